"""The sender's bookkeeping of rooms it is told to fence before it has seen them open."""
from __future__ import annotations

import time

import pytest

from ipc import shm
from ipc.arena import Arena
from ipc.held import HeldAllocs
from ipc.receivers import ReceiverTable
from ipc.rooms import RoomTable
from stages.records import OWNER_INTAKE, Fenced, LateAlloc, RoomOpened, UnknownRoom
from stages.sender import Sender

ROOM = 11


@pytest.fixture
def sender(shm_prefix):
    run_id = shm.new_run_id()
    arena = Arena.create(shm_prefix, run_id, "emb", 64 * 1024, block_size=64)
    rooms = RoomTable.create(shm_prefix, run_id, "rooms", 16)
    receivers = ReceiverTable.create(shm_prefix, run_id, "receivers", 8)
    held = HeldAllocs.create(shm_prefix, run_id, "held", 16)
    # No write is started here, so no transfer engine is needed.
    s = Sender(arena=arena, engine=None, rooms=rooms, registrations=receivers, held=held, hidden=8,
               dtype="bfloat16", deepstack_width=0, bootstrap_timeout_s=60.0, max_held_allocs=16)
    try:
        yield s, rooms
    finally:
        for table in (rooms, receivers, held):
            table.close()
            table.unlink()
        arena.close()
        arena.unlink()


def test_a_room_fenced_before_its_room_opened_is_not_opened_when_it_comes(sender):
    """The reaper fences a failed room before the room table says Failed, and the
    RoomOpened comes on another ring: the table may still say live when it arrives."""
    s, rooms = sender
    slot = rooms.insert(ROOM, "req", 1, OWNER_INTAKE)
    s.fence(ROOM)
    assert s.events == [Fenced(ROOM, ())]
    s.on_opened(RoomOpened(slot, ROOM, "req", [4], 0.0))
    assert rooms.get(slot).live, "the table alone would have let it open"
    assert ROOM not in s.live


def test_a_room_id_used_again_after_an_old_fence_opens(sender):
    """A room id may come back once its tombstone expired: a fence older than the room
    is not the new room's."""
    s, rooms = sender
    s.fence(ROOM)  # a room of that id, long gone
    time.sleep(0.01)
    slot = rooms.insert(ROOM, "req-again", 1, OWNER_INTAKE)
    s.on_opened(RoomOpened(slot, ROOM, "req-again", [4], 0.0))
    assert ROOM in s.live


def test_an_alloc_for_a_room_fenced_before_it_opened_is_answered_at_once(sender):
    """A room failed at intake never opens at the sender; an alloc that comes after its
    fence, while the table may still say live, must not wait for a RoomOpened."""
    from ipc.wire import Alloc

    s, rooms = sender
    rooms.insert(ROOM, "req", 1, OWNER_INTAKE)
    s.fence(ROOM)
    s.events.clear()
    alloc = Alloc(receiver="rx", room=ROOM, item=0, dst=4096, dst_deepstack=0, row_start=0, n_rows=4,
                  span=4, hidden=8, dtype="bfloat16", deepstack_width=0, fanout=1)
    s._on_alloc(alloc, time.monotonic())
    assert s.events == [LateAlloc(ROOM, "rx")]
    assert not s.held


def test_allocs_held_for_an_unseen_room_outlive_the_sender(sender, shm_prefix):
    """A sender SIGKILLed while it holds an alloc for a room it has not seen: its successor
    holds it again, since the same moment, and answers it (here: "unknown room" at the
    bootstrap timeout), so the receiver does not wait forever."""
    from ipc.wire import Alloc

    s, rooms = sender
    alloc = Alloc(receiver="rx", room=ROOM, item=0, dst=4096, dst_deepstack=0, row_start=0, n_rows=4,
                  span=4, hidden=8, dtype="bfloat16", deepstack_width=0, fanout=1)
    since = time.monotonic()
    s._on_alloc(alloc, since)
    assert s.n_held == 1 and not s.events
    successor = Sender(arena=s.arena, engine=None, rooms=rooms, registrations=s.registrations,
                       held=s.held_table, hidden=8, dtype="bfloat16", deepstack_width=0,
                       bootstrap_timeout_s=60.0, max_held_allocs=16)
    assert successor.held == {ROOM: [(since, alloc, 0)]} and successor.n_held == 1
    successor._timeouts(since + 61.0)
    assert successor.events == [UnknownRoom(ROOM, "rx", "unknown room")]
    assert successor.n_held == 0 and len(successor.held_table) == 0


def test_a_bad_held_alloc_fails_its_room_once_and_the_rest_are_answered(sender):
    """Allocs held before their RoomOpened, the first of them bad: it fails and fences the
    room as it opens; the others are answered, not held again (that went round and round
    until the held table was full, and every alloc after it was dropped)."""
    from ipc.wire import Alloc

    s, rooms = sender
    slot = rooms.insert(ROOM, "req", 2, OWNER_INTAKE)
    mk = lambda rx, item, span: Alloc(receiver=rx, room=ROOM, item=item, dst=4096, dst_deepstack=0,  # noqa: E731
                                      row_start=0, n_rows=span, span=span, hidden=8, dtype="bfloat16",
                                      deepstack_width=0, fanout=1)
    s._on_alloc(mk("rx-a", 0, 5), time.monotonic())  # span 5: the room's is 4
    s._on_alloc(mk("rx-b", 1, 4), time.monotonic())
    assert s.n_held == 2
    s.on_opened(RoomOpened(slot, ROOM, "req", [4, 4], 0.0))
    assert s.n_held == 0 and len(s.held_table) == 0 and not s.held
    kinds = [type(e).__name__ for e in s.events]
    assert kinds == ["AllocSeen", "RoomFailure", "Fenced", "LateAlloc"], s.events
    assert s.events[-1] == LateAlloc(ROOM, "rx-b")
    s.events.clear()
    s._on_alloc(mk("rx-c", 1, 4), time.monotonic())  # later still: answered too
    assert s.events == [LateAlloc(ROOM, "rx-c")] and not s.held


class _Engine:
    """Records the writes a sender starts; they stay in flight."""

    def __init__(self):
        self.writes = []

    def submit(self, session, srcs, dsts, lens):
        self.writes.append((session, dsts))
        return object()


def _bootstrap(s, **msg):
    from ipc import wire

    s.on_bootstrap(wire.encode({"v": wire.VERSION, **msg}))


@pytest.mark.parametrize("again", ["new session", "same session", "same session, new status endpoint"])
def test_an_alloc_from_a_receiver_that_registered_again_is_never_written(sender, again):
    """A register replaces the one before (a restarted receiver, PROTOCOL.md §2): an alloc
    that came before one under another session names the predecessor's buffers. Its room
    fails; no write starts. The same session registered again (a status endpoint moved)
    is the same receiver's memory: its allocs stand."""
    from stages.records import OWNER_TOWER, ReadyItem, RoomFailure

    s, rooms = sender
    s.engine = engine = _Engine()
    _bootstrap(s, type="register", receiver="rx", session="127.0.0.1:1111", status="tcp://127.0.0.1:2222")
    slot = rooms.insert(ROOM, "req", 1, OWNER_INTAKE)
    s.on_opened(RoomOpened(slot, ROOM, "req", [4], 0.0))
    _bootstrap(s, type="alloc", receiver="rx", room=ROOM, item=0, dst=4096, dst_deepstack=0, row_start=0,
               n_rows=4, span=4, hidden=8, dtype="bfloat16", deepstack_width=0, fanout=1)
    session = "127.0.0.1:3333" if again == "new session" else "127.0.0.1:1111"
    status = "tcp://127.0.0.1:4444" if "new status" in again else "tcp://127.0.0.1:2222"
    _bootstrap(s, type="register", receiver="rx", session=session, status=status)
    lease = s.arena.alloc(4 * 8 * 2, OWNER_TOWER)
    s.on_ready(ReadyItem(slot, ROOM, 0, 4, lease), source="tower")
    failures = [e for e in s.events if isinstance(e, RoomFailure)]
    if again == "new session":
        assert engine.writes == []
        assert len(failures) == 1 and "registered again" in failures[0].reason, s.events
    else:
        assert engine.writes == [("127.0.0.1:1111", [4096])] and not failures
