"""Protocol 1.2's http(s) media URLs through the worker, both modes (issue #35).

A URL's image gives the rows of the same image sent inline; it is cached by its bytes,
so the same image at another URL (or inline) is a hit and changed content at one URL is
a new entry; a URL refused (a host not listed, a redirect, a 404, bytes not of the
format) fails its own room with the reason, and a fetch that waits on a slow server
holds up neither the other rooms nor the preprocess stage's loop.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import replace

import numpy as np
import pytest

from ipc import media
from pipeline.peers.client import Client, image_item, url_item, video_item
from pipeline.peers.receiver import Receiver
from tests.helpers import sim_config, start_worker
from tests.ipc.test_fetch import http_server, reply
from tests.ipc.test_media import CORPUS
from tests.stages.test_preprocess import BOUNDS, ROW, SETTINGS, span_of

pytestmark = pytest.mark.timeout(180)
_rooms = itertools.count(370_000)


def images(*names):
    """Each image's bytes, format and grid (what a gateway reads from its header)."""
    out = {}
    for name in names:
        data, fmt = CORPUS[name]
        out[name] = (data, fmt, list(media.image_grid(data, fmt, SETTINGS)))
    return out


class Site:
    """The test's web server: path -> (bytes, format); `release` lets /slow answer."""

    def __init__(self, files: dict):
        self.files = dict(files)
        self.release = threading.Event()
        routes = {"/slow.png": self._slow, "/moved.png": lambda h: reply(h, 302, b"", {"Location": "/a.png"})}
        self._cm = http_server(_Routes(self, routes))
        self.server = self._cm.__enter__()

    def _slow(self, h):
        self.release.wait(60)
        reply(h, 200, self.files["/a.png"])

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.server.server_address[1]}{path}"

    def close(self):
        self.release.set()
        self._cm.__exit__(None, None, None)


class _Routes(dict):
    """The site's fixed routes, and its files as they are now (a test changes them)."""

    def __init__(self, site: Site, fixed: dict):
        super().__init__(fixed)
        self.site = site

    def get(self, path, default=None):
        if path in self.site.files:
            return lambda h: reply(h, 200, self.site.files[path])
        return super().get(path, default)


def setup(mode, shm_prefix, tmp_path, made, files: dict, **cfg):
    site = Site(files)
    made(site)
    w = start_worker(mode, sim_config(shm_prefix, tmp_path, media_url_hosts="127.0.0.1", **BOUNDS, **cfg))
    made(w)
    client = Client(w.cfg.intake, shm_prefix)
    made(client)
    rx = Receiver("rx0", w.cfg.bootstrap, buffer_bytes=16 << 20)
    made(rx)
    return site, w, client, rx


def send(client, rx, item) -> int:
    room = next(_rooms)
    rx.alloc(room, 0, span=span_of(item.grid_thw[0]), **ROW)
    client.encode(room, f"req-{room}", [item])
    return room


def same_rows(rx, a: int, b: int) -> bool:
    (ma, da), (mb, db) = rx.rows(a, 0), rx.rows(b, 0)
    return np.array_equal(ma, mb) and np.array_equal(da, db)


def test_a_urls_image_is_the_inline_ones_and_is_cached_by_its_bytes(mode, shm_prefix, tmp_path, made):
    imgs = images("png-rgb", "jpeg-rgb")
    png, fmt, grid = imgs["png-rgb"]
    site, w, client, rx = setup(mode, shm_prefix, tmp_path, made, {"/a.png": png, "/b.png": png})
    first = send(client, rx, url_item(site.url("/a.png"), fmt, grid, min_pixels=SETTINGS.min_pixels,
                                      max_pixels=SETTINGS.max_pixels))
    assert rx.wait({first: 1}, 60), "the URL's room never concluded"
    assert first not in rx.failed, rx.failed[first]
    inline = send(client, rx, image_item(png, fmt, min_pixels=SETTINGS.min_pixels, max_pixels=SETTINGS.max_pixels))
    other_url = send(client, rx, url_item(site.url("/b.png"), fmt, grid, min_pixels=SETTINGS.min_pixels,
                                          max_pixels=SETTINGS.max_pixels))
    assert rx.wait({inline: 1, other_url: 1}, 60)
    for room in (inline, other_url):
        assert room not in rx.failed, rx.failed[room]
        assert same_rows(rx, first, room)
    stats = w.stats()
    assert stats["preprocess_items"].get("decoded") == 1, stats["preprocess_items"]
    assert stats["preprocess_items"].get("fetched") == 2, stats["preprocess_items"]
    hits = sum(v for k, v in stats["cache_items"].items() if k.startswith("hit"))
    assert hits == 2, stats["cache_items"]
    # Other bytes at the same URL: another entry, not the stale rows.
    jpeg, jfmt, jgrid = imgs["jpeg-rgb"]
    site.files["/a.png"] = jpeg
    changed = send(client, rx, url_item(site.url("/a.png"), jfmt, jgrid, min_pixels=SETTINGS.min_pixels,
                                        max_pixels=SETTINGS.max_pixels))
    want = send(client, rx, image_item(jpeg, jfmt, min_pixels=SETTINGS.min_pixels, max_pixels=SETTINGS.max_pixels))
    assert rx.wait({changed: 1, want: 1}, 60)
    assert changed not in rx.failed and want not in rx.failed, rx.failed
    assert same_rows(rx, changed, want) and not same_rows(rx, changed, first)
    assert w.stats()["preprocess_items"].get("decoded") == 2


def test_a_refused_url_fails_its_room_alone_and_a_slow_one_holds_up_nothing(mode, shm_prefix, tmp_path, made):
    png, fmt, grid = images("png-rgb")["png-rgb"]
    site, w, client, rx = setup(mode, shm_prefix, tmp_path, made, {"/a.png": png, "/html.png": b"<html></html>"},
                                media_url_timeout_s=60.0)
    bounds = dict(min_pixels=SETTINGS.min_pixels, max_pixels=SETTINGS.max_pixels)
    slow = send(client, rx, url_item(site.url("/slow.png"), fmt, grid, **bounds))
    refused = {
        send(client, rx, url_item(site.url("/a.png", host="localhost"), fmt, grid, **bounds)):
            "host localhost is not one this worker fetches from (media_url_hosts)",
        send(client, rx, url_item(site.url("/missing.png"), fmt, grid, **bounds)): "answered 404",
        send(client, rx, url_item(site.url("/moved.png"), fmt, grid, **bounds)): "follows no redirect",
        send(client, rx, url_item(site.url("/html.png"), fmt, grid, **bounds)): "not a png file",
        send(client, rx, url_item(site.url("/a.png"), fmt, [1, 4, 4], **bounds)): "is not the image's",
    }
    # While the slow fetch waits on its server, the rest are served: an inline image
    # decoded by the same preprocess stage, and a good URL.
    good = [send(client, rx, image_item(CORPUS["png-gray"][0], "png", **bounds)),
            send(client, rx, url_item(site.url("/a.png"), fmt, grid, **bounds))]
    assert rx.wait({r: 1 for r in [*refused, *good]}, 60), "some room never concluded"
    for room, reason in refused.items():
        assert reason in rx.failed.get(room, ""), (reason, rx.failed.get(room))
    for room in good:
        assert room not in rx.failed, rx.failed[room]
    assert not rx.concluded(slow, 1), "the slow fetch's server has not answered yet"
    site.release.set()
    assert rx.wait({slow: 1}, 60) and slow not in rx.failed, rx.failed.get(slow)
    assert same_rows(rx, slow, good[1])


def test_the_preprocess_stage_fetches_a_few_at_a_time_and_hands_back_keyed_bytes(shm_prefix, made):
    """The stage on its own: at most MAX_FETCHES out at once (each holds its bytes in
    memory), the rest waiting their turn; each fetched image goes back to the cache in a
    lease of the pixel arena with the keyed hash intake would have taken of its bytes."""
    import time

    from ipc import hashing, shm
    from ipc.arena import Arena
    from ipc.fetch import UrlSettings
    from stages.preprocess import MAX_FETCHES, PreprocessStage
    from stages.records import PreprocessDone, WorkItem

    png, fmt, grid = images("png-rgb")["png-rgb"]
    site = Site({"/a.png": png})
    made(site)
    n = MAX_FETCHES + 2
    arena = Arena.create(shm_prefix, shm.new_run_id(), "pixels", 2 * n * len(png) + (1 << 20), block_size=4096)
    sent: list = []
    key = hashing.new_cache_key()
    stage = PreprocessStage(lambda dest, rec: sent.append((dest, rec)), pixel_arena=arena, settings=SETTINGS,
                            urls=UrlSettings(hosts="127.0.0.1", timeout_s=60.0), content_key=key)
    bounds = (SETTINGS.min_pixels, SETTINGS.max_pixels)
    try:
        for room in range(n):
            stage.handle("cache", WorkItem(slot=room, room=room, item=0, seq=room, modality="image",
                                           grid_thw=(tuple(grid),), pixel_dtype="float32", n_patches=4,
                                           patch_dim=SETTINGS.patch_dim, span=1, pixels=None,
                                           media=(fmt, 0, *bounds), url=site.url("/slow.png")))
        assert stage.fetches.pending() == MAX_FETCHES and len(stage.to_fetch) == n - MAX_FETCHES
        site.release.set()
        end = time.monotonic() + 60
        while len(back := [r for _, r in sent if isinstance(r, WorkItem)]) < n:
            assert time.monotonic() < end, stage.stats()
            stage.tick(time.monotonic())
            time.sleep(0.01)
        kind = hashing.media_kind((fmt, len(png), *bounds), SETTINGS.backend)
        want = hashing.cache_hash(key, "image", (tuple(grid),), kind, png)
        for r in back:
            assert r.url is None and r.pixel_hash == want and r.media == (fmt, len(png), *bounds)
            assert bytes(arena.view(r.pixels)) == png
        assert sum(isinstance(r, PreprocessDone) for _, r in sent) == n
        assert {dest for dest, _ in sent} == {"cache"}
    finally:
        stage.close()
        arena.close()
        arena.unlink()


def test_urls_with_two_preprocess_workers(shm_prefix, tmp_path, made):
    """A fetched image comes back to the cache from one worker and may be decoded by the
    other: its lease passes from the fetching worker's hands whichever it was."""
    imgs = images("png-rgb", "jpeg-rgb", "webp-lossy", "png-rgba")
    files = {f"/{name}": data for name, (data, _, _) in imgs.items()}
    site, w, client, rx = setup("pipeline", shm_prefix, tmp_path, made, files, preprocess_workers=2)
    bounds = dict(min_pixels=SETTINGS.min_pixels, max_pixels=SETTINGS.max_pixels)
    pairs = {name: (send(client, rx, url_item(site.url(f"/{name}"), fmt, grid, **bounds)),
                    send(client, rx, url_item(site.url(f"/{name}?again"), fmt, grid, **bounds)))
             for name, (_, fmt, grid) in imgs.items()}
    assert rx.wait({r: 1 for pair in pairs.values() for r in pair}, 60), "some room never concluded"
    for name, (a, b) in pairs.items():
        assert a not in rx.failed and b not in rx.failed, (name, rx.failed)
        assert same_rows(rx, a, b), name
    stats = w.stats()
    assert stats["preprocess_items"].get("fetched") == 2 * len(imgs), stats["preprocess_items"]
    assert stats["preprocess_items"].get("decoded") == len(imgs), stats["preprocess_items"]


def test_a_video_at_a_url_is_the_inline_ones_and_shares_its_entry(mode, shm_prefix, tmp_path, made):
    """A video fetched by URL is keyed by the same recipe as its inline bytes (its frame
    settings with them), so it is a hit on the inline one's entry, with the same rows."""
    pytest.importorskip("cv2")
    pytest.importorskip("torch")
    from tests.ipc.test_media_video import make_video
    from tests.stages.test_preprocess_video import BOUNDS as VIDEO_BOUNDS
    from tests.stages.test_preprocess_video import SETTINGS as VIDEO

    data = make_video("mp4", "mp4v", 20, 64, 48, 10.0)
    site, w, client, rx = setup(mode, shm_prefix, tmp_path, made, {"/v.mp4": data}, **VIDEO_BOUNDS)
    it = video_item(data, "mp4", min_pixels=VIDEO.min_pixels, max_pixels=VIDEO.max_pixels, fps=VIDEO.fps)
    inline = send(client, rx, it)
    assert rx.wait({inline: 1}, 60), "the inline video's room never concluded"
    at_url = send(client, rx, replace(it, pixels=np.zeros(0, dtype=np.uint8), url=site.url("/v.mp4")))
    assert rx.wait({at_url: 1}, 60), "the URL's room never concluded"
    assert inline not in rx.failed and at_url not in rx.failed, rx.failed
    assert same_rows(rx, inline, at_url)
    items = w.stats()["preprocess_items"]
    assert items.get("decoded") == 1 and items.get("fetched") == 1, items
