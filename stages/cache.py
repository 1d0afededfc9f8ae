"""Hash/cache stage: content hash, cache lookup, one encode for identical misses in flight."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

from ipc import hashing
from ipc.arena import Arena, ArenaFull, Lease, StaleLease
from ipc.stats import ReasonCode
from stages import registry
from stages.base import POLL_S, Stage
from stages.embedding_cache import EmbeddingCache, InflightMisses, cache_key, make_key
from stages.settings import CacheSettings
from stages.store_tier import StoreTier, tower_identity
from stages.records import (OWNER_CACHE, Encoded, EncodeFailed, PreprocessDone, PreprocessDown,
                            PreprocessRestarted, ReadyItem, RoomAbandoned, RoomFailure, SpaceWanted, WorkItem)


class CacheStage(Stage):
    """Items from intake; encode results from the tower; failed rooms from the reaper.

    A hit goes to the sender ready; the first miss of a key goes on to the scheduler to
    be encoded; an identical miss while that one is in flight waits for it, in this
    stage's custody, and goes to the sender with its rows.

    Items are keyed by the keyed hash intake took of their pixels under the run's
    `content_key` (or a trusted client's own hash), their shape, and their request's
    cache_salt: items of different salts share neither an entry nor an encode.

    With a shared store (`store`), the first miss of a key asks it before it goes to the
    scheduler, and waits for the answer in this stage's custody (with the identical
    items behind it); a hit is shipped like an encode, a miss (or no answer by the
    store's deadline) is scheduled. What the tower encodes is put into the store.
    Workers do not single-flight among themselves: identical misses on two workers at
    once are each encoded.

    A miss of a compressed image goes to a preprocess worker first (`preprocess`, their
    stage names): to the live one with the fewest items outstanding (sent, not yet
    `PreprocessDone`), so a slow or hung worker is sent no more while another has fewer.
    A dead one is sent nothing from its `PreprocessDown` until its successor's
    `PreprocessRestarted`, and its count is dropped: the successor takes again what the
    dead one had not released from its ring and reports each done (the count stops at
    zero), so nothing the dead one took stays counted for ever, whatever became of it.

    An image at an http(s) URL has no bytes to key yet: it goes to a preprocess worker
    (chosen as a miss is) to be fetched, and comes back with its bytes and their keyed
    hash, to be looked up as any compressed image: a repeat at any URL skips the decode.
    """

    name = registry.CACHE
    owner = OWNER_CACHE

    def __init__(self, emit, *, pixel_arena: Arena, cache: EmbeddingCache, hidden: int, dtype: str,
                 trust_client_hash: bool = False, custody=None, content_key: bytes | None = None,
                 row_bytes: int = 0, store: StoreTier | None = None,
                 preprocess: tuple[str, ...] = (registry.PREPROCESS,)):
        super().__init__(emit, custody)
        self.preprocess = preprocess
        self.outstanding = [0] * len(preprocess)  # items sent to each worker, not yet done
        self.down: set[int] = set()  # workers dead and not yet back
        self.next_worker = 0  # where a tie starts: idle workers take turns
        # The run's key (the same as intake's): items whose pixels intake did not hash are hashed here.
        self.content_key = content_key if content_key is not None else hashing.new_cache_key()
        self.content_key_id = hashing.cache_key_id(self.content_key)
        self.pixel_arena = pixel_arena
        self.cache = cache
        self.emb_arena = cache.arena  # the rows, cached or in flight
        self.hidden = hidden
        self.dtype = dtype
        self.trust_client_hash = trust_client_hash
        self.row_bytes = row_bytes  # of an entry (main and deepstack halves): what the store must answer
        self.store = store
        self.asking: set = set()  # keys asked of the store, unanswered
        self.inflight = InflightMisses()
        self.dedup_hits = 0
        # items by cache outcome: hit_arena, hit_host, hit_store, miss, inflight_duplicate
        self.outcomes = Counter()
        # Encoded rows go to their waiters first and into the cache (and the store) after
        # (flush_inserts): inserting can demote an older entry, a copy of megabytes that need
        # not delay a send. (key, lease, whether to put it into the store)
        self.pending_inserts: list[tuple[tuple, Lease, bool]] = []

    def handle(self, source: str, rec) -> None:
        match rec:
            case WorkItem():
                self._item(rec, source)
            case Encoded(item=w):
                self._encoded(w, source)
            case EncodeFailed(item=w, reason=reason, rooms=rooms):
                code = ReasonCode.BAD_REQUEST if registry.kind_of(source) == registry.PREPROCESS \
                    else ReasonCode.TOWER_ERROR
                self._encode_failed(w, reason, rooms, code)
            case PreprocessDone(worker=k):
                # A dead worker's ring reaches its successor after its count was dropped.
                self.outstanding[k] = max(0, self.outstanding[k] - 1)
            case PreprocessDown(worker=k):
                self.outstanding[k] = 0
                self.down.add(k)
            case PreprocessRestarted(worker=k):
                self.down.discard(k)
            case SpaceWanted(nbytes=nbytes):
                self.flush_inserts()
                self.cache.give_back(nbytes)
            case RoomAbandoned(room=room):
                self._abandon(room)
            case _:
                raise ValueError(f"cache: unexpected record from {source}: {rec!r}")

    def tick(self, now: float) -> None:
        self.flush_inserts()
        if self.store is not None:
            for key, rows in self.store.answers(now):
                self._store_answered(key, rows)
            for lease in self.store.done():
                self._drop_rows(lease)

    def next_tick_in(self, now: float) -> float | None:
        return POLL_S if self.store is not None and self.store.pending() else None

    def stats(self) -> dict:
        out = {"cache": self.cache.stats(), "dedup_hits": self.dedup_hits, "cache_items": dict(self.outcomes),
               "cache_key_id": self.content_key_id}
        if self.store is not None:
            out.update(self.store.stats())
        if len(self.preprocess) > 1:
            out["preprocess_outstanding"] = dict(zip(self.preprocess, self.outstanding))
            out["preprocess_down"] = sorted(self.preprocess[k] for k in self.down)
        return out

    def close(self) -> None:
        self.flush_inserts()
        if self.store is not None:
            for lease in self.store.close():
                self._drop_rows(lease)
        self.cache.clear()

    def key_of(self, w: WorkItem) -> tuple:
        if self.trust_client_hash and w.client_hash is not None:
            h = w.client_hash  # an int: never equal to a keyed hash (bytes)
        elif w.pixel_hash is not None:
            h = w.pixel_hash
        else:
            h = hashing.cache_hash(self.content_key, w.modality, w.grid_thw, w.pixel_dtype,
                                self.pixel_arena.view(w.pixels))
        return make_key(w.modality, h, w.span, self.hidden, self.dtype, w.cache_salt)

    def flush_inserts(self) -> None:
        pending, self.pending_inserts = self.pending_inserts, []
        for key, lease, to_store in pending:
            self.cache.insert(key, lease)
            if to_store and self.store is not None:
                self._put(key, lease)
            self._drop_rows(lease)

    def _put(self, key: tuple, lease: Lease) -> None:
        """The store's put thread reads the rows: a reference of ours keeps them until it has."""
        try:
            self.emb_arena.addref(lease, OWNER_CACHE)
            view = self.emb_arena.view(lease)
        except StaleLease:
            return
        if not self.store.put(key, view, lease):
            view.release()
            self._drop_rows(lease)

    def _drop_rows(self, lease: Lease) -> None:
        try:
            self.emb_arena.drop(lease, OWNER_CACHE)
        except StaleLease:
            pass

    def _item(self, w: WorkItem, source: str = registry.INTAKE) -> None:
        self.custody.hold(w.slot, w.room)
        if w.url is not None:
            # No bytes yet, so no key: a preprocess worker fetches and hashes them, and
            # sends the item back here, to be looked up as any compressed image.
            # Not an outcome (cache_items counts each item once): preprocess_items counts fetches.
            self.emit(self._encoder_of(w), w)
            self.custody.release(w.slot, w.room)
            return
        try:
            self.pixel_arena.transfer(w.pixels, registry.owner_of(source), OWNER_CACHE)
            w = replace(w, key=self.key_of(w))
            self.flush_inserts()  # a key encoded a moment ago is a hit, not a second encode
            lease = self.cache.lookup(w.key, OWNER_CACHE)
        except StaleLease:  # the pixels were reclaimed from a dead intake (or preprocess worker)
            self.emit(registry.REAPER, RoomFailure(w.slot, w.room, f"pixels were lost before hashing ({source} died)",
                                                   ReasonCode.STAGE_DIED))
            self.custody.release(w.slot, w.room)
            return
        if lease is not None:
            self.outcomes[self.cache.last_status.value] += 1
            self._drop_pixels(w)
            self.emit(registry.SENDER, ReadyItem(w.slot, w.room, w.item, w.span, lease))
            self.custody.release(w.slot, w.room)
        elif self.inflight.begin(w.key, w):
            if w.key in self.asking:  # its predecessor's room failed while the store was asked
                return
            if self.store is not None and self.store.ask(w.key, w.span * self.row_bytes, time.monotonic()):
                self.asking.add(w.key)  # in our custody until the store answers (tick)
                return
            self._schedule(w)
        else:  # waits, in our custody, for the identical item in flight
            self.dedup_hits += 1
            self.outcomes["inflight_duplicate"] += 1

    def _schedule(self, w: WorkItem) -> None:
        self.outcomes["miss"] += 1
        self.emit(self._encoder_of(w), w)
        self.custody.release(w.slot, w.room)

    def _store_answered(self, key: tuple, rows) -> None:
        """The store's rows of `key` (checked), or None: its first waiter goes to be encoded."""
        self.asking.discard(key)
        lease = self._lease_of(rows) if rows is not None else None
        if lease is None:
            waiters = self.inflight.waiting(key)
            if waiters:
                self._schedule(waiters[0])
            return
        self.pending_inserts.append((key, lease, False))
        waiters = self.inflight.finish(key)
        if waiters:
            self.outcomes["hit_store"] += 1
        self._ship(waiters, lease)

    def _lease_of(self, rows) -> Lease | None:
        """The store's rows in a lease of ours, or None when the arena has no room now (encoded then)."""
        try:
            lease = self.emb_arena.alloc(len(rows), OWNER_CACHE)
        except ArenaFull:
            return None
        if lease is not None:
            with self.emb_arena.view(lease) as mv:
                mv[:] = rows
        return lease

    def _ship(self, waiters: list, lease: Lease) -> None:
        """Each waiter to the sender with a reference of ours on `lease` (in our custody until then)."""
        ready = []
        for w in waiters:
            self._drop_pixels(w)
            try:
                self.emb_arena.addref(lease, OWNER_CACHE)
            except StaleLease:
                continue
            ready.append(ReadyItem(w.slot, w.room, w.item, w.span, lease))
        for r in ready:
            self.emit(registry.SENDER, r)
            self.custody.release(r.slot, r.room)

    def _encoded(self, encoded: WorkItem, source: str) -> None:
        """The tower wrote `encoded`'s rows into its lease and sent them on to the sender
        itself; the identical items that waited for them go to the sender, each with a
        reference of this stage (OWNER_CACHE), which the sender takes over on receipt. The
        tower's reference passes to this stage: flush_inserts() caches the rows and drops it."""
        try:
            self.emb_arena.transfer(encoded.out, registry.owner_of(source), OWNER_CACHE)
        except StaleLease:
            self._encode_failed(encoded, f"embedding was lost ({source} died)", {encoded.room},
                                ReasonCode.STAGE_DIED)
            return
        key, lease = encoded.key, encoded.out
        self.pending_inserts.append((key, lease, True))
        waiters = self.inflight.finish(key)
        if waiters and not _same(waiters[0], encoded):
            # `encoded` led until its room failed; the waiter encoded in its place
            # (_abandon) gets its own rows, the others need not wait for them
            self.inflight.begin(key, waiters.pop(0))
        self._ship([w for w in waiters if not _same(w, encoded)], lease)

    def _encode_failed(self, w: WorkItem, reason: str, failed_rooms, code: ReasonCode) -> None:
        """Waiters whose rooms failed with the encode fail; the first of the others is
        encoded anew (the rest keep waiting on it)."""
        waiters = self.inflight.waiting(w.key)
        if not (waiters and _same(waiters[0], w)):
            return  # replaced after its room failed: the waiters wait for its successor
        failed, survivors = [], []
        for f in self.inflight.abort(w.key):
            if f.room in failed_rooms:
                self._drop_pixels(f)
                failed.append(f)
            else:
                survivors.append(f)
        again = None
        for s in survivors:
            if self.inflight.begin(w.key, s):
                again = s
        for f in failed:
            self.emit(registry.REAPER, RoomFailure(f.slot, f.room, reason, code))
            if not _same(f, w):
                self.custody.release(f.slot, f.room)
        if again is not None:
            self.emit(self._encoder_of(again), again)
            self.custody.release(again.slot, again.room)

    def _abandon(self, room: int) -> None:
        """A failed room's waiters stop waiting (their pixels are released). Where the room's
        item was the one being encoded for the others, its encode may never come back (the
        scheduler drops a failed room's queued items; a dead stage loses what it held): the
        first other waiter goes to be encoded in its place."""
        promoted = []
        for key in self.inflight.keys():
            waiters = self.inflight.waiting(key)
            if not any(w.room == room for w in waiters):
                continue
            keep = [w for w in waiters if w.room != room]
            # The first one's pixels are the scheduler's or the tower's, unless the store is being asked.
            asking = key in self.asking
            for w in waiters if asking else waiters[1:]:
                if w.room == room:
                    self._drop_pixels(w)
            self.inflight.abort(key)
            for w in keep:
                self.inflight.begin(key, w)
            if keep and waiters[0].room == room and not asking:  # else the store's answer decides
                promoted.append(keep[0])
        for w in promoted:
            self.emit(self._encoder_of(w), w)
            self.custody.release(w.slot, w.room)
        self.custody.forget(room)

    def _encoder_of(self, w: WorkItem) -> str:
        """Where a miss goes: patches to be batched; a compressed image to be decoded first,
        by the live worker with the fewest items outstanding (counted here as sent)."""
        if w.media is None:
            return registry.SCHEDULER
        n = len(self.preprocess)
        live = [k for k in range(n) if k not in self.down] or range(n)  # none live: its ring waits for it
        k = min(live, key=lambda k: (self.outstanding[k], (k - self.next_worker) % n))
        self.outstanding[k] += 1
        self.next_worker = (k + 1) % n
        return self.preprocess[k]

    def _drop_pixels(self, w: WorkItem) -> None:
        if w.pixels is None:  # the tower already let go of them
            return
        try:
            self.pixel_arena.drop(w.pixels, OWNER_CACHE)
        except StaleLease:
            pass


def _same(a: WorkItem, b: WorkItem) -> bool:
    """The same item of the same room (a record is a copy: identity says nothing)."""
    return (a.room, a.item) == (b.room, b.item)


def build(env, settings: CacheSettings, name, emit, custody) -> CacheStage:
    s, spec, sh = settings, env.spec, env.shared
    cache = EmbeddingCache(sh.emb_arena, OWNER_CACHE, s.arena_cache_bytes, s.host_cache_bytes)
    content_key = cache_key(s.cache_key_file, s.shm_prefix, env.run_id)
    store = None
    if s.store is not None:
        store = StoreTier(s.store, tower_identity(s.tower, spec, s.tower_config, s.run_dir), content_key)
    return CacheStage(emit, pixel_arena=sh.pixel_arena, cache=cache, hidden=spec.hidden, dtype=spec.dtype,
                      trust_client_hash=s.trust_client_hash, custody=custody, content_key=content_key,
                      row_bytes=spec.row_bytes, store=store,
                      preprocess=tuple(registry.preprocess_names(s.preprocess_workers)))
