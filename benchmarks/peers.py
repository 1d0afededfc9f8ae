#!/usr/bin/env python3
"""The worker against the encoders the engines ship, in one run, on the same tiny
seeded checkpoints, the same images and the same machine.

    .venv/bin/python benchmarks/peers.py [--quick] [--json PATH] [--only vllm,tokenspeed]

vLLM (in .venv-vllm, scripts/setup_vllm.sh; benchmarks/scenarios/peers_vllm.py): a
tiny random-weight Qwen2.5-VL served by
  (a) vLLM with its own encoder: the reference every other answer is checked against;
  (b) vLLM with the worker as its encoder (EPDConnector), `run.py proxy` in front;
  (c) vLLM's own encoder disaggregation: an `ec_producer` (encoder-only) instance and
      an `ec_consumer` instance joined by vLLM's ECExampleConnector (safetensors in a
      shared folder), the client sending each request to one, then the other.
tokenspeed (in .venv-tokenspeed; benchmarks/scenarios/peers_tokenspeed.py): the same
tower behind
  (d) tokenspeed's own encode worker, and
  (e) the worker behind its tokenspeed fronts,
each driven by tokenspeed's own prefill code and a gateway stub.

Images: four sizes up to 448 x 448, every fourth a repeat of an earlier one. Figures:
time to first token (vLLM) or encode latency (tokenspeed) p50 and p99 one request at a
time, the paths taking turns; images/s at 4 and 16 in flight, one path after the other.
Every answer is checked against the local reference: the same first token, its five
most likely tokens' log-probabilities within 0.01; a mismatch fails the run (exit 1).
The ratios (ours / theirs), each with its target, are printed and written to the JSON:
peers_vllm_ttft_vs_own_disagg, peers_vllm_throughput_vs_own_disagg (and _16),
peers_vllm_ttft_vs_local, peers_tokenspeed_throughput_vs_own (and _16),
peers_tokenspeed_latency_vs_own.

Exit status: 0 when every part ran and every answer matched (a missed target is
printed, not an error); 1 otherwise.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# benchmarks/pipeline.py would shadow the package of that name
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") not in (HERE, ROOT)]

from benchmarks.scenarios.peers_common import TARGETS, verdict  # noqa: E402

PYTHONS = {"vllm": os.path.join(ROOT, ".venv-vllm", "bin", "python"),
           "tokenspeed": os.path.join(ROOT, ".venv-tokenspeed", "bin", "python")}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer images (a few minutes)")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--only", default="vllm,tokenspeed", help="comma-separated subset of vllm, tokenspeed")
    ap.add_argument("--images", type=int, help="images one at a time, per path (overrides the defaults)")
    ap.add_argument("--in-flight", default="4,16", help="requests in flight for images/s (default %(default)s)")
    ap.add_argument("--worker-mode", choices=("pipeline", "inprocess"), default="pipeline",
                    help="the worker's mode (default %(default)s)")
    ap.add_argument("--tower-threads", type=int, default=1,
                    help="the worker's tower_threads (default %(default)s; 0: one per CPU)")
    ap.add_argument("--tower-replicas", type=int, default=1,
                    help="the worker's tower_replicas beside vLLM (default %(default)s: its model runner "
                         "takes a core of its own)")
    ap.add_argument("--ts-tower-replicas", type=int, default=2,
                    help="the worker's tower_replicas on the tokenspeed side (default %(default)s); tokenspeed's "
                         "encode worker, which has one tower, gets this many times the torch threads")
    ap.add_argument("--queue-spin-s", type=float, default=0.0,
                    help="EPDConnector's queue_spin_s (default %(default)s; -1: vLLM's own spin)")
    ap.add_argument("--tower-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the worker's tower_dtype (default %(default)s)")
    ap.add_argument("--profile", action="store_true",
                    help="instead of the comparison: where a request through the worker spends its time (vLLM side)")
    ap.add_argument("--part", choices=tuple(PYTHONS), help=argparse.SUPPRESS)  # one side, in its own venv
    args = ap.parse_args(argv)
    args.in_flight = [int(k) for k in args.in_flight.split(",")]
    args.queue_spin_s = None if args.queue_spin_s < 0 else args.queue_spin_s
    return args


def run_part(name: str, argv: list[str], tmp: str) -> tuple[int, dict]:
    python = PYTHONS[name]
    if not os.path.exists(python):
        raise RuntimeError(f"the {name} side needs {python}")
    out = os.path.join(tmp, f"{name}.json")
    cmd = [python, os.path.abspath(__file__), *argv, "--part", name, "--json", out]
    env = dict(os.environ, PYTHONPATH=ROOT)
    if name == "tokenspeed":
        # as tests/integrations/test_tokenspeed_prefill.py runs tokenspeed: Mooncake over TCP (no RDMA
        # device here), its libraries found
        site = glob.glob(os.path.join(ROOT, ".venv-tokenspeed", "lib", "python3*", "site-packages"))
        env.update(MC_FORCE_TCP="1", LD_LIBRARY_PATH=os.pathsep.join(
            [os.path.join(ROOT, ".venv-tokenspeed")] + [os.path.join(s, "nvidia", "cu13", "lib") for s in site]))
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    result = {}
    if os.path.exists(out):
        with open(out) as f:
            result = json.load(f)
    return rc, result


def ratio(results: dict, key: str, num: float, den: float, unit: str) -> None:
    value = num / den
    results[key] = value
    print(f"{key} = {num:.2f} {unit} / {den:.2f} {unit} = {value:.2f}  {verdict(key, value)}", flush=True)


def report_vllm(r: dict, results: dict) -> None:
    if "profile_ms" in r:
        print(f"vLLM side, a request through the worker ({r['worker_mode']}, tower_threads {r['tower_threads']}), "
              "one at a time, ms p50 / p99:")
        for step, p in r["profile_ms"].items():
            print(f"  {step:16s} {p['p50']:8.1f} / {p['p99']:8.1f}", flush=True)
        return
    ttft, ips = r["ttft_ms"], r["images_per_s"]
    print("vLLM, TTFT ms one at a time (p50 / p99), images/s at " + ", ".join(ips) + " in flight:")
    for path, label in (("local", "(a) vLLM local encoder"), ("ours", "(b) worker + EPDConnector"),
                        ("theirs", "(c) vLLM ec_producer + ec_consumer")):
        print(f"  {label:36s} {ttft[path]['p50']:8.1f} / {ttft[path]['p99']:8.1f}   "
              + "   ".join(f"{ips[k][path]:6.2f}" for k in ips), flush=True)
    for k, by_path in r.get("cpu_ms_per_image", {}).items():
        print(f"  CPU ms per image at {k} in flight: " + "; ".join(
            f"{path} " + ", ".join(f"{name} {ms:.1f}" for name, ms in sorted(cpu.items(), key=lambda x: -x[1]))
            for path, cpu in by_path.items()), flush=True)
    ratio(results, "peers_vllm_ttft_vs_own_disagg", ttft["ours"]["p50"], ttft["theirs"]["p50"], "ms")
    ratio(results, "peers_vllm_ttft_vs_local", ttft["ours"]["p50"], ttft["local"]["p50"], "ms")
    for k in ips:
        key = "peers_vllm_throughput_vs_own_disagg" + ("" if k == "4" else f"_{k}")
        if key in TARGETS:
            ratio(results, key, ips[k]["ours"], ips[k]["theirs"], "images/s")


def report_tokenspeed(r: dict, results: dict) -> None:
    lat, ips = r["latency_ms"], r["images_per_s"]
    print("tokenspeed, encode latency ms one at a time (p50 / p99), images/s at " + ", ".join(ips) + " in flight:")
    for path, label in (("theirs", "(d) tokenspeed's encode worker"), ("ours", "(e) worker behind the fronts")):
        print(f"  {label:36s} {lat[path]['p50']:8.1f} / {lat[path]['p99']:8.1f}   "
              + "   ".join(f"{ips[k][path]:6.2f}" for k in ips), flush=True)
    ratio(results, "peers_tokenspeed_latency_vs_own", lat["ours"]["p50"], lat["theirs"]["p50"], "ms")
    for k in ips:
        key = "peers_tokenspeed_throughput_vs_own" + ("" if k == "4" else f"_{k}")
        if key in TARGETS:
            ratio(results, key, ips[k]["ours"], ips[k]["theirs"], "images/s")


def check_line(name: str, check: dict) -> str:
    if "rooms" in check:
        return f"{name} rows against the tower run alone: " + ", ".join(
            f"{p} {c['rooms'] - c['wrong'] - c['failed']}/{c['rooms']} match (max |d| {c['rows_max_abs_diff']:.3g})"
            for p, c in check["rooms"].items()) + ("" if check["ok"] else "  MISMATCH")
    return f"{name} answers against {check['reference']}: " + ", ".join(
        f"{p} {c['answers'] - c['wrong']}/{c['answers']} match (max |dlogprob| {c['logprob_max_abs_diff']:.3g})"
        for p, c in check["paths"].items() if p != check["reference"]) + ("" if check["ok"] else "  MISMATCH")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part == "vllm":
        from benchmarks.scenarios import peers_vllm
        return peers_vllm.main(args)
    if args.part == "tokenspeed":
        from benchmarks.scenarios import peers_tokenspeed
        return peers_tokenspeed.main(args)
    argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    if "--json" in argv:
        i = argv.index("--json")
        del argv[i:i + 2]
    argv = [a for a in argv if not a.startswith("--json=")]
    t0 = time.monotonic()
    results: dict = {"quick": args.quick, "cpu_count": os.cpu_count(), "failures": []}
    with tempfile.TemporaryDirectory(prefix="epd-peers-") as tmp:
        for name, report in (("vllm", report_vllm), ("tokenspeed", report_tokenspeed)):
            if name not in args.only.split(","):
                continue
            print(f"== {name}", flush=True)
            try:
                rc, r = run_part(name, argv, tmp)
            except Exception as e:
                rc, r = 1, {"error": f"{type(e).__name__}: {e}"}
            results[name] = r
            if "check" in r and not args.profile:
                print(check_line(name, r["check"]), flush=True)
            if rc or "check" not in r:
                results["failures"].append(f"{name}: exit {rc} {r.get('error', '')}".strip())
            if "check" in r:
                report(r, results)
    for key, (op, bound, what) in TARGETS.items():
        results.setdefault(key, None)
    results["targets"] = {k: (None if t[0] is None else f"{t[0]} {t[1]}") for k, t in TARGETS.items()}
    results["seconds"] = time.monotonic() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if results["failures"]:
        print("FAILED: " + "; ".join(results["failures"]))
    print(f"({results['seconds']:.0f} s)")
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
