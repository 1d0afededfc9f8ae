"""What a dead stage process leaves to the others, taken back by the supervisor before
the stage is restarted: the rooms whose custody bit it held fail, its arena references
are freed, and its last words go on its own rings.

In this order, which the fault tests and the dense soak were run against: its custody
bits cleared, its arena references reclaimed, the reaper told (RoomsLost, so receivers
hear), then its last words, behind everything the dead one pushed and ahead of anything
its successor will (stages.registry.last_words).
"""
from __future__ import annotations

import logging
import pickle
from typing import Callable

from ipc.ring import Ring
from pipeline.runtime.wiring import Shared
from stages import registry
from stages.records import RoomsLost

log = logging.getLogger("epd.supervisor")


class Reclaimer:
    """Takes back what a dead stage held. `rings` are the run's, by (producer, consumer);
    `tell_reaper` hands the reaper a record (the supervisor's ring to it)."""

    def __init__(self, shared: Shared, rings: dict[tuple[str, str], Ring], tell_reaper: Callable[[object], bool]):
        self.shared = shared
        self.rings = rings
        self.tell_reaper = tell_reaper

    def stage_died(self, name: str, why: str) -> None:
        """Fail the rooms `name` held, free its arena references, and say its last words."""
        rooms = self.shared.rooms
        owner = registry.owner_of(name)
        bit = 1 << owner
        # Failed rooms it still held too: the sender holds a failed room until no write of
        # it is in flight, and the reaper tells its receivers only then (its death is that
        # fence). Left out, such a room was live nowhere and nobody ever told them.
        claimed = rooms.held_by(bit, failed_too=True)
        held = [(e.slot, e.room) for e in claimed if e.live]
        fencing = [(e.slot, e.room) for e in claimed if not e.live]
        for slot, room in held + fencing:
            rooms.unhold(slot, room, bit)
        self.shared.pixel_arena.reclaim(owner)
        self.shared.emb_arena.reclaim(owner)
        log.error("the %s stage %s; failing the %d rooms it held: room=%s%s", name, why, len(held),
                  ",".join(str(room) for _, room in held[:20]) + (",..." if len(held) > 20 else ""),
                  f" (and {len(fencing)} failed rooms it still held)" if fencing else "")
        self.tell_reaper(RoomsLost(tuple(held + fencing), f"the {name} stage died while it held this room",
                                   died=name))
        self.say_last_words(name)

    def say_last_words(self, name: str) -> None:
        """Push the dead stage's last words on its own rings: nobody else produces there
        until its successor starts (its start() may have pushed already: these go after)."""
        for dest, record in registry.last_words(name):
            if not self.rings[(name, dest)].push(pickle.dumps(record, protocol=5), timeout=5.0):
                log.error("the %s's ring from %s is full: could not deliver %s", dest, name, type(record).__name__)
