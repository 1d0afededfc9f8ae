"""Receiver registrations in shared memory, so that they outlive the processes that use them.

The sender writes a registration here before anyone hears of it; a restarted sender
and a restarted reaper read them back, even when both died together.

One writer (the sender), any number of readers, no lock. Each slot holds one
registration (receiver id, session, status endpoint: UTF-8, each at most
``MAX_ID_CHARS`` characters; and the CurveZMQ public key the receiver registered
under, empty without CURVE: the id stays bound to that key for as long as the
registration lives, even across a sender's restart) and a generation number, 0 while
the slot is free. A
registration is written into a *free* slot, body first, and published by one
aligned 8-byte store of a generation higher than any before; only then is the slot
of the registration it replaces (a receiver registering again) freed. So:

* a writer killed at any instruction leaves every published slot whole: the slot it
  was writing is still free (invisible), or published with the old one not yet
  freed, and readers take the higher generation of the two;
* a reader reads a slot's generation, its row, and the generation again: equal
  means nobody wrote the row meanwhile (a slot is written only while free, and a
  slot freed and reused comes back with a new generation). On a CPU that may show
  another core's stores out of order (ARM, POWER) that is not enough: a reader could
  see a new generation before the body it publishes, or part of a reused slot's new
  body under its old generation. So each row begins with a crc32 over its
  generation and body, written with the body before the generation is published,
  and a reader takes a row only when the checksum agrees, re-reading it otherwise;
  a row that never agrees is damage, skipped (and the writer frees it).

Bounded: ``MAX_RECEIVERS`` registrations, plus the one spare slot a replacement is
written into before its predecessor is freed. The writer frees a registration that
expired or gave way to a new one (``remove``); which one goes is the writer's choice
(stages/sender.py), not the table's.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from . import shm
from .shared_table import SlotTable
from .wire import MAX_ID_CHARS, Register

__all__ = ["KEY_CHARS", "MAX_RECEIVERS", "ReceiverTable", "TableFull", "registration_row"]

MAX_RECEIVERS = 4096  # prefill ranks one worker serves: a deployment has far fewer
_FIELD = 4 * MAX_ID_CHARS  # UTF-8 bytes of a field at most
KEY_CHARS = 40  # a CurveZMQ public key in Z85
_ROW = struct.Struct(f"<IHHH{_FIELD}s{_FIELD}s{_FIELD}s{KEY_CHARS}s")  # crc32, lengths, receiver, session, status, key
_SLOT = (_ROW.size + 63) // 64 * 64
_READ_SPINS = 64
_INCARNATION = "\0"  # between a session and its incarnation; a session holds no NUL

# Test hook: called with a point name inside a write (tests SIGKILL the process there).
_fault_hook = None


class TableFull(RuntimeError):
    """Every slot holds a registration."""


def _crc(gen: int, body) -> int:
    return zlib.crc32(body, zlib.crc32(gen.to_bytes(8, "little")))


def registration_row(gen: int, receiver: str, session: str, status: str, key: str = "") -> bytes:
    """The row that registers ``receiver`` under generation ``gen``: checksum first."""
    fields = [s.encode() for s in (receiver, session, status)]
    if any(len(f) > _FIELD for f in fields):
        raise ValueError(f"a registration field is longer than {MAX_ID_CHARS} characters")
    if key and (len(key) != KEY_CHARS or not key.isascii()):
        raise ValueError(f"a receiver's key is {KEY_CHARS} Z85 characters, got {key!r}")
    body = _ROW.pack(0, *(len(f) for f in fields), *fields, key.encode())[4:]
    return _crc(gen, body).to_bytes(4, "little") + body


class ReceiverTable(SlotTable):
    MAGIC = 0x7278_6365_7200_0003  # "recvr", layout 3
    KIND = "receiver table"
    SLOT_BYTES = _SLOT
    CAPACITY = (2, 2**16)

    @classmethod
    def create(  # type: ignore[override]  # a default capacity (shared_table.py)
        cls, prefix: str, run_id: str, what: str, capacity: int = MAX_RECEIVERS + 1
    ) -> "ReceiverTable":
        return super().create(prefix, run_id, what, capacity)

    @classmethod
    def size_of(cls, capacity: int = MAX_RECEIVERS + 1) -> int:
        return cls.segment_size(capacity)

    def __init__(self, seg: shm.Segment):
        super().__init__(seg)
        at = self.layout(self.capacity)["generations"]
        self._genv = seg.buf[at : at + 8 * self.capacity].cast("Q")
        # The writer's view, built by load(): receiver -> slot, and slots to free.
        self._slot_of: dict[str, int] | None = None
        self._stale: list[int] = []
        self._next_gen = 1

    def load(self) -> dict[str, tuple[str, str, str]]:
        """Every registration: receiver -> (session, status endpoint, key). A writer calls it
        first: it frees what a predecessor killed mid-replacement left twice, and rows
        whose checksum does not agree."""
        newest: dict[str, tuple[int, int, tuple[str, str, str]]] = {}
        stale = []
        for slot in np.flatnonzero(self.generations.copy()).tolist():  # a copy: the writer may change it meanwhile
            got = self._read(slot)
            if got is None:
                if self._genv[slot]:  # published, and its checksum never agreed: damage
                    stale.append(slot)
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
        self._next_gen = self.next_generation()
        return {r: reg for r, (_, _, reg) in newest.items()}

    def _read(self, slot: int) -> tuple[int, str, tuple[str, str, str]] | None:
        """(generation, receiver, (session, status, key)) of a published slot; None if free."""
        off = self.slots_at + slot * _SLOT
        for _ in range(_READ_SPINS):
            gen = self._genv[slot]
            if not gen:
                return None
            raw = self.buf[off : off + _ROW.size].tobytes()
            if self._genv[slot] == gen and _crc(gen, memoryview(raw)[4:]) == int.from_bytes(raw[:4], "little"):
                _, n_rx, n_sess, n_st, rx, sess, st, key = _ROW.unpack(raw)
                return gen, rx[:n_rx].decode(), (sess[:n_sess].decode(), st[:n_st].decode(), key.rstrip(b"\0").decode())
        return None  # reused under us again and again, or damaged: not there, as far as this read knows

    def registrations(self) -> dict[str, Register]:
        """Every registration as the `register` that made it (incarnation and key included)."""
        out = {}
        for receiver, (stored, status, key) in self.load().items():
            session, _, number = stored.partition(_INCARNATION)
            out[receiver] = Register(receiver, session, status, int(number) if number else None, key)
        return out

    def put(self, receiver: str, session: str, status: str, incarnation: int | None = None, key: str = "") -> None:
        """Record (or replace) a registration; TableFull when no slot is free. Writer only."""
        if self._slot_of is None:
            self.load()
        assert self._slot_of is not None  # load() made it
        if incarnation is not None:  # (protocol 1.1) kept in the session's field, after a NUL
            session = f"{session}{_INCARNATION}{incarnation}"
        new = registration_row(self._next_gen, receiver, session, status, key)
        old = self._slot_of.get(receiver)
        for slot in self._stale:
            self._genv[slot] = 0
        self._stale = []
        free = np.flatnonzero(self.generations == 0)
        if not free.size:
            raise TableFull(f"receiver table {self.segment.name!r} is full: {self.capacity} slots")
        slot = int(free[0])
        off = self.slots_at + slot * _SLOT
        self.buf[off : off + _ROW.size] = new
        if _fault_hook is not None:
            _fault_hook("receivers.body")
        self._genv[slot] = self._next_gen  # publish: one aligned 8-byte store
        self._next_gen += 1
        if _fault_hook is not None:
            _fault_hook("receivers.published")
        if old is not None:
            self._genv[old] = 0
        self._slot_of[receiver] = slot

    def remove(self, receiver: str) -> bool:
        """Free `receiver`'s registration (expired, or giving way); whether it was there.
        Writer only. One aligned store: a reader sees the registration whole, or not at all."""
        if self._slot_of is None:
            self.load()
        assert self._slot_of is not None  # load() made it
        slot = self._slot_of.pop(receiver, None)
        if slot is None:
            return False
        self._genv[slot] = 0
        return True
