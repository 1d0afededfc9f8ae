"""Hash/cache stage: content hash, cache lookup, one encode for identical misses in flight."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

from ipc.arena import Arena, Lease, StaleLease
from ipc.wire import content_hash
from stages import registry
from stages.embedding_cache import EmbeddingCache, InflightMisses
from stages.base import Stage
from stages.records import (OWNER_CACHE, OWNER_INTAKE, Encoded, EncodeFailed, ReadyItem, RoomAbandoned,
                            RoomFailure, SpaceWanted, WorkItem)


class HashCache:
    def __init__(self, *, pixel_arena: Arena, cache: EmbeddingCache, hidden: int, dtype: str,
                 trust_client_hash: bool = False):
        self.pixel_arena = pixel_arena
        self.cache = cache
        self.hidden = hidden
        self.dtype = dtype
        self.trust_client_hash = trust_client_hash
        self.inflight = InflightMisses()
        self.dedup_hits = 0
        self.outcomes = Counter()  # items by cache outcome: hit_arena, hit_host, miss, inflight_duplicate
        # Encoded rows go to their waiters first and into the cache after (flush_inserts):
        # inserting can demote an older entry, a copy of megabytes that need not delay a send.
        self.pending_inserts: list[tuple[tuple, Lease]] = []

    def key_of(self, w: WorkItem) -> tuple:
        if self.trust_client_hash and w.client_hash is not None:
            h = w.client_hash
        elif w.pixel_hash is not None:
            h = w.pixel_hash
        else:
            h = content_hash(w.modality, w.grid_thw, w.pixel_dtype, self.pixel_arena.view(w.pixels))
        return (w.modality, h, w.span, self.hidden, self.dtype)

    def on_item(self, w: WorkItem) -> tuple[ReadyItem | None, WorkItem | None]:
        """A hit comes back ready to send; the first miss of a key goes on to be encoded;
        an identical miss already in flight waits for it (both None). StaleLease: the
        pixels were reclaimed from a dead intake; the caller fails the room."""
        self.pixel_arena.transfer(w.pixels, OWNER_INTAKE, OWNER_CACHE)
        w = replace(w, key=self.key_of(w))
        self.flush_inserts()  # a key encoded a moment ago is a hit, not a second encode
        lease = self.cache.lookup(w.key, OWNER_CACHE)
        if lease is not None:
            self.outcomes[self.cache.last_status.value] += 1
            self._drop_pixels(w)
            return ReadyItem(w.slot, w.room, w.item, w.span, lease), None
        if self.inflight.begin(w.key, w):
            self.outcomes["miss"] += 1
            return None, w
        self.dedup_hits += 1
        self.outcomes["inflight_duplicate"] += 1
        return None, None

    def on_encoded(self, encoded: WorkItem) -> list[ReadyItem]:
        """The tower wrote `encoded`'s rows into its lease and sent them on to the sender
        itself; the identical items that waited for them are returned ready, each with a
        reference of this stage (OWNER_CACHE), which the sender takes over on receipt. The
        caller's own reference passes to this object: flush_inserts() caches the rows and
        drops it."""
        key, lease = encoded.key, encoded.out
        self.pending_inserts.append((key, lease))
        ready = []
        waiters = self.inflight.finish(key)
        if waiters and not self._same(waiters[0], encoded):
            # `encoded` led until its room failed; the waiter encoded in its place
            # (forget_room) gets its own rows, the others need not wait for them
            self.inflight.begin(key, waiters.pop(0))
        for w in waiters:
            if w is encoded or (w.room, w.item) == (encoded.room, encoded.item):
                continue
            self._drop_pixels(w)
            try:
                self.cache.arena.addref(lease, OWNER_CACHE)
            except StaleLease:
                continue
            ready.append(ReadyItem(w.slot, w.room, w.item, w.span, lease))
        return ready

    def flush_inserts(self) -> None:
        pending, self.pending_inserts = self.pending_inserts, []
        for key, lease in pending:
            self.cache.insert(key, lease)
            try:
                self.cache.arena.drop(lease, OWNER_CACHE)
            except StaleLease:
                pass

    def on_encode_failed(self, key: tuple,
                         failed_rooms: set[int]) -> tuple[list[WorkItem], WorkItem | None]:
        """The encode of `key` failed. Waiters whose rooms failed with it are returned to be
        failed; the first of the others is encoded anew (the rest keep waiting on it)."""
        failed, survivors = [], []
        for w in self.inflight.abort(key):
            if w.room in failed_rooms:
                self._drop_pixels(w)
                failed.append(w)
            else:
                survivors.append(w)
        again = None
        for w in survivors:
            if self.inflight.begin(key, w):
                again = w
        return failed, again

    def leads(self, w: WorkItem) -> bool:
        """Whether `w` is the item being encoded for its key (not one replaced by forget_room)."""
        waiters = self.inflight.waiting(w.key)
        return bool(waiters) and self._same(waiters[0], w)

    @staticmethod
    def _same(a: WorkItem, b: WorkItem) -> bool:
        return (a.room, a.item) == (b.room, b.item)

    def forget_room(self, room: int) -> list[WorkItem]:
        """A failed room's waiters stop waiting (their pixels are released). Where the room's
        item was the one being encoded for the others, its encode may never come back (the
        scheduler drops a failed room's queued items; a dead stage loses what it held): the
        first other waiter is returned, to be encoded in its place."""
        promoted = []
        for key in self.inflight.keys():
            waiters = self.inflight.waiting(key)
            if not any(w.room == room for w in waiters):
                continue
            keep = [w for w in waiters if w.room != room]
            for w in waiters[1:]:  # the first one's pixels are the scheduler's or the tower's
                if w.room == room:
                    self._drop_pixels(w)
            self.inflight.abort(key)
            for w in keep:
                self.inflight.begin(key, w)
            if keep and waiters[0].room == room:
                promoted.append(keep[0])
        return promoted

    def _drop_pixels(self, w: WorkItem) -> None:
        if w.pixels is None:  # the tower already let go of them
            return
        try:
            self.pixel_arena.drop(w.pixels, OWNER_CACHE)
        except StaleLease:
            pass


class CacheStage(Stage):
    """Items from intake; encode results from the tower; failed rooms from the reaper."""

    name = "cache"
    owner = OWNER_CACHE

    def __init__(self, emit, hash_cache: HashCache, emb_arena: Arena, custody=None):
        super().__init__(emit, custody)
        self.hc = hash_cache
        self.emb_arena = emb_arena

    def handle(self, source: str, rec) -> None:
        match rec:
            case WorkItem():
                self._item(rec)
            case Encoded(item=w):
                try:
                    self.emb_arena.transfer(w.out, registry.owner_of(source), OWNER_CACHE)
                except StaleLease:
                    self._encode_failed(w, f"embedding was lost ({source} died)", {w.room})
                    return
                for ready in self.hc.on_encoded(w):  # waiters, in our custody
                    self.emit("sender", ready)
                    self.custody.release(ready.slot, ready.room)
            case EncodeFailed(item=w, reason=reason, rooms=rooms):
                self._encode_failed(w, reason, rooms)
            case SpaceWanted(nbytes=nbytes):
                self.hc.flush_inserts()
                self.hc.cache.give_back(nbytes)
            case RoomAbandoned(room=room):
                for w in self.hc.forget_room(room):
                    self.emit("scheduler", w)
                    self.custody.release(w.slot, w.room)
                self.custody.forget(room)
            case _:
                raise ValueError(f"cache: unexpected record from {source}: {rec!r}")

    def tick(self, now: float) -> None:
        self.hc.flush_inserts()

    def stats(self) -> dict:
        return {"cache": self.hc.cache.stats(), "dedup_hits": self.hc.dedup_hits,
                "cache_items": dict(self.hc.outcomes)}

    def close(self) -> None:
        self.hc.flush_inserts()
        self.hc.cache.clear()

    def _item(self, w: WorkItem) -> None:
        self.custody.hold(w.slot, w.room)
        try:
            ready, miss = self.hc.on_item(w)
        except StaleLease:
            self.emit("reaper", RoomFailure(w.slot, w.room, "pixels were lost before hashing (intake died)"))
            self.custody.release(w.slot, w.room)
            return
        if ready is not None:
            self.emit("sender", ready)
            self.custody.release(w.slot, w.room)
        elif miss is not None:
            self.emit("scheduler", miss)
            self.custody.release(w.slot, w.room)
        # else: waits, in our custody, for the identical item in flight

    def _encode_failed(self, w: WorkItem, reason: str, failed_rooms) -> None:
        if not self.hc.leads(w):
            return  # replaced after its room failed: the waiters wait for its successor
        failed, again = self.hc.on_encode_failed(w.key, failed_rooms)
        for f in failed:
            self.emit("reaper", RoomFailure(f.slot, f.room, reason))
            if (f.room, f.item) != (w.room, w.item):
                self.custody.release(f.slot, f.room)
        if again is not None:
            self.emit("scheduler", again)
            self.custody.release(again.slot, again.room)


def build(env, name, emit, custody) -> CacheStage:
    cfg, spec, sh = env.cfg, env.spec, env.shared
    cache = EmbeddingCache(sh.emb_arena, OWNER_CACHE, cfg.arena_cache_bytes, cfg.host_cache_bytes)
    hc = HashCache(pixel_arena=sh.pixel_arena, cache=cache, hidden=spec.hidden, dtype=spec.dtype,
                   trust_client_hash=cfg.trust_client_hash)
    return CacheStage(emit, hc, sh.emb_arena, custody)
