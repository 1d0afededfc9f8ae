"""Receiver registrations in shared memory, so that they outlive the processes that use them.

The sender writes a registration here before anyone hears of it; a restarted sender
and a restarted reaper read them back, even when both died together.

One writer (the sender), any number of readers, no lock. Each slot holds one
registration (receiver id, session, status endpoint: UTF-8, each at most
``MAX_ID_CHARS`` characters) and a generation number, 0 while the slot is free. A
registration is written into a *free* slot, body first, and published by one
aligned 8-byte store of a generation higher than any before; only then is the slot
of the registration it replaces (a receiver registering again) freed. So:

* a writer killed at any instruction leaves every published slot whole: the slot it
  was writing is still free (invisible), or published with the old one not yet
  freed, and readers take the higher generation of the two;
* a reader reads a slot's generation, its body, and the generation again: equal
  means nobody wrote the body meanwhile (a slot is written only while free, and a
  slot freed and reused comes back with a new generation).

Bounded: ``MAX_RECEIVERS`` registrations, plus the one spare slot a replacement is
written into before its predecessor is freed.
"""
from __future__ import annotations

import struct
from operator import index as _index

import numpy as np

from . import shm
from .wire import MAX_ID_CHARS

__all__ = ["MAX_RECEIVERS", "ReceiverTable", "TableFull"]

MAX_RECEIVERS = 4096  # prefill ranks one worker serves: a deployment has far fewer
_FIELD = 4 * MAX_ID_CHARS  # UTF-8 bytes of a field at most
_BODY = struct.Struct(f"<HHH{_FIELD}s{_FIELD}s{_FIELD}s")
_SLOT = (_BODY.size + 63) // 64 * 64
_HDR = 64
_MAGIC = 0x7278_6365_7200_0001  # "recvr", layout 1
_READ_SPINS = 64

# Test hook: called with a point name inside a write (tests SIGKILL the process there).
_fault_hook = None


class TableFull(RuntimeError):
    """Every slot holds a registration."""


def _layout(capacity: int) -> tuple[int, int]:
    """(offset of the slots, total size): header, generations u64[cap], slots."""
    slots = (_HDR + 8 * capacity + 63) // 64 * 64
    return slots, slots + _SLOT * capacity


class ReceiverTable:
    @classmethod
    def create(cls, prefix: str, run_id: str, what: str, capacity: int = MAX_RECEIVERS + 1) -> "ReceiverTable":
        capacity = _index(capacity)
        if not 2 <= capacity <= 2**16:
            raise ValueError(f"receiver table capacity {capacity} must be 2..65536")
        _, total = _layout(capacity)
        seg = shm.Segment.create(shm.object_name(prefix, run_id, what), total)
        try:
            hdr = seg.buf[:_HDR].cast("Q")
            hdr[1], hdr[2] = capacity, total
            hdr[0] = _MAGIC  # last: attach refuses a half-made table
            hdr.release()
            return cls(seg)
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def attach(cls, prefix: str, run_id: str, what: str, readonly: bool = False) -> "ReceiverTable":
        seg = shm.Segment.attach(shm.object_name(prefix, run_id, what), readonly=readonly)
        try:
            return cls(seg)
        except BaseException:
            seg.close()
            raise

    @staticmethod
    def size_of(capacity: int = MAX_RECEIVERS + 1) -> int:
        return _layout(capacity)[1]

    def __init__(self, seg: shm.Segment):
        self._seg = seg
        hdr = seg.buf[:_HDR].cast("Q") if seg.size >= _HDR else None
        ok = hdr is not None and hdr[0] == _MAGIC and 2 <= hdr[1] <= 2**16 and hdr[2] == _layout(hdr[1])[1]
        capacity = hdr[1] if ok else 0
        if hdr is not None:
            hdr.release()
        if not ok or seg.size < _layout(capacity)[1]:
            raise shm.ShmError(f"{seg.name!r} is not an initialised receiver table (bad magic or layout)")
        self.capacity = capacity
        self._slots0 = _layout(capacity)[0]
        self._mv = seg.buf
        self._genv = seg.buf[_HDR:_HDR + 8 * capacity].cast("Q")
        self._gens = np.frombuffer(seg.buf.obj, np.uint64, capacity, _HDR)
        # The writer's view, built by load(): receiver -> slot, and slots to free.
        self._slot_of: dict[str, int] | None = None
        self._stale: list[int] = []
        self._next_gen = 1

    def load(self) -> dict[str, tuple[str, str]]:
        """Every registration: receiver -> (session, status endpoint). A writer calls it
        first: it frees what a predecessor killed mid-replacement left twice."""
        newest: dict[str, tuple[int, int, tuple[str, str]]] = {}
        stale = []
        for slot in np.flatnonzero(self._gens.copy()).tolist():  # a copy: the writer may change it meanwhile
            got = self._read(slot)
            if got is None:
                continue
            gen, receiver, reg = got
            old = newest.get(receiver)
            if old is not None and old[0] > gen:
                stale.append(slot)
                continue
            if old is not None:
                stale.append(old[1])
            newest[receiver] = (gen, slot, reg)
        self._stale = stale
        self._slot_of = {r: slot for r, (_, slot, _) in newest.items()}
        self._next_gen = int(self._gens.max()) + 1
        return {r: reg for r, (_, _, reg) in newest.items()}

    def _read(self, slot: int):
        """(generation, receiver, (session, status)) of a published slot; None if free."""
        off = self._slots0 + slot * _SLOT
        for _ in range(_READ_SPINS):
            gen = self._genv[slot]
            if not gen:
                return None
            raw = self._mv[off:off + _BODY.size].tobytes()
            if self._genv[slot] == gen:
                n_rx, n_sess, n_st, rx, sess, st = _BODY.unpack(raw)
                return gen, rx[:n_rx].decode(), (sess[:n_sess].decode(), st[:n_st].decode())
        return None  # the writer kept reusing it under us: gone, as far as this read knows

    def put(self, receiver: str, session: str, status: str) -> None:
        """Record (or replace) a registration; TableFull when no slot is free. Writer only."""
        if self._slot_of is None:
            self.load()
        fields = [s.encode() for s in (receiver, session, status)]
        if any(len(f) > _FIELD for f in fields):
            raise ValueError(f"a registration field is longer than {MAX_ID_CHARS} characters")
        old = self._slot_of.get(receiver)
        for slot in self._stale:
            self._genv[slot] = 0
        self._stale = []
        free = np.flatnonzero(self._gens == 0)
        if not free.size:
            raise TableFull(f"receiver table {self._seg.name!r} is full: {self.capacity} slots")
        slot = int(free[0])
        off = self._slots0 + slot * _SLOT
        self._mv[off:off + _BODY.size] = _BODY.pack(*(len(f) for f in fields), *fields)
        if _fault_hook is not None:
            _fault_hook("receivers.body")
        self._genv[slot] = self._next_gen  # publish: one aligned 8-byte store
        self._next_gen += 1
        if _fault_hook is not None:
            _fault_hook("receivers.published")
        if old is not None:
            self._genv[old] = 0
        self._slot_of[receiver] = slot

    def close(self) -> None:
        if self._mv is None:
            return
        self._genv.release()
        self._gens = self._genv = self._mv = None
        self._seg.close()

    def unlink(self) -> None:
        self._seg.unlink()

    def __repr__(self) -> str:
        return f"ReceiverTable({self._seg.name!r}, capacity={self.capacity})"
