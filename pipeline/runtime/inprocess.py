"""The reference design (`--mode inprocess`): every stage object in one process, one loop.

The same stage objects run in the multi-process pipeline; here records move from
one to the next through a local queue, in the order they were emitted. Tower
replicas are more tower stages in the same loop, each with its own tower (and GPU):
a tower stage never waits for its device (it starts a job and polls it), so one loop
keeps several devices busy as it keeps one.
"""
from __future__ import annotations

import logging
import time

from pipeline.runtime import wiring
from pipeline.runtime.loop import Env, Loop, QueueChannel
from pipeline.ops.metrics import MetricsServer, Snapshot, Totals, merge_stats, totals_of
from pipeline.runtime.serving import RunResources, Serving, SignalFlag
from pipeline.integrations.tokenspeed_front import Fronts, start_fronts
from stages import registry
from stages.registry import REQUEST_STAGE, SUPERVISOR

log = logging.getLogger("epd.worker")


class InProcessWorker:
    """The in-process runtime: its run's resources, every stage built from one Env and
    run in one Loop over a QueueChannel, and serving and the drain (Serving, with this as
    its StageControl). `tower`, if given, is the first replica's, built by the caller."""

    def __init__(self, cfg, tower=None):
        self.run = RunResources(cfg)
        self.cfg, self.run_id, self.shared, self.rooms = self.run.cfg, self.run.run_id, self.run.shared, self.run.rooms
        self.serving = Serving(self.run, self)
        self.fatal: str | None = None  # stays None: no stage here dies apart from the loop
        self.env = Env(self.cfg, self.run_id, self.shared, tower=tower)
        self.channel = QueueChannel()
        self.stages = self.channel.stages  # by name, in the order a round visits them
        self.loop: Loop | None = None  # made once every stage is built
        self.metrics: MetricsServer | None = None  # the Prometheus endpoint; .port is the one bound
        self.fronts: Fronts | None = None  # tokenspeed's, when asked for: once every stage is ready
        self.published: dict[str, dict] = {}        # each stage's stats(), copied by the loop for it
        self.published_at = 0.0
        self.run.notifier.status("starting the stages")
        try:
            for name in registry.stage_names(self.cfg.tower_replicas, self.cfg.preprocess_workers):
                self.stages[name] = self.env.build(name, self.channel.emitter(name), None)
            self.spec = self.env.spec
            self.loop = Loop(list(self.stages.values()), self.channel, self.env.zmq_context, self.env.curve)
            for stage in self.stages.values():
                stage.start()
                self.loop.settle(stage)
            if self.cfg.metrics_endpoint:
                self.metrics = MetricsServer(self.cfg.metrics_endpoint, self.metrics_snapshot, self.serving.health)
            self.fronts = start_fronts(self.cfg, self.spec, self.run_id, lambda: self.serving.draining)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ the loop
    def watch(self, stop: SignalFlag) -> None:
        self.step()

    def step(self, max_wait: float = 0.02) -> None:
        self.loop.step(max_wait)
        now = time.monotonic()
        if self.metrics is not None and now - self.published_at > 0.05:
            # The endpoint's thread reads copies: the stages' own counters change under this loop.
            self.published_at = now
            self.published = {name: stage.stats() for name, stage in self.stages.items()}

    def poll(self) -> None:
        self.step(0.005)

    def close_intake(self, refusing: str = "") -> None:
        stage = self.stages[REQUEST_STAGE]
        if refusing:
            stage.refuse(refusing)
            self.loop.settle(stage)  # a request it had stalled on fails at its next tick
        self.loop.close_when_read(stage)

    def intake_closed(self) -> bool:
        return self.loop.read_to_the_end(self.stages[REQUEST_STAGE])

    def tell_reaper(self, record) -> bool:
        reaper = self.stages[wiring.supervisor_reader()]
        reaper.handle(SUPERVISOR, record)
        self.loop.settle(reaper)
        return True

    def settled(self) -> bool:
        # Work in hand (writes, a device job) is due within a poll; timers (deadlines) are not work.
        now = time.monotonic()
        return not self.channel.pending() and all(
            due is None or due > 0.01 for due in (s.next_tick_in(now) for s in self.stages.values()))

    def stop_all(self) -> None:
        """Nothing to stop: the stages are closed with the worker (close)."""

    def heartbeat_ages(self) -> dict[str, float | None]:
        """None: the loop's turn is its stages' heartbeat."""
        return {}

    def stages_not_ready(self) -> list[str]:
        return []  # every stage was started before the constructor returned

    def stages_not_ready_since(self) -> dict[str, float]:
        return {}

    # ------------------------------------------------------------ state
    def stats(self) -> dict:
        out = merge_stats({name: stage.stats() for name, stage in self.stages.items()})
        return {**out, **self.fronts.stats()} if self.fronts is not None else out

    def metrics_snapshot(self) -> Snapshot:
        """What the metrics endpoint reports; called on its thread at every scrape."""
        stats = self.published
        totals = Totals()
        for s in stats.values():
            totals.add(totals_of(s))
        sh = self.shared
        arenas = {"pixels": (sh.pixel_arena.used_bytes(), sh.pixel_arena.size),
                  "embeddings": (sh.emb_arena.used_bytes(), sh.emb_arena.size)}
        return Snapshot(totals, stats, {}, arenas, self.rooms.count_live())

    def close(self) -> None:
        if self.fronts is not None:
            self.fronts.close()
            self.fronts = None
        if self.metrics is not None:  # first: a scrape reads the objects closed below
            self.metrics.close()
            self.metrics = None
        for stage in self.stages.values():
            try:
                stage.close()  # the tower's waits for its jobs; the reaper's closes status sockets
            except Exception as e:
                log.warning("closing the %s stage: %s", stage.name, e)
        self.stages.clear()
        if self.loop is not None:
            self.loop.close()
        self.env.close()
        self.run.close()
