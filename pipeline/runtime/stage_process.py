"""Runs one stage in its own process: the round of pipeline/runtime/loop.py over rings, a
heartbeat, custody in the room table, counters on the stats board."""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
from dataclasses import asdict

from ipc import shm
from ipc.ring import Ring
from pipeline.ops import numa
from pipeline.runtime import wiring
from pipeline.runtime.boards import DrainOrder, Heartbeats, IntakeJournal, StatsBoard
from pipeline.cli.config import WorkerConfig
from pipeline.ops.logs import setup_logging
from pipeline.runtime.loop import Env, Loop, RingChannel
from pipeline.runtime.serving import SHUTTING_DOWN, SignalFlag
from stages.base import TableCustody
from stages import progress, registry, store_tier

log = logging.getLogger("epd.stage")

DUMP_STACKS = signal.SIGUSR1


def stage_process(name: str, cfg_kwargs: dict, run_id: str, spec_kwargs: dict | None, conn,
                  cpus: list[int] | None = None) -> None:
    """Entry point of a stage process (multiprocessing, spawn); `cpus`: its NUMA placement."""
    name_process(name)
    numa.pin(cpus)  # first: the threads this process starts (torch, zmq, Mooncake) inherit it
    cfg = WorkerConfig(**cfg_kwargs)
    setup_logging(cfg, name)
    stopping = SignalFlag()
    signal.signal(signal.SIGTERM, stopping.set)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides
    # The supervisor asks a stage that does not stop for its stacks before it kills it.
    faulthandler.register(DUMP_STACKS, all_threads=True)
    try:
        host = StageHost(name, cfg, run_id, spec_kwargs)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    conn.send(("ready", asdict(host.env.spec)))
    conn.close()
    try:
        host.run(stopping)
    finally:
        host.close()
        # Interpreter teardown resets Python's handlers to the default: a second SIGTERM
        # from the supervisor's stop would then end a stage that closed cleanly with -15.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    store_tier.end_process_if_abandoned(0)  # a store client whose master is gone: no exit handlers


def name_process(stage: str) -> None:
    """Name this process after its stage, so that ps, top, py-spy and systemd-cgls tell the
    stages apart: with setproctitle (the `worker` extra) the command line
    `epd-worker: <stage>`, and the kernel's name (comm, 15 bytes) `epd-<stage>`, set last
    (setproctitle sets it to its title's first 15 bytes, which would cut the stage's off)."""
    try:
        import setproctitle

        setproctitle.setproctitle(f"epd-worker: {stage}")
    except ImportError:
        pass
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, f"epd-{stage}".encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


def _die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the supervisor dies (Linux), besides the ppid check."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class StageHost:
    """One stage in this process: its rings, its heartbeat row and its counters' region.
    A stage that cannot be built ends its process (stage_process), so close() meets a
    whole host."""

    def __init__(self, name: str, cfg: WorkerConfig, run_id: str, spec_kwargs: dict | None):
        from stages.towers import TowerSpec

        self.name = name
        self.parent = os.getppid()
        _die_with_parent()
        p = cfg.shm_prefix
        self.hb = Heartbeats.attach(p, run_id)
        self.row = self.hb.row(name)
        self.row[Heartbeats.PID] = os.getpid()
        self.row[Heartbeats.BEAT] = time.monotonic()
        # A tower's load reports its steps: each moves the heartbeat on, and the supervisor
        # gives up on the start only when it stops moving (pipeline/runtime/starts.py).
        progress.set_reporter(lambda: self.row.__setitem__(Heartbeats.BEAT, time.monotonic()))
        self.stats_board = StatsBoard.attach(p, run_id)
        self._stats_at = 0.0
        self._busy_window_at = time.monotonic()
        self.drain_seen = DrainOrder.NONE  # the last drain order acted on
        shared = wiring.attach_shared(cfg, run_id)
        self.journal = IntakeJournal.attach(p, run_id)
        self.env = Env(cfg, run_id, shared, spec=TowerSpec(**spec_kwargs) if spec_kwargs else None,
                       journal=self.journal)
        bell_of = lambda stage: shm.object_name(p, run_id, wiring.doorbell_name(stage))  # noqa: E731
        self.bell = shm.open_semaphore(bell_of(name))
        self.channel = RingChannel(
            {src: Ring.attach(p, run_id, wiring.ring_name(src, name), doorbell=bell_of(name))
             for src in wiring.inputs_of(name, cfg.tower_replicas, cfg.preprocess_workers)},
            {dst: Ring.attach(p, run_id, wiring.ring_name(name, dst), doorbell=bell_of(dst))
             for dst in wiring.outputs_of(name, cfg.tower_replicas, cfg.preprocess_workers)},
            self.bell, self._beat)
        self.custody = TableCustody(shared.rooms, registry.owner_of(name))
        self.stage = self.env.build(name, self.channel.emitter(name), self.custody)
        self.loop = Loop([self.stage], self.channel, self.env.zmq_context, self.env.curve)
        self.stage.start()  # picks up what a predecessor left
        self.loop.settle(self.stage)
        progress.set_reporter(None)
        self.row[Heartbeats.READY] = 1.0

    def _beat(self) -> None:
        now = time.monotonic()
        self.row[Heartbeats.BEAT] = now
        order = self.hb.drain_order(self.name)
        if order > self.drain_seen:  # a drain: read the socket to the end
            self.drain_seen = order
            if order is DrainOrder.REFUSE:
                self.stage.refuse(SHUTTING_DOWN)
            self.loop.close_when_read(self.stage)
        if order is not DrainOrder.NONE and self.loop.read_to_the_end(self.stage):
            self.hb.report_drained(self.name, order)
        if os.getppid() != self.parent:
            # The supervisor is gone (killed whole): nobody can restart or clean up after
            # us; the next start with this prefix sweeps the shared objects.
            os._exit(70)
        if now - self._stats_at > 0.05:
            self._stats_at = now
            self.stats_board.write(self.name, self.stage.stats())
        if now - self._busy_window_at >= 1.0:
            wall = now - self._busy_window_at
            self.row[Heartbeats.BUSY] = min(1.0, max(0.0, 1.0 - self.loop.idle_s / wall))
            self._busy_window_at, self.loop.idle_s = now, 0.0

    def run(self, stopping: SignalFlag) -> None:
        while not stopping.is_set():
            self._beat()
            self.loop.step(0.1)  # heartbeats and timers at least this often

    def close(self) -> None:
        try:
            self.stats_board.write(self.name, self.stage.stats())
            self.stage.close()
        except Exception as e:
            log.warning("closing: %s", e)
        self.stats_board.close()
        self.loop.close()
        self.env.close()
        self.channel.close()
        self.env.shared.close()
        self.hb.close()
        self.journal.close()
        self.bell.close()
        sys.stdout.flush()
