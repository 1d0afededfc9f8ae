"""ipc.shared_table, the base of every table; ipc.receivers and ipc.told: state that
outlives a stage, whole after a writer killed anywhere."""
from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import pytest

from ipc import receivers as receivers_mod
from ipc import shm
from ipc import told as told_mod
from ipc.shared_table import SharedTable, lay_out
from ipc.receivers import KEY_CHARS, ReceiverTable, TableFull, registration_row
from ipc.told import ToldTable
from ipc.wire import MAX_ID_CHARS
from tests.helpers import fork_call, wait_child


@pytest.fixture
def make(shm_prefix):
    made = []

    def make(cls, *args):
        run_id = shm.new_run_id()
        t = cls.create(shm_prefix, run_id, "t", *args)
        t.run_id = run_id
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()
        t.unlink()


# -- the base ---------------------------------------------------------------------------


class Pairs(SharedTable):
    """A table for the base's tests: `count` u64 pairs, the second of each formatted to 7."""

    MAGIC = 0x7372_6961_7000_0001
    KIND = "pair table"
    GEOMETRY = ("count", "width")
    fail_format = False

    @classmethod
    def segment_size(cls, count: int, width: int) -> int:
        if not 1 <= count <= 1000 or width != 16:
            raise ValueError(f"pair table count {count} or width {width} out of range")
        return lay_out([("pairs", width * count)])["total"]

    @classmethod
    def format(cls, buf, count, width):
        if cls.fail_format:
            raise RuntimeError("format failed")
        at = lay_out([("pairs", width * count)])["pairs"]
        buf[at:at + width * count] = (bytes(8) + (7).to_bytes(8, "little")) * count

    def __init__(self, seg):
        super().__init__(seg)
        at = lay_out([("pairs", self.width * self.count)])["pairs"]
        self.pairs = np.frombuffer(self.buf.obj, np.uint64, 2 * self.count, at).reshape(self.count, 2)
        self.words = self.buf[:64].cast("Q")


def test_a_table_is_created_attached_and_closed_with_its_geometry(shm_prefix):
    run_id = shm.new_run_id()
    t = Pairs.create(shm_prefix, run_id, "pairs", 3, 16)
    try:
        assert (t.count, t.width) == (3, 16) and t.pairs[:, 1].tolist() == [7, 7, 7]
        t.pairs[2, 0] = 5
        with Pairs.attach(shm_prefix, run_id, "pairs") as other:
            assert other.pairs[2].tolist() == [5, 7] and repr(other).endswith("count=3, width=16)")
        assert other.closed and other.pairs is None
        with pytest.raises(ValueError):
            other.words[0]  # released: a use after close fails loudly
        other.close()  # twice is harmless
        with pytest.raises(ValueError, match="out of range"):
            Pairs.create(shm_prefix, run_id, "big", 1001, 16)
        with pytest.raises(TypeError):
            Pairs.create(shm_prefix, run_id, "short", 3)
        Pairs.fail_format = True
        try:
            with pytest.raises(RuntimeError, match="format failed"):
                Pairs.create(shm_prefix, run_id, "failed", 3, 16)  # unlinked again: the fixture checks
        finally:
            Pairs.fail_format = False
    finally:
        t.close()
        t.unlink()
    with pytest.raises(shm.ShmError, match="does not exist"):
        Pairs.attach(shm_prefix, run_id, "pairs")


def test_attach_refuses_what_is_not_a_whole_table_of_its_kind(shm_prefix):
    run_id = shm.new_run_id()
    t = Pairs.create(shm_prefix, run_id, "pairs", 3, 16)
    name = t.segment.name
    try:
        magic = t.words[0]
        t.words[0] = 0  # as if its creator died before the magic: half-made
        with pytest.raises(shm.ShmError, match="not an initialised pair table .bad magic"):
            Pairs.attach(shm_prefix, run_id, "pairs")
        t.words[0] = magic
        t.words[1] = 4  # a count its size does not fit
        with pytest.raises(shm.ShmError, match="geometry .*disagree"):
            Pairs.attach(shm_prefix, run_id, "pairs")
        t.words[1] = 3
        told = ToldTable.create(shm_prefix, run_id, "told", 4, 8)
        try:
            with pytest.raises(shm.ShmError, match="not an initialised told table"):
                ToldTable.attach(shm_prefix, run_id, "pairs")  # another kind
            with pytest.raises(shm.ShmError, match="not an initialised pair table"):
                Pairs.attach(shm_prefix, run_id, "told")
        finally:
            told.close()
            told.unlink()
        small = shm.Segment.create(shm.object_name(shm_prefix, run_id, "small"), 16)
        try:
            with pytest.raises(shm.ShmError, match="too small"):
                Pairs.attach(shm_prefix, run_id, "small")
        finally:
            small.close()
            small.unlink()
        with Pairs.attach(shm_prefix, run_id, "pairs") as whole:
            assert whole.count == 3
    finally:
        t.close()
        t.unlink()
    assert name not in shm.list_objects(shm_prefix)


# -- receivers -------------------------------------------------------------------------


def test_registrations_are_replaced_and_read_back_by_another_process_view(make, shm_prefix):
    t = make(ReceiverTable, 3)
    t.put("rx-0", "host:1", "tcp://h:1")
    t.put("rx-1", "host:2", "tcp://h:2")
    t.put("rx-0", "host:3", "tcp://h:3")  # a restarted receiver: the spare slot, then the old one freed
    other = ReceiverTable.attach(shm_prefix, t.run_id, "t", readonly=True)
    try:
        assert other.load() == {"rx-0": ("host:3", "tcp://h:3", ""), "rx-1": ("host:2", "tcp://h:2", "")}
    finally:
        other.close()
    t.put("rx-2", "host:4", "tcp://h:4")
    with pytest.raises(TableFull):
        t.put("rx-3", "host:5", "tcp://h:5")
    longest = "é" * MAX_ID_CHARS  # two UTF-8 bytes each; four-byte characters fit too
    t2 = make(ReceiverTable, 2)
    t2.put(longest, "🙂" * MAX_ID_CHARS, "ipc://x")
    assert t2.load() == {longest: ("🙂" * MAX_ID_CHARS, "ipc://x", "")}


def test_a_writer_killed_between_publishing_and_freeing_leaves_the_newer_registration(make, shm_prefix):
    t = make(ReceiverTable, 3)
    t.put("rx", "old:1", "tcp://old:1")

    def child():
        def die(point):
            if point == "receivers.published":
                os.kill(os.getpid(), signal.SIGKILL)
        receivers_mod._fault_hook = die
        t.put("rx", "new:1", "tcp://new:1")

    assert wait_child(fork_call(child)) == -signal.SIGKILL
    successor = ReceiverTable.attach(shm_prefix, t.run_id, "t")
    try:
        assert successor.load() == {"rx": ("new:1", "tcp://new:1", "")}
        successor.put("rx-2", "b:1", "tcp://b:1")  # frees the stale copy first: room for both
        assert successor.load() == {"rx": ("new:1", "tcp://new:1", ""), "rx-2": ("b:1", "tcp://b:1", "")}
    finally:
        successor.close()


def test_a_torn_row_is_never_read_as_a_registration(make, shm_prefix):
    """What a weakly ordered CPU may show a reader of a slot being reused: the new
    generation before the body it publishes, or part of the new body under the old
    generation. Neither is read as a registration; the row once whole is."""
    t = make(ReceiverTable, 4)
    t.put("rx", "old:1", "tcp://old:1")
    reader = ReceiverTable.attach(shm_prefix, t.run_id, "t", readonly=True)
    try:
        slot = t._slot_of["rx"]
        gen = int(t._genv[slot])
        at = t.slots_at + slot * receivers_mod._SLOT
        new = registration_row(gen + 1, "rx", "new:2", "tcp://new:2")
        t._genv[slot] = gen + 1  # the new generation, over the old row
        assert reader.load() == {}
        t._genv[slot] = gen
        half = 10 + 4 * MAX_ID_CHARS + 2  # into the session field
        t.buf[at + 4:at + half] = new[4:half]  # part of the new body, under the old generation
        assert reader.load() == {}
        t.buf[at:at + len(new)] = new  # the rest, then the generation: whole
        t._genv[slot] = gen + 1
        assert reader.load() == {"rx": ("new:2", "tcp://new:2", "")}
        t.buf[at + 100] ^= 1  # damage: skipped by any reader, freed by the writer
        assert reader.load() == {}
        assert t.load() == {}
        t.put("rx-2", "b:1", "tcp://b:1")
        assert t.load() == {"rx-2": ("b:1", "tcp://b:1", "")} and np.count_nonzero(t.generations) == 1, "freed"
    finally:
        reader.close()


def test_a_reader_racing_the_writer_sees_each_registration_old_or_new(make, shm_prefix):
    """A reader that reads at every point inside a write (the writer paused there)
    sees the registrations before it or after it, never a mix."""
    t = make(ReceiverTable, 3)
    reader = ReceiverTable.attach(shm_prefix, t.run_id, "t", readonly=True)
    seen = []
    receivers_mod._fault_hook = lambda point: seen.append((point, reader.load()))
    try:
        t.put("rx", "a:1", "tcp://a:1")
        t.put("rx", "b:2", "tcp://b:2", key="K" * KEY_CHARS)  # a CurveZMQ key goes with it
        t.put("ry", "c:3", "tcp://c:3")
    finally:
        receivers_mod._fault_hook = None
        reader.close()
    a, b = {"rx": ("a:1", "tcp://a:1", "")}, {"rx": ("b:2", "tcp://b:2", "K" * KEY_CHARS)}
    assert seen == [("receivers.body", {}), ("receivers.published", a),
                    ("receivers.body", a), ("receivers.published", b),
                    ("receivers.body", b), ("receivers.published", {**b, "ry": ("c:3", "tcp://c:3", "")})]


def _registration_ops(seed: int, n: int):
    rng = random.Random(seed)
    for k in range(n):
        rx = f"rx-{rng.randrange(6)}"
        yield rx, f"host-{k}:{rng.randrange(1 << 16)}", f"tcp://h{k}:{rng.randrange(1, 1 << 16)}"


LIMIT = 3000  # writes a writer makes before it waits for its kill: the replay stays bounded


def _register(prefix: str, run_id: str, seed: int, ready_fd: int) -> None:
    t = ReceiverTable.attach(prefix, run_id, "t")
    os.write(ready_fd, b"r")
    for op in _registration_ops(seed, LIMIT):
        t.put(*op)
    while True:
        time.sleep(1)


@pytest.mark.timeout(120)
def test_receiver_table_writer_killed_at_random_moments(make, shm_prefix):
    """Readers see each registration whole while the writer runs, and after a SIGKILL the
    table is the state after some prefix of the writer's registrations."""
    seed = int(os.environ.get("TABLES_KILL_SEED", random.randrange(2**32)))
    print(f"TABLES_KILL_SEED={seed}")
    rng = random.Random(seed)
    t = make(ReceiverTable, 8)
    r, w = os.pipe()
    replayed = 0
    try:
        for _ in range(30):
            before = t.load()
            child_seed = rng.randrange(2**32)
            pid = fork_call(_register, shm_prefix, t.run_id, child_seed, w)
            try:
                assert os.read(r, 1) == b"r"
                end = time.monotonic() + rng.uniform(0, 0.01)
                while time.monotonic() < end:
                    for rx, (session, status, _) in t.load().items():  # whole: the fields agree
                        k = session.split("-")[1].split(":")[0]
                        assert status.startswith(f"tcp://h{k}:"), (rx, session, status)
            finally:
                os.kill(pid, signal.SIGKILL)
                assert wait_child(pid) == -signal.SIGKILL
            got = ReceiverTable.attach(shm_prefix, t.run_id, "t")
            try:
                after = got.load()
                state, ops = dict(before), _registration_ops(child_seed, LIMIT)
                for rx, session, status in ops:
                    if state == after:
                        break
                    state[rx] = (session, status, "")
                    replayed += 1
                assert state == after, f"the table matches no prefix of the writer's registrations ({child_seed})"
            finally:
                got.close()
    finally:
        os.close(r)
        os.close(w)
    assert replayed, "the writer never got to write"


# -- told ------------------------------------------------------------------------------


def test_told_records_and_forgets(make, shm_prefix):
    t = make(ToldTable, 3, 16)
    assert t.record_success(7, 0, "rx", 1.0) and t.record_success(7, 9, "rx", 2.0)
    assert t.record_failed(7, "ry", 3.0) and t.record_failed(7, "rx", 4.0)
    assert t.told_success(7, 9, "rx") and not t.told_success(7, 1, "rx") and not t.told_success(7, 9, "ry")
    assert t.told_failed(7, "rx") and t.told_failed(7, "ry") and t.told_anything(7, "ry")
    assert not t.told_anything(8, "rx") and not t.record_success(7, 16, "rx", 5.0)  # beyond max_items
    assert t.record_failed(8, "rx", 5.0)
    assert not t.record_failed(9, "rx", 6.0), "full: the caller counts an unrecorded status"
    successor = ToldTable.attach(shm_prefix, t.run_id, "t")
    try:
        assert successor.rooms() == {7: 1.0, 8: 5.0}
        assert successor.told_success(7, 9, "rx") and successor.told_failed(7, "ry")
        view = ToldTable.attach(shm_prefix, t.run_id, "t")  # another process's reading, no index
        try:
            assert view.recorded(7, ["rx"]) == (True, {0, 9})
            assert view.recorded(7, ["ry", "nobody"]) == (True, set())
            assert view.recorded(7, ["nobody"]) == (False, set()) and view.recorded(6, ["rx"]) == (False, set())
        finally:
            view.close()
        successor.forget(7)
        assert not successor.told_anything(7, "rx") and successor.used() == 1
        assert successor.record_failed(9, "rx", 6.0) and successor.record_failed(10, "rx", 7.0)
    finally:
        successor.close()


def _told_ops(seed: int, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        room, rx = rng.randrange(5), f"rx-{rng.randrange(3)}"
        kind = rng.random()
        if kind < 0.15:
            yield "forget", room, None, rx
        elif kind < 0.5:
            yield "failed", room, None, rx
        else:
            yield "success", room, rng.randrange(12), rx


def _apply(state: dict, op) -> None:
    kind, room, item, rx = op
    if kind == "forget":
        for key in [k for k in state if k[0] == room]:
            del state[key]
    elif kind == "failed":
        state.setdefault((room, rx), [False, set()])[0] = True
    else:
        state.setdefault((room, rx), [False, set()])[1].add(item)


def _do(t: ToldTable, op) -> None:
    kind, room, item, rx = op
    if kind == "forget":
        t.forget(room)
    elif kind == "failed":
        t.record_failed(room, rx, 1.0)
    else:
        t.record_success(room, item, rx, 1.0)


def _partly_forgotten(state: dict, after: dict, room) -> bool:
    """`after` is `state` with some of `room`'s entries freed: a writer killed inside
    forget(room), which frees them one by one (each alone is whole; the rest go when the
    successor frees that tombstone again)."""
    rest = {k: v for k, v in state.items() if k[0] != room}
    return rest == {k: v for k, v in after.items() if k[0] != room} and \
        all(state.get(k) == v for k, v in after.items() if k[0] == room)


def _logical(t: ToldTable) -> dict:
    state = {}
    for room in t.rooms():
        for rx in (f"rx-{k}" for k in range(3)):
            if t.told_anything(room, rx):
                state[(room, rx)] = [t.told_failed(room, rx), {i for i in range(12) if t.told_success(room, i, rx)}]
    return state


def _tell(prefix: str, run_id: str, seed: int, ready_fd: int) -> None:
    t = ToldTable.attach(prefix, run_id, "t")
    os.write(ready_fd, b"r")
    for op in _told_ops(seed, LIMIT):
        _do(t, op)
    while True:
        time.sleep(1)


@pytest.mark.timeout(120)
def test_told_table_writer_killed_at_random_moments(make, shm_prefix):
    """After a SIGKILL anywhere, a successor's view is the state after some prefix of the
    writer's records and forgets: never half an entry."""
    seed = int(os.environ.get("TABLES_KILL_SEED", random.randrange(2**32)))
    print(f"TABLES_KILL_SEED={seed}")
    rng = random.Random(seed)
    t = make(ToldTable, 64, 12)
    r, w = os.pipe()
    replayed = 0
    try:
        for _ in range(30):
            view = ToldTable.attach(shm_prefix, t.run_id, "t")
            before = _logical(view)
            view.close()
            child_seed = rng.randrange(2**32)
            pid = fork_call(_tell, shm_prefix, t.run_id, child_seed, w)
            try:
                assert os.read(r, 1) == b"r"
                time.sleep(rng.uniform(0, 0.01))
            finally:
                os.kill(pid, signal.SIGKILL)
                assert wait_child(pid) == -signal.SIGKILL
            view = ToldTable.attach(shm_prefix, t.run_id, "t")
            try:
                after = _logical(view)
                state = {k: [v[0], set(v[1])] for k, v in before.items()}
                matched = state == after
                for op in _told_ops(child_seed, LIMIT):
                    matched = state == after or op[0] == "forget" and _partly_forgotten(state, after, op[1])
                    if matched:
                        break
                    _apply(state, op)
                    replayed += 1
                assert matched or state == after, f"the table matches no prefix of the writer's records ({child_seed})"
                assert view.used() == sum(1 for _ in after), "an entry published but not in the view"
            finally:
                view.close()
    finally:
        os.close(r)
        os.close(w)
    assert replayed, "the writer never got to write"


@pytest.mark.timeout(60)
def test_a_told_writer_killed_before_publishing_leaves_nothing(make, shm_prefix):
    t = make(ToldTable, 4, 8)

    def child():
        def die(point):
            if point == "told.body":
                os.kill(os.getpid(), signal.SIGKILL)
        told_mod._fault_hook = die
        t.record_failed(5, "rx", 1.0)

    assert wait_child(fork_call(child)) == -signal.SIGKILL
    view = ToldTable.attach(shm_prefix, t.run_id, "t")
    try:
        assert view.rooms() == {} and view.used() == 0
    finally:
        view.close()
