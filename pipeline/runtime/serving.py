"""What both modes do around their stages: start-up checks, the run's shared objects
and their close (RunResources), serving, the drain and health (Serving), and signals.
The in-process worker (pipeline/runtime/inprocess.py) and the supervisor of the stage processes
(pipeline/runtime/supervisor.py) each own one of each, and give Serving their StageControl.
"""
from __future__ import annotations

import resource
import signal
import time
from typing import Protocol

from ipc import ordering, shm
from ipc.rooms import RoomState
from pipeline.runtime import wiring
from pipeline.cli.config import WorkerConfig
from pipeline.ops.notify import Notifier
from stages.records import RoomsLost
from stages.status_pusher import FDS_PER_SOCKET, SLOTS_PER_SOCKET

# Open files the worker takes besides its status sockets (its own sockets, the rings'
# and tables' descriptors, Mooncake's, the libraries'): the common default soft limit,
# under which it ran before status sockets were bounded.
BASE_OPEN_FILES = 1024

SHUTTING_DOWN = "worker shutting down"


class SignalFlag:
    """A stop flag that a signal handler sets: what `threading.Event` offers, without its lock.

    A Python signal handler runs in the main thread between two bytecodes of whatever
    it interrupted, and a second signal's handler can run inside the first one's.
    `Event.set` takes a lock that is not reentrant, so a handler that sets an Event
    deadlocks when it interrupts code holding that lock: the main thread in
    `Event.wait`, or the first handler inside `set` (a stage that got the supervisor's
    two SIGTERMs back to back hung until it was SIGKILLed). Setting an attribute
    cannot block."""

    def __init__(self):
        self._set = False

    def set(self, *_signal) -> None:
        """Also a signal handler as it is (`signal.signal(SIGTERM, flag.set)`)."""
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Sleeps `timeout` unless set (a signal may cut it short); whether it is set."""
        if not self._set:
            time.sleep(timeout)
        return self._set


class StartError(RuntimeError):
    """The worker could not start (exit code 3); the message says why."""


def open_files_needed(cfg: WorkerConfig) -> int:
    """The open-file limit the worker's bounds need in its largest process (the in-process
    worker, or the reaper's): a status socket closed holds its files until ZeroMQ reaps it."""
    return BASE_OPEN_FILES + FDS_PER_SOCKET * SLOTS_PER_SOCKET * cfg.max_status_sockets


def raise_open_file_limit(cfg: WorkerConfig) -> int:
    """Raise this process's soft RLIMIT_NOFILE (up to the hard limit) to what the bounds
    need; stage processes inherit it. StartError, naming the bound to lower, when the hard
    limit is below it. Returns the soft limit now in force."""
    need = open_files_needed(cfg)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    if hard != resource.RLIM_INFINITY and hard < need:
        fits = max(0, (hard - BASE_OPEN_FILES) // (FDS_PER_SOCKET * SLOTS_PER_SOCKET))
        raise StartError(
            f"the open-file limit (RLIMIT_NOFILE, hard {hard}) is below the {need} the worker's bounds need "
            f"({BASE_OPEN_FILES} + {FDS_PER_SOCKET * SLOTS_PER_SOCKET} per status socket, max_status_sockets "
            f"{cfg.max_status_sockets}): lower max_status_sockets to {fits} or less, or raise the hard limit "
            f"(ulimit -Hn, or LimitNOFILE= in the service's unit)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return need


class RunResources:
    """A run's shared objects, from start-up checks to close: what both modes own.

    Start-up, in this order so that a failure leaves nothing behind: sweep what a dead
    run of this prefix left, check that /dev/shm can hold everything (`needs`, bytes by
    what), take the run lock (its id names every object), make the run directory, then
    create the arenas and the room table."""

    def __init__(self, cfg: WorkerConfig, needs: dict[str, int] | None = None, placement: dict | None = None):
        try:  # before anything is made: the rings' barriers must be in place on this CPU
            ordering.check_cpu()
        except ordering.UnsupportedCPU as e:
            raise StartError(str(e)) from None
        # Before any stage process exists: it takes NOTIFY_SOCKET out of the environment
        # they inherit, so the service manager hears from this process alone.
        self.notifier = Notifier()
        self.notifier.status("starting: creating the shared memory")
        self.cfg = cfg = cfg.resolved().validate()
        self.objects = []  # closed and unlinked at close(), last made first
        raise_open_file_limit(cfg)  # before any stage process exists: they inherit it
        shm.sweep(cfg.shm_prefix)
        # Clients' pixel segments no worker took and whose creator has exited: nobody
        # else would ever remove them.
        shm.sweep_pixel_segments(cfg.shm_prefix)
        shm.require_free({"pixel arena": cfg.pixel_arena_bytes, "embedding arena": cfg.embedding_arena_bytes,
                          "receiver and told tables": wiring.tables_bytes(cfg), **(needs or {})})
        self.lock = shm.RunLock(cfg.shm_prefix)
        self.run_id = self.lock.run_id
        try:
            shm.private_dir(cfg.run_dir)
            self.shared = wiring.create_shared(cfg, self.run_id, self.own, placement)
        except BaseException:
            self.close()
            raise
        self.rooms = self.shared.rooms

    def own(self, obj):
        """Take a shared object to close and unlink at close()."""
        self.objects.append(obj)
        return obj

    def live_rooms(self) -> list:
        return [e for e in self.rooms.entries() if e.state < RoomState.SUCCESS]

    def close(self) -> None:
        for obj in reversed(self.objects):
            obj.close()
            obj.unlink()
        self.objects = []
        wiring.unlink_ipc(self.cfg.intake)
        if self.lock is not None:
            shm.sweep(self.cfg.shm_prefix, self.lock.run_id, include_live=True)
            self.lock.release()
            self.lock = None


class StageControl(Protocol):
    """What serving and the drain ask of a mode's stages: the in-process worker runs them
    in its loop, the supervisor watches their processes."""

    fatal: str | None  # why the run cannot go on (a stage kept dying); None while it can

    def watch(self, stop: SignalFlag) -> None:
        """One turn of serving: run the stages, or watch their processes."""

    def poll(self) -> None:
        """A short step of the work (or of watching it), for the drain's waits."""

    def close_intake(self, refusing: str = "") -> None:
        """The request stage reads what is in its socket now, then no more; with
        `refusing`, it fails each of those requests with that reason instead of doing it."""

    def intake_closed(self) -> bool:
        """Whether it has read its socket to the end and handled what it read."""

    def tell_reaper(self, record) -> bool:
        """Hand the reaper a record; False if no reaper is there to take it."""

    def settled(self) -> bool:
        """Whether what the reaper decided (fences, statuses) has gone out."""

    def stop_all(self) -> None:
        """Stop every stage (after a drain, or when the run cannot go on)."""

    def heartbeat_ages(self) -> dict[str, float | None]:
        """Seconds since each stage process beat (None: not running or not ready yet)."""

    def stages_not_ready(self) -> list[str]:
        """The stages that cannot take work now."""

    def stages_not_ready_since(self) -> dict[str, float]:
        """Those stages, each with the time.monotonic() since which it has not been ready."""


class Serving:
    """Serving a run until a stop, the drain, and what /healthz reports of it: the same in
    both modes, over the run's resources and the mode's StageControl."""

    def __init__(self, run: RunResources, control: StageControl):
        self.run = run
        self.control = control
        self.draining = False
        self.turned_at: float | None = None  # when the loop last went round
        self.told_not_ready: tuple = ()  # the stages the last STATUS= named as not ready

    def serve(self, stop: SignalFlag, second: SignalFlag | None = None) -> int:
        """Serve until `stop`; then drain for drain_timeout_s (none once `second` is set)
        and stop. Returns 0, or 1 if the run could not go on."""
        second = second or SignalFlag()
        while not stop.is_set() and self.control.fatal is None:
            self.control.watch(stop)
            self.turned()
        if self.control.fatal is None:
            self.drain(0.0 if second.is_set() else self.run.cfg.drain_timeout_s, second.is_set)
            self.control.stop_all()
            return 0
        self.run.notifier.stopping(f"stopping: {self.control.fatal}")
        self.fail_live(f"worker stopped: {self.control.fatal}")
        self.control.stop_all()
        return 1

    def turned(self) -> None:
        """The loop (serving, draining, or starting the stages) went round: what /healthz
        and the service manager's watchdog go by. It never waits on one stage, so this
        means the supervisor is alive, not that it is stuck waiting."""
        self.turned_at = time.monotonic()
        self.run.notifier.watchdog(self.control.heartbeat_ages(), self.turned_at)
        if self.run.notifier.enabled and self.run.notifier.is_ready and not self.draining:
            since = self.control.stages_not_ready_since()
            if tuple(since) != self.told_not_ready:
                self.told_not_ready = tuple(since)
                self.run.notifier.status(not_ready_text(since, self.turned_at) if since else "serving")

    def health(self) -> dict:
        """The conditions of the /healthz and /readyz probes (pipeline.ops.metrics.READY_WHEN);
        called on the metrics endpoint's thread."""
        turned = self.turned_at
        not_ready = self.control.stages_not_ready()
        now = time.monotonic()
        since = self.control.stages_not_ready_since()
        return {"loop_alive": turned is not None
                and now - turned < max(2.0, self.run.cfg.heartbeat_timeout_s),
                "stages_ready": not not_ready, "not_ready": not_ready,
                "not_ready_since": {name: _wall(t, now) for name, t in since.items()},
                "not_ready_for_s": {name: round(now - t, 1) for name, t in since.items()},
                "draining": self.draining, "restart_budget_left": self.control.fatal is None}

    def drain(self, deadline_s: float, cut_short=lambda: False) -> None:
        """Take no new requests, but every one already received concludes: the intake
        reads what is in its socket, rooms in flight may finish until the deadline (or
        until `cut_short()`); then whatever the intake still reads and every live room
        fails with "worker shutting down", and allocs held for rooms never seen are
        answered."""
        control, live_rooms = self.control, self.run.live_rooms
        self.draining = True
        self.run.notifier.stopping(f"draining: {len(live_rooms())} rooms in flight, "
                                   f"up to {deadline_s:g} s")
        control.close_intake()
        self.wait(lambda: (control.intake_closed() and not live_rooms()) or cut_short(), deadline_s)
        control.close_intake(refusing=SHUTTING_DOWN)
        self.wait(control.intake_closed, 5.0)
        self.fail_live(SHUTTING_DOWN)

    def fail_live(self, reason: str) -> None:
        """Fail every live room through the reaper (so receivers hear), then in the table
        for any the reaper could not reach."""
        live_rooms = self.run.live_rooms
        live = tuple((e.slot, e.room) for e in live_rooms())
        if live and self.control.tell_reaper(RoomsLost(live, reason)):
            self.wait(lambda: not live_rooms(), 5.0)
            self.wait(self.control.settled, 2.0)  # the sender's fence and the reaper's statuses
        for e in live_rooms():
            self.run.rooms.fail(e.slot, e.room, reason)

    def wait(self, done, timeout: float) -> None:
        """Step the stages until `done()`, for at most `timeout` seconds."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and not done():
            self.control.poll()
            self.turned()


def _wall(t: float, now: float) -> str:
    """A time.monotonic() `t` as UTC wall-clock time (ISO 8601, seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - (now - t)))


def not_ready_text(since: dict[str, float], now: float) -> str:
    """STATUS= while stages are not ready: which, and since when."""
    return "serving, degraded: " + "; ".join(
        f"the {name} stage not ready since {_wall(t, now)} ({now - t:.0f} s)" for name, t in since.items())


def serve_until_signalled(make, announce) -> int:
    """`run.py serve`: start the runtime `make()` builds, serve until SIGTERM/SIGINT, drain
    for drain_timeout_s (a second signal, before or during it, skips the rest), close.
    Returns the runtime's exit code; StartError if it could not start."""
    stop, second = SignalFlag(), SignalFlag()

    def on_signal(signum, _frame):
        (second if stop.is_set() else stop).set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        rt = make()
    except StartError:
        raise
    except Exception as e:  # /dev/shm too small, a run dir we cannot make, a port taken, ...
        raise StartError(str(e)) from e
    try:
        announce(rt)
        rt.run.notifier.ready(f"serving: intake {rt.cfg.intake}, bootstrap {rt.cfg.bootstrap}")
        return rt.serving.serve(stop, second)
    finally:
        rt.close()
