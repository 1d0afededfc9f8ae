"""Allocs held for rooms not seen yet, in shared memory, so that they outlive the sender.

docs/protocol.md §4: an alloc for a room the worker has not seen is held for
`bootstrap_timeout_s`, then answered `failed` ("unknown room"). The sender holds it;
a sender SIGKILLed meanwhile would take it along, and its receiver would wait
forever. So the sender writes each held alloc here, and its successor holds them
again, with their first arrival times (CLOCK_MONOTONIC is the machine's, not the
process's).

One writer (the sender); the only reader is its successor, once the writer is dead.
Each slot holds one alloc (msgpack, at most ``BODY`` bytes) and a generation number,
0 while the slot is free: an alloc is written into a free slot, body first, and
published by one aligned 8-byte store of its generation, so a writer killed at any
instruction leaves every slot free or whole. Bounded by `max_held_allocs`.
"""

from __future__ import annotations

import struct
from dataclasses import fields
from operator import attrgetter

import msgpack
import numpy as np

from . import shm
from .shared_table import SlotTable
from .wire import MAX_ID_CHARS, Alloc

__all__ = ["HeldAllocs"]

# An alloc: a receiver id of MAX_ID_CHARS in UTF-8, a dozen numbers, its session's hash,
# and the CurveZMQ key it came under (40 characters).
BODY = 4 * MAX_ID_CHARS + 144 + 48
_HEAD = struct.Struct("<dH")  # held since (time.monotonic()), body length
_SLOT = _HEAD.size + BODY
_values = attrgetter(*(f.name for f in fields(Alloc)))  # dataclasses.astuple deep-copies each value: 20x slower


class HeldAllocs(SlotTable):
    MAGIC = 0x646C_6568_0000_0004  # "held", layout 4
    KIND = "held-alloc table"
    SLOT_BYTES = _SLOT

    def __init__(self, seg: shm.Segment):
        super().__init__(seg)
        self._free: list[int] | None = None  # the writer's, built by load()
        self._next_gen = 1

    def load(self) -> list[tuple[int, float, Alloc]]:
        """Every alloc held: (slot, held since, alloc). The writer calls it first."""
        out = []
        for slot in np.flatnonzero(self.generations).tolist():
            at = self.slots_at + slot * _SLOT
            since, n = _HEAD.unpack_from(self.buf, at)
            try:
                body = bytes(self.buf[at + _HEAD.size : at + _HEAD.size + n])
                out.append((slot, since, Alloc(*msgpack.unpackb(body))))
            except Exception:  # not ours to answer if it cannot be read: free it
                self.generations[slot] = 0
        used = {slot for slot, _, _ in out}
        self._free = [s for s in range(self.capacity - 1, -1, -1) if s not in used]
        self._next_gen = self.next_generation()
        return out

    def put(self, since: float, alloc: Alloc) -> int | None:
        """Hold `alloc`; its slot, or None when every slot is taken."""
        if self._free is None:
            self.load()
        if not self._free:
            return None
        body = msgpack.packb(_values(alloc))
        slot = self._free.pop()
        at = self.slots_at + slot * _SLOT
        _HEAD.pack_into(self.buf, at, since, len(body))
        self.buf[at + _HEAD.size : at + _HEAD.size + len(body)] = body
        self.generations[slot] = self._next_gen  # one aligned store publishes it
        self._next_gen += 1
        return slot

    def remove(self, slot: int) -> None:
        self.generations[slot] = 0
        assert self._free is not None  # the slot came from put() or load(), which made it
        self._free.append(slot)

    def __len__(self) -> int:
        return int(np.count_nonzero(self.generations))
