"""The tower stage: runs the scheduler's batches on a vision tower (``stages.towers``)."""
from __future__ import annotations

import logging
import time

import numpy as np

from ipc.stats import Histogram
from stages.base import Stage
from stages.towers import Tower, TowerError, TowerItem, TowerJob, numpy_dtype
# Not used here: pipeline/ imports them from this module until it imports them from stages.towers.
from stages.towers import TowerSpec, build_tower  # noqa: F401
from stages.towers.base import DoneJob, TimedJob

log = logging.getLogger("epd.tower")


class TowerStage(Stage):
    """Batches from the scheduler in; each item's rows to the sender and the cache, a credit back.

    Jobs start as batches arrive (an asynchronous device queues them); results go
    out in order as jobs finish. Pixels are dropped once the batch is done; the
    item's output lease travels on to the sender and the cache, which take it over.
    """

    name = "tower"

    def __init__(self, emit, tower: Tower, *, pixel_arena, emb_arena, rooms, owner: int,
                 prev_owner: int, custody=None):
        from stages.base import Custody

        self.emit = emit
        self.tower = tower
        self.pixel_arena = pixel_arena
        self.emb_arena = emb_arena
        self.rooms = rooms
        self.owner = owner
        self.prev_owner = prev_owner
        self.custody = custody or Custody()
        self.jobs: list[tuple[TowerJob, list]] = []
        self.job_started: list[float] = []  # time.monotonic() each job started, in self.jobs' order
        self.batches = 0
        self.items = 0
        self.rows = 0
        self.batch_seconds = Histogram()
        register = getattr(tower, "register_host_memory", None)
        if register is not None:
            register(emb_arena.address, emb_arena.size)

    def handle(self, source: str, batch) -> None:
        from ipc.arena import StaleLease
        from ipc.rooms import RoomState
        from stages.records import RoomFailure

        if source != "scheduler":
            raise ValueError(f"tower: unexpected source {source!r}")
        spec = self.tower.spec
        live, items, outs = [], [], []
        for w in batch:
            self.custody.hold(w.slot, w.room)
            try:
                self.pixel_arena.transfer(w.pixels, self.prev_owner, self.owner)
                self.emb_arena.transfer(w.out, self.prev_owner, self.owner)
                px = np.frombuffer(self.pixel_arena.view(w.pixels), dtype=numpy_dtype(w.pixel_dtype))
                flat = np.frombuffer(self.emb_arena.view(w.out), dtype=spec.np_dtype)
            except StaleLease:
                self._drop(w)
                self.emit("reaper", RoomFailure(w.slot, w.room, "pixels or output space lost (scheduler died)"))
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
            self.emit("scheduler", ("credit",))
            return
        self.batches += 1
        self.items += len(live)
        self.rows += sum(w.span for w in live)
        try:
            job = self.tower.start(items, outs)
        except TowerError as e:
            job = DoneJob(e)
        self.jobs.append((job, live))
        self.job_started.append(time.monotonic())

    def tick(self, now: float) -> None:
        from stages.records import ReadyItem

        while self.jobs and self.jobs[0][0].done():
            job, batch = self.jobs.pop(0)
            self.batch_seconds.observe(time.monotonic() - self.job_started.pop(0))
            try:
                job.result()
                error = None
            except TowerError as e:
                error = f"tower failed: {e}"
            rooms = {w.room for w in batch}
            if error is not None:
                log.warning("tower batch of %d items failed: room=%s: %s", len(batch),
                            ",".join(map(str, sorted(rooms))), error)
            for w in batch:
                self.pixel_arena.drop(w.pixels, self.owner)
                w.pixels = None
                if error is None:
                    # Straight to the sender (the critical path), and to the cache, which
                    # shares the rows with identical items waiting and caches them: each
                    # gets a reference of ours and takes it over on receipt.
                    self.emb_arena.addref(w.out, self.owner)
                    self.emit("sender", ReadyItem(w.slot, w.room, w.item, w.span, w.out))
                    self.emit("cache", ("encoded", w))
                else:
                    self.emb_arena.drop(w.out, self.owner)
                    w.out = None
                    self.emit("cache", ("failed", w, error, rooms))
                self.custody.release(w.slot, w.room)
            self.emit("scheduler", ("credit",))

    def busy(self) -> bool:
        return bool(self.jobs)

    def stats(self) -> dict:
        return {"tower_batches": self.batches, "tower_items": self.items, "tower_rows": self.rows,
                "tower_batch_seconds": self.batch_seconds.snapshot()}

    def next_done_in(self) -> float | None:
        """Seconds until the oldest job may be done, when the tower can tell (sim)."""
        if self.jobs and isinstance(self.jobs[0][0], TimedJob):
            return max(0.0, self.jobs[0][0].ready_at - time.monotonic())
        return None

    def _drop(self, w) -> None:
        from ipc.arena import StaleLease

        for arena, lease in ((self.pixel_arena, w.pixels), (self.emb_arena, w.out)):
            for owner in (self.owner, self.prev_owner):
                try:
                    arena.drop(lease, owner)
                    break
                except StaleLease:
                    continue

    def close(self) -> None:
        for job, _ in self.jobs:
            try:
                job.result(timeout=10)
            except Exception:
                pass
        self.tower.close()
