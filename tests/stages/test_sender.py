"""The sender: rooms fenced before it has seen them open, allocs held for rooms it has not
seen, and the custody it takes of what it holds."""
from __future__ import annotations

import time
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ipc import shm, wire
from ipc.arena import Arena
from ipc.held import HeldAllocs
from ipc.receivers import ReceiverTable
from ipc.rooms import RoomTable
from ipc.wire import Register
from stages.base import TableCustody
from stages.records import (OWNER_INTAKE, OWNER_SENDER, OWNER_TOWER, AllocSeen, Fence, Fenced, LateAlloc, ReadyItem,
                            RoomFailure, RoomOpened, RoomSucceeded, UnknownRoom)
from stages.registry import INTAKE, REAPER, TOWER
from stages.registrations import Registrations
from stages.sender import SenderStage

ROOM = 11


class Outbox(list):
    """What a sender emitted, in order: every record of its goes to the reaper."""

    def __call__(self, dest, rec) -> None:
        assert dest == REAPER, (dest, rec)
        self.append(rec)


class RecordingCustody(TableCustody):
    """A stage process's custody, which also keeps the calls a sender makes, in order."""

    def __init__(self, rooms: RoomTable):
        super().__init__(rooms, OWNER_SENDER)
        self.calls: list[tuple[str, int, int]] = []

    def hold(self, slot: int, room: int) -> None:
        self.calls.append(("hold", slot, room))
        super().hold(slot, room)

    def release(self, slot: int, room: int) -> None:
        self.calls.append(("release", slot, room))
        super().release(slot, room)

    def holds(self, room: int) -> bool:
        """Is the sender's bit set for `room` in the room table, once what it emitted is pushed?"""
        self.flush()
        return any(e.room == room for e in self.rooms.held_by(self.bit, failed_too=True))


@pytest.fixture
def tables(shm_prefix):
    """What a sender and its successors share: arena, rooms, receivers, held allocs."""
    run_id = shm.new_run_id()
    made = (Arena.create(shm_prefix, run_id, "emb", 64 * 1024, block_size=64),
            RoomTable.create(shm_prefix, run_id, "rooms", 16),
            ReceiverTable.create(shm_prefix, run_id, "receivers", 8),
            HeldAllocs.create(shm_prefix, run_id, "held", 16))
    try:
        yield made
    finally:
        for table in made:
            table.close()
            table.unlink()


def make_sender(tables, engine=None, custody=None) -> tuple[SenderStage, Outbox]:
    """A started sender on `tables`, as a stage host builds one (no transfer engine unless
    a test starts writes)."""
    arena, rooms, receivers, held = tables
    out = Outbox()
    s = SenderStage(out, custody, arena=arena, engine=engine, rooms=rooms, registrations=receivers, held=held,
                    hidden=8, dtype="bfloat16", deepstack_width=0, bootstrap_timeout_s=60.0, max_held_allocs=16)
    s.start()
    return s, out


@pytest.fixture
def sender(tables):
    s, out = make_sender(tables)
    return s, tables[1], out


def _bootstrap(s, **msg):
    s.handle("socket", wire.encode({"v": wire.VERSION, **msg}))


def _register(s, rx, session="127.0.0.1:1111", status="tcp://127.0.0.1:2222"):
    _bootstrap(s, type="register", receiver=rx, session=session, status=status)


def _alloc(s, rx, item=0, span=4, n_rows=None):
    _bootstrap(s, type="alloc", receiver=rx, room=ROOM, item=item, dst=4096, dst_deepstack=0, row_start=0,
               n_rows=span if n_rows is None else n_rows, span=span, hidden=8, dtype="bfloat16",
               deepstack_width=0, fanout=1)


def test_a_room_fenced_before_its_room_opened_is_not_opened_when_it_comes(sender):
    """The reaper fences a failed room before the room table says Failed, and the
    RoomOpened comes on another ring: the table may still say live when it arrives."""
    s, rooms, out = sender
    slot = rooms.insert(ROOM, "req", 1, OWNER_INTAKE)
    s.handle(REAPER, Fence(ROOM))
    assert out == [Fenced(ROOM, ())]
    s.handle(INTAKE, RoomOpened(slot, ROOM, "req", [4], 0.0))
    assert rooms.get(slot).live, "the table alone would have let it open"
    assert s.lives.live_one(ROOM) is None


def test_a_room_id_used_again_after_an_old_fence_opens(sender):
    """A room id may come back once its tombstone expired: a fence older than the room
    is not the new room's."""
    s, rooms, _ = sender
    s.handle(REAPER, Fence(ROOM))  # a room of that id, long gone
    time.sleep(0.01)
    slot = rooms.insert(ROOM, "req-again", 1, OWNER_INTAKE)
    s.handle(INTAKE, RoomOpened(slot, ROOM, "req-again", [4], 0.0))
    assert s.lives.live_one(ROOM) is not None


def test_an_alloc_for_a_room_fenced_before_it_opened_is_answered_at_once(sender):
    """A room failed at intake never opens at the sender; an alloc that comes after its
    fence, while the table may still say live, must not wait for a RoomOpened."""
    s, rooms, out = sender
    _register(s, "rx")
    rooms.insert(ROOM, "req", 1, OWNER_INTAKE)
    s.handle(REAPER, Fence(ROOM))
    out.clear()
    _alloc(s, "rx")
    assert out == [LateAlloc(ROOM, "rx")]
    assert not s.lives.holding


def test_allocs_held_for_an_unseen_room_outlive_the_sender(tables):
    """A sender SIGKILLed while it holds an alloc for a room it has not seen: its successor
    holds it again, since the same moment, and answers it (here: "unknown room" at the
    bootstrap timeout), so the receiver does not wait forever."""
    s, out = make_sender(tables)
    _register(s, "rx")
    out.clear()
    _alloc(s, "rx")
    assert s.n_held == 1 and not out
    [(since, alloc, slot)] = s.lives.get(ROOM).held
    successor, heard = make_sender(tables)
    assert list(successor.lives.holding) == [ROOM] and successor.n_held == 1
    assert successor.lives.get(ROOM).held == [(since, alloc, slot)]
    successor.tick(since + 61.0)
    assert heard == [UnknownRoom(ROOM, "rx", "unknown room")]
    assert successor.n_held == 0 and len(successor.held_table) == 0


def test_a_bad_held_alloc_fails_its_room_once_and_the_rest_are_answered(sender):
    """Allocs held before their RoomOpened, the first of them bad: it fails and fences the
    room as it opens; the others are answered, not held again (that went round and round
    until the held table was full, and every alloc after it was dropped)."""
    s, rooms, out = sender
    for rx in ("rx-a", "rx-b", "rx-c"):
        _register(s, rx)
    slot = rooms.insert(ROOM, "req", 2, OWNER_INTAKE)
    out.clear()
    _alloc(s, "rx-a", item=0, span=5)  # span 5: the room's is 4
    _alloc(s, "rx-b", item=1, span=4)
    assert s.n_held == 2
    s.handle(INTAKE, RoomOpened(slot, ROOM, "req", [4, 4], 0.0))
    assert s.n_held == 0 and len(s.held_table) == 0 and not s.lives.holding
    kinds = [type(e).__name__ for e in out]
    assert kinds == ["AllocSeen", "RoomFailure", "Fenced", "LateAlloc"], out
    assert out[-1] == LateAlloc(ROOM, "rx-b")
    out.clear()
    _alloc(s, "rx-c", item=1, span=4)  # later still: answered too
    assert out == [LateAlloc(ROOM, "rx-c")] and not s.lives.holding


class _Engine:
    """Records the writes a sender starts; they stay in flight."""

    def __init__(self):
        self.writes = []

    def submit(self, session, srcs, dsts, lens):
        self.writes.append((session, dsts))
        return object()


@pytest.mark.parametrize("again", ["new session", "same session", "same session, new status endpoint"])
def test_an_alloc_from_a_receiver_that_registered_again_is_never_written(sender, again):
    """A register replaces the one before (a restarted receiver, docs/protocol.md §2): an alloc
    that came before one under another session names the predecessor's buffers. Its room
    fails; no write starts. The same session registered again (a status endpoint moved)
    is the same receiver's memory: its allocs stand."""
    s, rooms, out = sender
    s.engine = engine = _Engine()
    _register(s, "rx")
    slot = rooms.insert(ROOM, "req", 1, OWNER_INTAKE)
    s.handle(INTAKE, RoomOpened(slot, ROOM, "req", [4], 0.0))
    _alloc(s, "rx")
    session = "127.0.0.1:3333" if again == "new session" else "127.0.0.1:1111"
    status = "tcp://127.0.0.1:4444" if "new status" in again else "tcp://127.0.0.1:2222"
    _register(s, "rx", session, status)
    lease = s.arena.alloc(4 * 8 * 2, OWNER_TOWER)
    s.handle(TOWER, ReadyItem(slot, ROOM, 0, 4, lease))
    failures = [e for e in out if isinstance(e, RoomFailure)]
    if again == "new session":
        assert engine.writes == []
        assert len(failures) == 1 and "registered again" in failures[0].reason, out
    else:
        assert engine.writes == [("127.0.0.1:1111", [4096])] and not failures


# -- custody: held while the sender holds anything of the room, released once handed on ----


def _ready(s, slot, item):
    s.handle(TOWER, ReadyItem(slot, ROOM, item, 4, s.arena.alloc(4 * 8 * 2, OWNER_TOWER)))


def test_an_item_that_overtook_its_room_is_held_until_the_room_holds_it(tables):
    """An item before its RoomOpened is the sender's (its bit set); once the room opens,
    the room's hold covers it; the room's success releases the room."""
    custody = RecordingCustody(tables[1])
    s, _ = make_sender(tables, custody=custody)
    rooms = tables[1]
    slot = rooms.insert(ROOM, "req", 2, OWNER_INTAKE)
    _ready(s, slot, 0)
    assert custody.calls == [("hold", slot, ROOM)] and s.next_tick_in(0.0) is not None
    assert custody.holds(ROOM)
    s.handle(INTAKE, RoomOpened(slot, ROOM, "req", [4, 4], 0.0))
    assert custody.calls[1:] == [("hold", slot, ROOM), ("release", slot, ROOM)]
    assert custody.holds(ROOM)
    custody.calls.clear()
    s.handle(REAPER, RoomSucceeded(ROOM))
    assert custody.calls == [("release", slot, ROOM)] and s.lives.live_one(ROOM) is None
    assert not custody.holds(ROOM)


def test_a_room_fenced_is_released_with_its_fence(tables):
    """A live room's fence answered at once releases it; an unopened room's fence releases
    each item that overtook it."""
    custody = RecordingCustody(tables[1])
    s, out = make_sender(tables, custody=custody)
    rooms = tables[1]
    slot = rooms.insert(ROOM, "req", 1, OWNER_INTAKE)
    s.handle(INTAKE, RoomOpened(slot, ROOM, "req", [4], 0.0))
    custody.calls.clear()
    s.handle(REAPER, Fence(ROOM))
    assert out == [Fenced(ROOM, ())] and custody.calls == [("release", slot, ROOM)]
    assert not custody.holds(ROOM)

    other = ROOM + 1
    slot2 = rooms.insert(other, "req-2", 2, OWNER_INTAKE)
    for item in (0, 1):
        s.handle(TOWER, ReadyItem(slot2, other, item, 4, s.arena.alloc(4 * 8 * 2, OWNER_TOWER)))
    assert custody.holds(other)
    custody.calls.clear()
    s.handle(REAPER, Fence(other))
    assert custody.calls == [("release", slot2, other)] * 2 and not s.lives.waiting
    assert not custody.holds(other)


def test_a_room_failed_while_it_opens_is_never_held(tables):
    """A bad alloc held for the room fails and fences it as its RoomOpened is handled: the
    room is not held (its item that came early is released), so nothing stays set for it."""
    custody = RecordingCustody(tables[1])
    s, out = make_sender(tables, custody=custody)
    rooms = tables[1]
    _register(s, "rx")
    slot = rooms.insert(ROOM, "req", 1, OWNER_INTAKE)
    _alloc(s, "rx", span=5)  # the room's span is 4
    _ready(s, slot, 0)
    s.handle(INTAKE, RoomOpened(slot, ROOM, "req", [4], 0.0))
    assert [type(e) for e in out[1:]] == [AllocSeen, RoomFailure, Fenced], out
    assert custody.calls == [("hold", slot, ROOM), ("release", slot, ROOM)]
    assert not custody.holds(ROOM)


def test_registrations_that_own_nothing_give_way_least_recently_heard_from_first(tables):
    """The table is bounded: when full, a new receiver takes the place of the one heard from
    least recently that owns no room in flight nor held alloc; one that owns something is
    passed over; the shared table says the same to a successor."""
    s, out = make_sender(tables)
    s.receivers.max_receivers = 3
    _register(s, "old")
    _register(s, "busy")
    _register(s, "fresh")
    _bootstrap(s, type="cancel", receiver="old", room=99)  # old is heard from again: now the most recent
    _alloc(s, "busy")  # held for a room not seen yet: busy owns something
    _register(s, "new")
    assert list(s.receivers) == ["old", "busy", "new"] and s.receivers.evicted == 1  # fresh gave way
    assert set(tables[2].load()) == {"old", "busy", "new"}
    successor, _ = make_sender(tables)
    assert set(successor.receivers) == {"old", "busy", "new"}
    _register(s, "newer")  # old, then new give way before busy, which still owns its held alloc
    _register(s, "newest")
    assert set(s.receivers) == {"busy", "newer", "newest"}
    out.clear()
    _alloc(s, "fresh")
    assert not out and any("unregistered" in reason for reason in s.dropped)


def test_a_full_table_of_receivers_that_all_own_a_room_drops_a_new_one_with_a_reason(tables):
    s, _ = make_sender(tables)
    s.receivers.max_receivers = 2
    for rx in ("a", "b"):
        _register(s, rx)
        _alloc(s, rx)
    _register(s, "c")
    assert set(s.receivers) == {"a", "b"}
    assert any("each receiver of its key has a room in flight" in reason for reason in s.dropped), s.dropped


def test_a_key_past_its_share_gives_way_among_its_own_registrations_only(tables):
    """With CurveZMQ a key holds at most max_receivers_per_key registrations: past that,
    or with the table full, its own least recently heard from that owns nothing gives
    way, never another key's; with none such its register is dropped."""
    a, b = "A" * 40, "B" * 40

    def register(rx, key, **over):  # with an alloc's fields in `over`, a self-describing alloc
        msg = {"v": wire.VERSION, "type": "register", "receiver": rx, "session": "127.0.0.1:1111",
               "status": "tcp://127.0.0.1:2222", **over}
        s.handle("socket", wire.KeyedFrame(wire.encode(msg), key))

    s, _ = make_sender(tables)
    s.receivers.max_per_key = 2
    s.receivers.max_receivers = 4
    register("a1", a)
    register("b1", b)
    register("a2", a)
    for n in range(3, 10):  # a's flood: a1, a2, ... give way in turn
        register(f"a{n}", a)
    assert set(s.receivers) == {"b1", "a8", "a9"} and s.receivers.evicted == 7
    register("b2", b)
    register("b3", b)  # b's own share full: b1, the oldest of b's, gives way
    assert set(s.receivers) == {"b2", "b3", "a8", "a9"}
    register("b1", a)  # a free id: anyone's, within a's share
    assert set(s.receivers) == {"b2", "b3", "a9", "b1"} and s.receivers["b1"].key == a
    for rx in ("b2", "b3"):  # held for a room not seen yet: each owns something
        register(rx, b, type="alloc", room=ROOM, item=0, dst=4096, dst_deepstack=0, row_start=0, n_rows=4, span=4,
                 hidden=8, dtype="bfloat16", deepstack_width=0, fanout=1)
    register("b4", b)  # the table is full, and every one of b's owns an alloc
    assert set(s.receivers) == {"b2", "b3", "a9", "b1"}
    assert any("each receiver of its key has a room in flight" in reason for reason in s.dropped), s.dropped
    assert set(tables[2].load()) == {"b2", "b3", "a9", "b1"}
    successor, _ = make_sender(tables)
    assert {rx: reg.key for rx, reg in successor.receivers.by_id.items()} == {
        "b2": b, "b3": b, "a9": a, "b1": a}


class _Table:
    """The shared table's writer side, in a dict."""

    def __init__(self):
        self.rows = {}

    def put(self, receiver, session, status, incarnation=None, key=""):
        self.rows[receiver] = key

    def remove(self, receiver):
        return self.rows.pop(receiver, None) is not None


_KEYS = ("", "A" * 40, "B" * 40, "C" * 40)


@given(st.lists(st.tuples(st.sampled_from(["register", "engage", "disengage"]), st.integers(0, 11),
                          st.sampled_from(_KEYS)), max_size=200),
       st.integers(1, 5), st.integers(1, 8))
def test_registrations_never_give_way_across_keys(ops, per_key, total):
    """Whatever registers, engages and lets go, in any order: a key other than '' holds
    at most its share, the table at most its size; a register takes the place of one of
    its own key's idle registrations (the least recently heard from) or of none, never
    another key's; and it is refused only when all of its key's own are engaged."""
    engaged = Counter()
    regs = Registrations(_Table(), engaged, idle_s=3600.0, max_per_key=per_key)
    regs.max_receivers = total
    for now, (op, n, key) in enumerate(ops):
        rx = f"rx-{n}"
        if op == "engage":  # a room in flight, or an alloc held
            if rx in regs:
                engaged[rx] += 1
            continue
        if op == "disengage":
            if engaged[rx]:
                engaged[rx] -= 1
            continue
        if rx in regs and regs[rx].key != key:
            continue  # the sender refuses an id of another key before it gets here
        before = dict(regs.by_id)
        idle_own = [r for r in regs.by_key.get(key, ()) if not engaged[r]]
        problem = regs.add(Register(rx, "127.0.0.1:1", "tcp://127.0.0.1:1", None, key), float(now))
        gone = set(before) - set(regs.by_id)
        if problem:
            assert not idle_own and rx not in regs and not gone, problem
        else:
            assert rx in regs and gone <= set(idle_own[:1]), (gone, idle_own)
        assert len(regs) <= total and all(len(own) <= per_key for k, own in regs.by_key.items() if k)
        assert regs.table.rows == {r: m.key for r, m in regs.by_id.items()}


def test_idle_registrations_expire_unless_they_own_something(tables):
    s, _ = make_sender(tables)
    s.receivers.idle_s = 10.0
    _register(s, "idle")
    _register(s, "waiting")
    _alloc(s, "waiting")  # held: owns an alloc
    s.receivers.expire(time.monotonic() + 11.0)
    assert list(s.receivers) == ["waiting"] and s.receivers.expired == 1
    assert set(tables[2].load()) == {"waiting"}
    s._unhold(ROOM)  # its alloc answered: its idle time starts now
    s.receivers.expire(time.monotonic() + 5.0)
    assert list(s.receivers) == ["waiting"]
    s.receivers.expire(time.monotonic() + 11.0)
    assert not s.receivers and not tables[2].load()
