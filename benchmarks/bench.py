#!/usr/bin/env python3
"""Every benchmark in one run, a JSON of all their figures and a PNG plot beside it.

    python run.py bench [--quick] [--json PATH] [--only ring,transfer,pipeline]

Runs benchmarks/ring.py, benchmarks/transfer.py and benchmarks/pipeline.py (each in
its own process, each printing its figures as ratios against its own baseline);
pipeline.py with every scenario (cpu-bound, small, device-bound, tiny Qwen, replicas) and its
load scenario too: both modes of the worker (sim tower, cpu-bound settings)
measured at each number of rooms in flight (1, 2, 4, ... 64). The PNG (PATH with
.png) shows images/s of both modes against rooms in flight, the one-at-a-time
latency percentiles of both modes (4.8 MB and small images), and images/s of both
modes in each scenario.

Exit status: 0 when every benchmark ran (a missed target is printed, not an error);
1 when one failed (a failed room, a protocol violation, a crash).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PARTS = ("ring", "transfer", "pipeline")
PIPELINE_SCENARIOS = "cpu,small,device,tiny,replicas,load"  # every scenario of benchmarks/pipeline.py


def run_script(name: str, extra: list[str], out_dir: str) -> tuple[int, dict]:
    """One benchmark script in its own process; its exit status and JSON."""
    path = os.path.join(out_dir, f"{name}.json")
    cmd = [sys.executable, os.path.join(HERE, f"{name}.py"), "--json", path, *extra]
    print(f"\n== {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd[1:])}",
          flush=True)
    rc = subprocess.call(cmd, cwd=ROOT)
    result = {}
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    return rc, result


def plot(results: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.2))
    load = (results.get("pipeline") or {}).get("load")
    if load:
        for mode, style in (("inprocess", "o-"), ("pipeline", "s-")):
            ax1.plot(load["windows"], load[mode], style, label=f"--mode {mode}")
        ax1.set_xscale("log", base=2)
        ax1.set_xticks(load["windows"], [str(w) for w in load["windows"]])
        ax1.legend()
    ax1.set_xlabel("rooms in flight")
    ax1.set_ylabel("images/s")
    ax1.set_title("Throughput against load (sim tower, cpu-bound)")
    ax1.grid(alpha=0.3)
    raw = (results.get("pipeline") or {}).get("raw", {})
    qs = ("p50", "p90", "p99")
    series = [(f"{scen}_{mode}", f"{label}, --mode {mode}") for scen, label in (("cpu_bound", "4.8 MB"),
                                                                               ("small", "small"))
              for mode in ("inprocess", "pipeline") if raw.get(f"{scen}_{mode}", {}).get("latency_ms")]
    width = 0.8 / max(1, len(series))
    for k, (key, label) in enumerate(series):
        lat = raw[key]["latency_ms"]
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(qs))]
        ax2.bar(xs, [lat[q] for q in qs], width, label=label)
    ax2.set_xticks(range(len(qs)), qs)
    ax2.set_ylabel("ms, encode sent -> success at the receiver")
    ax2.set_title("Latency, one image in flight")
    if series:
        ax2.legend(fontsize=8)
    ax2.grid(axis="y", alpha=0.3)
    scenarios = [(scen, label) for scen, label in (("cpu_bound", "4.8 MB"), ("small", "small"),
                                                   ("device_bound", "device-bound"), ("tiny_qwen", "tiny Qwen"))
                 if any(raw.get(f"{scen}_{m}", {}).get("images_per_s") for m in ("inprocess", "pipeline"))]
    for k, mode in enumerate(("inprocess", "pipeline")):
        xs = [i + (k - 0.5) * 0.38 for i in range(len(scenarios))]
        ax3.bar(xs, [raw.get(f"{scen}_{mode}", {}).get("images_per_s", 0.0) for scen, _ in scenarios], 0.38,
                label=f"--mode {mode}")
    ax3.set_xticks(range(len(scenarios)), [label for _, label in scenarios])
    ax3.set_yscale("log")
    ax3.set_ylabel("images/s (best trial)")
    ax3.set_title("Throughput by scenario")
    if scenarios:
        ax3.legend()
    ax3.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="run.py bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="the benchmarks' quick sizes and a shorter load sweep (about 12 minutes on 2 cores)")
    ap.add_argument("--json", metavar="PATH", default="bench-results/bench.json",
                    help="where to write every figure (default: %(default)s); the plot goes to PATH with .png")
    ap.add_argument("--only", default=",".join(PARTS),
                    help=f"comma-separated subset of {', '.join(PARTS)} (default: all)")
    args = ap.parse_args(argv)
    parts = [p for p in args.only.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--only: unknown part(s) {bad}; choose from {', '.join(PARTS)}")
    json_path = os.path.abspath(args.json)
    png_path = os.path.splitext(json_path)[0] + ".png"
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    out_dir = os.path.dirname(json_path)
    t0 = time.monotonic()
    results: dict = {"quick": args.quick, "parts": parts}
    failures = []
    quick = ["--quick"] if args.quick else []
    extra = {"ring": quick, "transfer": quick,
             "pipeline": quick + ["--scenarios", PIPELINE_SCENARIOS]
             + (["--load-windows", "1,4,16,64"] if args.quick else [])}
    for name in PARTS:
        if name in parts:
            rc, results[name] = run_script(name, extra[name], out_dir)
            if rc:
                failures.append(f"{name}.py exited {rc}")
    results["seconds"] = time.monotonic() - t0
    results["failures"] = failures
    with open(json_path, "w") as f:
        json.dump(results, f, indent=2)
    plot(results, png_path)
    print(f"\nwrote {json_path} and {png_path} ({results['seconds']:.0f} s)")
    for name in ("ring", "transfer", "pipeline"):
        r = results.get(name) or {}
        figs = {k: v for k, v in r.items() if isinstance(v, (int, float)) and ("_vs_" in k or k.startswith("added"))}
        if figs:
            print(f"  {name}: " + ", ".join(f"{k} = {v:.2f}" for k, v in figs.items()))
    if failures:
        print("FAILED: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
