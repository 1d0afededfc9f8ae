#!/usr/bin/env python3
"""The EPD encode worker.

  python run.py                 the main job: the pipeline with its embedded defaults
                                (tiny Qwen2.5-VL tower, Mooncake TCP on loopback), a
                                receiver in its own process and a synthetic workload;
                                prints progress, per-room results and a summary
  python run.py serve [flags]   serve until SIGTERM/SIGINT (exit 0 after draining; a
                                second signal skips the drain)

--mode pipeline (the default) runs every stage in its own process under a
supervisor; --mode inprocess runs the same stages in one process and one loop.

Exit codes: 0 success; 1 the demo saw a failed room or a protocol violation, or
a stage kept dying (restart limit); 2 bad configuration or flags; 3 the worker
could not start.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import signal
import sys
import threading
import time

from pipeline.config import ConfigError, WorkerConfig, add_flags, from_args
from pipeline.running import free_port

MODES = ["pipeline", "inprocess"]


# ---------------------------------------------------------------- serve
def serve(cfg: WorkerConfig, mode: str) -> int:
    if mode == "pipeline":
        from pipeline.supervisor import PipelineError, run_pipeline

        try:
            return run_pipeline(cfg)
        except PipelineError as e:
            print(f"error: the worker could not start: {e}", file=sys.stderr)
            return 3
    from pipeline.worker import Worker

    try:
        worker = Worker(cfg)
    except Exception as e:
        print(f"error: the worker could not start: {e}", file=sys.stderr)
        return 3
    stop = threading.Event()
    signals = []

    def on_signal(signum, _frame):
        signals.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"serving: intake {worker.cfg.intake}  bootstrap {worker.cfg.bootstrap}  "
          f"mooncake session {worker.engine.session}  tower {worker.spec.name}", flush=True)
    try:
        worker.serve(stop)
        # A second signal, before or during the drain, skips (the rest of) it.
        worker.drain(cfg.drain_timeout_s, cut_short=lambda: len(signals) > 1)
    finally:
        worker.close()
    print("stopped", flush=True)
    return 0


# ---------------------------------------------------------------- demo
def _receiver_main(bootstrap: str, conn) -> None:
    """The prefill side: allocs for each room it is told of, then reports what arrived."""
    import hashlib

    from pipeline.receiver import Receiver

    r = Receiver("demo-prefill", bootstrap)
    conn.send(("ready", r.engine.session))
    pending: dict[int, int] = {}
    while True:
        while conn.poll(0):
            msg = conn.recv()
            if msg is None:
                r.close()
                return
            room, spans, spec = msg
            for i, span in enumerate(spans):
                r.alloc(room, i, span=span, **spec)
            pending[room] = len(spans)
        r.poll(0.01)
        for room, n in list(pending.items()):
            if r.concluded(room, n):
                del pending[room]
                if room in r.failed:
                    conn.send((room, "failed", r.failed[room], ""))
                else:
                    digest = hashlib.sha1()
                    for i in range(n):
                        main, deep = r.rows(room, i)
                        digest.update(main.tobytes())
                        if deep is not None:
                            digest.update(deep.tobytes())
                    conn.send((room, "success", "", digest.hexdigest()[:12]))
                r.release(room)
        if r.violations:
            conn.send(("violations", r.violations))
            r.violations = []


def _progress(results: dict, total: int, elapsed: float) -> None:
    ok = sum(1 for r in results.values() if r[0] == "success")
    print(f"\r  rooms {len(results)}/{total}  ok {ok}  failed {len(results) - ok}  "
          f"{len(results) / max(elapsed, 1e-9):6.1f} rooms/s", end="", file=sys.stderr, flush=True)


def _workload(patch_dim: int, merge: int):
    """Images of several sizes, some repeated, a multi-item room and a video."""
    import numpy as np

    from pipeline.client import Item

    grids = [(1, 8, 8), (1, 16, 16), (1, 12, 20), (1, 24, 16), (1, 32, 32)]
    rng = np.random.default_rng(0)
    pool = [rng.standard_normal((g[0] * g[1] * g[2], patch_dim), dtype=np.float32) for g in grids]
    rooms = []
    for k in range(40):
        g = k % len(grids) if k % 4 else (k // 4) % len(grids)   # every 4th repeats an earlier image
        items = [Item("image", [list(grids[g])], pool[g])]
        if k == 7:
            items.append(Item("image", [list(grids[0])], pool[0] + 1))
        if k == 11:
            t = (2, 8, 8)
            items = [Item("video", [list(t)], rng.standard_normal((128, patch_dim), dtype=np.float32))]
        rooms.append(items)
    return rooms


def demo(cfg: WorkerConfig, mode: str) -> int:
    from pipeline.client import Client
    from pipeline.running import Running

    try:
        worker = Running(cfg, mode)
    except Exception as e:
        print(f"error: the worker could not start: {e}", file=sys.stderr)
        return 3
    spec = worker.spec
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    rx = ctx.Process(target=_receiver_main, args=(worker.cfg.bootstrap, child), daemon=True)
    rx.start()
    results, violations = {}, []
    try:
        if not parent.poll(60):
            raise RuntimeError("the receiver process did not start")
        parent.recv()
        time.sleep(0.2)  # let its register reach the worker before the first alloc
        client = Client(worker.cfg.intake, cfg.shm_prefix)
        workload = _workload(spec.patch_dim, spec.merge)
        alloc_spec = dict(hidden=spec.hidden, dtype=spec.dtype, deepstack_width=spec.deepstack_width)
        sent_at = {}
        print(f"demo: {len(workload)} rooms through the {spec.name} tower "
              f"(hidden {spec.hidden}, {spec.dtype}), mode {mode}", flush=True)
        t0 = time.monotonic()
        end = t0 + 300
        wave = 10  # in waves, so that later waves find earlier images in the cache
        for first in range(0, len(workload), wave):
            for n in range(first, min(first + wave, len(workload))):
                items, room = workload[n], 1 + n
                spans = [sum(t * h * w for t, h, w in it.grid_thw) // spec.merge ** 2 for it in items]
                parent.send((room, spans, alloc_spec))
                sent_at[room] = time.monotonic()
                client.encode(room, f"demo-{room}", items)
            while len(results) < min(first + wave, len(workload)) and time.monotonic() < end:
                if parent.poll(0.5):
                    msg = parent.recv()
                    if msg[0] == "violations":
                        violations.extend(msg[1])
                        continue
                    room, state, reason, digest = msg
                    results[room] = (state, reason, digest, time.monotonic() - sent_at[room])
                    _progress(results, len(workload), time.monotonic() - t0)
        elapsed = time.monotonic() - t0
        client.close()
        parent.send(None)
    finally:
        rx.join(10)
        if rx.is_alive():
            rx.kill()
        stats = worker.stats()
        worker.close()
    print(file=sys.stderr)

    print(f"{'room':>5} {'items':>5} {'state':<8} {'ms':>8}  rows sha1 / reason")
    for n, items in enumerate(workload):
        room = 1 + n
        state, reason, digest, lat = results.get(room, ("missing", "no status", "", 0.0))
        print(f"{room:>5} {len(items):>5} {state:<8} {lat * 1000:>8.1f}  {digest or reason}")
    lats = sorted(r[3] for r in results.values())
    ok = sum(1 for r in results.values() if r[0] == "success")
    images = sum(len(items) for items in workload)
    cache = stats["cache"]
    lookups = cache["hits_arena"] + cache["hits_host"] + cache["misses"]
    pct = lambda q: lats[min(len(lats) - 1, int(q * len(lats)))] * 1000 if lats else 0.0
    print(f"\nrooms: {ok} succeeded, {len(workload) - ok} failed or missing")
    print(f"images/s: {images / elapsed:.1f}   latency p50 {pct(0.5):.1f} ms  p99 {pct(0.99):.1f} ms")
    print(f"cache hit rate: arena {cache['hits_arena'] / max(1, lookups):.0%}  "
          f"host {cache['hits_host'] / max(1, lookups):.0%}  in-flight duplicates {stats['dedup_hits']}")
    print(f"tower: {stats['tower_batches']} batches, {stats['tower_items']} items")
    if violations:
        print("protocol violations seen by the receiver:", *violations, sep="\n  ")
    return 0 if ok == len(workload) and not violations else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="demo", choices=["demo", "serve"])
    parser.add_argument("--mode", choices=MODES, default="pipeline",
                        help="pipeline: each stage its own process; inprocess: one process, one loop")
    parser.add_argument("--log-level", default="WARNING")
    add_flags(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "demo":
            over = {} if args.bootstrap else {"bootstrap": f"tcp://127.0.0.1:{free_port()}"}
            if not args.shm_prefix:
                over["shm_prefix"] = "epd_demo"
            cfg = from_args(args, **over)
        else:
            cfg = from_args(args)
    except (ConfigError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return serve(cfg, args.mode)
    return demo(cfg, args.mode)


if __name__ == "__main__":
    sys.exit(main())
