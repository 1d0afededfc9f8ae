"""The room table's index: room id -> slot, without a scan.

The table is as large as the rooms live plus the tombstones kept, and a scan of its
columns is slow next to one update: ``insert`` did two under the lock, once per
request, and every other writer waited on them. So the index maps room ids to
slots: a hash table (linear probing, backward-shift deletion, at least twice the
table's capacity, u32 slot + 1 per entry, 0 empty) that ``insert`` and ``free``
update under the table's lock.

It is a hint: every slot it gives is verified against the record (an entry left
pointing at a slot that has changed room is skipped). A writer makes the index's
sequence word (a word of the table's header) odd before touching it and even
after; one killed in between leaves it odd, and the next writer rebuilds the index
from the records. A lock-free reader retries when the word moved under it, and
scans the table's columns while it is odd.
"""

from __future__ import annotations

import mmap
from typing import cast

import numpy as np

__all__ = ["RoomIndex"]

_GOLDEN = 0x9E37_79B9_7F4A_7C15  # Fibonacci hashing of room ids
_M64 = 2**64 - 1
_READ_SPINS = 64


class RoomIndex:
    """Room id -> slot over ``entries(capacity)`` u32 words at ``offset`` of a table's segment.

    ``room_at(slot)`` gives (room, state) of a slot's active copy from the table's
    columns; ``header[seq_word]`` is the index's sequence word."""

    @staticmethod
    def entries(capacity: int) -> int:
        """A power of two, at least twice the capacity."""
        return 1 << max(4, (2 * capacity - 1).bit_length())

    def __init__(self, buf: memoryview, offset: int, capacity: int, header: memoryview, seq_word: int, room_at):
        n = self.entries(capacity)
        self.capacity = capacity
        self._words = buf[offset : offset + 4 * n].cast("I")
        self._array = np.frombuffer(cast(mmap.mmap, buf.obj), np.uint32, n, offset)
        self._mask, self._shift = n - 1, 64 - (n.bit_length() - 1)
        self._header, self._seq_word = header, seq_word
        self._room_at = room_at

    def _home(self, room: int) -> int:
        return ((room * _GOLDEN) & _M64) >> self._shift

    # -- reads ---------------------------------------------------------------------

    def slot_of(self, room: int) -> int | None:
        """The slot the index gives for ``room`` (its columns agree; the caller verifies the record)."""
        words, mask = self._words, self._mask
        i = self._home(room)
        for _ in range(mask + 1):
            e = words[i]
            if e == 0 or e > self.capacity:
                return None
            r, state = self._room_at(e - 1)
            if r == room and state:
                return e - 1
            i = (i + 1) & mask
        return None

    def lookup(self, room: int) -> tuple[int, ...] | None:
        """Lock-free: the slots (none or one) the index gives for ``room``, or None when a
        writer is changing the index (or died doing it): then the caller scans."""
        header, word = self._header, self._seq_word
        for _ in range(_READ_SPINS):
            v = header[word]
            if v & 1:
                return None
            slot = self.slot_of(room)
            if header[word] == v:
                return () if slot is None else (slot,)
        return None

    @property
    def dirty(self) -> bool:
        """A writer died while changing it: rebuild before use."""
        return bool(self._header[self._seq_word] & 1)

    # -- changes (the table's lock held) -----------------------------------------------

    def begin_change(self) -> None:
        """The sequence word odd until ``end_change``: readers scan meanwhile, and a writer
        that never gets to ``end_change`` (killed, or an exception) leaves the index to be
        rebuilt by the next."""
        self._header[self._seq_word] += 1

    def end_change(self) -> None:
        self._header[self._seq_word] += 1

    def add(self, room: int, slot: int) -> None:
        words, mask = self._words, self._mask
        i = self._home(room)
        while words[i]:
            i = (i + 1) & mask
        words[i] = slot + 1

    def remove(self, room: int, slot: int) -> None:
        """Take ``slot``'s entry out of ``room``'s chain, moving later entries of the chain
        back into the hole (backward-shift deletion: no tombstones to skip)."""
        words, mask = self._words, self._mask
        i = self._home(room)
        while words[i] != slot + 1:
            if words[i] == 0:
                return
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            e = words[j]
            if e == 0:
                break
            k = self._home(self._room_at(e - 1)[0])
            if (j - k) & mask >= (j - i) & mask:  # its home is not after the hole: it may move there
                words[i] = e
                i = j
        words[i] = 0

    def rebuild(self, rooms) -> None:
        """From ``rooms`` ((room, slot) of every entry not FREE), and mark it whole again."""
        self._array[:] = 0
        for room, slot in rooms:
            self.add(room, slot)
        self._header[self._seq_word] += 1

    def close(self) -> None:
        self._words.release()
        self._array = None  # type: ignore[assignment]  # a use after close fails
