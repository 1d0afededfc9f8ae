"""Custody of the room table's rooms, without the table's lock.

A room's holders are a bit mask: bit ``i`` set while stage ``i`` holds some of the
room's items. Every stage sets and clears its bit on every record it takes and hands
on, so the mask is not in the locked record: each slot has a claim per owner
(``MAX_OWNERS``), a room id and an on-byte, and only that owner (or the supervisor,
once the owner is dead) writes it. A claim counts only while its room is the slot's
room, so claims left by a room that has gone are void, and the table's ``insert``
resets the slot's claims before it publishes the new room. ``RoomTable.hold`` takes a
claim, checks the slot holds the room, and puts the claim back if not: a room freed
and another inserted into the slot meanwhile voids the claim (a store the CPU still
buffers past that check could in principle outlive it; its only effect is that the
owner's death would fail the new room too).
"""

from __future__ import annotations

import functools
import mmap
from typing import cast

import numpy as np

__all__ = ["MAX_OWNERS", "RoomClaims", "owners"]

MAX_OWNERS = 32  # custody bits
_NO_CLAIMS = bytes(MAX_OWNERS)


@functools.lru_cache(maxsize=1024)
def owners(bits: int) -> tuple[int, ...]:
    """The owners whose bits are set in ``bits``."""
    return tuple(o for o in range(MAX_OWNERS) if bits >> o & 1)


class RoomClaims:
    """The claims of ``capacity`` slots: room u64 [slot, owner] at ``rooms_at``, on u8
    [slot, owner] at ``on_at`` of a table's segment (``columns`` sizes them)."""

    @staticmethod
    def columns(capacity: int) -> tuple[tuple[str, int], ...]:
        return ("claim_room", 8 * MAX_OWNERS * capacity), ("claim_on", MAX_OWNERS * capacity)

    def __init__(self, buf: memoryview, rooms_at: int, on_at: int, capacity: int):
        n = MAX_OWNERS * capacity
        self._roomv = buf[rooms_at : rooms_at + 8 * n].cast("Q")
        self._onv = buf[on_at : on_at + n]
        mm = cast(mmap.mmap, buf.obj)  # a table's buf views its segment's whole mapping
        self._mm, self._on_at = mm, on_at
        self._rooms = np.frombuffer(mm, np.uint64, n, rooms_at).reshape(capacity, MAX_OWNERS)
        self._on = np.frombuffer(mm, np.uint8, n, on_at).reshape(capacity, MAX_OWNERS)

    def holders(self, slot: int, room: int) -> int:
        """The custody bits of the owners whose claim on ``slot`` is for ``room``."""
        base = slot * MAX_OWNERS
        at = self._on_at + base
        on = self._mm[at : at + MAX_OWNERS]  # bytes: the usual answer (no claim) in one compare
        if on == _NO_CLAIMS:
            return 0
        bits, rooms = 0, self._roomv
        o = on.find(1)
        while o >= 0:
            if rooms[base + o] == room:
                bits |= 1 << o
            o = on.find(1, o + 1)
        return bits

    def reset(self, slot: int, room: int, bits: int) -> None:
        """The table's lock held, slot FREE: the new room's claims are ``bits``, every other void."""
        base = slot * MAX_OWNERS
        self._onv[base : base + MAX_OWNERS] = _NO_CLAIMS
        for o in owners(bits):
            self._roomv[base + o] = room
            self._onv[base + o] = 1

    def take(self, slot: int, room: int, bits: int) -> list[tuple[int, int, int]]:
        """Claim ``room`` in ``slot`` for the owners of ``bits``; what ``put_back`` undoes it with."""
        base = slot * MAX_OWNERS
        rooms, on = self._roomv, self._onv
        before = [(o, rooms[base + o], on[base + o]) for o in owners(bits)]
        for o, _, _ in before:
            rooms[base + o] = room
            on[base + o] = 1
        return before

    def put_back(self, slot: int, before: list[tuple[int, int, int]]) -> None:
        base = slot * MAX_OWNERS
        rooms, on = self._roomv, self._onv
        for o, room, flag in before:
            on[base + o] = 0
            rooms[base + o] = room
            on[base + o] = flag

    def give_up(self, slot: int, room: int, bits: int) -> None:
        """End the claims of the owners of ``bits`` on ``room`` in ``slot``."""
        base = slot * MAX_OWNERS
        for o in owners(bits):
            if self._onv[base + o] and self._roomv[base + o] == room:
                self._onv[base + o] = 0

    def claimed(self, bits: int, rooms: np.ndarray) -> np.ndarray:
        """Per slot: whether an owner of ``bits`` claims the slot's room (``rooms``, one per slot)."""
        mine = list(owners(bits))
        return ((self._on[:, mine] != 0) & (self._rooms[:, mine] == rooms[:, None])).any(axis=1)

    def close(self) -> None:
        self._roomv.release()
        self._onv.release()
        self._rooms = self._on = self._mm = None  # type: ignore[assignment]  # a use after close fails
