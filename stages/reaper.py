"""Reaper: concludes rooms, tells receivers, enforces deadlines and tombstones.

It is the one place that decides what each receiver hears, so that a receiver
gets at most one terminal status per (room, item), never `success` after
`failed`, and `failed` only once the sender has fenced the room (no write to the
receiver's buffers is in flight or can start). What it tells is recorded in shared
memory (ipc/told.py) before it is sent, so a successor never tells it again; the
registrations it sends to come from shared memory too (ipc/receivers.py).

Its watchdog fails any room still live past its bound (`ReaperStage.bound_of`),
whatever record was lost on the way: every room concludes.

It takes no custody: what it holds of a room is in the room and told tables, which
outlive it.
"""
from __future__ import annotations

import heapq
import logging
import time
from collections import Counter, OrderedDict

import numpy as np

from ipc.receivers import ReceiverTable
from ipc import tcp_table
from ipc.rooms import RoomState, RoomTable, TableFull
from ipc.told import ToldTable, incarnation
from ipc import wire
from ipc.stats import Histogram, ReasonCode, reason_class
from ipc.wire import Register
from stages import registry
from stages.base import Stage
from stages.ownership import may_hear
from stages.records import (OWNER_REAPER, AllocSeen, Fence, Fenced, IntakeRestarted, ItemDone, LateAlloc,
                            Queried, Registered, RoomAbandoned, RoomFailure, RoomOpened, RoomsLost, RoomSucceeded,
                            ShardWritten, UnknownRoom)
from stages.settings import ReaperSettings
from stages.status_pusher import StatusPusher

log = logging.getLogger("epd.reaper")

WATCH_EVERY_S = 1.0
RESTART_MARGIN_S = 5.0  # besides heartbeat_timeout_s: a dead or hung stage found, restarted, caught up
# How long a dead sender's rooms wait for its orphaned connections to deliver what they
# carry before their `failed` goes anyway: Mooncake's own bound on a write that makes no
# progress (MC_TCP_PROGRESS_TIMEOUT_SEC, its default), which a live sender would have met.
LATE_BYTES_BOUND_S = 30.0
MAX_REFUSED_TOLD = 65536  # (room, receiver) pairs told of a refusal, remembered as boundedly as tombstones
DRAIN_POLL_S = 0.05


WATCHDOG = "room watchdog:"
# Failures after which the receivers of a room are not known for sure (see _fenced).
AUDIENCE_UNKNOWN = ("the sender stage died", WATCHDOG)


class ReaperStage(Stage):
    """The sender's records, opened and failed rooms, and the supervisor's news in; orders
    to the sender (Fence, RoomSucceeded), the cache and the scheduler (RoomAbandoned) out."""

    name = registry.REAPER
    owner = OWNER_REAPER
    settle_each_record = True  # a status sent cannot be taken back: a successor repeats at most one record

    def __init__(self, emit, *, rooms: RoomTable, told: ToldTable, receivers: ReceiverTable, pusher: StatusPusher,
                 tombstone_ttl_s: float, max_tombstones: int, bootstrap_timeout_s: float,
                 heartbeat_timeout_s: float, max_deadline_s: float = 3600.0, custody=None):
        super().__init__(emit, custody)
        self.rooms = rooms
        self.told = told
        self.receivers = receivers
        self.pusher = pusher
        self.tombstone_ttl_s = tombstone_ttl_s
        self.max_tombstones = max_tombstones
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.restart_margin_s = heartbeat_timeout_s + RESTART_MARGIN_S
        self.max_deadline_s = max_deadline_s
        self.allocated: dict[int, set[str]] = {}  # receivers known to have allocated for a room
        self.reasons: dict[int, str] = {}        # failed rooms awaiting their fence
        self.codes: dict[int, str] = {}          # their ReasonCodes, until concluded
        # Rooms failed while the room table was full ("worker busy: ..."): what their allocs
        # hear, as long as their tombstone lasts (it bounds this too).
        self.untabled: dict[int, str] = {}
        self.refused_told: OrderedDict[tuple[int, str], None] = OrderedDict()  # (room, receiver): _refused
        self.deadlines: list[tuple[float, int, int]] = []  # a heap of (deadline, slot, room)
        self._prune_at = 64
        self.tombstones: OrderedDict[int, tuple[float, int]] = OrderedDict()  # room -> (concluded, slot)
        # Rooms this worker never had that a receiver was told "unknown room" of: a budget of
        # their own (any peer can name any room id), which never evicts a real room's tombstone.
        self.unknown: OrderedDict[int, float] = OrderedDict()  # room -> when told
        self.digests: dict[int, dict[tuple[str, int], bytes]] = {}  # room -> (told, item) -> digest
        self.registrations: dict = {}
        self.sender_died_at = float("-inf")
        self.outcomes = Counter()
        self.concluded_by_reason = Counter()  # (outcome, reason class) -> rooms
        self.latency = Histogram()            # room opened to concluded, seconds
        self.to_mark: list[tuple[int, int, str]] = []  # (slot, room, reason): fenced, not yet Failed in the table
        # A dead sender's rooms: (reason, receivers not told yet). A receiver is told once
        # the dead process's orphaned connections carry nothing more to it, or at
        # drain_until: bytes it queued must not land in buffers a receiver reused.
        self.draining: dict[int, tuple[str, set[str]]] = {}
        self.destinations: dict[str, tcp_table.Destination] = {}  # receiver -> where its bytes go
        self.drain_until = 0.0
        self._drain_at = 0.0
        self.late_bytes_waits = 0  # sender deaths that left bytes on their way, and were waited for
        self.waited = False
        self.unrecorded = 0  # statuses sent without a record (the told table was full)
        self.query_answers = Counter()  # "repeat": statuses sent again; "none": nothing told yet
        self._watch_at = 0.0

    def start(self) -> None:
        """Pick up what a predecessor (if any) left: deadlines and tombstones from the room
        table, unknown rooms' tombstones from the told table, and the registrations."""
        in_table = set()
        for e in self.rooms.entries():
            in_table.add(e.room)
            if e.state < RoomState.SUCCESS:
                if e.deadline:
                    heapq.heappush(self.deadlines, (self.deadline_of(e.deadline, e.created), e.slot, e.room))
            else:
                self.tombstones[e.room] = (e.concluded, e.slot)
        for room, told_at in sorted(self.told.rooms().items(), key=lambda kv: kv[1]):
            if room not in in_table:
                self.unknown[room] = told_at
        self.tombstones = OrderedDict(sorted(self.tombstones.items(), key=lambda kv: kv[1][0]))
        registered = self._reload_registrations()
        if registered or in_table:
            # A predecessor was here (the tables are empty at the worker's start): whether
            # a sender died meanwhile, and who allocated (AllocSeen), died with it. Rooms
            # that fail soon are told to every registered receiver, as after a sender death.
            self.sender_died_at = time.monotonic()

    def handle(self, source: str, rec) -> None:
        match rec:
            case RoomOpened():
                self._on_opened(rec)
            case RoomFailure():
                self._fail(rec)
            case RoomsLost():
                self._on_rooms_lost(rec)
            case IntakeRestarted():
                self.emit(registry.SENDER, rec)  # its held allocs: the sender's to answer
            case Registered(registration=reg):
                self._registered(reg)
            case AllocSeen(room=room, receiver=receiver):
                self.allocated.setdefault(room, set()).add(receiver)
            case ShardWritten(room=room, item=item, receiver=receiver, digest=digest):
                self._tell_success(room, item, receiver, digest)
            case ItemDone(slot=slot, room=room, done=done_so_far):
                # The count so far, not "one more": a successor handed the record its
                # predecessor died with must not count the item twice (and end the room early).
                # (and the room's success in the same update of the table, once every item is done)
                if self.rooms.complete_item(slot, room, done_so_far)[1]:
                    self.emit(registry.SENDER, RoomSucceeded(room))
                    self._concluded(room, slot, "success", "")
            case Fenced(room=room, receivers=receivers):
                self._fenced(room, receivers)
            case LateAlloc(room=room, receiver=receiver):
                self._alloc_after_all(room, receiver, "unknown room", dropped=False)
            case UnknownRoom(room=room, receiver=receiver, reason=reason, refused=""):
                self._alloc_after_all(room, receiver, reason, dropped=True)
            case UnknownRoom(room=room, receiver=receiver, reason=reason, refused=kind):
                self._refused(room, receiver, reason, kind)
            case Queried(room=room, receiver=receiver, pending=pending):
                self._on_query(room, receiver, pending)
            case _:
                raise ValueError(f"unknown event {rec!r}")

    def tick(self, now: float) -> None:
        if now >= self._watch_at:
            self._watch_at = now + WATCH_EVERY_S
            self._watch(now)
        while self.deadlines and self.deadlines[0][0] <= now:
            deadline, slot, room = heapq.heappop(self.deadlines)
            entry = self.rooms.get(slot)
            if entry is not None and entry.room == room and entry.state < RoomState.SUCCESS:
                capped = deadline < entry.deadline
                self._fail(RoomFailure(slot, room, f"deadline exceeded (deadline_ms, capped at max_deadline_s "
                                                   f"{self.max_deadline_s:g} s)" if capped else
                                                   "deadline exceeded (deadline_ms)", ReasonCode.DEADLINE))
        if self.draining and now >= self._drain_at:
            self._drain_at = now + DRAIN_POLL_S
            self._tell_drained(now)
        self._expire_tombstones(now)
        self.pusher.tick()

    def next_tick_in(self, now: float) -> float | None:
        due = min(self.deadlines[0][0], self._watch_at) if self.deadlines else self._watch_at
        if self.pusher.n_waiting or self.draining:  # a socket frees within its linger; bytes land
            due = min(due, now + DRAIN_POLL_S)
        return max(0.0, due - now)

    def deadline_of(self, deadline: float, created: float) -> float:
        """A room's deadline, capped at max_deadline_s after it arrived: a peer's deadline_ms
        (up to 1e9 ms) must not keep the room, nor its entry in the heap, for days."""
        return min(deadline, created + self.max_deadline_s)

    def _prune_deadlines(self) -> None:
        """Drop the heap's entries of rooms that concluded before their deadline: rooms
        conclude far faster than their deadlines, and the heap would grow with the
        request rate times the deadline. Each time it has doubled: amortised, one scan
        of the table per entry pushed."""
        live = {e.room for e in self._live_entries()}
        self.deadlines = [d for d in self.deadlines if d[2] in live]
        heapq.heapify(self.deadlines)
        self._prune_at = max(64, 2 * len(self.deadlines))

    def pushed(self) -> None:
        """Conclude in the room table the rooms _fail() fenced, now that its orders are out."""
        to_mark, self.to_mark = self.to_mark, []
        for slot, room, reason in to_mark:
            if self.rooms.fail(slot, room, reason):
                self._concluded(room, slot, "failed", reason)

    def stats(self) -> dict:
        return {"rooms": dict(self.outcomes), **self.pusher.stats(),
                "status_unrecorded": self.unrecorded, "deadline_heap": len(self.deadlines),
                "query_answers": dict(self.query_answers), "tombstones": len(self.tombstones),
                "unknown_rooms_remembered": len(self.unknown), "late_bytes_waits": self.late_bytes_waits,
                "rooms_concluded": dict(self.concluded_by_reason), "room_latency_seconds": self.latency.snapshot()}

    def close(self) -> None:
        self.pusher.close()

    # ------------------------------------------------------------ inputs
    def _on_opened(self, o: RoomOpened) -> None:
        # What was told is kept, not reset: a receiver told "unknown room" must not hear
        # about the room again.
        self.unknown.pop(o.room, None)
        if o.deadline:
            entry = self.rooms.get(o.slot)
            created = entry.created if entry is not None and entry.room == o.room else time.monotonic()
            heapq.heappush(self.deadlines, (self.deadline_of(o.deadline, created), o.slot, o.room))
            if len(self.deadlines) >= self._prune_at:
                self._prune_deadlines()

    def _on_rooms_lost(self, lost: RoomsLost) -> None:
        writes_gone = lost.died == registry.SENDER
        if writes_gone:
            self.sender_died_at = time.monotonic()
            # A sender writes a registration into the shared table before it tells
            # us; one killed in between took the telling along, and we would send
            # that receiver's statuses to the endpoint of its previous incarnation.
            self._reload_registrations()
        for slot, room in lost.rooms:
            code = ReasonCode.STAGE_DIED if lost.died else ReasonCode.SHUTDOWN  # "": a drain's end
            self._fail(RoomFailure(slot, room, lost.reason, code))
            # The process is gone: no write of its can start any more (the fence), but what
            # its connections had queued still lands: each receiver is told once nothing
            # more can reach it (_tell_drained).
            audience = self._audience(room, ()) if writes_gone else None
            if audience is not None:
                self.draining[room] = audience
        if writes_gone and self.draining:
            now = time.monotonic()
            self.drain_until = now + LATE_BYTES_BOUND_S
            self._drain_at = now + DRAIN_POLL_S
            self.destinations = {}
            self.waited = False
            self._tell_drained(now)

    def _tell_drained(self, now: float) -> None:
        """Tell the dead sender's rooms' receivers `failed`, each once its orphaned connections
        carry nothing more to it (ipc/tcp_table.py), or at the bound."""
        late = self._late_receivers(now)
        if late:
            self.late_bytes_waits += not self.waited
            self.waited = True
        for room, (reason, to) in list(self.draining.items()):
            for r in sorted(to - late):
                self._tell_failed(room, r, reason)
            to &= late
            if not to:
                del self.draining[room]

    def _late_receivers(self, now: float) -> set[str]:
        """Registered receivers that a dead process's orphaned connections still carry bytes to."""
        if now >= self.drain_until:
            return set()
        table = tcp_table.read_table()
        orphans = tcp_table.orphaned(table)
        if not orphans:
            return set()
        waiting = set().union(*(to for _, to in self.draining.values())) & set(self.registrations)
        if waiting - set(self.destinations):
            groups = tcp_table.port_groups(table)  # once per death: the receivers' processes do not move
            for receiver in waiting - set(self.destinations):
                self.destinations[receiver] = tcp_table.destination(self.registrations[receiver].session, table, groups)
        return {receiver for receiver in waiting if self.destinations[receiver].carried(orphans)}

    def _registered(self, reg: Register) -> None:
        self.registrations[reg.receiver] = reg
        self.pusher.register(reg.receiver, reg.status, reg.key)
        if reg.hello:
            self.pusher.send(reg.receiver, wire.hello_message())
        if len(self.registrations) > self.receivers.capacity:
            # The sender frees registrations (expired, or given way) without a record:
            # the shared table says which are left.
            self._reload_registrations()

    def _reload_registrations(self) -> dict:
        registered = self.receivers.registrations()
        for receiver in [r for r in self.registrations if r not in registered]:
            del self.registrations[receiver]
            self.pusher.forget(receiver)
        for receiver, reg in registered.items():
            self.registrations[receiver] = reg
            self.pusher.register(receiver, reg.status, reg.key)
        return registered

    def _tell_success(self, room: int, item: int, receiver: str, digest: bytes | None) -> None:
        who = self._incarnation(receiver)
        if self.told.told_failed(room, who) or self.told.told_success(room, item, who):
            return
        self._recorded(self.told.record_success(room, item, who, time.monotonic()))
        if digest is not None:  # kept while the room is remembered: a repeat carries it too
            self.digests.setdefault(room, {})[(who, item)] = digest
        self.pusher.send(receiver, wire.status_message(room, item, True, digest=digest))

    def _on_query(self, room: int, receiver: str, pending: bool) -> None:
        """Repeat what `receiver` was told of `room` (a status lost with a killed reaper or in
        a socket's queue); if nothing, answer as a late alloc would, unless its status is
        still to come. A repeated success carries its digest while this reaper remembers it
        (a successor does not: the told table keeps none)."""
        if receiver not in self.registrations:
            return
        who = self._incarnation(receiver)
        failed, items = self.told.told_to(room, who)
        if failed:
            entry = self._entry(room)
            reason = (entry.reason if entry is not None and entry.state == RoomState.FAILED
                      else self.untabled.get(room, "room failed"))
            self.pusher.send(receiver, wire.status_message(room, None, False, reason, repeat=True))
        digests = self.digests.get(room, {})
        for item in [] if failed else sorted(items):
            self.pusher.send(receiver, wire.status_message(room, item, True, repeat=True,
                                                           digest=digests.get((who, item))))
        if failed or items:
            self.query_answers["repeat"] += 1
        elif pending or room in self.reasons or room in self.draining:
            self.query_answers["none"] += 1
        else:
            self.query_answers["late"] += 1
            self._alloc_after_all(room, receiver, "unknown room", dropped=False)

    def _refused(self, room: int, receiver: str, reason: str, kind: str) -> None:
        """A message the room is not its key's (stages/ownership.py): told what a room never
        seen would tell it, once, and a query's repeat after that; nothing of the room."""
        if receiver not in self.registrations:
            return
        if (room, receiver) not in self.refused_told:
            self.refused_told[(room, receiver)] = None
            if len(self.refused_told) > MAX_REFUSED_TOLD:
                self.refused_told.popitem(last=False)
            self.pusher.send(receiver, wire.status_message(room, None, False, reason))
        elif kind == "query":
            self.pusher.send(receiver, wire.status_message(room, None, False, "room failed", repeat=True))

    def _fenced(self, room: int, receivers) -> None:
        if room in self.draining:  # the fence a successor answers: bytes of its predecessor may still land
            self.draining[room][1].update(receivers)
            return
        audience = self._audience(room, receivers)
        if audience is not None:
            reason, to = audience
            for r in sorted(to):
                self._tell_failed(room, r, reason)

    def _audience(self, room: int, receivers) -> tuple[str, set[str]] | None:
        """A fenced room's reason and the receivers to tell; None if there is nothing to tell."""
        reason = self.reasons.pop(room, None)
        if reason is None:
            entry = self._entry(room)
            if entry is not None and entry.state == RoomState.SUCCESS:
                # A cancel (or a failure) that reached the sender after the room had
                # succeeded: every receiver has its successes, there is nothing to tell.
                return None
            if entry is not None and entry.state < RoomState.SUCCESS:
                # The answer to a predecessor's fence, for a room it died before marking
                # Failed: the record it died with comes again and fences it again.
                return None
            reason = entry.reason if entry else "room failed"
        to = set(receivers) | self.allocated.get(room, set())
        entry = self._entry(room)
        if entry is not None and (self._allocs_maybe_lost(entry) or reason.startswith(AUDIENCE_UNKNOWN)):
            # Allocs a dead sender had received were never acknowledged, and a room the
            # watchdog fails lost a record somewhere: who allocated is not known for sure,
            # so every registered receiver hears (and ignores a room it never allocated
            # for), so that none waits forever; under CURVE, only those of the room's keys.
            to |= {r for r, reg in self.registrations.items() if may_hear(entry.keys, reg.key)}
        return reason, to

    def _allocs_maybe_lost(self, entry) -> bool:
        """Could a dead sender have taken allocs for this room along? Allocs may come
        before their room (held up to bootstrap_timeout_s), and a request may reach the
        table well after a sender died (in a restarting intake's socket): a room created
        up to that long after the death may miss an alloc nobody will ever see again."""
        return entry.created <= self.sender_died_at + self.bootstrap_timeout_s + self.restart_margin_s

    def _alloc_after_all(self, room: int, receiver: str, unknown_reason: str, dropped: bool) -> None:
        """An alloc for a room that is concluded, or was never seen (`unknown_reason`), or
        that the sender `dropped` (could not hold) although the room is in the table."""
        entry = self._entry(room)
        if entry is None:
            reason = self.untabled.get(room, unknown_reason)
            if room not in self.tombstones and room not in self.unknown:
                # Whom we told about a room we never had is remembered as long as a
                # tombstone, and as boundedly: hostile allocs and queries must not grow
                # `told`, nor push out what real rooms' late allocs must hear.
                self.unknown[room] = time.monotonic()
                if len(self.unknown) > self.max_tombstones:
                    self._forget(self.unknown.popitem(last=False)[0])
        elif room in self.draining:  # a dead sender's bytes may still land: told once they did
            self.draining[room][1].add(receiver)
            return
        elif room in self.reasons:  # failing, fence not yet answered: it will tell them
            self.allocated.setdefault(room, set()).add(receiver)
            return
        elif entry.state == RoomState.FAILED:
            reason = entry.reason
        elif entry.state < RoomState.SUCCESS:
            # Live, and yet the sender answered: it fenced the room already (LateAlloc; a
            # dead predecessor of ours failed it, and its record or the watchdog fails it
            # again), or it could not hold the alloc (UnknownRoom: too many held, or held
            # past bootstrap_timeout_s while the room was on its way), so the room cannot
            # succeed at this receiver. Its fence tells every receiver, this one too.
            self.allocated.setdefault(room, set()).add(receiver)
            if dropped:
                self._fail(RoomFailure(entry.slot, room, unknown_reason))
            return
        else:
            reason = "room already concluded"
        if self.told.told_anything(room, self._incarnation(receiver)):
            return
        self._tell_failed(room, receiver, reason)

    def _fail(self, f: RoomFailure) -> None:
        """Fail a live room (first conclusion wins): fence it at the sender and tell the
        cache and scheduler; `pushed()` concludes it in the room table once those
        orders are pushed. In that order a reaper that dies between the two leaves a live
        room, whose record its successor handles again and fences again (harmless); the
        other way round the successor would meet a Failed room, do nothing, and nobody
        would ever tell its receivers."""
        slot = f.slot
        if slot is None:
            try:
                # Found under the table's lock: intake may be inserting this room on the
                # other core right now. A room recorded here has nobody holding its items.
                slot = self.rooms.insert(f.room, "?", 0, 0, existing_ok=True)
            except TableFull:
                log.error("room failed but the room table is full: room=%d reason=%s", f.room, f.reason)
                self.emit(registry.SENDER, Fence(f.room))
                self.unknown.pop(f.room, None)  # a real room now
                if f.room not in self.tombstones:
                    self.tombstones[f.room] = (time.monotonic(), None)
                    self.untabled[f.room] = f.reason
                return
        self.unknown.pop(f.room, None)  # in the table now: its tombstone will be a real room's
        entry = self.rooms.get(slot)
        if (entry is None or entry.room != f.room or entry.state >= RoomState.SUCCESS
                or f.room in self.reasons):
            return
        self.reasons[f.room] = f.reason
        self.codes[f.room] = f.code
        self.to_mark.append((slot, f.room, f.reason))
        self.emit(registry.SENDER, Fence(f.room))
        self.emit(registry.CACHE, RoomAbandoned(f.room))
        self.emit(registry.SCHEDULER, RoomAbandoned(f.room))

    # ------------------------------------------------------------ time
    def _expire_tombstones(self, now: float) -> None:
        passed_over = 0  # each room waiting for its fence goes to the back once per call
        while self.tombstones and passed_over < len(self.tombstones):
            room, (t, slot) = next(iter(self.tombstones.items()))
            if t > now - self.tombstone_ttl_s and len(self.tombstones) <= self.max_tombstones:
                break
            if room in self.reasons or room in self.draining:
                # Still waiting for its fence (or for a dead sender's bytes): kept, and passed over, so that the rooms
                # behind it still expire (they stalled behind it, and the table filled).
                self.tombstones.move_to_end(room)
                passed_over += 1
                continue
            self.tombstones.popitem(last=False)
            if slot is not None:
                self.rooms.free(slot, room)
            # After the table's entry: a reaper killed between the two leaves entries a
            # successor keeps as an unknown room's tombstone, already expired.
            self._forget(room)
        while self.unknown:
            room, t = next(iter(self.unknown.items()))
            if t > now - self.tombstone_ttl_s and len(self.unknown) <= self.max_tombstones:
                break
            self.unknown.popitem(last=False)
            self._forget(room)

    def _forget(self, room: int) -> None:
        self.told.forget(room)
        self.digests.pop(room, None)
        self.allocated.pop(room, None)
        self.untabled.pop(room, None)

    def bound_of(self, entry) -> float:
        """When a room must have concluded, whatever died: its deadline or the bootstrap
        timeout, whichever is later, plus the time to find and restart a dead stage."""
        deadline = self.deadline_of(entry.deadline, entry.created) if entry.deadline else 0.0
        return max(deadline, entry.created + self.bootstrap_timeout_s) + self.restart_margin_s

    def _watch(self, now: float) -> None:
        """Fail every live room past its bound: a record lost with a dead stage (or never
        acted on) must not leave a room, and its receivers, waiting for ever."""
        for entry in self._live_entries():
            if now > self.bound_of(entry):
                self._fail(RoomFailure(entry.slot, entry.room, (
                    f"{WATCHDOG} still live {now - entry.created:.0f} s after it arrived, past its bound "
                    f"max(deadline, bootstrap_timeout_s {self.bootstrap_timeout_s:g} s) + "
                    f"heartbeat_timeout_s + {RESTART_MARGIN_S:g} s ({self.restart_margin_s:g} s); "
                    f"no stage was finishing it (a stage stuck, or a record lost with one that died)")))

    def _live_entries(self) -> list:
        # The table's state column, vectorised: reading every entry would cost the tens of
        # thousands of tombstones each time.
        states = self.rooms.active_states()
        live = np.flatnonzero((states > RoomState.FREE) & (states < RoomState.SUCCESS)).tolist()
        return [e for e in map(self.rooms.get, live) if e is not None and e.live]

    # ------------------------------------------------------------ helpers
    def _entry(self, room: int):
        slot = self.rooms.find(room)
        return self.rooms.get(slot) if slot is not None else None

    def _tell_failed(self, room: int, receiver: str, reason: str) -> None:
        who = self._incarnation(receiver)
        if self.told.told_failed(room, who):
            return
        self._recorded(self.told.record_failed(room, who, time.monotonic()))
        self.pusher.send(receiver, wire.status_message(room, None, False, reason))

    def _incarnation(self, receiver: str) -> str:
        """Whom the told table records a status for: the receiver as registered now, by its
        id and Mooncake session (its process: the sender binds allocs to it the same way). A
        receiver restarted under the same id registers a new session; what its previous
        incarnation was told (or was sent, before we heard of the new one) the new one never
        heard, and it is told again. One that only moved its status endpoint is the same
        process, and hears nothing twice."""
        reg = self.registrations.get(receiver)
        return receiver if reg is None else incarnation(receiver, reg.session, reg.incarnation)

    def _recorded(self, ok: bool) -> None:
        if not ok:
            self.unrecorded += 1
            if self.unrecorded & (self.unrecorded - 1) == 0:  # the 1st, 2nd, 4th...: not one per status
                log.warning("the told table is full (%d entries): %d statuses sent without a record, "
                            "which a restarted reaper could repeat", self.told.capacity, self.unrecorded)

    def _concluded(self, room: int, slot: int, outcome: str, reason: str) -> None:
        self.outcomes[outcome] += 1
        code = self.codes.pop(room, "")  # "": a raise site that sets none yet, classed by its text
        self.concluded_by_reason[(outcome, reason_class(reason, code) if outcome == "failed" else "none")] += 1
        entry = self.rooms.get(slot)
        if entry is not None and entry.room == room and entry.concluded:
            self.latency.observe(max(0.0, entry.concluded - entry.created))
        self.unknown.pop(room, None)
        self.tombstones.pop(room, None)
        self.tombstones[room] = (time.monotonic(), slot)
        if outcome == "failed":
            entry = self.rooms.get(slot)
            request_id = entry.request_id if entry is not None and entry.room == room else "?"
            log.info("room failed: room=%d request_id=%s reason=%s", room, request_id, reason)


def build(env, settings: ReaperSettings, name, emit, custody) -> ReaperStage:
    s, sh = settings, env.shared
    return ReaperStage(emit, rooms=sh.rooms, told=sh.told, receivers=sh.receivers,
                       pusher=StatusPusher(s.status_hwm, s.max_status_sockets, s.status_socket_idle_s,
                                           curve=env.curve_keypair),
                       tombstone_ttl_s=s.tombstone_ttl_s, max_tombstones=s.max_tombstones,
                       bootstrap_timeout_s=s.bootstrap_timeout_s, heartbeat_timeout_s=s.heartbeat_timeout_s,
                       max_deadline_s=s.max_deadline_s, custody=custody)
