"""A shared-memory region carved into reference-counted leases, usable from many processes.

Two segments per arena: ``<prefix>-<run>-<what>`` holds the data (the region a
sender registers with Mooncake once) and ``<prefix>-<run>-<what>.meta`` the
allocator. A lease is ``(slot, gen, offset, length)``: a slot of the lease table,
that slot's generation (bumped on every reuse, so an old handle is detected as
stale, never silently read), the byte offset in the data segment and the length
asked for. Space is handed out in whole blocks, first fit.

Metadata (all in the ``.meta`` segment)::

    header    int64[16]: magic, layout, size, block_size, nblocks, max_leases,
              max_owners, seq (odd while a mutation is in progress), used blocks,
              live leases, recoveries, journal slot (-1 = none), ...
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


_MAGIC = 0x3141_7265_6E61_0001  # "arena", layout 1
_LAYOUT = 1
# header words (int64)
_H_MAGIC, _H_LAYOUT, _H_SIZE, _H_BS, _H_NBLK, _H_MAXL, _H_MAXO, _H_SEQ, _H_USED, _H_LIVE, _H_RECOV, _H_JSLOT = range(12)
_H_WORDS = 16
# journal words (int64): state, gen, start, nblocks, length; then u32 refs[max_owners]
_J_WORDS = 8
_FREE, _LIVE = 0, 1
_U32_MAX = 0xFFFF_FFFF

# Test hook: called with a point name inside mutations (tests SIGKILL the process there).
_fault_hook = None


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


def _layout(nblocks: int, max_leases: int, max_owners: int) -> dict[str, int]:
    off = {}
    pos = 0
    for name, nbytes in (
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
    ):
        pos = _align(pos)
        off[name] = pos
        pos += nbytes
    off["total"] = _align(pos, 4096)
    return off


class Arena:
    """A region of shared memory leased out in blocks with per-owner reference counts."""

    # -- construction ------------------------------------------------------

    @classmethod
    def create(cls, prefix: str, run_id: str, what: str, size: int, *, block_size: int = 4096,
               max_leases: int = 4096, max_owners: int = 16, slices: int = 1, touch=None) -> "Arena":
        """`slices`, `touch`: the data's pages allocated in parts, each in a context of its
        own (shm.Segment.create: a NUMA first touch per part)."""
        size, block_size = _index(size), _index(block_size)
        max_leases, max_owners = _index(max_leases), _index(max_owners)
        if size <= 0 or block_size <= 0:
            raise ValueError(f"arena size ({size}) and block_size ({block_size}) must be > 0")
        if not 1 <= max_leases <= 2**24 or not 1 <= max_owners <= 4096:
            raise ValueError(f"max_leases ({max_leases}) must be 1..2**24 and max_owners ({max_owners}) 1..4096")
        nblocks = -(-size // block_size)
        data_name, meta_name = cls._names(prefix, run_id, what)
        lay = _layout(nblocks, max_leases, max_owners)
        data = shm.Segment.create(data_name, nblocks * block_size, slices=slices, touch=touch)
        try:
            meta = shm.Segment.create(meta_name, lay["total"])
        except BaseException:
            data.close()
            data.unlink()
            raise
        try:
            # posix_fallocate leaves the segment zeroed: all slots FREE, map free.
            h = np.frombuffer(meta.buf.obj, np.int64, _H_WORDS, lay["header"])
            h[_H_LAYOUT], h[_H_SIZE], h[_H_BS], h[_H_NBLK] = _LAYOUT, nblocks * block_size, block_size, nblocks
            h[_H_MAXL], h[_H_MAXO], h[_H_JSLOT] = max_leases, max_owners, -1
            h[_H_MAGIC] = _MAGIC  # last: attach refuses a half-made arena
            del h
            return cls(data, meta)
        except BaseException:
            for seg in (meta, data):
                seg.close()
                seg.unlink()
            raise

    @classmethod
    def attach(cls, prefix: str, run_id: str, what: str) -> "Arena":
        data_name, meta_name = cls._names(prefix, run_id, what)
        meta = shm.Segment.attach(meta_name)
        try:
            data = shm.Segment.attach(data_name)
        except BaseException:
            meta.close()
            raise
        try:
            return cls(data, meta)
        except BaseException:
            data.close()
            meta.close()
            raise

    @staticmethod
    def _names(prefix: str, run_id: str, what: str) -> tuple[str, str]:
        return shm.object_name(prefix, run_id, what), shm.object_name(prefix, run_id, what + ".meta")

    def __init__(self, data: shm.Segment, meta: shm.Segment):
        self._data, self._meta = data, meta
        mm = meta.buf.obj
        if meta.size < 8 * _H_WORDS:
            raise shm.ShmError(f"{meta.name!r} is too small to be an arena's metadata")
        hdr = np.frombuffer(mm, np.int64, _H_WORDS, 0)
        if int(hdr[_H_MAGIC]) != _MAGIC or int(hdr[_H_LAYOUT]) != _LAYOUT:
            raise shm.ShmError(f"{meta.name!r} is not an initialised arena (bad magic or layout)")
        self.size = int(hdr[_H_SIZE])
        self.block_size = int(hdr[_H_BS])
        self.nblocks = int(hdr[_H_NBLK])
        self.max_leases = int(hdr[_H_MAXL])
        self.max_owners = int(hdr[_H_MAXO])
        del hdr
        L, O, nb = self.max_leases, self.max_owners, self.nblocks
        lay = _layout(nb, L, O)
        if meta.size < lay["total"] or data.size < self.size:
            raise shm.ShmError(f"arena segments {meta.name!r}/{data.name!r} are smaller than their header says")
        self._lay = lay
        mv = meta.buf
        # memoryview casts for scalar access (fast, plain ints), numpy for scans.
        self._h = mv[lay["header"]:lay["header"] + 8 * _H_WORDS].cast("q")
        self._jq = mv[lay["jint"]:lay["jint"] + 8 * _J_WORDS].cast("q")
        self._jr = mv[lay["jrefs"]:lay["jrefs"] + 4 * O].cast("I")
        self._st = mv[lay["state"]:lay["state"] + L]
        self._gen = mv[lay["gen"]:lay["gen"] + 4 * L].cast("I")
        self._start = mv[lay["start"]:lay["start"] + 8 * L].cast("q")
        self._nblk = mv[lay["nblk"]:lay["nblk"] + 8 * L].cast("q")
        self._len = mv[lay["length"]:lay["length"] + 8 * L].cast("q")
        self._refs = mv[lay["refs"]:lay["refs"] + 4 * L * O].cast("I")
        self._map = mv[lay["map"]:lay["map"] + nb]
        self._views = [self._h, self._jq, self._jr, self._st, self._gen, self._start,
                       self._nblk, self._len, self._refs, self._map]
        self._mm = mm
        self._n_state = np.frombuffer(mm, np.uint8, L, lay["state"])
        self._n_start = np.frombuffer(mm, np.int64, L, lay["start"])
        self._n_nblk = np.frombuffer(mm, np.int64, L, lay["nblk"])
        self._n_refs = np.frombuffer(mm, np.uint32, L * O, lay["refs"]).reshape(L, O)
        self._n_map = np.frombuffer(mm, np.uint8, nb, lay["map"])
        self._zeros = memoryview(bytes(nb))
        self._ones = memoryview(b"\x01" * nb)
        self._zrow = memoryview(bytes(4 * O)).cast("I")
        a = np.frombuffer(data.buf.obj, np.uint8, 1, 0)
        self.address = int(a.ctypes.data)
        del a
        self._lock = SegmentLock(meta)
        self._closed = False

    # -- locking and recovery ---------------------------------------------

    def _acquire(self) -> None:
        if self._closed:
            raise ValueError("arena is closed")
        self._lock.acquire()
        try:
            if self._h[_H_SEQ] & 1:
                self._recover()
        except BaseException:
            self._lock.release()
            raise

    def _release(self) -> None:
        self._lock.release()

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
        self._jr[:] = self._refs[b:b + self.max_owners]
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
            self._refs[b:b + self.max_owners] = self._jr
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
            raise RuntimeError(f"arena {self._meta.name!r}: lease table holds impossible leases "
                               f"(slots {idx[bad].tolist()}); metadata is corrupt")
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
        if (not 0 <= slot < self.max_leases or self._st[slot] != _LIVE or self._gen[slot] != gen
                or self._start[slot] * self.block_size != offset or self._len[slot] != length):
            raise StaleLease(f"lease {tuple(lease)} is stale (freed or its slot reused)")
        return slot

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
        self._acquire()
        try:
            pos = self._mm.find(self._zeros[:k], lay["map"], lay["map"] + self.nblocks)
            if pos < 0:
                return None
            start = pos - lay["map"]
            slot = self._mm.find(b"\0", lay["state"], lay["state"] + self.max_leases)
            if slot < 0:
                raise ArenaFull(f"arena {self._data.name!r}: all {self.max_leases} lease slots are "
                                f"live; raise max_leases or drop leases")
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
                self._refs[b:b + self.max_owners] = self._zrow
                self._refs[b + owner] = 1
                if hook is not None:
                    hook("alloc.filled")
                self._st[slot] = _LIVE  # commit
                if hook is not None:
                    hook("alloc.committed")
                self._map[start:start + k] = self._ones[:k]
                if hook is not None:
                    hook("alloc.mapped")
                self._h[_H_USED] += k
                self._h[_H_LIVE] += 1
                self._end()
            except BaseException:
                self._abort()
                raise
            return Lease(slot, gen, start * self.block_size, nbytes)
        finally:
            self._release()

    def addref(self, lease: Lease, owner: int) -> None:
        owner = self._owner(owner)
        self._acquire()
        try:
            i = self._slot_of(lease) * self.max_owners + owner
            n = self._refs[i]
            if n >= _U32_MAX:
                raise OverflowError(f"owner {owner} holds {n} references to lease {tuple(lease)}")
            self._refs[i] = n + 1  # one aligned store: no journal needed
        finally:
            self._release()

    def drop(self, lease: Lease, owner: int) -> bool:
        """Drop one reference of ``owner``; True if that freed the lease."""
        owner = self._owner(owner)
        self._acquire()
        try:
            slot = self._slot_of(lease)
            i = slot * self.max_owners + owner
            n = self._refs[i]
            if n == 0:
                raise StaleLease(f"owner {owner} holds no reference to lease {tuple(lease)}")
            b = slot * self.max_owners
            if n > 1 or sum(self._refs[b:b + self.max_owners]) > 1:
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
        finally:
            self._release()

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
        self._map[start:start + k] = self._zeros[:k]
        self._h[_H_USED] -= k
        self._h[_H_LIVE] -= 1

    def transfer(self, lease: Lease, from_owner: int, to_owner: int) -> None:
        """Move one reference from ``from_owner`` to ``to_owner``, atomically."""
        src, dst = self._owner(from_owner), self._owner(to_owner)
        self._acquire()
        try:
            slot = self._slot_of(lease)
            base = slot * self.max_owners
            if self._refs[base + src] == 0:
                raise StaleLease(f"owner {src} holds no reference to lease {tuple(lease)}")
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
        finally:
            self._release()

    def reclaim(self, owner: int) -> int:
        """Drop every reference ``owner`` holds (a dead process); return how many were dropped."""
        owner = self._owner(owner)
        self._acquire()
        try:
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
                    if sum(self._refs[b:b + self.max_owners]) == n:
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
        finally:
            self._release()

    # -- queries ---------------------------------------------------------------

    def _live_now(self, lease) -> bool:
        """Whether ``lease`` is live, read without the lock: its slot's generation is read
        before and after the rest, and every reuse of a slot bumps it first, so a lease freed
        and its slot leased again meanwhile shows as changed. (A caller that holds a
        reference, as stages do, sees no change: nobody else can free it.)"""
        slot, gen, offset, length = lease
        if self._closed or not 0 <= slot < self.max_leases:
            return False
        g = self._gen[slot]
        ok = (g == gen and self._st[slot] == _LIVE and self._start[slot] * self.block_size == offset
              and self._len[slot] == length)
        return ok and self._gen[slot] == g and not self._h[_H_SEQ] & 1

    def valid(self, lease: Lease) -> bool:
        try:
            if self._live_now(lease):
                return True
        except (ValueError, TypeError):
            return False
        self._acquire()  # a mutation in progress, or a dead writer's to roll back: ask under the lock
        try:
            self._slot_of(lease)
            return True
        except (StaleLease, ValueError, TypeError):
            return False
        finally:
            self._release()

    def view(self, lease: Lease) -> memoryview:
        """A writable view of exactly ``lease.length`` bytes; StaleLease if not valid."""
        if not self._live_now(lease):
            self._acquire()
            try:
                self._slot_of(lease)
            finally:
                self._release()
        return self._data.buf[lease.offset:lease.offset + lease.length]

    def refs(self, lease: Lease) -> dict[int, int]:
        """owner -> references held, for a valid lease (StaleLease otherwise)."""
        self._acquire()
        try:
            row = self._n_refs[self._slot_of(lease)]
            owners = np.flatnonzero(row)
            return {int(o): int(row[o]) for o in owners}
        finally:
            self._release()

    def used_bytes(self) -> int:
        """Bytes in leased blocks (each lease counts whole blocks)."""
        self._acquire()
        try:
            return self._h[_H_USED] * self.block_size
        finally:
            self._release()

    def live_leases(self) -> list[Lease]:
        """Every live lease, by offset."""
        self._acquire()
        try:
            idx = np.flatnonzero(self._n_state == _LIVE)
            idx = idx[np.argsort(self._n_start[idx], kind="stable")]
            bs = self.block_size
            return [Lease(s, self._gen[s], self._start[s] * bs, self._len[s]) for s in idx.tolist()]
        finally:
            self._release()

    @property
    def recoveries(self) -> int:
        """How many times a lock holder repaired metadata left mid-mutation."""
        return self._h[_H_RECOV]

    # -- teardown --------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lock.close()
        for v in self._views:
            v.release()
        self._views = []
        for name in ("_h", "_jq", "_jr", "_st", "_gen", "_start", "_nblk", "_len", "_refs", "_map",
                     "_n_state", "_n_start", "_n_nblk", "_n_refs", "_n_map", "_mm"):
            setattr(self, name, None)
        self._meta.close()
        self._data.close()

    def unlink(self) -> None:
        """Remove both segments' names (mappings stay valid until closed)."""
        self._data.unlink()
        self._meta.unlink()

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Arena({self._data.name!r}, size={self.size}, block_size={self.block_size}, "
                f"max_leases={self.max_leases}, max_owners={self.max_owners})")
