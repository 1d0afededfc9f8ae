"""Preprocess: compressed images and videos (protocol 1.2) decoded into the tower's patches.

A stage of its own, in its own process in the pipeline, because decoding runs native
code on bytes a peer chose: a decoder that crashes or hangs takes this process alone,
and the supervisor fails exactly the rooms it held and starts another. With
`preprocess_workers` N > 1 there are N such stages (`preprocess0` ..), each with its own
owner number and rings; the cache spreads the misses among them.
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter, deque
from dataclasses import replace

import numpy as np

from ipc import media, media_video
from ipc.arena import Arena, ArenaFull, Lease, StaleLease
from ipc.stats import ReasonCode
from stages import progress, registry
from stages.base import POLL_S, Stage
from stages.records import EncodeFailed, PreprocessDone, PreprocessRestarted, RoomFailure, WorkItem

log = logging.getLogger("epd.preprocess")


class PreprocessStage(Stage):
    """Misses of compressed images and videos from the cache in; their patches to the scheduler.

    The cache looked the item up by the keyed hash of its bytes and settings first, so
    a repeated image is never decoded. Each item's patches take a lease of their own in
    the pixel arena; while the arena has no room, items wait here in order (`waiting`).
    An image that does not decode goes back to the cache as an `EncodeFailed` (the cache
    fails its room, and tries the next identical item waiting on it, if any).

    Every item that leaves, whatever its end, is a `PreprocessDone` to the cache, which
    counts the items outstanding at each worker. `name` is the worker's stage name
    (stages/registry.py), which gives its owner number."""

    def __init__(self, emit, *, pixel_arena: Arena, settings: media.ImageSettings, custody=None,
                 name: str = registry.PREPROCESS, video: media_video.VideoSettings | None = None):
        super().__init__(emit, custody)
        self.video = video or media_video.VideoSettings()
        self.name = name
        self.worker = registry.worker_of(name)
        self.owner = registry.owner_of(name)
        self.pixel_arena = pixel_arena
        self.settings = settings
        self.waiting: deque[WorkItem] = deque()  # in our custody, their bytes ours, patches not leased yet
        self.outcomes = Counter()

    def start(self) -> None:
        # The cache sends a worker nothing between its death and this (registry.last_words).
        self.emit(registry.CACHE, PreprocessRestarted(self.worker))

    def handle(self, source: str, rec) -> None:
        match rec:
            case WorkItem() as w:
                self._item(w, source)
            case _:
                raise ValueError(f"preprocess: unexpected record from {source}: {rec!r}")

    def tick(self, now: float) -> None:
        self._drain()

    def next_tick_in(self, now: float) -> float | None:
        return POLL_S if self.waiting else None  # until the pixel arena has room

    def stats(self) -> dict:
        return {"preprocess_waiting": len(self.waiting), "preprocess_items": dict(self.outcomes)}

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
        while self.waiting:
            self._drop(self.waiting.popleft().pixels)


def image_settings(cfg, spec) -> media.ImageSettings:
    """The processor's settings for this tower: its patch geometry, the worker's resize
    bounds, and mean and std from the checkpoint's processor configuration when it has
    one (else the family's: Qwen3-VL's 0.5, Qwen2's CLIP values)."""
    mean, std = (media.HALF, media.HALF) if cfg.tower == "qwen3-vl" else (media.CLIP_MEAN, media.CLIP_STD)
    rescale = media.RESCALE
    pc = _processor_config(cfg.tower_config) if cfg.tower_config else None
    if pc:
        mean, std = tuple(pc.get("image_mean", mean)), tuple(pc.get("image_std", std))
        rescale = pc.get("rescale_factor", rescale)
    return media.ImageSettings(patch=spec.patch, merge=spec.merge, temporal_patch=spec.temporal_patch,
                               min_pixels=cfg.image_min_pixels, max_pixels=cfg.image_max_pixels,
                               mean=mean, std=std, rescale=rescale, max_decoded_pixels=cfg.max_decoded_pixels,
                               backend=cfg.image_backend)


def video_settings(cfg, spec) -> media_video.VideoSettings:
    """The video processor's settings for this tower: the image processor's patch
    geometry, mean and std (Qwen's video processors share them), the worker's resize
    bounds (else the tower's video processor's), fps and bounds, and whose loader and
    processor (Qwen3-VL's sample and resize otherwise than Qwen2's)."""
    s = image_settings(cfg, spec)
    lo, hi = media_video.default_pixels(cfg.tower, cfg.video_min_pixels, cfg.video_max_pixels)
    return media_video.VideoSettings(patch=s.patch, merge=s.merge, temporal_patch=s.temporal_patch,
                                     min_pixels=lo, max_pixels=hi, mean=s.mean, std=s.std, rescale=s.rescale,
                                     fps=cfg.video_fps, max_decoded_pixels=cfg.max_decoded_pixels,
                                     max_stream_pixels=cfg.max_video_decoded_pixels,
                                     family=media_video.family_of(cfg.tower))


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


def build(env, name, emit, custody) -> PreprocessStage:
    return PreprocessStage(emit, pixel_arena=env.shared.pixel_arena, settings=image_settings(env.cfg, env.spec),
                           custody=custody, name=name, video=video_settings(env.cfg, env.spec))
