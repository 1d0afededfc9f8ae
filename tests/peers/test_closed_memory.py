"""No stranger reads or writes the worker's memory through Mooncake (issue #22, item 2).

A worker (either mode) serves a room, so its embedding arena holds embeddings. Then an
unrelated Mooncake engine in a process of its own does what any host that reaches the
worker's ports can: it handshakes with the worker's Mooncake session, asks for its first
registered buffer, and reads and writes the arena at the address it is mapped at in the
worker's process. Every read and write must fail and leave the arena's bytes as they were.
"""
from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest

from pipeline.peers.client import Client, Item
from pipeline.peers.receiver import Receiver
from stages.registry import SENDER
from tests.helpers import image, sim_config, start_worker

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                       reason="the Mooncake transfer engine is not installed"),
    pytest.mark.timeout(300),
]

READ = 1 << 20       # what the stranger tries to read, as the finding did
WRITE = 4096         # what it tries to write
PROBE_WAIT_S = 20.0  # a port that is not a handshake listener leaves its probe hanging


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in list(f)[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def arena_mappings(pid: int, data_file: str) -> list[int]:
    """Where process `pid` maps the start of the shared-memory file `data_file`."""
    starts = []
    with open(f"/proc/{pid}/maps") as f:
        for row in f:
            cols = row.split()
            if len(cols) >= 6 and cols[5] == data_file and int(cols[2], 16) == 0:
                starts.append(int(cols[0].split("-")[0], 16))
    return starts


def _stranger(conn, ports: list[int], targets: list[int]) -> None:
    """An unrelated engine: which ports answer its handshake, what their first buffer
    is, and the return codes of its reads and writes at `targets` (and that buffer)."""
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    probes: dict[int, int] = {}

    def probe(port: int) -> None:
        probes[port] = te.send_probe(f"127.0.0.1:{port}")

    threads = [threading.Thread(target=probe, args=(p,), daemon=True) for p in ports]
    for t in threads:
        t.start()
    end = time.monotonic() + PROBE_WAIT_S
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    out = {"probes": dict(probes), "first": {}, "reads": [], "writes": []}
    forged = np.full(WRITE, 0xA5, np.uint8)
    for port in [p for p, rc in probes.items() if rc == 0]:
        session = f"127.0.0.1:{port}"
        first = te.get_first_buffer_address(session)
        out["first"][port] = first
        for addr in sorted(set(targets) | ({first} if first else set())):
            stolen = np.zeros(READ, np.uint8)
            rc = te.transfer_sync_read(session, stolen.ctypes.data, addr, READ)
            out["reads"].append((port, hex(addr), rc, int(np.count_nonzero(stolen))))
            rc = te.transfer_sync_write(session, forged.ctypes.data, addr, WRITE)
            out["writes"].append((port, hex(addr), rc))
    conn.send(out)
    conn.close()
    os._exit(0)  # a probe of a port that never answers still holds the engine


def stranger_tries(ports: list[int], targets: list[int]) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_stranger, args=(child, ports, targets), daemon=True)
    proc.start()
    child.close()
    try:
        assert parent.poll(PROBE_WAIT_S + 60), "the stranger did not report"
        return parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def serve_a_room(w, shm_prefix: str) -> None:
    client = Client(w.cfg.intake, shm_prefix)
    rx = Receiver("rx-closed-arena", w.cfg.bootstrap, buffer_bytes=16 << 20)
    try:
        grid, px = image(7, grid=(1, 8, 8))
        item = Item("image", grid, px)
        spec = w.spec
        span = 8 * 8 // spec.merge ** 2
        client.encode(1, "req-1", [item])
        rx.alloc(1, 0, span=span, hidden=spec.hidden, dtype=spec.dtype,
                 deepstack_width=spec.deepstack_width)
        assert rx.wait({1: 1}, 60) and not rx.failed, rx.failed
    finally:
        rx.close()
        client.close()


@pytest.mark.parametrize("mode", ["inprocess", "pipeline"])
def test_a_stranger_can_neither_read_nor_write_the_embedding_arena(mode, shm_prefix, tmp_path):
    w = start_worker(mode, sim_config(shm_prefix, tmp_path))
    try:
        serve_a_room(w, shm_prefix)
        if mode == "pipeline":
            pid = w.runtime.procs[SENDER].pid
            ports = listening_ports(pid)
        else:  # the test's own process also holds the receiver's (open) engine
            pid = os.getpid()
            ports = [int(w.runtime.env.engine.session.rsplit(":", 1)[1])]
        data_file = f"/dev/shm/{shm_prefix}-{w.runtime.run_id}-emb"
        targets = arena_mappings(pid, data_file)
        assert targets, f"the worker's process maps no {data_file}"
        with open(data_file, "rb") as f:
            before = f.read(READ)
        assert any(before), "the arena holds no embeddings: nothing to steal, the test proves nothing"

        got = stranger_tries(ports, targets)

        with open(data_file, "rb") as f:
            after = f.read(READ)
        answered = [p for p, rc in got["probes"].items() if rc == 0]
        assert answered, f"no port of the worker ({ports}) answered a Mooncake handshake: {got}"
        served = {p: hex(a) for p, a in got["first"].items() if a}
        read = [r for r in got["reads"] if r[2] == 0 or r[3]]
        written = [wr for wr in got["writes"] if wr[2] == 0]
        assert not served and not read and not written and after == before, (
            f"a stranger reached the worker's arena: buffers served {served}; reads that "
            f"returned 0 (port, address, rc, non-zero bytes) {read}; writes that returned 0 "
            f"{written}; arena changed: {after != before}")
    finally:
        w.close()
