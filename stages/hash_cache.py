"""Hash/cache stage: content hash, cache lookup, one encode for identical misses in flight."""
from __future__ import annotations

import struct

import xxhash

from ipc.arena import Arena, Lease, StaleLease
from stages.cache import EmbeddingCache, InflightMisses
from stages.base import Stage
from stages.records import OWNER_CACHE, OWNER_INTAKE, OWNER_TOWER, RoomFailure, ReadyItem, WorkItem


def content_hash(modality: str, grid_thw, pixel_dtype: str, pixels) -> int:
    """64-bit hash of what determines an embedding: the pixel bytes *and* their grid.

    The same bytes under another grid (say [1, 4, 8] and [1, 8, 4]) give other
    rows, so the grid and dtype go into the hash, not only the bytes.
    """
    h = xxhash.xxh3_64()
    h.update(f"{modality}|{pixel_dtype}|".encode())
    h.update(struct.pack(f"<{3 * len(grid_thw)}q", *(x for g in grid_thw for x in g)))
    h.update(pixels)
    return h.intdigest()


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

    def key_of(self, w: WorkItem) -> tuple:
        if self.trust_client_hash and w.client_hash is not None:
            h = w.client_hash
        else:
            h = content_hash(w.modality, w.grid_thw, w.pixel_dtype, self.pixel_arena.view(w.pixels))
        return (w.modality, h, w.span, self.hidden, self.dtype)

    def on_item(self, w: WorkItem) -> tuple[ReadyItem | None, WorkItem | None]:
        """A hit comes back ready to send; the first miss of a key goes on to be encoded;
        an identical miss already in flight waits for it (both None). StaleLease: the
        pixels were reclaimed from a dead intake; the caller fails the room."""
        self.pixel_arena.transfer(w.pixels, OWNER_INTAKE, OWNER_CACHE)
        w.key = self.key_of(w)
        lease = self.cache.lookup(w.key, OWNER_CACHE)
        if lease is not None:
            self._drop_pixels(w)
            return ReadyItem(w.slot, w.room, w.item, w.span, lease), None
        if self.inflight.begin(w.key, w):
            return None, w
        self.dedup_hits += 1
        return None, None

    def on_encoded(self, key: tuple, lease: Lease) -> list[ReadyItem]:
        """The tower wrote `key`'s rows into `lease`. Each ReadyItem carries a reference of
        this stage (OWNER_CACHE), which the sender takes over on receipt; the caller keeps
        its own."""
        self.cache.insert(key, lease)
        ready = []
        for w in self.inflight.finish(key):
            self._drop_pixels(w)
            try:
                self.cache.arena.addref(lease, OWNER_CACHE)
            except StaleLease:
                continue
            ready.append(ReadyItem(w.slot, w.room, w.item, w.span, lease))
        return ready

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

    def forget_room(self, room: int) -> None:
        """A failed room's waiters stop waiting (their pixels are released)."""
        for key in self.inflight.keys():
            waiters = self.inflight.waiting(key)
            if len(waiters) > 1 and any(w.room == room for w in waiters[1:]):
                keep = [w for w in waiters if w.room != room or w is waiters[0]]
                for w in waiters:
                    if w not in keep:
                        self._drop_pixels(w)
                self.inflight.abort(key)
                for w in keep:
                    self.inflight.begin(key, w)

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
        if source == "intake":
            self._item(rec)
        elif source == "tower":
            self._encoded(rec)
        elif source == "reaper":
            self.hc.forget_room(rec[1])
            self.custody.forget(rec[1])
        else:
            raise ValueError(f"cache: unexpected source {source!r}")

    def stats(self) -> dict:
        return {"cache": self.hc.cache.stats(), "dedup_hits": self.hc.dedup_hits}

    def close(self) -> None:
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

    def _encoded(self, rec) -> None:
        kind, w = rec[0], rec[1]
        if kind == "encoded":
            try:
                self.emb_arena.transfer(w.out, OWNER_TOWER, OWNER_CACHE)
            except StaleLease:
                kind, rec = "failed", ("failed", w, "embedding was lost (tower died)", {w.room})
        if kind == "encoded":
            for ready in self.hc.on_encoded(w.key, w.out):
                self.emit("sender", ready)
                if (ready.room, ready.item) != (w.room, w.item):  # waiters were ours
                    self.custody.release(ready.slot, ready.room)
            self.emb_arena.drop(w.out, OWNER_CACHE)
            return
        _, w, reason, failed_rooms = rec
        failed, again = self.hc.on_encode_failed(w.key, failed_rooms)
        for f in failed:
            self.emit("reaper", RoomFailure(f.slot, f.room, reason))
            if (f.room, f.item) != (w.room, w.item):
                self.custody.release(f.slot, f.room)
        if again is not None:
            self.emit("scheduler", again)
            self.custody.release(again.slot, again.room)
