"""The embedding cache against a simple model, and in-flight miss dedup."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ipc import shm
from ipc.arena import Arena
from stages.embedding_cache import (
    EmbeddingCache,
    InflightMisses,
    Status,
    entry_nbytes,
    make_key,
    split_entry,
)
from stages.cache import CacheStage
from stages.records import (OWNER_CACHE, OWNER_INTAKE, OWNER_TOWER, Encoded, EncodeFailed, ReadyItem, RoomAbandoned,
                            WorkItem)

CACHE, CALLER, READER, HOG = 0, 1, 2, 3
BLOCK = 64
ARENA_SIZE = 64 * 1024
N_KEYS = 6
MAX_HELD = 8


def content(i: int, n: int) -> bytes:
    return np.random.default_rng(1000 + i).integers(0, 256, n, dtype=np.uint8).tobytes()


item_shapes = st.tuples(
    st.integers(1, 6),  # span
    st.integers(2, 6),  # hidden
    st.sampled_from([0, 4]),  # deepstack width
    st.sampled_from(["float16", "float32"]),
)


class Model:
    """The cache as two ordered dicts (LRU first) and counters."""

    def __init__(self, arena_budget, host_budget):
        self.ab, self.hb = arena_budget, host_budget
        self.t1: OrderedDict = OrderedDict()  # key -> nbytes
        self.t2: OrderedDict = OrderedDict()
        self.c = dict.fromkeys(
            "hits_arena hits_host misses promotions promotion_no_room demotions evictions "
            "oversize_skipped inserts insert_present stale_dropped".split(),
            0,
        )

    def _demote(self, key, n):
        if n > self.hb:
            self.c["evictions"] += 1
            return
        while self.t2 and sum(self.t2.values()) + n > self.hb:
            self.t2.popitem(last=False)
            self.c["evictions"] += 1
        self.t2[key] = n
        self.c["demotions"] += 1

    def _room(self, n):
        while self.t1 and sum(self.t1.values()) + n > self.ab:
            self._demote(*self.t1.popitem(last=False))

    def insert(self, key, n) -> bool:
        if n > self.ab:
            self.c["oversize_skipped"] += 1
            return False
        if key in self.t1:
            self.c["insert_present"] += 1
            return False
        self.t2.pop(key, None)
        self._room(n)
        self.t1[key] = n
        self.c["inserts"] += 1
        return True

    def lookup(self, key, arena_full: bool) -> Status:
        if key in self.t1:
            self.t1.move_to_end(key)
            self.c["hits_arena"] += 1
            return Status.HIT_ARENA
        if key in self.t2:
            self.c["hits_host"] += 1
            if arena_full:
                self.t2.move_to_end(key)
                self.c["promotion_no_room"] += 1
                return Status.NO_ROOM
            n = self.t2.pop(key)
            self._room(n)
            self.t1[key] = n
            self.c["promotions"] += 1
            return Status.HIT_HOST
        self.c["misses"] += 1
        return Status.MISS


class CacheMachine(RuleBasedStateMachine):
    prefix = None  # set by the test (the shm_prefix fixture)

    def __init__(self):
        super().__init__()
        self.arena = None
        self.cache = None
        self.held: list = []  # leases on which READER holds a reference

    @initialize(
        shapes=st.lists(item_shapes, min_size=N_KEYS, max_size=N_KEYS),
        arena_budget=st.integers(-40, 400).map(lambda b: max(b, 0)),
        host_budget=st.integers(-60, 500).map(lambda b: max(b, 0)),
    )
    def setup(self, shapes, arena_budget, host_budget):
        self.arena = Arena.create(
            self.prefix, shm.new_run_id(), "emb", ARENA_SIZE, block_size=BLOCK
        )
        self.keys = []
        self.data = {}
        for i, (span, hidden, deep, dtype) in enumerate(shapes):
            key = make_key("image" if i % 2 else "video", 0xABC000 + i, span, hidden, dtype)
            n = entry_nbytes(span, hidden, deep, np.dtype(dtype).itemsize)
            self.keys.append(key)
            self.data[key] = content(i, n)
        self.cache = EmbeddingCache(self.arena, CACHE, arena_budget, host_budget)
        self.model = Model(arena_budget, host_budget)

    def teardown(self):
        if self.arena is None:
            return
        try:
            if self.cache is not None:
                self.cache.clear()
                for lease in self.held:
                    self.arena.drop(lease, READER)
                self.held.clear()
                assert len(self.arena.live_leases()) == 0
                assert self.arena.used_bytes() == 0
        finally:
            self.arena.close()
            self.arena.unlink()

    # -- rules -----------------------------------------------------------

    @precondition(lambda self: self.cache is not None)
    @rule(i=st.integers(0, N_KEYS - 1))
    def insert_one(self, i):
        self.insert(i)

    def insert(self, i):
        key = self.keys[i]
        data = self.data[key]
        lease = self.arena.alloc(len(data), CALLER)
        assert lease is not None, "test arena is sized never to run out here"
        with self.arena.view(lease) as mv:
            mv[:] = data
        got = self.cache.insert(key, lease)
        assert got == self.model.insert(key, len(data))
        refs = self.arena.refs(lease)
        assert refs.get(CACHE, 0) == (1 if got else 0)
        assert refs.get(CALLER, 0) == 1
        # The caller (the tower's output, now shipped) lets go of its own reference.
        freed = self.arena.drop(lease, CALLER)
        assert freed == (not got)

    @precondition(lambda self: self.cache is not None)
    @rule(ids=st.lists(st.integers(0, N_KEYS - 1), min_size=2, max_size=4))
    def insert_several(self, ids):
        for i in ids:
            self.insert(i)

    def _lookup(self, i, hold, arena_full):
        key = self.keys[i]
        before_t1 = self.cache.lease_of(key)
        status, lease = self.cache.lookup_status(key, READER)
        assert self.cache.last_status is status
        assert status is self.model.lookup(key, arena_full)
        if status in (Status.MISS, Status.NO_ROOM):
            assert lease is None
            return
        assert lease is not None and self.arena.valid(lease)
        if status is Status.HIT_ARENA:
            assert lease == before_t1
        assert lease.length == len(self.data[key])
        with self.arena.view(lease) as mv:
            assert bytes(mv) == self.data[key], "a hit must return the bytes inserted"
        refs = self.arena.refs(lease)
        assert refs.get(CACHE) == 1
        assert refs.get(READER, 0) == 1 + sum(1 for h in self.held if h == lease)
        if hold and len(self.held) < MAX_HELD:
            self.held.append(lease)
        else:
            assert not self.arena.drop(lease, READER)

    @precondition(lambda self: self.cache is not None)
    @rule(i=st.integers(0, N_KEYS - 1), hold=st.booleans())
    def lookup(self, i, hold):
        self._lookup(i, hold, arena_full=False)

    @precondition(lambda self: self.cache is not None and self.model.t2)
    @rule(j=st.integers(0, N_KEYS - 1), hold=st.booleans())
    def lookup_host_entry(self, j, hold):
        """Aim at tier 2 on purpose: promotions are the interesting case."""
        host = list(self.model.t2)
        self._lookup(self.keys.index(host[j % len(host)]), hold, arena_full=False)

    @precondition(lambda self: self.cache is not None)
    @rule(i=st.integers(0, N_KEYS - 1))
    def lookup_with_arena_full(self, i):
        """Another owner takes every free byte: a host hit cannot be promoted."""
        hog = []
        size = ARENA_SIZE
        while size >= 1:
            lease = self.arena.alloc(size, HOG)
            if lease is None:
                size //= 2
            else:
                hog.append(lease)
        assert self.arena.alloc(1, HOG) is None
        try:
            self._lookup(i, hold=False, arena_full=True)
        finally:
            for lease in hog:
                assert self.arena.drop(lease, HOG)

    @precondition(lambda self: self.cache is not None and self.held)
    @rule(j=st.integers(0, MAX_HELD - 1))
    def release(self, j):
        lease = self.held.pop(j % len(self.held))
        still_cached = lease in self.cache._t1.values()
        freed = self.arena.drop(lease, READER)
        if still_cached or lease in self.held:
            assert not freed
        else:
            assert freed, "a demoted entry's lease goes when its last reader lets go"

    @precondition(lambda self: self.cache is not None)
    @rule(go=st.integers(0, 7))
    def clear(self, go):
        if go:  # rare: a clear wipes what the other rules built up
            return
        self.cache.clear()
        self.model.t1.clear()
        self.model.t2.clear()

    # -- invariants ------------------------------------------------------

    @invariant()
    def matches_model(self):
        if self.cache is None:
            return
        c, m = self.cache, self.model
        t1, t2 = c.keys("arena"), c.keys("host")
        assert not set(t1) & set(t2), "tiers must be exclusive"
        assert t1 == list(m.t1), "tier-1 LRU order"
        assert t2 == list(m.t2), "tier-2 LRU order"
        s = c.stats()
        assert s["arena_bytes"] == sum(m.t1.values()) <= m.ab
        assert s["host_bytes"] == sum(m.t2.values()) <= m.hb
        assert s["arena_entries"] == len(t1) and s["host_entries"] == len(t2)
        for name, value in m.c.items():
            assert s[name] == value, name
        for key in t1:
            assert key in c.keys("arena")
        for key in t2:
            assert key in c.keys("host")
            assert c._t2[key] == self.data[key]

    @invariant()
    def arena_references(self):
        if self.cache is None:
            return
        t1_leases = {self.cache.lease_of(k): k for k in self.cache.keys("arena")}
        assert len(t1_leases) == len(self.cache.keys("arena"))
        for lease, key in t1_leases.items():
            refs = self.arena.refs(lease)
            assert refs.get(CACHE) == 1, "the cache holds exactly one ref per tier-1 entry"
            assert refs.get(READER, 0) == self.held.count(lease)
            assert set(refs) <= {CACHE, READER}
            with self.arena.view(lease) as mv:
                assert bytes(mv) == self.data[key]
        for lease in set(self.held):
            refs = self.arena.refs(lease)
            assert refs.get(READER) == self.held.count(lease)
            assert refs.get(CACHE, 0) == (1 if lease in t1_leases else 0)
        assert len(self.arena.live_leases()) == len(set(t1_leases) | set(self.held))


def test_cache_state_machine(shm_prefix):
    class Machine(CacheMachine):
        prefix = shm_prefix

    run_state_machine_as_test(
        Machine,
        settings=settings(max_examples=300, stateful_step_count=50, deadline=None),
    )


# -- targeted cases ------------------------------------------------------


@pytest.fixture
def arena(shm_prefix):
    a = Arena.create(shm_prefix, shm.new_run_id(), "emb", ARENA_SIZE, block_size=BLOCK)
    try:
        yield a
    finally:
        a.close()
        a.unlink()


def put(arena, cache, key, data, owner=CALLER):
    lease = arena.alloc(len(data), owner)
    with arena.view(lease) as mv:
        mv[:] = data
    ok = cache.insert(key, lease)
    arena.drop(lease, owner)
    return ok


def key_of(i, span=4, hidden=4, dtype="float32"):
    return make_key("image", i, span, hidden, dtype)


def test_oversize_is_skipped_and_evicts_nothing(arena):
    cache = EmbeddingCache(arena, CACHE, arena_budget=200, host_budget=10_000)
    assert put(arena, cache, key_of(1), b"a" * 100)
    assert put(arena, cache, key_of(2), b"b" * 100)
    assert not put(arena, cache, key_of(3), b"c" * 201)  # bigger than the arena budget
    s = cache.stats()
    assert s["oversize_skipped"] == 1
    assert s["demotions"] == s["evictions"] == 0
    assert cache.keys("arena") == [key_of(1), key_of(2)]
    assert key_of(3) not in cache  # not cached in the host tier either
    assert len(arena.live_leases()) == 2
    cache.clear()
    assert len(arena.live_leases()) == 0


def test_key_is_more_than_the_hash(arena):
    cache = EmbeddingCache(arena, CACHE, 1000, 1000)
    assert put(arena, cache, make_key("image", 7, 4, 4, "float32"), b"x" * 64)
    assert cache.lookup(make_key("image", 7, 4, 4, "float16"), READER) is None
    assert cache.lookup(make_key("video", 7, 4, 4, "float32"), READER) is None
    with pytest.raises(TypeError):
        cache.lookup(7, READER)
    cache.clear()


def test_demote_then_promote_roundtrip(arena):
    cache = EmbeddingCache(arena, CACHE, arena_budget=100, host_budget=1000)
    a, b = content(1, 60), content(2, 60)
    assert put(arena, cache, key_of(1), a)
    assert put(arena, cache, key_of(2), b)  # demotes key 1
    assert key_of(1) in cache.keys("host")
    assert len(arena.live_leases()) == 1
    lease = cache.lookup(key_of(1), READER)  # promotes key 1, demotes key 2
    assert cache.last_status is Status.HIT_HOST
    with arena.view(lease) as mv:
        assert bytes(mv) == a
    assert key_of(1) in cache.keys("arena") and key_of(2) in cache.keys("host")
    s = cache.stats()
    assert (s["promotions"], s["demotions"], s["hits_host"]) == (1, 2, 1)
    arena.drop(lease, READER)
    cache.clear()
    assert len(arena.live_leases()) == 0


def test_insert_supersedes_host_copy(arena):
    cache = EmbeddingCache(arena, CACHE, arena_budget=100, host_budget=1000)
    assert put(arena, cache, key_of(1), b"1" * 60)
    assert put(arena, cache, key_of(2), b"2" * 60)
    assert key_of(1) in cache.keys("host")
    assert put(arena, cache, key_of(1), b"1" * 60)  # re-encoded after NO_ROOM, say
    assert key_of(1) in cache.keys("arena") and key_of(2) in cache.keys("host")
    assert not put(arena, cache, key_of(1), b"1" * 60)  # already in tier 1
    assert cache.stats()["insert_present"] == 1
    cache.clear()
    assert len(arena.live_leases()) == 0


def test_stale_lease_is_dropped_never_returned(arena):
    cache = EmbeddingCache(arena, CACHE, arena_budget=1000, host_budget=1000)
    assert put(arena, cache, key_of(1), b"1" * 100)
    assert put(arena, cache, key_of(2), b"2" * 100)
    old = cache.lease_of(key_of(1))
    arena.reclaim(CACHE)  # e.g. the supervisor reclaimed a dead cache stage's refs
    assert not arena.valid(old)
    reused = arena.alloc(100, CALLER)  # the space (and maybe the slot) is reused
    assert cache.lookup(key_of(1), READER) is None
    assert cache.last_status is Status.MISS
    assert cache.lookup(key_of(2), READER) is None  # key 2 is stale too: dropped on sight
    s = cache.stats()
    assert s["stale_dropped"] == 2 and s["arena_entries"] == 0 and s["arena_bytes"] == 0
    assert not cache.insert(key_of(3), old)  # a stale lease is refused
    assert cache.stats()["stale_dropped"] == 3
    assert arena.refs(reused) == {CALLER: 1}
    arena.drop(reused, CALLER)
    cache.clear()
    assert len(arena.live_leases()) == 0


def test_clear_leaves_arena_empty_once_readers_drop(arena):
    cache = EmbeddingCache(arena, CACHE, arena_budget=1000, host_budget=1000)
    for i in range(5):
        assert put(arena, cache, key_of(i), content(i, 150))
    held = [cache.lookup(key_of(i), READER) for i in range(5)]
    cache.clear()
    assert len(cache) == 0
    assert len(arena.live_leases()) == 5  # readers still hold theirs
    for lease in held:
        assert arena.refs(lease) == {READER: 1}
        assert arena.drop(lease, READER)
    assert len(arena.live_leases()) == 0 and arena.used_bytes() == 0


def test_entry_layout_roundtrip():
    span, hidden, deep = 3, 4, 2
    main = np.arange(span * hidden, dtype=np.float16).reshape(span, hidden)
    ds = -np.arange(span * deep, dtype=np.float16).reshape(span, deep)
    blob = main.tobytes() + ds.tobytes()
    assert len(blob) == entry_nbytes(span, hidden, deep, 2)
    m2, d2 = split_entry(blob, span, hidden, deep, "float16")
    assert (m2 == main).all() and (d2 == ds).all()
    m3, d3 = split_entry(main.tobytes(), span, hidden, 0, "float16")
    assert (m3 == main).all() and d3 is None


# -- in-flight dedup -------------------------------------------------------


def test_identical_misses_encoded_once():
    inflight = InflightMisses()
    k = key_of(1)
    assert inflight.begin(k, "r1")
    assert not inflight.begin(k, "r2")
    assert not inflight.begin(k, "r3")
    assert inflight.begin(key_of(2), "r4")
    assert inflight.waiting(k) == ["r1", "r2", "r3"]
    assert len(inflight) == 2
    assert inflight.finish(k) == ["r1", "r2", "r3"]
    assert k not in inflight and len(inflight) == 1
    assert inflight.begin(k, "r5")  # a new miss after the encode finished
    assert inflight.abort(key_of(2)) == ["r4"]
    assert inflight.finish(key_of(2)) == []


@given(
    st.lists(
        st.tuples(st.sampled_from(["begin", "finish", "abort"]), st.integers(0, 3)),
        max_size=60,
    )
)
def test_inflight_against_model(ops):
    inflight = InflightMisses()
    model: dict[int, list] = {}
    for n, (op, k) in enumerate(ops):
        if op == "begin":
            first = inflight.begin(k, n)
            assert first == (k not in model)
            model.setdefault(k, []).append(n)
        else:
            got = inflight.finish(k) if op == "finish" else inflight.abort(k)
            assert got == model.pop(k, [])
            assert got == sorted(got)
        assert len(inflight) == len(model)
        for kk in range(4):
            assert inflight.waiting(kk) == model.get(kk, [])


# -- the cache stage: a failed room's item that identical items waited for ----------


PIXELS = np.arange(16, dtype=np.float32).tobytes()  # the same image in every room below


class CacheRig:
    """A CacheStage on real arenas; the test plays intake, scheduler, tower and reaper."""

    def __init__(self, prefix):
        run_id = shm.new_run_id()
        self.pixel_arena = Arena.create(prefix, run_id, "pixels", ARENA_SIZE, block_size=BLOCK)
        self.emb_arena = Arena.create(prefix, run_id, "emb", ARENA_SIZE, block_size=BLOCK)
        cache = EmbeddingCache(self.emb_arena, OWNER_CACHE, arena_budget=4096, host_budget=4096)
        self.sent: list[tuple[str, object]] = []
        self.stage = CacheStage(lambda dest, rec: self.sent.append((dest, rec)), pixel_arena=self.pixel_arena,
                                cache=cache, hidden=4, dtype="float32")

    def item(self, room: int, salt: str = "") -> WorkItem:
        """Intake hands over an item of `room` (pixels in our arena, intake's reference)."""
        lease = self.pixel_arena.alloc(len(PIXELS), OWNER_INTAKE)
        self.pixel_arena.view(lease)[:] = PIXELS
        w = WorkItem(slot=room, room=room, item=0, seq=room, modality="image", grid_thw=((1, 2, 2),),
                     pixel_dtype="float32", n_patches=4, patch_dim=1, span=1, pixels=lease, cache_salt=salt)
        keyed = replace(w, key=self.stage.key_of(w))  # as the cache passes it on
        self.stage.handle("intake", w)
        return keyed

    def take(self, dest: str) -> list:
        taken = [rec for d, rec in self.sent if d == dest]
        self.sent = [(d, rec) for d, rec in self.sent if d != dest]
        return taken

    def into_tower(self, w: WorkItem) -> None:
        """The scheduler and tower take `w`: its pixels leave the cache's hands."""
        self.pixel_arena.transfer(w.pixels, OWNER_CACHE, OWNER_TOWER)

    def encoded(self, w: WorkItem, fill: int) -> None:
        """The tower wrote `w`'s rows (all bytes `fill`) and tells the cache."""
        self.pixel_arena.drop(w.pixels, OWNER_TOWER)
        w = replace(w, pixels=None, out=self.emb_arena.alloc(16, OWNER_TOWER))
        self.emb_arena.view(w.out)[:] = bytes([fill]) * 16
        self.stage.handle("tower", Encoded(w))

    def tower_failed(self, w: WorkItem, rooms: set[int]) -> None:
        self.pixel_arena.drop(w.pixels, OWNER_TOWER)
        self.stage.handle("tower", EncodeFailed(replace(w, pixels=None), "tower failed: test", frozenset(rooms)))

    def received(self, ready: list[ReadyItem]) -> list[tuple[int, bytes]]:
        """The sender takes each ReadyItem over (and is done with it): (room, rows)."""
        got = []
        for r in ready:
            got.append((r.room, bytes(self.emb_arena.view(r.lease))))
            self.emb_arena.drop(r.lease, OWNER_CACHE)
        return got

    def check_no_leaks(self) -> None:
        self.stage.close()  # lets go of the cached rows
        assert self.pixel_arena.live_leases() == [], "pixels leaked"
        assert self.emb_arena.live_leases() == [], "rows leaked"

    def close(self) -> None:
        for a in (self.pixel_arena, self.emb_arena):
            a.close()
            a.unlink()


@pytest.fixture
def rig(shm_prefix):
    r = CacheRig(shm_prefix)
    try:
        yield r
    finally:
        r.close()


def test_failed_leader_room_sends_next_waiter_to_be_encoded(rig):
    a = rig.item(1)
    assert rig.take("scheduler") == [a]
    rig.into_tower(a)
    b = rig.item(2)
    rig.item(3)
    assert rig.sent == [], "identical items wait for the one in flight"

    rig.stage.handle("reaper", RoomAbandoned(1))  # the scheduler dropped a's queued batch
    rig.pixel_arena.drop(a.pixels, OWNER_TOWER)
    assert rig.take("scheduler") == [b], "the waiters must not wait for an encode that never comes"
    assert rig.sent == []

    rig.into_tower(b)
    rig.encoded(b, fill=0xBB)
    assert rig.received(rig.take("sender")) == [(3, b"\xbb" * 16)]
    assert rig.sent == []
    rig.check_no_leaks()


@pytest.mark.parametrize("late", ["encoded_first", "encoded_last", "failed"])
def test_late_result_of_replaced_item_sends_nothing_twice(rig, late):
    """The failed room's item was in the tower already: its result still comes."""
    a = rig.item(1)
    rig.take("scheduler")
    rig.into_tower(a)
    b = rig.item(2)
    rig.item(3)
    rig.stage.handle("reaper", RoomAbandoned(1))
    assert rig.take("scheduler") == [b]
    rig.into_tower(b)

    if late == "encoded_first":
        rig.encoded(a, fill=0xAA)
        rig.encoded(b, fill=0xBB)
        expected = [(3, b"\xaa" * 16)]  # c need not wait for b; b's own rows go from the tower
    elif late == "encoded_last":
        rig.encoded(b, fill=0xBB)
        rig.encoded(a, fill=0xAA)
        expected = [(3, b"\xbb" * 16)]
    else:
        rig.tower_failed(a, {1})
        rig.encoded(b, fill=0xBB)
        expected = [(3, b"\xbb" * 16)]
    assert rig.received(rig.take("sender")) == expected, "each waiter gets exactly one ReadyItem"
    assert rig.sent == [], "no second encode of b, no failure of a room that did not fail"
    assert len(rig.stage.inflight) == 0
    rig.check_no_leaks()


def test_salts_share_neither_an_encode_in_flight_nor_an_entry(rig):
    """The same pixels under another salt are a miss of their own, encoded on their own;
    the same salt waits for the encode in flight, and later hits its entry only."""
    a = rig.item(1, salt="tenant-a")
    b = rig.item(2, salt="tenant-b")
    assert rig.take("scheduler") == [a, b], "another salt does not wait for a's encode"
    a2 = rig.item(3, salt="tenant-a")
    assert rig.sent == [] and a2.key == a.key != b.key
    for w, fill in ((a, 0xAA), (b, 0xBB)):
        rig.into_tower(w)
        rig.encoded(w, fill)
    assert rig.received(rig.take("sender")) == [(3, b"\xaa" * 16)]  # the waiter got a's rows
    rig.stage.flush_inserts()
    rig.item(4, salt="tenant-b")
    rig.item(5, salt="")
    assert rig.received(rig.take("sender")) == [(4, b"\xbb" * 16)], "b's salt hits b's entry"
    (c,) = rig.take("scheduler")
    assert c.room == 5, "the empty salt shares nothing with the others"
    rig.into_tower(c)
    rig.encoded(c, 0xCC)
    rig.check_no_leaks()
