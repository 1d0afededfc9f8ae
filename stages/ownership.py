"""Rooms belong to keys (docs/security.md, "Rooms belong to keys"): the sender's checks.

Under CurveZMQ intake records with each room the tags (`wire.key_tag`) of the keys it
belongs to: the opening gateway's, then the receivers' keys the `encode` names
(protocol 1.2 `receivers`); a room that names none is claimed by the first other key
whose alloc the sender takes for it while it is live. An `alloc`, `cancel` or `query`
under any other key is refused: counted, and answered as a room the worker never saw
would be, so that it tells no room from a room that does not exist:

- a refused alloc is kept (in this process: a sender's death forgets it) and answered
  `failed` "unknown room" once `bootstrap_timeout_s` has passed, as an unknown room's
  held alloc is; past `max_held_allocs` held, at once, with the same reason;
- a refused cancel gives up that receiver's refused allocs for the room ("canceled"),
  or is dropped if it has none;
- a refused query is answered nothing while that receiver has a refused alloc waiting
  for the room (its answer is still to come), else "unknown room", and the next ones
  repeat it, as for a room never seen.

Without CURVE no message carries a key and nothing here refuses anything.
"""
from __future__ import annotations

from collections import Counter

from ipc import wire
from ipc.rooms import RoomTable
from ipc.wire import Alloc, Cancel, Query
from stages import registry
from stages.records import UnknownRoom

KINDS = ("alloc", "cancel", "query")  # the messages counted when refused


def may_hear(keys: tuple[int, ...], key: str) -> bool:
    """May a receiver registered under `key` hear of a room with these key tags? (A key
    that allocated into it is among them: its first alloc claimed it.)"""
    tag = wire.key_tag(key)
    return not tag or tag in keys


class RoomKeys:
    """Which keys a room in the table belongs to, and the refusals of all other keys."""

    def __init__(self, rooms: RoomTable, emit, bootstrap_timeout_s: float, max_held_allocs: int):
        self.rooms = rooms
        self.emit = emit
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.max_held_allocs = max_held_allocs
        self.waiting: dict[int, list[tuple[float, str]]] = {}  # room -> (since, receiver) of refused allocs
        self.n_waiting = 0
        self.refused = Counter()  # message kind -> refused

    def verdict(self, room: int, key: str, claim: bool) -> bool | None:
        """May `key` name `room`? None: the room is not in the table (nothing to check
        yet); `claim`: an alloc, which claims a live room whose gateway named no receiver."""
        slot = self.rooms.find(room)
        entry = self.rooms.get(slot) if slot is not None else None
        if entry is None or entry.room != room:
            return None
        return self.allows(slot, room, entry.keys, key, claim)

    def allows(self, slot: int, room: int, keys: tuple[int, ...], key: str, claim: bool) -> bool:
        tag = wire.key_tag(key)
        if not tag or tag in keys:
            return True
        if claim and keys and keys[0] and not keys[1]:
            keys = self.rooms.claim(slot, room, tag) or ()
        return tag in keys

    def sort_held(self, room: int, held: list) -> list:
        """Of allocs held for `room` ((since, alloc, slot) each, taken off the sender's
        held list): those whose key the room now in the table allows, in order (the first
        may claim it); the others wait here as refused."""
        if not any(h[1].key for h in held):  # without CURVE: nothing to sort
            return held
        slot = self.rooms.find(room)
        entry = self.rooms.get(slot) if slot is not None else None
        if entry is None or entry.room != room:
            return held
        out = []
        for h in held:
            since, a = h[0], h[1]
            if self.allows(slot, room, entry.keys, a.key, claim=True):
                out.append(h)
                entry = self.rooms.get(slot) or entry  # a claim changed its keys
            else:
                self.refused["alloc"] += 1
                self._wait(room, a.receiver, since)
        return out

    def refuse(self, m: Alloc | Cancel | Query, now: float, held: int) -> None:
        """Answer `m`, from a key `m.room` does not belong to, as if the room were unknown
        (`held`: the allocs the sender holds for rooms not seen, which share the bound)."""
        kind = type(m).__name__.lower()
        self.refused[kind] += 1
        if isinstance(m, Alloc):
            if held + self.n_waiting < self.max_held_allocs:
                self._wait(m.room, m.receiver, now)
            else:
                self.emit(registry.REAPER, UnknownRoom(
                    m.room, m.receiver, f"alloc for a room this worker has not seen, and it already holds "
                                        f"{self.max_held_allocs} such allocs (max_held_allocs)", kind))
        elif isinstance(m, Cancel):
            if self.forget(m.room, m.receiver):
                self.emit(registry.REAPER, UnknownRoom(m.room, m.receiver, "canceled", kind))
        elif not self.waits(m.room, m.receiver):
            self.emit(registry.REAPER, UnknownRoom(m.room, m.receiver, "unknown room", kind))

    def waits(self, room: int, receiver: str) -> bool:
        return any(r == receiver for _, r in self.waiting.get(room, ()))

    def forget(self, room: int, receiver: str) -> bool:
        """Give up `receiver`'s refused allocs for `room`; whether it had any."""
        waiting = self.waiting.get(room, [])
        keep = [w for w in waiting if w[1] != receiver]
        if len(keep) == len(waiting):
            return False
        self.n_waiting -= len(waiting) - len(keep)
        if keep:
            self.waiting[room] = keep
        else:
            del self.waiting[room]
        return True

    def expire(self, now: float) -> None:
        """Answer the refused allocs that have waited as long as an unknown room's would."""
        limit = now - self.bootstrap_timeout_s
        for room, waiting in list(self.waiting.items()):
            for since, receiver in waiting:
                if since < limit:
                    self.emit(registry.REAPER, UnknownRoom(room, receiver, "unknown room", "alloc"))
            keep = [w for w in waiting if w[0] >= limit]
            self.n_waiting -= len(waiting) - len(keep)
            if keep:
                self.waiting[room] = keep
            else:
                del self.waiting[room]

    def _wait(self, room: int, receiver: str, since: float) -> None:
        self.waiting.setdefault(room, []).append((since, receiver))
        self.n_waiting += 1
