"""The hashes of an item's content, the run's cache key they are keyed with, and the
refusals MAC'd under it.

``content_hash`` (unkeyed xxh3) is what gateways route rooms by and anyone can compute;
``cache_hash`` (keyed BLAKE3) is the worker's cache key, which no peer can compute or
collide without the run's key. A refusal (``refusal``) is how a front in the worker's own
main process fails a room at intake, honoured only under that key.
"""

from __future__ import annotations

import secrets
import struct

import blake3
import xxhash

from .wire import VERSION, room_of

CACHE_KEY_BYTES = 32  # the key of the keyed content hash (BLAKE3's key size)


def content_hash(modality: str, grid_thw, pixel_dtype: str, pixels) -> int:
    """Unkeyed 64-bit xxh3 of what determines an embedding: what gateways route rooms by
    (pipeline/peers/client.py's routing_key), which anyone can compute. Never a cache key: a
    peer can craft collisions of it (the worker's cache keys are cache_hash)."""
    h = content_hasher(modality, grid_thw, pixel_dtype)
    h.update(pixels)
    return h.intdigest()


def content_hasher(modality: str, grid_thw, pixel_dtype: str):
    """content_hash as a running hash: update it with the pixel bytes, in any pieces."""
    h = xxhash.xxh3_64()
    h.update(_hash_header(modality, grid_thw, pixel_dtype))
    return h


def cache_hash(key: bytes, modality: str, grid_thw, pixel_dtype: str, pixels) -> bytes:
    """The worker's content hash of an item, its cache key: BLAKE3 in keyed mode (256
    bits) under the worker's secret `key`, of the pixel bytes *and* their grid.

    Keyed, so that no peer can compute it (nor craft two images under one key) without
    the key; the same bytes under another grid (say [1, 4, 8] and [1, 8, 4]) give other
    rows, so the grid and dtype go into the hash, not only the bytes.
    """
    h = cache_hasher(key, modality, grid_thw, pixel_dtype)
    h.update(pixels)
    return h.digest()


def cache_hasher(key: bytes, modality: str, grid_thw, pixel_dtype: str):
    """cache_hash as a running hash: update it with the pixel bytes, in any pieces;
    `digest()` is cache_hash."""
    h = blake3.blake3(key=key)
    h.update(_hash_header(modality, grid_thw, pixel_dtype))
    return h


def media_kind(media: tuple, backend: str) -> str:
    """The `pixel_dtype` a compressed item's bytes are hashed under: its settings, so that
    the same bytes under other settings (other patches) are another entry. `media` is
    WorkItem.media, (format, size, min_pixels, max_pixels), a video's with (fps,
    min_frames, max_frames) after. Intake hashes inline and segment bytes with it, the
    preprocess stage fetched ones."""
    fmt, _, lo, hi, *video = media
    # A video's frames are resized by torch whatever the image backend says.
    tail = "|".join(map(repr, video)) if video else backend
    return f"media|{fmt}|{lo}|{hi}|{tail}"


def _hash_header(modality: str, grid_thw, pixel_dtype: str) -> bytes:
    return f"{modality}|{pixel_dtype}|".encode() + struct.pack(
        f"<{3 * len(grid_thw)}q", *(x for g in grid_thw for x in g)
    )


# A room that a front in the worker's own main process refused (tokenspeed's gRPC front)
# fails at intake with the front's reason. Not a protocol message: intake honours it only
# under a MAC keyed with the run's cache key, which no peer holds; any other is refused
# as a message of an unknown type.
REFUSED = "refused"
MAX_REFUSAL_REASON = 512


def refusal(key: bytes, room: int, request_id: str, reason: str) -> dict:
    reason = reason[:MAX_REFUSAL_REASON]
    return {
        "v": VERSION,
        "type": REFUSED,
        "room": room,
        "request_id": request_id,
        "reason": reason,
        "mac": _refusal_mac(key, room, reason),
    }


def refusal_reason(key: bytes, msg: dict) -> str | None:
    """The reason of a refusal made under `key`; None if `msg` is none."""
    room, reason, mac = room_of(msg), msg.get("reason"), msg.get("mac")
    if (
        msg.get("type") != REFUSED
        or room is None
        or not isinstance(reason, str)
        or not isinstance(mac, bytes)
        or len(reason) > MAX_REFUSAL_REASON
    ):
        return None
    return reason if secrets.compare_digest(mac, _refusal_mac(key, room, reason)) else None


def _refusal_mac(key: bytes, room: int, reason: str) -> bytes:
    # The prefix keeps it apart from the cache hashes under the same key (_hash_header).
    return blake3.blake3(b"refused\0" + struct.pack("<Q", room) + reason.encode(), key=key).digest()


def new_cache_key() -> bytes:
    return secrets.token_bytes(CACHE_KEY_BYTES)


def parse_cache_key(data: bytes) -> bytes:
    """A key file's contents as the key: CACHE_KEY_BYTES raw bytes, or twice as many hex
    digits (surrounding whitespace allowed). ValueError says what is wrong."""
    if len(data) == CACHE_KEY_BYTES:
        return data
    text = data.strip()
    if len(text) == 2 * CACHE_KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise ValueError(
        f"it holds {len(data)} bytes; a cache key is {CACHE_KEY_BYTES} raw bytes or {2 * CACHE_KEY_BYTES} hex digits"
    )


def cache_key_id(key: bytes) -> str:
    """A name for a key that gives nothing of it away: two workers share a key exactly when
    they show the same id (stats, run.py status)."""
    return blake3.blake3(b"epd cache key id", key=key).hexdigest()[:16]
