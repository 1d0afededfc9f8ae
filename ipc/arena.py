"""A shared-memory region carved into reference-counted leases, usable from many processes.

Two segments per arena: ``<prefix>-<run>-<what>`` holds the data (the region a
sender registers with Mooncake once) and ``<prefix>-<run>-<what>.meta`` the
allocator. A lease is ``(slot, gen, offset, length)``: a slot of the lease table,
that slot's generation (bumped on every reuse, so an old handle is detected as
stale, never silently read), the byte offset in the data segment and the length
asked for. Space is handed out in whole blocks, first fit.

Metadata (all in the ``.meta`` segment)::

    header    int64[16]: magic, size, block_size, max_leases, max_owners, the
              segment's size (ipc/shared_table.py), seq (odd while a mutation is
              in progress), used blocks, live leases, recoveries, journal slot
              (-1 = none), ...
    journal   the pre-image of the one lease slot being mutated
    lease table (the source of truth), column-wise:
              state u8 (0 FREE, 1 LIVE), gen u32, start block i64, nblocks i64,
              length i64, refs u32[max_leases, max_owners]
    block map u8[nblocks]: 0 free, 1 used; *derived* from the live leases

Locking: every mutation (and every read that must be exact) holds the ``.meta``
segment's ``SegmentLock``, which the kernel drops when its holder dies, however it
dies.

Crash consistency (a holder SIGKILLed anywhere):

* A mutation first makes ``seq`` odd, then, per lease slot it touches, writes the
  slot's pre-image to the journal and only then publishes the journal's slot number;
  it ends with the journal slot cleared and ``seq`` even again.
* The next lock holder that finds ``seq`` odd rolls the journaled slot back to its
  pre-image (so a single-slot operation happened wholly or not at all), rebuilds
  the block map and counters from the lease table, and makes ``seq`` even.
* Within a mutation the order also keeps the table sane on its own: a new lease is
  filled in before its state byte says LIVE (the commit point), a freed lease is
  FREE in the table before its blocks are cleared in the map, and the map is
  searched only while ``seq`` is even, so a half-made lease is never LIVE and a
  half-freed one never overlaps a new one.
* Operations that change one 32-bit counter and nothing derived (an addref, a drop
  that leaves references) are a single aligned store and skip the journal.
* ``reclaim`` journals slot by slot: a crash leaves a prefix of it done, and
  reclaiming again finishes it.
"""

from __future__ import annotations

from operator import index as _index
from typing import NamedTuple

import numpy as np

from . import shm
from .segment_lock import SegmentLock
from .shared_table import SharedTable, lay_out

__all__ = ["Arena", "ArenaFull", "Lease", "StaleLease"]


class ArenaFull(RuntimeError):
    """Every lease slot (``max_leases``) is in use."""


class StaleLease(RuntimeError):
    """The lease was freed or its slot reused (generation changed), or the owner holds no reference."""


class Lease(NamedTuple):
    slot: int
    gen: int
    offset: int
    length: int

    def __reduce__(self):  # a NamedTuple's own way calls back into Python twice; leases cross rings in records
        return (Lease, tuple(self))


# header words (int64)
_H_MAGIC, _H_SIZE, _H_BS, _H_MAXL, _H_MAXO, _H_TOTAL, _H_SEQ, _H_USED, _H_LIVE, _H_RECOV, _H_JSLOT = range(11)
_H_WORDS = 16
# journal words (int64): state, gen, start, nblocks, length; then u32 refs[max_owners]
_J_WORDS = 8
_FREE, _LIVE = 0, 1
_U32_MAX = 0xFFFF_FFFF

# Test hook: called with a point name inside mutations (tests SIGKILL the process there).
_fault_hook = None


def _layout(nblocks: int, max_leases: int, max_owners: int) -> dict[str, int]:
    off = lay_out(
        (
            ("header", 8 * _H_WORDS),
            ("jint", 8 * _J_WORDS),
            ("jrefs", 4 * max_owners),
            ("state", max_leases),
            ("gen", 4 * max_leases),
            ("start", 8 * max_leases),
            ("nblk", 8 * max_leases),
            ("length", 8 * max_leases),
            ("refs", 4 * max_leases * max_owners),
            ("map", nblocks),
        ),
        start=0,
    )
    off["total"] = (off["total"] + 4095) // 4096 * 4096
    return off


class Arena(SharedTable):
    """A region of shared memory leased out in blocks with per-owner reference counts.

    Its table is the ``.meta`` segment (a SharedTable); the data segment beside it is
    made, attached, closed and unlinked with it."""

    MAGIC = 0x3141_7265_6E61_0002  # "arena", layout 2
    KIND = "arena"
    GEOMETRY = ("size", "block_size", "max_leases", "max_owners")
    MAX_LEASES = 2**24  # lease slots an arena can have
    size: int  # the geometry (SharedTable.__init__ sets it from the header)
    block_size: int
    max_leases: int
    max_owners: int

    # -- construction ------------------------------------------------------

    @classmethod
    def segment_size(cls, size: int, block_size: int, max_leases: int, max_owners: int) -> int:
        if size <= 0 or block_size <= 0 or size % block_size:
            raise ValueError(f"arena size ({size}) and block_size ({block_size}) must be > 0")
        if not 1 <= max_leases <= cls.MAX_LEASES or not 1 <= max_owners <= 4096:
            raise ValueError(f"max_leases ({max_leases}) must be 1..2**24 and max_owners ({max_owners}) 1..4096")
        return _layout(size // block_size, max_leases, max_owners)["total"]

    @classmethod
    def format(cls, buf: memoryview, size: int, block_size: int, max_leases: int, max_owners: int) -> None:
        """posix_fallocate left the segment zeroed: all slots FREE, the map free; no journal."""
        buf[8 * _H_JSLOT : 8 * _H_JSLOT + 8] = (-1).to_bytes(8, "little", signed=True)

    @classmethod
    def segment_name(cls, prefix: str, run_id: str, what: str) -> str:
        return shm.object_name(prefix, run_id, what + ".meta")

    @classmethod
    def create(  # type: ignore[override]  # a signature of its own (shared_table.py)
        cls,
        prefix: str,
        run_id: str,
        what: str,
        size: int,
        *,
        block_size: int = 4096,
        max_leases: int = 4096,
        max_owners: int = 16,
        slices: int = 1,
        touch=None,
    ) -> "Arena":
        """`size` rounded up to whole blocks. `slices`, `touch`: the data's pages allocated in
        parts, each in a context of its own (shm.Segment.create: a NUMA first touch per part)."""
        size, block_size = _index(size), _index(block_size)
        geometry = (
            -(-size // block_size) * block_size if block_size > 0 else size,
            block_size,
            _index(max_leases),
            _index(max_owners),
        )
        cls.segment_size(*geometry)  # checked before anything is made
        data = shm.Segment.create(shm.object_name(prefix, run_id, what), geometry[0], slices=slices, touch=touch)
        try:
            meta = cls.create_segment(prefix, run_id, what, *geometry)
        except BaseException:
            data.close()
            data.unlink()
            raise
        try:
            return cls(meta, data)
        except BaseException:
            for seg in (meta, data):
                seg.close()
                seg.unlink()
            raise

    @classmethod
    def attach(cls, prefix: str, run_id: str, what: str) -> "Arena":  # type: ignore[override]  # a signature of its own (shared_table.py)
        meta = cls.attach_segment(prefix, run_id, what)
        try:
            data = shm.Segment.attach(shm.object_name(prefix, run_id, what))
        except BaseException:
            meta.close()
            raise
        try:
            return cls(meta, data)
        except BaseException:
            data.close()
            meta.close()
            raise

    def __init__(self, meta: shm.Segment, data: shm.Segment):
        super().__init__(meta)
        self._data, self._meta = data, meta
        self.nblocks = self.size // self.block_size
        L, owners, nb = self.max_leases, self.max_owners, self.nblocks
        if data.size < self.size:
            raise shm.ShmError(f"arena data {data.name!r} is smaller than its table {meta.name!r} says")
        lay = self._lay = _layout(nb, L, owners)
        mv, mm = meta.buf, meta.mapped
        # memoryview casts for scalar access (fast, plain ints), numpy for scans.
        self._h = mv[lay["header"] : lay["header"] + 8 * _H_WORDS].cast("q")
        self._jq = mv[lay["jint"] : lay["jint"] + 8 * _J_WORDS].cast("q")
        self._jr = mv[lay["jrefs"] : lay["jrefs"] + 4 * owners].cast("I")
        self._st = mv[lay["state"] : lay["state"] + L]
        self._gen = mv[lay["gen"] : lay["gen"] + 4 * L].cast("I")
        self._start = mv[lay["start"] : lay["start"] + 8 * L].cast("q")
        self._nblk = mv[lay["nblk"] : lay["nblk"] + 8 * L].cast("q")
        self._len = mv[lay["length"] : lay["length"] + 8 * L].cast("q")
        self._refs = mv[lay["refs"] : lay["refs"] + 4 * L * owners].cast("I")
        self._map = mv[lay["map"] : lay["map"] + nb]
        self._mm = mm
        self._n_state = np.frombuffer(mm, np.uint8, L, lay["state"])
        self._n_start = np.frombuffer(mm, np.int64, L, lay["start"])
        self._n_nblk = np.frombuffer(mm, np.int64, L, lay["nblk"])
        self._n_refs = np.frombuffer(mm, np.uint32, L * owners, lay["refs"]).reshape(L, owners)
        self._n_map = np.frombuffer(mm, np.uint8, nb, lay["map"])
        self._zeros = memoryview(bytes(nb))
        self._ones = memoryview(b"\x01" * nb)
        self._zrow = memoryview(bytes(4 * owners)).cast("I")
        a = np.frombuffer(data.mapped, np.uint8, 1, 0)
        self.address = int(a.ctypes.data)
        del a
        self._lock = SegmentLock(meta, on_acquire=self._recover_if_dirty)

    # -- locking and recovery ---------------------------------------------

    def _recover_if_dirty(self) -> None:
        """The lock just taken: roll back what a holder killed mid-mutation left."""
        if self._h[_H_SEQ] & 1:
            self._recover()

    def _begin(self) -> None:
        """Enter a mutation (lock held, seq even): seq odd, no journaled slot yet."""
        h = self._h
        h[_H_SEQ] += 1
        h[_H_JSLOT] = -1

    def _journal(self, slot: int) -> None:
        """Save ``slot``'s pre-image; publish the slot number only once it is whole."""
        h, jq = self._h, self._jq
        h[_H_JSLOT] = -1
        jq[0] = self._st[slot]
        jq[1] = self._gen[slot]
        jq[2] = self._start[slot]
        jq[3] = self._nblk[slot]
        jq[4] = self._len[slot]
        b = slot * self.max_owners
        self._jr[:] = self._refs[b : b + self.max_owners]
        h[_H_JSLOT] = slot

    def _end(self) -> None:
        h = self._h
        h[_H_JSLOT] = -1
        h[_H_SEQ] += 1

    def _abort(self) -> None:
        """An exception inside a mutation: undo it as a crash would be undone."""
        if self._h[_H_SEQ] & 1:
            self._recover()

    def _recover(self) -> None:
        """Lock held, seq odd: roll the journaled slot back, rebuild what is derived."""
        h = self._h
        j = h[_H_JSLOT]
        if 0 <= j < self.max_leases:
            jq = self._jq
            self._st[j] = _FREE  # not LIVE while half restored
            self._gen[j] = jq[1]
            self._start[j] = jq[2]
            self._nblk[j] = jq[3]
            self._len[j] = jq[4]
            b = j * self.max_owners
            self._refs[b : b + self.max_owners] = self._jr
            self._st[j] = jq[0]
        h[_H_JSLOT] = -1
        self._rebuild()
        h[_H_RECOV] += 1
        h[_H_SEQ] += 1

    def _rebuild(self) -> None:
        """Derive the block map and counters from the lease table."""
        state = self._n_state
        live = state == _LIVE
        # A LIVE lease nobody references is unreachable: free it.
        orphan = live & (self._n_refs.sum(axis=1, dtype=np.uint64) == 0)
        if orphan.any():
            state[orphan] = _FREE
            live &= ~orphan
        # Anything but FREE/LIVE in a state byte is garbage: treat as FREE.
        state[(state != _LIVE) & (state != _FREE)] = _FREE
        idx = np.flatnonzero(live)
        starts, counts = self._n_start[idx], self._n_nblk[idx]
        bad = (starts < 0) | (counts <= 0) | (starts + counts > self.nblocks)
        if bad.any():
            raise RuntimeError(
                f"arena {self._meta.name!r}: lease table holds impossible leases "
                f"(slots {idx[bad].tolist()}); metadata is corrupt"
            )
        cover = self._coverage(starts, counts)
        if cover.size and cover.max() > 1:
            raise RuntimeError(f"arena {self._meta.name!r}: live leases overlap; metadata is corrupt")
        self._n_map[:] = cover > 0
        h = self._h
        h[_H_USED] = int(counts.sum())
        h[_H_LIVE] = int(idx.size)

    def _coverage(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        d = np.zeros(self.nblocks + 1, np.int32)
        np.add.at(d, starts, 1)
        np.add.at(d, starts + counts, -1)
        return np.cumsum(d[:-1])

    # -- checks --------------------------------------------------------------

    def _owner(self, owner) -> int:
        owner = _index(owner)
        if not 0 <= owner < self.max_owners:
            raise ValueError(f"owner {owner} out of range 0..{self.max_owners - 1}")
        return owner

    def _slot_of(self, lease) -> int:
        """Lock held: the slot of a valid lease, else StaleLease."""
        slot, gen, offset, length = lease
        if (
            not 0 <= slot < self.max_leases
            or self._st[slot] != _LIVE
            or self._gen[slot] != gen
            or self._start[slot] * self.block_size != offset
            or self._len[slot] != length
        ):
            raise StaleLease(f"lease {tuple(lease)} is stale (freed or its slot reused)")
        return slot

    def _count_of(self, lease, owner: int) -> tuple[int, int, int]:
        """Lock held: the slot of a valid lease, where ``owner``'s count of it is, and the count."""
        slot = self._slot_of(lease)
        i = slot * self.max_owners + owner
        return slot, i, self._refs[i]

    def _held_by(self, lease, owner: int) -> tuple[int, int, int]:
        """``_count_of``, or StaleLease when ``owner`` holds no reference."""
        slot, i, n = self._count_of(lease, owner)
        if n == 0:
            raise StaleLease(f"owner {owner} holds no reference to lease {tuple(lease)}")
        return slot, i, n

    # -- operations ----------------------------------------------------------

    def alloc(self, nbytes: int, owner: int) -> Lease | None:
        """A new lease of ``nbytes`` holding one reference of ``owner``; None if no contiguous room now.

        Raises ValueError for ``nbytes <= 0`` or ``> size`` and ArenaFull when all
        ``max_leases`` lease slots are live.
        """
        nbytes = _index(nbytes)
        owner = self._owner(owner)
        if not 0 < nbytes <= self.size:
            raise ValueError(f"cannot lease {nbytes} bytes from an arena of {self.size}")
        k = -(-nbytes // self.block_size)
        lay = self._lay
        with self._lock:
            pos = self._mm.find(self._zeros[:k], lay["map"], lay["map"] + self.nblocks)
            if pos < 0:
                return None
            start = pos - lay["map"]
            slot = self._mm.find(b"\0", lay["state"], lay["state"] + self.max_leases)
            if slot < 0:
                raise ArenaFull(
                    f"arena {self._data.name!r}: all {self.max_leases} lease slots are "
                    f"live; raise max_leases or drop leases"
                )
            slot -= lay["state"]
            self._begin()
            try:
                self._journal(slot)
                hook = _fault_hook
                gen = (self._gen[slot] + 1) & _U32_MAX
                self._gen[slot] = gen
                self._start[slot] = start
                self._nblk[slot] = k
                self._len[slot] = nbytes
                b = slot * self.max_owners
                self._refs[b : b + self.max_owners] = self._zrow
                self._refs[b + owner] = 1
                if hook is not None:
                    hook("alloc.filled")
                self._st[slot] = _LIVE  # commit
                if hook is not None:
                    hook("alloc.committed")
                self._map[start : start + k] = self._ones[:k]
                if hook is not None:
                    hook("alloc.mapped")
                self._h[_H_USED] += k
                self._h[_H_LIVE] += 1
                self._end()
            except BaseException:
                self._abort()
                raise
            return Lease(slot, gen, start * self.block_size, nbytes)

    def addref(self, lease: Lease, owner: int) -> None:
        owner = self._owner(owner)
        with self._lock:
            _, i, n = self._count_of(lease, owner)
            if n >= _U32_MAX:
                raise OverflowError(f"owner {owner} holds {n} references to lease {tuple(lease)}")
            self._refs[i] = n + 1  # one aligned store: no journal needed

    def drop(self, lease: Lease, owner: int) -> bool:
        """Drop one reference of ``owner``; True if that freed the lease."""
        owner = self._owner(owner)
        with self._lock:
            slot, i, n = self._held_by(lease, owner)
            b = slot * self.max_owners
            if n > 1 or sum(self._refs[b : b + self.max_owners]) > 1:
                self._refs[i] = n - 1  # one aligned store: no journal needed
                return False
            self._begin()
            try:
                self._journal(slot)
                self._free_slot(slot, i)
                self._end()
            except BaseException:
                self._abort()
                raise
            return True

    def _free_slot(self, slot: int, i: int) -> None:
        """Inside a mutation, slot journaled: zero ref ``i`` and free the lease."""
        hook = _fault_hook
        self._refs[i] = 0
        if hook is not None:
            hook("free.unref")
        self._st[slot] = _FREE  # commit: from here the blocks are not the lease's
        if hook is not None:
            hook("free.committed")
        start, k = self._start[slot], self._nblk[slot]
        self._map[start : start + k] = self._zeros[:k]
        self._h[_H_USED] -= k
        self._h[_H_LIVE] -= 1

    def transfer(self, lease: Lease, from_owner: int, to_owner: int) -> None:
        """Move one reference from ``from_owner`` to ``to_owner``, atomically."""
        src, dst = self._owner(from_owner), self._owner(to_owner)
        with self._lock:
            slot, _, _ = self._held_by(lease, src)
            base = slot * self.max_owners
            if src == dst:
                return
            if self._refs[base + dst] >= _U32_MAX:
                raise OverflowError(f"owner {dst} holds too many references to lease {tuple(lease)}")
            self._begin()
            try:
                self._journal(slot)
                self._refs[base + dst] += 1
                if _fault_hook is not None:
                    _fault_hook("transfer.added")
                self._refs[base + src] -= 1
                self._end()
            except BaseException:
                self._abort()
                raise

    def reclaim(self, owner: int) -> int:
        """Drop every reference ``owner`` holds (a dead process); return how many were dropped."""
        owner = self._owner(owner)
        with self._lock:
            col = self._n_refs[:, owner]
            slots = np.flatnonzero((col > 0) & (self._n_state == _LIVE))
            if slots.size == 0:
                return 0
            dropped = 0
            self._begin()
            try:
                for slot in slots.tolist():
                    i = slot * self.max_owners + owner
                    n = self._refs[i]
                    self._journal(slot)
                    b = slot * self.max_owners
                    if sum(self._refs[b : b + self.max_owners]) == n:
                        self._free_slot(slot, i)
                    else:
                        self._refs[i] = 0
                    dropped += n
                    if _fault_hook is not None:
                        _fault_hook("reclaim.slot")
                self._end()
            except BaseException:
                self._abort()
                raise
            return dropped

    # -- queries ---------------------------------------------------------------

    def _live_now(self, lease) -> bool:
        """Whether ``lease`` is live, read without the lock: its slot's generation is read
        before and after the rest, and every reuse of a slot bumps it first, so a lease freed
        and its slot leased again meanwhile shows as changed. (A caller that holds a
        reference, as stages do, sees no change: nobody else can free it.)"""
        slot, gen, offset, length = lease
        if self.closed or not 0 <= slot < self.max_leases:
            return False
        g = self._gen[slot]
        ok = (
            g == gen
            and self._st[slot] == _LIVE
            and self._start[slot] * self.block_size == offset
            and self._len[slot] == length
        )
        return ok and self._gen[slot] == g and not self._h[_H_SEQ] & 1

    def valid(self, lease: Lease) -> bool:
        try:
            if self._live_now(lease):
                return True
        except (ValueError, TypeError):
            return False
        with self._lock:  # a mutation in progress, or a dead writer's to roll back: ask under the lock
            try:
                self._slot_of(lease)
                return True
            except (StaleLease, ValueError, TypeError):
                return False

    def view(self, lease: Lease) -> memoryview:
        """A writable view of exactly ``lease.length`` bytes; StaleLease if not valid."""
        if not self._live_now(lease):
            with self._lock:
                self._slot_of(lease)
        return self._data.buf[lease.offset : lease.offset + lease.length]

    def refs(self, lease: Lease) -> dict[int, int]:
        """owner -> references held, for a valid lease (StaleLease otherwise)."""
        with self._lock:
            row = self._n_refs[self._slot_of(lease)]
            owners = np.flatnonzero(row)
            return {int(o): int(row[o]) for o in owners}

    def used_bytes(self) -> int:
        """Bytes in leased blocks (each lease counts whole blocks)."""
        with self._lock:
            return self._h[_H_USED] * self.block_size

    def room_for(self, lengths: list[int]) -> bool:
        """Whether leases of these lengths could all be had now, counting blocks and
        lease slots, not where the free blocks lie: False means an alloc of them fails
        for sure, a cheap test for a stage that waits for room."""
        blocks = sum(-(-_index(n) // self.block_size) for n in lengths)
        with self._lock:
            return blocks <= self.nblocks - self._h[_H_USED] and len(lengths) <= self.max_leases - self._h[_H_LIVE]

    def live_leases(self) -> list[Lease]:
        """Every live lease, by offset."""
        with self._lock:
            idx = np.flatnonzero(self._n_state == _LIVE)
            idx = idx[np.argsort(self._n_start[idx], kind="stable")]
            bs = self.block_size
            return [Lease(s, self._gen[s], self._start[s] * bs, self._len[s]) for s in idx.tolist()]

    @property
    def recoveries(self) -> int:
        """How many times a lock holder repaired metadata left mid-mutation."""
        return self._h[_H_RECOV]

    # -- teardown --------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        self._lock.close()
        super().close()
        self._data.close()

    def unlink(self) -> None:
        """Remove both segments' names (mappings stay valid until closed)."""
        self._data.unlink()
        self._meta.unlink()

    def __repr__(self) -> str:
        return (
            f"Arena({self._data.name!r}, size={self.size}, block_size={self.block_size}, "
            f"max_leases={self.max_leases}, max_owners={self.max_owners})"
        )
