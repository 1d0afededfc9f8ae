"""Batches of pending misses: deterministic, FIFO by arrival, under a token budget.

The scheduler stage holds every cache miss that still has to go through the
tower. ``next_batch`` packs greedily from the head of the queue:

* order is ``(seq, room, item)``: ``seq`` is the arrival order, ties broken by
  room then item, so the same arrivals always give the same batches;
* items are taken from the head while the running token sum (a token is one
  row: an item costs its ``span``) stays ``<= max_tokens_per_batch`` and the
  count ``<= max_items_per_batch``; packing stops at the *first* item that does
  not fit. Nothing is skipped over, so nothing starves and every batch is the
  longest prefix of the queue that fits;
* an item whose span alone exceeds the token budget goes alone, in its own
  batch, when it reaches the head (it would never fit otherwise);
* backpressure: ``next_batch(reserve)`` offers the chosen batch to
  ``reserve(batch) -> bool`` (the caller allocates embedding-arena space for its
  output there). On False the batch is not released: it stays at the head, the
  call returns ``[]`` and the same batch is offered again next time, so output
  memory stays bounded.

The queue is a binary heap: ``add`` is O(log n) and ``next_batch`` O(k log n)
for a batch of k items. ``remove_room`` (a failed room) is O(n), which is fine
for a rare event.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from ipc.arena import ArenaFull, Lease, StaleLease
from stages import registry
from stages.base import POLL_S, Stage
from stages.records import (OWNER_CACHE, OWNER_SCHEDULER, Batch, RoomAbandoned, RoomFailure, SpaceWanted,
                            TowerCredit, TowerDown, TowerRestarted, WorkItem)


@dataclass(frozen=True, order=True)
class Pending:
    """One item waiting for the tower. Sorted by ``(seq, room, item)``."""

    seq: int  # arrival order
    room: int
    item: int
    span: int  # rows (vision tokens) the item costs
    payload: object = field(default=None, compare=False)


Reserve = Callable[[list[Pending]], bool]


class Scheduler:
    def __init__(self, max_tokens_per_batch: int, max_items_per_batch: int):
        for name, value in (
            ("max_tokens_per_batch", max_tokens_per_batch),
            ("max_items_per_batch", max_items_per_batch),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"scheduler budget {name} must be an integer >= 1, got {value!r}")
            if value < 1:
                raise ValueError(f"scheduler budget {name} must be >= 1, got {value}")
        self.max_tokens_per_batch = max_tokens_per_batch
        self.max_items_per_batch = max_items_per_batch
        self._heap: list[Pending] = []
        self._per_room: dict[int, int] = {}
        self._tokens = 0
        self.held_back = 0  # times a batch was refused by ``reserve``

    def add(self, p: Pending) -> None:
        if p.span < 0:
            raise ValueError(f"pending item room={p.room} item={p.item} has negative span {p.span}")
        heapq.heappush(self._heap, p)
        self._per_room[p.room] = self._per_room.get(p.room, 0) + 1
        self._tokens += p.span

    def next_batch(self, reserve: Optional[Reserve] = None) -> list[Pending]:
        """The next batch (removed from the queue), or [] if empty or held back."""
        heap = self._heap
        if not heap:
            return []
        batch: list[Pending] = []
        tokens = 0
        while heap and len(batch) < self.max_items_per_batch:
            head = heap[0]
            if batch and tokens + head.span > self.max_tokens_per_batch:
                break
            batch.append(heapq.heappop(heap))
            tokens += head.span
            if tokens > self.max_tokens_per_batch:  # an oversize item, alone
                break
        if reserve is not None:
            try:
                ok = reserve(batch)
            except BaseException:
                self._push_back(batch)
                raise
            if not ok:
                self._push_back(batch)
                self.held_back += 1
                return []
        for p in batch:
            self._forget(p)
        return batch

    def _push_back(self, batch: list[Pending]) -> None:
        for p in batch:
            heapq.heappush(self._heap, p)

    def _forget(self, p: Pending) -> None:
        n = self._per_room[p.room] - 1
        if n:
            self._per_room[p.room] = n
        else:
            del self._per_room[p.room]
        self._tokens -= p.span

    def remove_room(self, room: int) -> list[Pending]:
        """Take every pending item of ``room`` out of the queue; returned in queue order."""
        if room not in self._per_room:
            return []
        gone = sorted(p for p in self._heap if p.room == room)
        self._heap = [p for p in self._heap if p.room != room]
        heapq.heapify(self._heap)
        for p in gone:
            self._forget(p)
        return gone

    def has_full_batch(self) -> bool:
        """Whether the next batch would be cut by a budget rather than by the queue's end."""
        return len(self._heap) >= self.max_items_per_batch or self._tokens >= self.max_tokens_per_batch

    def pending_tokens(self) -> int:
        return self._tokens

    def rooms(self) -> set[int]:
        return set(self._per_room)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)


SPACE_WANTED_EVERY_S = 0.2


class SchedulerStage(Stage):
    """Misses from the cache in; batches to the tower replicas, at most `depth` outstanding each.

    A tower hands a credit back for every batch it finishes, so batches wait here
    (FIFO, their output space not yet reserved) rather than in a tower's ring. Each
    batch goes to the replica with the most credit left (the lowest number on a tie),
    so the batches and where they go follow from the arrivals and the completions
    alone. A replica that died has none until its successor announces itself.
    """

    name = "scheduler"
    owner = OWNER_SCHEDULER

    def __init__(self, emit, scheduler: Scheduler, *, pixel_arena, emb_arena, entry_bytes,
                 custody=None, depth: int = 2, towers: tuple[str, ...] = (registry.TOWER,)):
        super().__init__(emit, custody)
        self.scheduler = scheduler
        self.pixel_arena = pixel_arena
        self.emb_arena = emb_arena
        self.entry_bytes = entry_bytes  # span -> bytes of the item's rows
        self.depth = depth
        self.towers = list(towers)  # stage names, by replica number
        self.credits = [depth] * len(self.towers)
        self.reserved: dict[tuple[int, int], Lease] = {}  # (room, item) -> output space, for the batch at hand
        self.short_of = 0  # bytes the batch at the head could not reserve
        self.wanted_at = float("-inf")

    def handle(self, source: str, rec) -> None:
        match rec:
            case WorkItem() as w:
                self.custody.hold(w.slot, w.room)
                try:
                    self.pixel_arena.transfer(w.pixels, OWNER_CACHE, self.owner)
                except StaleLease:
                    self.emit("reaper", RoomFailure(w.slot, w.room,
                                                    "pixels were lost before scheduling (cache died)"))
                    self.custody.release(w.slot, w.room)
                    return
                self.scheduler.add(Pending(w.seq, w.room, w.item, w.span, w))
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
                for p in self.scheduler.remove_room(room):
                    self._release_leases(p.payload)
                self.custody.forget(room)
            case _:
                raise ValueError(f"scheduler: unexpected record from {source}: {rec!r}")

    def _release_leases(self, w: WorkItem) -> None:
        for arena, lease in ((self.pixel_arena, w.pixels), (self.emb_arena, w.out)):
            if lease is not None:
                try:
                    arena.drop(lease, self.owner)
                except StaleLease:
                    pass

    def _reserve(self, batch: list[Pending]) -> bool:
        for p in batch:
            nbytes = self.entry_bytes(p.span)
            try:
                lease = self.emb_arena.alloc(nbytes, self.owner)
            except ArenaFull:  # every lease slot is live: as short of room as no space
                lease = None
            if lease is None:
                for taken in self.reserved.values():
                    self.emb_arena.drop(taken, self.owner)
                self.reserved.clear()
                self.short_of = sum(self.entry_bytes(q.span) for q in batch)
                return False
            self.reserved[(p.room, p.item)] = lease
        self.short_of = 0
        return True

    def tick(self, now: float) -> None:
        self.short_of = 0
        while max(self.credits) > 0:
            k = self.credits.index(max(self.credits))
            if self.credits[k] < self.depth and not self.scheduler.has_full_batch():
                # Every replica is computing: a part batch now would only wait behind that
                # work, so let it fill. A replica that finishes comes back to full credit
                # and takes what there is.
                break
            batch = self.scheduler.next_batch(self._reserve)
            if not batch:
                break
            self.credits[k] -= 1
            items = tuple(replace(p.payload, out=self.reserved.pop((p.room, p.item))) for p in batch)
            self.emit(self.towers[k], Batch(items))
            for w in items:
                self.custody.release(w.slot, w.room)
        if self.short_of and now - self.wanted_at >= SPACE_WANTED_EVERY_S:
            # Cached rows may be what fills the arena: the cache gives them back. Asked
            # again while short, as the rows in flight to receivers are freed meanwhile.
            self.emit("cache", SpaceWanted(self.short_of))
            self.wanted_at = now

    def next_tick_in(self, now: float) -> float | None:
        # Items wait for a credit (the tower's answer wakes us), for more items to fill a
        # batch (so do they), or for embedding space (poll).
        return POLL_S if self.short_of else None

    def stats(self) -> dict:
        return {"scheduler_pending": len(self.scheduler), "scheduler_pending_tokens": self.scheduler.pending_tokens()}


def build(env, name, emit, custody) -> SchedulerStage:
    cfg, spec, sh = env.cfg, env.spec, env.shared
    return SchedulerStage(emit, Scheduler(cfg.max_tokens_per_batch, cfg.max_items_per_batch),
                          pixel_arena=sh.pixel_arena, emb_arena=sh.emb_arena,
                          entry_bytes=lambda span: span * spec.row_bytes, custody=custody,
                          towers=tuple(registry.tower_names(cfg.tower_replicas)))
