"""Sender: matches ready embeddings with receivers' allocs, checks them, issues writes.

It owns the Mooncake engine and the bootstrap socket's messages, and never sends a
status itself: what a receiver should hear goes to the reaper as a record, so that one
place decides what each receiver is told, exactly once. Custody: a room from its
RoomOpened until it concludes here (fenced, or forgotten once it succeeded), and an
item that overtook its room's RoomOpened until the room arrives or is fenced. Each room's
life here, its phase and the transitions between, is one `RoomLife` (stages/room_life.py).
"""
from __future__ import annotations

import logging
import time
from collections import Counter

from ipc.arena import Arena, StaleLease
from ipc.held import HeldAllocs
from ipc.receivers import ReceiverTable
from ipc.rooms import RoomState, RoomTable
from ipc import wire
from ipc.stats import Histogram, ReasonCode
from ipc.wire import Alloc, Cancel, ProtocolError, Query, Register
from stages import registry
from stages.alloc_checks import RowShape, alloc_problem, tiling_problem
from stages.base import POLL_S, Stage
from stages.ownership import RoomKeys
from stages.records import (OWNER_SENDER, AllocSeen, Fence, Fenced, IntakeRestarted, ItemDone, LateAlloc,
                            Queried, ReadyItem, Registered, RoomFailure, RoomOpened, RoomSucceeded,
                            ShardWritten, UnknownRoom)
from stages.registrations import Registrations, StatusRule
from stages.room_life import LIVE, RoomLife, RoomLives, Write
from stages.settings import SenderSettings

log = logging.getLogger("epd.sender")


MAX_FENCED_UNOPENED = 65536  # a RoomOpened trails its fence by a ring's length at most
# A room that arrived before this sender started (its predecessor died) and still misses
# allocs this long after both its embedding and this sender were ready fails: allocs sent
# meanwhile may be lost with the dead connection (docs/design.md, "Restarts and rooms").
ALLOCS_LOST_AFTER_S = 5.0


class SenderStage(Stage):
    """Bootstrap frames, opened rooms, ready items and the reaper's orders in; records for
    the reaper out."""

    name = registry.SENDER
    owner = OWNER_SENDER

    def __init__(self, emit, custody=None, *, arena: Arena, engine, rooms: RoomTable,
                 registrations: ReceiverTable, held: HeldAllocs, hidden: int, dtype: str, deepstack_width: int,
                 bootstrap_timeout_s: float, max_held_allocs: int, endpoint: str = "",
                 registration_idle_s: float = 3600.0, max_receivers_per_key: int = 64,
                 status_rule: StatusRule | None = None):
        super().__init__(emit, custody)
        self.arena = arena
        self.engine = engine
        self.rooms = rooms
        self.shape = RowShape(hidden, dtype, deepstack_width)
        self.itemsize = wire.DTYPES[dtype]
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.max_held_allocs = max_held_allocs
        self.endpoint = endpoint
        self.engaged = Counter()  # receiver -> its rooms in flight here and allocs held
        self.receivers = Registrations(registrations, self.engaged, idle_s=registration_idle_s,
                                       max_per_key=max_receivers_per_key, status_rule=status_rule)
        self.keys = RoomKeys(rooms, self.emit, bootstrap_timeout_s, max_held_allocs)  # whose rooms are whose
        # Every room known here: opened, or with allocs held for it (in the shared held
        # table too), or items that overtook its RoomOpened, or fenced before its RoomOpened
        # came (the reaper fences before the room table says Failed) or after, so that a
        # later alloc is answered, not held for it.
        self.lives = RoomLives(MAX_FENCED_UNOPENED)
        self.held_table = held
        self.n_held = self.transfer_failures = self.bytes_written = 0
        self.dropped = Counter()
        self.transfer_seconds = Histogram()
        self.alloc_wait = Histogram()  # an item's embedding ready here to its allocs complete
        self.started_at = time.monotonic()
        self.intake_back_at = float("-inf")  # when an intake successor was last ready
        self._timeouts_at = 0.0
        self._logged: set[str] = set()

    def start(self) -> None:
        """A predecessor's registrations and held allocs, if there was one: they outlive it
        (and the reaper) in shared memory."""
        self.receivers.load(time.monotonic())
        for slot, since, a in self.held_table.load():
            self.lives.life(a.room).hold((since, a, slot))
            self.engaged[a.receiver] += 1
        self.n_held = len(self.held_table)

    def socket(self) -> tuple[str, int] | None:  # register/alloc/cancel are a few hundred bytes
        return (self.endpoint, 1 << 20) if self.endpoint else None

    def handle(self, source: str, rec) -> None:
        match rec:
            case bytes() | wire.KeyedFrame():
                self._on_bootstrap(rec)
            case RoomOpened():
                self._on_opened(rec)
            case ReadyItem():
                self._on_ready(rec, source)
            case Fence(room=room):
                self._fence(room)
            case RoomSucceeded(room=room):
                self._forget(room)
            case IntakeRestarted(at=at):
                self.intake_back_at = max(self.intake_back_at, at)
            case _:
                raise ValueError(f"sender: unexpected record from {source}: {rec!r}")

    def tick(self, now: float) -> None:
        """Collect finished writes; time out what waited too long for its allocs."""
        for room in list(self.lives.writing):
            life = self.lives.live_one(room)
            if life is not None and life.writes:
                self._poll_room(room, life)
        if now - self._timeouts_at >= 0.05:
            self._timeouts_at = now
            self._timeouts(now)
            self.receivers.expire(now)
            self.keys.expire(now)

    def next_tick_in(self, now: float) -> float | None:
        # Writes complete in Mooncake's threads: poll them, yielding the core meanwhile.
        # An item that overtook its room's RoomOpened polls for it too: that record does
        # not wake us (stages/records.py, UNHURRIED).
        return POLL_S if self.lives.writing or self.lives.waiting else None

    def stats(self) -> dict:
        return {"sender_dropped": dict(self.dropped), "sender_refused": dict(self.keys.refused),
                "bytes_written": self.bytes_written,
                "sender_live_rooms": len(self.lives.live), "sender_held_allocs": self.n_held,
                "sender_early_items": self.lives.n_early(),
                "receivers_registered": len(self.receivers), "receivers_expired": self.receivers.expired,
                "receivers_evicted": self.receivers.evicted,
                "transfer_seconds": self.transfer_seconds.snapshot(), "transfer_failures": self.transfer_failures,
                "alloc_wait_seconds": self.alloc_wait.snapshot()}

    # ------------------------------------------------------------ inputs
    def _on_bootstrap(self, frame: bytes | wire.KeyedFrame) -> None:
        now = time.monotonic()
        key = frame.key if isinstance(frame, wire.KeyedFrame) else ""
        try:
            msg = wire.decode(frame.data if isinstance(frame, wire.KeyedFrame) else frame)
            m = wire.parse_bootstrap(msg)
        except ProtocolError as e:
            self._drop(f"bootstrap message: {e}")
            return
        bound = self.receivers.get(m.receiver)
        if bound is not None and bound.key != key:  # an id is its first key's while registered
            self._drop(f"{type(m).__name__.lower()} naming a receiver registered under another key")
            return
        if isinstance(m, Register):
            m.key = key
            self._on_register(m, now)
            return
        if isinstance(m, Alloc) and m.session is not None:
            # Self-describing: it registers its receiver as a register would, so that a
            # receiver that never registers again (tokenspeed's prefill) outlives our restarts.
            if bound is None or (bound.session, bound.status, bound.incarnation) != (
                    m.session, m.status, m.incarnation):
                self._on_register(Register(m.receiver, m.session, m.status, m.incarnation, key), now)
            m.session = m.status = None  # registered: a held copy (ipc/held.py) need not carry them
        if m.receiver not in self.receivers:
            self._drop(f"{type(m).__name__.lower()} from unregistered receiver")
            return
        self.receivers.heard(m.receiver, now)
        if key and self._refused(m, key, now):
            return
        if isinstance(m, Cancel):
            self._on_cancel(m)
        elif isinstance(m, Query):  # pending: its status is still to come, never "unknown room"
            life = self.lives.get(m.room)
            self.emit(registry.REAPER, Queried(m.room, m.receiver, life is not None and (
                bool(life.held) or life.phase in LIVE)))
        else:
            reg = self.receivers[m.receiver]
            # An alloc that names its incarnation is bound to it: one of an older
            # incarnation than the registration's fails its room when its write would start.
            m.session_hash = (reg.session_hash if m.incarnation is None or reg.incarnation is None
                              else wire.binding_hash(reg.session, m.incarnation))
            self._on_alloc(m, now)

    def _refused(self, m: Alloc | Cancel | Query, key: str, now: float) -> bool:
        """Under CURVE: True if `m` was answered as naming a room never seen, because the
        room is not its key's, or because it is not in the table yet and a cancel or query
        must not tell whose allocs are held for it (stages/ownership.py)."""
        if isinstance(m, Alloc):
            m.key = key  # kept while it is held: the room's keys are checked when it opens
        verdict = self.keys.verdict(m.room, key, claim=isinstance(m, Alloc))
        if verdict is False:
            self.keys.refuse(m, now, self.n_held)
        elif verdict is None and not isinstance(m, Alloc):
            life = self.lives.life(m.room)
            mine = [h for h in life.held if h[1].receiver == m.receiver]
            if isinstance(m, Query):  # answered without a look at the room, which may open meanwhile
                if not (mine or self.keys.waits(m.room, m.receiver)):
                    self.emit(registry.REAPER, UnknownRoom(m.room, m.receiver, "unknown room", "query"))
            elif self.keys.forget(m.room, m.receiver) or mine:  # it gives up its own allocs, not the room
                life.keep_held([h for h in life.held if h not in mine])
                self._unheld(mine)
                self.emit(registry.REAPER, UnknownRoom(m.room, m.receiver, "canceled", "cancel"))
            else:
                self._drop("cancel of a room this worker does not hold")
        return verdict is False or (verdict is None and not isinstance(m, Alloc))

    def _on_register(self, m: Register, now: float) -> None:
        problem = self.receivers.add(m, now)
        if problem:
            self._drop(problem)
            return
        self.emit(registry.REAPER, Registered(m))

    def _disengage(self, receiver: str) -> None:
        """One room or held alloc of `receiver` less: with none left, its idle time starts now."""
        if self.engaged[receiver] > 1:
            self.engaged[receiver] -= 1
            return
        self.engaged.pop(receiver, None)
        if receiver in self.receivers:
            self.receivers.heard(receiver, time.monotonic())

    def _on_opened(self, opened: RoomOpened) -> None:
        room = opened.room
        entry = self.rooms.get(opened.slot)
        fenced = self._fenced_unopened(room, entry, pop=True)
        if fenced or entry is None or entry.room != room or entry.state >= RoomState.SUCCESS:
            # Concluded before it reached us (failed elsewhere): answer what was held.
            for a in self._unhold(room):
                self.emit(registry.REAPER, LateAlloc(room, a.receiver))
            self._release_early(room)
            return
        life = self.lives.life(room)
        if not life.open(opened.slot, opened.spans):  # open already: a room id is live once
            self._impossible(room, life)
            return
        # Taken off the list first: a bad one fails and fences the room, and the next ones
        # then meet no live room (they are answered, not held again onto the very list
        # being read, which went round until the held table was full). Out of the shared
        # table only once handled: a sender killed meanwhile leaves them to its successor.
        held = life.take_held()
        for arrival, a, _ in self.keys.sort_held(room, held):
            self._on_alloc(a, arrival)
        self._unheld(held)
        early = life.take_early()
        for r in early:
            self._adopt(r)
        if life.phase in LIVE:  # not concluded on the way
            if life.opened():
                self.custody.hold(opened.slot, room)
            else:
                self._impossible(room, life)
        for _ in early:  # now covered by the room, or released with it
            self.custody.release(opened.slot, room)

    def _on_ready(self, r: ReadyItem, source: str) -> None:
        """Takes over the reference on r.lease that its producer (the cache or a tower) holds."""
        try:
            self.arena.transfer(r.lease, registry.owner_of(source), OWNER_SENDER)
        except StaleLease:
            life = self.lives.live_one(r.room)
            if life is not None:
                self._fail(r.room, life, f"embedding was lost before it could be sent ({source} died)",
                           ReasonCode.STAGE_DIED)
            return
        life = self.lives.live_one(r.room)
        if life is None:
            # The room's RoomOpened comes on another ring and may still be on its way.
            entry = self.rooms.get(r.slot)
            if entry is not None and entry.room == r.room and entry.state < RoomState.SUCCESS:
                if self.lives.life(r.room).keep_early(r):
                    self.custody.hold(r.slot, r.room)  # ours until its room arrives
            else:
                self._release(r)
            return
        self._adopt(r)

    def _adopt(self, r: ReadyItem) -> None:
        life = self.lives.live_one(r.room)  # None: failed (and fenced) by a held alloc just now
        if life is None or life.failing or r.item >= len(life.items) or life.items[r.item].ready:
            self._release(r)
            return
        it = life.items[r.item]
        it.ready = r
        it.ready_at = time.monotonic()
        self._maybe_start(r.room, life, r.item)

    # ------------------------------------------------------------ alloc rules
    def _on_alloc(self, a: Alloc, arrival: float) -> None:
        life = self.lives.live_one(a.room)
        if life is None:
            self._hold_alloc(a, arrival)
            return
        if a.receiver not in life.receivers:
            life.receivers.add(a.receiver)
            self.engaged[a.receiver] += 1
            self.emit(registry.REAPER, AllocSeen(a.room, a.receiver))
        if life.failing:
            return
        it = life.items[a.item] if a.item < len(life.items) else None
        problem = alloc_problem(a, life.spans, it.allocs if it else (), self.shape)
        if problem:
            self._fail(a.room, life, problem, ReasonCode.BAD_ALLOC)
            return
        it.allocs.append(a)
        it.fanout = a.fanout
        if len(it.allocs) == it.fanout:
            problem = tiling_problem(a.item, life.spans[a.item], it.allocs)
            if problem:
                self._fail(a.room, life, problem, ReasonCode.BAD_ALLOC)
                return
            self._maybe_start(a.room, life, a.item)

    def _hold_alloc(self, a: Alloc, arrival: float) -> None:
        """An alloc for a room not open here: answered if the room concluded, else held
        for its RoomOpened (in shared memory too: held allocs outlive this process)."""
        slot = self.rooms.find(a.room)
        entry = self.rooms.get(slot) if slot is not None else None
        if (entry is not None and entry.state in (RoomState.SUCCESS, RoomState.FAILED)
                or self._fenced_unopened(a.room, entry, pop=False)):
            if a.key and not self.keys.verdict(a.room, a.key, claim=False):  # opened since it was checked
                self.keys.refuse(a, arrival, self.n_held)
            else:
                self.emit(registry.REAPER, LateAlloc(a.room, a.receiver))
            return
        slot = self.held_table.put(arrival, a) if self.n_held + self.keys.n_waiting < self.max_held_allocs else None
        if slot is None:
            self._drop("alloc for an unknown room: too many held (max_held_allocs)")
            self.emit(registry.REAPER, UnknownRoom(a.room, a.receiver,
                      f"alloc for a room this worker has not seen, and it already holds "
                      f"{self.max_held_allocs} such allocs (max_held_allocs)"))
            return
        self.lives.life(a.room).hold((arrival, a, slot))
        self.n_held += 1
        self.engaged[a.receiver] += 1

    # ------------------------------------------------------------ writes
    def _maybe_start(self, room: int, life: RoomLife, item: int) -> None:
        it = life.items[item]
        if it.started or it.ready is None or not it.fanout or len(it.allocs) < it.fanout:
            return
        it.started = True
        self.alloc_wait.observe(max(0.0, time.monotonic() - it.ready_at))  # ~0 when the allocs came first
        if not self.arena.valid(it.ready.lease):
            self._fail(room, life, "embedding was reclaimed before it could be sent", ReasonCode.STAGE_DIED)
            return
        # no owner: the table's holders field is the custody bit mask, which a number would overwrite
        self.rooms.advance(life.slot, room, RoomState.TRANSFERRING)
        for a in it.allocs:
            if a.session_hash != self.receivers[a.receiver].session_hash:
                # The receiver registered again since (a restarted process), or the alloc came
                # from an older incarnation: the addresses it named are not the registered one's.
                self._fail(room, life, f"receiver {a.receiver} registered again with another session or "
                                     f"incarnation than its alloc for item {item}: the buffers it named are gone",
                           ReasonCode.BAD_ALLOC)
                return
        rows = self.arena.view(it.ready.lease)
        for a in it.allocs:
            if not self._write_shard(room, life, item, a, rows):
                return
        if not it.writes_left:
            self._item_done(room, life, item)

    def _write_shard(self, room: int, life: RoomLife, item: int, a: Alloc, rows: memoryview) -> bool:
        """Start the write of one alloc's rows (`rows`: the item's lease); False if the room failed."""
        main_row = self.shape.hidden * self.itemsize
        ds_row = self.shape.deepstack_width * self.itemsize
        main = (a.row_start * main_row, a.n_rows * main_row)  # (offset in the lease, length)
        deep = (life.spans[item] * main_row + a.row_start * ds_row, a.n_rows * ds_row)
        digest = wire.rows_digest([rows[off:off + n] for off, n in (main, deep)])
        if not a.n_rows:
            self.emit(registry.REAPER, ShardWritten(room, item, a.receiver, digest))
            return True
        base = self.arena.address + life.items[item].ready.lease.offset
        halves = [main, deep] if ds_row else [main]
        dsts = [a.dst, a.dst_deepstack][:len(halves)]
        try:
            pending = self.engine.submit(self.receivers[a.receiver].session, [base + off for off, _ in halves],
                                         dsts, [n for _, n in halves])
        except Exception as e:  # the transport names the cause
            self.transfer_failures += 1
            self._fail(room, life, f"transfer to receiver {a.receiver} could not start: {e}", ReasonCode.TRANSFER_ERROR)
            return False
        life.wrote(Write(item, a.receiver, pending, time.monotonic(), digest))
        life.items[item].writes_left += 1
        self.bytes_written += sum(n for _, n in halves)
        return True

    def _fenced_unopened(self, room: int, entry, pop: bool) -> bool:
        """Was `room` fenced before it opened here? (A room id may come back after its
        tombstone expired: a fence older than the room is not the new room's.)"""
        life = self.lives.get(room)
        fenced_at = life and (life.forget_fence() if pop else life.fenced_at)
        return fenced_at is not None and entry is not None and entry.created <= fenced_at

    def _item_done(self, room: int, life: RoomLife, item: int) -> None:
        it = life.items[item]
        self._release(it.ready)
        it.ready = None
        life.done += 1
        self.emit(registry.REAPER, ItemDone(life.slot, room, item, life.done))

    def _poll_room(self, room: int, life: RoomLife) -> None:
        still = []
        for w in life.writes:
            ok = w.pending.poll()
            if ok is None:
                still.append(w)
                continue
            it = life.items[w.item]
            it.writes_left -= 1
            self.transfer_seconds.observe(time.monotonic() - w.started)
            if not ok:
                self.transfer_failures += 1
            if ok and not life.failing:
                self.emit(registry.REAPER, ShardWritten(room, w.item, w.receiver, w.digest))
            elif not ok:
                reason = getattr(w.pending, "error", "") or "write failed"
                self._fail(room, life, f"transfer to receiver {w.receiver} failed: {reason}", ReasonCode.TRANSFER_ERROR)
            if not it.writes_left and not life.failing:
                self._item_done(room, life, w.item)
            elif not it.writes_left and it.ready is not None:  # fenced while written: no longer read
                self._release(it.ready)
                it.ready = None
        life.polled(still)
        if life.failing and not life.writes:
            self._conclude_fence(room, life)

    def _timeouts(self, now: float) -> None:
        # An item that came early for a room the table says is over (fenced before the item
        # came, and its RoomOpened lost with a dead intake) waits for nothing any more.
        for room in list(self.lives.waiting):
            entry = self.rooms.get(self.lives.get(room).early[0].slot)
            if entry is None or entry.room != room or entry.state >= RoomState.SUCCESS:
                self._release_early(room)
        limit = now - self.bootstrap_timeout_s
        for room in list(self.lives.live):
            life = self.lives.get(room)
            if life.failing:
                continue
            for i, it in enumerate(life.items):
                if it.ready is None or it.started:
                    continue
                entry = self.rooms.get(life.slot)
                before_me = entry is not None and entry.created < self.started_at
                if before_me and max(it.ready_at, self.started_at) < now - ALLOCS_LOST_AFTER_S:
                    # An alloc sent while no sender listened may be gone with the dead one's
                    # connection, and a receiver need not ask: the room fails within a bound.
                    self._fail(room, life, f"allocs for item {i} incomplete {ALLOCS_LOST_AFTER_S:g} s after "
                               f"the sender stage was restarted: any sent while it was down may be lost",
                               ReasonCode.BOOTSTRAP_TIMEOUT)
                    break
                if it.ready_at < limit:
                    reason = (f"allocs for item {i} incomplete {self.bootstrap_timeout_s:g} s "
                              f"after its embedding was ready (bootstrap_timeout_s)")
                    if before_me:
                        reason += ("; the sender stage was restarted after the room arrived, "
                                   "and allocs its predecessor had received were lost with it")
                    self._fail(room, life, reason, ReasonCode.BOOTSTRAP_TIMEOUT)
                    break
        for room in list(self.lives.holding):
            life = self.lives.get(room)
            held, keep = life.held, []
            for t, a, slot in held:
                # A request sent before an intake's restart may have died in its socket: an
                # alloc held since then is answered within a bound, not bootstrap_timeout_s.
                lost = t < self.intake_back_at < now - ALLOCS_LOST_AFTER_S
                if t >= limit and not lost:
                    keep.append((t, a, slot))
                    continue
                why = (f"no request for this room reached the worker within {ALLOCS_LOST_AFTER_S:g} s of the "
                       f"intake stage's restart: one sent before it may be lost" if lost else "unknown room")
                self.emit(registry.REAPER, UnknownRoom(room, a.receiver, why))
                self.held_table.remove(slot)
                self._disengage(a.receiver)
            self.n_held -= len(held) - len(keep)
            life.keep_held(keep)

    # ------------------------------------------------------------ failing
    def _fail(self, room: int, life: RoomLife, reason: str, code: ReasonCode) -> None:
        if life.phase in LIVE and not life.failing:
            self.emit(registry.REAPER, RoomFailure(life.slot, room, reason, code))
            self._fence(room)

    def _fence(self, room: int) -> None:
        """Stop the room: no new write starts; once none is in flight, report `fenced`."""
        life = self.lives.live_one(room)
        if life is None:
            self.lives.life(room).fence_unopened(time.monotonic())
            receivers = sorted({a.receiver for a in self._unhold(room)})
            self._release_early(room)
            self.emit(registry.REAPER, Fenced(room, tuple(receivers)))
            return
        if not life.failing:
            life.fail()
            for it in life.items:
                # An item whose writes are in flight keeps its lease until they end
                # (_poll_room): Mooncake still reads its rows, which must not be leased
                # and rewritten for another room meanwhile.
                if it.ready is not None and not it.writes_left:
                    self._release(it.ready)
                    it.ready = None
        if not life.writes:
            self._conclude_fence(room, life)

    def _release_early(self, room: int) -> None:
        life = self.lives.get(room)
        early = life.take_early() if life is not None else []
        for r in early:
            self._release(r)
        for _ in early:  # held where the first was: a later one's slot may be another room's since
            self.custody.release(early[0].slot, room)

    def _conclude_fence(self, room: int, life: RoomLife) -> None:
        self.emit(registry.REAPER, Fenced(room, tuple(sorted(life.receivers))))
        for receiver in life.receivers:
            self._disengage(receiver)
        slot = self.custody.slot_of(room)  # where its bit was set (None: no custody kept here)
        if life.in_custody and slot is not None:  # else its RoomOpened's handling releases it
            self.custody.release(slot, room)
        # An alloc that comes later is answered (LateAlloc), not held for a RoomOpened
        # that came already: the room is in the table, live until the reaper marks it.
        life.conclude(time.monotonic())

    def _forget(self, room: int) -> None:
        """The room concluded Success: drop what is left of it."""
        life = self.lives.live_one(room)
        if life is not None:
            if not life.succeed():
                self._impossible(room, life)
                return
            for receiver in life.receivers:
                self._disengage(receiver)
            for it in life.items:
                if it.ready is not None:
                    self._release(it.ready)
            self.custody.release(life.slot, room)

    def _on_cancel(self, c: Cancel) -> None:
        life = self.lives.live_one(c.room)
        if life is not None:
            self._fail(c.room, life, "canceled", ReasonCode.CANCELED)
        elif self.lives.get(c.room) is not None and self.lives.get(c.room).held:
            self.emit(registry.REAPER, RoomFailure(None, c.room, "canceled", ReasonCode.CANCELED))
        else:
            self._drop("cancel of a room this worker does not hold")

    def _unhold(self, room: int) -> list[Alloc]:
        """The allocs held for `room` whose keys it allows (the others wait as refused), no longer held."""
        life = self.lives.get(room)
        held = life.take_held() if life is not None else []
        allowed = self.keys.sort_held(room, held)
        self._unheld(held)
        return [a for _, a, _ in allowed]

    def _unheld(self, held: list) -> list[Alloc]:
        """`held` (taken off a room's life) out of the shared table too; their allocs."""
        for _, a, slot in held:
            self.held_table.remove(slot)
            self._disengage(a.receiver)
        self.n_held -= len(held)
        return [a for _, a, _ in held]

    def _impossible(self, room: int, life: RoomLife) -> None:
        """A transition its phase does not allow was asked of `life`: a bug, which it logged.
        The room fails saying so (once: a failing one concludes as it would), rather than
        the stage's loop raising."""
        self._fail(room, life, life.fault, ReasonCode.OTHER)

    def _release(self, r: ReadyItem) -> None:
        try:
            self.arena.drop(r.lease, OWNER_SENDER)
        except StaleLease:
            pass

    def _drop(self, reason: str) -> None:
        wire.count_reason(self.dropped, reason)
        if reason not in self._logged:
            if len(self._logged) >= 1000:  # reasons quote what clients sent: stay bounded
                self._logged.clear()
            self._logged.add(reason)
            log.warning("dropped: %s", reason)


def build(env, settings: SenderSettings, name, emit, custody) -> SenderStage:
    s, spec, sh = settings, env.spec, env.shared
    return SenderStage(emit, custody, arena=sh.emb_arena, engine=env.engine, rooms=sh.rooms,
                       registrations=sh.receivers, held=sh.held, hidden=spec.hidden, dtype=spec.dtype,
                       deepstack_width=spec.deepstack_width, bootstrap_timeout_s=s.bootstrap_timeout_s,
                       max_held_allocs=s.max_held_allocs, endpoint=s.endpoint,
                       registration_idle_s=s.registration_idle_s,
                       max_receivers_per_key=s.max_receivers_per_key,
                       status_rule=StatusRule(list(s.own_endpoints), list(s.status_ipc_dirs)))
