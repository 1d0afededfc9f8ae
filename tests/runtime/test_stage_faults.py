"""The multi-process pipeline under faults: stages SIGKILLed or hung under load, a crash
loop, SIGTERM. Real processes, real Mooncake over loopback TCP, the sim tower."""
from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from pipeline.peers.client import Client, Item
from pipeline.peers.receiver import Receiver
from stages import registry
from tests.helpers import PipelineWorker, expected_sim_rows, free_port, image, sim_config, with_sim_tower

pytestmark = pytest.mark.timeout(300)
_rooms = itertools.count(1)


@pytest.fixture
def pipeline(worker_rig):
    def start(**over):
        over.setdefault("bootstrap_timeout_s", 3.0)
        over.setdefault("sim_time_per_row_s", 2e-4)  # a steady trickle through the tower
        w, client, (r,) = worker_rig("pipeline", **over)
        return w, client, r

    return start


class Load:
    """Rooms of one or two items (some images repeated), sent at a steady pace."""

    def __init__(self, w, client, r, seed):
        self.w, self.client, self.r = w, client, r
        self.rng = random.Random(seed)
        self.sent: dict[int, list[Item]] = {}

    def send(self, n: int, pause: float = 0.01) -> None:
        spec = self.w.spec
        for _ in range(n):
            room = next(_rooms)
            items = [Item("image", *image(self.rng.randrange(40), grid=(1, 4, 2 * self.rng.randrange(1, 4))))
                     for _ in range(self.rng.choice((1, 1, 2)))]
            self.client.encode(room, f"load-{room}", items)
            for i, it in enumerate(items):
                span = sum(t * h * w for t, h, w in it.grid_thw) // spec.merge ** 2
                self.r.alloc(room, i, span=span, hidden=spec.hidden, dtype=spec.dtype,
                             deepstack_width=spec.deepstack_width)
            self.sent[room] = items
            self.r.poll(0)
            time.sleep(pause)

    def settle(self, timeout: float = 60.0) -> None:
        """Every room concludes; every success is bit-exact; the receiver saw no breach."""
        assert self.r.wait({room: len(items) for room, items in self.sent.items()}, timeout), \
            f"rooms left hanging: {[x for x, it in self.sent.items() if not self.r.concluded(x, len(it))]}"
        spec = self.w.spec
        for room, items in self.sent.items():
            if room in self.r.failed:
                continue
            for i, it in enumerate(items):
                span = sum(t * h * w for t, h, w in it.grid_thw) // spec.merge ** 2
                want_main, want_deep = expected_sim_rows(it.pixels, it.modality, span, spec.hidden,
                                                         spec.deepstack_width, spec.dtype)
                main, deep = self.r.rows(room, i)
                assert (main == want_main).all() and (deep == want_deep).all(), f"room {room} item {i}"
        self.r.poll(0.3)
        assert not self.r.violations, self.r.violations


def stage_pid(w, stage: str) -> int:
    return w.runtime.procs[stage].pid


def wait_restarted(w, stage: str, times: int = 1, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if w.runtime.restart_counts[stage] >= times:
            return
        time.sleep(0.05)
    raise AssertionError(f"the {stage} stage was not restarted")


@pytest.mark.parametrize("stage", registry.stage_names(1))
def test_sigkill_each_stage_under_load(pipeline, stage):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    w, client, r = pipeline()
    load = Load(w, client, r, seed)
    load.send(25)
    os.kill(stage_pid(w, stage), signal.SIGKILL)
    load.send(25)
    wait_restarted(w, stage)
    load.send(15)
    load.settle()
    failed = {room: reason for room, reason in r.failed.items() if room in load.sent}
    for room, reason in failed.items():
        # A request still in the dead intake's socket buffers was never seen by the worker:
        # its receiver's allocs are answered "unknown room".
        assert stage in reason or (stage == "intake" and reason == "unknown room"), \
            f"room {room} failed for another reason: {reason}"
    # the pipeline still serves: rooms sent after the restart succeed
    later = list(load.sent)[-10:]
    assert not [room for room in later if room in r.failed], failed
    left = [n for n in os.listdir("/dev/shm") if n.startswith(w.cfg.shm_prefix + ".px.")]
    if stage == "intake":
        # Requests lost in the dead intake's socket were never received: their segments
        # are still the gateway's, as many as rooms answered "unknown room" at most.
        assert len(left) <= 2 * sum(1 for x in failed.values() if x == "unknown room")
        for n in left:
            os.unlink("/dev/shm/" + n)
    else:
        assert not left, left


def test_hung_stage_is_killed_and_restarted(pipeline):
    w, client, r = pipeline(heartbeat_timeout_s=1.0)
    load = Load(w, client, r, 1)
    load.send(10)
    os.kill(stage_pid(w, "cache"), signal.SIGSTOP)
    load.send(10)
    wait_restarted(w, "cache")
    load.send(10)
    load.settle()
    failed = {room: reason for room, reason in r.failed.items() if room in load.sent}
    assert all("cache" in reason for reason in failed.values()), failed
    later = list(load.sent)[-10:]  # sent after the hung cache was replaced: all served
    assert not [room for room in later if room in r.failed], failed


def _zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_hung_stage_is_killed_while_the_supervisor_waits_for_a_lock(pipeline):
    """A stage stopped while it holds an arena's lock blocks whoever wants that lock next,
    the supervisor reclaiming a dead stage's references included: hung stages are killed
    by a thread of the supervisor's that takes no lock, and killing frees the lock."""
    w, client, r = pipeline(heartbeat_timeout_s=1.0)
    load = Load(w, client, r, 2)
    load.send(10)
    lock = w.runtime.shared.pixel_arena._lock  # stands in for a stopped stage holding it
    lock.acquire()
    try:
        os.kill(stage_pid(w, "cache"), signal.SIGKILL)  # its reclaim now waits for the lock
        stopped = stage_pid(w, "scheduler")
        os.kill(stopped, signal.SIGSTOP)
        end = time.monotonic() + 60
        while not _zombie_or_gone(stopped):
            assert time.monotonic() < end, "the stopped scheduler was not killed while the supervisor waited"
            time.sleep(0.05)
    finally:
        lock.release()
    wait_restarted(w, "cache")
    wait_restarted(w, "scheduler")
    load.send(10)
    load.settle()
    later = list(load.sent)[-5:]
    assert not [room for room in later if room in r.failed], r.failed


def crash_loop(shm_prefix, tmp_path, victim: str, n_rooms: int, first_image: int, **over) -> None:
    """Kill `victim` three times with restart_limit 2: the run ends (exit 1, the victim
    named), and every room it had concludes at the receiver."""
    w = PipelineWorker(sim_config(shm_prefix, tmp_path, restart_limit=2, restart_window_s=60,
                                  bootstrap_timeout_s=3.0, sim_time_per_row_s=0.01, **over))
    client = Client(w.cfg.intake, shm_prefix)
    r = Receiver("rx", w.cfg.bootstrap)
    try:
        spec = w.spec
        rooms = []
        for k in range(n_rooms):
            room = next(_rooms)
            client.encode(room, "cl", [Item("image", *image(first_image + k, grid=(1, 8, 8)))])
            r.alloc(room, 0, span=16, hidden=spec.hidden, dtype=spec.dtype, deepstack_width=spec.deepstack_width)
            rooms.append(room)
        time.sleep(0.3)
        for n in range(3):
            os.kill(stage_pid(w, victim), signal.SIGKILL)
            if n < 2:
                wait_restarted(w, victim, n + 1)
        w.thread.join(60)
        assert w.code == 1
        assert victim in w.runtime.fatal
        assert not w.runtime.run.live_rooms()
        r.wait({room: 1 for room in rooms}, 10)
        assert all(r.concluded(room, 1) for room in rooms)
    finally:
        client.close()
        r.close()
        w.close()


def test_crash_loop_trips_the_restart_limit(shm_prefix, tmp_path):
    crash_loop(shm_prefix, tmp_path, "tower", 5, 200)


@pytest.mark.parametrize("mode", ["pipeline", "inprocess"])
@pytest.mark.parametrize("drain_s", ["10", "0.3"])
def test_sigterm_right_after_a_burst_concludes_every_room_received(mode, drain_s, shm_prefix, tmp_path):
    """`run.py serve` as an operator runs it: SIGTERM just after a burst of 80 rooms (allocs
    sent). The intake reads what is in its socket: every room concludes at the receiver
    (success, or "worker shutting down" once the drain's time is up), no segment is left,
    exit 0."""
    port = free_port()
    sim = with_sim_tower(tmp_path, dict(tower="sim", sim_hidden=64, sim_deepstack_width=32, sim_time_per_row_s=0.0005))
    cmd = [sys.executable, "run.py", "serve", "--mode", mode, "--shm-prefix", shm_prefix,
           "--intake", f"ipc://{tmp_path}/intake.sock", "--bootstrap", f"tcp://127.0.0.1:{port}",
           "--run-dir", str(tmp_path), "--tower", "sim", "--tower-config", sim["tower_config"],
           "--pixel-arena-bytes", str(64 << 20), "--embedding-arena-bytes", str(32 << 20),
           "--arena-cache-bytes", str(8 << 20), "--max-tombstones", "1024", "--max-live-rooms", "256",
           "--drain-timeout-s", drain_s]
    proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # printed once every stage is ready
        assert line.startswith("serving"), f"{line!r}, exit code {proc.poll()}"
        client = Client(f"ipc://{tmp_path}/intake.sock", shm_prefix)
        r = Receiver("rx", f"tcp://127.0.0.1:{port}")
        sent = {}
        for k in range(80):
            room = next(_rooms)
            client.encode(room, "t", [Item("image", *image(300 + k, grid=(1, 8, 8)))])
            r.alloc(room, 0, span=16, hidden=64, dtype="bfloat16", deepstack_width=32)
            sent[room] = 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert r.wait(sent, 10), f"rooms left without a status: {[x for x in sent if not r.concluded(x, 1)]}"
        assert set(r.failed.values()) <= {"worker shutting down"}, r.failed
        assert not r.violations
        client.close()
        r.close()
        left = [n for n in os.listdir("/dev/shm") if n.startswith(shm_prefix)]
        assert not left, f"segments left: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sender_and_reaper_killed_together_keep_the_registrations(pipeline):
    """Neither can give the other the registrations back (issue #11: allocs were then
    dropped as "from unregistered receiver"): the receiver table in shared memory does.
    A receiver that registered before both died, and never again, still gets its rooms."""
    w, client, r = pipeline()
    load = Load(w, client, r, 7)
    load.send(10)
    load.settle()
    os.kill(stage_pid(w, "sender"), signal.SIGKILL)
    time.sleep(random.uniform(0, 0.05))
    os.kill(stage_pid(w, "reaper"), signal.SIGKILL)
    wait_restarted(w, "sender")
    wait_restarted(w, "reaper")
    after = Load(w, client, r, 8)
    after.send(10)
    after.settle()
    assert not [room for room in after.sent if room in r.failed], r.failed


def test_an_alloc_held_for_an_unseen_room_is_answered_after_the_sender_dies(shm_prefix, tmp_path):
    """docs/protocol.md §4: an alloc for a room the worker has not seen is held, then answered
    "unknown room". A sender SIGKILLed while it holds one: its successor answers it."""
    w = PipelineWorker(sim_config(shm_prefix, tmp_path, bootstrap_timeout_s=2.0))
    r = Receiver("rx0", w.cfg.bootstrap, buffer_bytes=1 << 20)
    try:
        r.alloc(9001, 0, span=4, hidden=64, dtype="bfloat16", deepstack_width=32)
        end = time.monotonic() + 30
        while w.stats().get("sender_held_allocs") != 1:
            assert time.monotonic() < end, "the sender never held the alloc"
        os.kill(w.runtime.procs["sender"].pid, signal.SIGKILL)
        wait_restarted(w, "sender")
        assert r.wait({9001: 1}, 30), "the receiver was never answered"
        assert r.failed[9001] == "unknown room"
        # The restarted sender serves a fresh room, bit-exact.
        client = Client(w.cfg.intake, shm_prefix)
        try:
            grid, px = image(3, grid=(1, 4, 4))
            client.encode(9002, "after", [Item("image", grid, px)])
            r.alloc(9002, 0, span=4, hidden=64, dtype="bfloat16", deepstack_width=32)
            assert r.wait({9002: 1}, 30) and 9002 not in r.failed, r.failed.get(9002)
            main, deep = r.rows(9002, 0)
            want_main, want_deep = expected_sim_rows(px, "image", 4, 64, 32, "bfloat16")
            assert (main == want_main).all() and (deep == want_deep).all()
        finally:
            client.close()
    finally:
        r.close()
        w.close()


_STOPPABLE_RECEIVER = """
import sys
from pipeline.peers.receiver import Receiver
bootstrap, room = sys.argv[1], int(sys.argv[2])
r = Receiver("rx-stopped", bootstrap, buffer_bytes=1 << 20)
r.alloc(room, 0, span=4, hidden=64, dtype="bfloat16", deepstack_width=32, fanout=2, row_start=2, n_rows=2)
print("allocated", flush=True)
sys.stdin.read()
"""


def test_a_sender_killed_while_it_fences_a_failed_room_leaves_no_receiver_waiting(shm_prefix, tmp_path):
    """Issue #11's hung rooms of the dense soak: a room fails while the sender still has a
    write in flight (to a receiver that stalls), so the reaper marks it Failed and waits for
    the sender's Fenced before it tells anyone; the sender is killed meanwhile. The room is
    no longer live, so it must still be among the rooms the dead sender held, and its
    receivers told: here the other receiver, which already had its `success` for its
    shard, hears `failed` (docs/protocol.md §3: every receiver that allocated gets one)."""
    from ipc.rooms import RoomState

    w = PipelineWorker(sim_config(shm_prefix, tmp_path, bootstrap_timeout_s=30.0))
    client = Client(w.cfg.intake, shm_prefix)
    r = Receiver("rx", w.cfg.bootstrap, buffer_bytes=1 << 20)
    room = next(_rooms)
    stalled = subprocess.Popen([sys.executable, "-c", _STOPPABLE_RECEIVER, w.cfg.bootstrap, str(room)],
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert stalled.stdout.readline().strip() == "allocated"
        end = time.monotonic() + 30
        while w.stats().get("sender_held_allocs") != 1:  # its alloc is in: held for the unseen room
            assert time.monotonic() < end, "the sender never held the stalled receiver's alloc"
        os.kill(stalled.pid, signal.SIGSTOP)  # its Mooncake server stops answering: the write hangs
        spec = w.spec
        client.encode(room, "stall", [Item("image", *image(1, grid=(1, 4, 4)))])
        r.alloc(room, 0, span=4, hidden=spec.hidden, dtype=spec.dtype, deepstack_width=spec.deepstack_width,
                fanout=2, row_start=0, n_rows=2)
        end = time.monotonic() + 30
        while (room, 0) not in r.success:
            assert time.monotonic() < end and not r.failed, (r.success, r.failed)
            r.poll(0.1)
        r.cancel(room)  # the sender fails and fences the room: its write to rx-stopped is in flight
        end = time.monotonic() + 30
        while True:
            slot = w.runtime.rooms.find(room)
            entry = w.runtime.rooms.get(slot) if slot is not None else None
            if entry is not None and entry.state == RoomState.FAILED:
                break
            assert time.monotonic() < end, f"the room never failed: {entry}"
            time.sleep(0.02)
        r.poll(0.2)
        assert room not in r.failed, "told before the fence (the write to the stopped receiver is in flight)"
        os.kill(stage_pid(w, "sender"), signal.SIGKILL)
        wait_restarted(w, "sender")
        # It reads what the dead sender's connection still carried: only once that has landed
        # (or LATE_BYTES_BOUND_S has passed) are the room's receivers told (issue #24).
        os.kill(stalled.pid, signal.SIGCONT)
        end = time.monotonic() + 20
        while room not in r.failed and time.monotonic() < end:
            r.poll(0.1)
        assert r.failed.get(room) == "canceled", "the receiver was never told the room failed"
        # The restarted sender serves: a fresh room's rows, bit-exact.
        fresh, grid_px = next(_rooms), image(2, grid=(1, 4, 4))
        client.encode(fresh, "after", [Item("image", *grid_px)])
        r.alloc(fresh, 0, span=4, hidden=spec.hidden, dtype=spec.dtype, deepstack_width=spec.deepstack_width)
        assert r.wait({fresh: 1}, 30) and fresh not in r.failed, r.failed.get(fresh)
        want_main, want_deep = expected_sim_rows(grid_px[1], "image", 4, spec.hidden, spec.deepstack_width,
                                                 spec.dtype)
        main, deep = r.rows(fresh, 0)
        assert (main == want_main).all() and (deep == want_deep).all()
        assert not r.violations, r.violations
    finally:
        stalled.kill()
        stalled.wait()
        client.close()
        r.close()
        w.close()
