"""The tower stage: runs the scheduler's batches on a vision tower (``stages.towers``)."""
from __future__ import annotations

import logging
import time

from dataclasses import replace

import numpy as np

from ipc.arena import StaleLease
from ipc.rooms import RoomState
from ipc.stats import Histogram, ReasonCode
from stages import registry
from stages.base import POLL_S, Stage
from stages.records import (OWNER_SCHEDULER, Batch, Encoded, EncodeFailed, ReadyItem, RoomFailure,
                            TowerCredit, TowerRestarted, WorkItem)
from stages.towers import Tower, TowerError, TowerItem, TowerJob, numpy_dtype
from stages.towers.base import DoneJob, TimedJob

log = logging.getLogger("epd.tower")


class TowerStage(Stage):
    """Batches from the scheduler in; each item's rows to the sender and the cache, a credit back.

    Jobs start as batches arrive (an asynchronous device queues them); results go
    out in order as jobs finish. Pixels are dropped once the batch is done; the
    item's output lease travels on to the sender and the cache, which take it over.
    The tower itself belongs to whoever built it (pipeline/runtime/loop.py's Env closes it).
    `name` is the replica's stage name (stages/registry.py), which gives its owner number.
    """

    # A tower that computes in `start` (a CPU one) is done with a batch when `handle`
    # returns: its rows and credit go out before the next batch in the ring is computed,
    # not after every batch that came together (which held the receivers and the
    # scheduler back by a forward each, and starved the tower of full batches).
    settle_each_record = True

    def __init__(self, emit, *, tower: Tower, pixel_arena, emb_arena, rooms, custody=None,
                 name: str = registry.TOWER):
        super().__init__(emit, custody)
        self.name = name
        self.replica = registry.replica_of(name)
        self.owner = registry.owner_of(name)
        self.tower = tower
        self.pixel_arena = pixel_arena
        self.emb_arena = emb_arena
        self.rooms = rooms
        self.jobs: list[tuple[TowerJob, list[WorkItem], float]] = []  # (job, its items, time.monotonic() it started)
        self.batches = 0
        self.items = 0
        self.rows = 0
        self.batch_seconds = Histogram()
        register = getattr(tower, "register_host_memory", None)
        if register is not None:
            register(emb_arena.address, emb_arena.size)

    def start(self) -> None:
        # Credits for batches a predecessor held died with it.
        self.emit(registry.SCHEDULER, TowerRestarted(self.replica))

    def handle(self, source: str, rec) -> None:
        match rec:
            case Batch(items=batch):
                self._start_job(batch)
                self.tick(time.monotonic())
            case _:
                raise ValueError(f"tower: unexpected record from {source}: {rec!r}")

    def _start_job(self, batch: tuple[WorkItem, ...]) -> None:
        spec = self.tower.spec
        live, items, outs = [], [], []
        for w in batch:
            self.custody.hold(w.slot, w.room)
            try:
                self.pixel_arena.transfer(w.pixels, OWNER_SCHEDULER, self.owner)
                self.emb_arena.transfer(w.out, OWNER_SCHEDULER, self.owner)
                px = np.frombuffer(self.pixel_arena.view(w.pixels), dtype=numpy_dtype(w.pixel_dtype))
                flat = np.frombuffer(self.emb_arena.view(w.out), dtype=spec.np_dtype)
            except StaleLease:
                self._release_leases(w)
                self.emit(registry.REAPER, RoomFailure(w.slot, w.room, "pixels or output space lost (scheduler died)",
                                                       ReasonCode.STAGE_DIED))
                self.custody.release(w.slot, w.room)
                continue
            items.append(TowerItem(w.modality, [tuple(g) for g in w.grid_thw],
                                   px.reshape(w.n_patches, w.patch_dim)))
            main = flat[: w.span * spec.hidden].reshape(w.span, spec.hidden)
            deep = (flat[w.span * spec.hidden:].reshape(w.span, spec.deepstack_width)
                    if spec.deepstack_width else None)
            outs.append((main, deep))
            live.append(w)
            self.rooms.advance(w.slot, w.room, RoomState.ENCODING)
        if not live:
            self.emit(registry.SCHEDULER, TowerCredit(self.replica))
            return
        self.batches += 1
        self.items += len(live)
        self.rows += sum(w.span for w in live)
        try:
            job = self.tower.start(items, outs)
        except TowerError as e:
            job = DoneJob(e)
        self.jobs.append((job, live, time.monotonic()))

    def tick(self, now: float) -> None:
        while self.jobs and self.jobs[0][0].done():
            job, batch, started = self.jobs.pop(0)
            self.batch_seconds.observe(time.monotonic() - started)
            self._finish(job, batch)

    def _finish(self, job: TowerJob, batch: list[WorkItem]) -> None:
        """Each item's rows out, or its failure; the pixels given back; a credit back."""
        try:
            job.result()
            error = None
        except TowerError as e:
            error = f"tower failed: {e}"
        rooms = frozenset(w.room for w in batch)
        if error is not None:
            log.warning("tower batch of %d items failed: room=%s: %s", len(batch),
                        ",".join(map(str, sorted(rooms))), error)
        for w in batch:
            self.pixel_arena.drop(w.pixels, self.owner)
            w = replace(w, pixels=None)
            if error is None:
                # Straight to the sender (the critical path), and to the cache, which
                # shares the rows with identical items waiting and caches them: each
                # gets a reference of ours and takes it over on receipt.
                self.emb_arena.addref(w.out, self.owner)
                self.emit(registry.SENDER, ReadyItem(w.slot, w.room, w.item, w.span, w.out))
                self.emit(registry.CACHE, Encoded(w))
            else:
                self.emb_arena.drop(w.out, self.owner)
                self.emit(registry.CACHE, EncodeFailed(replace(w, out=None), error, rooms))
            self.custody.release(w.slot, w.room)
        self.emit(registry.SCHEDULER, TowerCredit(self.replica))

    def next_tick_in(self, now: float) -> float | None:
        """When the oldest job may be done: the sim tower can tell; a device is polled."""
        if not self.jobs:
            return None
        job = self.jobs[0][0]
        return max(0.0, job.ready_at - now) if isinstance(job, TimedJob) else POLL_S

    def stats(self) -> dict:
        return {"tower_batches": self.batches, "tower_items": self.items, "tower_rows": self.rows,
                "tower_batch_seconds": self.batch_seconds.snapshot(), "tower_name": self.tower.spec.name}

    def _release_leases(self, w: WorkItem) -> None:
        for arena, lease in ((self.pixel_arena, w.pixels), (self.emb_arena, w.out)):
            for owner in (self.owner, OWNER_SCHEDULER):
                try:
                    arena.drop(lease, owner)
                    break
                except StaleLease:
                    continue

    def close(self) -> None:
        for job, _, _ in self.jobs:
            try:
                job.result(timeout=10)
            except Exception:
                pass


def build(env, settings: None, name, emit, custody) -> TowerStage:
    # No settings of its own: the runtime builds the replica's tower (env.tower).
    sh = env.shared
    return TowerStage(emit, tower=env.tower(registry.replica_of(name)), pixel_arena=sh.pixel_arena,
                      emb_arena=sh.emb_arena, rooms=sh.rooms, custody=custody, name=name)
