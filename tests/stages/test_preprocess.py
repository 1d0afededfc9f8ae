"""Protocol 1.2's compressed images through the worker, both modes (issue #35).

A compressed image's rows equal those of the same image sent as the processor's
pixels, whether its bytes come inline, in a segment or as a data: URL; a repeat is
served from the cache; hostile media (a decompression bomb, truncated or garbage bytes,
a grid that is not the image's) fail only their own room, with a reason, while the
other rooms of the same moment are served.
"""
from __future__ import annotations

import base64
import itertools
import time

import numpy as np
import pytest

from ipc import media, wire
from pipeline.peers.client import Client, Item, image_item
from pipeline.peers.receiver import Receiver
from tests.helpers import sim_config, start_worker
from tests.ipc.test_media import CORPUS, HOSTILE

pytestmark = pytest.mark.timeout(180)
_rooms = itertools.count(350_000)
ROW = dict(hidden=64, dtype="bfloat16", deepstack_width=32)  # the sim tower of sim_config
BOUNDS = dict(image_min_pixels=28 * 28, image_max_pixels=112 * 112, max_decoded_pixels=16 << 20)
SETTINGS = media.ImageSettings(min_pixels=BOUNDS["image_min_pixels"], max_pixels=BOUNDS["image_max_pixels"])


def started(made, obj):
    made(obj)
    return obj


def span_of(grid) -> int:
    return grid[0] * grid[1] * grid[2] // 4


def send(client, rx, item: Item, **kw) -> int:
    room = next(_rooms)
    rx.alloc(room, 0, span=span_of(item.grid_thw[0]), **ROW)
    client.encode(room, f"req-{room}", [item], **kw)
    return room


def raw_media_room(client, rx, grid, media_map: dict) -> int:
    """A room whose one item is `media_map`, sent as is (what a hostile gateway can send)."""
    room = next(_rooms)
    rx.alloc(room, 0, span=span_of(grid), **ROW)
    client.send({"v": wire.VERSION, "type": "encode", "request_id": f"req-{room}", "room": room,
                 "items": [{"modality": "image", "grid_thw": [list(grid)], "media": media_map}]})
    return room


def test_compressed_images_give_the_rows_of_their_pixels_and_hostile_ones_fail_alone(mode, shm_prefix, tmp_path,
                                                                                      made):
    w = started(made, start_worker(mode, sim_config(shm_prefix, tmp_path, **BOUNDS)))
    client = started(made, Client(w.cfg.intake, shm_prefix))
    rx = started(made, Receiver("rx0", w.cfg.bootstrap, buffer_bytes=16 << 20))
    good, rooms = {}, {}
    for name in ("jpeg-rgb", "jpeg-exif-rot90", "png-rgba", "webp-lossy", "jpeg-cmyk"):
        data, fmt = CORPUS[name]
        pixels, grid = media.preprocess(data, fmt, SETTINGS)
        good[name] = send(client, rx, Item("image", [list(grid)], pixels))
        it = image_item(data, fmt, min_pixels=SETTINGS.min_pixels, max_pixels=SETTINGS.max_pixels)
        assert tuple(it.grid_thw[0]) == grid
        rooms[(name, "shm")] = send(client, rx, it)
        rooms[(name, "inline")] = send(client, rx, it, inline=True)
        rooms[(name, "repeat")] = send(client, rx, it, inline=True)
        # The worker's own bounds where the item names none; a data: URL.
        url = f"data:image/{fmt};base64," + base64.b64encode(data).decode()
        rooms[(name, "url")] = raw_media_room(client, rx, grid, {"url": url})
    hostile = {}
    for name in ("bomb", "truncated-jpeg", "truncated-png", "garbage", "too-thin", "short-idat"):
        data, fmt, reason = HOSTILE[name]
        try:  # the grid its header claims, where the header reads: what a gateway would send
            grid = media.image_grid(data, fmt, SETTINGS)
        except media.MediaError:
            grid = (1, 4, 4)
        hostile[name] = (raw_media_room(client, rx, grid, {"format": fmt, "data": data}), reason)
    data, fmt = CORPUS["png-rgb"]
    hostile["wrong-grid"] = (raw_media_room(client, rx, (1, 4, 4), {"format": fmt, "data": data}),
                             "is not the image's")
    hostile["not-a-format"] = (raw_media_room(client, rx, (1, 4, 4), {"format": "gif", "data": data}),
                               "media.format must be one of")
    # A good room after the hostile ones: a failed decode leaves the stage serving.
    last = send(client, rx, image_item(CORPUS["png-gray"][0], "png", min_pixels=SETTINGS.min_pixels,
                                       max_pixels=SETTINGS.max_pixels))
    every = {r: 1 for r in [*good.values(), *rooms.values(), *(r for r, _ in hostile.values()), last]}
    assert rx.wait(every, timeout=60), "some room never concluded"
    for name, room in good.items():
        assert room not in rx.failed, rx.failed[room]
        want = rx.rows(room, 0)
        for how in ("shm", "inline", "repeat", "url"):
            r = rooms[(name, how)]
            assert r not in rx.failed, f"{name} {how}: {rx.failed[r]}"
            got = rx.rows(r, 0)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), f"{name} {how}"
    for name, (room, reason) in hostile.items():
        assert room in rx.failed, f"{name} did not fail"
        assert reason in rx.failed[room], f"{name}: {rx.failed[room]!r}"
    assert last not in rx.failed, rx.failed[last]
    stats = w.stats()
    decoded = stats.get("preprocess_items", {}).get("decoded", 0)
    # Each distinct image is decoded once: its repeats (inline, url: the same bytes and
    # settings) are cache hits or wait on the first one's encode.
    assert decoded == len(good) * 1 + 1, stats.get("preprocess_items")


def test_the_torchvision_backend_gives_the_rows_of_its_own_pixels(mode, shm_prefix, tmp_path, made):
    """image_backend torchvision: a compressed image's rows are those of the pixels that
    backend makes of it (tests/ipc/test_media_torch.py checks those against the backend)."""
    from dataclasses import replace

    w = started(made, start_worker(mode, sim_config(shm_prefix, tmp_path, image_backend="torchvision", **BOUNDS)))
    client = started(made, Client(w.cfg.intake, shm_prefix))
    rx = started(made, Receiver("rx0", w.cfg.bootstrap, buffer_bytes=16 << 20))
    pairs = {}
    for name in ("jpeg-rgb", "png-rgba", "webp-lossy"):
        data, fmt = CORPUS[name]
        pixels, grid = media.preprocess(data, fmt, replace(SETTINGS, backend="torchvision"))
        it = image_item(data, fmt, min_pixels=SETTINGS.min_pixels, max_pixels=SETTINGS.max_pixels)
        pairs[name] = (send(client, rx, Item("image", [list(grid)], pixels)), send(client, rx, it))
    assert rx.wait({r: 1 for pair in pairs.values() for r in pair}, timeout=60), "some room never concluded"
    for name, (as_pixels, compressed) in pairs.items():
        assert as_pixels not in rx.failed and compressed not in rx.failed, (name, rx.failed)
        want, got = rx.rows(as_pixels, 0), rx.rows(compressed, 0)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), name


def test_a_data_url_and_its_format_are_checked_at_intake(mode, shm_prefix, tmp_path, made):
    w = started(made, start_worker(mode, sim_config(shm_prefix, tmp_path, **BOUNDS)))
    client = started(made, Client(w.cfg.intake, shm_prefix))
    rx = started(made, Receiver("rx0", w.cfg.bootstrap, buffer_bytes=4 << 20))
    bad = {
        # URLs are off by default (tests/stages/test_media_urls.py has them on).
        raw_media_room(client, rx, (1, 4, 4), {"url": "http://example.com/a.jpg", "format": "jpeg"}):
            "fetches no http(s) URL (media_url_hosts is empty)",
        raw_media_room(client, rx, (1, 4, 4), {"url": "https://example.com/a.jpg"}): "needs media.format",
        raw_media_room(client, rx, (1, 4, 4), {"url": "data:image/png;base64,@@@"}): "not valid base64",
        raw_media_room(client, rx, (1, 4, 4), {"format": "png"}): "exactly one of",
        raw_media_room(client, rx, (1, 4, 4), {"format": "png", "data": b"x", "min_pixels": 0}): "min_pixels",
    }
    assert rx.wait({r: 1 for r in bad}, timeout=30)
    for room, reason in bad.items():
        assert reason in rx.failed.get(room, ""), rx.failed.get(room)


@pytest.mark.parametrize("how", ["hang", "crash"])
def test_a_hung_or_crashed_preprocess_process_is_restarted_and_fails_only_what_it_held(how, shm_prefix, tmp_path,
                                                                                        made):
    """The decoder is native code: a process stopped (a decoder that loops) is killed by the
    hang killer, one killed outright (a decoder that crashes) is found dead; either way the
    supervisor starts another, the rooms the dead one held fail naming it, the ones still
    in its ring are decoded by its successor, and later rooms are served."""
    import os
    import signal

    w = started(made, start_worker("pipeline", sim_config(shm_prefix, tmp_path, heartbeat_timeout_s=1.0,
                                                          bootstrap_timeout_s=30.0, **BOUNDS)))
    client = started(made, Client(w.cfg.intake, shm_prefix))
    rx = started(made, Receiver("rx0", w.cfg.bootstrap, buffer_bytes=16 << 20))
    pid = w.runtime.procs["preprocess"].pid
    os.kill(pid, signal.SIGSTOP)
    items = [image_item(CORPUS[n][0], CORPUS[n][1], min_pixels=SETTINGS.min_pixels, max_pixels=SETTINGS.max_pixels)
             for n in ("jpeg-rgb", "png-rgba", "webp-lossy", "jpeg-gray")]
    before = [send(client, rx, it) for it in items]
    if how == "crash":
        os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 60
    while w.runtime.restart_counts["preprocess"] < 1:
        assert time.monotonic() < end, "the preprocess stage was not restarted"
        time.sleep(0.05)
    after = send(client, rx, image_item(CORPUS["png-gray"][0], "png", min_pixels=SETTINGS.min_pixels,
                                        max_pixels=SETTINGS.max_pixels))
    assert rx.wait({r: 1 for r in [*before, after]}, timeout=60)
    for room in before:
        assert room not in rx.failed or "preprocess" in rx.failed[room], rx.failed[room]
    assert after not in rx.failed, rx.failed[after]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(shm_prefix + ".px.")]


@pytest.mark.parametrize("layout", ["preprocessor_config.json", "processor_config.json"])
def test_the_checkpoints_mean_and_std_are_the_workers(layout, tmp_path):
    """transformers 5 saves a processor's settings in processor_config.json (its
    image_processor map); older checkpoints in preprocessor_config.json."""
    import json
    from types import SimpleNamespace

    from pipeline.cli.config import WorkerConfig
    from pipeline.runtime.stage_settings import preprocess_settings
    from stages.preprocess import image_settings

    pc = {"image_mean": [0.1, 0.2, 0.3], "image_std": [0.4, 0.5, 0.6], "rescale_factor": 0.5}
    (tmp_path / layout).write_text(json.dumps(pc if layout.startswith("pre") else {"image_processor": pc}))
    spec = SimpleNamespace(patch=14, merge=2, temporal_patch=2)
    s = image_settings(preprocess_settings(WorkerConfig(tower="qwen3-vl", tower_config=str(tmp_path))), spec)
    assert (s.mean, s.std, s.rescale) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6), 0.5)
    s = image_settings(preprocess_settings(WorkerConfig(tower="qwen3-vl", tower_config="tiny")), spec)
    assert (s.mean, s.std) == (media.HALF, media.HALF)
