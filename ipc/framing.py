"""The records of ipc.ring: a 5-byte header, then the payload; a run of them is one pickle.

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

__all__ = ["RECORD_HEADER", "RECORD_TAG", "as_bytes_like", "frame", "header_of", "pack_header",
           "unframe", "unpack_u32"]

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
