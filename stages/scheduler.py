"""The scheduler stage: cache misses in, batches out to the tower replicas.

The misses wait in a `BatchQueue` (stages/batch_queue.py: FIFO by arrival, cut by a
token budget and an item cap); a token is one row of output, so an item costs its
span. A batch leaves only once its output space is reserved in the embedding arena,
so output memory stays bounded.
"""
from __future__ import annotations

import time
from dataclasses import replace

from ipc.arena import ArenaFull, Lease, StaleLease
from ipc.stats import Histogram, ReasonCode
from stages import registry
from stages.base import POLL_S, Stage
from stages.batch_queue import BatchQueue, Entry
from stages.records import (OWNER_SCHEDULER, Batch, RoomAbandoned, RoomFailure, SpaceWanted,
                            TowerCredit, TowerDown, TowerRestarted, WorkItem)
from stages.settings import SchedulerSettings

SPACE_WANTED_EVERY_S = 0.2


class SchedulerStage(Stage):
    """Misses from the cache in; batches to the tower replicas, at most `depth` outstanding each.

    A tower hands a credit back for every batch it finishes, so batches wait here
    (FIFO, their output space not yet reserved) rather than in a tower's ring. Each
    batch goes to the replica with the most credit left (the lowest number on a tie),
    so the batches and where they go follow from the arrivals and the completions
    alone. A replica that died has none until its successor announces itself.
    """

    name = registry.SCHEDULER
    owner = OWNER_SCHEDULER

    def __init__(self, emit, *, queue: BatchQueue, pixel_arena, emb_arena, entry_bytes, custody=None,
                 depth: int = 2, towers: tuple[str, ...] = (registry.TOWER,)):
        super().__init__(emit, custody)
        self.queue = queue  # of Entry(payload=the WorkItem)
        self.pixel_arena = pixel_arena
        self.emb_arena = emb_arena
        self.entry_bytes = entry_bytes  # span -> bytes of the item's rows
        self.depth = depth
        self.towers = list(towers)  # stage names, by replica number
        self.credits = [depth] * len(self.towers)
        self.reserved: dict[tuple[int, int], Lease] = {}  # (room, item) -> output space, for the batch at hand
        self.short_of = 0  # bytes the batch at the head could not reserve
        self.wanted_at = float("-inf")
        self.queue_wait = Histogram()  # an item's arrival here to its batch leaving for a tower

    def handle(self, source: str, rec) -> None:
        match rec:
            case WorkItem() as w:
                self._item(w, source)
            case TowerRestarted(replica=k):
                # The batches its predecessor held died with it and will hand no credit back.
                # Those still in the ring will: a cap of `depth` keeps them from adding up.
                self.credits[k] = self.depth
            case TowerCredit(replica=k):
                self.credits[k] = min(self.credits[k] + 1, self.depth)
            case TowerDown(replica=k):
                # Behind every credit of the dead one, ahead of its successor's TowerRestarted
                # (both on its ring): none reaches a replica that is restarting. Batches already
                # in its ring wait for the successor.
                self.credits[k] = 0
            case RoomAbandoned(room=room):
                for e in self.queue.remove_room(room):
                    self._release_leases(e.payload)
                self.custody.forget(room)
            case _:
                raise ValueError(f"scheduler: unexpected record from {source}: {rec!r}")

    def tick(self, now: float) -> None:
        self.short_of = 0
        while max(self.credits) > 0:
            k = self.credits.index(max(self.credits))
            if self.credits[k] < self.depth and not self.queue.has_full_batch():
                # Every replica is computing: a part batch now would only wait behind that
                # work, so let it fill. A replica that finishes comes back to full credit
                # and takes what there is.
                break
            batch = self.queue.next_batch(self._reserve)
            if not batch:
                break
            self.credits[k] -= 1
            items = tuple(replace(e.payload, out=self.reserved.pop((e.room, e.item))) for e in batch)
            self.emit(self.towers[k], Batch(items))
            for e in batch:
                self.queue_wait.observe(max(0.0, now - e.arrived))
            for w in items:
                self.custody.release(w.slot, w.room)
        if self.short_of and now - self.wanted_at >= SPACE_WANTED_EVERY_S:
            # Cached rows may be what fills the arena: the cache gives them back. Asked
            # again while short, as the rows in flight to receivers are freed meanwhile.
            self.emit(registry.CACHE, SpaceWanted(self.short_of))
            self.wanted_at = now

    def next_tick_in(self, now: float) -> float | None:
        # Items wait for a credit (the tower's answer wakes us), for more items to fill a
        # batch (so do they), or for embedding space (poll).
        return POLL_S if self.short_of else None

    def stats(self) -> dict:
        return {"scheduler_pending": len(self.queue), "scheduler_pending_tokens": self.queue.pending_tokens(),
                "scheduler_queue_wait_seconds": self.queue_wait.snapshot()}

    def _item(self, w: WorkItem, source: str) -> None:
        self.custody.hold(w.slot, w.room)
        try:
            # From the cache, or (a compressed image, decoded) from the preprocess stage.
            self.pixel_arena.transfer(w.pixels, registry.owner_of(source), self.owner)
        except StaleLease:
            self.emit(registry.REAPER, RoomFailure(w.slot, w.room, f"pixels were lost before scheduling ({source} "
                                                   f"died)", ReasonCode.STAGE_DIED))
            self.custody.release(w.slot, w.room)
            return
        self.queue.add(Entry(w.seq, w.room, w.item, w.span, w, arrived=time.monotonic()))

    def _reserve(self, batch: list[Entry]) -> bool:
        """Output space for each item of `batch`, or none and False (`short_of` says how much)."""
        for e in batch:
            try:
                lease = self.emb_arena.alloc(self.entry_bytes(e.tokens), self.owner)
            except ArenaFull:  # every lease slot is live: as short of room as no space
                lease = None
            if lease is None:
                for taken in self.reserved.values():
                    self.emb_arena.drop(taken, self.owner)
                self.reserved.clear()
                self.short_of = sum(self.entry_bytes(q.tokens) for q in batch)
                return False
            self.reserved[(e.room, e.item)] = lease
        self.short_of = 0
        return True

    def _release_leases(self, w: WorkItem) -> None:
        for arena, lease in ((self.pixel_arena, w.pixels), (self.emb_arena, w.out)):
            if lease is not None:
                try:
                    arena.drop(lease, self.owner)
                except StaleLease:
                    pass


def build(env, settings: SchedulerSettings, name, emit, custody) -> SchedulerStage:
    s, spec, sh = settings, env.spec, env.shared
    return SchedulerStage(emit, queue=BatchQueue(s.max_tokens_per_batch, s.max_items_per_batch),
                          pixel_arena=sh.pixel_arena, emb_arena=sh.emb_arena,
                          entry_bytes=lambda span: span * spec.row_bytes, custody=custody,
                          towers=tuple(registry.tower_names(s.tower_replicas)))
