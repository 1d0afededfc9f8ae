"""The multi-process pipeline (`--mode pipeline`): one process per stage, and their supervisor.

The supervisor owns every shared object: it creates them, starts the stages (the
tower first: the others need its spec), watches them (exit, or a heartbeat older
than `heartbeat_timeout_s`: killed), and when one dies fails exactly the rooms it
held, reclaims its arena references, unlinks the pixel segments it was taking,
and restarts it with backoff; the successor continues from its input rings. More
than `restart_limit` restarts within `restart_window_s` end the run.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import stat
import threading
import time
from collections import deque
from dataclasses import asdict

from ipc import shm
from ipc.ring import Ring
from ipc.rooms import RoomState
from pipeline import numa, wiring
from pipeline.config import WorkerConfig
from pipeline.metrics import MetricsError, MetricsServer, Snapshot, StageTotals
from pipeline.stage_host import Heartbeats, IntakeJournal, StatsBoard, doorbell_name, stage_process

log = logging.getLogger("epd.supervisor")


class PipelineError(RuntimeError):
    """The pipeline could not start, or had to stop (a stage kept dying)."""


class Supervisor:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg = cfg.resolved().validate()
        self._objects = []
        self._bells = []
        self.procs: dict[str, mp.Process] = {}
        self.restarts: deque = deque()
        self.restart_counts = {name: 0 for name in wiring.STAGES}
        self.pending_restart: dict[str, float] = {}
        self.fatal: str | None = None
        self.spec_kwargs: dict | None = None
        self._mp = mp.get_context("spawn")
        self.metrics: MetricsServer | None = None  # the Prometheus endpoint; .port is the one bound
        self.totals = StageTotals(wiring.STAGES)
        self.placement = numa.placement(cfg)  # each stage's CPUs (None: unpinned)
        if any(self.placement.values()):
            log.info("NUMA placement: %s", ", ".join(f"{s} on CPUs {numa.format_cpulist(c)}" if c else
                                                     f"{s} unpinned" for s, c in self.placement.items()))
        shm.sweep(cfg.shm_prefix)  # what a dead run of this prefix left, and only that
        shm.require_free({"pixel arena": cfg.pixel_arena_bytes,
                          "embedding arena": cfg.embedding_arena_bytes,
                          "rings": len(wiring.EDGES) * cfg.ring_bytes})
        self.lock = shm.RunLock(cfg.shm_prefix)
        self.run_id = run_id = self.lock.run_id
        p = cfg.shm_prefix
        try:
            shm.private_dir(cfg.run_dir)
            self.shared = wiring.create_shared(cfg, run_id, self._own, self.placement)
            self.rooms = self.shared.rooms
            for stage in wiring.STAGES:
                name = shm.object_name(p, run_id, doorbell_name(stage))
                self._bells.append((name, shm.create_semaphore(name)))
            self.rings = {}
            for src, dst in wiring.EDGES:
                self.rings[(src, dst)] = self._own(Ring.create(
                    p, run_id, wiring.ring_name(src, dst), cfg.ring_bytes,
                    doorbell=shm.object_name(p, run_id, doorbell_name(dst))))
            self.to_reaper = self.rings[("supervisor", "reaper")]
            self.hb = self._own(Heartbeats.create(p, run_id))
            self.journal = self._own(IntakeJournal.create(p, run_id))
            self.stats_board = self._own(StatsBoard.create(p, run_id))
        except BaseException:
            self.close()
            raise

    def _own(self, obj):
        self._objects.append(obj)
        return obj

    # ------------------------------------------------------------ processes
    def _spawn(self, name: str) -> tuple[mp.Process, object]:
        parent, child = self._mp.Pipe(duplex=False)
        cfg = asdict(self.cfg)
        proc = self._mp.Process(target=stage_process, name=f"epd-{name}",
                                args=(name, cfg, self.run_id, self.spec_kwargs, child, self.placement[name]),
                                daemon=False)
        row = self.hb.row(name)
        row[Heartbeats.READY] = 0.0
        row[Heartbeats.BEAT] = time.monotonic()
        row[Heartbeats.BUSY] = 0.0
        proc.start()
        child.close()
        return proc, parent

    def _await_ready(self, name: str, proc, conn, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if conn.poll(0.05):
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    break
                if kind == "ready":
                    if name == "tower":
                        self.spec_kwargs = payload
                    conn.close()
                    return
                raise PipelineError(f"the {name} stage could not start: {payload}")
            if not proc.is_alive():
                break
        proc.kill()
        proc.join(5)
        raise PipelineError(f"the {name} stage did not become ready (exit code {proc.exitcode})")

    def start(self) -> None:
        """Start every stage, each ready before the next; the tower first (the others need its spec)."""
        order = ["tower"] + [s for s in wiring.STAGES if s != "tower"]
        try:
            if self.cfg.metrics_endpoint:
                try:
                    self.metrics = MetricsServer(self.cfg.metrics_endpoint, self.metrics_snapshot)
                except MetricsError as e:
                    raise PipelineError(str(e)) from None
            for name in order:
                proc, conn = self._spawn(name)
                self.procs[name] = proc
                self._await_ready(name, proc, conn, self.cfg.start_timeout_s)
        except BaseException:
            self._stop_all(0.0)
            raise

    # ------------------------------------------------------------ watching
    def serve(self, stop: threading.Event, second: threading.Event | None = None) -> int:
        """Watch until `stop`; then drain (skipped if `second` is set) and shut down.
        Returns 0, or 1 if a stage kept dying."""
        while not stop.is_set() and self.fatal is None:
            self.check()
            stop.wait(0.05)
        if self.fatal is None:
            self.drain(0.0 if second is not None and second.is_set() else self.cfg.drain_timeout_s,
                       second)
            return 0
        self._stop_all(5.0)  # every live room failed (naming the stage), every stage stopped
        return 1

    def check(self) -> None:
        now = time.monotonic()
        for name, proc in list(self.procs.items()):
            if proc is None:
                if now >= self.pending_restart.get(name, 0.0):
                    self._restart(name)
                continue
            if not proc.is_alive():
                self._died(name, f"exited with code {proc.exitcode}")
                continue
            row = self.hb.row(name)
            if row[Heartbeats.READY] and now - row[Heartbeats.BEAT] > self.cfg.heartbeat_timeout_s:
                log.error("the %s stage (pid %d) missed its heartbeat for %.1f s: killing it",
                          name, proc.pid, now - row[Heartbeats.BEAT])
                proc.kill()
                proc.join(10)
                self._died(name, "hung (no heartbeat)")

    def _died(self, name: str, why: str) -> None:
        proc = self.procs[name]
        proc.join(5)
        self.procs[name] = None
        with self.totals.lock:  # its successor counts from zero: keep what it had counted
            self.totals.retire(name, self.stats_board.read(name))
            self.stats_board.write(name, {})
        owner = wiring.OWNERS[name]
        bit = 1 << owner
        held = [(e.slot, e.room) for e in self.rooms.held_by(bit)]
        for slot, room in held:
            self.rooms.unhold(slot, room, bit)
        self.shared.pixel_arena.reclaim(owner)
        self.shared.emb_arena.reclaim(owner)
        if name == "intake":
            in_hand = self._unlink_journal()
            if in_hand is not None and self.rooms.find(in_hand) is None:
                held.append((None, in_hand))  # the request it was reading: remember it as failed
        log.error("the %s stage %s; failing the %d rooms it held: room=%s", name, why, len(held),
                  ",".join(str(room) for _, room in held[:20]) + (",..." if len(held) > 20 else ""))
        self._to_reaper(("fail_rooms", held, f"the {name} stage died while it held this room",
                         name == "sender"))
        now = time.monotonic()
        self.restarts.append((now, name))
        while self.restarts and self.restarts[0][0] < now - self.cfg.restart_window_s:
            self.restarts.popleft()
        if len(self.restarts) > self.cfg.restart_limit:
            self.fatal = (f"the {name} stage died {sum(1 for _, n in self.restarts if n == name)} "
                          f"times, and stages restarted {len(self.restarts)} times in "
                          f"{self.cfg.restart_window_s:g} s (restart_limit {self.cfg.restart_limit})")
            log.error("giving up: %s", self.fatal)
            return
        recent = sum(1 for _, n in self.restarts if n == name)
        self.pending_restart[name] = now + min(2.0, 0.05 * 2 ** (recent - 1))

    def _restart(self, name: str) -> None:
        self.pending_restart.pop(name, None)
        try:
            proc, conn = self._spawn(name)
            self.procs[name] = proc
            self._await_ready(name, proc, conn, self.cfg.start_timeout_s)
        except PipelineError as e:
            log.error("%s", e)
            self.procs[name] = None
            self._died_at_start(name)
            return
        self.restart_counts[name] += 1
        log.warning("restarted the %s stage (pid %d, restart %d)", name, proc.pid, self.restart_counts[name])
        self.hb.row(name)[Heartbeats.RESTARTS] = self.restart_counts[name]
        if name == "sender":
            self._to_reaper(("sender_restarted",))

    def _died_at_start(self, name: str) -> None:
        now = time.monotonic()
        self.restarts.append((now, name))
        if len(self.restarts) > self.cfg.restart_limit:
            self.fatal = f"the {name} stage could not be restarted"
        self.pending_restart[name] = now + 2.0

    def _unlink_journal(self) -> int | None:
        """Unlink the segments of the frame intake died with; return its room. By the
        rules intake takes them by: a name under the prefix, a regular file of ours."""
        from stages.intake import segment_name_problem

        room, names = self.journal.read()
        for name in names:
            if not name or segment_name_problem(self.cfg.shm_prefix, name) is not None:
                continue
            path = os.path.join(shm.SHM_DIR, name[1:])
            try:
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                    os.unlink(path)
            except FileNotFoundError:
                pass
        self.journal.record(None, [])
        return room

    def _to_reaper(self, rec) -> None:
        if not self.to_reaper.push(pickle.dumps(rec, protocol=5), timeout=5.0):
            log.error("the reaper's ring is full: could not deliver %s", rec[0])

    # ------------------------------------------------------------ state
    def live_rooms(self) -> list:
        return [e for e in self.rooms.entries() if e.state < RoomState.SUCCESS]

    def stats(self) -> dict:
        out = self.stats_board.read_all()
        out["restarts"] = dict(self.restart_counts)
        return out

    def metrics_snapshot(self) -> Snapshot:
        """What the metrics endpoint reports; called on its thread at every scrape."""
        with self.totals.lock:
            stats = {s: self.totals.seen(s, self.stats_board.read(s)) for s in wiring.STAGES}
            totals = self.totals.total()
        now = time.monotonic()
        stages = {}
        for stage in wiring.STAGES:
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
    def drain(self, deadline_s: float, second: threading.Event | None = None) -> None:
        """Stop intake; let rooms finish until the deadline; fail the rest; stop everything."""
        self._stop_stage("intake")
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and self.live_rooms():
            if second is not None and second.is_set():
                break
            self.check()
            time.sleep(0.02)
        self._fail_live("worker shutting down")
        self._stop_all(5.0)

    def _fail_live(self, reason: str) -> None:
        live = [(e.slot, e.room) for e in self.live_rooms()]
        if live and self.procs.get("reaper") is not None and self.procs["reaper"].is_alive():
            self._to_reaper(("fail_rooms", live, reason, False))
            end = time.monotonic() + 5.0
            while time.monotonic() < end and self.live_rooms():
                time.sleep(0.02)
            # and let the sender's fence and the reaper's statuses go out
            end = time.monotonic() + 2.0
            while time.monotonic() < end and (self.rings[("reaper", "sender")].depth()
                                               or self.rings[("sender", "reaper")].depth()):
                time.sleep(0.02)
        for e in self.live_rooms():
            self.rooms.fail(e.slot, e.room, reason)

    def _stop_stage(self, name: str, timeout: float = 5.0) -> None:
        proc = self.procs.get(name)
        self.procs.pop(name, None)
        self.pending_restart.pop(name, None)
        if proc is None:
            return
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(5)

    def _stop_all(self, timeout: float) -> None:
        if self.fatal is not None:
            self._fail_live(f"worker stopped: {self.fatal}")
        for name in list(self.procs):
            proc = self.procs.get(name)
            if proc is not None and proc.is_alive():
                proc.terminate()
        for name in list(self.procs):
            self._stop_stage(name, timeout)

    def close(self) -> None:
        if self.metrics is not None:  # first: a scrape reads the objects closed below
            self.metrics.close()
            self.metrics = None
        self._stop_all(5.0)
        for obj in reversed(self._objects):
            obj.close()
            obj.unlink()
        self._objects = []
        for name, sem in self._bells:
            sem.close()
            shm.unlink_semaphore(name)
        self._bells = []
        wiring.unlink_ipc(self.cfg.intake)
        if self.lock is not None:
            shm.sweep(self.cfg.shm_prefix, self.lock.run_id, include_live=True)
            self.lock.release()
            self.lock = None


def run_pipeline(cfg: WorkerConfig) -> int:
    """`run.py serve --mode pipeline`: serve until SIGTERM/SIGINT; a second signal skips the drain."""
    stop, second = threading.Event(), threading.Event()

    def on_signal(signum, _frame):
        (second if stop.is_set() else stop).set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        sup = Supervisor(cfg)
    except Exception as e:  # /dev/shm too small, a run dir we cannot make, ...
        raise PipelineError(str(e)) from e
    try:
        sup.start()
        print(f"serving (pipeline): intake {sup.cfg.intake}  bootstrap {sup.cfg.bootstrap}  "
              f"tower {sup.spec_kwargs['name']}", flush=True)
        if sup.metrics is not None:
            print(f"metrics: {sup.metrics.url}", flush=True)
        code = sup.serve(stop, second)
        if sup.fatal:
            print(f"error: {sup.fatal}", flush=True)
        return code
    finally:
        sup.close()
