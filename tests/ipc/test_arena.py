"""ipc.arena: leases with reference counts in shared memory, shared by processes."""
from __future__ import annotations

import os
import random
import select
import signal
import struct
import threading
import time

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, invariant,
                                 multiple, precondition, rule, run_state_machine_as_test)

import numpy as np

from ipc import arena as arena_mod
from ipc import shm
from tests.helpers import fork_call, wait_child
from ipc.arena import Arena, ArenaFull, Lease, StaleLease


# -- helpers ----------------------------------------------------------------------




def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    assert wait_child(pid) == -signal.SIGKILL


def _kill_at_random_moment(pid: int, rng: random.Random, mid_mutation, aim: bool) -> bool:
    """SIGKILL ``pid`` at a random moment; with ``aim``, prefer a moment inside a mutation.

    Aiming freezes the child (SIGSTOP) at random moments until ``mid_mutation()`` holds
    (or tries run out) and kills it there: the kill lands exactly where it was frozen.
    Returns whether it died mid-mutation.
    """
    time.sleep(rng.uniform(0, 0.005))
    for _ in range(300 if aim else 0):
        os.kill(pid, signal.SIGSTOP)
        _, status = os.waitpid(pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), "child ended early"
        if mid_mutation():
            break
        os.kill(pid, signal.SIGCONT)
        time.sleep(rng.uniform(0, 0.0005))
    hit = mid_mutation()  # (stale if not frozen; recounted below from what it left)
    _kill(pid)
    return hit


def _blocks(arena: Arena, n: int) -> int:
    return -(-n // arena.block_size)


def _problems(a: Arena) -> list[str]:
    """What is inconsistent in the arena's metadata, read under its lock; [] when sound."""
    H_SEQ, H_JSLOT, H_USED, H_LIVE = arena_mod._H_SEQ, arena_mod._H_JSLOT, arena_mod._H_USED, arena_mod._H_LIVE
    LIVE, FREE = arena_mod._LIVE, arena_mod._FREE
    a._lock.acquire()
    try:
        problems = []
        if a._h[H_SEQ] & 1 or a._h[H_JSLOT] != -1:
            problems.append("mutation marker left set")
        state = a._n_state
        if ((state != LIVE) & (state != FREE)).any():
            problems.append("bad state bytes")
        idx = np.flatnonzero(state == LIVE)
        starts, counts = a._n_start[idx], a._n_nblk[idx]
        if ((starts < 0) | (counts <= 0) | (starts + counts > a.nblocks)).any():
            return problems + ["lease out of bounds"]
        cover = a._coverage(starts, counts)
        if cover.size and cover.max() > 1:
            problems.append("live leases overlap")
        if not np.array_equal(a._n_map != 0, cover > 0):
            problems.append("block map differs from the lease table")
        if a._h[H_USED] != int(counts.sum()):
            problems.append(f"used blocks {a._h[H_USED]} != {int(counts.sum())}")
        if a._h[H_LIVE] != idx.size:
            problems.append(f"live count {a._h[H_LIVE]} != {idx.size}")
        if (a._n_refs[idx].sum(axis=1, dtype=np.uint64) == 0).any():
            problems.append("live lease without references")
        lens = np.frombuffer(a._mm, np.int64, a.max_leases, a._lay["length"])[idx]
        if ((lens <= 0) | (-(-lens // a.block_size) != counts)).any():
            problems.append("lease length does not match its blocks")
        return problems
    finally:
        a._lock.release()


def _snapshot(a: Arena) -> dict[Lease, dict[int, int]]:
    """Every live lease with its references (owner -> count), taken atomically under the lock."""
    a._lock.acquire()
    try:
        out = {}
        for s in np.flatnonzero(a._n_state == arena_mod._LIVE).tolist():
            row = a._n_refs[s]
            out[Lease(s, a._gen[s], a._start[s] * a.block_size, a._len[s])] = {
                int(o): int(row[o]) for o in np.flatnonzero(row)}
        return out
    finally:
        a._lock.release()


def _largest_free(arena: Arena) -> int:
    """Bytes in the longest run of free blocks, by the live leases."""
    runs, end = [], 0
    for lease in arena.live_leases():  # by offset
        runs.append(lease.offset - end)
        end = lease.offset + _blocks(arena, lease.length) * arena.block_size
    return max(runs + [arena.size - end])


def _assert_sound(arena: Arena) -> list[Lease]:
    """The allocator is consistent; returns the live leases."""
    assert _problems(arena) == []
    live = arena.live_leases()
    end = 0
    for lease in live:  # by offset
        assert lease.offset >= end, f"leases overlap: {live}"
        end = lease.offset + _blocks(arena, lease.length) * arena.block_size
        assert end <= arena.size
    assert arena.used_bytes() == sum(_blocks(arena, lease.length) for lease in live) * arena.block_size
    return live


def _fill_free_space(arena: Arena, owner: int) -> None:
    """Allocate every free byte (largest run first, repeatedly), check, give it back."""
    free = arena.size - arena.used_bytes()
    got = []
    while arena.used_bytes() < arena.size:
        n = _largest_free(arena)
        lease = arena.alloc(n, owner)
        assert lease is not None, "alloc found no room for the largest free run"
        got.append(lease)
    assert sum(lease.length for lease in got) == free
    for lease in got:
        assert arena.drop(lease, owner) is True
    assert arena.size - arena.used_bytes() == free


@pytest.fixture
def make_arena(shm_prefix):
    made = []

    def make(size=64 * 4096, **kw):
        a = Arena.create(shm_prefix, shm.new_run_id(), "arena", size, **kw)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()
        a.unlink()


# -- basics -------------------------------------------------------------------------


def test_alloc_view_refs_and_attach(make_arena, shm_prefix):
    a = make_arena(16 * 4096, block_size=4096, max_leases=8, max_owners=4)
    assert (a.size, a.block_size) == (16 * 4096, 4096)
    assert a.address % 4096 == 0 and a.address > 0
    lease = a.alloc(5000, 1)
    assert lease == Lease(lease.slot, lease.gen, 0, 5000)
    assert a.used_bytes() == 2 * 4096
    assert a.refs(lease) == {1: 1}
    with a.view(lease) as mv:
        assert len(mv) == 5000
        mv[:5] = b"hello"
    other = Arena.attach(shm_prefix, a._data.name.split("-")[1], "arena")
    try:
        assert other.valid(lease) and bytes(other.view(lease)[:5]) == b"hello"
        other.addref(lease, 2)
        assert a.refs(lease) == {1: 1, 2: 1}
        other.transfer(lease, 2, 3)
        assert a.refs(lease) == {1: 1, 3: 1}
        assert a.drop(lease, 1) is False
        assert other.drop(lease, 3) is True
        assert not a.valid(lease) and not other.valid(lease)
    finally:
        other.close()
    assert a.used_bytes() == 0 and _largest_free(a) == a.size


def test_argument_errors(make_arena):
    a = make_arena(8 * 64, block_size=64, max_leases=4, max_owners=2)
    for n in (0, -1, 8 * 64 + 1):
        with pytest.raises(ValueError):
            a.alloc(n, 0)
    with pytest.raises(ValueError):
        a.alloc(1, 2)  # owner out of range
    lease = a.alloc(8 * 64, 0)
    assert a.alloc(1, 0) is None  # no room now
    with pytest.raises(StaleLease):
        a.drop(lease, 1)  # owner 1 holds no reference
    with pytest.raises(StaleLease):
        a.transfer(lease, 1, 0)
    assert a.drop(lease, 0)
    leases = [a.alloc(64, 0) for _ in range(4)]
    with pytest.raises(ArenaFull, match="max_leases"):
        a.alloc(64, 0)
    for lease in leases:
        a.drop(lease, 0)


def test_create_refuses_what_it_cannot_hold_and_leaves_nothing(shm_prefix):
    run_id = shm.new_run_id()
    for size, kw in ((0, {}), (4096, {"block_size": 0}), (4096, {"max_leases": 0}),
                     (4096, {"max_owners": 4097})):
        with pytest.raises(ValueError):
            Arena.create(shm_prefix, run_id, "arena", size, **kw)
    assert shm.list_objects(shm_prefix) == []
    a = Arena.create(shm_prefix, run_id, "arena", 4096, block_size=64)
    try:
        a._data.unlink()  # data smaller than its table says: refused
        small = shm.Segment.create(shm.object_name(shm_prefix, run_id, "arena"), 64)
        small.close()
        with pytest.raises(shm.ShmError, match="smaller than its table"):
            Arena.attach(shm_prefix, run_id, "arena")
    finally:
        a.close()
        a.unlink()


def test_size_rounds_up_to_blocks(make_arena):
    a = make_arena(1000, block_size=256)
    assert a.size == 1024
    assert a.alloc(1024, 0) is not None


def test_stale_handles_after_reuse(make_arena):
    a = make_arena(4 * 64, block_size=64, max_leases=1, max_owners=2)
    first = a.alloc(100, 0)
    assert a.drop(first, 0)
    second = a.alloc(100, 0)
    assert second.slot == first.slot and second.offset == first.offset and second.gen != first.gen
    for call in (lambda: a.addref(first, 0), lambda: a.drop(first, 0), lambda: a.view(first),
                 lambda: a.refs(first), lambda: a.transfer(first, 0, 1)):
        with pytest.raises(StaleLease):
            call()
    assert not a.valid(first) and a.valid(second)
    assert not a.valid(first._replace(gen=second.gen, length=99))  # forged
    assert a.refs(second) == {0: 1}


def test_reclaim_drops_exactly_one_owner(make_arena):
    a = make_arena(32 * 64, block_size=64, max_owners=4)
    only3 = a.alloc(64, 3)
    a.addref(only3, 3)
    shared = a.alloc(128, 1)
    a.addref(shared, 3)
    other = a.alloc(64, 2)
    assert a.reclaim(3) == 3
    assert not a.valid(only3)
    assert a.refs(shared) == {1: 1} and a.refs(other) == {2: 1}
    assert a.reclaim(3) == 0
    _assert_sound(a)


def test_threads_and_two_attachments_in_one_process(make_arena, shm_prefix):
    a = make_arena(256 * 64, block_size=64, max_leases=256, max_owners=4)
    b = Arena.attach(shm_prefix, a._data.name.split("-")[1], "arena")
    errors = []

    def work(arena, owner, seed):
        rng = random.Random(seed)
        held = []
        try:
            for _ in range(1500):
                if held and rng.random() < 0.5:
                    arena.drop(held.pop(rng.randrange(len(held))), owner)
                else:
                    lease = arena.alloc(rng.randint(1, 256), owner)
                    if lease is not None:
                        held.append(lease)
            for lease in held:
                arena.drop(lease, owner)
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work, args=(arena, owner, owner))
               for owner, arena in enumerate((a, a, b, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    b.close()
    assert not errors
    assert _assert_sound(a) == []


# -- model-based ------------------------------------------------------------------------

BS, NBLK, MAXL, MAXO = 64, 24, 10, 4


class ArenaMachine(RuleBasedStateMachine):
    """The arena against a model: live lease -> {owner: references}."""

    leases = Bundle("leases")

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix
        self.arena = None
        self.model: dict[Lease, dict[int, int]] = {}
        self.gens: dict[int, set[int]] = {}

    @initialize()
    def make(self):
        self.arena = Arena.create(self.prefix, shm.new_run_id(), "sm", BS * NBLK, block_size=BS,
                                  max_leases=MAXL, max_owners=MAXO)

    def _free_runs(self) -> list[tuple[int, int]]:
        """(start block, length) of the free runs, by the model."""
        used = sorted((lease.offset // BS, _blocks(self.arena, lease.length)) for lease in self.model)
        runs, pos = [], 0
        for start, n in used:
            if start > pos:
                runs.append((pos, start - pos))
            pos = start + n
        if pos < NBLK:
            runs.append((pos, NBLK - pos))
        return runs

    @staticmethod
    def _pattern(lease: Lease) -> bytes:
        return struct.pack("<II", lease.slot, lease.gen) * (lease.length // 8 + 1)

    @rule(target=leases, nbytes=st.integers(1, BS * NBLK), owner=st.integers(0, MAXO - 1))
    def alloc(self, nbytes, owner):
        k = -(-nbytes // BS)
        fits = [start for start, n in self._free_runs() if n >= k]
        try:
            lease = self.arena.alloc(nbytes, owner)
        except ArenaFull:
            assert len(self.model) == MAXL and fits
            return multiple()
        if lease is None:
            assert not fits, f"alloc({nbytes}) found no room, but the model has runs at {fits}"
            return multiple()
        assert len(self.model) < MAXL
        assert lease.offset == fits[0] * BS, "not first fit"
        assert lease.length == nbytes
        assert lease.gen not in self.gens.setdefault(lease.slot, set()), "generation reused"
        self.gens[lease.slot].add(lease.gen)
        assert lease not in self.model
        self.model[lease] = {owner: 1}
        with self.arena.view(lease) as mv:
            mv[:] = self._pattern(lease)[:nbytes]
        return lease

    @rule(lease=leases, owner=st.integers(0, MAXO - 1))
    def addref(self, lease, owner):
        if lease not in self.model:
            with pytest.raises(StaleLease):
                self.arena.addref(lease, owner)
            return
        self.arena.addref(lease, owner)
        self.model[lease][owner] = self.model[lease].get(owner, 0) + 1

    @rule(lease=leases, owner=st.integers(0, MAXO - 1))
    def drop(self, lease, owner):
        refs = self.model.get(lease)
        if refs is None or not refs.get(owner):
            with pytest.raises(StaleLease):
                self.arena.drop(lease, owner)
            return
        refs[owner] -= 1
        if not refs[owner]:
            del refs[owner]
        freed = self.arena.drop(lease, owner)
        assert freed == (not refs)
        if freed:
            del self.model[lease]

    @rule(lease=leases, src=st.integers(0, MAXO - 1), dst=st.integers(0, MAXO - 1))
    def transfer(self, lease, src, dst):
        refs = self.model.get(lease)
        if refs is None or not refs.get(src):
            with pytest.raises(StaleLease):
                self.arena.transfer(lease, src, dst)
            return
        self.arena.transfer(lease, src, dst)
        refs[src] -= 1
        if not refs[src]:
            del refs[src]
        refs[dst] = refs.get(dst, 0) + 1

    @rule(owner=st.integers(0, MAXO - 1))
    def reclaim(self, owner):
        expected = sum(refs.get(owner, 0) for refs in self.model.values())
        assert self.arena.reclaim(owner) == expected
        for lease in list(self.model):
            self.model[lease].pop(owner, None)
            if not self.model[lease]:
                del self.model[lease]

    @rule(lease=leases)
    def stale_access(self, lease):
        if lease in self.model:
            assert self.arena.valid(lease)
            return
        assert not self.arena.valid(lease)
        for call in (self.arena.view, self.arena.refs):
            with pytest.raises(StaleLease):
                call(lease)

    @precondition(lambda self: self.arena is not None)
    @invariant()
    def agrees_with_model(self):
        a = self.arena
        live = _assert_sound(a)
        assert set(live) == set(self.model)
        assert a.used_bytes() == sum(_blocks(a, lease.length) for lease in self.model) * BS
        assert _largest_free(a) == max((n for _, n in self._free_runs()), default=0) * BS
        for lease, refs in self.model.items():
            assert a.refs(lease) == refs
            assert bytes(a.view(lease)) == self._pattern(lease)[:lease.length], "lease bytes clobbered"

    def teardown(self):
        a = self.arena
        if a is None:
            return
        try:
            for lease, refs in list(self.model.items()):
                for owner, n in refs.items():
                    for _ in range(n):
                        a.drop(lease, owner)
            assert a.used_bytes() == 0 and a.live_leases() == []
            assert _largest_free(a) == a.size
            whole = a.alloc(a.size, 0)
            assert whole is not None and a.drop(whole, 0)
            assert _problems(a) == []
        finally:
            a.close()
            a.unlink()


def test_arena_state_machine(shm_prefix):
    run_state_machine_as_test(lambda: ArenaMachine(shm_prefix))


# -- several processes ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_dead_holder_is_reclaimed_exactly(make_arena, shm_prefix):
    a = make_arena(64 * 4096, max_owners=8)
    run_id = a._data.name.split("-")[1]
    shared = a.alloc(10000, 0)
    r, w = os.pipe()

    def child():
        os.close(r)
        arena = Arena.attach(shm_prefix, run_id, "arena")
        mine = [arena.alloc(4096 * (i + 1), 3) for i in range(4)]
        arena.addref(mine[0], 3)
        arena.addref(shared, 3)
        arena.addref(shared, 3)
        given = arena.alloc(3000, 3)
        arena.transfer(given, 3, 0)
        for i, lease in enumerate(mine):
            arena.view(lease)[:4] = struct.pack("<I", i)
        os.write(w, repr([tuple(lease) for lease in mine] + [tuple(given)]).encode() + b"\n")
        while True:
            time.sleep(1)

    pid = fork_call(child)
    os.close(w)
    try:
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(r, 4096)
            assert chunk, "child died before reporting"
            line += chunk
    finally:
        os.close(r)
    *mine, given = [Lease(*t) for t in eval(line)]
    # What the child made is visible here while it lives.
    for i, lease in enumerate(mine):
        assert a.refs(lease) == ({3: 2} if i == 0 else {3: 1})
        assert struct.unpack("<I", a.view(lease)[:4])[0] == i
    assert a.refs(shared) == {0: 1, 3: 2} and a.refs(given) == {0: 1}
    _kill(pid)
    assert a.reclaim(3) == 2 + 3 + 2  # mine[0] twice, mine[1:] once each, shared twice
    assert not any(a.valid(lease) for lease in mine)
    assert a.refs(shared) == {0: 1} and a.refs(given) == {0: 1}
    assert set(_assert_sound(a)) == {shared, given}
    _fill_free_space(a, 5)
    assert a.drop(shared, 0) and a.drop(given, 0)
    assert a.used_bytes() == 0 and a.alloc(a.size, 1) is not None


def _hammer(prefix, run_id, owners, seed, shared, ready_fd, stop_fd=None):
    """A child: random alloc/addref/drop/transfer under ``owners`` until killed (or told to stop)."""
    arena = Arena.attach(prefix, run_id, "arena")
    rng = random.Random(seed)
    held = []  # (lease, owner) references this child holds
    for lease in shared:
        held.append((lease, owners[0]))
    os.write(ready_fd, b"r")
    ops = 0
    while True:
        ops += 1
        if stop_fd is not None and ops % 64 == 0 and select.select([stop_fd], [], [], 0)[0]:
            for lease, owner in held:
                arena.drop(lease, owner)
            return
        x = rng.random()
        if x < 0.35 or not held:
            owner = rng.choice(owners)
            lease = arena.alloc(rng.randint(1, arena.size // 8), owner)
            if lease is not None:
                held.append((lease, owner))
        elif x < 0.55:
            lease, _ = rng.choice(held)
            owner = rng.choice(owners)
            arena.addref(lease, owner)
            held.append((lease, owner))
        elif x < 0.7:
            i = rng.randrange(len(held))
            lease, owner = held[i]
            to = rng.choice(owners)
            arena.transfer(lease, owner, to)
            held[i] = (lease, to)
        else:
            lease, owner = held.pop(rng.randrange(len(held)))
            arena.drop(lease, owner)
        if len(held) > 40:
            lease, owner = held.pop(0)
            arena.drop(lease, owner)


@pytest.mark.timeout(120)
def test_sigkill_mid_mutation_loop(make_arena, shm_prefix):
    """A child SIGKILLed at random moments while mutating, beside a live one; the parent
    reclaims exactly the dead child's references and the allocator stays sound."""
    seed = int(os.environ.get("ARENA_KILL_SEED", random.randrange(2**32)))
    print(f"ARENA_KILL_SEED={seed}")
    rng = random.Random(seed)
    a = make_arena(256 * 1024, block_size=1024, max_leases=512, max_owners=8)
    run_id = a._data.name.split("-")[1]
    mine = [a.alloc(1024 * (i + 1), 0) for i in range(4)]  # the parent's, owner 0
    survivor_owner, victim_owners = 7, [1, 2]
    for lease in mine:
        a.addref(lease, survivor_owner)
    model_mine = {lease: 1 for lease in mine}  # owner 0's references, known exactly
    r, w = os.pipe()
    stop_r, stop_w = os.pipe()
    survivor = fork_call(_hammer, shm_prefix, run_id, [survivor_owner], rng.randrange(2**32),
                     list(mine), w, stop_r)
    assert os.read(r, 1) == b"r"
    kills = 0
    recoveries_before = a.recoveries
    try:
        for i in range(60):
            for lease in mine:  # the victim will drop these references as it likes
                a.addref(lease, victim_owners[0])
            victim = fork_call(_hammer, shm_prefix, run_id, victim_owners, rng.randrange(2**32), list(mine), w)
            assert os.read(r, 1) == b"r"
            _kill_at_random_moment(victim, rng, lambda: a._h[arena_mod._H_SEQ] & 1, aim=i % 2 == 1)
            kills += 1
            assert _problems(a) == []  # repairs if the victim died mid-mutation
            snap = _snapshot(a)  # atomically: the survivor is still at work
            expected = sum(refs.get(o, 0) for refs in snap.values() for o in victim_owners)
            assert a.reclaim(victim_owners[0]) + a.reclaim(victim_owners[1]) == expected
            for lease, refs in snap.items():
                # The survivor mutates its own references meanwhile; all others are exact.
                keep = {o: n for o, n in refs.items() if o not in victim_owners and o != survivor_owner}
                if not keep and survivor_owner not in refs:
                    assert not a.valid(lease), f"{lease} held only by the dead child survived"
                elif keep:
                    now = _snapshot(a)[lease]  # held by owner 0: stays valid
                    assert {o: n for o, n in now.items() if o != survivor_owner} == keep
            for lease, n in model_mine.items():
                assert a.refs(lease).get(0) == n
            assert _problems(a) == []
    finally:
        os.write(stop_w, b"s")
        code = wait_child(survivor)
        for fd in (r, w, stop_r, stop_w):
            os.close(fd)
    assert code == 0, "the surviving child failed"
    # recoveries: kills that left the metadata mid-mutation (repaired by whoever locked next)
    print(f"kills={kills} recoveries={a.recoveries - recoveries_before}")
    assert a.reclaim(survivor_owner) == 0  # it dropped everything it held on the way out
    assert set(_assert_sound(a)) == set(mine)
    _fill_free_space(a, 3)
    for lease in mine:
        assert a.drop(lease, 0)
    assert a.used_bytes() == 0
    whole = a.alloc(a.size, 1)
    assert whole is not None and a.drop(whole, 1)


def _die_at(point: str, nth: int = 1):
    calls = [0]

    def hook(p):
        if p == point:
            calls[0] += 1
            if calls[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _state(a: Arena):
    return {lease: a.refs(lease) for lease in a.live_leases()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point,op", [
    ("alloc.filled", "alloc"), ("alloc.committed", "alloc"), ("alloc.mapped", "alloc"),
    ("free.unref", "drop"), ("free.committed", "drop"),
    ("free.unref", "reclaim"), ("free.committed", "reclaim"),
    ("transfer.added", "transfer"),
])
def test_torn_metadata_is_rolled_back(make_arena, point, op):
    """A child SIGKILLed at a chosen point inside a mutation leaves dirty metadata;
    the next lock holder rolls the half-done operation back."""
    a = make_arena(32 * 64, block_size=64, max_leases=8, max_owners=4)
    keep = a.alloc(200, 0)
    victim = a.alloc(100, 1)
    a.addref(keep, 1)
    before = _state(a)
    recoveries = a.recoveries

    def child():
        arena_mod._fault_hook = _die_at(point)
        if op == "alloc":
            a.alloc(300, 2)  # uses the inherited object: the fork re-opened its lock
        elif op == "drop":
            a.drop(victim, 1)
        elif op == "reclaim":
            a.reclaim(1)
        else:
            a.transfer(keep, 1, 3)
        raise AssertionError(f"fault point {point} was not reached")

    assert wait_child(fork_call(child)) == -signal.SIGKILL
    assert a._h[arena_mod._H_SEQ] & 1, "metadata should be left dirty"
    if op == "reclaim":
        # Slot by slot: ``keep`` (slot 0) was done before the kill, ``victim`` rolled back.
        before[keep] = {0: 1}
    assert _state(a) == before  # (the first locked call repaired it)
    assert a.recoveries == recoveries + 1
    _assert_sound(a)
    # And it works on: the operation again, in this process.
    if op == "drop":
        assert a.drop(victim, 1)
    elif op == "reclaim":
        assert a.reclaim(1) == 1 and not a.valid(victim)
    _fill_free_space(a, 2)


@pytest.mark.timeout(60)
def test_reclaim_killed_midway_finishes_on_retry(make_arena):
    a = make_arena(32 * 64, block_size=64, max_leases=8, max_owners=4)
    leases = [a.alloc(64, 1) for _ in range(4)]
    a.addref(leases[1], 0)

    def child():
        arena_mod._fault_hook = _die_at("reclaim.slot", nth=3)  # two slots done, third journaled
        a.reclaim(1)

    assert wait_child(fork_call(child)) == -signal.SIGKILL
    live = set(a.live_leases())
    assert leases[0] not in live and a.refs(leases[1]) == {0: 1}  # done before the kill
    assert a.refs(leases[2]) == {1: 1} and a.refs(leases[3]) == {1: 1}  # rolled back / untouched
    assert a.reclaim(1) == 2
    assert set(_assert_sound(a)) == {leases[1]}
