"""What each receiver was told about each room, in shared memory: recorded before it is told.

The reaper records a terminal status here and only then sends it, so that a
successor (handed again the record its predecessor died with, or a late alloc for a
room the predecessor concluded) never tells a receiver the same thing twice, nor
`success` after `failed`.

One entry per (room, receiver) told anything: the room (u64), a 64-bit hash of the
receiver (xxh3; the reaper names a receiver by its id and Mooncake session, so that a
restarted receiver is one not told yet), when it was first told (time.monotonic(), for the tombstone a
successor rebuilds), whether it was told `failed`, and a bit per item told
`success`. One writer (the reaper), no lock. An entry is written while free and
published by one byte store of its flags (0 = free); afterwards a change is one
byte store (an item's success bit, or the failed flag). A writer killed at any
instruction therefore leaves every entry as it was before or after one status.

Bounded: `capacity` entries, sized by the caller from the rooms remembered at once
(live and tombstoned) times a few receivers each; an entry is freed when its room's
tombstone is (`forget`). When it is full `record_*` returns False: the status still
goes out, unrecorded (the caller counts it).
"""

from __future__ import annotations

import numpy as np
import xxhash

from . import shm
from .shared_table import SharedTable, lay_out

__all__ = ["ToldTable", "receiver_hash"]

_USED, _FAILED = 1, 2

# Test hook: called with a point name inside a write (tests SIGKILL the process there).
_fault_hook = None


def incarnation(receiver: str, session: str, number: int | None = None) -> str:
    """The name a status is recorded under: a receiver's id, its Mooncake session and the
    incarnation it registered with, if any (its process), so that a receiver restarted
    under the same id, or on the same session, is one not told yet."""
    return f"{receiver}\0{session}" if number is None else f"{receiver}\0{session}\0{number}"


def receiver_hash(receiver: str) -> int:
    return xxhash.xxh3_64_intdigest(receiver.encode())


def _layout(capacity: int, max_items: int) -> dict[str, int]:
    """Columns: room u64, receiver hash u64, first told f64, flags u8, item bits u8[items/8]."""
    return lay_out(
        (
            ("room", 8 * capacity),
            ("rx", 8 * capacity),
            ("at", 8 * capacity),
            ("flags", capacity),
            ("items", capacity * ((max_items + 7) // 8)),
        )
    )


class ToldTable(SharedTable):
    MAGIC = 0x646C_6F74_0000_0001  # "told", layout 1
    KIND = "told table"
    GEOMETRY = ("capacity", "max_items")
    capacity: int  # the geometry (SharedTable.__init__ sets it from the header)
    max_items: int

    @classmethod
    def segment_size(cls, capacity: int, max_items: int) -> int:
        if not 1 <= capacity <= 2**28 or not 1 <= max_items <= 2**20:
            raise ValueError(f"told table capacity {capacity} or max_items {max_items} out of range")
        return _layout(capacity, max_items)["total"]

    size_of = segment_size  # the name the start-up check calls

    def __init__(self, seg: shm.Segment):
        super().__init__(seg)
        capacity = self.capacity
        lay = _layout(capacity, self.max_items)
        mm = seg.mapped
        self._room = np.frombuffer(mm, np.uint64, capacity, lay["room"])
        self._rx = np.frombuffer(mm, np.uint64, capacity, lay["rx"])
        self._at = np.frombuffer(mm, np.float64, capacity, lay["at"])
        self._flags = np.frombuffer(mm, np.uint8, capacity, lay["flags"])
        self._items = np.frombuffer(mm, np.uint8, capacity * ((self.max_items + 7) // 8), lay["items"]).reshape(
            capacity, -1
        )
        self._index: dict[int, dict[int, int]] | None = None  # room -> receiver hash -> entry
        self._free: list[int] = []

    # -- the writer's view -------------------------------------------------------

    def _entries(self) -> dict[int, dict[int, int]]:
        """Built from the table on first use: a successor picks up its predecessor's entries."""
        if self._index is None:
            used = np.flatnonzero(self._flags)
            self._index = {}
            for e, room, rx in zip(used.tolist(), self._room[used].tolist(), self._rx[used].tolist()):
                self._index.setdefault(room, {})[rx] = e
            self._free = np.flatnonzero(self._flags == 0)[::-1].tolist()
        return self._index

    def rooms(self) -> dict[int, float]:
        """Every room with an entry, and when its first receiver was told."""
        self._entries()
        used = np.flatnonzero(self._flags)
        first: dict[int, float] = {}
        for room, at in zip(self._room[used].tolist(), self._at[used].tolist()):
            first[room] = min(at, first.get(room, at))
        return first

    def _find(self, room: int, receiver: str) -> int | None:
        return self._entries().get(room, {}).get(receiver_hash(receiver))

    def told_failed(self, room: int, receiver: str) -> bool:
        e = self._find(room, receiver)
        return e is not None and bool(self._flags[e] & _FAILED)

    def told_success(self, room: int, item: int, receiver: str) -> bool:
        e = self._find(room, receiver)
        return e is not None and 0 <= item < self.max_items and bool(self._items[e, item >> 3] & (1 << (item & 7)))

    def told_to(self, room: int, receiver: str) -> tuple[bool, list[int]]:
        """(told failed, items told success) for one receiver of a room."""
        e = self._find(room, receiver)
        if e is None:
            return False, []
        bits = np.unpackbits(self._items[e], bitorder="little")
        return bool(self._flags[e] & _FAILED), np.flatnonzero(bits).tolist()

    def told_anything(self, room: int, receiver: str) -> bool:
        return self._find(room, receiver) is not None

    # -- another process's view ------------------------------------------------------

    def recorded(self, room: int, receivers) -> tuple[bool, set[int]]:
        """(failed, items told success) recorded for `room` at any of the `receivers`
        (names as the writer records them), read from the shared arrays, not the writer's
        index (which only the writing process builds and keeps)."""
        hashes = np.array([receiver_hash(r) for r in receivers], np.uint64)
        mine = np.flatnonzero((self._flags != 0) & (self._room == room) & np.isin(self._rx, hashes))
        failed = bool((self._flags[mine] & _FAILED).any())
        bits = np.unpackbits(self._items[mine], axis=1, bitorder="little").any(axis=0)
        return failed, set(np.flatnonzero(bits).tolist())

    # -- writes (one writer) -------------------------------------------------------

    def record_failed(self, room: int, receiver: str, now: float) -> bool:
        e = self._find(room, receiver)
        if e is None:
            return self._new(room, receiver, now, _USED | _FAILED, None)
        self._flags[e] |= _FAILED  # one byte store
        return True

    def record_success(self, room: int, item: int, receiver: str, now: float) -> bool:
        if not 0 <= item < self.max_items:
            return False
        e = self._find(room, receiver)
        if e is None:
            return self._new(room, receiver, now, _USED, item)
        self._items[e, item >> 3] |= 1 << (item & 7)  # one byte store
        return True

    def _new(self, room: int, receiver: str, now: float, flags: int, item: int | None) -> bool:
        index = self._entries()
        if not self._free:
            return False
        e = self._free.pop()
        rx = receiver_hash(receiver)
        self._room[e], self._rx[e], self._at[e] = room, rx, now
        self._items[e] = 0
        if item is not None:
            self._items[e, item >> 3] = 1 << (item & 7)
        if _fault_hook is not None:
            _fault_hook("told.body")
        self._flags[e] = flags  # publish: one byte store
        index.setdefault(room, {})[rx] = e
        return True

    def forget(self, room: int) -> None:
        """The room's tombstone is freed: free its entries (a room id may come back)."""
        for e in self._entries().pop(room, {}).values():
            self._flags[e] = 0
            self._free.append(e)

    def used(self) -> int:
        return int(np.count_nonzero(self._flags))
