"""Wire protocol version 1 (1.2: docs/protocol.md): parsing and validation of messages.

Only structure is checked here; rules that need the worker's state (the tower's
patch_dim, the item's span, remembered rooms) are checked by the stages.
"""

from __future__ import annotations

import base64
import functools
import re
from collections import Counter
from dataclasses import dataclass
from typing import TypeGuard

import msgpack
import xxhash

from ipc import fetch

VERSION = 1
U64_MAX = 2**64 - 1
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
MODALITIES = ("image", "video")
MAX_REQUEST_ID = 128
MAX_ID_CHARS = 256  # receiver ids, sessions, endpoints
MAX_SESSION_BYTES = 4 * MAX_ID_CHARS - 24  # room for an incarnation beside it (ipc/receivers.py)
MAX_REASON_KEYS = 64
MAX_CACHE_SALT = 128  # characters of an encode's cache_salt (protocol 1.1)
MAX_ROOM_RECEIVERS = 7  # (1.2) receiver keys an encode may name: with its gateway's, ipc/room_record.py's ROOM_KEYS
_Z85_KEY = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")  # a CurveZMQ public key
# What ZeroMQ can connect to: a host (name, IPv4 or [IPv6]) and a port, or an ipc path
# that fits a socket address. Anything else makes connect() raise in the reaper.
# A status endpoint under TOKENSPEED_STATUS hears tokenspeed's status frames instead of
# ours (tokenspeed_status): what the tokenspeed frame front registers its prefill ranks with.
TOKENSPEED_STATUS = "tokenspeed+"
_STATUS_ENDPOINT = re.compile(
    r"(?:tokenspeed\+)?tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})|ipc://[^\0]{1,100}"
)


class ProtocolError(ValueError):
    """A message breaks a rule; str(e) is the reason sent to the client."""


def is_u64(x: object) -> TypeGuard[int]:
    return type(x) is int and 0 <= x <= U64_MAX


def is_int(x: object) -> TypeGuard[int]:
    return type(x) is int


def decode(frame: bytes) -> dict:
    """One frame -> its map. ProtocolError if it is not a msgpack map with string keys."""
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"not a msgpack message ({type(e).__name__})") from None
    if not isinstance(msg, dict):
        raise ProtocolError("message is not a map")
    if type(msg.get("v")) is not int or msg["v"] != VERSION:  # True and 1.0 equal 1 in Python
        raise ProtocolError(f"unsupported protocol version {msg.get('v')!r} (this worker speaks {VERSION})")
    if not isinstance(msg.get("type"), str):
        raise ProtocolError("missing message type")
    return msg


def encode(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def count_reason(counter: Counter, key: str) -> None:
    """Count one message under `key` (cut to 80 characters), or under "other" once the
    counter has MAX_REASON_KEYS keys: reasons quote what clients sent, and no client may
    grow the worker's counters."""
    key = key[:80]
    if key in counter or len(counter) < MAX_REASON_KEYS:
        counter[key] += 1
    else:
        counter["other"] += 1


def room_of(msg) -> int | None:
    """The message's room if it can be read, else None."""
    if isinstance(msg, dict) and is_u64(msg.get("room")):
        return msg["room"]
    return None


# ---------------------------------------------------------------- intake


@dataclass
class PixelsRef:
    shape: tuple[int, int]
    dtype: str
    shm: str | None = None
    data: bytes | None = None
    media: MediaRef | None = None  # compressed (protocol 1.2): these bytes are the image's or video's file

    @property
    def nbytes(self) -> int:
        if self.media is not None:
            return self.media.size
        return self.shape[0] * self.shape[1] * DTYPES[self.dtype]


@dataclass(frozen=True)
class MediaRef:
    """A compressed image or video (protocol 1.2): its format, its size in bytes, the
    processor's resize bounds the gateway asked for (0: the worker's own), and a video's
    sampling: frames per second and bounds on the frames sampled (0: the worker's own)."""

    format: str
    size: int
    min_pixels: int = 0
    max_pixels: int = 0
    url: str = ""  # an http(s) URL to fetch the bytes from (size 0 until then)
    fps: float = 0.0
    min_frames: int = 0
    max_frames: int = 0


@dataclass
class EncodeItem:
    modality: str
    grid_thw: list[tuple[int, int, int]]
    pixels: PixelsRef
    hash: int | None


@dataclass
class EncodeRequest:
    request_id: str
    room: int
    items: list[EncodeItem]
    deadline_ms: int | None
    cache_salt: str = ""  # absent (or nil) is the empty salt
    receivers: tuple[str, ...] = ()  # (1.2) the receivers' public keys (Z85) the room belongs to


def shm_names(msg: dict) -> list[str]:
    """Every segment name the message hands over, valid or not: they are the worker's to unlink."""
    out = []
    items = msg.get("items")
    if isinstance(items, list):
        for it in items:
            for key in ("pixels", "media"):
                if isinstance(it, dict) and isinstance(it.get(key), dict):
                    name = it[key].get("shm")
                    if isinstance(name, str):
                        out.append(name)
    return out


def parse_encode(msg: dict, max_items: int) -> EncodeRequest:
    if msg.get("type") != "encode":
        raise ProtocolError(f"intake takes 'encode' messages, not {msg.get('type')!r}")
    rid = msg.get("request_id")
    if not isinstance(rid, str) or not 1 <= len(rid) <= MAX_REQUEST_ID:
        raise ProtocolError(f"request_id must be a string of 1..{MAX_REQUEST_ID} characters")
    room = room_of(msg)
    if room is None:
        raise ProtocolError("room must be an unsigned 64-bit integer")
    deadline = msg.get("deadline_ms")
    if deadline is not None and (not is_int(deadline) or not 1 <= deadline <= 10**9):
        raise ProtocolError("deadline_ms must be an integer in 1..1e9")
    salt = msg.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT):
        raise ProtocolError(f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters")
    receivers = msg.get("receivers")
    if receivers is not None and not (
        isinstance(receivers, list)
        and 1 <= len(receivers) <= MAX_ROOM_RECEIVERS
        and all(isinstance(k, str) and _Z85_KEY.fullmatch(k) for k in receivers)
    ):
        raise ProtocolError(
            f"receivers must be a list of 1..{MAX_ROOM_RECEIVERS} CurveZMQ public keys (40 characters of Z85)"
        )
    items = msg.get("items")
    if not isinstance(items, list) or not 1 <= len(items) <= max_items:
        raise ProtocolError(f"items must be a list of 1..{max_items} items (max_items_per_request)")
    parsed = [_parse_item(i, it) for i, it in enumerate(items)]
    return EncodeRequest(rid, room, parsed, deadline, salt or "", tuple(dict.fromkeys(receivers or ())))


def _parse_item(i: int, it) -> EncodeItem:
    if not isinstance(it, dict):
        raise ProtocolError(f"item {i}: not a map")
    modality = it.get("modality")
    if modality not in MODALITIES:
        raise ProtocolError(f"item {i}: modality must be 'image' or 'video', got {modality!r}")
    grid = it.get("grid_thw")
    if not isinstance(grid, list) or not 1 <= len(grid) <= 4096:
        raise ProtocolError(f"item {i}: grid_thw must be a non-empty list of [t, h, w]")
    thw = []
    for g in grid:
        if not (isinstance(g, list) and len(g) == 3 and all(is_int(x) and 1 <= x <= 1 << 20 for x in g)):
            raise ProtocolError(f"item {i}: each grid_thw entry must be [t, h, w] with integers in 1..2^20")
        thw.append((g[0], g[1], g[2]))
    if "media" in it:
        if "pixels" in it:
            raise ProtocolError(f"item {i}: an item has pixels or media, not both")
        ref = _parse_media(i, it["media"])
        assert ref.media is not None
        if (ref.media.format in VIDEO_FORMATS) != (modality == "video"):
            raise ProtocolError(f"item {i}: media.format {ref.media.format} is not {modality}")
        if modality == "image" and (len(thw) != 1 or thw[0][0] != 1):
            raise ProtocolError(f"item {i}: an image's grid_thw is one [1, h, w]")
        if len(thw) != 1:
            raise ProtocolError(f"item {i}: a compressed video's grid_thw is one [t, h, w]")
        h = it.get("hash")
        if h is not None and not is_u64(h):
            raise ProtocolError(f"item {i}: hash must be an unsigned 64-bit integer")
        return EncodeItem(modality, thw, ref, h)
    px = it.get("pixels")
    if not isinstance(px, dict):
        raise ProtocolError(f"item {i}: pixels must be a map")
    has_shm, has_data = "shm" in px, "data" in px
    if has_shm == has_data:
        raise ProtocolError(f"item {i}: pixels must have exactly one of 'shm' or 'data'")
    shape = px.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(is_int(x) and 1 <= x <= 1 << 40 for x in shape)):
        raise ProtocolError(f"item {i}: pixels.shape must be [n_patches, patch_dim] of positive integers")
    dtype = px.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:  # a list would raise: not hashable
        raise ProtocolError(f"item {i}: pixels.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ref = PixelsRef(shape=(shape[0], shape[1]), dtype=dtype)
    if has_shm:
        if not isinstance(px["shm"], str):
            raise ProtocolError(f"item {i}: pixels.shm must be a string")
        ref.shm = px["shm"]
    else:
        if not isinstance(px["data"], bytes):
            raise ProtocolError(f"item {i}: pixels.data must be bytes")
        ref.data = px["data"]
    h = it.get("hash")
    if h is not None and not is_u64(h):
        raise ProtocolError(f"item {i}: hash must be an unsigned 64-bit integer")
    return EncodeItem(modality, thw, ref, h)


VIDEO_FORMATS = ("mp4", "webm")
MEDIA_FORMATS = ("jpeg", "png", "webp", *VIDEO_FORMATS)
MAX_MEDIA_PIXELS = 1 << 30  # bounds on min_pixels and max_pixels as numbers; the worker has its own
_HTTP = ("http://", "https://")
MAX_MEDIA_FRAMES = 768  # a video's min_frames and max_frames: vLLM's Qwen loaders sample no more
MAX_MEDIA_FPS = 1000.0  # a number's bound only: vLLM's Qwen loaders sample at most 30 a second
_DATA_URL = re.compile(r"data:(?:image/(jpeg|jpg|png|webp)|video/(mp4|webm));base64,", re.I)


def _parse_media(i: int, m) -> PixelsRef:
    """An item's `media` map: the file's bytes inline (`data`), in a segment (`shm` and
    `size`), as a base64 `data:` URL or at an http(s) URL (`url`), with its `format`."""
    if not isinstance(m, dict):
        raise ProtocolError(f"item {i}: media must be a map")
    bounds = []
    for key in ("min_pixels", "max_pixels"):
        v = m.get(key)
        if v is not None and not (is_int(v) and 1 <= v <= MAX_MEDIA_PIXELS):
            raise ProtocolError(f"item {i}: media.{key} must be an integer in 1..2^30")
        bounds.append(v or 0)
    if bounds[0] and bounds[1] and bounds[0] > bounds[1]:
        raise ProtocolError(f"item {i}: media.min_pixels is above media.max_pixels")
    sources = [k for k in ("data", "shm", "url") if k in m]
    if len(sources) != 1:
        raise ProtocolError(f"item {i}: media must have exactly one of 'data', 'shm' or 'url'")
    fmt, data, shm, url = m.get("format"), None, None, ""
    if sources[0] == "url" and isinstance(m["url"], str) and m["url"][:8].lower().startswith(_HTTP):
        # Fetched by the preprocess stage where the worker allows its host (intake checks);
        # its size is known only then, and its format is the sender's to say.
        try:
            url = str(fetch.parse_url(m["url"]))
        except ValueError as e:
            raise ProtocolError(f"item {i}: media.url: {e}") from None
        if fmt not in MEDIA_FORMATS:
            raise ProtocolError(f"item {i}: an http(s) media.url needs media.format ({', '.join(MEDIA_FORMATS)})")
    elif sources[0] == "url":
        text = m["url"]
        match = _DATA_URL.match(text) if isinstance(text, str) else None
        if match is None:
            raise ProtocolError(
                f"item {i}: media.url must be a data:image/(jpeg|png|webp);base64, or "
                f"data:video/(mp4|webm);base64, URL, or an http(s) URL"
            )
        try:
            data = base64.b64decode(text[match.end() :], validate=True)
        except ValueError:
            raise ProtocolError(f"item {i}: media.url is not valid base64") from None
        named = (match.group(1) or match.group(2)).lower()
        fmt = fmt or {"jpg": "jpeg"}.get(named, named)
    elif sources[0] == "data":
        data = m["data"]
        if not isinstance(data, bytes):
            raise ProtocolError(f"item {i}: media.data must be bytes")
    else:
        shm = m["shm"]
        if not isinstance(shm, str):
            raise ProtocolError(f"item {i}: media.shm must be a string")
    if fmt not in MEDIA_FORMATS:
        raise ProtocolError(f"item {i}: media.format must be one of {', '.join(MEDIA_FORMATS)}, got {fmt!r}")
    size = len(data) if data is not None else 0 if url else m.get("size")
    if not (is_int(size) and (1 <= size <= 1 << 40 or (url and size == 0))):
        raise ProtocolError(f"item {i}: media must have 1 or more bytes (media.size with media.shm)")
    ref = MediaRef(fmt, size, bounds[0], bounds[1], url, *_video_sampling(i, m, fmt))
    return PixelsRef(shape=(size, 1), dtype="float32", shm=shm, data=data, media=ref)


def _video_sampling(i: int, m: dict, fmt: str) -> tuple[float, int, int]:
    """A video's fps, min_frames and max_frames (0 where the map gives none)."""
    keys = [k for k in ("fps", "min_frames", "max_frames") if m.get(k) is not None]
    if fmt not in VIDEO_FORMATS:
        if keys:
            raise ProtocolError(f"item {i}: media.{keys[0]} is for a video")
        return 0.0, 0, 0
    fps = m.get("fps")
    if fps is not None and not (type(fps) in (int, float) and 0 < fps <= MAX_MEDIA_FPS):
        raise ProtocolError(f"item {i}: media.fps must be a number above 0, at most {MAX_MEDIA_FPS:g}")
    frames = []
    for key in ("min_frames", "max_frames"):
        v = m.get(key)
        if v is not None and not (is_int(v) and 1 <= v <= MAX_MEDIA_FRAMES):
            raise ProtocolError(f"item {i}: media.{key} must be an integer in 1..{MAX_MEDIA_FRAMES}")
        frames.append(v or 0)
    return float(fps or 0.0), frames[0], frames[1]


def check_item_against_tower(i: int, item: EncodeItem, patch_dim: int, merge: int) -> int:
    """Rules that need the tower; returns the item's span."""
    n_patches = 0
    for t, h, w in item.grid_thw:
        if h % merge or w % merge:
            raise ProtocolError(f"item {i}: grid [{t}, {h}, {w}] has h or w not divisible by the merge size {merge}")
        n_patches += t * h * w
    if item.pixels.media is not None:  # the patches are the preprocess stage's to make, and check
        return n_patches // (merge * merge)
    if item.pixels.shape[0] != n_patches:
        raise ProtocolError(
            f"item {i}: pixels.shape[0] is {item.pixels.shape[0]} but grid_thw gives {n_patches} patches"
        )
    if item.pixels.shape[1] != patch_dim:
        raise ProtocolError(
            f"item {i}: pixels.shape[1] is {item.pixels.shape[1]} but the tower's patch_dim is {patch_dim}"
        )
    if item.pixels.data is not None and len(item.pixels.data) != item.pixels.nbytes:
        raise ProtocolError(
            f"item {i}: inline data has {len(item.pixels.data)} bytes, shape and dtype need {item.pixels.nbytes}"
        )
    return n_patches // (merge * merge)


# ---------------------------------------------------------------- bootstrap


@dataclass(frozen=True)
class KeyedFrame:
    """A frame from a CurveZMQ socket, with the public key (Z85) its peer authenticated
    with: the worker binds a receiver id to the key that registered it."""

    data: bytes
    key: str

    def __len__(self) -> int:
        return len(self.data)


def key_tag(key: str) -> int:
    """A CurveZMQ public key (Z85) as the room table keeps it: a non-zero 64-bit hash; 0
    for no key (no CURVE). Admitted keys are the operator's: none is made to collide."""
    return (xxhash.xxh3_64_intdigest(key.encode()) or 1) if key else 0


@dataclass
class Register:
    receiver: str
    session: str
    status: str
    incarnation: int | None = None  # (1.1) a receiver restarted on the same session registers a new one
    # Not on the wire: the CurveZMQ public key the register came under ('' without CURVE),
    # set by the worker; the id is the key's while the registration lives.
    key: str = ""
    # (1.1) The receiver asks the worker to say, on its status socket, that it speaks 1.1:
    # its successes then carry digests, and the receiver may require them.
    hello: bool = False

    @functools.cached_property
    def session_hash(self) -> int:
        """A 64-bit hash of the session and incarnation: an alloc's addresses name memory of
        one Mooncake session, and a receiver registered again under another session, or
        under another incarnation of the same one, is another process."""
        return binding_hash(self.session, self.incarnation)


def binding_hash(session: str, incarnation: int | None) -> int:
    """Register.session_hash of a receiver process: its session, and its incarnation if it
    names one."""
    tail = b"" if incarnation is None else b"\0" + str(incarnation).encode()
    return xxhash.xxh3_64_intdigest(session.encode() + tail)


@dataclass
class Alloc:
    receiver: str
    room: int
    item: int
    dst: int
    dst_deepstack: int
    row_start: int
    n_rows: int
    span: int
    hidden: int
    dtype: str
    deepstack_width: int
    fanout: int
    incarnation: int | None = None  # (1.1) the receiver process's incarnation it was sent by
    # Not on the wire: Register.session_hash of the registration the alloc came under, set by
    # the worker. Rows are written only while the receiver's session is still that one.
    session_hash: int = 0
    # A self-describing alloc (1.1): the receiver's session and status endpoint, which
    # register it when it is not registered (or registered with others).
    session: str | None = None
    status: str | None = None
    # Not on the wire: the CurveZMQ public key the alloc came under ('' without CURVE), set
    # by the worker; a held alloc keeps it, for the room's keys to be checked when it opens.
    key: str = ""


@dataclass
class Cancel:
    receiver: str
    room: int


@dataclass
class Query:
    """(1.1) The receiver heard nothing of a room for a while: the worker repeats what it
    told it about the room."""

    receiver: str
    room: int


def _short_str(msg: dict, key: str) -> str:
    v = msg.get(key)
    if not isinstance(v, str) or not 1 <= len(v) <= MAX_ID_CHARS:
        raise ProtocolError(f"{key} must be a string of 1..{MAX_ID_CHARS} characters")
    return v


def _status_endpoint(msg: dict) -> str:
    status = _short_str(msg, "status")
    m = _STATUS_ENDPOINT.fullmatch(status)
    if m is None or (m.group(2) is not None and not 1 <= int(m.group(2)) <= 65535):
        raise ProtocolError(
            "status must be an endpoint tcp://host:port (port 1..65535) or ipc://path (up to 100 characters)"
        )
    return status


def _session(msg: dict) -> str:
    """A register's session, or a self-describing alloc's: both become a registration."""
    session = _short_str(msg, "session")
    if "\0" in session or len(session.encode()) > MAX_SESSION_BYTES:
        # The receiver table keeps an incarnation after a NUL in the session's field.
        raise ProtocolError(f"session must hold no NUL and at most {MAX_SESSION_BYTES} bytes of UTF-8")
    return session


def _incarnation(msg: dict) -> int | None:
    v = msg.get("incarnation")
    if v is not None and not is_u64(v):
        raise ProtocolError("incarnation must be an unsigned 64-bit integer")
    return v


def parse_bootstrap(msg: dict) -> Register | Alloc | Cancel | Query:
    kind = msg.get("type")
    if kind == "register":
        status = _status_endpoint(msg)
        hello = msg.get("hello", False)
        if type(hello) is not bool:
            raise ProtocolError("hello must be true or false")
        return Register(_short_str(msg, "receiver"), _session(msg), status, _incarnation(msg), hello=hello)
    if kind in ("cancel", "query"):
        room = room_of(msg)
        if room is None:
            raise ProtocolError("room must be an unsigned 64-bit integer")
        return (Cancel if kind == "cancel" else Query)(_short_str(msg, "receiver"), room)
    if kind != "alloc":
        raise ProtocolError(f"bootstrap takes register, alloc, cancel or query, not {kind!r}")
    receiver = _short_str(msg, "receiver")
    for key in ("room", "dst", "dst_deepstack"):
        if not is_u64(msg.get(key)):
            raise ProtocolError(f"{key} must be an unsigned 64-bit integer")
    for key in ("item", "row_start", "n_rows", "span", "hidden", "deepstack_width"):
        v = msg.get(key)
        if not is_int(v) or not 0 <= v <= 1 << 40:
            raise ProtocolError(f"{key} must be a non-negative integer")
    fanout = msg.get("fanout")
    if not is_int(fanout) or not 1 <= fanout <= 1024:
        raise ProtocolError("fanout must be an integer in 1..1024")
    if not isinstance(msg.get("dtype"), str) or msg["dtype"] not in DTYPES:
        raise ProtocolError(f"dtype must be one of {', '.join(DTYPES)}")
    alloc = Alloc(
        receiver,
        msg["room"],
        msg["item"],
        msg["dst"],
        msg["dst_deepstack"],
        msg["row_start"],
        msg["n_rows"],
        msg["span"],
        msg["hidden"],
        msg["dtype"],
        msg["deepstack_width"],
        fanout,
        _incarnation(msg),
    )
    if "session" in msg or "status" in msg:
        alloc.session, alloc.status = _session(msg), _status_endpoint(msg)
    return alloc


def status_message(
    room: int, item: int | None, ok: bool, reason: str = "", *, digest: bytes | None = None, repeat: bool = False
) -> bytes:
    msg = {
        "v": VERSION,
        "type": "status",
        "room": room,
        "item": item,
        "state": "success" if ok else "failed",
        "reason": "" if ok else reason,
    }
    if digest is not None:
        msg["digest"] = digest
    if repeat:
        msg["repeat"] = True
    return encode(msg)


DIGEST_BYTES = 16
SPEAKS = "1.1"


def hello_message() -> bytes:
    """(1.1) The answer to a register that asks (`hello`): this worker speaks 1.1, and every
    `success` it sends carries the digest of the rows it wrote."""
    return encode({"v": VERSION, "type": "hello", "speaks": SPEAKS})


def rows_digest(parts) -> bytes:
    """(1.1) The digest a `success` carries: xxh3-128 of exactly the bytes written for one
    receiver's shard, its main half then its deepstack half (`parts`: buffers, in order)."""
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.digest()


def tokenspeed_status(frame: bytes) -> list[bytes]:
    """One of our status frames as tokenspeed's: [room, "5" (success) or "0" (failed), encode
    rank "0"], ASCII. Exactly these three integer parts: anything else ends tokenspeed's
    status thread. An item's success is its room's (tokenspeed rooms have one item)."""
    st = msgpack.unpackb(frame, raw=False)
    return [str(st["room"]).encode(), b"5" if st["state"] == "success" else b"0", b"0"]
