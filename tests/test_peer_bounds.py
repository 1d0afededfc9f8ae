"""What a stranger on the bootstrap socket can reach (issue #22): registrations, the
reaper's status sockets and the file descriptors behind them, deadlines, tombstones.

Each limit test pushes past the bound and checks that the worker answers with a reason
and keeps serving: a real receiver still registers, allocs and gets its rows, and no
stage restarts.
"""
from __future__ import annotations

import itertools
import secrets
import time

import numpy as np
import pytest
import zmq

from ipc import wire
from pipeline.client import Client, Item
from pipeline.receiver import Receiver
from tests.helpers import expected_sim_rows, image, sim_config, start_worker

pytestmark = pytest.mark.timeout(300)
_rooms = itertools.count(70_000)
FLOOD = 5000


@pytest.fixture(params=["inprocess", "pipeline"])
def env(request, shm_prefix, tmp_path):
    made = []

    def start(**over):
        w = start_worker(request.param, sim_config(shm_prefix, tmp_path, **over))
        made.append(w)
        client = Client(w.cfg.intake, shm_prefix)
        made.append(client)
        return w, client, made

    start.mode = request.param
    yield start
    for obj in reversed(made):
        obj.close()


def serve_one(client, rx, seed: int, deadline_ms=None) -> tuple[int, Item]:
    room = next(_rooms)
    it = Item("image", *image(seed, grid=(1, 4, 4)))
    client.encode(room, f"req-{room}", [it], deadline_ms=deadline_ms)
    rx.alloc(room, 0, span=4, hidden=64, dtype="bfloat16", deepstack_width=32)
    return room, it


def assert_rows(rx, room: int, it: Item) -> None:
    main, deep = expected_sim_rows(it.pixels, it.modality, 4, 64, 32, "bfloat16")
    got_main, got_deep = rx.rows(room, 0)
    assert np.array_equal(got_main, main) and np.array_equal(got_deep, deep), room


def assert_alive(w) -> None:
    if w.mode == "pipeline":
        stats = w.stats()
        assert not any(stats["restarts"].values()), stats["restarts"]
        assert all(p.is_alive() for p in w.runtime.procs.values())
    else:
        assert w.thread.is_alive() and w.error is None, w.error


def stat(w, key: str, default=0):
    return w.stats().get(key, default)


def wait_for(cond, timeout: float = 60.0, every: float = 0.1) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(every)
    return True


def register_msg(rid: str, status: str = "tcp://127.0.0.1:9") -> bytes:
    return wire.encode({"v": 1, "type": "register", "receiver": rid, "session": "127.0.0.1:1", "status": status})


def alloc_msg(rid: str, room: int) -> bytes:
    return wire.encode({"v": 1, "type": "alloc", "receiver": rid, "room": room, "item": 0, "span": 4,
                        "hidden": 64, "dtype": "bfloat16", "deepstack_width": 32, "row_start": 0,
                        "n_rows": 4, "fanout": 1, "dst": 1 << 20, "dst_deepstack": 2 << 20})


def test_a_register_flood_leaves_the_worker_serving(env):
    """5,000 registers under random ids, some of them followed by an alloc that earns a
    status (to an endpoint nobody listens on), then a real receiver registers, allocs
    and gets its rows: the flood's registrations give way, least recently used first,
    the status sockets stay capped, and no stage dies. (Before: the in-process worker
    ended with `ZMQError: Too many open files`; the pipeline's reaper could never start
    again, and the real receiver's alloc was "from unregistered receiver".)"""
    w, client, made = env(bootstrap_timeout_s=2.0, max_status_sockets=32)
    ctx = zmq.Context()
    try:
        peer = ctx.socket(zmq.PUSH)
        peer.setsockopt(zmq.LINGER, 5000)
        peer.connect(w.cfg.bootstrap)
        ids = [f"flood-{secrets.token_hex(8)}" for _ in range(FLOOD)]
        for k, rid in enumerate(ids):
            peer.send(register_msg(rid))
            if k % 50 == 0:  # an alloc for a room never seen: "unknown room" to an endpoint nobody serves
                peer.send(alloc_msg(rid, 9_000_000 + k))
        # Last, over the same socket (so after the flood): a receiver with a status socket
        # of ours, and an alloc of it for a room never seen. Its "unknown room" says the
        # worker read the whole flood and still registers and tells.
        probe = ctx.socket(zmq.PULL)
        probe_status = f"tcp://127.0.0.1:{probe.bind_to_random_port('tcp://127.0.0.1')}"
        peer.send(register_msg("probe", probe_status))
        peer.send(alloc_msg("probe", 8_999_999))
        assert probe.poll(60_000), f"the receiver registered after the flood was never told: {w.stats()}"
        assert wire.decode(probe.recv())["reason"] == "unknown room"
        assert_alive(w)
        rx = Receiver("real", w.cfg.bootstrap, buffer_bytes=8 << 20)
        made.append(rx)
        room, it = serve_one(client, rx, 1)
        assert rx.wait({room: 1}, 60) and room not in rx.failed, rx.failed.get(room)
        assert_rows(rx, room, it)
        assert wait_for(lambda: stat(w, "receivers_evicted") > 0), w.stats()
        assert stat(w, "status_sockets_open") <= 32
        # The flood's statuses went out (or were tried), through at most 32 sockets at once.
        assert wait_for(lambda: stat(w, "status_sockets_opened") >= FLOOD // 50 // 2), w.stats()
        room2, it2 = serve_one(client, rx, 2)
        assert rx.wait({room2: 1}, 60) and room2 not in rx.failed
        assert_rows(rx, room2, it2)
        assert_alive(w)
    finally:
        ctx.destroy(linger=0)
