"""Scenario store: two pipeline workers sharing one Mooncake Store (a mooncake_master on
loopback); every image goes first to worker A and later to worker B, so half of all
items are cross-worker repeats. 4.8 MB images, a sim tower of 10 ms per image.

- store_tower_work_saved: (tower items of the same two workers, same images, without the
  store - tower items with it) / tower items without it. 0.5 is the ceiling (B encodes
  nothing); target >= 0.45.
- store_hit_latency_vs_local_miss: p50 latency of B's rooms (served from the store) /
  p50 latency of A's rooms (freshly encoded), one image at a time, the same run; target
  <= 0.5.

Each session's client numbers its rooms from 1 and makes room r's pixels from r alone
(harness/client.py), so B's rooms are A's images. B starts on a batch only once A's puts
of it have all finished (stored, failed or dropped): "later" means after the put."""
from __future__ import annotations

import os
import time

from benchmarks.harness.client import MIB
from benchmarks.harness.report import describe, print_ratio
from benchmarks.harness.session import Session
from benchmarks.scenarios.common import GRID, Bench

STORE_DEVICE_S = 10e-3  # sim device time per image
EMBEDDING_BYTES = (GRID[0] * GRID[1] * GRID[2] // 4) * 3584 * 2


def store(b: Bench) -> None:
    from pipeline.testing.store_master import StoreMaster

    n, trials = b.size("store")
    lat = b.latency_images // 2
    print(f"store: {GRID}, device {STORE_DEVICE_S * 1e3:.0f} ms/image (a sleep), two pipeline workers; "
          f"{lat} images one at a time to A then to B, then {trials} x {n} images, window "
          f"{b.args.window}, to A then to B; the same without the store", flush=True)
    key = os.path.join(b.tmp, "cache.key")
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    images = lat + trials * n
    plain = run_store_pair(b, "nostore", {"cache_key_file": key}, n, trials, lat)
    print(f"  without the store, ms p50 one image at a time: A {plain['A']['latency_ms']['p50']:.2f}, "
          f"B {plain['B']['latency_ms']['p50']:.2f}", flush=True)
    master = StoreMaster(os.path.join(b.tmp, "master.log"))
    try:
        shared = {"cache_key_file": key, "store_master": master.address,
                  "store_segment_bytes": (images + 16) * (EMBEDDING_BYTES + 4096), "store_buffer_bytes": 16 * MIB}
        with_store = run_store_pair(b, "store", shared, n, trials, lat)
    finally:
        master.close()
    for run, pair in (("nostore", plain), ("store", with_store)):
        for name, r in pair.items():
            b.raw[f"{run}_{name}_pipeline"] = r
            print(f"  {run}, worker {name}:\n{describe(r)}", flush=True)
    items = lambda pair: sum(r["stats"].get("tower_items", 0) for r in pair.values())  # noqa: E731
    without, with_ = items(plain), items(with_store)
    b_stats = with_store["B"]["stats"]
    print(f"  tower items: {without} without the store, {with_} with it; B's store lookups: "
          f"{b_stats.get('store_gets')}; A's puts: {with_store['A']['stats'].get('store_puts')}")
    print_ratio("store_tower_work_saved", without - with_, without, b.results, "d")
    hit, miss = with_store["B"]["latency_ms"]["p50"], with_store["A"]["latency_ms"]["p50"]
    print_ratio("store_hit_latency_vs_local_miss", hit, miss, b.results, ".2f",
                "   (ms p50, one image at a time: B served from the store / A encoding)")


def run_store_pair(b: Bench, tag: str, config: dict, n: int, trials: int, lat: int) -> dict:
    """Workers A and B (pipeline), alive together; each batch of images to A, A's puts
    finished, then the same batch to B."""
    sessions: dict[str, Session] = {}
    rooms = lat + trials * n
    try:
        for name in ("A", "B"):
            sessions[name] = Session("pipeline", f"{tag}_{name}", b.tmp, b.args, rooms=rooms, tower="sim",
                                     device_s=STORE_DEVICE_S, grids=(GRID,), config=config)
        a, bw = sessions["A"], sessions["B"]
        for s in (a, bw):
            wait_connected(s)
        a.latency(lat)
        wait_puts(a)
        bw.latency(lat)
        for _ in range(trials):
            a.trial(n, b.args.window)
            wait_puts(a)
            bw.trial(n, b.args.window)
        return {name: s.finish() for name, s in sessions.items()}
    finally:
        for s in sessions.values():
            s.close()


def wait_connected(s: Session, timeout: float = 60.0) -> None:
    if not s.cfg.store_master:
        return
    end = time.monotonic() + timeout
    while not s.worker("stats").get("store", {}).get("connected"):
        if time.monotonic() > end:
            raise RuntimeError(f"worker {s.prefix} did not reach the store's master")
        time.sleep(0.1)


def wait_puts(s: Session, timeout: float = 120.0) -> None:
    """Until every item A's tower encoded has been put, or failed or dropped."""
    if not s.cfg.store_master:
        return
    end = time.monotonic() + timeout
    while True:
        st = s.worker("stats")
        if sum(st.get("store_puts", {}).values()) >= st.get("tower_items", 0):
            return
        if time.monotonic() > end:
            raise RuntimeError(f"worker {s.prefix}'s puts did not finish: {st.get('store_puts')}")
        time.sleep(0.1)
