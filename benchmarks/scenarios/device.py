"""Scenario device (device-bound): device time per image DEVICE_FACTOR x the in-process
CPU cost per image of the cpu-bound run; images/s of each mode against 1 / device time."""
from __future__ import annotations

from benchmarks.harness.report import describe, verdict
from benchmarks.harness.session import run_pair
from benchmarks.scenarios.common import CPU_DEVICE_S, DEVICE_FACTOR, GRID, Bench


def device(b: Bench) -> None:
    n, trials = b.size("device")
    inp = b.raw["cpu_bound_inprocess"]
    cost = max(1e-4, 1.0 / inp["images_per_s"] - CPU_DEVICE_S)
    device_s = DEVICE_FACTOR * cost
    ceiling = 1.0 / device_s
    b.results["inprocess_cpu_ms_per_image"] = cost * 1000
    b.results["device_bound_device_ms_per_image"] = device_s * 1000
    b.results["device_bound_ceiling_images_per_s"] = ceiling
    print(f"device-bound: in-process CPU cost {cost * 1e3:.2f} ms/image -> device "
          f"{device_s * 1e3:.2f} ms/image, ceiling {ceiling:.1f} images/s; {n} images x "
          f"{trials} trials per mode", flush=True)
    pair = run_pair("dev", b.tmp, b.args, modes=("pipeline", "inprocess"), device_s=device_s, grids=(GRID,), n=n,
                    trials=trials, warmup=b.warmup)
    for mode, r in pair.items():
        b.raw[f"device_bound_{mode}"] = r
        print(describe(r), flush=True)
    pip, inp = b.raw["device_bound_pipeline"], b.raw["device_bound_inprocess"]
    ratio = pip["images_per_s"] / ceiling
    b.results["pipeline_vs_device_bound"] = ratio
    b.results["inprocess_vs_device_bound"] = inp["images_per_s"] / ceiling
    print(f"pipeline_vs_device_bound = {pip['images_per_s']:.1f} / {ceiling:.1f} = {ratio:.2f}  "
          f"{verdict('pipeline_vs_device_bound', ratio)}   (inprocess: "
          f"{b.results['inprocess_vs_device_bound']:.2f}, no target)", flush=True)
