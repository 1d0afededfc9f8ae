"""What every stage is: a plain object that takes records in and hands records out.

A host moves the records. The in-process host (pipeline/runtime/inprocess.py) calls the
stages one after another in one loop; the pipeline host (pipeline/runtime/stage_process.py)
runs one stage per process and moves records over shared-memory rings. A stage
never knows which.

Custody: while a stage holds any item of a room, its bit is set in the room's
entry of the room table, so the supervisor can fail exactly the rooms a dead
stage held. A record in a ring belongs to nobody (the ring outlives both ends):
a consumer takes custody before it releases the record from its ring, and a
producer gives custody up after the record is pushed.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from ipc.rooms import RoomTable


class Custody:
    """Does nothing: in one process nobody dies alone."""

    def hold(self, slot: int, room: int) -> None:
        pass

    def release(self, slot: int, room: int) -> None:
        pass

    def forget(self, room: int) -> None:
        pass

    def slot_of(self, room: int) -> int | None:
        """The room's slot in the room table while this stage holds any of its items."""
        return None

    def flush(self) -> None:
        pass


class TableCustody(Custody):
    """Counts the items of each room this stage holds; sets its bit on 0 -> 1, clears it on 1 -> 0."""

    def __init__(self, rooms: RoomTable, owner: int):
        self.rooms = rooms
        self.bit = 1 << owner
        self.count: Counter = Counter()
        self.slots: dict[int, int] = {}
        self.deferred: list[tuple[int, int]] = []

    def hold(self, slot: int, room: int) -> None:
        if self.count[room] == 0:
            self.rooms.hold(slot, room, self.bit)
            self.slots[room] = slot
        self.count[room] += 1

    def release(self, slot: int, room: int) -> None:
        """One item handed on. A room this stage never held by count (intake's, whose bit
        the table insert set) is released at once."""
        n = self.count.get(room, 0)
        if n > 1:
            self.count[room] = n - 1
            return
        self.count.pop(room, None)
        self.slots.pop(room, None)
        self.deferred.append((slot, room))

    def forget(self, room: int) -> None:
        if self.count.pop(room, 0):
            self.deferred.append((self.slots.pop(room), room))

    def slot_of(self, room: int) -> int | None:
        return self.slots.get(room)

    def flush(self) -> None:
        """Clear the bits of rooms handed on, once the host has pushed what was emitted:
        until then a death here must still fail them."""
        for slot, room in self.deferred:
            if room not in self.count:  # not taken up again meanwhile
                self.rooms.unhold(slot, room, self.bit)
        self.deferred.clear()


class Stage:
    """A stage: `handle` records from its sources (and frames from its socket), `tick`
    for timers and polling. What a host needs to know of it, it says here."""

    name = ""
    owner = 0  # its arena owner id, and its custody bit in the room table
    # True: the loop settles after each input record (pushes what it emitted, releases the
    # record from its ring) before it hands over the next. Each stage that sets it says why.
    settle_each_record = False

    def __init__(self, emit: Callable[[str, object], None], custody: Custody | None = None):
        self.emit = emit
        self.custody = custody or Custody()

    def socket(self) -> tuple[str, int] | None:
        """(endpoint, largest frame) of the PULL socket whose frames it handles, if any."""
        return None

    def takes_frames(self) -> bool:
        """False while it cannot take another frame from its socket (they wait in the socket)."""
        return True

    def refuse(self, reason: str) -> None:
        """From now on, fail what arrives on its socket with `reason` instead of doing it
        (the end of a drain: every request received concludes, none waits)."""

    def start(self) -> None:
        """Called once before the first round: a stage that begins again after its
        predecessor died picks up here what that one left (tables, journals, peers)."""

    def handle(self, source: str, record) -> None:
        raise NotImplementedError

    def tick(self, now: float) -> None:
        pass

    def next_tick_in(self, now: float) -> float | None:
        """Seconds until `tick` has work (0: now); None while it has none of its own."""
        return None

    def pushed(self) -> None:
        """What `handle` or `tick` emitted is in the next stages' rings (or queue) now."""

    def stats(self) -> dict:
        """Counters, merged with the other stages' into the worker's stats."""
        return {}

    def close(self) -> None:
        pass


POLL_S = 1e-4  # next_tick_in of work that completes elsewhere (a device, Mooncake's threads)

