"""One room's entry in the room table (ipc/rooms.py): a pair of records, their bytes and fields.

Torn updates. Each entry has a u32 sequence number and two copies of its
record; copy ``seq & 1`` is the active one. A writer (lock held) writes the whole
new record into the *inactive* copy, body first and its crc32 last, and only then
publishes it with one aligned 4-byte store of ``seq + 1``. So:

* a writer killed at any point leaves ``seq`` unchanged and the active copy
  untouched: the update simply did not happen;
* a reader reads ``seq``, the active copy, then ``seq`` again: if it changed, a
  writer published meanwhile and the reader retries; if not, no writer can have
  touched that copy (it writes only the other one until it publishes), so the
  copy is whole. Its crc32 (and its stored sequence number) are checked besides;
  a mismatch with a stable ``seq`` is damage, not a race, and the entry is
  repaired under the lock: a live room whose record is lost is concluded FAILED.

A record is a crc32 over the rest, then the body: the sequence number it was written
for, then the fields (ROOM ... KEYS index them, after that number). ``request_id``
(REQUEST_ID_BYTES of UTF-8) and ``reason`` (REASON_BYTES) are cut with '…' when longer.
"""

from __future__ import annotations

import struct
import zlib

from .room_entry import RoomState

REQUEST_ID_BYTES = 128
REASON_BYTES = 256
ROOM_KEYS = 8  # the opening gateway's key and up to seven receivers' (wire.MAX_ROOM_RECEIVERS)
BODY = struct.Struct(f"<IQBBHIIddd{REQUEST_ID_BYTES}s{REASON_BYTES}s{ROOM_KEYS}Q")
RECORD_BYTES = 4 + BODY.size

# body field indices (after the sequence number)
ROOM, STATE, RIDLEN, REASONLEN, TOTAL, DONE, DEADLINE, CREATED, CONCLUDED, RID, REASON = range(11)
KEYS = slice(11, 11 + ROOM_KEYS)
FREE_FIELDS = (0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, b"", b"") + (0,) * ROOM_KEYS


def cut(text: str, limit: int) -> bytes:
    b = text.encode("utf-8")
    if len(b) <= limit:
        return b
    return b[: limit - 3].decode("utf-8", "ignore").encode("utf-8") + "…".encode("utf-8")


def verify(raw: bytes, seq: int) -> tuple | None:
    """The fields of record ``raw`` if it is whole and was written for ``seq``; else None."""
    if zlib.crc32(memoryview(raw)[4:]) != int.from_bytes(raw[:4], "little"):
        return None
    f = BODY.unpack_from(raw, 4)
    if (
        f[0] != seq
        or f[1 + STATE] > RoomState.FAILED
        or f[1 + RIDLEN] > REQUEST_ID_BYTES
        or f[1 + REASONLEN] > REASON_BYTES
    ):
        return None
    return f[1:]
