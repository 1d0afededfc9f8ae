"""The EPD encode worker's command line: `epd-worker` (the console script) and `run.py`
(a shim in the source checkout) both call main().

PROG [COMMAND] [flags], the command one of:

  demo (or none)   the main job: the pipeline with its embedded defaults (tiny
                   Qwen2.5-VL tower, Mooncake TCP on loopback), a receiver in its
                   own process and a synthetic workload; prints progress, per-room
                   results and a summary
  serve            serve until SIGTERM/SIGINT (exit 0 after draining; a second
                   signal skips the drain)
  config           print the effective configuration, one key per line with where
                   its value came from (--json: as JSON)
  status           what a running worker of this shm prefix is doing: rooms by
                   state, per-stage queue depth, restarts, cache occupancy per tier
                   (--json: as JSON)
  bench            run the benchmarks (PROG bench --help), from a source checkout

Settings: defaults < a TOML file (--config PATH) < EPD_<KEY> environment variables
< flags; `PROG COMMAND --help` lists every one.

--mode pipeline (the default) runs every stage in its own process under a
supervisor; --mode inprocess runs the same stages in one process and one loop.

Exit codes (each command's are listed below): 0 success; 1 a failed room or
protocol violation in the demo, a stage that kept dying, or a failed benchmark;
2 bad configuration or flags; 3 the worker could not start; 4 (status) no worker
with that shm prefix is running.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import multiprocessing as mp
import os
import sys
import textwrap
import time

from pipeline.cli.config import ConfigError, WorkerConfig, add_flags, flags_given, format_config, load_config
from pipeline.ops.logs import setup_logging
from pipeline.runtime.background import free_port
from stages.registry import SUPERVISOR

MODES = ["pipeline", "inprocess"]
COMMANDS = ["demo", "serve", "config", "status", "bench", "proxy"]
log = logging.getLogger("epd.run")
# The console script's name; run.py passes its own.
PROG = "epd-worker"

EXIT_CODES = {
    "demo": "0 every room succeeded; 1 a room failed, a JPEG's rows differed from its pixels', a protocol "
            "violation, or a stage kept dying "
            "(restart_limit); 2 bad configuration or flags; 3 the worker could not start",
    "serve": "0 stopped by SIGTERM/SIGINT after draining; 1 a stage kept dying (more than restart_limit "
             "restarts in restart_window_s, or restart_limit + 1 failed starts in a row); 2 bad configuration or "
             "flags; 3 the worker could not start",
    "config": "0 the configuration is valid; 2 bad configuration or flags",
    "status": "0 a worker with this shm prefix is running; 2 bad configuration or flags; "
              "4 no worker with this shm prefix is running",
    "bench": "0 every benchmark ran; 1 one failed; 2 bad flags",
    "proxy": "0 stopped by SIGINT; 2 bad flags",
}


# ---------------------------------------------------------------- serve
def serve(cfg: WorkerConfig, mode: str) -> int:
    from pipeline.runtime.serving import StartError, serve_until_signalled
    from pipeline.runtime.background import start

    def announce(rt) -> None:
        print(f"serving ({mode}): intake {rt.cfg.intake}  bootstrap {rt.cfg.bootstrap}  "
              f"tower {rt.spec.name}", flush=True)
        if rt.metrics is not None:
            print(f"metrics: {rt.metrics.url}", flush=True)

    started = []
    try:
        code = serve_until_signalled(lambda: started.append(start(cfg, mode)) or started[0], announce)
    except StartError as e:
        print(f"error: the worker could not start: {e}", file=sys.stderr)
        return 3
    print("stopped" if code == 0 else f"error: {started[0].fatal}", flush=True)
    from stages.store_tier import end_process_if_abandoned

    end_process_if_abandoned(code)  # a store client whose master is gone: no exit handlers
    return code


# ---------------------------------------------------------------- demo
def _receiver_main(bootstrap: str, conn, cfg: WorkerConfig) -> None:
    """The prefill side: allocs for each room it is told of, then reports what arrived."""
    import hashlib

    from pipeline.peers.receiver import Receiver

    setup_logging(cfg, "receiver")
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
                    digests = []
                    for i in range(n):
                        main, deep = r.rows(room, i)
                        digest = hashlib.sha1(main.tobytes())
                        if deep is not None:
                            digest.update(deep.tobytes())
                        digests.append(digest.hexdigest()[:12])
                    conn.send((room, "success", "", digests))
                r.release(room)
        if r.violations:
            conn.send(("violations", r.violations))
            r.violations = []


def _hit_rate(stats: dict) -> tuple[float, float]:
    """Cache hits per lookup, arena tier and host tier."""
    cache = stats.get("cache") or {}
    arena, host = cache.get("hits_arena", 0), cache.get("hits_host", 0)
    lookups = max(1, arena + host + cache.get("misses", 0))
    return arena / lookups, host / lookups


def _progress(results: dict, total: int, images: int, elapsed: float, stats: dict) -> None:
    ok = sum(1 for r in results.values() if r[0] == "success")
    arena, host = _hit_rate(stats)
    print(f"\r  rooms {len(results)}/{total}  ok {ok}  failed {len(results) - ok}  "
          f"{images / max(elapsed, 1e-9):6.1f} images/s  cache hits {arena + host:4.0%} "
          f"(arena {arena:.0%}, host {host:.0%})", end="", file=sys.stderr, flush=True)


def _jpegs() -> list[bytes]:
    """Synthetic pictures (gradients and grain) as JPEG files, of sizes the patches tile."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    files = []
    for width, height in ((112, 112), (224, 224), (280, 168), (224, 336), (448, 448)):
        y, x = np.mgrid[0:height, 0:width]
        rgb = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], axis=-1)
        rgb = (rgb + rng.integers(0, 48, rgb.shape)).clip(0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(rgb).save(out, "JPEG", quality=90)
        files.append(out.getvalue())
    return files


TWIN_ROOM = 8  # its two items: a JPEG sent compressed, and the pixels the worker makes of it


def _workload(cfg: WorkerConfig, spec):
    """JPEGs of several sizes, some repeated, sent compressed (the worker decodes them);
    one room with a JPEG beside the pixels the worker makes of it, whose rows must be
    equal; a video sent as pixels."""
    import numpy as np

    from ipc import media
    from pipeline.peers.client import Item, image_item
    from pipeline.runtime.stage_settings import preprocess_settings
    from stages.preprocess import image_settings

    jpegs = _jpegs()
    bounds = dict(min_pixels=cfg.image_min_pixels, max_pixels=cfg.image_max_pixels, patch=spec.patch,
                  merge=spec.merge)
    rng = np.random.default_rng(0)
    rooms = []
    for k in range(40):
        g = k % len(jpegs) if k % 4 else (k // 4) % len(jpegs)   # every 4th repeats an earlier image
        items = [image_item(jpegs[g], "jpeg", **bounds)]
        if 1 + k == TWIN_ROOM:
            pixels, grid = media.preprocess(jpegs[0], "jpeg", image_settings(preprocess_settings(cfg), spec))
            items = [image_item(jpegs[0], "jpeg", **bounds), Item("image", [list(grid)], pixels)]
        if k == 11:
            t = (2, 8, 8)
            items = [Item("video", [list(t)], rng.standard_normal((128, spec.patch_dim), dtype=np.float32))]
        rooms.append(items)
    return rooms


def demo(cfg: WorkerConfig, mode: str) -> int:
    from pipeline.peers.client import Client
    from pipeline.runtime.background import Running

    try:
        worker = Running(cfg, mode)
    except Exception as e:
        print(f"error: the worker could not start: {e}", file=sys.stderr)
        return 3
    spec = worker.spec
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    rx = ctx.Process(target=_receiver_main, args=(worker.cfg.bootstrap, child, cfg), daemon=True)
    rx.start()
    results, violations = {}, []
    try:
        if not parent.poll(60):
            raise RuntimeError("the receiver process did not start")
        parent.recv()
        time.sleep(0.2)  # let its register reach the worker before the first alloc
        client = Client(worker.cfg.intake, cfg.shm_prefix)
        workload = _workload(worker.cfg, spec)
        alloc_spec = dict(hidden=spec.hidden, dtype=spec.dtype, deepstack_width=spec.deepstack_width)
        sent_at = {}
        print(f"demo: {len(workload)} rooms through the {spec.name} tower "
              f"(hidden {spec.hidden}, {spec.dtype}), mode {mode}", flush=True)
        t0 = time.monotonic()
        end = t0 + 300
        images_done, shown_at = 0, 0.0
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
                    images_done += len(workload[room - 1])
                    if time.monotonic() - shown_at > 0.25 or len(results) == len(workload):
                        shown_at = time.monotonic()
                        _progress(results, len(workload), images_done, shown_at - t0, worker.stats())
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

    return _summary(workload, results, violations, stats, elapsed)

def _summary(workload: list, results: dict, violations: list, stats: dict, elapsed: float) -> int:
    """Every room's result and the run's figures; the demo's exit code."""
    print(f"{'room':>5} {'items':>5} {'state':<8} {'ms':>8}  rows sha1 / reason")
    for n, items in enumerate(workload):
        room = 1 + n
        state, reason, digest, lat = results.get(room, ("missing", "no status", "", 0.0))
        print(f"{room:>5} {len(items):>5} {state:<8} {lat * 1000:>8.1f}  {' '.join(digest) or reason}")
    lats = sorted(r[3] for r in results.values())
    ok = sum(1 for r in results.values() if r[0] == "success")
    images = sum(len(items) for items in workload)
    arena, host = _hit_rate(stats)

    def pct(q: float) -> float:
        return lats[min(len(lats) - 1, int(q * len(lats)))] * 1000 if lats else 0.0

    print(f"\nrooms: {ok} succeeded, {len(workload) - ok} failed or missing")
    print(f"images/s: {images / elapsed:.1f}   latency p50 {pct(0.5):.1f} ms  p99 {pct(0.99):.1f} ms")
    print(f"cache hit rate: arena {arena:.0%}  host {host:.0%}  in-flight duplicates {stats['dedup_hits']}")
    print(f"tower: {stats['tower_batches']} batches, {stats['tower_items']} items")
    twin = results.get(TWIN_ROOM, ("missing", "", [], 0.0))[2]
    twins_equal = len(twin) == 2 and twin[0] == twin[1]
    print(f"room {TWIN_ROOM}: the JPEG's rows and those of its pixels are "
          f"{'equal' if twins_equal else 'NOT equal'}")
    if violations:
        print("protocol violations seen by the receiver:", *violations, sep="\n  ")
    return 0 if ok == len(workload) and not violations and twins_equal else 1


# ---------------------------------------------------------------- bench
def bench(argv: list[str]) -> int:
    """benchmarks/bench.py's main, with every flag after `bench` passed through.

    The benchmarks are not part of the installed package: they run from a source
    checkout, or an editable install of one, where benchmarks/ sits beside pipeline/."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "benchmarks", "bench.py")
    if not os.path.exists(path):
        print(f"error: bench runs from a source checkout of the worker (no {path} here): "
              "clone it and run scripts/setup.sh there", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so that what it pickles for child processes can be found
    spec.loader.exec_module(module)
    return module.main(argv)


# ---------------------------------------------------------------- flags
def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n", 1)[1].replace("PROG", prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes:\n" + "\n".join(textwrap.fill(f"{name}: {text}", 88, initial_indent="  ",
                                                          subsequent_indent="    ")
                                            for name, text in EXIT_CODES.items()))
    commands = parser.add_subparsers(dest="command", metavar="COMMAND",
                                     description="demo is the default when no command is given")
    summaries = {
        "demo": "the main job: a worker, a receiver and a synthetic workload; prints a summary",
        "serve": "serve until SIGTERM/SIGINT, printing the effective configuration at start",
        "config": "print the effective configuration and where each value came from",
        "status": "rooms, queues, restarts and cache occupancy of a running worker (by shm prefix)",
    }
    for name, summary in summaries.items():
        extra = "[--mode MODE] " if name in ("demo", "serve") else "[--json] "
        description = summary
        if name == "demo":
            description += ("; unless set otherwise, it uses shm_prefix 'epd_demo' and a free port for "
                            "bootstrap, so it runs beside a worker with the defaults")
        sub = commands.add_parser(name, help=summary, description=description,
                                  epilog="exit codes: " + EXIT_CODES[name],
                                  usage=f"%(prog)s [-h] {extra}[--config PATH] [--<setting> VALUE ...]")
        if name in ("demo", "serve"):
            sub.add_argument("--mode", choices=MODES, default="pipeline",
                             help="pipeline: each stage its own process (default); "
                                  "inprocess: one process, one loop")
        if name in ("config", "status"):
            sub.add_argument("--json", action="store_true", help="print JSON instead of text")
        add_flags(sub)
    # Parsed by benchmarks/bench.py itself (see bench()); listed here for the command list.
    commands.add_parser("bench", add_help=False, help=f"run the benchmarks; flags: {prog} bench --help")
    # Parsed by pipeline/integrations/proxy.py.
    commands.add_parser("proxy", add_help=False,
                        help=f"a front for vLLM that has the workers encode the images; flags: {prog} proxy --help")
    return parser


def main(argv=None, prog: str = PROG) -> int:
    """The command line's entry point: its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["demo"] + argv
    if argv[0] == "bench":
        return bench(argv[1:])
    if argv[0] == "proxy":
        from pipeline.integrations.proxy import main as proxy_main

        return proxy_main(argv[1:], prog=f"{prog} proxy")
    args = build_parser(prog).parse_args(argv)
    # The demo runs beside whatever else runs here: its own prefix and a free port.
    demo_defaults = ({"shm_prefix": "epd_demo", "bootstrap": f"tcp://127.0.0.1:{free_port()}"}
                     if args.command == "demo" else {})
    try:
        cfg, sources = load_config(args.config, flags_given(args), defaults=demo_defaults,
                                   defaults_source="demo default")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(format_config(cfg, sources, as_json=args.json))
        return 0
    if args.command == "status":
        setup_logging(cfg, "status")
        from pipeline.cli.status import main as status_main

        return status_main(cfg, args.json)
    setup_logging(cfg, SUPERVISOR if args.mode == "pipeline" else "worker")
    if args.command == "serve":
        print("effective configuration:\n" + format_config(cfg, sources), file=sys.stderr, flush=True)
        return serve(cfg, args.mode)
    log.info("effective configuration:\n%s", format_config(cfg, sources))
    return demo(cfg, args.mode)


if __name__ == "__main__":
    sys.exit(main())
