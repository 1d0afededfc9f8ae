"""Scenario load: images/s of both modes (cpu-bound settings) at each number of rooms
in flight of --load-windows (run.py bench plots them)."""
from __future__ import annotations

from benchmarks.harness.session import Session
from benchmarks.scenarios.common import CPU_DEVICE_S, GRID, Bench


def load(b: Bench) -> None:
    windows = [int(w) for w in b.args.load_windows.split(",")]
    n = b.args.images or (80 if b.quick else 150)
    b.results["load"] = load_sweep(b.tmp, b.args, windows, n)
    for mode, r in b.results["load"].pop("raw").items():
        b.raw[f"load_{mode}"] = r


def load_sweep(tmp: str, args, windows: list[int], n: int) -> dict:
    """images/s of both modes (cpu-bound settings) at each number of rooms in flight,
    alternating the modes at each point as run_pair does."""
    print(f"load: device {CPU_DEVICE_S * 1e3:.1f} ms/image, {n} images per point, rooms in flight "
          f"{windows}", flush=True)
    # steady_rate leaves out the first and last `window` completions of each point
    counts = [max(n, 4 * w) for w in windows]
    out = {"windows": windows, "images_per_point": counts, "inprocess": [], "pipeline": []}
    warm = 2 * max(windows)
    sessions: dict[str, Session] = {}
    try:
        for mode in ("inprocess", "pipeline"):
            sessions[mode] = Session(mode, f"load_{mode[:3]}", tmp, args, rooms=warm + sum(counts),
                                     tower="sim", device_s=CPU_DEVICE_S, grids=[GRID])
        for s in sessions.values():
            s.warmup(warm, max(windows))
        order = list(sessions.values())
        for k, w in enumerate(windows):
            for s in (order if k % 2 == 0 else order[::-1]):
                s.trial(counts[k], w)
                out[s.mode].append(s.res["trials"][-1]["images_per_s"])
            print(f"  {w:>3} in flight: inprocess {out['inprocess'][-1]:7.1f}, pipeline "
                  f"{out['pipeline'][-1]:7.1f} images/s (ratio "
                  f"{out['pipeline'][-1] / max(out['inprocess'][-1], 1e-9):.2f})", flush=True)
        out["raw"] = {mode: s.finish() for mode, s in sessions.items()}
    finally:
        for s in sessions.values():
            s.close()
    return out
