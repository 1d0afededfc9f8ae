"""ipc.ring: model-based tests against a deque, crash points, sleepers and wake-ups.

No test asserts a timing: timeouts only bound how long a test can wait.
"""
from __future__ import annotations

import array
import os
import threading
from collections import deque

import pytest
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ipc import framing
from ipc import ring as ring_mod
from ipc import shm
from ipc.ring import RECORD_HEADER, RecordTooLarge, Ring, RingError, wait_any

H = RECORD_HEADER


def _rec(tag: int, size: int) -> bytes:
    return (tag.to_bytes(4, "little") * (size // 4 + 1))[:size]


def _footprint(records) -> int:
    return sum(H + len(r) for r in records)


def take(r: Ring, max_records: int = 1024, timeout: float | None = 0.0) -> list[bytes]:
    """Consume up to ``max_records`` oldest records: peek them, then release them all."""
    recs, end = r.peek_batch(max_records, timeout)
    r.release(end)
    return recs


def take_one(r: Ring, timeout: float | None = 0.0) -> bytes | None:
    """Consume the oldest record (None if none came within ``timeout``) with release_one."""
    recs, _ = r.peek_batch(1, timeout)
    if not recs:
        return None
    r.release_one()
    return recs[0]


@pytest.fixture
def make_ring(shm_prefix):
    """Ring factory; unlinks (and closes) everything it made."""
    made = []

    def make(capacity: int, what: str = "r") -> Ring:
        r = Ring.create(shm_prefix, shm.new_run_id(), what, capacity)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()
        r.unlink()


def _attach_like(r: Ring) -> Ring:
    _, prefix, run_id, what = _split(r.name)
    return Ring.attach(prefix, run_id, what)


def _split(name: str):
    prefix, run_id, what = shm.parse_name(name)
    return name, prefix, run_id, what


# --- the model-based state machine ----------------------------------------------------------
SIZES = st.one_of(st.integers(0, 8), st.integers(0, 300), st.sampled_from(["max", "too big"]))


class RingMachine(RuleBasedStateMachine):
    """One ring, a producer handle and a separate consumer handle, against a deque.

    The crash rules stop a producer or consumer at each step of its publish / release
    sequence (as a SIGKILL there would) and start a successor on a fresh handle.
    """

    prefix = "unset"
    exact = True  # batch pops return min(max_records, depth) records (no parse limit hit)

    def __init__(self):
        super().__init__()
        self.ring = self.prod = self.cons = None
        self.model: deque[bytes] = deque()
        self.tag = 0

    @initialize(capacity=st.sampled_from([16, 23, 64, 100, 257, 1000]))
    def setup(self, capacity):
        self.ring = Ring.create(self.prefix, shm.new_run_id(), "sm", capacity)
        self.prod = self.ring
        self.cons = _attach_like(self.ring)
        assert self.ring.max_record == capacity - H

    def teardown(self):
        if self.ring is not None:
            for handle in {id(h): h for h in (self.ring, self.prod, self.cons)}.values():
                handle.close()
            self.ring.unlink()

    # helpers
    def size(self, s) -> int:
        if s == "max":
            return self.prod.max_record
        if s == "too big":
            return self.prod.max_record + 1
        return s

    def new_record(self, s) -> bytes:
        self.tag += 1
        return _rec(self.tag, self.size(s))

    def used(self) -> int:
        return _footprint(self.model)

    def fits(self, records) -> int:
        free = self.prod.capacity - self.used()
        k = 0
        for r in records:
            if H + len(r) > free:
                break
            free -= H + len(r)
            k += 1
        return k

    # producer rules
    @rule(s=SIZES)
    def push(self, s):
        rec = self.new_record(s)
        if len(rec) > self.prod.max_record:
            with pytest.raises(RecordTooLarge):
                self.prod.push(rec)
            return
        expected = self.fits([rec]) == 1
        assert self.prod.push(rec) is expected
        if expected:
            self.model.append(rec)

    @rule(sizes=st.lists(SIZES, max_size=8), kind=st.sampled_from(["bytes", "bytearray", "memoryview"]))
    def push_batch(self, sizes, kind):
        recs = [self.new_record(s) for s in sizes]
        conv = {"bytes": bytes, "bytearray": bytearray, "memoryview": memoryview}[kind]
        head = self.prod.head
        if any(len(r) > self.prod.max_record for r in recs):
            with pytest.raises(RecordTooLarge):
                self.prod.push_batch([conv(r) for r in recs])
            assert self.prod.head == head  # nothing pushed
            return
        k = self.fits(recs)
        assert self.prod.push_batch([conv(r) for r in recs]) == k
        self.model.extend(recs[:k])
        assert self.prod.head == head + _footprint(recs[:k])

    @rule()
    def push_full_with_timeout(self):
        """A record that does not fit: a short blocking push gives up, overwrites nothing."""
        free = self.prod.capacity - self.used()
        if free > self.prod.max_record:
            return
        rec = self.new_record(max(free - H + 1, 0))
        assert self.prod.push(rec, timeout=0.001) is False
        assert self.prod.push_batch([rec], timeout=0.001) == 0

    # consumer rules
    @rule()
    def take_one(self):
        expected = self.model.popleft() if self.model else None
        assert take_one(self.cons) == expected

    def parsed_earlier(self) -> int | None:
        """How many records an earlier peek parsed that the consumer has not given back
        yet, if any: a peek then serves those alone, not what arrived after them."""
        c = self.cons
        return len(c._rd_recs) - c._rd_i if c._rd_at == c.tail else None

    def check_batch(self, got, m, parsed):
        """``got`` is a non-empty prefix of the model of at most ``m`` records (exactly
        ``m``, or all of them, or all ``parsed`` earlier, unless a parse limit cut the
        batch short)."""
        expected = list(self.model)[:m if parsed is None else min(m, parsed)]
        if self.exact or not expected:
            assert got == expected
        else:
            assert 1 <= len(got) <= m and got == expected[: len(got)]

    @rule(m=st.integers(1, 10))
    def take(self, m):
        parsed = self.parsed_earlier()
        got = take(self.cons, m)
        self.check_batch(got, m, parsed)
        for _ in got:
            self.model.popleft()

    @rule(m=st.integers(1, 10), j=st.integers(0, 10), same_handle=st.booleans())
    def peek_then_release_one_at_a_time(self, m, j, same_handle):
        parsed = self.parsed_earlier()
        recs, _ = self.cons.peek_batch(m)
        self.check_batch(recs, m, parsed)
        if not same_handle:  # a successor gives back what its predecessor had peeked
            self.cons.close()
            self.cons = _attach_like(self.ring)
        for _ in range(min(j, len(recs))):
            tail = self.cons.tail
            self.cons.release_one()
            assert self.cons.tail == tail + H + len(self.model.popleft())
        if not self.model:
            with pytest.raises(RingError, match="holds no record"):
                self.cons.release_one()

    @rule(m=st.integers(1, 10), j=st.integers(0, 10), same_handle=st.booleans())
    def peek_then_release(self, m, j, same_handle):
        tail, parsed = self.cons.tail, self.parsed_earlier()
        recs, end = self.cons.peek_batch(m)
        self.check_batch(recs, m, parsed)
        assert end == tail + _footprint(recs)
        assert self.cons.peek_batch(m) == (recs, end)  # peeking consumes nothing
        j = min(j, len(recs))
        if not same_handle:  # a successor releases what its predecessor logged
            self.cons.close()
            self.cons = _attach_like(self.ring)
        self.cons.release(end if j == len(recs) else tail + _footprint(recs[:j]))
        for _ in range(j):
            self.model.popleft()

    @rule(m=st.integers(1, 10), bad=st.sampled_from(["past head", "before tail", "mid record"]))
    def bad_release(self, m, bad):
        tail = self.cons.tail
        if bad == "past head":
            end = self.cons.head + 1
        elif bad == "before tail":
            if tail == 0:
                return
            end = tail - 1
        else:
            if not self.model:
                return
            end = tail + 1  # inside the first record's header
        with pytest.raises(RingError):
            self.cons.release(end)

    @rule()
    @precondition(lambda self: self.ring is not None and not self.model)
    def blocking_pop_on_empty(self):
        self.cons._data_sem.release()  # an extra post must not make a record
        assert take_one(self.cons, timeout=0.001) is None
        assert take(self.cons, timeout=0.001) == []
        assert self.cons.peek_batch(timeout=0.001) == ([], self.cons.tail)

    @rule(n=st.integers(1, 3))
    def extra_posts(self, n):
        for _ in range(n):
            self.prod._data_sem.release()
            self.prod._space_sem.release()

    # crashes and successors
    @rule(s=SIZES, step=st.sampled_from(["payload", "repair", "pend_head", "pend_pushed", "head"]))
    def producer_killed_in_push(self, s, step):
        """Do the stores push does, in its order, up to ``step`` (as if SIGKILLed right
        after it), then restart the producer."""
        rec = self.new_record(s)
        if len(rec) > self.prod.max_record or self.fits([rec]) == 0:
            return
        q, head = self.prod._q, self.prod.head
        pushed = self.prod._pushed()
        framed = framing.pack_header(framing.RECORD_TAG, len(rec)) + rec
        framing.write_at(self.prod._data, head, framed, len(framed))
        new_head = head + H + len(rec)
        order = [
            ("repair", ring_mod._PUSHED, pushed),
            ("pend_head", ring_mod._PEND_HEAD, new_head),
            ("pend_pushed", ring_mod._PEND_PUSHED, pushed + 1),
            ("head", ring_mod._HEAD, new_head),
        ]
        if step != "payload":
            for name, idx, value in order:
                q[idx] = value
                if name == step:
                    break
        if step == "head":  # published; the pushed counter store never happened
            self.model.append(rec)
        self._restart_producer()

    @rule(step=st.sampled_from(["repair", "pend_tail", "pend_popped", "tail"]))
    def consumer_killed_in_release(self, step):
        """Do the stores release does, in its order, up to ``step``, then restart."""
        if not self.model:
            return
        recs, end = self.cons.peek_batch(3)
        q = self.cons._q
        popped = self.cons._popped()
        for name, idx, value in [
            ("repair", ring_mod._POPPED, popped),
            ("pend_tail", ring_mod._PEND_TAIL, end),
            ("pend_popped", ring_mod._PEND_POPPED, popped + len(recs)),
            ("tail", ring_mod._TAIL, end),
        ]:
            q[idx] = value
            if name == step:
                break
        if step == "tail":
            for _ in recs:
                self.model.popleft()
        self.cons.close()
        self.cons = _attach_like(self.ring)

    @rule()
    def restart_both(self):
        self._restart_producer()
        self.cons.close()
        self.cons = _attach_like(self.ring)

    def _restart_producer(self):
        if self.prod is not self.ring:
            self.prod.close()
        self.prod = _attach_like(self.ring)

    # invariants
    @invariant()
    def indices_match_model(self):
        if self.ring is None:
            return
        used = self.cons.head - self.cons.tail
        note(f"model {len(self.model)} records, {used} bytes used")
        assert used == self.used()
        assert 0 <= used <= self.ring.capacity
        assert self.prod.head == self.cons.head and self.prod.tail == self.cons.tail

    @invariant()
    def counters_match_model(self):
        if self.ring is None:
            return
        assert self.cons.depth() == len(self.model) == self.prod.depth()
        st_ = self.ring.stats()
        assert st_["pushed"] - st_["popped"] == len(self.model)


@pytest.mark.parametrize("limits", ["default", "tiny"])
def test_ring_state_machine(shm_prefix, monkeypatch, limits):
    if limits == "tiny":
        # Exercise the large-record, bounded-parse and record-by-record write paths
        # with small rings.
        monkeypatch.setattr(ring_mod, "_DIRECT", 40)
        monkeypatch.setattr(ring_mod, "_PARSE_LIMIT", 60)
        monkeypatch.setattr(ring_mod, "_JOIN_MAX_AVG", 6)

    class Machine(RingMachine):
        prefix = shm_prefix
        exact = limits == "default"

    # modest whatever the profile: this file should run in well under a minute
    examples = min(settings().max_examples, 50)
    run_state_machine_as_test(
        Machine, settings=settings(max_examples=examples, stateful_step_count=30)
    )


# --- plain tests ---------------------------------------------------------------------------
def test_names_and_unlink(shm_prefix):
    run_id = shm.new_run_id()
    r = Ring.create(shm_prefix, run_id, "edge.a", 4096)
    base = shm.object_name(shm_prefix, run_id, "edge.a")
    assert shm.list_objects(shm_prefix, run_id) == sorted(
        [base, f"sem.{base}.data", f"sem.{base}.space"]
    )
    assert os.stat(os.path.join(shm.SHM_DIR, base)).st_mode & 0o777 == 0o600
    with pytest.raises(shm.ShmError):
        Ring.create(shm_prefix, run_id, "edge.a", 4096)  # exists: the first is untouched
    r2 = Ring.attach(shm_prefix, run_id, "edge.a")
    assert r2.capacity == 4096 and r2.max_record == 4096 - H
    r.push(b"x")
    assert take_one(r2) == b"x"
    r2.close()
    r2.close()  # idempotent
    r.unlink()
    assert shm.list_objects(shm_prefix, run_id) == []
    assert r.push(b"still mapped") is True  # an open handle outlives the unlink
    r.close()
    with pytest.raises(shm.ShmError):
        Ring.attach(shm_prefix, run_id, "edge.a")


def test_bad_capacity_and_not_a_ring(shm_prefix):
    run_id = shm.new_run_id()
    with pytest.raises(ValueError):
        Ring.create(shm_prefix, run_id, "r", 4)
    assert shm.list_objects(shm_prefix) == []
    name = shm.object_name(shm_prefix, run_id, "fake")
    seg = shm.Segment.create(name, 4096)
    sems = [shm.create_semaphore(name + ".data"), shm.create_semaphore(name + ".space")]
    try:
        with pytest.raises(RingError, match="not a version"):
            Ring.attach(shm_prefix, run_id, "fake")
    finally:
        for s in sems:
            s.close()
        seg.close()
        seg.unlink()
        shm.unlink_semaphore(name + ".data")
        shm.unlink_semaphore(name + ".space")


def test_record_too_large_names_sizes(make_ring):
    r = make_ring(100)
    assert r.max_record == 95
    with pytest.raises(RecordTooLarge, match=r"record of 96 bytes exceeds max_record 95 bytes.*capacity 100"):
        r.push(b"x" * 96)
    with pytest.raises(RecordTooLarge, match=r"200 bytes \(index 1 of the batch\) exceeds max_record 95"):
        r.push_batch([b"a", b"b" * 200, b"c"])
    assert r.head == 0 and r.depth() == 0
    assert r.push(b"m" * 95) is True  # max_record fills the whole ring
    assert r.head - r.tail == r.capacity
    assert r.push(b"") is False and r.push_batch([b""]) == 0
    assert take_one(r) == b"m" * 95


def test_full_ring_blocks_then_gives_up_without_overwriting(make_ring):
    r = make_ring(64)
    recs = [_rec(i, 11) for i in range(4)]  # 4 x 16 bytes: exactly full
    assert r.push_batch(recs) == 4
    assert r.push(b"z", timeout=0.05) is False
    assert r.push_batch([b"z", b"y"], timeout=0.05) == 0
    assert r.stats()["producer_sleeps"] >= 1
    assert take(r) == recs
    assert r.stats()["producer_waiting"] is False


def test_blocking_pop_on_empty_ring_times_out(make_ring):
    r = make_ring(1024)
    assert take_one(r, timeout=0.05) is None
    assert take(r, timeout=0.05) == []
    assert r.peek_batch(timeout=0.05) == ([], 0)
    st_ = r.stats()
    assert st_["consumer_sleeps"] >= 3 and st_["consumer_waiting"] is False


def test_extra_posts_make_no_records(make_ring):
    r = make_ring(64)
    for _ in range(5):
        r._data_sem.release()
    assert take_one(r, timeout=0.05) is None
    assert take(r, timeout=0.05) == []
    assert r.depth() == 0 and r.head == 0
    assert r.push_batch([_rec(i, 11) for i in range(4)]) == 4
    for _ in range(5):
        r._space_sem.release()
    assert r.push(b"z", timeout=0.05) is False  # spurious wake-ups, still full
    assert [len(x) for x in take(r)] == [11] * 4
    assert r.stats()["pushed"] == 4 == r.stats()["popped"]


def test_release_rules(make_ring):
    r = make_ring(256)
    recs = [_rec(i, i * 3) for i in range(6)]
    r.push_batch(recs)
    got, end = r.peek_batch(4)
    assert got == recs[:4]
    with pytest.raises(RingError, match="outside"):
        r.release(r.head + 1)
    with pytest.raises(RingError, match="record boundary"):
        r.release(H + 1)
    r.release(0)  # no-op
    r.release(_footprint(recs[:2]))  # not the peeked end: counted by walking headers
    assert r.depth() == 4 and take_one(r) == recs[2]
    other = _attach_like(r)  # a successor releases without having peeked
    other.release(r.head)
    assert r.depth() == 0 and r.stats()["popped"] == 6
    with pytest.raises(RingError, match="outside"):
        other.release(0)
    other.close()
    with pytest.raises(ValueError):
        r.peek_batch(0)


def test_a_peek_serves_what_an_earlier_parse_left_before_what_came_after(make_ring):
    """A peek parses every record there and keeps those it did not return; the next
    peek returns those kept (fewer than asked, maybe) before it parses newer ones."""
    r = make_ring(64)
    r.push_batch([b"a", b"b"])
    assert take(r, 1) == [b"a"]  # b parsed too, and kept
    r.push(b"c")
    assert r.peek_batch(2)[0] == [b"b"]
    assert take(r, 2) == [b"b"] and take(r, 2) == [b"c"] and r.depth() == 0


def test_buffer_records(make_ring):
    r = make_ring(1024)
    a = array.array("i", [1, 2, 3])
    assert r.push(memoryview(a)) and r.push(bytearray(b"ba")) and r.push(a)
    assert r.push_batch([a, memoryview(b"mv"), bytearray(b"x")]) == 3
    assert take(r) == [a.tobytes(), b"ba", a.tobytes(), a.tobytes(), b"mv", b"x"]


def test_wrapping_large_records_round_trip(make_ring):
    """Records near the ring size, split at every offset (direct copy path)."""
    r = make_ring(100_003)
    sizes = [40_000, 33_000, 50_001, 99_998, 7, 60_000] * 4
    for i, n in enumerate(sizes):
        rec = _rec(i, n)
        assert r.push(rec)
        assert take_one(r) == rec if i % 2 else take(r) == [rec]
    assert r.head > 4 * r.capacity and r.depth() == 0


def test_big_backlog_of_small_records(make_ring):
    """More bytes queued than one parse takes: bounded parse, then the cache."""
    r = make_ring(3 << 20)
    recs = [_rec(i, 1 + i % 120) for i in range(40_000)]
    pushed = 0
    while pushed < len(recs):
        pushed += r.push_batch(recs[pushed:pushed + 4096])
    assert r.head - r.tail > ring_mod._PARSE_LIMIT
    out = []
    while len(out) < len(recs):
        got, end = r.peek_batch(1000)
        out.extend(got)
        r.release(end)
        if len(out) % 3000 == 0:
            out.append(take_one(r))
    assert out == recs and r.depth() == 0


def test_corruption_is_an_error_not_a_record(make_ring):
    r = make_ring(256)
    r.push_batch([b"abc", b"defg"])
    r._data[0] = 0x00  # clobber the first record's tag
    with pytest.raises(RingError, match="corrupt"):
        take_one(r)
    with pytest.raises(RingError, match="corrupt"):
        r.release_one()
    with pytest.raises(RingError, match="corrupt"):
        take(r)
    r._data[0] = framing.RECORD_TAG
    r._data[1] = 200  # a length running past head
    with pytest.raises(RingError, match="corrupt"):
        take(r)
    with pytest.raises(RingError, match="corrupt"):
        r.release_one()
    r._data[1] = 3
    assert take(r) == [b"abc", b"defg"]


def test_sleepers_wake_across_threads(make_ring):
    r = make_ring(64)
    cons = _attach_like(r)
    got = []
    t = threading.Thread(target=lambda: got.append(take_one(cons, timeout=None)))
    t.start()
    while not r.stats()["consumer_waiting"] and t.is_alive():  # let it fall asleep
        threading.Event().wait(0.001)
    assert r.push(b"wake")
    t.join(30)
    assert not t.is_alive() and got == [b"wake"]
    assert r.stats()["data_posts"] >= 1

    r.push_batch([_rec(i, 11) for i in range(4)])  # full
    done = []
    t = threading.Thread(target=lambda: done.append(r.push(b"late", timeout=None)))
    t.start()
    while not r.stats()["producer_waiting"] and t.is_alive():
        threading.Event().wait(0.001)
    assert len(take(cons)) == 4
    t.join(30)
    assert not t.is_alive() and done == [True]
    assert take_one(cons) == b"late"
    assert r.stats()["space_posts"] >= 1
    cons.close()


def test_unhurried_records_leave_a_sleeping_consumer_asleep(make_ring):
    """wake_consumer=False posts nothing: the sleeper finds the record when its slice ends,
    or at once when an urgent record follows (which posts, though a quiet one went first)."""
    r = make_ring(4096)
    cons = _attach_like(r)
    got = []
    t = threading.Thread(target=lambda: got.append(take(cons, 8, timeout=None)))
    t.start()
    while not r.stats()["consumer_waiting"] and t.is_alive():
        threading.Event().wait(0.001)
    assert r.push_batch([b"quiet"], wake_consumer=False) == 1
    assert r.stats()["data_posts"] == 0
    t.join(30)  # the slice ends, it re-checks the indices
    assert not t.is_alive() and got == [[b"quiet"]]

    got.clear()
    t = threading.Thread(target=lambda: got.append(take(cons, 8, timeout=None)))
    t.start()
    while not r.stats()["consumer_waiting"] and t.is_alive():
        threading.Event().wait(0.001)
    r.push_batch([b"quiet"], wake_consumer=False)
    r.push_batch([b"urgent"])
    t.join(30)
    assert not t.is_alive() and got and got[0][0] == b"quiet"
    # one post, unless its slice ended in the microseconds between the two pushes
    assert r.stats()["data_posts"] == 1 or got[0] == [b"quiet"]
    cons.close()


def test_batching_needs_far_fewer_posts_than_records(make_ring):
    r = make_ring(64 * 1024)
    cons = _attach_like(r)
    batch = 256
    n = batch * 800
    recs = [_rec(i, 16 + i % 64) for i in range(batch)]
    errors = []

    def produce():
        try:
            for _ in range(n // batch):
                assert r.push_batch(recs, timeout=None) == batch
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=produce)
    t.start()
    got = 0
    while got < n:
        out = take(cons, 1024, timeout=30)
        assert out, "consumer starved"
        assert out[0] == recs[got % batch]
        got += len(out)
    t.join(30)
    assert not errors and got == n
    st_ = r.stats()
    posts = st_["data_posts"] + st_["space_posts"]
    print(f"{posts} posts for {n} records: {st_}")
    assert st_["pushed"] == st_["popped"] == n
    assert posts * 50 < n, st_
    cons.close()


def test_push_batch_publishes_once_per_round(make_ring, monkeypatch):
    """What fits goes out with one head store; the rest waits for a later round."""
    stores = []
    publish = Ring._publish

    def counting(self, new_head, n, wake_consumer=True):
        stores.append(n)
        publish(self, new_head, n, wake_consumer)

    monkeypatch.setattr(Ring, "_publish", counting)
    r = make_ring(4096)
    recs = [_rec(i, 7 + i % 5) for i in range(400)]
    assert r.push_batch(recs[:200]) == 200
    assert stores == [200]
    k = r.push_batch(recs[200:], timeout=0)
    assert 0 < k < 200 and stores == [200, k]
    assert r.head - r.tail + H + len(recs[200 + k]) > r.capacity  # the next one did not fit
    assert take(r, 1000) == recs[: 200 + k]


@pytest.mark.parametrize("words", ["memoryview", "release and acquire"])
def test_index_store_is_never_torn(shm_prefix, words):
    """Header words are written with one 8-byte store each, through the memoryview
    (counters) or ipc.ordering (head and tail): a reader in another process never sees
    a mix of two values (a byte-wise copy would show up here)."""
    import multiprocessing as mp

    a, b = 0x0123456789ABCDEF, 0xFEDCBA9876543210  # every byte differs
    run_id = shm.new_run_id()
    r = Ring.create(shm_prefix, run_id, "torn", 64)
    q = r._q
    q[ring_mod._HEAD] = a
    load = q.__getitem__ if words == "memoryview" else r._load_acquire

    def writer():
        w = Ring.attach(shm_prefix, run_id, "torn")
        store = w._q.__setitem__ if words == "memoryview" else w._store_release
        for _ in range(300_000):
            store(ring_mod._HEAD, b)
            store(ring_mod._HEAD, a)

    p = mp.get_context("fork").Process(target=writer)
    p.start()
    seen = set()
    try:
        while p.exitcode is None and len(seen) <= 2:
            for _ in range(10_000):
                seen.add(load(ring_mod._HEAD))
    finally:
        p.join(60)
        q[ring_mod._HEAD] = 0
        r.close()
        r.unlink()
    assert seen <= {a, b}, [hex(v) for v in seen]
    assert p.exitcode == 0


def test_shared_doorbell_and_wait_any(shm_prefix):
    """Several rings wake one consumer through its doorbell; unlinking a ring leaves
    the doorbell (it belongs to whoever created it)."""
    run_id = shm.new_run_id()
    bell_name = shm.object_name(shm_prefix, run_id, "bell")
    bell = shm.create_semaphore(bell_name)
    rings = [Ring.create(shm_prefix, run_id, f"in{i}", 256, doorbell=bell_name) for i in range(3)]
    try:
        assert wait_any(rings, bell, 0) is False
        assert wait_any(rings, bell, 0.02) is False  # times out, nothing there
        bell.release()  # an extra ring of the bell makes no record
        assert wait_any(rings, bell, 0.02) is False and all(r.depth() == 0 for r in rings)

        producer = Ring.attach(shm_prefix, run_id, "in2", doorbell=bell_name)
        woke = []
        t = threading.Thread(target=lambda: woke.append(wait_any(rings, bell, 30)))
        t.start()
        while not rings[2].stats()["consumer_waiting"] and t.is_alive():
            threading.Event().wait(0.001)
        assert producer.push(b"ding")
        t.join(30)
        assert woke == [True] and producer.stats()["data_posts"] >= 1
        assert take_one(rings[2]) == b"ding"
        assert not any(r.stats()["consumer_waiting"] for r in rings)
        producer.close()
    finally:
        for r in rings:
            r.close()
            r.unlink()
    assert shm.list_objects(shm_prefix, run_id) == [f"sem.{bell_name}"]
    bell.close()
    shm.unlink_semaphore(bell_name)


def test_release_one_gives_records_back_one_at_a_time_including_wrapped_ones(make_ring):
    """What a consumer that settles each record does (pipeline/runtime/loop.py): peek a batch,
    then give the records back one by one, without knowing how they are framed."""
    r = make_ring(64)
    with pytest.raises(RingError, match="holds no record"):
        r.release_one()
    for k in range(20):  # sizes whose headers and payloads wrap around the 64-byte buffer
        recs = [bytes([k]) * (3 + k % 11), bytes([k + 1]) * (7 + k % 5)]
        assert r.push_batch(recs) == 2
        got, end = r.peek_batch()
        assert got == recs
        for rec in recs:
            tail, popped = r.tail, r.stats()["popped"]
            r.release_one()
            assert r.tail == tail + H + len(rec) and r.stats()["popped"] == popped + 1
        assert r.tail == end and r.depth() == 0
