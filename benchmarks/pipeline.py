#!/usr/bin/env python3
"""The multi-process pipeline against the in-process worker, same workload, same run.

    .venv/bin/python benchmarks/pipeline.py [--quick] [--json PATH]

Each scenario is a module of benchmarks/scenarios/; the client and worker processes,
the baselines and the report they share are in benchmarks/harness/.

Workload: distinct images (no cache hits), each a (1, 32, 32) grid of float32
patches of 1176 values (4.8 MB of pixels to take in and hash), passed in
shared-memory segments (the Client default); the sim tower makes 256 rows of
hidden 3584 bfloat16 (1.835 MB) per image, which the sender writes over Mooncake
TCP on loopback into the receiver's memory.

Each mode and scenario gets a fresh worker (its own shm prefix ``bench_...``) in a
spawned worker process, started as pipeline/testing's start_worker does: the
``InProcessWorker`` serving in a thread (inprocess, like ``run.py serve``) or the
``Supervisor`` and its stage processes (pipeline). The gateway and the prefill
receiver run together in a spawned *client* process per worker: it publishes the
pixels, sends the encode messages, allocs each room's item as it announces it,
keeps a window of rooms in flight and takes the times. This process only
orchestrates and samples memory, so nothing of the benchmark's shares a GIL with
the in-process worker. The two modes of a scenario are alive together (one idle
while the other is measured): warm-up each, then the latency samples in
alternating blocks of 25 and the measured runs alternating (A B B A ...), so a
change in the shared machine's load meets both. Pixels of a measured run are
published before its clock starts: the gateway's copies are not the worker's
cost, and on two cores they would take a large share of the CPU from either mode.

Figures (each a ratio against a baseline measured in the same run; two hold a
target, pipeline_vs_device_bound and replicas2_vs_one_device_bound; the targets of
the others were withdrawn: they are measured, printed with "(no target)" and written
as before, and never MISSED):
- pipeline_vs_inprocess_throughput (scenario cpu-bound, device time 0.2 ms per
  image): images/s of the pipeline / images/s of the in-process worker.
  small_pipeline_vs_inprocess_throughput: the same in scenario small (grid 1x4x4:
  75 KB of pixels, 4 rows = 28 KB out, device time 0.02 ms per image). Each prints
  the ceiling: all cores busy at the in-process CPU cost per image.
- pipeline_cpu_per_image_vs_inprocess, small_...: CPU per image of every process
  (worker and client, user+system) of the pipeline / of the in-process worker,
  best trials (the worker-only ratio is printed too).
- added_latency_vs_hop_floor: p50 of per-image latency (encode sent -> success
  status at the receiver, one image in flight) of the pipeline minus the
  in-process worker's (added_latency_ms_p50), cpu-bound settings, / (ring hops on
  a fresh encode's critical path, FRESH_ENCODE_PATH checked against
  pipeline/runtime/wiring.py's EDGES, x the p50 one-way wake of a process asleep on a bare
  semaphore: benchmarks/ring.py's measurement, run while both workers are up and
  idle). small_added_latency_vs_hop_floor: the same, small.
- intake_cpu_vs_raw_read: the intake stage process's CPU per image (best
  cpu-bound trial) / the CPU per image of one process that opens a segment made
  as the gateway makes it, preadv's it into a resident buffer, unlinks and closes
  it. small_intake_cpu_vs_raw_read: the same, small.
  The intake stage also hashes the pixels as it reads them (the cache's key, once
  read by the cache stage again): intake_cpu_vs_raw_read_and_hash divides by the same
  floor with each piece hashed as it lands (no target).
- pipeline_vs_device_bound (scenario device-bound: device time per image = 3x the
  in-process CPU cost per image, that cost = 1/throughput - device time from the
  cpu-bound in-process run): images/s of the pipeline / 1 / device time.
  Target >= 0.97. The in-process worker's figure there is reported too.
- replicas2_vs_one_device_bound (scenario replicas: small images, sim device time
  10 ms per image, a sleep, so it scales on two cores too; batches of at most 4):
  images/s of the pipeline with two tower replicas / with one, both workers alive
  together, trials alternating. Target >= 1.8.
- tiny_pipeline_vs_tower_alone: images/s of the pipeline with the tiny Qwen2.5-VL
  tower (grid (1, 16, 16)) / the same tower's forward alone (built as the tower
  stage builds it, start(...).result() one batch after another, outs registered
  as the embedding arena is) on the batches the scheduler forms from the same
  images all waiting, in one process. In-process / tower alone
  is printed too, and tiny_tower_alone_busy_neighbour_vs_alone: the tower alone
  while another process spins a Python loop, / alone (no target: what any work
  on the other core costs the forward on this machine; the pipeline's other
  stages are such work).
- tokenspeed_front_vs_native_throughput (scenario tokenspeed, cpu-bound's images and
  device time): images/s of a pipeline worker fed through the tokenspeed fronts (a
  gateway on smg's gRPC stubs, pixels in its own shared-memory segments; a prefill
  rank speaking tokenspeed's frames and status frames) / of one fed natively, both
  alive together, trials alternating ABBA; the median over rounds of the round's
  ratio. Target >= 0.95.
  tokenspeed_front_cpu_per_image_vs_native: CPU per image of every process, the
  same way (no target).
- store_tower_work_saved, store_hit_latency_vs_local_miss (scenario store, not by
  default: benchmarks/scenarios/store.py): two pipeline workers sharing a Mooncake
  Store, every image to worker A then to worker B; the share of tower items the store
  saved against the same run without it (target >= 0.45, 0.5 the ceiling), and the p50
  latency of a room B serves from the store / of a room A encodes (target <= 0.5).
- peak resident memory of each worker's process tree (for the pipeline, the
  supervisor and every stage), sampled at 10 Hz as a sum of RSS (a shared page
  counts in every process that maps it); PSS (each shared page split among its
  mappers) is read at phase ends. The arenas' pages count once touched.

Throughput is the steady rate: a least-squares slope of completions against time,
the first and last `window` (default 64) completions left out (fill and drain);
each mode runs `trials` measured runs after a warm-up of 2 x window images and the
best (least disturbed: the machine is shared) counts; every trial, its end-to-end
rate and the CPU per image of every process (user+system, from /proc; for the
in-process worker split into its loop thread and its other threads, Mooncake's
and zmq's) are in the JSON under "raw". The tiny tower runs with one torch
intra-op thread in both modes (--torch-threads): two OpenMP threads on two cores
shared with the other processes stall for seconds at a time (identical runs gave
16 to 318 images/s).

Exit status: 0, also when a target is missed (MISSED is printed); 1 if a room
failed or timed out, the receiver saw a protocol violation, or a scenario failed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# First, whatever PYTHONPATH says: this file's own folder (sys.path[0]) would otherwise
# make `pipeline` this script rather than the package.
sys.path.insert(0, ROOT)

from benchmarks.harness.baselines import FRESH_ENCODE_PATH, hops_on_fresh_path  # noqa: E402
from benchmarks.harness.report import judge, write_json  # noqa: E402
from benchmarks.harness.session import HIDDEN  # noqa: E402
from benchmarks.scenarios import SCENARIOS  # noqa: E402
from benchmarks.scenarios.common import GRID, SMALL_GRID, Bench, image_bytes  # noqa: E402


def parse_args(argv) -> tuple[argparse.Namespace, set]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer images (under ~4 minutes)")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--window", type=int, default=64, help="rooms in flight at the receiver")
    ap.add_argument("--scenarios", default="cpu,small,device,tiny,replicas,tokenspeed",
                    help="comma-separated subset of cpu, small, device, tiny, replicas, tokenspeed (device needs "
                         "cpu), and, not by default: load: images/s of both modes at each of --load-windows "
                         "rooms in flight; store: two workers sharing a Mooncake Store; vllm: the worker as "
                         "vLLM's encoder against vLLM's own (needs .venv-vllm); media: compressed JPEGs "
                         "against pixels and against Hugging Face's processor")
    ap.add_argument("--load-windows", default="1,2,4,8,16,32,64",
                    help="rooms in flight for the load scenario (default %(default)s; at most --window)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--images", type=int, help="measured images per trial (overrides the defaults)")
    ap.add_argument("--trials", type=int, help="measured runs per mode (overrides the defaults)")
    ap.add_argument("--pixel-arena-mib", type=int, default=512)
    ap.add_argument("--embedding-arena-mib", type=int, default=256)
    ap.add_argument("--arena-cache-mib", type=int, default=8)
    ap.add_argument("--host-cache-mib", type=int, default=64)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="intra-op threads of the tiny Qwen tower, both modes (0: torch's default)")
    args = ap.parse_args(argv)
    scenarios = set(args.scenarios.split(","))
    if "device" in scenarios:
        scenarios.add("cpu")
    windows = [int(w) for w in args.load_windows.split(",")]
    if "load" in scenarios and max(windows) > args.window:
        ap.error(f"--load-windows: {max(windows)} is more than --window {args.window}")
    return args, scenarios


def header(args, hops: int) -> dict:
    """The run's settings and sizes, first in the JSON."""
    return {"quick": args.quick, "window": args.window, "image_bytes": image_bytes(GRID),
            "embedding_bytes": (GRID[1] * GRID[2] // 4) * HIDDEN * 2,
            "small_image_bytes": image_bytes(SMALL_GRID),
            "small_embedding_bytes": (SMALL_GRID[1] * SMALL_GRID[2] // 4) * HIDDEN * 2,
            "hops_on_fresh_encode_path": hops, "fresh_encode_path": list(FRESH_ENCODE_PATH),
            "cpu_count": os.cpu_count()}


def memory(b: Bench) -> None:
    """Peak resident memory of each mode's worker side, over every run, and of each run."""
    peak, peak_pss = {}, {}
    for key, r in b.raw.items():
        for mode in ("inprocess", "pipeline"):
            if key.endswith(mode):
                peak[mode] = max(peak.get(mode, 0.0), r["peak_rss_mib"])
                peak_pss[mode] = max(peak_pss.get(mode, 0.0), r["peak_pss_mib"])
    b.results["peak_rss_mib"] = peak
    b.results["peak_pss_mib"] = peak_pss
    b.results["peak_rss_mib_by_run"] = {k: r["peak_rss_mib"] for k, r in b.raw.items()}
    b.results["peak_pss_mib_by_run"] = {k: r["peak_pss_mib"] for k, r in b.raw.items()}
    print("peak resident memory, worker side (sum of RSS / PSS), MiB: " + ", ".join(
        f"{k} {r['peak_rss_mib']:.0f}/{r['peak_pss_mib']:.0f}" for k, r in b.raw.items()))


def finish(b: Bench, t_start: float) -> int:
    """Memory, failures and targets into the results, the summary printed, the JSON
    written; the exit status."""
    results, raw = b.results, b.raw
    memory(b)
    failed = sum(r["failed_rooms"] + r["timed_out"] for r in raw.values())
    violations = sum(r["n_violations"] for r in raw.values())
    results["failed_rooms"] = failed
    results["violations"] = violations
    summary = judge(results)
    results["seconds"] = time.monotonic() - t_start
    results["raw"] = raw
    print(f"{summary}  ({results['seconds']:.0f} s)")
    if failed or violations:
        print(f"FAILED rooms: {failed}, receiver protocol violations: {violations}")
        for key, r in raw.items():
            if r["failed_rooms"] or r["n_violations"] or r["timed_out"]:
                print(f"  {key}: {r['failed_rooms']} failed {r['failed_reasons']}, {r['timed_out']} "
                      f"timed out, violations {r['violations'][:3]}")
    write_json(b.args.json, results)
    if results.get("error"):
        print(f"FAILED: {results['error']}")
    return 0 if not failed and not violations and not results.get("error") else 1


def main(argv=None) -> int:
    args, scenarios = parse_args(argv)

    def on_term(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    hops = hops_on_fresh_path()
    tmp = tempfile.mkdtemp(prefix="epd-bench-")
    t_start = time.monotonic()
    b = Bench(args, tmp, hops, header(args, hops))
    try:
        for name, run in SCENARIOS.items():
            if name in scenarios:
                run(b)
    except Exception as e:  # the figures measured so far still go to the JSON
        traceback.print_exc()
        b.results["error"] = f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return finish(b, t_start)


if __name__ == "__main__":
    sys.exit(main())
