"""Preprocess: compressed images and videos (protocol 1.2) decoded into the tower's patches.

A stage of its own, in its own process in the pipeline, because decoding runs native
code on bytes a peer chose: a decoder that crashes or hangs takes this process alone,
and the supervisor fails exactly the rooms it held and starts another. With
`preprocess_workers` N > 1 there are N such stages (`preprocess0` ..), each with its own
owner number and rings; the cache spreads the misses among them.

It also fetches images at http(s) URLs (ipc/fetch.py), for the same reason (the server
is the peer's to choose, the bytes too), on a few threads of its process so that its
loop goes on answering its rings while they wait on the network.
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter, deque
from dataclasses import replace

import numpy as np

from ipc import fetch, hashing, media, media_video
from ipc.arena import Arena, ArenaFull, Lease, StaleLease
from ipc.stats import ReasonCode
from stages import progress, registry
from stages.base import POLL_S, Stage
from stages.embedding_cache import cache_key
from stages.records import EncodeFailed, PreprocessDone, PreprocessRestarted, RoomFailure, WorkItem
from stages.settings import PreprocessSettings

log = logging.getLogger("epd.preprocess")
# How often the loop looks for fetches that ended while some are out: they wait on the
# network, so a coarser poll than POLL_S costs nothing they would notice.
FETCH_POLL_S = 0.005
# Fetches out or fetched and waiting for a lease, at most: each holds up to
# media_url_max_bytes in this process's memory. Past it, URLs wait their turn (`to_fetch`).
MAX_FETCHES = 2 * fetch.FETCH_THREADS


class PreprocessStage(Stage):
    """Misses of compressed images and videos from the cache in; their patches to the scheduler.

    The cache looked the item up by the keyed hash of its bytes and settings first, so
    a repeated image is never decoded. Each item's patches take a lease of their own in
    the pixel arena; while the arena has no room, items wait here in order (`waiting`).
    An image that does not decode goes back to the cache as an `EncodeFailed` (the cache
    fails its room, and tries the next identical item waiting on it, if any).

    Every item that leaves, whatever its end, is a `PreprocessDone` to the cache, which
    counts the items outstanding at each worker. `name` is the worker's stage name
    (stages/registry.py), which gives its owner number.

    An item with a `url` (no bytes yet) is fetched by `fetches`; its bytes take a lease
    of their own (waiting in `fetched` while the arena has none), are hashed as intake
    hashes inline bytes (under `content_key`, the run's), and the item goes back to the
    cache to be looked up. A URL that is not fetched fails its room here, saying why."""

    def __init__(self, emit, *, pixel_arena: Arena, settings: media.ImageSettings, custody=None,
                 name: str = registry.PREPROCESS, urls: fetch.UrlSettings | None = None,
                 content_key: bytes | None = None, video: media_video.VideoSettings | None = None):
        super().__init__(emit, custody)
        self.video = video or media_video.VideoSettings()
        self.name = name
        self.worker = registry.worker_of(name)
        self.owner = registry.owner_of(name)
        self.pixel_arena = pixel_arena
        self.settings = settings
        self.waiting: deque[WorkItem] = deque()  # in our custody, their bytes ours, patches not leased yet
        self.outcomes = Counter()
        self.fetches = fetch.Fetches(urls or fetch.UrlSettings())
        self.content_key = content_key if content_key is not None else hashing.new_cache_key()
        self.fetched: deque[tuple[WorkItem, bytes]] = deque()  # in our custody, waiting for a lease
        self.to_fetch: deque[WorkItem] = deque()  # in our custody, not yet fetching (MAX_FETCHES)

    def start(self) -> None:
        # The cache sends a worker nothing between its death and this (registry.last_words).
        self.emit(registry.CACHE, PreprocessRestarted(self.worker))

    def handle(self, source: str, rec) -> None:
        match rec:
            case WorkItem(url=str()) as w:
                self.custody.hold(w.slot, w.room)
                self.to_fetch.append(w)
                self._start_fetches()
            case WorkItem() as w:
                self._item(w, source)
            case _:
                raise ValueError(f"preprocess: unexpected record from {source}: {rec!r}")

    def tick(self, now: float) -> None:
        self._collect(now)
        self._drain()

    def next_tick_in(self, now: float) -> float | None:
        if self.waiting or self.fetched:
            return POLL_S  # until the pixel arena has room (to_fetch waits on fetches or fetched)
        return FETCH_POLL_S if self.fetches.pending() else None

    def stats(self) -> dict:
        return {"preprocess_waiting": len(self.waiting), "preprocess_items": dict(self.outcomes),
                "preprocess_fetching": self.fetches.pending() + len(self.to_fetch)}

    def _start_fetches(self) -> None:
        while self.to_fetch and self.fetches.pending() + len(self.fetched) < MAX_FETCHES:
            w = self.to_fetch.popleft()
            self.fetches.submit(w, w.url, w.media[0])

    def _collect(self, now: float) -> None:
        """Fetches that ended: failed ones fail their rooms; fetched bytes into leases, in order."""
        for w, data, reason in self.fetches.done(now):
            if data is None:
                self._refuse(w, f"item {w.item}: media.url {w.url}: {reason}")
            else:
                self.fetched.append((w, data))
        while self.fetched:
            w, data = self.fetched[0]
            try:
                lease = self.pixel_arena.alloc(len(data), self.owner)
            except ArenaFull:
                lease = None
            except ValueError:
                self.fetched.popleft()
                self._refuse(w, f"item {w.item}: media.url {w.url}: its {len(data)} bytes are more than the "
                                f"pixel arena holds ({self.pixel_arena.size} bytes)")
                continue
            if lease is None:
                break  # tried again at every tick
            self.fetched.popleft()
            self._hand_back(w, data, lease)
        self._start_fetches()

    def _hand_back(self, w: WorkItem, data: bytes, lease: Lease) -> None:
        """A fetched image to the cache as though intake had read it: its bytes and their keyed hash."""
        self.pixel_arena.view(lease)[:] = data
        media = (w.media[0], len(data), *w.media[2:])
        h = hashing.cache_hash(self.content_key, w.modality, w.grid_thw,
                               hashing.media_kind(media, self.settings.backend), data)
        self.outcomes["fetched"] += 1
        self.emit(registry.CACHE, replace(w, pixels=lease, pixel_hash=h, url=None, media=media))
        self.emit(registry.CACHE, PreprocessDone(self.worker))
        self.custody.release(w.slot, w.room)

    def _refuse(self, w: WorkItem, reason: str) -> None:
        self.outcomes["fetch_failed"] += 1
        log.debug("image not fetched: room=%d item=%d reason=%s", w.room, w.item, reason)
        self.emit(registry.REAPER, RoomFailure(w.slot, w.room, reason, ReasonCode.BAD_REQUEST))
        self.emit(registry.CACHE, PreprocessDone(self.worker))
        self.custody.release(w.slot, w.room)

    def _item(self, w: WorkItem, source: str) -> None:
        self.custody.hold(w.slot, w.room)
        try:
            self.pixel_arena.transfer(w.pixels, registry.owner_of(source), self.owner)
        except StaleLease:
            self.emit(registry.REAPER, RoomFailure(w.slot, w.room, f"the {w.modality}'s bytes were lost before "
                                                   f"decoding ({source} died)", ReasonCode.STAGE_DIED))
            self.emit(registry.CACHE, PreprocessDone(self.worker))
            self.custody.release(w.slot, w.room)
            return
        self.waiting.append(w)
        self._drain()

    def _drain(self) -> None:
        while self.waiting:
            w = self.waiting[0]
            try:
                lease = self.pixel_arena.alloc(w.n_patches * w.patch_dim * 4, self.owner)
            except ArenaFull:  # every lease slot is live: as short of room as no space
                lease = None
            except ValueError:  # larger than the whole arena: it never fits
                self.waiting.popleft()
                self._fail(w, None, f"the {w.modality}'s patches ({w.n_patches * w.patch_dim * 4} bytes) are larger "
                                    f"than the pixel arena ({self.pixel_arena.size} bytes)")
                continue
            if lease is None:
                return  # tried again at every tick
            self.waiting.popleft()
            self._decode(w, lease)

    def _decode(self, w: WorkItem, lease: Lease) -> None:
        fmt, _size, min_pixels, max_pixels, *sampling = w.media
        try:
            data = bytes(self.pixel_arena.view(w.pixels))
            if sampling:  # a video: fps, min_frames, max_frames
                fps, min_frames, max_frames = sampling
                s = replace(self.video, min_pixels=min_pixels, max_pixels=max_pixels, fps=fps,
                            min_frames=min_frames, max_frames=max_frames)
                grid = media_video.video_grid(data, fmt, s)
            else:
                s = replace(self.settings, min_pixels=min_pixels, max_pixels=max_pixels)
                grid = media.image_grid(data, fmt, s)
            if (grid,) != tuple(tuple(g) for g in w.grid_thw):
                raise media.MediaError(
                    f"grid_thw {[list(g) for g in w.grid_thw]} is not the {w.modality}'s {list(grid)} (min_pixels "
                    f"{min_pixels}, max_pixels {max_pixels}, patch {s.patch}, merge {s.merge}"
                    + (f", fps {sampling[0]:g}, frames {sampling[1]}..{sampling[2]})" if sampling else ")"))
            if w.patch_dim != s.patch_dim:
                raise media.MediaError(f"the tower's patch_dim {w.patch_dim} is not 3 channels of "
                                       f"{s.temporal_patch} x {s.patch} x {s.patch}")
            out = np.frombuffer(self.pixel_arena.view(lease), dtype=np.float32).reshape(w.n_patches, w.patch_dim)
            if sampling:  # each frame moves the heartbeat on: a long video is not a hung decoder
                media_video.preprocess(data, fmt, s, out=out, progress=progress.report)
            else:
                media.preprocess(data, fmt, s, out=out)
        except media.MediaError as e:
            self._fail(w, lease, f"item {w.item}: {e}")
            return
        except StaleLease:
            self._fail(w, lease, f"the {w.modality}'s bytes were lost before decoding", ReasonCode.STAGE_DIED)
            return
        self.outcomes["decoded"] += 1
        self._drop(w.pixels)
        self.emit(registry.SCHEDULER, replace(w, pixels=lease, media=None))
        self.emit(registry.CACHE, PreprocessDone(self.worker))
        self.custody.release(w.slot, w.room)

    def _fail(self, w: WorkItem, lease: Lease | None, reason: str, code: ReasonCode | None = None) -> None:
        self.outcomes["failed"] += 1
        log.debug("item failed to preprocess: room=%d item=%d reason=%s", w.room, w.item, reason)
        self._drop(w.pixels)
        if lease is not None:
            self._drop(lease)
        if code is not None:
            self.emit(registry.REAPER, RoomFailure(w.slot, w.room, reason, code))
        else:
            # Through the cache: identical items of other rooms wait on this one there.
            self.emit(registry.CACHE, EncodeFailed(replace(w, pixels=None), reason, (w.room,)))
        self.emit(registry.CACHE, PreprocessDone(self.worker))
        self.custody.release(w.slot, w.room)

    def _drop(self, lease: Lease) -> None:
        try:
            self.pixel_arena.drop(lease, self.owner)
        except StaleLease:
            pass

    def close(self) -> None:
        self.fetches.close()
        while self.waiting:
            self._drop(self.waiting.popleft().pixels)


def image_settings(s: PreprocessSettings, spec) -> media.ImageSettings:
    """The processor's settings for this tower: its patch geometry, the worker's resize
    bounds, and mean and std from the checkpoint's processor configuration when it has
    one (else the family's: Qwen3-VL's 0.5, Qwen2's CLIP values)."""
    mean, std = (media.HALF, media.HALF) if s.tower == "qwen3-vl" else (media.CLIP_MEAN, media.CLIP_STD)
    rescale = media.RESCALE
    pc = _processor_config(s.tower_config) if s.tower_config else None
    if pc:
        mean, std = tuple(pc.get("image_mean", mean)), tuple(pc.get("image_std", std))
        rescale = pc.get("rescale_factor", rescale)
    return media.ImageSettings(patch=spec.patch, merge=spec.merge, temporal_patch=spec.temporal_patch,
                               min_pixels=s.image_min_pixels, max_pixels=s.image_max_pixels,
                               mean=mean, std=std, rescale=rescale, max_decoded_pixels=s.max_decoded_pixels,
                               backend=s.image_backend)


def video_settings(s: PreprocessSettings, spec) -> media_video.VideoSettings:
    """The video processor's settings for this tower: the image processor's patch
    geometry, mean and std (Qwen's video processors share them), the worker's resize
    bounds (else the tower's video processor's), fps and bounds, and whose loader and
    processor (Qwen3-VL's sample and resize otherwise than Qwen2's)."""
    im = image_settings(s, spec)
    lo, hi = media_video.default_pixels(s.tower, s.video_min_pixels, s.video_max_pixels)
    return media_video.VideoSettings(patch=im.patch, merge=im.merge, temporal_patch=im.temporal_patch,
                                     min_pixels=lo, max_pixels=hi, mean=im.mean, std=im.std, rescale=im.rescale,
                                     fps=s.video_fps, max_decoded_pixels=s.max_decoded_pixels,
                                     max_stream_pixels=s.max_video_decoded_pixels,
                                     family=media_video.family_of(s.tower))


def _processor_config(path: str) -> dict | None:
    """The image processor's settings in a checkpoint: preprocessor_config.json, or (as
    transformers 5 saves a processor) the image_processor map of processor_config.json."""
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                pc = json.load(f)
            pc = pc.get(key) if key else pc
            if isinstance(pc, dict):
                return pc
    return None


def url_settings(s: PreprocessSettings) -> fetch.UrlSettings:
    """The operator's rules for http(s) media URLs (media_url_*)."""
    return fetch.UrlSettings(s.media_url_hosts, s.media_url_max_bytes, s.media_url_timeout_s)


def build(env, settings: PreprocessSettings, name, emit, custody) -> PreprocessStage:
    s = settings
    return PreprocessStage(emit, pixel_arena=env.shared.pixel_arena, settings=image_settings(s, env.spec),
                           custody=custody, name=name, urls=url_settings(s), video=video_settings(s, env.spec),
                           content_key=cache_key(s.cache_key_file, s.shm_prefix, env.run_id))
