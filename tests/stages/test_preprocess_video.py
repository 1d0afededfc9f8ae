"""Protocol 1.2's compressed videos through the worker, both modes (issue #35).

A compressed video's rows equal those of the same video sent as the processor's pixels
(ipc/media_video.py's, which tests/ipc/test_media_video.py checks against vLLM's), whether
its bytes come inline, in a segment or as a data: URL; a repeat is served from the cache;
hostile videos (truncated, garbage, a grid that is not the video's, more frames than the
worker decodes) fail only their own room, with a reason, while the other rooms are served.
"""

from __future__ import annotations

import base64
from dataclasses import replace

import numpy as np
import pytest

from ipc import media_video as mv
from ipc import wire
from pipeline.peers.client import Client, Item, video_item
from pipeline.peers.receiver import Receiver
from tests.helpers import sim_config, start_worker
from tests.ipc.test_media_video import make_video
from tests.stages.test_preprocess import ROW, _rooms, send, span_of, started

pytestmark = pytest.mark.timeout(180)
BOUNDS = dict(video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 16, video_fps=4.0,
              max_video_decoded_pixels=64 * 48 * 40)
SETTINGS = mv.VideoSettings(min_pixels=BOUNDS["video_min_pixels"], max_pixels=BOUNDS["video_max_pixels"],
                            fps=BOUNDS["video_fps"])


def raw_video_room(client, rx, grid, media_map: dict, modality: str = "video") -> int:
    """A room whose one item is `media_map`, sent as is (what a hostile gateway can send)."""
    room = next(_rooms)
    rx.alloc(room, 0, span=span_of(grid), **ROW)
    client.send({"v": wire.VERSION, "type": "encode", "request_id": f"req-{room}", "room": room,
                 "items": [{"modality": modality, "grid_thw": [list(grid)], "media": media_map}]})
    return room


def test_compressed_videos_give_the_rows_of_their_pixels_and_hostile_ones_fail_alone(mode, shm_prefix, tmp_path,
                                                                                      made):
    pytest.importorskip("cv2")
    pytest.importorskip("torch")
    w = started(made, start_worker(mode, sim_config(shm_prefix, tmp_path, **BOUNDS)))
    client = started(made, Client(w.cfg.intake, shm_prefix))
    rx = started(made, Receiver("rx0", w.cfg.bootstrap, buffer_bytes=16 << 20))
    videos = {"mp4": make_video("mp4", "mp4v", 20, 64, 48, 10.0), "webm": make_video("webm", "VP90", 12, 80, 40, 6.0)}
    good, rooms = {}, {}
    for fmt, data in videos.items():
        pixels, grid = mv.preprocess(data, fmt, SETTINGS)
        good[fmt] = send(client, rx, Item("video", [list(grid)], pixels))
        it = video_item(data, fmt, min_pixels=SETTINGS.min_pixels, max_pixels=SETTINGS.max_pixels, fps=SETTINGS.fps)
        assert tuple(it.grid_thw[0]) == grid
        rooms[(fmt, "shm")] = send(client, rx, it)
        rooms[(fmt, "inline")] = send(client, rx, it, inline=True)
        rooms[(fmt, "repeat")] = send(client, rx, it, inline=True)
        # The worker's own settings where the item names none; a data: URL.
        url = f"data:video/{fmt};base64," + base64.b64encode(data).decode()
        rooms[(fmt, "url")] = raw_video_room(client, rx, grid, {"url": url})
    # Other settings, other pixels: the same bytes at 2 frames a second.
    data = videos["mp4"]
    pixels, grid = mv.preprocess(data, "mp4", replace(SETTINGS, fps=2.0))
    slow = (send(client, rx, Item("video", [list(grid)], pixels)),
            send(client, rx, video_item(data, "mp4", min_pixels=SETTINGS.min_pixels,
                                        max_pixels=SETTINGS.max_pixels, fps=2.0)))
    mp4, grid = videos["mp4"], mv.video_grid(videos["mp4"], "mp4", SETTINGS)
    long_video = make_video("mp4", "mp4v", 60, 64, 48, 10.0)
    hostile = {
        "truncated": (raw_video_room(client, rx, grid, {"format": "mp4", "data": mp4[: len(mp4) // 2]}),
                      "does not open"),
        "garbage": (raw_video_room(client, rx, grid, {"format": "webm", "data": bytes(range(256)) * 8}),
                    "not a webm file"),
        "wrong-grid": (raw_video_room(client, rx, (grid[0] + 1, grid[1], grid[2]), {"format": "mp4", "data": mp4}),
                       "is not the video's"),
        "too-long": (raw_video_room(client, rx, (2, 4, 4), {"format": "mp4", "data": long_video}),
                     "max_stream_pixels"),
        "image-format": (raw_video_room(client, rx, grid, {"format": "png", "data": mp4}), "is not video"),
        "video-as-image": (raw_video_room(client, rx, (1, 4, 4), {"format": "mp4", "data": mp4}, "image"),
                           "is not image"),
        "bad-fps": (raw_video_room(client, rx, grid, {"format": "mp4", "data": mp4, "fps": -1}), "media.fps"),
        "bad-frames": (raw_video_room(client, rx, grid, {"format": "mp4", "data": mp4, "max_frames": 10_000}),
                       "media.max_frames"),
    }
    # A good room after the hostile ones: a failed decode leaves the stage serving.
    last = send(client, rx, video_item(videos["webm"], "webm", min_pixels=SETTINGS.min_pixels,
                                       max_pixels=SETTINGS.max_pixels, fps=1.0))
    every = {r: 1 for r in [*good.values(), *rooms.values(), *slow, *(r for r, _ in hostile.values()), last]}
    assert rx.wait(every, timeout=90), "some room never concluded"
    for fmt, room in good.items():
        assert room not in rx.failed, rx.failed[room]
        want = rx.rows(room, 0)
        for how in ("shm", "inline", "repeat", "url"):
            r = rooms[(fmt, how)]
            assert r not in rx.failed, f"{fmt} {how}: {rx.failed[r]}"
            got = rx.rows(r, 0)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), f"{fmt} {how}"
    assert not set(slow) & set(rx.failed), rx.failed
    got, want = rx.rows(slow[1], 0), rx.rows(slow[0], 0)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    for name, (room, reason) in hostile.items():
        assert room in rx.failed, f"{name} did not fail"
        assert reason in rx.failed[room], f"{name}: {rx.failed[room]!r}"
    assert last not in rx.failed, rx.failed[last]
    decoded = w.stats().get("preprocess_items", {}).get("decoded", 0)
    # Each distinct video and settings is decoded once: repeats are cache hits or wait on the first.
    assert decoded == len(good) + 2, w.stats().get("preprocess_items")


def test_video_settings_follow_the_tower():
    """Qwen3-VL's loader and processor, patch 16, mean and std 0.5 and its processor's
    default bounds; Qwen2.5-VL's otherwise; the worker's own bounds where it sets them."""
    from types import SimpleNamespace

    from ipc.media import CLIP_MEAN, HALF
    from pipeline.cli.config import WorkerConfig
    from stages.preprocess import video_settings

    s = video_settings(WorkerConfig(tower="qwen3-vl", tower_config="tiny"),
                       SimpleNamespace(patch=16, merge=2, temporal_patch=2))
    assert (s.family, s.patch, s.mean, s.min_pixels, s.max_pixels) == ("qwen3", 16, HALF, *mv.DEFAULT_PIXELS["qwen3"])
    s = video_settings(WorkerConfig(tower="qwen2.5-vl", video_max_pixels=28 * 28 * 64, video_fps=1.0),
                       SimpleNamespace(patch=14, merge=2, temporal_patch=2))
    assert (s.family, s.patch, s.mean, s.min_pixels, s.max_pixels, s.fps) == (
        "qwen2", 14, CLIP_MEAN, mv.DEFAULT_PIXELS["qwen2"][0], 28 * 28 * 64, 1.0)
