#!/usr/bin/env python
"""What a peer can do to the worker (issue #22), measured at the issue's own scale.

    .venv/bin/python benchmarks/peer_limits.py [--mode inprocess|pipeline|both] [--quick]
        [--only burst,flood,stranger,registers] [--json PATH]

The sim tower (3,584 bfloat16 columns a row), every setting its default unless named:

- ``burst``: 500 requests of 64 tiny items each (grid 1x2x2, pixels in shared-memory
  segments), every one within every limit; the allocs go 8 s after the last request.
  Stage restarts, rooms that succeeded, the gateway's segments never unlinked, and
  whether the worker is still up.
- ``flood``: inline requests of 4.6 MiB (grid 1x32x32), up to 1,500, with a 64 MiB
  embedding arena and no allocs: how many the gateway sent before its send blocked
  (the socket stayed full for 2 s), and the intake's private memory (the whole
  process in-process) before and at its peak, as a ratio of its growth to the bound
  the settings give (tests/runtime/test_load_bounds.py's ``memory_bound``).
- ``stranger``: an unrelated Mooncake engine on the host handshakes with each port the
  worker listens on and reads (1 MiB) and writes (4 KiB) its embedding arena where the
  worker maps it (tests/peers/test_closed_memory.py): the return codes and the non-zero bytes
  it got back.
- ``registers``: 5,000 registers under random ids (every 50th followed by an alloc for a
  room never seen, answered "unknown room" after a ``bootstrap_timeout_s`` of 2 s, so
  that status sockets open), then a real receiver is served: whether it is, the open
  file descriptors of the process holding the status sockets (the reaper; the worker
  in-process) before and after, as a ratio, and stage restarts.

``--quick``: the burst at 150 requests and the flood at 300 requests at most. No
targets: the figures are the closing note's "after". Prints one line per figure and
writes the JSON (``--json``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import zmq  # noqa: E402

from ipc import shm, wire  # noqa: E402
from pipeline.peers.client import Client, Item  # noqa: E402
from pipeline.peers.receiver import Receiver  # noqa: E402
from pipeline.testing.sim import image  # noqa: E402
from pipeline.testing.workers import start_worker, worker_config  # noqa: E402
from stages import registry  # noqa: E402

SIM = dict(tower="sim")
_rooms = itertools.count(1)


def row_shape(w) -> dict:
    """An alloc's keys that must match the tower's rows."""
    return dict(hidden=w.spec.hidden, dtype=w.spec.dtype, deepstack_width=w.spec.deepstack_width)


def alive(w) -> bool:
    if w.mode == "pipeline":
        return w.runtime.fatal is None and all(p.is_alive() for p in w.runtime.procs.values())
    return w.thread.is_alive() and w.error is None


def restarts(w) -> int:
    return sum(w.runtime.restart_counts.values()) if w.mode == "pipeline" else 0


def close(*objs) -> None:
    for obj in objs:
        try:
            obj.close()
        except Exception as e:  # an in-process worker that ended: its error is in the figures already
            print(f"  closing {type(obj).__name__}: {e!r}", flush=True)


def figure(results: dict, key: str, value, note: str = "") -> None:
    results[key] = value
    print(f"  {key} = {value}{note}", flush=True)


def ratio(results: dict, key: str, num: float, den: float, note: str = "") -> None:
    results[key] = num / den if den else None
    print(f"  {key} = {num:.4g} / {den:.4g} = {results[key]:.3g}{note}", flush=True)


# ---------------------------------------------------------------- the burst

def burst(mode: str, prefix: str, run_dir: str, quick: bool) -> dict:
    n_requests, n_items = (150 if quick else 500), 64
    w = start_worker(mode, worker_config(prefix, run_dir, **SIM))
    client = Client(w.cfg.intake, prefix)
    rx = Receiver("rx", w.cfg.bootstrap)  # 256 MiB: a row of every item
    out: dict = {"requests": n_requests, "items_per_request": n_items}
    try:
        rooms, seeds = [], itertools.count()
        for _ in range(n_requests):
            room = next(_rooms)
            client.encode(room, f"burst-{room}", [Item("image", *image(next(seeds), grid=(1, 2, 2)))
                                                  for _ in range(n_items)])
            rooms.append(room)
        time.sleep(8.0)  # the allocs came 8 s after the requests, whatever the worker did meanwhile
        for room in rooms:
            for i in range(n_items):
                rx.alloc(room, i, span=1, **row_shape(w))
        rx.wait({room: n_items for room in rooms}, 300 if alive(w) else 1)
        ok = sum(1 for r in rooms if r not in rx.failed and rx.concluded(r, n_items))
        reasons = sorted({rx.failed[r][:60] for r in rooms if r in rx.failed})
        figure(out, "stage_restarts", restarts(w))
        ratio(out, "rooms_succeeded_of_sent", ok, len(rooms), f"  ({ok} of {len(rooms)}; failed: {reasons})")
        figure(out, "rooms_failed", len(rooms) - ok)
        figure(out, "segments_left", len([e for e in os.listdir(shm.SHM_DIR) if e.startswith(f"{prefix}.px.")]))
        figure(out, "worker_alive", alive(w))
    finally:
        for e in os.listdir(shm.SHM_DIR):
            if e.startswith(f"{prefix}.px."):
                os.unlink(os.path.join(shm.SHM_DIR, e))
        close(rx, client, w)
    return out


# ---------------------------------------------------------------- the flood

def flood(mode: str, prefix: str, run_dir: str, quick: bool) -> dict:
    from tests.runtime.test_load_bounds import FLOOD_GRID, flood_frame, memory_bound, private_bytes

    limit = 300 if quick else 1500
    w = start_worker(mode, worker_config(prefix, run_dir, **SIM, embedding_arena_bytes=64 << 20,
                                         arena_cache_bytes=16 << 20))
    gateway = zmq.Context.instance().socket(zmq.PUSH)
    gateway.setsockopt(zmq.SNDHWM, 1)  # the gateway's own queue stays small: the worker's is measured
    gateway.setsockopt(zmq.LINGER, 0)
    gateway.connect(w.cfg.intake)
    out: dict = {"limit": limit}
    try:
        pid = w.runtime.procs[registry.INTAKE].pid if mode == "pipeline" else os.getpid()
        base = np.random.default_rng(7).standard_normal((FLOOD_GRID[1] * FLOOD_GRID[2], 1176), dtype=np.float32)
        before = peak = private_bytes(pid)
        sent, blocked, frame = 0, False, b""
        for n in range(limit):
            frame = flood_frame(next(_rooms), base, n)
            try:
                gateway.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                if not gateway.poll(2000, zmq.POLLOUT):
                    blocked = True
                    break
                gateway.send(frame, zmq.NOBLOCK)
            sent += 1
            peak = max(peak, private_bytes(pid))
        for _ in range(10):
            peak = max(peak, private_bytes(pid))
            time.sleep(0.1)
        figure(out, "request_mib", round(len(frame) / 2**20, 2))
        figure(out, "requests_sent_before_blocking", sent)
        figure(out, "gateway_blocked", blocked)
        figure(out, "intake_private_mib_before", round(before / 2**20))
        figure(out, "intake_private_mib_peak", round(peak / 2**20))
        ratio(out, "intake_growth_vs_bound", peak - before, memory_bound(w.cfg, mode),
              "  (growth / what the settings bound it to)")
        figure(out, "stage_restarts", restarts(w))
        figure(out, "worker_alive", alive(w))
    finally:
        gateway.close()
        close(w)
    return out


# ---------------------------------------------------------------- a stranger's Mooncake read

def stranger(mode: str, prefix: str, run_dir: str, quick: bool) -> dict:
    from tests.peers.test_closed_memory import READ, arena_mappings, listening_ports, serve_a_room, stranger_tries

    w = start_worker(mode, worker_config(prefix, run_dir, **SIM))
    out: dict = {}
    try:
        serve_a_room(w, prefix)
        if mode == "pipeline":
            pid = w.runtime.procs[registry.SENDER].pid
            ports = listening_ports(pid)
        else:
            pid = os.getpid()
            ports = [int(w.runtime.env.engine.session.rsplit(":", 1)[1])]
        data_file = f"/dev/shm/{prefix}-{w.runtime.run_id}-emb"
        with open(data_file, "rb") as f:
            before = f.read(READ)
        got = stranger_tries(ports, arena_mappings(pid, data_file))
        with open(data_file, "rb") as f:
            after = f.read(READ)
        figure(out, "arena_nonzero_bytes", int(np.count_nonzero(np.frombuffer(before, np.uint8))),
               "  (what there was to steal)")
        figure(out, "ports_answering_handshake", sorted(p for p, rc in got["probes"].items() if rc == 0))
        figure(out, "first_buffer_served", {str(p): hex(a) for p, a in got["first"].items() if a})
        figure(out, "reads", [list(r) for r in got["reads"]], "  (port, address, rc, non-zero bytes read)")
        figure(out, "writes", [list(r) for r in got["writes"]], "  (port, address, rc)")
        figure(out, "reads_that_returned_data", sum(1 for r in got["reads"] if r[2] == 0 or r[3]))
        figure(out, "writes_that_returned_0", sum(1 for r in got["writes"] if r[2] == 0))
        figure(out, "arena_changed", after != before)
    finally:
        close(w)
    return out


# ---------------------------------------------------------------- 5,000 registers

def registers(mode: str, prefix: str, run_dir: str, quick: bool) -> dict:
    n = 5000
    # Allocs for rooms never seen are answered "unknown room" after bootstrap_timeout_s: soon, here.
    w = start_worker(mode, worker_config(prefix, run_dir, **SIM, bootstrap_timeout_s=2.0))
    client = Client(w.cfg.intake, prefix)
    ctx = zmq.Context()
    out: dict = {"registers": n}
    rx = None
    try:
        shape = row_shape(w)
        holder = psutil.Process(w.runtime.procs[registry.REAPER].pid if mode == "pipeline" else os.getpid())
        fds_before = holder.num_fds()
        peer = ctx.socket(zmq.PUSH)
        peer.setsockopt(zmq.LINGER, 5000)
        peer.connect(w.cfg.bootstrap)
        probe = ctx.socket(zmq.PULL)
        probe_status = f"tcp://127.0.0.1:{probe.bind_to_random_port('tcp://127.0.0.1')}"
        for k in range(n):
            rid = f"flood-{secrets.token_hex(8)}"
            peer.send(wire.encode({"v": 1, "type": "register", "receiver": rid, "session": "127.0.0.1:1",
                                   "status": "tcp://127.0.0.1:9"}))
            if k % 50 == 0:  # an alloc for a room never seen earns a status: a status socket opens
                peer.send(wire.encode({"v": 1, "type": "alloc", "receiver": rid, "room": 9_000_000 + k,
                                       "item": 0, "span": 4, **shape, "row_start": 0, "n_rows": 4, "fanout": 1,
                                       "dst": 1 << 20, "dst_deepstack": 2 << 20}))
        # Last, on the same connection: told "unknown room" once the worker has read the whole flood.
        peer.send(wire.encode({"v": 1, "type": "register", "receiver": "probe", "session": "127.0.0.1:1",
                               "status": probe_status}))
        peer.send(wire.encode({"v": 1, "type": "alloc", "receiver": "probe", "room": 8_999_999, "item": 0,
                               "span": 4, **shape, "row_start": 0, "n_rows": 4, "fanout": 1, "dst": 1 << 20,
                               "dst_deepstack": 2 << 20}))
        figure(out, "flood_read_and_answered", bool(probe.poll(120_000)))
        rx = Receiver("real", w.cfg.bootstrap, buffer_bytes=8 << 20)
        room = next(_rooms)
        it = Item("image", *image(1, grid=(1, 4, 4)))
        client.encode(room, "real", [it])
        rx.alloc(room, 0, span=4, **shape)
        served = rx.wait({room: 1}, 60) and room not in rx.failed
        figure(out, "real_receiver_served", served, "" if served else f"  ({rx.failed.get(room)})")
        fds_after = holder.num_fds()
        ratio(out, "status_fds_after_vs_before", fds_after, fds_before, f"  ({fds_before} -> {fds_after} fds)")
        stats = w.stats()
        figure(out, "receivers_registered", stats.get("receivers_registered"))
        figure(out, "receivers_evicted", stats.get("receivers_evicted"))
        figure(out, "status_sockets_open", stats.get("status_sockets_open"))
        figure(out, "stage_restarts", restarts(w))
        figure(out, "worker_alive", alive(w))
    finally:
        ctx.destroy(linger=0)
        close(*[o for o in (rx, client, w) if o is not None])
    return out


RUN = {"burst": burst, "flood": flood, "stranger": stranger, "registers": registers}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["inprocess", "pipeline", "both"], default="both")
    ap.add_argument("--quick", action="store_true", help="the burst at 150 requests, the flood at 300 at most")
    ap.add_argument("--only", default=",".join(RUN), help=f"a comma-separated subset of {','.join(RUN)}")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in RUN]
    if unknown:
        ap.error(f"no scenario {', '.join(unknown)}; choose from {', '.join(RUN)}")
    modes = ["inprocess", "pipeline"] if args.mode == "both" else [args.mode]
    results: dict = {"quick": args.quick}
    for mode in modes:
        results[mode] = {}
        for name in only:
            print(f"{name} ({mode}):", flush=True)
            prefix = f"peerlim{os.getpid()}{name[:2]}{mode[0]}"
            with tempfile.TemporaryDirectory(prefix="epd-peer-limits-") as run_dir:
                try:
                    results[mode][name] = RUN[name](mode, prefix, run_dir, args.quick)
                finally:
                    shm.sweep(prefix, include_live=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
