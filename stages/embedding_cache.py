"""The embedding cache: a bytes-bounded LRU in two exclusive tiers, and in-flight dedup.

Key
    ``(modality, hash, span, hidden, dtype, salt)``, a tuple (``make_key``); never
    the content hash alone, so two models or dtypes never share an entry, nor two
    requests of different ``cache_salt``. ``hash`` is the worker's keyed hash of the
    pixels (``ipc.hashing.cache_hash``, bytes), or a trusted client's own hash (an int):
    the two never compare equal, so no client hash can name a keyed entry. The key
    the pixels are hashed under (``cache_key``) is the run's secret, or the operator's
    file's, shared by every stage process of the run.

Value
    The item's rows as one contiguous blob: the main rows (``span*hidden*itemsize``
    bytes) followed by the deepstack rows (``span*deepstack_width*itemsize``), see
    ``entry_nbytes`` / ``split_entry``. The cache itself only sees bytes of a length.

Tier 1, "arena"
    Entries are leases in the embedding arena (shared memory, registered with
    Mooncake, so a hit is shipped from where it lies). The cache holds exactly one
    reference per entry, as owner ``cache_owner``. Budget: ``arena_budget`` bytes,
    the sum of the lease lengths of tier-1 entries. Leave the arena larger than the
    budget: in-flight encodes and promotions need room too.

Tier 2, "host"
    Process-local ``bytes``, budget ``host_budget``. It only catches tier-1
    evictions (demotion: copy the bytes out, drop the arena reference). Evicted
    from tier 2 means gone ("eviction").

Documented behaviours
    * Tiers are exclusive: a key is in at most one tier at any time.
    * LRU: ``lookup`` hits and ``insert`` make the entry tier-1 MRU. Making room in
      tier 1 demotes its LRU entries (in LRU order) to tier-2 MRU; making room in
      tier 2 evicts its LRU entries.
    * Host hit = promotion: ``lookup`` allocates a lease (owner ``cache_owner``) in
      the arena, copies the bytes in, removes the host entry and makes the lease
      tier-1 MRU, demoting tier-1 LRU entries as needed for budget room.
    * Promotion with the arena full: when ``arena.alloc`` returns None, nothing
      moves: the entry stays in tier 2 (touched to MRU there), no tier-1 entry is
      demoted, and ``lookup`` returns None; ``last_status`` (and
      ``lookup_status``) says ``Status.NO_ROOM`` and ``stats()['promotion_no_room']``
      counts it. The caller may retry the lookup later or re-encode the item; an
      ``insert`` of the re-encoded lease then supersedes the host copy (below).
    * Oversize: an item longer than ``arena_budget`` is not cached at all (neither
      tier: a host entry could never be promoted, hence never shipped from the
      cache), evicts nothing, and counts ``oversize_skipped``. An entry longer than
      ``host_budget`` that is demoted from tier 1 is evicted right away.
    * ``insert`` of a key already in tier 1 returns False (the caller's lease is not
      adopted; its own reference is untouched). ``insert`` of a key that sits in
      tier 2 replaces the host copy with the new lease (tier-1 MRU, True): the
      fresh lease is ship-ready, the host copy is not.
    * Stale leases: if the arena says a tier-1 lease is stale (``StaleLease``, e.g.
      the cache owner was reclaimed), the entry is dropped and counted
      (``stale_dropped``); a lookup that finds one is a miss. A stale lease is never
      returned. ``insert`` of an already-stale lease returns False (counted too).

Only the cache stage touches the index, so there is no locking here.
"""
from __future__ import annotations

import enum
import os
import secrets
import stat
from collections import OrderedDict
from typing import Any, Hashable, Optional

from ipc import hashing, shm
from ipc.arena import Arena, ArenaFull, Lease, StaleLease

CacheKey = tuple  # (modality, hash, span, hidden, dtype, salt)


def make_key(modality: str, content_hash: bytes | int, span: int, hidden: int, dtype: str,
             salt: str = "") -> CacheKey:
    return (modality, content_hash, int(span), int(hidden), str(dtype), str(salt))


def cache_key(key_file: str, prefix: str, run_id: str) -> bytes:
    """The key this run hashes pixels under: the operator's `key_file` (workers that share
    it cache an image under the same key), or by default a random key of the run's own."""
    return read_key_file(key_file) if key_file else run_key(prefix, run_id)


def read_key_file(path: str) -> bytes:
    """The key in an operator's key file; ValueError says why it cannot be used. A file
    that every user may read (or write) gives the key away: refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
            raise ValueError(f"{path} is readable or writable by every user (mode {stat.S_IMODE(st.st_mode):o}), "
                             f"which gives the cache key away: chmod o-rw it (600 or 640)")
        data = os.read(fd, 4 * hashing.CACHE_KEY_BYTES)
    finally:
        os.close(fd)
    try:
        return hashing.parse_cache_key(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e} (make one: head -c 32 /dev/urandom > {path})") from None


def run_key(prefix: str, run_id: str) -> bytes:
    """The run's own random key, the same in every stage process of the run and in a
    restarted one: a shared-memory object of the run (mode 0600, swept with the run's
    other objects), made by whichever stage asks first. It is written in full under a
    name of its own, then linked to the run's name, so that a stage never reads a
    half-written key, and of two stages that make one at once, the first link wins."""
    path = os.path.join(shm.SHM_DIR, shm.object_name(prefix, run_id, "cachekey"))
    try:
        return _read_run_key(path)
    except FileNotFoundError:
        pass
    mine = os.path.join(shm.SHM_DIR, shm.object_name(prefix, run_id, f"cachekey.{secrets.token_hex(4)}"))
    fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, hashing.new_cache_key())
        os.close(fd)
        try:
            os.link(mine, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(mine)
    return _read_run_key(path)


def _read_run_key(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        data = os.read(fd, hashing.CACHE_KEY_BYTES + 1)
    finally:
        os.close(fd)
    # Another user could have made it first in the shared /dev/shm, knowing the key.
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise RuntimeError(f"{path} is not this user's alone (uid {st.st_uid}, mode "
                           f"{stat.S_IMODE(st.st_mode):o}): refusing the cache key in it")
    if len(data) != hashing.CACHE_KEY_BYTES:
        raise RuntimeError(f"{path} holds {len(data)} bytes, not a cache key of {hashing.CACHE_KEY_BYTES}")
    return data


def entry_nbytes(span: int, hidden: int, deepstack_width: int, itemsize: int) -> int:
    """Bytes of one entry: main rows then deepstack rows, no padding."""
    return span * (hidden + deepstack_width) * itemsize


def split_entry(buf, span: int, hidden: int, deepstack_width: int, dtype) -> tuple[Any, Any]:
    """``(main, deepstack or None)`` numpy views over an entry's bytes (no copy)."""
    import numpy as np

    dt = np.dtype(dtype)
    flat = np.frombuffer(buf, dtype=dt, count=span * (hidden + deepstack_width))
    main = flat[: span * hidden].reshape(span, hidden)
    deep = flat[span * hidden:].reshape(span, deepstack_width) if deepstack_width else None
    return main, deep


class Status(enum.Enum):
    HIT_ARENA = "hit_arena"  # found in tier 1
    HIT_HOST = "hit_host"  # found in tier 2 and promoted to tier 1
    MISS = "miss"  # not cached (or its lease had gone stale)
    NO_ROOM = "no_room"  # in tier 2, but the arena had no room to promote it now


def _check_key(key) -> None:
    if not isinstance(key, tuple) or len(key) != 6:
        raise TypeError(
            f"cache key must be a (modality, hash, span, hidden, dtype, salt) tuple, got {key!r}"
        )


class EmbeddingCache:
    def __init__(self, arena: Arena, cache_owner: int, arena_budget: int, host_budget: int):
        if arena_budget < 0 or host_budget < 0:
            raise ValueError(
                f"cache budgets must be >= 0 bytes (arena_budget={arena_budget}, "
                f"host_budget={host_budget})"
            )
        self.arena = arena
        self.cache_owner = cache_owner
        self.arena_budget = arena_budget
        self.host_budget = host_budget
        # LRU first, MRU last.
        self._t1: OrderedDict[Hashable, Lease] = OrderedDict()
        self._t2: OrderedDict[Hashable, bytes] = OrderedDict()
        self._t1_bytes = 0
        self._t2_bytes = 0
        self.last_status: Optional[Status] = None
        self._c = dict.fromkeys(
            (
                "hits_arena",
                "hits_host",
                "misses",
                "promotions",
                "promotion_no_room",
                "demotions",
                "evictions",
                "oversize_skipped",
                "inserts",
                "insert_present",
                "stale_dropped",
                "given_back",
            ),
            0,
        )

    # -- lookups ---------------------------------------------------------

    def lookup(self, key, reader_owner: int) -> Optional[Lease]:
        """A lease on which ``reader_owner`` now holds its own reference, or None.

        None is a miss, or (``last_status is Status.NO_ROOM``) a host hit that could
        not be promoted for lack of arena room right now.
        """
        return self.lookup_status(key, reader_owner)[1]

    def lookup_status(self, key, reader_owner: int) -> tuple[Status, Optional[Lease]]:
        _check_key(key)
        status, lease = self._lookup(key, reader_owner)
        self.last_status = status
        return status, lease

    def _lookup(self, key, reader_owner: int) -> tuple[Status, Optional[Lease]]:
        lease = self._t1.get(key)
        if lease is not None:
            try:
                self.arena.addref(lease, reader_owner)
            except StaleLease:
                self._forget_stale(key)
                self._c["misses"] += 1
                return Status.MISS, None
            self._t1.move_to_end(key)
            self._c["hits_arena"] += 1
            return Status.HIT_ARENA, lease
        data = self._t2.get(key)
        if data is None:
            self._c["misses"] += 1
            return Status.MISS, None
        self._c["hits_host"] += 1
        return self._promote(key, data, reader_owner)

    def __contains__(self, key) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def _promote(self, key, data: bytes, reader_owner: int) -> tuple[Status, Optional[Lease]]:
        n = len(data)
        try:
            lease = self.arena.alloc(n, self.cache_owner) if n <= self.arena_budget else None
        except ArenaFull:  # every lease slot is live: no room either
            lease = None
        if lease is None:
            self._t2.move_to_end(key)
            self._c["promotion_no_room"] += 1
            return Status.NO_ROOM, None
        try:
            with self.arena.view(lease) as mv:
                mv[:] = data
            self.arena.addref(lease, reader_owner)
        except BaseException:
            self._drop_quiet(lease, reader_owner)
            self._drop_quiet(lease, self.cache_owner)
            raise
        del self._t2[key]
        self._t2_bytes -= n
        self._make_room_t1(n)
        self._t1[key] = lease
        self._t1_bytes += n
        self._c["promotions"] += 1
        return Status.HIT_HOST, lease

    # -- inserts ---------------------------------------------------------

    def insert(self, key, lease: Lease) -> bool:
        """Cache the rows in ``lease`` (the caller keeps its own reference).

        The cache adds its reference (``cache_owner``) and makes the entry tier-1
        MRU, demoting/evicting LRU entries to fit. False if not cached: oversize,
        key already in tier 1, or a stale lease. A key in tier 2 is superseded.
        """
        _check_key(key)
        n = lease.length
        if n > self.arena_budget:
            self._c["oversize_skipped"] += 1
            return False
        if key in self._t1:
            self._c["insert_present"] += 1
            return False
        try:
            self.arena.addref(lease, self.cache_owner)
        except StaleLease:
            self._c["stale_dropped"] += 1
            return False
        old = self._t2.pop(key, None)
        if old is not None:
            self._t2_bytes -= len(old)
        self._make_room_t1(n)
        self._t1[key] = lease
        self._t1_bytes += n
        self._c["inserts"] += 1
        return True

    def give_back(self, nbytes: int) -> int:
        """Demote tier-1 entries, least recently used first, until ``nbytes`` of the arena
        are given back (or the tier is empty): an item to encode must never wait for
        rows that are only cached. Returns the bytes given back."""
        freed = 0
        while self._t1 and freed < nbytes:
            key, lease = self._t1.popitem(last=False)
            self._t1_bytes -= lease.length
            freed += lease.length
            self._demote(key, lease)
            self._c["given_back"] += lease.length
        return freed

    # -- eviction machinery ---------------------------------------------

    def _make_room_t1(self, n: int) -> None:
        while self._t1 and self._t1_bytes + n > self.arena_budget:
            key, lease = self._t1.popitem(last=False)
            self._t1_bytes -= lease.length
            self._demote(key, lease)

    def _demote(self, key, lease: Lease) -> None:
        """Move a tier-1 entry (already out of the tier-1 index) to tier 2 MRU."""
        n = lease.length
        data = None
        try:
            if n <= self.host_budget:
                with self.arena.view(lease) as mv:
                    data = bytes(mv)
            self.arena.drop(lease, self.cache_owner)
        except StaleLease:
            self._c["stale_dropped"] += 1
            return
        if data is None:
            self._c["evictions"] += 1
            return
        while self._t2 and self._t2_bytes + n > self.host_budget:
            _, old = self._t2.popitem(last=False)
            self._t2_bytes -= len(old)
            self._c["evictions"] += 1
        self._t2[key] = data
        self._t2_bytes += n
        self._c["demotions"] += 1

    def _forget_stale(self, key) -> None:
        lease = self._t1.pop(key)
        self._t1_bytes -= lease.length
        self._c["stale_dropped"] += 1
        self._drop_quiet(lease, self.cache_owner)

    def _drop_quiet(self, lease: Lease, owner: int) -> None:
        try:
            self.arena.drop(lease, owner)
        except StaleLease:
            pass

    # -- the rest --------------------------------------------------------

    def stats(self) -> dict:
        out = dict(self._c)
        out.update(
            arena_bytes=self._t1_bytes,
            arena_entries=len(self._t1),
            arena_budget=self.arena_budget,
            host_bytes=self._t2_bytes,
            host_entries=len(self._t2),
            host_budget=self.host_budget,
        )
        return out

    def keys(self, tier: str) -> list:
        """Keys of ``tier`` ('arena' or 'host'), LRU first."""
        return list(self._t1 if tier == "arena" else self._t2)

    def lease_of(self, key) -> Optional[Lease]:
        """The tier-1 lease of ``key`` (no reference taken, no LRU touch), or None."""
        return self._t1.get(key)

    def clear(self) -> None:
        """Drop every reference the cache holds and forget both tiers."""
        t1, self._t1 = self._t1, OrderedDict()
        self._t2 = OrderedDict()
        self._t1_bytes = self._t2_bytes = 0
        for lease in t1.values():
            self._drop_quiet(lease, self.cache_owner)


class InflightMisses:
    """Identical misses in flight are encoded once; every waiter is shipped.

    ``begin(key, waiter)`` is True for the first miss of a key (encode it) and
    False for later ones (attached as waiters). ``finish(key)`` / ``abort(key)``
    end the encode and return every waiter, the first included, in arrival order
    (for ``abort`` the caller fails them, or begins again for a retry).
    """

    def __init__(self) -> None:
        self._waiting: dict[Hashable, list] = {}

    def begin(self, key, waiter) -> bool:
        ws = self._waiting.get(key)
        if ws is None:
            self._waiting[key] = [waiter]
            return True
        ws.append(waiter)
        return False

    def finish(self, key) -> list:
        return self._waiting.pop(key, [])

    def abort(self, key) -> list:
        return self._waiting.pop(key, [])

    def waiting(self, key) -> list:
        return list(self._waiting.get(key, ()))

    def keys(self) -> list:
        return list(self._waiting)

    def __contains__(self, key) -> bool:
        return key in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)
