"""The records of ipc.ring: a 5-byte header, then the payload; a run of them is one pickle.

Records lie end to end in a circular data area: one that runs past its end continues
at its start (``write_at``, ``read_at``, ``length_at``).

A record's header is the tag byte 0x42 and the payload length as u32.  The header
is on purpose pickle's BINBYTES opcode: a run of records, framed as
``PROTO EMPTY_LIST MARK <records> APPENDS STOP``, is a pickle of the list of their
payloads, so a batch splits into ``bytes`` objects in C (``pickle.loads``) instead
of a Python loop, and the sizes are checked to add up.  (A ring's segment is mode
0600: only a process of our own user, which could do anything as us anyway, can
write what that parser reads.)
"""

from __future__ import annotations

import pickle
import struct
from itertools import chain

__all__ = [
    "RECORD_HEADER",
    "RECORD_TAG",
    "as_bytes_like",
    "frame",
    "header_of",
    "length_at",
    "pack_header",
    "read_at",
    "unframe",
    "unpack_u32",
    "write_at",
]

RECORD_HEADER = 5  # tag byte + u32 payload length
RECORD_TAG = 0x42  # pickle BINBYTES

pack_header = struct.Struct("<BI").pack
unpack_u32 = struct.Struct("<I").unpack_from
_PICKLE_HEAD = b"\x80\x04]("  # PROTO 4, EMPTY_LIST, MARK
_PICKLE_TAIL = b"e."  # APPENDS, STOP
_loads = pickle.loads


class _Headers(dict):
    """Record headers by payload size; small sizes are kept (a C-speed map in batches)."""

    def __missing__(self, n: int) -> bytes:
        h = pack_header(RECORD_TAG, n)
        if n < 4096:
            self[n] = h
        return h


header_of = _Headers().__getitem__


def as_bytes_like(record):
    """``record`` as an object whose len() is its size in bytes."""
    if isinstance(record, (bytes, bytearray)):
        return record
    mv = memoryview(record)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def frame(records, lens) -> bytes:
    """``records`` (of lengths ``lens``), each after its header, as one object."""
    n = lens[0]
    if lens.count(n) == len(lens):  # all one size: the header is a separator
        return header_of(n).join([b"", *records])
    return b"".join(chain.from_iterable(zip(map(header_of, lens), records)))


def unframe(parts, nbytes: int) -> list[bytes]:
    """The payloads of the records that ``parts`` (buffers, ``nbytes`` in all) hold end
    to end; ValueError if they do not parse or do not fill exactly ``nbytes``."""
    try:
        out = _loads(b"".join((_PICKLE_HEAD, *parts, _PICKLE_TAIL)))
        ok = type(out) is list and RECORD_HEADER * len(out) + sum(map(len, out)) == nbytes
    except Exception as exc:
        raise ValueError(f"do not parse ({exc!r})") from exc
    if not ok:
        raise ValueError("do not add up")
    return out


def write_at(data, index: int, blob, n: int) -> None:
    """Copy ``blob`` (``n`` bytes) into the circular area ``data`` at ``index``."""
    cap = len(data)
    p = index % cap
    e = p + n
    if e <= cap:
        data[p:e] = blob
    else:
        k = cap - p
        mv = memoryview(blob)
        data[p:cap] = mv[:k]
        data[: e - cap] = mv[k:]


def read_at(data, index: int, n: int) -> bytes:
    """The ``n`` bytes at ``index`` of the circular area ``data``."""
    cap = len(data)
    p = index % cap
    e = p + n
    if e <= cap:
        return data[p:e].tobytes()
    return b"".join((data[p:cap], data[: e - cap]))


def length_at(data, index: int) -> int:
    """Payload length of the record at ``index`` of the circular area ``data``; -1 if
    no record header is there."""
    p = index % len(data)
    if p + RECORD_HEADER > len(data):
        data, p = read_at(data, index, RECORD_HEADER), 0
    return unpack_u32(data, p + 1)[0] if data[p] == RECORD_TAG else -1
