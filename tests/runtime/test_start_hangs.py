"""A stage that hangs while it starts stops nothing else (issue #37): `run.py serve` in
the pipeline mode; a stage SIGKILLed and its replacement SIGSTOPped the moment it
appears (before it can be ready), or hung inside the tower's load. The worker serves a
fresh room again within heartbeat_timeout_s + 15 s, a room sent right after the kill
concludes within that bound at a receiver that only listens, SIGTERM then exits 0 and
/dev/shm is left clean (the shm_prefix fixture). And a stage that hangs at every start
ends the run, non-zero, within a stated bound.

The bounds asserted are the issue's correctness bounds, with margins for a loaded
machine; every wait is for a condition."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from ipc import shm
from pipeline.peers.client import Client, Item
from pipeline.peers.receiver import Receiver
from tests.helpers import free_port, image, with_sim_tower
from tests.runtime.test_process_supervisor import Listener, probe_until

pytestmark = pytest.mark.timeout(240)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEARTBEAT_S = 4.0
BOUND_S = HEARTBEAT_S + 15  # the issue's: serving again, and a room concluded, within this of the kill
STAGES = ["intake", "cache", "scheduler", "tower", "sender", "reaper"]


class Worker:
    """`run.py serve --mode pipeline --tower sim` in a process group of its own."""

    def __init__(self, prefix: str, run_dir, notify: Listener | None = None, **over):
        self.prefix, self.run_dir = prefix, run_dir
        self.metrics = free_port()
        self.intake, self.bootstrap = f"ipc://{run_dir}/intake.sock", f"tcp://127.0.0.1:{free_port()}"
        flags = dict(mode="pipeline", shm_prefix=prefix, run_dir=str(run_dir), intake=self.intake,
                     bootstrap=self.bootstrap, tower="sim", sim_hidden=64, sim_deepstack_width=32,
                     sim_dtype="bfloat16", pixel_arena_bytes=16 << 20, embedding_arena_bytes=16 << 20,
                     arena_cache_bytes=4 << 20, host_cache_bytes=4 << 20, ring_bytes=1 << 20,
                     max_tombstones=1024, max_live_rooms=256, heartbeat_timeout_s=HEARTBEAT_S,
                     drain_timeout_s=5.0, bootstrap_timeout_s=60.0, restart_window_s=1.0, log_level="INFO",
                     metrics_endpoint=f"127.0.0.1:{self.metrics}")
        flags = with_sim_tower(run_dir, {**flags, **over})  # the sim tower's settings: a file it reads
        cmd = [sys.executable, "run.py", "serve"]
        for key, value in flags.items():
            cmd += ["--" + key.replace("_", "-"), str(value)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
        if notify is not None:
            env["NOTIFY_SOCKET"] = notify.manager.env
        self.err_path = os.path.join(str(run_dir), "stderr")
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, env=env,
                                         start_new_session=True)
        self.ps = psutil.Process(self.proc.pid)
        self.made: list = []
        self.next_room = 1
        self.client: Client | None = None
        self.rx: Receiver | None = None
        self.stopper: Stopper | None = None

    def stderr(self) -> str:
        with open(self.err_path) as f:
            return f.read()[-6000:]

    def stages(self) -> dict[str, int]:
        """The stage processes by their kernel name (`epd-<stage>`), pids."""
        out = {}
        for child in self.ps.children():
            try:
                name = child.name()
            except psutil.NoSuchProcess:
                continue
            if name.startswith("epd-"):
                out[name[4:]] = child.pid
        return out

    def room(self, alloc: bool = True) -> tuple[int, Receiver]:
        """A one-image room through the gateway's client, allocated by a receiver that only
        listens (it never queries)."""
        if self.client is None:
            self.client = Client(self.intake, self.prefix)
            self.rx = Receiver("rx", self.bootstrap, buffer_bytes=4 << 20, query_after_s=None)
            self.made += [self.rx, self.client]
        room, self.next_room = self.next_room, self.next_room + 1
        client, rx = self.client, self.rx
        client.encode(room, f"req-{room}", [Item("image", *image(room, grid=(1, 4, 4)))])
        if alloc:
            rx.alloc(room, 0, span=4, hidden=64, dtype="bfloat16", deepstack_width=32)
        return room, rx

    def served(self, timeout: float) -> bool:
        """Whether a fresh room succeeds within `timeout`: a new one every second or so,
        as a gateway retrying would, until one does."""
        end = time.monotonic() + timeout
        sent = []
        while time.monotonic() < end:
            sent.append(self.room())
            step_end = min(end, time.monotonic() + 1.0)
            while time.monotonic() < step_end:
                for room, rx in sent:
                    if rx.wait({room: 1}, 0.05) and room not in rx.failed:
                        return True
        return False

    def wait_ready(self, timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        while len(self.stages()) < len(STAGES) or not self.served(5.0):
            assert self.proc.poll() is None and time.monotonic() < end, self.stderr()
        assert self.served(30), self.stderr()

    def stop(self) -> int:
        if self.stopper is not None:
            self.stopper.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            self.close()

    def close(self) -> None:
        if self.stopper is not None:
            self.stopper.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for obj in reversed(self.made):
            obj.close()
        self.made = []
        # A request that died in a killed intake's socket leaves its pixel segment the
        # gateway's to remove (docs/design.md, known limit 3): this test's gateway does.
        for name in os.listdir(shm.SHM_DIR):
            if name.startswith(f"{self.prefix}.px."):
                os.unlink(os.path.join(shm.SHM_DIR, name))


class Stopper:
    """SIGSTOPs each new child of the worker the moment it appears (a replacement stage,
    long before it can be ready), up to `count` of them; `stopped` lists their pids."""

    def __init__(self, w: Worker, count: int = 1):
        self.known = {c.pid for c in w.ps.children()}
        self.w, self.count, self.stopped = w, count, []
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running and len(self.stopped) < self.count:
            try:
                children = self.w.ps.children()
            except psutil.NoSuchProcess:
                return
            for c in children:
                if c.pid not in self.known and len(self.stopped) < self.count:
                    self.known.add(c.pid)
                    try:
                        os.kill(c.pid, signal.SIGSTOP)
                        self.stopped.append(c.pid)
                    except ProcessLookupError:
                        pass
            time.sleep(0.002)

    def wait(self, n: int, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while len(self.stopped) < n and time.monotonic() < end:
            time.sleep(0.01)
        assert len(self.stopped) >= n, f"only {len(self.stopped)} replacements appeared"

    def close(self) -> None:
        self.running = False
        self.thread.join(5)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_and_stop_replacements(w: Worker, stages: list[str]):
    """SIGKILL `stages` at once, SIGSTOP each one's replacement as it appears; then send a
    room at once. (the time of the kill, the room, its receiver)."""
    pids = w.stages()
    w.stopper = Stopper(w, count=len(stages))
    killed_at = time.monotonic()
    for stage in stages:
        os.kill(pids[stage], signal.SIGKILL)
    room, rx = w.room()
    w.stopper.wait(len(stages))
    return killed_at, room, rx


def assert_concluded(w: Worker, room: int, rx: Receiver, killed_at: float, stages: list[str]) -> None:
    """The room sent right after the kill concluded within the bound: succeeded, or failed
    with a reason that names a stage that was down."""
    assert rx.wait({room: 1}, max(0.0, killed_at + BOUND_S + 5 - time.monotonic())), \
        f"room {room} did not conclude within {BOUND_S} s of the kill\n" + w.stderr()
    if room in rx.failed:
        assert any(s in rx.failed[room] for s in stages), rx.failed[room]


@pytest.mark.parametrize("stage", STAGES)
def test_a_replacement_stopped_while_it_starts_holds_up_nothing(stage, shm_prefix, tmp_path):
    w = Worker(shm_prefix, tmp_path)
    try:
        w.wait_ready()
        before = w.stages()
        killed_at, room, rx = kill_and_stop_replacements(w, [stage])
        # Meanwhile the loop turns (/healthz), and /readyz says which stage is not ready, since when.
        code, body = probe_until(w.metrics, "/readyz", lambda c, b: c == 503 and stage in b.get("not_ready", ()),
                                 timeout=BOUND_S)
        assert code == 503 and stage in body["not_ready_since"] and stage in body["not_ready_for_s"], body
        assert probe_until(w.metrics, "/healthz", lambda c, _: c == 200, timeout=10)[0] == 200
        # The stopped replacement is given up and replaced: served again within the bound.
        assert w.served(killed_at + BOUND_S + 5 - time.monotonic()), w.stderr()
        assert_concluded(w, room, rx, killed_at, [stage])
        assert gone(w.stopper.stopped[0]), "the stopped replacement was left running"
        after = w.stages()
        assert after[stage] != before[stage] and all(after[s] == before[s] for s in STAGES if s != stage)
        assert psutil.Process(after[stage]).cmdline()[0] == f"epd-worker: {stage}"
        assert w.stop() == 0, w.stderr()
    finally:
        w.close()


def test_two_stages_starting_at_once(shm_prefix, tmp_path):
    listener = Listener(str(tmp_path / "notify"))
    w = Worker(shm_prefix, tmp_path, notify=listener)
    try:
        w.wait_ready()
        killed_at, room, rx = kill_and_stop_replacements(w, ["scheduler", "sender"])
        assert w.served(killed_at + BOUND_S + 5 - time.monotonic()), w.stderr()
        assert_concluded(w, room, rx, killed_at, ["scheduler", "sender"])
        # The service manager heard which stages were not ready, and since when, and then "serving".
        with listener.lock:
            statuses = [line for _, lines in listener.got for line in lines if line.startswith("STATUS=")]
        degraded = [line for line in statuses if "not ready since" in line]
        assert any("the scheduler stage" in line for line in degraded), statuses
        assert any("the sender stage" in line for line in degraded), statuses
        assert "STATUS=serving" in statuses[statuses.index(degraded[-1]):], statuses
        assert w.stop() == 0, w.stderr()
    finally:
        w.close()
        listener.close()


def test_a_tower_load_that_stops_progressing_is_a_hang_one_that_progresses_is_not(shm_prefix, tmp_path):
    stall = tmp_path / "stall"
    # The tower's load takes longer than stage_start_timeout_s, and progresses: left alone.
    w = Worker(shm_prefix, tmp_path, sim_load_s=8.0, stage_start_timeout_s=5.0, sim_load_stall_file=stall)
    try:
        w.wait_ready()
        assert "restarted the tower" not in w.stderr() and "failed to start" not in w.stderr()
        tower = w.stages()["tower"]
        stall.touch()
        killed_at = time.monotonic()
        os.kill(tower, signal.SIGKILL)
        room, rx = w.room()
        # Its replacement's load makes no progress: given up after heartbeat_timeout_s without
        # progress; the next one loads.
        end = time.monotonic() + 60
        while "made no load progress" not in w.stderr():
            assert time.monotonic() < end, w.stderr()
            time.sleep(0.05)
        stall.unlink()
        assert w.served(killed_at + BOUND_S + 10 - time.monotonic()), w.stderr()
        assert_concluded(w, room, rx, killed_at, ["tower"])
        assert w.stop() == 0, w.stderr()
    finally:
        w.close()


def test_a_stage_that_hangs_at_every_start_ends_the_run(shm_prefix, tmp_path):
    limit, start_s = 2, 5.0
    w = Worker(shm_prefix, tmp_path, restart_limit=limit, stage_start_timeout_s=start_s)
    try:
        w.wait_ready()
        pids = w.stages()
        w.stopper = Stopper(w, count=100)
        killed_at = time.monotonic()
        os.kill(pids["cache"], signal.SIGKILL)
        # The bound: restart_limit + 1 starts, each its start bound and a backoff of at most
        # 2 s, then the stop (rooms failed, stages stopped); margins for a loaded machine.
        bound = (limit + 1) * (start_s + 2.0) + 30
        code = w.proc.wait(bound)
        assert code == 1, w.stderr()
        assert time.monotonic() - killed_at < bound
        assert "could not be restarted" in w.stderr() or "giving up" in w.stderr(), w.stderr()
        assert not shm.list_objects(shm_prefix)
    finally:
        w.close()


def test_a_request_lost_in_a_dead_intakes_socket_is_answered_within_the_bound(shm_prefix, tmp_path):
    """A request in a stopped intake's socket dies with it when it is killed; the receiver
    that allocated for it hears `failed`, naming intake, within the bound, not at
    bootstrap_timeout_s (60 s here)."""
    w = Worker(shm_prefix, tmp_path)
    try:
        w.wait_ready()
        intake = w.stages()["intake"]
        os.kill(intake, signal.SIGSTOP)
        room, rx = w.room()  # its request waits in the stopped intake's socket; its alloc is held
        time.sleep(0.5)  # nothing to wait on: the frame's way into a stopped process's socket
        killed_at = time.monotonic()
        os.kill(intake, signal.SIGKILL)
        assert_concluded(w, room, rx, killed_at, ["intake"])
        assert room in rx.failed, "the request was not lost: this test tests nothing"
        assert w.served(30), w.stderr()
        assert w.stop() == 0, w.stderr()
    finally:
        w.close()


# ------------------------------------------------------------------ the bound, without processes
class _Alive:
    pid, exitcode = 1, None

    def is_alive(self) -> bool:
        return True


class _Silent:
    def poll(self, timeout=0) -> bool:
        return False


def _start(name: str, short=8.0, stall=4.0, cap=300.0):
    from pipeline.runtime.starts import Start

    return Start(name, _Alive(), _Silent(), spawned_at=100.0, short_s=short, stall_s=stall, cap_s=cap)


def test_a_stage_that_loads_nothing_has_the_short_bound_whatever_its_heartbeat_says():
    from pipeline.runtime.boards import Heartbeats
    from pipeline.runtime.starts import FAILED, WAITING

    row = [0.0] * Heartbeats.FIELDS
    row[Heartbeats.BEAT] = 107.9
    st = _start("sender")
    assert st.poll(row, 107.9)[0] == WAITING
    state, why = st.poll(row, 108.1)
    assert state == FAILED and "stage_start_timeout_s" in why


def test_a_tower_is_given_up_only_when_its_load_stops_progressing_or_at_the_cap():
    from pipeline.runtime.boards import Heartbeats
    from pipeline.runtime.starts import FAILED, WAITING

    row = [0.0] * Heartbeats.FIELDS
    st = _start("tower0")
    for now in (101.0, 120.0, 200.0, 399.0):  # progress a moment ago, each time: a slow load
        row[Heartbeats.BEAT] = now - 1.0
        assert st.poll(row, now)[0] == WAITING, now
    assert st.poll(row, 400.5)[0] == FAILED  # start_timeout_s caps it
    row[Heartbeats.BEAT] = 150.0
    assert st.poll(row, 153.9)[0] == WAITING
    state, why = st.poll(row, 154.1)  # no progress for heartbeat_timeout_s
    assert state == FAILED and "no load progress" in why
    row[Heartbeats.BEAT] = 100.0  # none at all: no sooner than the short bound
    assert st.poll(row, 107.9)[0] == WAITING and st.poll(row, 108.1)[0] == FAILED
