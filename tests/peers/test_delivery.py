"""Protocol 1.1 (issue #24): every row verified at the receiver, every status delivered.

- a `success` carries the digest of exactly the bytes written, and `Receiver` turns a
  mismatch into a failed item;
- a fenced item's lease lives until its write ends (a receiver that stalls its Mooncake
  reads while its room is canceled);
- a status lost on the way comes again on `query`, and a repeat already had is dropped;
- an alloc of an older incarnation is never written;
- no `failed` while a dead sender's bytes can still land (tests/peers/test_dead_sender_bytes.py).

The stalled receiver is a child process that owns a Mooncake engine and its memory; the
test speaks the protocol for it (RawReceiver) and stops and resumes it with SIGSTOP and
SIGCONT, so that its reads stall while the test goes on.
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
import zmq

from ipc import wire
from ipc.arena import StaleLease
from ipc.rooms import RoomState
from pipeline.peers.client import Client, Item
from pipeline.peers.receiver import Receiver
from stages.records import OWNER_SENDER
from tests.helpers import expected_sim_rows, image, sim_config, start_worker

pytestmark = pytest.mark.timeout(180)
_rooms = itertools.count(240_000)
ROW = dict(hidden=64, dtype="bfloat16", deepstack_width=32)  # the sim tower of sim_config
WIDE = dict(sim_hidden=3584, sim_deepstack_width=0, embedding_arena_bytes=48 << 20)  # 7 KiB a row
BIG_GRID = (1, 64, 64)  # 1,024 rows of 7 KiB: more than loopback's socket buffers hold


def started(made, obj):
    made(obj)
    return obj


def wait_for(cond, timeout: float = 30.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def shard_bytes(rx: Receiver, room: int, item: int) -> tuple[np.ndarray, np.ndarray]:
    s = rx.shards[(room, item)]
    isz = wire.DTYPES[s.dtype]
    return (rx.buffer[s.offset:s.offset + s.n_rows * s.hidden * isz],
            rx.buffer[s.ds_offset:s.ds_offset + s.n_rows * s.deepstack_width * isz])


def send(client, rx, room: int, seed: int, grid=(1, 4, 8)) -> Item:
    it = Item("image", *image(seed, grid=grid))
    rx.alloc(room, 0, span=grid[0] * grid[1] * grid[2] // 4, **ROW)
    client.encode(room, f"req-{room}", [it])
    return it


# ---------------------------------------------------------------- digest

def test_every_success_carries_its_rows_digest_and_a_mismatch_fails_the_item(mode, shm_prefix, tmp_path, made):
    w = started(made, start_worker(mode, sim_config(shm_prefix, tmp_path)))
    client = started(made, Client(w.cfg.intake, shm_prefix))
    rx = started(made, Receiver("rx0", w.cfg.bootstrap, buffer_bytes=8 << 20))
    room = next(_rooms)
    it = send(client, rx, room, 1)
    got = []
    wait_for(lambda: got.extend(rx.poll(0.1)) or rx.concluded(room, 1), what="the first room's status")
    main, deep = expected_sim_rows(it.pixels, "image", 8, 64, 32, "bfloat16")
    assert [st.get("digest") for st in got] == [wire.rows_digest((main.tobytes(), deep.tobytes()))]
    assert rx.digest_mismatches == 0 and (room, 0) in rx.success

    room = next(_rooms)
    send(client, rx, room, 2)
    assert rx.status_sock.poll(30_000)  # its success is here, not taken yet: the rows are final
    shard_bytes(rx, room, 0)[1][:2] ^= 0xFF  # as if another room's bytes landed over them
    assert rx.wait({room: 1}, 30)
    assert rx.failed.get(room) == "digest mismatch" and rx.digest_mismatches == 1
    assert (room, 0) not in rx.success and not rx.violations


# ---------------------------------------------------------------- the stalled receiver

def _stalled_child(conn, nbytes: int) -> None:  # pragma: no cover - runs in a child
    from ipc.transport import Engine
    engine = Engine("127.0.0.1", "tcp")
    raw = np.zeros(nbytes + 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096
    buf = raw[start:start + nbytes]
    engine.register(buf.ctypes.data, nbytes)
    conn.send((engine.session, buf.ctypes.data))
    while (cmd := conn.recv()) is not None:
        conn.send(buf[cmd[0]:cmd[0] + cmd[1]].tobytes())
    engine.close()


class StalledReceiver:
    """A Mooncake engine and its memory in a child process (which SIGSTOP stalls), and the
    protocol spoken for it from here."""

    def __init__(self, rid: str, bootstrap: str, nbytes: int = 16 << 20):
        self.conn, child_end = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_stalled_child, args=(child_end, nbytes), daemon=True)
        self.proc.start()
        self.session, self.address = self.conn.recv()
        self.id = rid
        ctx = zmq.Context.instance()
        self.status = ctx.socket(zmq.PULL)
        self.status.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.status.bind_to_random_port('tcp://127.0.0.1')}"
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.connect(bootstrap)
        self.send(type="register", session=self.session, status=self.endpoint)
        self.heard: list[dict] = []

    def send(self, **msg) -> None:
        self.push.send(wire.encode({"v": wire.VERSION, "receiver": self.id, **msg}))

    def alloc(self, room: int, n_rows: int, hidden: int, offset: int = 0) -> None:
        self.send(type="alloc", room=room, item=0, dst=self.address + offset, dst_deepstack=0, row_start=0,
                  n_rows=n_rows, span=n_rows, hidden=hidden, dtype="bfloat16", deepstack_width=0, fanout=1)

    def statuses(self, room: int, timeout: float = 60.0) -> list[dict]:
        def heard():
            while self.status.poll(50):
                self.heard.append(wire.decode(self.status.recv()))
            return [st for st in self.heard if st["room"] == room]
        return wait_for(heard, timeout, f"a status of room {room}")

    def read(self, offset: int, n: int) -> bytes:
        self.conn.send((offset, n))
        return self.conn.recv()

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self.status.close()
        self.push.close()


def sender_leases(w) -> list:
    arena = w.runtime.shared.emb_arena
    held = []
    for lease in arena.live_leases():
        try:
            if arena.refs(lease).get(OWNER_SENDER):
                held.append(lease)
        except StaleLease:  # freed since the list was read
            pass
    return held


def room_state(w, room: int):
    slot = w.runtime.rooms.find(room)
    entry = w.runtime.rooms.get(slot) if slot is not None else None
    return entry.state if entry is not None and entry.room == room else None


def test_a_fenced_items_lease_lives_until_its_write_ends(mode, shm_prefix, tmp_path, made):
    w = started(made, start_worker(mode, sim_config(shm_prefix, tmp_path, **WIDE)))
    client = started(made, Client(w.cfg.intake, shm_prefix))
    rx = started(made, StalledReceiver("stalled", w.cfg.bootstrap))
    warm = next(_rooms)  # the session opened: the big write then stalls in the socket, not the handshake
    rx.alloc(warm, 4, 3584)
    client.encode(warm, "warm", [Item("image", *image(3, grid=(1, 4, 4)))])
    assert [st["state"] for st in rx.statuses(warm)] == ["success"]

    room = next(_rooms)
    rx.alloc(room, 1024, 3584)
    rx.stop()
    client.encode(room, "big", [Item("image", *image(4, grid=BIG_GRID))])
    (lease,) = wait_for(lambda: room_state(w, room) == RoomState.TRANSFERRING and sender_leases(w),
                        what="the big write to start")
    rx.send(type="cancel", room=room)
    wait_for(lambda: room_state(w, room) == RoomState.FAILED, what="the cancel")
    # Mooncake still reads the rows: they must not be leased to another room meanwhile.
    assert lease in sender_leases(w)
    rx.resume()
    assert [(st["state"], st["reason"]) for st in rx.statuses(room)] == [("failed", "canceled")]
    wait_for(lambda: lease not in sender_leases(w), what="the lease's release once the write ended")


# ---------------------------------------------------------------- query

def test_a_lost_status_comes_again_on_query_and_a_repeat_is_dropped(mode, shm_prefix, tmp_path, made):
    w = started(made, start_worker(mode, sim_config(shm_prefix, tmp_path)))
    client = started(made, Client(w.cfg.intake, shm_prefix))
    rx = started(made, Receiver("rx0", w.cfg.bootstrap, buffer_bytes=8 << 20, query_after_s=0.5))
    wait_for(lambda: rx.poll(0.1) == [] and rx.worker_speaks, what="the worker's hello")  # first in the socket
    room = next(_rooms)
    send(client, rx, room, 5)
    assert rx.status_sock.poll(30_000)
    # The status is lost: the socket it waits in is closed unread, and the receiver
    # moves its status endpoint (the same process: it registers again).
    rx.status_sock.close(linger=0)
    rx.status_sock = zmq.Context.instance().socket(zmq.PULL)
    rx.status_endpoint = f"tcp://127.0.0.1:{rx.status_sock.bind_to_random_port('tcp://127.0.0.1')}"
    rx.register()
    assert rx.wait({room: 1}, 30), "the lost success never came again"
    assert (room, 0) in rx.success and rx.recovered_by_query == 1 and rx.queries_sent >= 1

    rx.query(room)  # answered again: a repeat of what it has, dropped
    wait_for(lambda: rx.poll(0.1) == [] and rx.dropped["repeat"] == 1, what="the repeat")
    never = next(_rooms)
    rx.query(never)
    wait_for(lambda: rx.poll(0.1) == [] and never in rx.early_failed, what="the unknown room's answer")
    assert rx.early_failed[never]["reason"] == "unknown room"
    assert not rx.violations and rx.recovered_by_query == 1
    assert w.stats()["query_answers"]["repeat"] >= 2


# ---------------------------------------------------------------- incarnation

def test_an_alloc_of_an_older_incarnation_is_never_written(mode, shm_prefix, tmp_path, made):
    w = started(made, start_worker(mode, sim_config(shm_prefix, tmp_path)))
    client = started(made, Client(w.cfg.intake, shm_prefix))
    rx = started(made, Receiver("rx0", w.cfg.bootstrap, buffer_bytes=8 << 20, incarnation=1))
    room = next(_rooms)
    rx.alloc(room, 0, span=8, **ROW)  # held: the room is not there yet
    # The receiver restarts on the same Mooncake session (same host and port): the new
    # process registers under a new incarnation, and its memory is not what the alloc named.
    rx.incarnation = 2
    rx.register()
    probe = next(_rooms)  # answered after the register, sent before it on the same socket
    rx.query(probe)
    wait_for(lambda: rx.poll(0.1) == [] and probe in rx.early_failed, what="the new registration")
    client.encode(room, f"req-{room}", [Item("image", *image(6, grid=(1, 4, 8)))])
    assert rx.wait({room: 1}, 30)
    assert "incarnation" in rx.failed.get(room, ""), rx.failed
    assert not any(part.any() for part in shard_bytes(rx, room, 0))
    # The new incarnation's own allocs are written.
    ok = next(_rooms)
    send(client, rx, ok, 7)
    assert rx.wait({ok: 1}, 30) and (ok, 0) in rx.success


# ---------------------------------------------------------------- the wire and the tables

def test_the_new_keys_parse_and_bad_ones_are_refused():
    reg = {"v": 1, "type": "register", "receiver": "rx", "session": "127.0.0.1:7", "status": "tcp://127.0.0.1:8"}
    assert wire.parse_bootstrap(reg).incarnation is None
    assert wire.parse_bootstrap({**reg, "incarnation": 2**64 - 1}).incarnation == 2**64 - 1
    assert wire.parse_bootstrap({"v": 1, "type": "query", "receiver": "rx", "room": 5}) == wire.Query("rx", 5)
    for bad in ({**reg, "incarnation": -1}, {**reg, "incarnation": "1"}, {**reg, "session": "h:1\0x"},
                {"v": 1, "type": "query", "receiver": "rx", "room": -5}):
        with pytest.raises(wire.ProtocolError):
            wire.parse_bootstrap(bad)
    a, b = wire.Register("rx", "h:1", "tcp://h:2", 1), wire.Register("rx", "h:1", "tcp://h:2", 2)
    assert len({a.session_hash, b.session_hash, wire.Register("rx", "h:1", "tcp://h:2").session_hash}) == 3


def test_the_receiver_table_keeps_the_incarnation(shm_prefix):
    from ipc.receivers import ReceiverTable
    table = ReceiverTable.create(shm_prefix, "0000a11c", "receivers", 4)
    try:
        table.put("a", "h:1", "tcp://h:2", 7)
        table.put("b", "h:3", "tcp://h:4")
        assert table.registrations() == {"a": wire.Register("a", "h:1", "tcp://h:2", 7),
                                         "b": wire.Register("b", "h:3", "tcp://h:4")}
    finally:
        table.close()
        table.unlink()
