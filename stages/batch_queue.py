"""Entries waiting to be batched: deterministic, FIFO by arrival, under a token budget.

``next_batch`` packs greedily from the head of the queue:

* order is ``(seq, room, item)``: ``seq`` is the arrival order, ties broken by
  room then item, so the same arrivals always give the same batches;
* entries are taken from the head while the running token sum stays
  ``<= max_tokens_per_batch`` and the count ``<= max_items_per_batch``; packing
  stops at the *first* entry that does not fit. Nothing is skipped over, so
  nothing starves and every batch is the longest prefix of the queue that fits;
* an entry whose tokens alone exceed the budget goes alone, in its own batch,
  when it reaches the head (it would never fit otherwise);
* backpressure: ``next_batch(reserve)`` offers the chosen batch to
  ``reserve(batch) -> bool`` (the caller reserves what the batch needs there).
  On False the batch is not released: it stays at the head, the call returns
  ``[]`` and the same batch is offered again next time.

The queue is a binary heap: ``add`` is O(log n) and ``next_batch`` O(k log n)
for a batch of k entries. ``remove_room`` (a failed room) is O(n), which is fine
for a rare event. What an entry carries (``payload``) is the caller's.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass(frozen=True, order=True)
class Entry:
    """One entry waiting in the queue. Sorted by ``(seq, room, item)``."""

    seq: int  # arrival order
    room: int
    item: int
    tokens: int  # what it costs of a batch's token budget
    payload: object = field(default=None, compare=False)
    arrived: float = field(default=0.0, compare=False)  # time.monotonic() when it joined the queue


Reserve = Callable[[list[Entry]], bool]


class BatchQueue:
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
        self._heap: list[Entry] = []
        self._per_room: dict[int, int] = {}
        self._tokens = 0
        self.held_back = 0  # times a batch was refused by ``reserve``

    def add(self, e: Entry) -> None:
        if e.tokens < 0:
            raise ValueError(f"queued entry room={e.room} item={e.item} has negative tokens {e.tokens}")
        heapq.heappush(self._heap, e)
        self._per_room[e.room] = self._per_room.get(e.room, 0) + 1
        self._tokens += e.tokens

    def next_batch(self, reserve: Optional[Reserve] = None) -> list[Entry]:
        """The next batch (removed from the queue), or [] if empty or held back."""
        heap = self._heap
        if not heap:
            return []
        batch: list[Entry] = []
        tokens = 0
        while heap and len(batch) < self.max_items_per_batch:
            head = heap[0]
            if batch and tokens + head.tokens > self.max_tokens_per_batch:
                break
            batch.append(heapq.heappop(heap))
            tokens += head.tokens
            if tokens > self.max_tokens_per_batch:  # an oversize entry, alone
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
        for e in batch:
            self._forget(e)
        return batch

    def _push_back(self, batch: list[Entry]) -> None:
        for e in batch:
            heapq.heappush(self._heap, e)

    def _forget(self, e: Entry) -> None:
        n = self._per_room[e.room] - 1
        if n:
            self._per_room[e.room] = n
        else:
            del self._per_room[e.room]
        self._tokens -= e.tokens

    def remove_room(self, room: int) -> list[Entry]:
        """Take every entry of ``room`` out of the queue; returned in queue order."""
        if room not in self._per_room:
            return []
        gone = sorted(e for e in self._heap if e.room == room)
        self._heap = [e for e in self._heap if e.room != room]
        heapq.heapify(self._heap)
        for e in gone:
            self._forget(e)
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
