"""The reference design (`--mode inprocess`): every stage object in one process, one loop.

The same stage objects run in the multi-process pipeline; here records move from
one to the next through a local queue, in the order they were emitted.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

import zmq

from ipc import shm
from ipc.rooms import RoomState
from pipeline import wiring
from pipeline.config import WorkerConfig
from pipeline.metrics import MetricsServer, Snapshot, Totals, totals_of
from ipc.transport import Engine
from stages.records import RoomFailure
from stages.tower import Tower, build_tower

log = logging.getLogger("epd.worker")


class Worker:
    def __init__(self, cfg: WorkerConfig, tower: Tower | None = None):
        self.cfg = cfg = cfg.resolved().validate()
        self.tower = None
        self.engine = None
        self.ctx = None
        self.stages = {}
        self._objects = []
        self.metrics: MetricsServer | None = None  # the Prometheus endpoint; .port is the one bound
        self.published: dict[str, dict] = {}        # each stage's stats(), copied by the loop for it
        self._published_at = 0.0
        shm.sweep(cfg.shm_prefix)  # what a dead run of this prefix left
        shm.require_free({"pixel arena": cfg.pixel_arena_bytes,
                          "embedding arena": cfg.embedding_arena_bytes})
        self.lock = shm.RunLock(cfg.shm_prefix)
        run_id = self.lock.run_id
        try:
            # Built before the arenas: torch's import is slow and may fail; then nothing is left.
            self.tower = tower or build_tower(cfg.tower, **cfg.tower_settings())
            self.spec = spec = self.tower.spec
            sh = self.shared = wiring.create_shared(cfg, run_id, self._own)
            self.pixel_arena, self.emb_arena, self.rooms = sh.pixel_arena, sh.emb_arena, sh.rooms
            self.engine = Engine(cfg.hostname, cfg.protocol, cfg.device)
            self.engine.register(self.emb_arena.address, self.emb_arena.size)
            self.ctx = zmq.Context()
            shm.private_dir(cfg.run_dir)
            self.intake_sock = wiring.bind_pull(self.ctx, cfg.intake, wiring.intake_max_frame(cfg))
            self.bootstrap_sock = wiring.bind_pull(self.ctx, cfg.bootstrap, wiring.BOOTSTRAP_MAX_FRAME)
            self.queue: deque = deque()
            for name in wiring.STAGES:
                self.stages[name] = wiring.build_stage(
                    name, cfg, run_id, sh, spec, self._emitter(name), None,
                    tower=self.tower, engine=self.engine, zmq_ctx=self.ctx)
        except BaseException:
            self.close()
            raise
        self.intake = self.stages["intake"].intake
        self.hash_cache = self.stages["cache"].hc
        self.cache = self.hash_cache.cache
        self.scheduler = self.stages["scheduler"].scheduler
        self.sender = self.stages["sender"].sender
        self.reaper = self.stages["reaper"].reaper
        self.stages["reaper"].on_conclusion = self.on_conclusions
        self.accepting = True
        if cfg.metrics_endpoint:
            try:
                self.metrics = MetricsServer(cfg.metrics_endpoint, self.metrics_snapshot)
            except BaseException:
                self.close()
                raise

    @property
    def tower_items(self) -> int:
        return self.stages["tower"].items

    @property
    def tower_batches(self) -> int:
        return self.stages["tower"].batches

    def _emitter(self, source: str):
        queue = self.queue
        return lambda dest, rec: queue.append((dest, source, rec))

    # ------------------------------------------------------------ set-up helpers
    def _own(self, obj):
        self._objects.append(obj)
        return obj

    # ------------------------------------------------------------ the loop
    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.step()

    def step(self, max_wait: float = 0.02) -> None:
        stages = self.stages
        if self.queue or stages["intake"].busy() or stages["scheduler"].busy():
            wait = 0.0
        elif stages["sender"].busy():
            # Writes in flight complete in Mooncake's threads: yield the core to them
            # (and to the receivers) instead of spinning on their status.
            time.sleep(1e-4)
            wait = 0.0
        elif stages["tower"].busy():
            left = stages["tower"].next_done_in()
            wait = max_wait if left is None else min(max_wait, left)
        else:
            wait = max_wait
        intake = self.stages["intake"]
        taking = self.accepting and intake.accepting()
        socks = [self.bootstrap_sock] + ([self.intake_sock] if taking else [])
        if wait >= 1e-3:
            zmq.select(socks, [], [], timeout=wait)
        self._drain(self.bootstrap_sock, self.stages["sender"])
        if taking:
            self._drain(self.intake_sock, intake, until=lambda: not intake.accepting())
        now = time.monotonic()
        for stage in self.stages.values():
            stage.tick(now)
            stage.pushed()
            self._dispatch()
        if self.metrics is not None and now - self._published_at > 0.05:
            # The endpoint's thread reads copies: the stages' own counters change under this loop.
            self._published_at = now
            self.published = {name: stage.stats() for name, stage in self.stages.items()}

    def _drain(self, sock, stage, limit: int = 256, until=None) -> None:
        for _ in range(limit):
            if until is not None and until():
                return
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            stage.handle("socket", frame)
            stage.pushed()
            self._dispatch()

    def _dispatch(self) -> None:
        queue, stages = self.queue, self.stages
        while queue:
            dest, source, rec = queue.popleft()
            stages[dest].handle(source, rec)
            stages[dest].pushed()  # emitted records are in the queue

    def on_conclusions(self, conclusions: list) -> None:
        """Hook for callers that watch rooms conclude (the demo, tests)."""

    # ------------------------------------------------------------ state
    def stats(self) -> dict:
        out = {}
        for stage in self.stages.values():
            out.update(stage.stats())
        return out

    def metrics_snapshot(self) -> Snapshot:
        """What the metrics endpoint reports; called on its thread at every scrape."""
        stats = self.published
        totals = Totals()
        for s in stats.values():
            totals.add(totals_of(s))
        arenas = {"pixels": (self.pixel_arena.used_bytes(), self.pixel_arena.size),
                  "embeddings": (self.emb_arena.used_bytes(), self.emb_arena.size)}
        return Snapshot(totals, stats, {}, arenas, self.rooms.count_live())

    def idle(self) -> bool:
        return not self.queue and not any(s.busy() for s in self.stages.values()) \
            and not len(self.scheduler) and not self.sender.live

    def drain(self, deadline_s: float, cut_short=lambda: False) -> None:
        """Stop taking work; let rooms in flight finish until the deadline (or until
        `cut_short()`); fail the rest."""
        self.accepting = False
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and not self.idle() and not cut_short():
            self.step(0.005)
        for e in self.rooms.entries():
            if e.state < RoomState.SUCCESS:
                self.stages["reaper"].handle("intake", RoomFailure(e.slot, e.room, "worker shutting down"))
                self.stages["reaper"].pushed()
                self._dispatch()
        end = time.monotonic() + 30
        while time.monotonic() < end and (self.queue or self.sender.busy()):
            self.step(0.005)

    def close(self) -> None:
        if self.metrics is not None:  # first: a scrape reads the objects closed below
            self.metrics.close()
            self.metrics = None
        for stage in self.stages.values():
            try:
                stage.close()  # the tower's waits for its jobs; the reaper's closes status sockets
            except Exception as e:
                log.warning("closing the %s stage: %s", stage.name, e)
        if "cache" in self.stages:
            self.stages["cache"].hc.cache.clear()
        if "tower" in self.stages:
            self.tower = None  # closed with its stage
        self.stages = {}
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.ctx is not None:
            for name in ("intake_sock", "bootstrap_sock"):
                sock = getattr(self, name, None)
                if sock is not None:
                    sock.close(linger=0)
            self.ctx.term()
            self.ctx = None
            wiring.unlink_ipc(self.cfg.intake)
        if self.tower is not None:
            self.tower.close()
            self.tower = None
        for obj in reversed(self._objects):
            obj.close()
            obj.unlink()
        self._objects = []
        if self.lock is not None:
            shm.sweep(self.cfg.shm_prefix, self.lock.run_id, include_live=True)
            self.lock.release()
            self.lock = None
