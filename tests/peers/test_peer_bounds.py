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
from pipeline.peers.client import Item
from pipeline.cli.config import WorkerConfig
from pipeline.peers.receiver import Receiver
from tests.helpers import expected_sim_rows, fork_call, image, wait_child

pytestmark = pytest.mark.timeout(300)
_rooms = itertools.count(70_000)
FLOOD = 5000


@pytest.fixture(params=["inprocess", "pipeline"])
def env(request, worker_rig):
    def start(**over):
        w, client, _ = worker_rig(request.param, names=(), **over)
        return w, client, worker_rig.made

    start.mode = request.param
    return start


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


# ================================================================ open files


def _limits_in_child(soft: int, hard: int, sockets: int, out) -> None:
    import resource

    from pipeline.runtime.serving import StartError, raise_open_file_limit

    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    cfg = WorkerConfig(max_status_sockets=sockets)
    try:
        got = raise_open_file_limit(cfg)
    except StartError as e:
        out.write_text(f"error {e}")
        return
    out.write_text(f"ok {got} {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}")


def test_the_worker_raises_its_open_file_limit_or_names_the_bound_to_lower(tmp_path):
    """At start the soft RLIMIT_NOFILE goes up (to the hard limit at most) to what
    max_status_sockets needs; past the hard limit the start fails naming the setting.
    (In a child: a hard limit lowered cannot be raised again.)"""
    from pipeline.runtime.serving import open_files_needed

    need = open_files_needed(WorkerConfig(max_status_sockets=256))
    out = tmp_path / "out"
    assert wait_child(fork_call(_limits_in_child, 256, need + 100, 256, out)) == 0
    assert out.read_text() == f"ok {need} {need}"
    assert wait_child(fork_call(_limits_in_child, 256, need + 100, 10_000, out)) == 0
    text = out.read_text()
    assert text.startswith("error") and "max_status_sockets" in text and "RLIMIT_NOFILE" in text, text


def test_a_start_with_too_low_a_hard_limit_exits_3_naming_the_bound(shm_prefix, tmp_path):
    import resource
    import subprocess
    import sys

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1500))

    proc = subprocess.run([sys.executable, "run.py", "serve", "--tower", "sim", "--shm-prefix", shm_prefix,
                           "--run-dir", str(tmp_path), "--max-status-sockets", "1000"],
                          preexec_fn=low_limit, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr)
    assert "max_status_sockets" in proc.stdout + proc.stderr


# ================================================================ status sockets


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_status_sockets_close_when_idle_reopen_when_needed_and_are_capped():
    """A socket unused for idle_s closes; the next status reopens it. At the cap the
    least recently used one closes, but only once its last status had its linger: until
    then a status for another receiver waits, and goes out when one may close."""
    from stages.status_pusher import LINGER_S, StatusPusher

    clock = FakeClock()
    ctx = zmq.Context()
    pusher = StatusPusher(max_sockets=2, idle_s=30.0, clock=clock)
    pulls = {}
    try:
        for rx in ("a", "b", "c"):
            pulls[rx] = ctx.socket(zmq.PULL)
            pusher.register(rx, f"tcp://127.0.0.1:{pulls[rx].bind_to_random_port('tcp://127.0.0.1')}")
        assert pusher.stats()["status_sockets_open"] == 0  # registering opens nothing

        def got(rx, room):
            assert pulls[rx].poll(5000), rx
            assert wire.decode(pulls[rx].recv())["room"] == room

        pusher.send("a", wire.status_message(1, 0, True))
        pusher.send("b", wire.status_message(2, 0, True))
        got("a", 1)
        got("b", 2)
        pusher.send("c", wire.status_message(3, 0, True))  # the cap: a's socket was used just now
        assert pusher.stats()["status_waiting"] == 1 and pusher.stats()["status_sockets_open"] == 2
        clock.now += LINGER_S
        pusher.tick()  # a may close now: c's status goes out
        got("c", 3)
        assert pusher.stats()["status_sockets_open"] == 2
        clock.now += 31.0
        pusher.tick()  # idle: every socket closes
        assert pusher.stats()["status_sockets_open"] == 0
        pusher.send("a", wire.status_message(4, 0, True))  # reopened for the next status
        got("a", 4)
        assert pusher.stats()["status_sockets_opened"] == 4 and pusher.stats()["status_undelivered"] == 0
    finally:
        pusher.close()
        for sock in pulls.values():
            sock.close(linger=0)
        ctx.term()


def test_a_full_status_queue_is_counted_and_logged(caplog):
    """A receiver that never reads: statuses past status_hwm are dropped, counted and logged."""
    from stages.status_pusher import StatusPusher

    pusher = StatusPusher(hwm=4, max_sockets=2)
    try:
        pusher.register("slow", "tcp://127.0.0.1:9")  # nobody listens
        with caplog.at_level("WARNING", logger="epd.reaper"):
            for room in range(20):
                pusher.send("slow", wire.status_message(room, 0, True))
        assert pusher.stats()["status_undelivered"] > 0
        assert any("dropped a status for receiver slow" in r.message for r in caplog.records)
    finally:
        pusher.close()


# ================================================================ both modes: deadlines, expiry


def test_a_deadline_past_max_deadline_s_fails_the_room_then_saying_so(env):
    """deadline_ms up to 1e9 is legal on the wire; the room is held to max_deadline_s
    (before: its entry stayed in the reaper's heap for up to 11.6 days)."""
    w, client, made = env(max_deadline_s=1.0)
    rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=8 << 20)
    made.append(rx)
    room = next(_rooms)
    it = Item("image", *image(3, grid=(1, 4, 4)))
    client.encode(room, f"req-{room}", [it], deadline_ms=10**9)
    # One shard of two: the room waits for the other until its (capped) deadline.
    rx.alloc(room, 0, span=4, hidden=64, dtype="bfloat16", deepstack_width=32, fanout=2, row_start=0, n_rows=2)
    assert rx.wait({room: 1}, 60), "the room never concluded"
    assert "max_deadline_s" in rx.failed[room], rx.failed[room]
    ok, it2 = serve_one(client, rx, 4, deadline_ms=10**9)
    assert rx.wait({ok: 1}, 60) and ok not in rx.failed
    assert_rows(rx, ok, it2)
    assert_alive(w)


def test_an_idle_registration_expires_and_registering_again_serves(env):
    w, client, made = env(registration_idle_s=2.0)
    rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=8 << 20)
    made.append(rx)
    assert wait_for(lambda: stat(w, "receivers_expired") >= 1), w.stats()
    assert stat(w, "receivers_registered") == 0
    rx.register()
    room, it = serve_one(client, rx, 5)
    assert rx.wait({room: 1}, 60) and room not in rx.failed, rx.failed.get(room)
    assert_rows(rx, room, it)
    assert_alive(w)


def test_a_receiver_quiet_past_its_register_interval_registers_again_before_it_allocs(env):
    """Without a register of its own, an honest receiver whose registration expired while
    it was quiet is served: `Receiver` registers again before an alloc once
    `register_every_s` has passed since its last register."""
    w, client, made = env(registration_idle_s=2.0)
    rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=8 << 20, register_every_s=1.0)
    made.append(rx)
    assert wait_for(lambda: stat(w, "receivers_expired") >= 1), w.stats()
    room, it = serve_one(client, rx, 6)
    assert rx.wait({room: 1}, 60) and room not in rx.failed, rx.failed.get(room)
    assert_rows(rx, room, it)
    assert_alive(w)
