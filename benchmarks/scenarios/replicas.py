"""Scenario replicas: small images, a sim device time per image (a sleep, so it scales
on two cores too), batches of at most 4; images/s of the pipeline with two tower
replicas / with one, both workers alive together, trials alternating."""
from __future__ import annotations

from benchmarks.harness.report import describe, verdict
from benchmarks.harness.session import Session
from benchmarks.scenarios.common import REPLICAS_DEVICE_S, SMALL_GRID, Bench


def replicas(b: Bench) -> None:
    n, trials = b.size("replicas")
    print(f"replicas: {SMALL_GRID}, device {REPLICAS_DEVICE_S * 1e3:.0f} ms/image (a sleep), at most 4 "
          f"images per batch; the pipeline with 1 and with 2 tower replicas, {n} images x "
          f"{trials} trials each, window {b.args.window}", flush=True)
    pair = run_replicas(b.tmp, b.args, n=n, trials=trials, warmup=b.warmup)
    for k, r in pair.items():
        b.raw[f"replicas{k}_pipeline"] = r
        print(f"  tower_replicas {k}:\n{describe(r)}", flush=True)
    one, two = pair[1]["images_per_s"], pair[2]["images_per_s"]
    ratio = two / one
    b.results["replicas2_vs_one_device_bound"] = ratio
    b.results["replicas_device_ceiling_images_per_s"] = {k: k / REPLICAS_DEVICE_S for k in pair}
    print(f"replicas2_vs_one_device_bound = {two:.1f} / {one:.1f} = {ratio:.2f}  "
          f"{verdict('replicas2_vs_one_device_bound', ratio)}   (device ceilings "
          f"{1 / REPLICAS_DEVICE_S:.0f} and {2 / REPLICAS_DEVICE_S:.0f} images/s)", flush=True)


def run_replicas(tmp: str, args, *, n: int, trials: int, warmup: int) -> dict:
    """The pipeline with one tower replica and with two (replicas scenario), alive together,
    the measured runs alternating (ABBA...) as run_pair's."""
    sessions: dict[int, Session] = {}
    try:
        for k in (1, 2):
            sessions[k] = Session("pipeline", f"rep{k}", tmp, args, rooms=warmup + trials * n, tower="sim",
                                  device_s=REPLICAS_DEVICE_S, grids=(SMALL_GRID,),
                                  config={"tower_replicas": k, "max_items_per_batch": 4})
        for s in sessions.values():
            s.warmup(warmup, args.window)
        order = list(sessions.values())
        for t in range(trials):
            for s in (order if t % 2 == 0 else order[::-1]):
                s.trial(n, args.window)
        return {k: s.finish() for k, s in sessions.items()}
    finally:
        for s in sessions.values():
            s.close()
