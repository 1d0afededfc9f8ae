"""Gateway-side library: publishes pixels and sends `encode` messages (docs/protocol.md section 1)."""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import numpy as np
import zmq

from ipc import media, shm
from ipc import wire
from pipeline.peers import curve
from pipeline.peers.routing import HashRing
from ipc.hashing import content_hash

_NP_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}


@dataclass
class Item:
    """One vision item. bfloat16 pixels are a uint16 array of their raw bits with dtype='bfloat16'.

    A compressed image or video (protocol 1.2, `image_item`, `video_item`): `pixels` holds the file's bytes
    (uint8), `media` its format, and min_pixels/max_pixels the processor's bounds (0: the
    worker's); the worker decodes it. One at an http(s) URL (`url_item`): `url` instead of
    bytes (`pixels` empty), fetched by a worker that allows its host (media_url_hosts)."""
    modality: str
    grid_thw: list
    pixels: np.ndarray
    dtype: str | None = None
    hash: int | None = None
    media: str | None = None
    min_pixels: int = 0
    max_pixels: int = 0
    url: str | None = None
    fps: float = 0.0  # a compressed video's sampling (`video_item`); 0: the worker's
    min_frames: int = 0
    max_frames: int = 0

    def dtype_name(self) -> str:
        if self.media is not None:
            return "media|" + self.media
        if self.dtype:
            return self.dtype
        try:
            return _NP_NAMES[np.dtype(self.pixels.dtype)]
        except KeyError:
            raise ValueError(f"pixels of dtype {self.pixels.dtype} need dtype='bfloat16' (uint16 bits) "
                             f"or float32/float16") from None


class Client:
    """Sends encode requests to one worker.

    Pixels travel in a POSIX shared-memory segment under the worker's prefix (the
    worker reads it and unlinks it; one the worker never takes, its room over, is
    unlinked here: `conclude(room)`, a room's deadline passed, `close()`), or inline in the message with ``inline=True``
    (always, when ``shm_prefix`` is None: a worker on another host).

    With a worker that uses CurveZMQ: ``curve_cert``, this gateway's secret certificate
    (a zmq.auth ``.key_secret`` file whose public half is in the worker's curve_clients),
    and ``worker_cert``, the worker's public certificate.
    """

    def __init__(self, intake: str, shm_prefix: str | None, ctx: zmq.Context | None = None, *,
                 curve_cert: str | None = None, worker_cert: str | None = None):
        self.shm_prefix = shm.check_prefix(shm_prefix) if shm_prefix is not None else None
        keys = curve.peer_keys(curve_cert, worker_cert)
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 5000)
        if keys is not None:
            curve.connect_as(self.sock, *keys)
        self.sock.connect(intake)
        self._names = itertools.count()
        # room -> (its segments, its send time plus its deadline), until the room
        # concludes: a worker that dies (or never reads the encode) leaves them to this
        # client, their creator.
        self.segments: dict[int, tuple[list[str], float]] = {}

    def publish(self, pixels: np.ndarray) -> str:
        """Write pixels into a new segment named for this worker; returns its name."""
        if self.shm_prefix is None:
            raise ValueError("this client has no shm prefix (its worker is on another host): send pixels inline")
        # Named for this process, so that a worker starting later can tell the segments
        # of a creator that died (shm.sweep_pixel_segments).
        name = "/" + shm.pixel_segment_name(self.shm_prefix, next(self._names))
        data = np.ascontiguousarray(pixels)
        fd = os.open(os.path.join(shm.SHM_DIR, name[1:]), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data).cast("B")
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
        except BaseException:
            os.unlink(os.path.join(shm.SHM_DIR, name[1:]))
            raise
        finally:
            os.close(fd)
        return name

    def message(self, room: int, request_id: str, items: list[Item], *, deadline_ms: int | None = None,
                inline: bool = False, cache_salt: str | None = None, receivers=None) -> dict:
        """The `encode` message; `cache_salt` (protocol 1.1, at most 128 characters): items
        of requests with other salts never share a cache entry or an encode with these;
        `receivers` (1.2, under CurveZMQ): the public keys (Z85, as `curve.load_public`
        gives them) of the receivers the room belongs to besides this gateway's."""
        inline = inline or self.shm_prefix is None
        msg_items = []
        published = []
        try:
            for it in items:
                if it.media is not None:
                    px = {"format": it.media, **{k: v for k, v in (
                        ("min_pixels", it.min_pixels), ("max_pixels", it.max_pixels), ("fps", it.fps),
                        ("min_frames", it.min_frames), ("max_frames", it.max_frames)) if v}}
                else:
                    px = {"shape": list(it.pixels.shape), "dtype": it.dtype_name()}
                if it.url is not None:
                    px["url"] = it.url
                elif inline:
                    px["data"] = np.ascontiguousarray(it.pixels).tobytes()
                else:
                    px["shm"] = self.publish(it.pixels)
                    published.append(px["shm"])
                    if it.media is not None:
                        px["size"] = it.pixels.nbytes
                entry = {"modality": it.modality, "grid_thw": [list(g) for g in it.grid_thw],
                         "media" if it.media is not None else "pixels": px}
                if it.hash is not None:
                    entry["hash"] = it.hash
                msg_items.append(entry)
        except BaseException:
            for name in published:
                unlink_segment(name)
            raise
        if published:
            self._expire()
            # Kept SEGMENT_KEEP_S past the deadline, read when it expires: a deadline counts
            # from the worker's reading of the message, which may wait in its queue or
            # behind a full pixel arena, so a short one would unlink what it is yet to read.
            until = time.monotonic() + (deadline_ms or 0) / 1000
            names, _ = self.segments.get(room, ([], 0.0))
            self.segments[room] = (names + published, until)
        msg = {"v": wire.VERSION, "type": "encode", "request_id": request_id, "room": room,
               "items": msg_items}
        if deadline_ms is not None:
            msg["deadline_ms"] = deadline_ms
        if cache_salt is not None:
            msg["cache_salt"] = cache_salt
        if receivers is not None:
            msg["receivers"] = [k.decode() if isinstance(k, bytes) else k for k in receivers]
        return msg

    def encode(self, room: int, request_id: str, items: list[Item], *, deadline_ms: int | None = None,
               inline: bool = False, cache_salt: str | None = None, receivers=None) -> None:
        self.send(self.message(room, request_id, items, deadline_ms=deadline_ms, inline=inline,
                               cache_salt=cache_salt, receivers=receivers))

    def send(self, msg: dict) -> None:
        self.sock.send(wire.encode(msg))

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def conclude(self, room: int) -> None:
        """The room is over (its receivers have their statuses, or gave it up): a segment
        of it that the worker has not taken never will be, and is unlinked."""
        names, _ = self.segments.pop(room, ([], 0.0))
        for name in names:
            unlink_segment(name)

    def _expire(self) -> None:
        now = time.monotonic()
        for room in [r for r, (_, until) in self.segments.items() if until + SEGMENT_KEEP_S <= now]:
            self.conclude(room)

    def close(self, abandon: bool = False) -> None:
        """Close the socket (what it still queues goes out within its linger); with
        `abandon`, at a gateway's exit, also unlink every segment of a room not
        concluded (an encode the worker has not read yet then fails for want of its
        pixels)."""
        if abandon:
            for room in list(self.segments):
                self.conclude(room)
        self.sock.close()


# A room's untaken segments are given up this long after it was sent, plus its deadline
# (the worker's own max_deadline_s, by default): a worker that has not read them by then
# is not serving it.
SEGMENT_KEEP_S = 3600.0


@dataclass(frozen=True)
class WorkerAddress:
    """One worker as a gateway sees it. `bootstrap` names it: on the ring, and to
    the receivers that send it allocs."""
    intake: str
    bootstrap: str
    shm_prefix: str | None = None  # when it shares this host's /dev/shm; None: pixels go inline


def image_item(data: bytes, fmt: str, *, min_pixels: int, max_pixels: int, patch: int = 14, merge: int = 2,
               max_decoded_pixels: int = 64 << 20) -> Item:
    """A compressed image (jpeg, png or webp) as an item: its grid from the file's header
    alone (no decode; Pillow needed). min_pixels and max_pixels are sent with it, so they
    must be the model's processor's; patch and merge are the tower's. ipc.media.MediaError
    if the header cannot be read or breaks a bound."""
    settings = media.ImageSettings(patch=patch, merge=merge, min_pixels=min_pixels, max_pixels=max_pixels,
                                   max_decoded_pixels=max_decoded_pixels)
    grid = media.image_grid(data, fmt, settings)
    return Item("image", [list(grid)], np.frombuffer(data, dtype=np.uint8), media=fmt,
                min_pixels=min_pixels, max_pixels=max_pixels)


def url_item(url: str, fmt: str, grid_thw, *, min_pixels: int = 0, max_pixels: int = 0) -> Item:
    """A compressed image at an http(s) URL as an item. The worker fetches it (where its
    media_url_hosts allows the host), so the caller gives its grid: the one the
    processor makes of the image under min_pixels and max_pixels (0: the worker's), as
    `image_item` reads it from the file's header; a grid that is not fails the room."""
    return Item("image", [list(grid_thw)], np.zeros(0, dtype=np.uint8), media=fmt,
                min_pixels=min_pixels, max_pixels=max_pixels, url=url)


def video_item(data: bytes, fmt: str, *, min_pixels: int, max_pixels: int, fps: float = 2.0, min_frames: int = 4,
               max_frames: int = 768, patch: int = 14, merge: int = 2, max_decoded_pixels: int = 64 << 20,
               max_stream_pixels: int = 1 << 34, family: str = "qwen2") -> Item:
    """A compressed video (mp4 or webm) as an item: its grid from the container's header
    (OpenCV needed; no frame decoded but the one a seek to the stream's end reads). The
    settings are sent with it, so they must be the model's processor's and loader's (vLLM's
    defaults: 2 frames a second, 4 to 768 frames); patch, merge and family are the tower's
    (family "qwen3" for Qwen3-VL, with patch 16). ipc.media.MediaError if the header cannot
    be read or breaks a bound."""
    from ipc import media_video

    settings = media_video.VideoSettings(patch=patch, merge=merge, min_pixels=min_pixels, max_pixels=max_pixels,
                                         fps=fps, min_frames=min_frames, max_frames=max_frames,
                                         max_decoded_pixels=max_decoded_pixels, max_stream_pixels=max_stream_pixels,
                                         family=family)
    grid = media_video.video_grid(data, fmt, settings)
    return Item("video", [list(grid)], np.frombuffer(data, dtype=np.uint8), media=fmt, min_pixels=min_pixels,
                max_pixels=max_pixels, fps=float(fps), min_frames=min_frames, max_frames=max_frames)


def routing_key(items: list[Item]) -> int:
    """A room's key on the ring: its first item's unkeyed content hash, so that a repeated
    image goes to the same worker (or the item's own `hash` when the gateway gives one).
    Not the worker's cache key, which is keyed with a secret the gateway does not hold."""
    first = items[0]
    if first.hash is not None:
        return first.hash
    if first.url is not None:  # the worker alone sees its bytes: the same URL goes to the same worker
        return content_hash(first.modality, first.grid_thw, first.dtype_name(), first.url.encode())
    return content_hash(first.modality, first.grid_thw, first.dtype_name(),
                        np.ascontiguousarray(first.pixels))


class RoutedClient:
    """Sends each room to one of many workers by its routing key on a consistent-hash
    ring, so a repeated image goes where it is cached, and remembers which worker
    each room went to: the prefill side must send that room's allocs there
    (`Receiver.alloc(..., worker=bootstrap)`). Call `forget(room)` once the room
    has concluded."""

    def __init__(self, workers: list[WorkerAddress], *, vnodes: int = 256, ctx: zmq.Context | None = None,
                 curve_cert: str | None = None, worker_cert: str | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.certs = dict(curve_cert=curve_cert, worker_cert=worker_cert)  # every worker's: one certificate
        self.ring = HashRing(vnodes=vnodes)
        self.clients: dict[str, Client] = {}
        self.rooms: dict[int, str] = {}  # room -> bootstrap of its worker
        for w in workers:
            self.add(w)

    def add(self, worker: WorkerAddress) -> None:
        self.ring.add(worker.bootstrap)
        self.clients[worker.bootstrap] = Client(worker.intake, worker.shm_prefix, self.ctx, **self.certs)

    def remove(self, bootstrap: str) -> None:
        """Take a worker off the ring: only the keys it owned move to others."""
        self.ring.remove(bootstrap)
        self.clients.pop(bootstrap).close()

    def route(self, items: list[Item]) -> str:
        """The bootstrap endpoint of the worker these items go to."""
        if not items:
            raise ValueError("a room needs at least one item to be routed")
        return self.ring.route(routing_key(items))

    def encode(self, room: int, request_id: str, items: list[Item], *, deadline_ms: int | None = None,
               inline: bool = False, cache_salt: str | None = None, receivers=None) -> str:
        """Send the room to its worker; returns that worker's bootstrap endpoint."""
        bootstrap = self.route(items)
        self.clients[bootstrap].encode(room, request_id, items, deadline_ms=deadline_ms, inline=inline,
                                       cache_salt=cache_salt, receivers=receivers)
        self.rooms[room] = bootstrap
        return bootstrap

    def worker_of(self, room: int) -> str:
        return self.rooms[room]

    def forget(self, room: int) -> None:
        self.rooms.pop(room, None)

    def conclude(self, room: int) -> None:
        """The room is over: its untaken segments are unlinked, and it is forgotten."""
        bootstrap = self.rooms.pop(room, None)
        if bootstrap in self.clients:
            self.clients[bootstrap].conclude(room)

    def close(self, abandon: bool = False) -> None:
        for c in self.clients.values():
            c.close(abandon)
        self.clients = {}


def unlink_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(shm.SHM_DIR, name.lstrip("/")))
    except FileNotFoundError:
        pass
