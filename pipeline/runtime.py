"""What both modes do around their stages: start-up checks, the run's shared objects,
the drain, signals and close. The in-process worker (pipeline/inprocess.py) and the
supervisor of the stage processes (pipeline/supervisor.py) are the two `Runtime`s.
"""
from __future__ import annotations

import signal
import time

from ipc import shm
from ipc.rooms import RoomState
from pipeline import wiring
from pipeline.config import WorkerConfig
from pipeline.notify import Notifier
from stages.records import RoomsLost

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


class Runtime:
    """A run of the worker: owns its shared objects from start-up checks to close.

    Start-up, in this order so that a failure leaves nothing behind: sweep what a dead
    run of this prefix left, check that /dev/shm can hold everything (`needs`, bytes by
    what), take the run lock (its id names every object), make the run directory, then
    create the arenas and the room table."""

    def __init__(self, cfg: WorkerConfig, needs: dict[str, int] | None = None, placement: dict | None = None):
        # Before any stage process exists: it takes NOTIFY_SOCKET out of the environment
        # they inherit, so the service manager hears from this process alone.
        self.notifier = Notifier()
        self.notifier.status("starting: creating the shared memory")
        self.cfg = cfg = cfg.resolved().validate()
        self._objects = []
        self.lock = None
        shm.sweep(cfg.shm_prefix)
        shm.require_free({"pixel arena": cfg.pixel_arena_bytes, "embedding arena": cfg.embedding_arena_bytes,
                          "receiver and told tables": wiring.tables_bytes(cfg), **(needs or {})})
        self.lock = shm.RunLock(cfg.shm_prefix)
        self.run_id = self.lock.run_id
        try:
            shm.private_dir(cfg.run_dir)
            self.shared = wiring.create_shared(cfg, self.run_id, self.own, placement)
        except BaseException:
            Runtime.close(self)  # what this made; a subclass has made nothing yet
            raise
        self.rooms = self.shared.rooms

    def own(self, obj):
        """Take a shared object to close and unlink at close()."""
        self._objects.append(obj)
        return obj

    # ------------------------------------------------------------ what each mode says
    def poll(self) -> None:
        """A short step of the work (or of watching it), for the drain's waits."""
        raise NotImplementedError

    def close_intake(self, refusing: str = "") -> None:
        """The request stage reads what is in its socket now, then no more; with
        `refusing`, it fails each of those requests with that reason instead of doing it."""
        raise NotImplementedError

    def intake_closed(self) -> bool:
        """Whether it has read its socket to the end and handled what it read."""
        raise NotImplementedError

    def tell_reaper(self, record) -> bool:
        """Hand the reaper a record; False if no reaper is there to take it."""
        raise NotImplementedError

    def settled(self) -> bool:
        """Whether what the reaper decided (fences, statuses) has gone out."""
        return True

    def watch(self, stop: SignalFlag) -> None:
        """One turn of serving: run the stages, or watch their processes."""
        raise NotImplementedError

    def stop_all(self) -> None:
        """Stop every stage (after a drain, or when the run cannot go on)."""

    def heartbeat_ages(self) -> dict[str, float | None]:
        """Seconds since each stage process beat (None: not running or not ready yet).
        Stages that run in the loop itself have none: the loop's turn is their heartbeat."""
        return {}

    def stages_not_ready(self) -> list[str]:
        return []

    fatal: str | None = None  # why the run cannot go on (a stage kept dying)
    draining = False
    _turned_at: float | None = None

    def serve(self, stop: SignalFlag, second: SignalFlag | None = None) -> int:
        """Serve until `stop`; then drain for drain_timeout_s (none once `second` is set)
        and stop. Returns 0, or 1 if the run could not go on."""
        second = second or SignalFlag()
        while not stop.is_set() and self.fatal is None:
            self.watch(stop)
            self.turned()
        if self.fatal is None:
            self.drain(0.0 if second.is_set() else self.cfg.drain_timeout_s, second.is_set)
            self.stop_all()
            return 0
        self.notifier.stopping(f"stopping: {self.fatal}")
        self.fail_live(f"worker stopped: {self.fatal}")
        self.stop_all()
        return 1

    # ------------------------------------------------------------ what a supervisor sees
    def turned(self) -> None:
        """The loop (serving, draining, or waiting for a stage to start) went round: what
        /healthz and the service manager's watchdog go by."""
        self._turned_at = time.monotonic()
        self.notifier.watchdog(self.heartbeat_ages(), self._turned_at)

    def health(self) -> dict:
        """The conditions of the /healthz and /readyz probes (pipeline.metrics.READY_WHEN);
        called on the metrics endpoint's thread."""
        turned = self._turned_at
        not_ready = self.stages_not_ready()
        return {"loop_alive": turned is not None
                and time.monotonic() - turned < max(2.0, self.cfg.heartbeat_timeout_s),
                "stages_ready": not not_ready, "not_ready": not_ready,
                "draining": self.draining, "restart_budget_left": self.fatal is None}

    # ------------------------------------------------------------ shared behaviour
    def live_rooms(self) -> list:
        return [e for e in self.rooms.entries() if e.state < RoomState.SUCCESS]

    def drain(self, deadline_s: float, cut_short=lambda: False) -> None:
        """Take no new requests, but every one already received concludes: the intake
        reads what is in its socket, rooms in flight may finish until the deadline (or
        until `cut_short()`); then whatever the intake still reads and every live room
        fails with "worker shutting down", and allocs held for rooms never seen are
        answered."""
        self.draining = True
        self.notifier.stopping(f"draining: {len(self.live_rooms())} rooms in flight, "
                               f"up to {deadline_s:g} s")
        self.close_intake()
        self._wait(lambda: (self.intake_closed() and not self.live_rooms()) or cut_short(), deadline_s)
        self.close_intake(refusing=SHUTTING_DOWN)
        self._wait(self.intake_closed, 5.0)
        self.fail_live(SHUTTING_DOWN)

    def fail_live(self, reason: str) -> None:
        """Fail every live room through the reaper (so receivers hear), then in the table
        for any the reaper could not reach."""
        live = tuple((e.slot, e.room) for e in self.live_rooms())
        if live and self.tell_reaper(RoomsLost(live, reason)):
            self._wait(lambda: not self.live_rooms(), 5.0)
            self._wait(self.settled, 2.0)  # the sender's fence and the reaper's statuses
        for e in self.live_rooms():
            self.rooms.fail(e.slot, e.room, reason)

    def _wait(self, done, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end and not done():
            self.poll()
            self.turned()

    def close(self) -> None:
        for obj in reversed(self._objects):
            obj.close()
            obj.unlink()
        self._objects = []
        wiring.unlink_ipc(self.cfg.intake)
        if self.lock is not None:
            shm.sweep(self.cfg.shm_prefix, self.lock.run_id, include_live=True)
            self.lock.release()
            self.lock = None


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
        rt.notifier.ready(f"serving: intake {rt.cfg.intake}, bootstrap {rt.cfg.bootstrap}")
        return rt.serve(stop, second)
    finally:
        rt.close()
