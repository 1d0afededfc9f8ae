"""The reaper: what each receiver hears when a room concludes."""
from __future__ import annotations

import time

import pytest

from ipc import shm
from ipc.receivers import ReceiverTable
from ipc.rooms import RoomState, RoomTable
from ipc.told import ToldTable
from ipc import wire
from stages.reaper import ReaperStage
from stages.records import (OWNER_INTAKE, AllocSeen, Fence, Fenced, ItemDone, LateAlloc, Registered, RoomAbandoned,
                            RoomFailure, RoomOpened, RoomsLost, RoomSucceeded, ShardWritten, UnknownRoom)

ROOM, RECEIVER = 7, "prefill-0"


class RecordingPusher:
    """Stands in for StatusPusher: keeps each status, decoded, in the order sent."""

    def __init__(self):
        self.sent: list[tuple[str, dict]] = []
        self.endpoints: dict[str, str] = {}
        self.undelivered = 0

    def register(self, receiver: str, endpoint: str, key: str = "") -> None:
        self.endpoints[receiver] = endpoint

    def send(self, receiver: str, frame: bytes) -> None:
        self.sent.append((receiver, wire.decode(frame)))

    def forget(self, receiver: str) -> None:
        self.endpoints.pop(receiver, None)

    n_waiting = 0

    def tick(self) -> None:
        pass

    def stats(self) -> dict:
        return {"status_undelivered": self.undelivered}

    def close(self) -> None:
        pass


@pytest.fixture
def tables(shm_prefix):
    """The shared tables a reaper and its successors use: rooms, told, receivers."""
    run_id = shm.new_run_id()
    made = [RoomTable.create(shm_prefix, run_id, "rooms", 16), ToldTable.create(shm_prefix, run_id, "told", 64, 8),
            ReceiverTable.create(shm_prefix, run_id, "receivers", 8)]
    try:
        yield made
    finally:
        for table in made:
            table.close()
            table.unlink()


@pytest.fixture
def rooms(tables):
    return tables[0]


def make_reaper(tables, **over):
    """A reaper stage on `tables`, as a stage host builds one: (stage, pusher, what it emitted)."""
    rooms, told, receivers = tables
    pusher, emitted = RecordingPusher(), []
    settings = dict(tombstone_ttl_s=60.0, max_tombstones=16, bootstrap_timeout_s=60.0, heartbeat_timeout_s=1.0)
    stage = ReaperStage(lambda dest, rec: emitted.append((dest, rec)), rooms=rooms, told=told, receivers=receivers,
                        pusher=pusher, **{**settings, **over})
    stage.start()
    return stage, pusher, emitted


@pytest.fixture
def reaper(tables, rooms):
    """A reaper with a room of two items open; (stage, pusher, slot, what it emitted)."""
    stage, pusher, emitted = make_reaper(tables)
    slot = rooms.insert(ROOM, "req-7", 2, OWNER_INTAKE)
    feed(stage, "intake", RoomOpened(slot, ROOM, "req-7", [4, 4], 0.0))
    feed(stage, "sender", AllocSeen(ROOM, RECEIVER))
    yield stage, pusher, slot, emitted
    stage.close()


def feed(stage, source: str, rec) -> None:
    """What a host does with one record: hand it over, push what it emitted, say so."""
    stage.handle(source, rec)
    stage.pushed()


def states(pusher) -> list[tuple[int | None, str]]:
    return [(msg["item"], msg["state"]) for _, msg in pusher.sent]


def finish_item(stage, slot: int, item: int) -> None:
    feed(stage, "sender", ShardWritten(ROOM, item, RECEIVER))
    feed(stage, "sender", ItemDone(slot, ROOM, item, item + 1))  # items done so far


def cancel_at_sender(stage, slot: int) -> None:
    """What the sender reports when a cancel for a room it holds arrives."""
    feed(stage, "sender", RoomFailure(slot, ROOM, "canceled"))
    feed(stage, "sender", Fenced(ROOM, (RECEIVER,)))


def test_cancel_just_after_success_sends_nothing(reaper, rooms):
    stage, pusher, slot, emitted = reaper
    finish_item(stage, slot, 0)
    finish_item(stage, slot, 1)
    assert rooms.get(slot).state == RoomState.SUCCESS
    assert emitted == [("sender", RoomSucceeded(ROOM))]

    cancel_at_sender(stage, slot)  # it crossed the last item's success on the way
    assert states(pusher) == [(0, "success"), (1, "success")], "no `failed` after the successes"
    assert emitted == [("sender", RoomSucceeded(ROOM))], "no fence, no forget_room for a room that succeeded"
    assert stage.outcomes == {"success": 1}
    assert rooms.get(slot).state == RoomState.SUCCESS


def test_cancel_before_the_last_success_fails_the_room(reaper, rooms):
    """The same events one item earlier: the receiver does hear `failed`."""
    stage, pusher, slot, emitted = reaper
    finish_item(stage, slot, 0)
    cancel_at_sender(stage, slot)
    assert states(pusher) == [(0, "success"), (None, "failed")]
    assert pusher.sent[-1][1]["reason"] == "canceled"
    assert rooms.get(slot).state == RoomState.FAILED
    assert ("sender", Fence(ROOM)) in emitted
    assert stage.outcomes == {"failed": 1}


def successor(tables):
    """A restarted reaper on the same shared tables, as the stage host builds one."""
    return make_reaper(tables)


@pytest.mark.parametrize("died", ["before its orders were pushed", "after its orders were pushed",
                                  "after the room table said Failed"])
def test_a_reaper_killed_while_failing_a_room_leaves_its_successor_to_tell_the_receivers(reaper, tables, rooms, died):
    """The record a reaper dies with comes again to its successor (it is released only
    after what it caused is pushed). Wherever the predecessor died, the receivers hear
    `failed` exactly once, and the cache and scheduler are told to drop the room."""
    stage, pusher, slot, _ = reaper
    failure = RoomFailure(slot, ROOM, "pixels were lost before hashing (intake died)")
    stage.handle("cache", failure)
    fence_out = died != "before its orders were pushed"  # else what it emitted died with it
    if died == "after the room table said Failed":
        stage.pushed()
        assert rooms.get(slot).state == RoomState.FAILED
    else:
        assert rooms.get(slot).live, "the table says Failed only once the fence is out"

    nxt, heard, emitted = successor(tables)
    if fence_out:  # the sender's answer to the predecessor's fence may come first
        feed(nxt, "sender", Fenced(ROOM, (RECEIVER,)))
    feed(nxt, "cache", failure)  # the same record again
    if died != "after the room table said Failed":
        assert ("sender", Fence(ROOM)) in emitted
        assert ("cache", RoomAbandoned(ROOM)) in emitted and ("scheduler", RoomAbandoned(ROOM)) in emitted
        feed(nxt, "sender", Fenced(ROOM, (RECEIVER,)))  # the answer to the successor's fence
    assert rooms.get(slot).state == RoomState.FAILED
    assert states(heard) == [(None, "failed")], heard.sent
    assert heard.sent[0][1]["reason"] == failure.reason
    assert pusher.sent == []  # the predecessor told nobody
    nxt.close()


def test_an_item_done_handled_again_by_a_successor_does_not_end_the_room_early(reaper, tables, rooms):
    """A reaper killed after counting an item but before releasing the record: its
    successor gets the same record. Counted as "one more", the room would have
    succeeded with its second item still unwritten."""
    stage, pusher, slot, _ = reaper
    finish_item(stage, slot, 0)
    nxt, heard, emitted = successor(tables)
    feed(nxt, "sender", ItemDone(slot, ROOM, 0, 1))  # the same record again
    assert rooms.get(slot).live and rooms.get(slot).items_done == 1
    assert ("sender", RoomSucceeded(ROOM)) not in emitted
    feed(nxt, "sender", ShardWritten(ROOM, 1, RECEIVER))
    feed(nxt, "sender", ItemDone(slot, ROOM, 1, 2))
    assert rooms.get(slot).state == RoomState.SUCCESS
    assert ("sender", RoomSucceeded(ROOM)) in emitted
    nxt.close()


def test_a_room_intake_inserts_while_the_reaper_looks_is_failed_not_crashed_on(reaper, rooms, monkeypatch):
    """The reaper looks a room up without the table's lock; intake may be inserting it on
    the other core at that moment. The insert the reaper then tries finds it under the
    lock: the reaper fails that entry instead of dying on the duplicate."""
    stage, pusher, slot, emitted = reaper
    real_find, looked = rooms.find, []

    def find_missing_once(room):
        looked.append(room)
        return None if len(looked) == 1 else real_find(room)

    monkeypatch.setattr(rooms, "find", find_missing_once)
    feed(stage, "sender", RoomFailure(None, ROOM, "alloc for item 0 does not fit"))
    assert rooms.get(slot).state == RoomState.FAILED
    assert ("sender", Fence(ROOM)) in emitted


# -- a successor never repeats a status, whatever record it is handed again ----------------


def test_a_shard_written_handled_again_by_a_successor_is_not_told_twice(reaper, tables):
    stage, pusher, slot, _ = reaper
    record = ShardWritten(ROOM, 0, RECEIVER)
    feed(stage, "sender", record)  # told, then killed before the record was released
    nxt, heard, _ = successor(tables)
    feed(nxt, "sender", record)
    assert states(pusher) == [(0, "success")] and heard.sent == []
    feed(nxt, "sender", ShardWritten(ROOM, 1, RECEIVER))  # the next one is told as usual
    assert states(heard) == [(1, "success")]
    nxt.close()


def test_a_fenced_with_several_receivers_handled_again_tells_each_once(reaper, tables, rooms):
    stage, pusher, slot, _ = reaper
    feed(stage, "cache", RoomFailure(slot, ROOM, "tower failed"))
    fenced = Fenced(ROOM, ("prefill-0", "prefill-1", "prefill-2"))
    stage.told.record_failed(ROOM, "prefill-0", 0.0)  # the predecessor got one told ...
    pusher.send("prefill-0", wire.status_message(ROOM, None, False, "tower failed"))
    nxt, heard, _ = successor(tables)  # ... and was killed there
    feed(nxt, "sender", fenced)
    feed(nxt, "sender", fenced)  # and once more, for good measure
    assert sorted(r for r, _ in pusher.sent + heard.sent) == ["prefill-0", "prefill-1", "prefill-2"]
    assert all(msg["state"] == "failed" and msg["reason"] == "tower failed" for _, msg in heard.sent)
    nxt.close()


def test_a_late_alloc_after_a_restart_is_not_told_again(reaper, tables, rooms):
    """The successor did not see the room fail: the told table says the receiver heard."""
    stage, pusher, slot, _ = reaper
    cancel_at_sender(stage, slot)
    assert states(pusher) == [(None, "failed")]
    nxt, heard, _ = successor(tables)
    feed(nxt, "sender", LateAlloc(ROOM, RECEIVER))
    assert heard.sent == []
    feed(nxt, "sender", LateAlloc(ROOM, "prefill-9"))  # one that never heard: told, once
    feed(nxt, "sender", LateAlloc(ROOM, "prefill-9"))
    assert [(r, m["state"]) for r, m in heard.sent] == [("prefill-9", "failed")]
    nxt.close()


def test_an_unknown_room_is_remembered_by_a_successor(tables):
    stage, pusher, _ = make_reaper(tables)
    feed(stage, "sender", UnknownRoom(99, RECEIVER, "unknown room"))
    nxt, heard, _ = successor(tables)
    assert 99 in nxt.unknown, "freed with its tombstone, like any other"
    feed(nxt, "sender", UnknownRoom(99, RECEIVER, "unknown room"))
    assert states(pusher) == [(None, "failed")] and heard.sent == []
    stage.close()
    nxt.close()


def test_no_success_after_failed_across_a_restart(reaper, tables):
    """A dead sender's rooms are failed at once (its writes died with it); a ShardWritten it
    pushed before it died still waits in its ring for the reaper's successor."""
    stage, pusher, slot, _ = reaper
    feed(stage, "supervisor", RoomsLost(((slot, ROOM),), "sender died", died="sender"))
    assert states(pusher) == [(None, "failed")]
    nxt, heard, _ = successor(tables)
    feed(nxt, "sender", ShardWritten(ROOM, 0, RECEIVER))
    assert heard.sent == []
    nxt.close()


def test_told_entries_go_with_their_tombstone(tables, rooms):
    stage, pusher, _ = make_reaper(tables, max_tombstones=1)
    slot = rooms.insert(ROOM, "req-7", 1, OWNER_INTAKE)
    feed(stage, "intake", RoomOpened(slot, ROOM, "req-7", (4,), 0.0))
    feed(stage, "sender", RoomFailure(slot, ROOM, "canceled"))
    feed(stage, "sender", Fenced(ROOM, (RECEIVER,)))
    told = stage.told
    assert told.told_failed(ROOM, RECEIVER)
    other = rooms.insert(ROOM + 1, "req-8", 1, OWNER_INTAKE)  # a second tombstone: one too many
    feed(stage, "intake", RoomOpened(other, ROOM + 1, "req-8", (4,), 0.0))
    feed(stage, "sender", RoomFailure(other, ROOM + 1, "canceled"))
    feed(stage, "sender", Fenced(ROOM + 1, (RECEIVER,)))
    stage.tick(time.monotonic())
    assert rooms.get(slot) is None and not told.told_anything(ROOM, RECEIVER)
    stage.close()


def test_unknown_rooms_never_evict_a_real_rooms_tombstone(tables, rooms):
    """Unknown rooms have a budget of their own (max_tombstones of them): past it the oldest
    unknown one goes, with what it was told; a concluded room's tombstone stays."""
    stage, pusher, _ = make_reaper(tables, max_tombstones=2)
    slot = rooms.insert(ROOM, "req-7", 1, OWNER_INTAKE)
    feed(stage, "intake", RoomOpened(slot, ROOM, "req-7", (4,), 0.0))
    cancel_at_sender(stage, slot)
    for room in range(100, 105):
        feed(stage, "sender", UnknownRoom(room, RECEIVER, "unknown room"))
    stage.tick(time.monotonic())
    assert list(stage.tombstones) == [ROOM] and list(stage.unknown) == [103, 104]
    assert stage.told.told_failed(ROOM, RECEIVER) and not stage.told.told_anything(100, RECEIVER)
    feed(stage, "sender", LateAlloc(ROOM, "prefill-9"))
    assert pusher.sent[-1][1]["reason"] == "canceled"
    stage.close()


# -- registrations outlive the sender and the reaper together ----------------------------


def test_a_sender_and_a_reaper_restarted_together_keep_every_registration(tables, shm_prefix):
    """Both die close together: neither can give the other the registrations back, the
    receiver table does. The receiver's alloc is still accepted, its status still goes out."""
    from ipc.arena import Arena
    from ipc.held import HeldAllocs
    from stages.sender import SenderStage

    rooms, _, receivers = tables
    run_id = shm.new_run_id()
    arena = Arena.create(shm_prefix, run_id, "emb", 64 * 1024, block_size=64)
    held = HeldAllocs.create(shm_prefix, run_id, "held", 16)
    try:
        def sender():
            """A started sender on the shared tables: (stage, what it emitted for the reaper)."""
            out = []
            s = SenderStage(lambda dest, rec: out.append(rec), arena=arena, engine=None, rooms=rooms,
                            registrations=receivers, held=held, hidden=8, dtype="bfloat16", deepstack_width=0,
                            bootstrap_timeout_s=60.0, max_held_allocs=16)
            s.start()
            return s, out

        first, first_out = sender()
        first.handle("socket", wire.encode({"v": 1, "type": "register", "receiver": RECEIVER,
                                            "session": "127.0.0.1:1234", "status": "tcp://127.0.0.1:5555"}))
        assert [type(e) for e in first_out] == [Registered]  # the sender and the reaper die here

        (again, again_out), reaper_again = sender(), make_reaper(tables)
        stage, pusher, _ = reaper_again
        assert pusher.endpoints == {RECEIVER: "tcp://127.0.0.1:5555"}
        slot = rooms.insert(ROOM, "req", 1, OWNER_INTAKE)
        again.handle("intake", RoomOpened(slot, ROOM, "req", (4,), 0.0))
        again.handle("socket", wire.encode({"v": 1, "type": "alloc", "receiver": RECEIVER, "room": ROOM, "item": 0,
                                            "dst": 4096, "dst_deepstack": 0, "row_start": 0, "n_rows": 0,
                                            "span": 4, "hidden": 8, "dtype": "bfloat16", "deepstack_width": 0,
                                            "fanout": 1}))
        assert not again.dropped, again.dropped
        feed(stage, "intake", RoomOpened(slot, ROOM, "req", (4,), 0.0))
        feed(stage, "sender", RoomFailure(slot, ROOM, "canceled"))
        again.handle("reaper", Fence(ROOM))  # the reaper's Fence: answered, with the receiver that allocated
        for ev in again_out:
            feed(stage, "sender", ev)
        assert pusher.sent == [(RECEIVER, {"v": 1, "type": "status", "room": ROOM, "item": None,
                                           "state": "failed", "reason": "canceled"})]
        stage.close()
    finally:
        for obj in (arena, held):
            obj.close()
            obj.unlink()


# -- the watchdog --------------------------------------------------------------------------


def test_the_watchdog_fails_a_room_nobody_will_finish(tables, rooms):
    """A room in the table whose every record was lost: past max(deadline, bootstrap_timeout_s)
    plus the restart margin it fails, fenced and told like any other failure."""
    stage, pusher, emitted = make_reaper(tables, bootstrap_timeout_s=0.2, heartbeat_timeout_s=0.1)
    slot = rooms.insert(ROOM, "req-lost", 1, 0)
    entry = rooms.get(slot)
    bound = stage.bound_of(entry)
    assert bound == entry.created + 0.2 + stage.restart_margin_s
    stage.tick(bound - 0.01)
    assert rooms.get(slot).live and not emitted
    stage.tick(bound + stage.restart_margin_s)  # a second later at most, it looks
    stage.pushed()
    assert ("sender", Fence(ROOM)) in emitted
    assert rooms.get(slot).state == RoomState.FAILED
    assert "room watchdog" in rooms.get(slot).reason and "bootstrap_timeout_s" in rooms.get(slot).reason
    feed(stage, "sender", AllocSeen(ROOM, RECEIVER))
    feed(stage, "sender", Fenced(ROOM, ()))
    assert states(pusher) == [(None, "failed")] and "room watchdog" in pusher.sent[0][1]["reason"]
    stage.close()


def test_the_watchdog_waits_for_a_later_deadline(tables, rooms):
    stage, pusher, emitted = make_reaper(tables, bootstrap_timeout_s=0.2, heartbeat_timeout_s=0.1,
                                         max_deadline_s=10**9)
    slot = rooms.insert(ROOM, "req-slow", 1, 0, deadline=10**9)
    stage.tick(10**6)
    assert rooms.get(slot).live and not emitted
    stage.close()


def test_a_deadline_past_max_deadline_s_is_capped(tables, rooms):
    """deadline_ms up to 1e9 (11.6 days) is legal on the wire: the room fails at
    max_deadline_s after it arrived, saying so, and the watchdog goes by the cap too."""
    stage, pusher, emitted = make_reaper(tables, max_deadline_s=5.0)
    slot = rooms.insert(ROOM, "req-far", 1, 0, deadline=time.monotonic() + 10**6)
    stage.handle("intake", RoomOpened(slot, ROOM, "req-far", (4,), rooms.get(slot).deadline))
    created = rooms.get(slot).created
    assert stage.bound_of(rooms.get(slot)) <= created + 60.0 + stage.restart_margin_s
    stage.tick(created + 1.0)
    assert rooms.get(slot).live and not emitted
    stage.tick(created + 5.5)
    stage.pushed()
    assert rooms.get(slot).state == RoomState.FAILED
    assert "max_deadline_s" in rooms.get(slot).reason
    stage.close()


def test_the_deadline_heap_keeps_only_rooms_in_flight(tables, rooms):
    """Rooms that conclude long before their deadline leave the heap (it grew with the
    request rate times deadline_ms)."""
    stage, pusher, emitted = make_reaper(tables, tombstone_ttl_s=0.001)
    for k in range(200):
        slot = rooms.insert(1000 + k, f"r{k}", 1, 0, deadline=time.monotonic() + 3000)
        stage.handle("intake", RoomOpened(slot, 1000 + k, f"r{k}", (4,), rooms.get(slot).deadline))
        stage.handle("sender", ItemDone(slot, 1000 + k, 0, 1))
        stage.tick(time.monotonic() + 2.0)  # the watch, and the tombstone's expiry (frees the slot)
    assert len(stage.deadlines) < 64, len(stage.deadlines)
    stage.close()


@pytest.mark.parametrize("how", ["the sender died", "the watchdog"])
def test_when_who_allocated_is_not_known_every_registered_receiver_hears(tables, rooms, how):
    """A receiver whose alloc died with the sender before the reaper heard of it (or whose
    record was lost, so the watchdog fails the room) must not wait for ever: every
    registered receiver is told, not only those the reaper knows allocated."""
    stage, pusher, _ = make_reaper(tables, bootstrap_timeout_s=0.2, heartbeat_timeout_s=0.1)
    for rx in ("rx-a", "rx-b"):
        reg = wire.Register(rx, "127.0.0.1:1", f"tcp://127.0.0.1:{len(rx)}")
        tables[2].put(reg.receiver, reg.session, reg.status)  # as the sender does, before telling anyone
        feed(stage, "sender", Registered(reg))
    slot = rooms.insert(ROOM, "req", 1, OWNER_INTAKE)
    feed(stage, "intake", RoomOpened(slot, ROOM, "req", (4,), 0.0))
    feed(stage, "sender", AllocSeen(ROOM, "rx-a"))  # rx-b's alloc was never acknowledged
    if how == "the sender died":
        feed(stage, "supervisor", RoomsLost(((slot, ROOM),), "the sender stage died while it held this room",
                                            died="sender"))
    else:
        stage.tick(stage.bound_of(rooms.get(slot)) + 1.0)  # time has passed its bound
        stage.pushed()
        feed(stage, "sender", Fenced(ROOM, ()))  # the sender never saw the room
    assert sorted(r for r, msg in pusher.sent if msg["state"] == "failed") == ["rx-a", "rx-b"], pusher.sent


@pytest.mark.parametrize("reaper_restarted", [False, True])
def test_a_room_that_arrives_after_the_sender_died_is_told_to_every_registered_receiver(tables, rooms,
                                                                                        reaper_restarted):
    """Allocs come before their room (held), and a request can reach the room table after
    the sender died (it waited in a restarting intake's socket): rx-b's alloc died with the
    sender, the room arrives after the death and times out at the successor, which never
    saw rx-b. rx-b must hear too, also when the reaper that saw the death died since."""
    stage, pusher, _ = make_reaper(tables, bootstrap_timeout_s=0.2, heartbeat_timeout_s=0.1)
    for rx in ("rx-a", "rx-b"):
        reg = wire.Register(rx, "127.0.0.1:1", f"tcp://127.0.0.1:{len(rx)}")
        tables[2].put(reg.receiver, reg.session, reg.status)  # as the sender does, before telling anyone
        feed(stage, "sender", Registered(reg))
    feed(stage, "supervisor", RoomsLost((), "the sender stage died while it held this room", died="sender"))
    if reaper_restarted:
        stage.close()
        stage, pusher, _ = make_reaper(tables, bootstrap_timeout_s=0.2, heartbeat_timeout_s=0.1)
    slot = rooms.insert(ROOM, "req", 1, OWNER_INTAKE)  # after the death
    feed(stage, "intake", RoomOpened(slot, ROOM, "req", (4,), 0.0))
    feed(stage, "sender", RoomFailure(slot, ROOM, "allocs for item 0 incomplete (bootstrap_timeout_s)"))
    feed(stage, "sender", Fenced(ROOM, ("rx-a",)))
    assert sorted(r for r, msg in pusher.sent if msg["state"] == "failed") == ["rx-a", "rx-b"], pusher.sent
    stage.close()


def test_an_alloc_the_sender_could_not_hold_fails_a_live_room(reaper, rooms):
    """The sender drops an alloc it cannot hold (too many held) and answers UnknownRoom,
    but the room is in the table already (its RoomOpened still on the way): the room can
    never succeed at that receiver, so it fails, with the sender's reason, at every one."""
    stage, pusher, slot, emitted = reaper
    why = "alloc for a room this worker has not seen, and it already holds 3 such allocs (max_held_allocs)"
    feed(stage, "sender", UnknownRoom(ROOM, "prefill-1", why))
    assert pusher.sent == [] and ("sender", Fence(ROOM)) in emitted  # fenced first, told after
    feed(stage, "sender", Fenced(ROOM, (RECEIVER,)))
    assert sorted((r, m["state"], m["reason"]) for r, m in pusher.sent) == [
        (RECEIVER, "failed", why), ("prefill-1", "failed", why)]
    assert rooms.get(slot).state == RoomState.FAILED


def test_a_registration_whose_telling_died_with_the_sender_is_read_back(tables):
    """A restarted receiver (same id, new status endpoint) registers with a sender that
    writes the receiver table and is killed before its Registered reaches the reaper: the
    sender's death makes the reaper read the table again, so the room failed next goes to
    the new endpoint, not the dead incarnation's."""
    rooms, _, receivers = tables
    receivers.put(RECEIVER, "127.0.0.1:1", "tcp://127.0.0.1:5001")
    stage, pusher, _ = make_reaper(tables)
    assert pusher.endpoints[RECEIVER] == "tcp://127.0.0.1:5001"
    receivers.put(RECEIVER, "127.0.0.1:2", "tcp://127.0.0.1:5002")  # ... and the sender dies
    slot = rooms.insert(ROOM, "req-7", 1, OWNER_INTAKE)
    feed(stage, "intake", RoomOpened(slot, ROOM, "req-7", (4,), 0.0))
    feed(stage, "supervisor", RoomsLost(((slot, ROOM),), "the sender stage died while it held this room",
                                        died="sender"))
    assert pusher.endpoints[RECEIVER] == "tcp://127.0.0.1:5002"
    assert [(r, m["state"]) for r, m in pusher.sent] == [(RECEIVER, "failed")]
    stage.close()


def _a_room_failed_at_its_receiver(tables):
    """A reaper that told RECEIVER (session 127.0.0.1:1, status endpoint :5001) that ROOM,
    which it allocated for, was canceled."""
    rooms = tables[0]
    stage, pusher, _ = make_reaper(tables)
    feed(stage, "sender", Registered(wire.Register(RECEIVER, "127.0.0.1:1", "tcp://127.0.0.1:5001")))
    slot = rooms.insert(ROOM, "req-7", 1, OWNER_INTAKE)
    feed(stage, "intake", RoomOpened(slot, ROOM, "req-7", (4,), 0.0))
    feed(stage, "sender", AllocSeen(ROOM, RECEIVER))
    feed(stage, "cache", RoomFailure(slot, ROOM, "canceled"))
    feed(stage, "sender", Fenced(ROOM, (RECEIVER,)))
    return stage, pusher


def test_a_receiver_restarted_under_the_same_id_hears_what_its_predecessor_was_told(tables):
    """The told table records a status for the receiver as registered: a restarted
    receiver (same id, new session and status endpoint) never heard what was sent to its
    previous incarnation, and its alloc for that room is answered; once, and a receiver
    that registers again unchanged is not told twice."""
    stage, pusher = _a_room_failed_at_its_receiver(tables)
    assert [(pusher.endpoints[r], m["state"]) for r, m in pusher.sent] == [("tcp://127.0.0.1:5001", "failed")]
    feed(stage, "sender", Registered(wire.Register(RECEIVER, "127.0.0.1:1", "tcp://127.0.0.1:5001")))
    feed(stage, "sender", LateAlloc(ROOM, RECEIVER))
    assert len(pusher.sent) == 1, "the same incarnation is not told twice"
    feed(stage, "sender", Registered(wire.Register(RECEIVER, "127.0.0.1:2", "tcp://127.0.0.1:5002")))
    feed(stage, "sender", LateAlloc(ROOM, RECEIVER))
    feed(stage, "sender", LateAlloc(ROOM, RECEIVER))
    assert [m["state"] for _, m in pusher.sent] == ["failed", "failed"]
    assert pusher.endpoints[RECEIVER] == "tcp://127.0.0.1:5002"
    stage.close()


@pytest.mark.parametrize("reaper_restarted", [False, True])
def test_a_failed_room_whose_fence_died_with_the_sender_is_told_to_every_receiver(tables, rooms, reaper_restarted):
    """The room failed (a write to rx-a failed) while the sender still had a write in flight,
    so the reaper marked it Failed and waits for Fenced; the sender dies first. The supervisor
    lists the failed room among those the dead sender held: its death is the fence, and both
    receivers hear `failed`, rx-b after its `success` too; also when the reaper that marked
    the room died meanwhile and its successor knows nothing of the wait."""
    stage, pusher, _ = make_reaper(tables)
    for rx in ("rx-a", "rx-b"):
        reg = wire.Register(rx, "127.0.0.1:1", f"tcp://127.0.0.1:{5001 if rx == 'rx-a' else 5002}")
        tables[2].put(reg.receiver, reg.session, reg.status)
        feed(stage, "sender", Registered(reg))
    slot = rooms.insert(ROOM, "req", 2, OWNER_INTAKE)
    feed(stage, "intake", RoomOpened(slot, ROOM, "req", (4, 4), 0.0))
    feed(stage, "sender", AllocSeen(ROOM, "rx-a"))
    feed(stage, "sender", AllocSeen(ROOM, "rx-b"))
    feed(stage, "sender", ShardWritten(ROOM, 1, "rx-b"))
    feed(stage, "sender", ItemDone(slot, ROOM, 1, 1))
    feed(stage, "sender", RoomFailure(slot, ROOM, "transfer to receiver rx-a failed"))
    assert rooms.get(slot).state == RoomState.FAILED and states(pusher) == [(1, "success")]
    if reaper_restarted:
        stage.close()
        stage, pusher, _ = make_reaper(tables)
    feed(stage, "supervisor", RoomsLost(((slot, ROOM),), "the sender stage died while it held this room",
                                        died="sender"))
    failed = sorted(r for r, msg in pusher.sent if msg["state"] == "failed")
    assert failed == ["rx-a", "rx-b"], pusher.sent
    stage.close()


def test_a_receiver_that_moved_its_status_endpoint_is_not_told_twice(tables):
    """The same process registering again at another status endpoint (the same Mooncake
    session) is the same receiver: what it was told stands, and a late alloc of a failed
    room is not answered a second time at the new endpoint (the protocol model found a
    second `failed` so)."""
    stage, pusher = _a_room_failed_at_its_receiver(tables)
    feed(stage, "sender", Registered(wire.Register(RECEIVER, "127.0.0.1:1", "tcp://127.0.0.1:5002")))
    feed(stage, "sender", LateAlloc(ROOM, RECEIVER))
    assert [(r, m["state"]) for r, m in pusher.sent] == [(RECEIVER, "failed")], "told twice"
    assert pusher.endpoints[RECEIVER] == "tcp://127.0.0.1:5002"  # what it is told next goes there
    stage.close()


def test_a_status_sent_just_before_the_receiver_moves_its_endpoint_still_arrives():
    """A receiver registers a new status endpoint while a status to the old one waits for
    its connection (found by the protocol model under the stress profile: the old socket
    was closed with linger 0, and the status told just before the move never arrived)."""
    import zmq

    from stages.status_pusher import StatusPusher
    from tests.helpers import free_port

    ctx = zmq.Context()
    pusher = StatusPusher()
    old = f"tcp://127.0.0.1:{free_port()}"  # nothing listens yet: the status waits in the queue
    new_pull = ctx.socket(zmq.PULL)
    new_port = new_pull.bind_to_random_port("tcp://127.0.0.1")
    old_pull = ctx.socket(zmq.PULL)
    try:
        pusher.register(RECEIVER, old)
        pusher.send(RECEIVER, wire.status_message(ROOM, None, False, "canceled"))
        pusher.register(RECEIVER, f"tcp://127.0.0.1:{new_port}")
        pusher.send(RECEIVER, wire.status_message(ROOM + 1, 0, True))
        old_pull.bind(old)  # the old endpoint comes up: the first status is delivered there
        assert old_pull.poll(5000), "the status sent before the move was dropped"
        assert wire.decode(old_pull.recv())["room"] == ROOM
        assert new_pull.poll(5000) and wire.decode(new_pull.recv())["room"] == ROOM + 1
    finally:
        pusher.close()
        for sock in (old_pull, new_pull):
            sock.close(linger=0)
        ctx.term()


def test_tombstones_expire_past_a_room_still_waiting_for_its_fence(tables, rooms):
    """A failed room waits for the sender's fence before its tombstone may go; the rooms
    concluded after it expire meanwhile (expiry stopped at it, and the table filled)."""
    stage, pusher, emitted = make_reaper(tables, tombstone_ttl_s=1.0)
    stuck = rooms.insert(ROOM, "req-stuck", 1, OWNER_INTAKE)
    stage.handle("intake", RoomOpened(stuck, ROOM, "req-stuck", (4,), 0.0))
    stage.handle("sender", RoomFailure(stuck, ROOM, "canceled"))
    stage.pushed()  # Failed in the table; the fence is not answered
    done = []
    for k in range(5):
        slot = rooms.insert(100 + k, f"r{k}", 1, OWNER_INTAKE)
        stage.handle("intake", RoomOpened(slot, 100 + k, f"r{k}", (4,), 0.0))
        stage.handle("sender", ItemDone(slot, 100 + k, 0, 1))
        done.append(slot)
    stage.tick(time.monotonic() + 2.0)
    assert all(rooms.get(slot) is None for slot in done), "expired behind the room waiting for its fence"
    assert ROOM in stage.tombstones and rooms.get(stuck) is not None
    stage.handle("sender", Fenced(ROOM, ()))
    stage.tick(time.monotonic() + 4.0)
    assert ROOM not in stage.tombstones
    stage.close()


def test_registrations_the_sender_freed_leave_the_reaper_too(tables):
    """The sender frees registrations (expired, given way) in the shared table without a
    record: past the table's capacity the reaper reads it again and forgets the rest."""
    stage, pusher, _ = make_reaper(tables)
    receivers = tables[2]
    for k in range(20):
        rx = f"rx{k}"
        if len(receivers.load()) >= receivers.capacity - 1:
            receivers.remove(f"rx{k - receivers.capacity + 1}")
        receivers.put(rx, "127.0.0.1:1", "tcp://127.0.0.1:9")
        feed(stage, "sender", Registered(wire.Register(rx, "127.0.0.1:1", "tcp://127.0.0.1:9")))
    assert len(stage.registrations) <= receivers.capacity
    assert set(pusher.endpoints) == set(stage.registrations)  # bounded, the same in both
    assert "rx19" in stage.registrations and "rx0" not in stage.registrations
    stage.close()


def test_a_room_failed_while_the_table_is_full_tells_its_allocs_why(tables, rooms):
    """Intake fails a request the full room table cannot take ("worker busy: ..."): the
    room has no slot, yet a receiver that allocs for it hears that reason, not "unknown room"."""
    stage, pusher, emitted = make_reaper(tables)
    for room in range(1000, 1000 + rooms.capacity):
        rooms.insert(room, "filler", 1, OWNER_INTAKE)
    feed(stage, "intake", RoomFailure(None, 99, "worker busy: room table full"))
    assert ("sender", Fence(99)) in emitted
    feed(stage, "sender", UnknownRoom(99, RECEIVER, "unknown room"))
    assert [(m["state"], m["reason"]) for _, m in pusher.sent] == [("failed", "worker busy: room table full")]
    stage.close()
