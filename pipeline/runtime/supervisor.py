"""The multi-process pipeline (`--mode pipeline`): one process per stage, and their supervisor.

The supervisor owns every shared object: it creates them, starts the stages (in
registry.start_order: the others need the towers' spec), watches them (exit, or a
heartbeat older than `heartbeat_timeout_s`: killed), and when one dies has its
Reclaimer (pipeline/runtime/reclaim.py) fail exactly the rooms it held, reclaim its arena
references and write its last words on its own rings (registry.last_words: a tower
replica's tell the scheduler it is gone), and restarts it with backoff; the successor
continues from its input rings and from what its predecessor left in shared memory
(its `start()`). More than `restart_limit` restarts within `restart_window_s` end the
run. Each tower replica is a stage of its own: it dies, is restarted and fails its
rooms alone.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import asdict

from ipc import shm
from ipc.ring import Ring
from pipeline.ops import numa
from pipeline.runtime import wiring
from pipeline.runtime.boards import DrainOrder, Heartbeats, IntakeJournal, StatsBoard
from pipeline.ops.metrics import MetricsError, MetricsServer, Snapshot, StageTotals, merge_stats
from pipeline.runtime.reclaim import Reclaimer
from pipeline.runtime.serving import RunResources, Serving, SignalFlag, StartError
from pipeline.integrations.tokenspeed_front import Fronts, start_fronts
from pipeline.runtime.stage_process import DUMP_STACKS, stage_process
from pipeline.runtime.starts import FAILED, READY, Start
from stages import registry
from stages.records import IntakeRestarted
from stages.registry import REQUEST_STAGE, SUPERVISOR

# Stages start by fork and exec (see Supervisor.__init__). gRPC (the tokenspeed gateway
# front serves from this process) restarts its pollers in a forked child when its fork
# support is on, and the child then dies of its own closed descriptors before the exec.
# gRPC reads the variable when it is imported; the command line imports this module
# before the front imports gRPC.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

log = logging.getLogger("epd.supervisor")


class PipelineError(StartError):
    """The pipeline could not start."""


class PipelineTables:
    """The pipeline's shared objects besides the run's: a doorbell per stage, a ring per
    edge, the heartbeats, intake's journal and the stats board; the run closes all but
    the doorbells (close_doorbells)."""

    def __init__(self, run: RunResources, stages: list[str], edges: list[tuple[str, str]]):
        cfg, p, run_id = run.cfg, run.cfg.shm_prefix, run.run_id
        self.bells = []
        try:
            for stage in stages:
                name = shm.object_name(p, run_id, wiring.doorbell_name(stage))
                self.bells.append((name, shm.create_semaphore(name)))
            self.rings = {}
            for src, dst in edges:
                self.rings[(src, dst)] = run.own(Ring.create(
                    p, run_id, wiring.ring_name(src, dst), cfg.ring_bytes,
                    doorbell=shm.object_name(p, run_id, wiring.doorbell_name(dst))))
            self.hb = run.own(Heartbeats.create(p, run_id, stages))
            self.journal = run.own(IntakeJournal.create(p, run_id))
            self.stats_board = run.own(StatsBoard.create(p, run_id, stages))
        except BaseException:
            self.close_doorbells()
            raise

    def close_doorbells(self) -> None:
        for name, sem in self.bells:
            sem.close()
            shm.unlink_semaphore(name)
        self.bells = []


class Supervisor:
    """The pipeline's runtime: its run's resources and tables, the stage processes
    (spawned, watched, restarted, stopped here), what a dead one held (Reclaimer), and
    serving and the drain (Serving, with this as its StageControl)."""

    def __init__(self, cfg):
        cfg = cfg.resolved().validate()
        self.stages = registry.stage_names(cfg.tower_replicas, cfg.preprocess_workers)
        edges = wiring.edges(cfg.tower_replicas, cfg.preprocess_workers)
        self.placement = numa.placement(cfg)  # each stage's CPUs (None: unpinned)
        if any(self.placement.values()):
            log.info("NUMA placement: %s", ", ".join(f"{s} on CPUs {numa.format_cpulist(c)}" if c else
                                                     f"{s} unpinned" for s, c in self.placement.items()))
        self.run = RunResources(cfg, {"rings": len(edges) * cfg.ring_bytes}, self.placement)
        try:
            self.tables = PipelineTables(self.run, self.stages, edges)
        except BaseException:
            self.run.close()
            raise
        self.cfg, self.run_id, self.shared, self.rooms = self.run.cfg, self.run.run_id, self.run.shared, self.run.rooms
        self.rings, self.hb, self.stats_board = self.tables.rings, self.tables.hb, self.tables.stats_board
        self.serving = Serving(self.run, self)
        self.reclaimer = Reclaimer(self.shared, self.rings, self.tell_reaper)
        self.totals = StageTotals(self.stages)
        self.metrics: MetricsServer | None = None  # the Prometheus endpoint; .port is the one bound
        self.fronts: Fronts | None = None  # tokenspeed's, when asked for: once every stage is ready
        self.procs: dict[str, mp.Process] = {}
        self.restarts: deque = deque()
        self.restart_counts = {name: 0 for name in self.stages}
        self.pending_restart: dict[str, float] = {}
        self.starting: dict[str, Start] = {}  # stages spawned and not ready yet: the loop looks, never waits
        self.failed_starts = {name: 0 for name in self.stages}  # in a row: every one counts toward giving up
        self.not_ready_since = {name: time.monotonic() for name in self.stages}
        self.fatal: str | None = None
        self.spec_kwargs: dict | None = None  # the towers' spec, as the first tower answered it
        self._mp = mp.get_context("spawn")
        # multiprocessing's spawn forks with vfork, which suspends this process until the
        # child execs: a child stopped (SIGSTOP, a debugger) in between stops the supervisor
        # with it. A plain fork costs a copy of the page tables and cannot block.
        setattr(subprocess, "_USE_VFORK", False)
        self._hung: dict[str, int] = {}  # stage -> pid of the process the hang killer SIGKILLed
        self._watching = threading.Event()  # cleared to stop the hang killer
        self._hang_killer: threading.Thread | None = None

    # ------------------------------------------------------------ processes
    def _spawn(self, name: str) -> Start:
        parent, child = self._mp.Pipe(duplex=False)
        cfg = asdict(self.cfg)
        proc = self._mp.Process(target=stage_process, name=f"epd-{name}",
                                args=(name, cfg, self.run_id, self.spec_kwargs, child, self.placement[name]),
                                daemon=False)
        row = self.hb.row(name)
        row[Heartbeats.READY] = 0.0
        row[Heartbeats.BEAT] = time.monotonic()  # a tower's load progress moves it on (pipeline/runtime/starts.py)
        row[Heartbeats.BUSY] = 0.0
        self.hb.report_drained(name, DrainOrder.NONE)  # a predecessor's answer is not this one's
        now = time.monotonic()
        try:
            proc.start()
        finally:
            child.close()
        self.procs[name] = proc
        c = self.cfg
        return Start(name, proc, parent, now, c.stage_start_timeout_s, c.heartbeat_timeout_s, c.start_timeout_s)

    def start(self) -> None:
        """Start every stage, each ready before the next (they need the towers' spec)."""
        try:
            if self.cfg.metrics_endpoint:
                try:
                    self.metrics = MetricsServer(self.cfg.metrics_endpoint, self.metrics_snapshot,
                                                 self.serving.health)
                except MetricsError as e:
                    raise PipelineError(str(e)) from None
            self._watching.set()
            self._hang_killer = threading.Thread(target=self._kill_hung, name="hang-killer", daemon=True)
            self._hang_killer.start()
            order = registry.start_order(self.cfg.tower_replicas, self.cfg.preprocess_workers)
            for n, name in enumerate(order, 1):
                self.run.notifier.status(f"starting the {name} stage ({n} of {len(order)})")
                st = self._spawn(name)
                while True:
                    state, why = st.poll(self.hb.row(name), time.monotonic())
                    if state == FAILED:
                        st.abandon()
                        raise PipelineError(f"the {name} stage {why}")
                    if state == READY:
                        break
                    self.serving.turned()  # nothing else to do before serving: this loop is the loop
                    time.sleep(0.05)
                self._ready(name, st)
            self.fronts = start_fronts(self.cfg, self.spec, self.run_id, lambda: self.serving.draining)
        except BaseException:
            self._stop_processes(0.0)
            raise

    def _ready(self, name: str, st: Start) -> None:
        if self.spec_kwargs is None:  # the first stage started is a tower
            self.spec_kwargs = st.spec
        self.not_ready_since.pop(name, None)
        self.failed_starts[name] = 0

    @property
    def spec(self):
        from stages.towers import TowerSpec

        return TowerSpec(**self.spec_kwargs)

    # ------------------------------------------------------------ watching
    def watch(self, stop: SignalFlag) -> None:
        self.check()
        stop.wait(0.05)

    def poll(self) -> None:
        self.check()
        time.sleep(0.02)

    def check(self) -> None:
        """One look at every stage: starts that became ready, failed or ran out of time,
        stages that died, restarts whose backoff is over. Never waits on a process."""
        now = time.monotonic()
        for name in list(self.starting):
            self._check_start(name, now)
        for name, proc in list(self.procs.items()):
            if name in self.starting:
                continue
            if proc is None:
                if self.fatal is None and now >= self.pending_restart.get(name, 0.0):
                    self._restart(name)
                continue
            if not proc.is_alive():
                hung = self._hung.pop(name, None) == proc.pid
                self._died(name, "hung (no heartbeat)" if hung else f"exited with code {proc.exitcode}")

    def _kill_hung(self) -> None:
        """SIGKILL every stage whose heartbeat is older than heartbeat_timeout_s; check()
        then finds it dead. A thread of its own that takes no lock: a stage stopped while
        it held an arena's or the room table's lock blocks whoever wants that lock next,
        the supervisor's main loop included (a dead stage's arena references are reclaimed
        under it), and only killing the stopped stage frees it."""
        while self._watching.is_set():
            now = time.monotonic()
            for name, proc in list(self.procs.items()):
                if proc is None or self._hung.get(name) == proc.pid:
                    continue
                row = self.hb.row(name)
                # READY is cleared before a successor starts, and PID is the process's own:
                # a stage starting, or one that just died, is not this one's to kill.
                if (row[Heartbeats.READY] and int(row[Heartbeats.PID]) == proc.pid
                        and now - row[Heartbeats.BEAT] > self.cfg.heartbeat_timeout_s):
                    log.error("the %s stage (pid %d) missed its heartbeat for %.1f s: killing it",
                              name, proc.pid, now - row[Heartbeats.BEAT])
                    self._hung[name] = proc.pid
                    try:
                        os.kill(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.05)

    def _died(self, name: str, why: str) -> None:
        proc = self.procs[name]
        proc.join(5)
        self.procs[name] = None
        self.not_ready_since.setdefault(name, time.monotonic())
        with self.totals.lock:  # its successor counts from zero: keep what it had counted
            self.totals.retire(name, self.stats_board.read(name))
            self.stats_board.write(name, {})
        self._lost(name, why)

    def _lost(self, name: str, why: str) -> None:
        """`name`'s process is gone (dead, hung, or given up while it started): fail what it
        held, count the restart, and schedule the next start or give up."""
        self.reclaimer.stage_died(name, why)
        now = time.monotonic()
        self.restarts.append((now, name))
        while self.restarts and self.restarts[0][0] < now - self.cfg.restart_window_s:
            self.restarts.popleft()
        if len(self.restarts) > self.cfg.restart_limit:
            self.fatal = (f"the {name} stage died {sum(1 for _, n in self.restarts if n == name)} "
                          f"times, and stages restarted {len(self.restarts)} times in "
                          f"{self.cfg.restart_window_s:g} s (restart_limit {self.cfg.restart_limit})")
        elif self.failed_starts[name] > self.cfg.restart_limit:
            # Starts that each take their whole bound may never crowd restart_window_s:
            # counted in a row, they end the run within a bound of their own.
            self.fatal = (f"the {name} stage could not be restarted: {self.failed_starts[name]} starts "
                          f"in a row failed (restart_limit {self.cfg.restart_limit}); the last {why}")
        if self.fatal is not None:
            log.error("giving up: %s", self.fatal)
            return
        recent = sum(1 for _, n in self.restarts if n == name)
        self.pending_restart[name] = now + min(2.0, 0.05 * 2 ** (recent - 1))

    def _restart(self, name: str) -> None:
        self.pending_restart.pop(name, None)
        try:
            self.starting[name] = self._spawn(name)
        except OSError as e:
            log.error("could not spawn the %s stage: %s", name, e)
            self.procs[name] = None
            self.failed_starts[name] += 1
            self._lost(name, f"could not be spawned: {e}")

    def _check_start(self, name: str, now: float) -> None:
        st = self.starting[name]
        state, why = st.poll(self.hb.row(name), now)
        if state == READY:
            del self.starting[name]
            self._ready(name, st)
            self.restart_counts[name] += 1
            log.warning("restarted the %s stage (pid %d, restart %d, ready %.1f s after its spawn)",
                        name, st.proc.pid, self.restart_counts[name], now - st.spawned_at)
            self.hb.row(name)[Heartbeats.RESTARTS] = self.restart_counts[name]
            if name == REQUEST_STAGE:  # requests in its predecessor's socket died with it
                self.tell_reaper(IntakeRestarted(now))
        elif state == FAILED:
            del self.starting[name]
            log.error("the %s stage (pid %d) %s: killing it", name, st.proc.pid, why)
            st.abandon()
            self.procs[name] = None
            self.failed_starts[name] += 1
            self._lost(name, f"failed to start ({why})")

    def tell_reaper(self, record) -> bool:
        # Into the ring whether or not the reaper is alive now: the ring outlives it, and a
        # successor continues from it (a RoomsLost dropped here would leave rooms whose
        # custody was just cleared live, held by nobody).
        dest = wiring.supervisor_reader()
        if not self.rings[(SUPERVISOR, dest)].push(pickle.dumps(record, protocol=5), timeout=5.0):
            log.error("the %s's ring is full: could not deliver %s", dest, type(record).__name__)
            return False
        proc = self.procs.get(dest)
        return proc is not None and proc.is_alive() or dest in self.pending_restart

    def heartbeat_ages(self) -> dict[str, float | None]:
        now = time.monotonic()
        ages = {}
        for name, proc in self.procs.items():
            row = self.hb.row(name)
            ready = proc is not None and row[Heartbeats.READY]
            ages[name] = max(0.0, now - float(row[Heartbeats.BEAT])) if ready else None
        return ages

    def stages_not_ready(self) -> list[str]:
        # On the metrics endpoint's thread: no is_alive(), whose waitpid would race the
        # loop's; a stage found dead is None in procs within a turn of the loop.
        return [name for name in self.stages
                if self.procs.get(name) is None or not self.hb.row(name)[Heartbeats.READY]]

    def stages_not_ready_since(self) -> dict[str, float]:
        """Each stage not ready now, and since when (time.monotonic): found dead or hung, or
        not yet ready since the run began."""
        since = dict(self.not_ready_since)
        return {name: since.get(name, time.monotonic()) for name in self.stages_not_ready()}

    # ------------------------------------------------------------ state
    def stats(self) -> dict:
        out = merge_stats({stage: self.stats_board.read(stage) for stage in self.stages})
        out["restarts"] = dict(self.restart_counts)
        if self.fronts is not None:
            out.update(self.fronts.stats())
        return out

    def metrics_snapshot(self) -> Snapshot:
        """What the metrics endpoint reports; called on its thread at every scrape."""
        with self.totals.lock:
            stats = {s: self.totals.seen(s, self.stats_board.read(s)) for s in self.stages}
            totals = self.totals.total()
        now = time.monotonic()
        stages = {}
        for stage in self.stages:
            row = self.hb.row(stage)
            stages[stage] = {
                "ring_depth": sum(ring.depth() for (_, dst), ring in self.rings.items() if dst == stage),
                "busy_ratio": float(row[Heartbeats.BUSY]),
                "heartbeat_age_s": max(0.0, now - float(row[Heartbeats.BEAT])),
                "restarts": self.restart_counts[stage],
            }
        arenas = {tier: (a.used_bytes(), a.size) for tier, a in
                  (("pixels", self.shared.pixel_arena), ("embeddings", self.shared.emb_arena))}
        return Snapshot(totals, stats, stages, arenas, self.rooms.count_live())

    # ------------------------------------------------------------ stopping
    def close_intake(self, refusing: str = "") -> None:
        # The stage reads its ask at its next beat; a successor started meanwhile, too.
        self.hb.order_drain(REQUEST_STAGE, DrainOrder.REFUSE if refusing else DrainOrder.FINISH_READ)

    def intake_closed(self) -> bool:
        proc = self.procs.get(REQUEST_STAGE)
        if proc is None or not proc.is_alive():
            return True  # its socket went with it
        return self.hb.drained(REQUEST_STAGE)

    def settled(self) -> bool:
        dest = wiring.supervisor_reader()
        return not any(ring.depth() for (src, dst), ring in self.rings.items() if dest in (src, dst))

    def stop_all(self) -> None:
        self._stop_processes(5.0)

    def _await_stop(self, name: str, timeout: float) -> None:
        """Wait up to `timeout` for a stage sent SIGTERM to exit, then kill it; one that
        was given time (a stop, not an aborted start) and still runs is asked for its
        stacks first: a stage that does not stop is a bug to find."""
        proc = self.procs.pop(name, None)
        self.pending_restart.pop(name, None)
        if proc is None:
            return
        proc.join(timeout)
        if not proc.is_alive():
            return
        if timeout > 0:
            log.warning("the %s stage (pid %d) did not exit within %.0f s of SIGTERM: its stacks "
                        "follow on stderr; killing it", name, proc.pid, timeout)
            try:
                os.kill(proc.pid, DUMP_STACKS)
            except ProcessLookupError:
                pass
            proc.join(1.0)
        proc.kill()
        proc.join(5)

    def _stop_processes(self, timeout: float) -> None:
        self._watching.clear()  # stages that stop stop beating: not hung
        if self._hang_killer is not None:
            self._hang_killer.join(5)
            self._hang_killer = None
        for name, st in list(self.starting.items()):  # not serving yet: nothing to finish
            st.abandon()
            self.procs[name] = None
        self.starting.clear()
        for name in list(self.procs):  # all at once: they stop together
            proc = self.procs.get(name)
            if proc is not None and proc.is_alive():
                proc.terminate()
        for name in list(self.procs):
            self._await_stop(name, timeout)

    def close(self) -> None:
        if self.fronts is not None:
            self.fronts.close()
            self.fronts = None
        if self.metrics is not None:  # first: a scrape reads the objects closed below
            self.metrics.close()
            self.metrics = None
        self._stop_processes(5.0)
        self.run.close()
        self.tables.close_doorbells()
