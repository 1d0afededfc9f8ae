"""ipc.rooms: the room table in shared memory, its state rules and torn-update safety."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test

from ipc import rooms as rooms_mod
from ipc import room_record, shm, wire
from tests.helpers import fork_call, wait_child
from ipc.rooms import RoomEntry, RoomState, RoomTable, TableFull

S = RoomState
LIVE = (S.BOOTSTRAPPING, S.QUEUED, S.ENCODING, S.TRANSFERRING)
FINAL = (S.SUCCESS, S.FAILED)




@pytest.fixture
def make_table(shm_prefix):
    made = []

    def make(capacity=8, what="rooms"):
        run_id = shm.new_run_id()
        t = RoomTable.create(shm_prefix, run_id, what, capacity)
        t.run_id = run_id
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()
        t.unlink()


# -- basics ----------------------------------------------------------------------------


def test_lifecycle_and_attach(make_table, shm_prefix):
    t = make_table(4)
    before = time.monotonic()
    slot = t.insert(2**63 - 1, "req-1", 3, holders=1, deadline=before + 5)
    e = t.get(slot)
    assert (e.room, e.request_id, e.state, e.holders, e.items_total, e.items_done, e.reason) == \
        (2**63 - 1, "req-1", S.BOOTSTRAPPING, 1, 3, 0, "")
    assert e.deadline == before + 5 and before <= e.created <= time.monotonic() and e.concluded == 0.0
    other = RoomTable.attach(shm_prefix, t.run_id, "rooms")
    try:
        assert other.capacity == 4 and other.get(slot) == e and other.find(2**63 - 1) == slot
        assert other.advance(slot, 2**63 - 1, S.ENCODING)  # skipping QUEUED is fine
        assert other.hold(slot, 2**63 - 1, 4) and other.unhold(slot, 2**63 - 1, 1)
        assert not other.hold(slot, 12, 2)  # not this room
        assert not t.advance(slot, 2**63 - 1, S.QUEUED)  # backwards
        assert not t.advance(slot, 2**63 - 1, S.ENCODING)  # not forward either
        assert not t.advance(slot, 12, S.TRANSFERRING)  # not this room
        assert t.item_done(slot, 2**63 - 1) == 1 and t.item_done(slot, 12) == -1
        # "done so far" reports: a repeated (or older) one changes nothing
        assert t.item_done(slot, 2**63 - 1, 1) == 1 and t.item_done(slot, 2**63 - 1, 3) == 3
        assert t.item_done(slot, 2**63 - 1, 3) == 3 and t.item_done(slot, 2**63 - 1, 2) == 3
        assert other.get(slot).items_done == 3
        assert [x.slot for x in other.held_by(4)] == [slot] and other.held_by(1) == []
        assert not t.free(slot, 2**63 - 1)  # live: not yet
        assert t.fail(slot, 2**63 - 1, "tower died")
        assert not t.fail(slot, 2**63 - 1, "again") and not t.succeed(slot, 2**63 - 1)
        assert not t.advance(slot, 2**63 - 1, S.FAILED)
        assert t.hold(slot, 2**63 - 1, 2) and t.get(slot).holders == 6  # custody outlives the room
        assert t.item_done(slot, 2**63 - 1) == 3  # final: unchanged
        e = other.get(slot)
        assert e.state == S.FAILED and e.reason == "tower died" and e.concluded >= e.created
        assert other.held_by(4) == [] and other.entries() == [e]
        # ... yet a failed room a stage still holds is there to be found when that stage dies
        assert [x.slot for x in other.held_by(4, failed_too=True)] == [slot] and other.held_by(1, True) == []
        assert t.free(slot, 2**63 - 1) and not t.free(slot, 2**63 - 1)
        assert other.get(slot) is None and other.find(2**63 - 1) is None and other.entries() == []
    finally:
        other.close()


def test_full_table_and_argument_errors(make_table):
    t = make_table(3)
    slots = [t.insert(r, f"q{r}", 1, 0) for r in (2**64 - 5, 0, 7)]
    assert sorted(slots) == [0, 1, 2]
    with pytest.raises(TableFull, match=r"all 3 slots .*room 9.*'q9'"):
        t.insert(9, "q9", 1, 0)
    with pytest.raises(ValueError, match="already"):
        t.insert(0, "again", 1, 0)
    assert t.insert(0, "again", 1, 0, existing_ok=True) == slots[1]  # full, but it is there
    assert t.find(0) == slots[1] and t.find(1) is None and t.find(2**70) is None
    for bad in (lambda: t.insert(2**64, "x", 1, 0), lambda: t.insert(-1, "x", 1, 0),
                lambda: t.insert(1, "x", -1, 0),
                lambda: t.insert(1, "x", 1, 0, state=S.FREE), lambda: t.insert(1, "x", 1, 2**32)):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(IndexError):
        t.get(3)
    assert t.succeed(slots[0], 2**64 - 5) and t.free(slots[0], 2**64 - 5)
    assert t.insert(9, "q9", 1, 0, state=S.QUEUED) == slots[0]


def test_long_strings_are_cut_with_ellipsis(make_table):
    t = make_table(2)
    slot = t.insert(1, "é" * 100, 1, 0)  # 200 UTF-8 bytes
    rid = t.get(slot).request_id
    assert rid.endswith("…") and len(rid.encode()) <= 128 and rid[:-1] == "é" * len(rid[:-1])
    t.fail(slot, 1, "x" * 1000)
    reason = t.get(slot).reason
    assert reason == "x" * 253 + "…" and len(reason.encode()) == 256


def test_damaged_entries_are_repaired_never_read(make_table):
    t = make_table(3)
    live = t.insert(10, "q10", 2, 0)
    t.item_done(live, 10)  # the other copy holds the version before it
    done = t.insert(11, "q11", 2, 0)
    t.succeed(done, 11)
    gone = t.insert(12, "q12", 2, 0)

    def smash(slot, both=False):
        base = t._rec0 + slot * 2 * room_record.RECORD_BYTES
        active = t._seqv[slot] & 1
        for copy in ((0, 1) if both else (active,)):
            off = base + copy * room_record.RECORD_BYTES + 30
            t._mv[off:off + 4] = b"\xff\xfe\xfd\xfc"

    smash(live)
    smash(done)
    smash(gone, both=True)
    e = t.get(live)  # salvaged from the older copy, and concluded: its record was damaged
    assert (e.room, e.state, e.request_id) == (10, S.FAILED, "q10") and "damaged" in e.reason
    e = t.get(done)  # only its live past is left: concluded FAILED, not guessed SUCCESS
    assert (e.room, e.state) == (11, S.FAILED) and "damaged" in e.reason
    assert t.get(gone) is None and t.find(12) is None  # nothing left to salvage
    assert t.repairs == 3
    assert all(t._load(s)[1] is not None for s in range(3))


# -- model-based --------------------------------------------------------------------------

CAP = 4
ROOMS = st.sampled_from([0, 1, 2, 3, 4, 5, 2**63, 2**64 - 1])
HOLDERS = st.integers(0, 15)  # custody bit masks of four stages
TEXT = st.text(max_size=150)


class RoomMachine(RuleBasedStateMachine):
    """The table against a model: slot -> fields (timestamps checked separately)."""

    def __init__(self, prefix):
        super().__init__()
        self.prefix = prefix
        self.t = None
        self.model: dict[int, dict] = {}

    @initialize()
    def make(self):
        self.t = RoomTable.create(self.prefix, shm.new_run_id(), "sm", CAP)

    def _slot_room(self, data_slot, room, use_model):
        if use_model and self.model:
            slot = sorted(self.model)[data_slot % len(self.model)]
            return slot, self.model[slot]["room"]
        return data_slot % CAP, room

    def _holds(self, slot, room):
        m = self.model.get(slot)
        return m is not None and m["room"] == room

    @rule(room=ROOMS, rid=TEXT, total=st.integers(0, 2**32 - 1), holders=HOLDERS,
          deadline=st.floats(0, 1e9), state=st.sampled_from(LIVE + FINAL))
    def insert(self, room, rid, total, holders, deadline, state):
        if any(m["room"] == room for m in self.model.values()):
            with pytest.raises(ValueError):
                self.t.insert(room, rid, total, holders, deadline, state)
            return
        if len(self.model) == CAP:
            with pytest.raises(TableFull):
                self.t.insert(room, rid, total, holders, deadline, state)
            return
        slot = self.t.insert(room, rid, total, holders, deadline, state)
        assert slot not in self.model and 0 <= slot < CAP
        cut = room_record.cut(rid, 128).decode()
        self.model[slot] = dict(room=room, request_id=cut, state=state, holders=holders, items_total=total,
                                items_done=0, reason="", deadline=deadline)

    @rule(i=st.integers(0, CAP - 1), room=ROOMS, use_model=st.booleans(),
          state=st.sampled_from(list(S)))
    def advance(self, i, room, use_model, state):
        slot, room = self._slot_room(i, room, use_model)
        m = self.model.get(slot)
        ok = self._holds(slot, room) and m["state"] in LIVE and state > m["state"]
        assert self.t.advance(slot, room, state) == ok
        if ok:
            m["state"] = state

    @rule(i=st.integers(0, CAP - 1), room=ROOMS, use_model=st.booleans(), bits=HOLDERS,
          take=st.booleans())
    def hold_or_unhold(self, i, room, use_model, bits, take):
        slot, room = self._slot_room(i, room, use_model)
        ok = self._holds(slot, room)  # concluded rooms too: custody outlives the room
        assert (self.t.hold if take else self.t.unhold)(slot, room, bits) == ok
        if ok:
            m = self.model[slot]
            m["holders"] = m["holders"] | bits if take else m["holders"] & ~bits

    @rule(i=st.integers(0, CAP - 1), room=ROOMS, use_model=st.booleans())
    def item_done(self, i, room, use_model):
        slot, room = self._slot_room(i, room, use_model)
        if not self._holds(slot, room):
            assert self.t.item_done(slot, room) == -1
            return
        m = self.model[slot]
        if m["state"] in LIVE:
            m["items_done"] += 1
        assert self.t.item_done(slot, room) == m["items_done"]

    @rule(i=st.integers(0, CAP - 1), room=ROOMS, use_model=st.booleans(), reason=TEXT,
          success=st.booleans())
    def conclude(self, i, room, use_model, reason, success):
        slot, room = self._slot_room(i, room, use_model)
        ok = self._holds(slot, room) and self.model[slot]["state"] in LIVE
        got = self.t.succeed(slot, room) if success else self.t.fail(slot, room, reason)
        assert got == ok
        if ok:
            m = self.model[slot]
            m["state"] = S.SUCCESS if success else S.FAILED
            m["reason"] = "" if success else room_record.cut(reason, 256).decode()

    @rule(i=st.integers(0, CAP - 1), room=ROOMS, use_model=st.booleans())
    def free(self, i, room, use_model):
        slot, room = self._slot_room(i, room, use_model)
        ok = self._holds(slot, room) and self.model[slot]["state"] in FINAL
        assert self.t.free(slot, room) == ok
        if ok:
            del self.model[slot]

    @precondition(lambda self: self.t is not None)
    @invariant()
    def agrees_with_model(self):
        t = self.t
        for slot in range(CAP):
            e = t.get(slot)
            m = self.model.get(slot)
            if m is None:
                assert e is None
                continue
            assert isinstance(e, RoomEntry) and e.slot == slot
            assert {k: getattr(e, k) for k in m} == m
            assert e.created > 0 and (e.concluded >= e.created) == (e.state in FINAL)
            assert (e.concluded == 0.0) == (e.state not in FINAL)
            assert t.find(m["room"]) == slot
        for room in (0, 1, 2, 3, 4, 5, 2**63, 2**64 - 1, 99):
            if not any(m["room"] == room for m in self.model.values()):
                assert t.find(room) is None
        assert [e.slot for e in t.entries()] == sorted(self.model)
        for bits in range(16):
            want = sorted(s for s, m in self.model.items() if m["holders"] & bits and m["state"] in LIVE)
            assert [e.slot for e in t.held_by(bits)] == want
            want = sorted(s for s, m in self.model.items()
                          if m["holders"] & bits and (m["state"] in LIVE or m["state"] == RoomState.FAILED))
            assert [e.slot for e in t.held_by(bits, failed_too=True)] == want
        assert t.repairs == 0

    def teardown(self):
        if self.t is not None:
            self.t.close()
            self.t.unlink()


def test_room_state_machine(shm_prefix):
    run_state_machine_as_test(lambda: RoomMachine(shm_prefix))


# -- a writer killed mid-update ------------------------------------------------------------

KCAP = 6
KROOMS = list(range(100, 100 + 2 * KCAP))
KILLS = 80


def _random_op(t: RoomTable, rng: random.Random) -> None:
    """One update chosen by ``rng``; what it does depends only on the table's logical state.

    Fields are tied to the room (request id, items_total, reason) so a reader can tell a
    torn entry from a whole one.
    """
    room = rng.choice(KROOMS)
    kind = rng.random()
    slot = t.find(room)
    if slot is None:
        if kind < 0.7:
            try:
                t.insert(room, f"q{room}" * (room % 7 + 1), room % 5 + 1, holders=room % 3,
                         deadline=float(room))
            except TableFull:
                pass
        return
    e = t.get(slot)
    if kind < 0.3:
        t.advance(slot, room, S(rng.randint(1, 6)))
    elif kind < 0.5:
        t.item_done(slot, room)
    elif kind < 0.6:
        (t.hold if rng.random() < 0.5 else t.unhold)(slot, room, 1 << rng.randint(0, 2))
    elif kind < 0.7:
        t.fail(slot, room, f"why{room}:{e.items_done}" * 40)
    elif kind < 0.8:
        t.succeed(slot, room)
    else:
        t.free(slot, room)


def _check_whole(e: RoomEntry) -> None:
    """The invariants _random_op keeps within one entry."""
    r = e.room
    assert r in KROOMS, e
    assert e.request_id == f"q{r}" * (r % 7 + 1) and e.items_total == r % 5 + 1, e
    assert e.deadline == float(r), e
    if e.state == S.FAILED and e.reason:
        assert e.reason.startswith(f"why{r}:{e.items_done}") and e.reason.endswith("…"), e
    elif e.reason:
        assert e.state == S.FAILED, e


def _logical(t: RoomTable, check: bool = True):
    """The table's rooms without timestamps, by room (which FREE slot an insert takes depends on
    the table's free-slot cursor, not only on its rooms); every active record must be whole."""
    out = []
    for slot in range(t.capacity):
        if check:
            _, f = t._load(slot)  # lock-free, no repair: a torn record shows as None
            assert f is not None, f"slot {slot} reads torn"
        e = t.get(slot)
        if e is not None:
            out.append((e.room, e.request_id, e.state, e.holders, e.items_total, e.items_done, e.reason,
                        e.deadline))
            assert t.find(e.room) == slot, f"room {e.room} in slot {slot} is not found"
    return sorted(out)


def _inactive(t: RoomTable) -> dict[tuple[int, int], bytes]:
    """(slot, seq) -> the inactive copy's bytes."""
    out = {}
    for slot in range(t.capacity):
        seq = t._seqv[slot]
        off = t._rec0 + (2 * slot + ((seq + 1) & 1)) * room_record.RECORD_BYTES
        out[slot, seq] = t._mv[off:off + room_record.RECORD_BYTES].tobytes()
    return out


def _unpublished(t: RoomTable, before: dict) -> bool:
    """Since ``before``, some inactive copy was (partly) rewritten but not published."""
    return any(raw != before.get(key) and room_record.verify(raw, (key[1] - 1) & 0xFFFFFFFF) is None
               for key, raw in _inactive(t).items())


def _writer(prefix, run_id, seed, ready_fd, limit):
    t = RoomTable.attach(prefix, run_id, "rooms")
    rng = random.Random(seed)
    os.write(ready_fd, b"r")
    for _ in range(limit):
        _random_op(t, rng)
    while True:  # done: wait for the kill
        time.sleep(1)


@pytest.mark.timeout(120)
def test_writer_killed_mid_update_loop(make_table, shm_prefix):
    """A writer SIGKILLed at random moments: readers never see a torn entry, and afterwards
    the table is exactly the state before or after the update in flight (found by replaying
    the writer's seeded updates on a second table)."""
    seed = int(os.environ.get("ROOMS_KILL_SEED", random.randrange(2**32)))
    print(f"ROOMS_KILL_SEED={seed}")
    rng = random.Random(seed)
    t = make_table(KCAP, "rooms")
    replica = make_table(KCAP, "replica")
    limit = 3000
    r, w = os.pipe()
    mid_update = replayed = 0
    try:
        for k in range(KILLS):
            child_seed = rng.randrange(2**32)
            before = _inactive(t)
            pid = fork_call(_writer, shm_prefix, t.run_id, child_seed, w, limit)
            assert os.read(r, 1) == b"r"
            end = time.monotonic() + rng.uniform(0, 0.004)
            while time.monotonic() < end:  # read while it writes
                for e in t.entries():
                    _check_whole(e)
            # Half the kills land anywhere; half are aimed: the writer is frozen (SIGSTOP)
            # at random moments until it is caught between writing a copy and publishing it.
            for _ in range(300 if k % 2 else 0):
                os.kill(pid, signal.SIGSTOP)
                _, status = os.waitpid(pid, os.WUNTRACED)
                assert os.WIFSTOPPED(status), "writer ended early"
                if _unpublished(t, before):
                    break
                os.kill(pid, signal.SIGCONT)
                time.sleep(rng.uniform(0, 0.0003))
            os.kill(pid, signal.SIGKILL)
            assert wait_child(pid) == -signal.SIGKILL
            mid_update += _unpublished(t, before)
            got = _logical(t)
            for e in t.entries():
                _check_whole(e)
            # Replay the same updates until the replica matches.
            replay = random.Random(child_seed)
            now, steps = _logical(replica, False), 0
            while now != got and steps < limit:
                _random_op(replica, replay)
                now, steps = _logical(replica, False), steps + 1
            replayed += steps
            assert now == got, (
                f"table after the kill matches no prefix of the writer's updates (seed {child_seed})")
            # The lock died with the writer: updating goes on.
            probe = t.find(KROOMS[0])
            if probe is not None:
                t.item_done(probe, KROOMS[0])
                replica.item_done(replica.find(KROOMS[0]), KROOMS[0])
            assert _logical(t) == _logical(replica)
    finally:
        os.close(r)
        os.close(w)
    print(f"kills={KILLS} updates_replayed={replayed} died_between_write_and_publish={mid_update}")
    assert t.repairs == 0  # a killed writer never damages the active copy


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", ["rooms.body", "rooms.crc"])
def test_writer_killed_at_each_point_leaves_old_value(make_table, point):
    t = make_table(2)
    slot = t.insert(5, "q5", 2, 1)
    before = t.get(slot)

    def child():
        def die(p):
            if p == point:
                os.kill(os.getpid(), signal.SIGKILL)
        rooms_mod._fault_hook = die
        t.fail(slot, 5, "never")  # the inherited object: the fork re-opened its lock
        raise AssertionError("fault point not reached")

    assert wait_child(fork_call(child)) == -signal.SIGKILL
    seq = t._seqv[slot]
    off = t._rec0 + (2 * slot + ((seq + 1) & 1)) * room_record.RECORD_BYTES
    inactive = t._mv[off:off + room_record.RECORD_BYTES].tobytes()
    assert (room_record.verify(inactive, (seq + 1) & 0xFFFFFFFF) is None) == (point == "rooms.body")
    assert t.get(slot) == before  # the update did not happen
    assert t.fail(slot, 5, "now") and t.get(slot).reason == "now"
    assert t.repairs == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["insert", "free"])
def test_writer_killed_while_changing_the_index(make_table, op):
    """A writer SIGKILLed between a record and its index entry: readers still find every
    room (they scan while the index is marked in change), and the next writer rebuilds it."""
    t = make_table(8)
    rooms = {r: t.insert(r, f"q{r}", 1, 0) for r in (7, 8, 2**64 - 1)}
    t.succeed(rooms[8], 8)

    def child():
        def die(p):
            if p == "rooms.index":
                os.kill(os.getpid(), signal.SIGKILL)
        rooms_mod._fault_hook = die
        t.insert(9, "q9", 1, 0) if op == "insert" else t.free(rooms[8], 8)
        raise AssertionError("fault point not reached")

    assert wait_child(fork_call(child)) == -signal.SIGKILL
    if op == "insert":  # the record was published: the room is there
        rooms[9] = t.find(9)
        assert rooms[9] is not None and t.get(rooms[9]).request_id == "q9"
    # (free: killed before its record changed, so the tombstone is still there)
    for r, slot in rooms.items():
        assert t.find(r) == slot
    assert t._room_index.dirty  # marked in change: readers scanned
    new = t.insert(10, "q10", 1, 0)  # rebuilds the index first
    assert not t._room_index.dirty
    rooms[10] = new
    for r, slot in rooms.items():
        assert t._room_index.slot_of(r) == slot and t.find(r) == slot
    with pytest.raises(ValueError):
        t.insert(7, "again", 1, 0)
    assert t.free(rooms[8], 8) and t.find(8) is None


def test_free_slots_are_found_from_the_cursor_across_chunks(make_table):
    """A table larger than one chunk of the FREE-slot search: filled, TableFull, freed in
    random places, refilled into exactly those places; the index finds every room."""
    cap = 2 * rooms_mod._FREE_CHUNK + 500
    t = make_table(cap)
    rng = random.Random(5)
    ids = list(dict.fromkeys(rng.getrandbits(64) for _ in range(cap + 400)))[:cap + 300]
    where = {r: t.insert(r, "q", 1, 0) for r in ids[:cap]}
    assert sorted(where.values()) == list(range(cap))
    with pytest.raises(TableFull):
        t.insert(ids[cap], "q", 1, 0)
    gone = rng.sample(ids[:cap], 300)
    for r in gone:
        assert t.succeed(where[r], r) and t.free(where[r], r)
        assert t.find(r) is None
    freed = sorted(where.pop(r) for r in gone)
    new = {r: t.insert(r, "q", 1, 0) for r in ids[cap:]}
    assert sorted(new.values()) == freed
    where.update(new)
    with pytest.raises(TableFull):
        t.insert(gone[0], "q", 1, 0)  # a freed id, but the table is full again
    for r, slot in where.items():
        assert t.find(r) == slot
    assert t.find(gone[0]) is None


def test_complete_item_counts_and_concludes_in_one_update(make_table):
    t = make_table(4)
    slot = t.insert(7, "q7", 3, 0)
    assert t.complete_item(slot, 7, 1) == (1, False)
    assert t.complete_item(slot, 7, 1) == (1, False)  # a report handled again counts nothing
    assert t.complete_item(slot, 8, 2) == (-1, False)  # not that slot's room
    assert t.complete_item(slot, 7, 3) == (3, True)
    e = t.get(slot)
    assert (e.state, e.items_done) == (S.SUCCESS, 3) and e.concluded >= e.created
    assert t.complete_item(slot, 7, 3) == (3, False)  # concluded: final, and not concluded again
    # A writer that counted the last item but died before the room's success: the same
    # report, handled again, concludes it.
    other = t.insert(9, "q9", 2, 0)
    assert t.item_done(other, 9, 2) == 2 and t.get(other).state == S.BOOTSTRAPPING
    assert t.complete_item(other, 9, 2) == (2, True) and t.get(other).state == S.SUCCESS
    failed = t.insert(10, "q10", 1, 0)
    assert t.fail(failed, 10, "gone")
    assert t.complete_item(failed, 10, 1) == (0, False) and t.get(failed).state == S.FAILED


def test_a_room_keeps_its_keys_and_is_claimed_once_while_live(make_table):
    """(#32) The key tags a room belongs to stay with it through every update; a room whose
    gateway named no receiver is claimed by the first other key, once, and only while
    live; a room that named its receivers, or has no gateway key (no CURVE), never is."""
    t = make_table(8)
    gw, rx, thief = 11, 22, 33
    open_ = t.insert(1, "open", 1, 0, keys=(gw,))
    named = t.insert(2, "named", 1, 0, keys=(gw, rx))
    plain = t.insert(3, "plain", 1, 0)
    assert t.get(open_).keys == (gw,) + (0,) * 7 and t.get(plain).keys == (0,) * 8
    assert t.claim(open_, 1, rx) == (gw, rx) + (0,) * 6
    assert t.claim(open_, 1, thief) == (gw, rx) + (0,) * 6, "claimed once"
    assert t.claim(named, 2, thief) == (gw, rx) + (0,) * 6 and t.claim(plain, 3, thief) == (0,) * 8
    assert t.claim(open_, 99, thief) is None, "not that slot's room"
    late = t.insert(4, "late", 1, 0, keys=(gw,))
    assert t.fail(late, 4, "gone") and t.claim(late, 4, thief) == (gw,) + (0,) * 7, "concluded: nobody's to claim"
    t.advance(open_, 1, S.TRANSFERRING)
    assert t.complete_item(open_, 1, 1) == (1, True)
    assert t.get(open_).keys == (gw, rx) + (0,) * 6, "kept past its conclusion (a tombstone's)"
    with pytest.raises(ValueError, match="at most 8 keys"):
        t.insert(5, "many", 1, 0, keys=tuple(range(1, 10)))
    assert room_record.ROOM_KEYS == 1 + wire.MAX_ROOM_RECEIVERS, "a gateway's key and every receiver's it may name"
