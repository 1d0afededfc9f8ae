"""Fixed-capacity table of rooms in shared memory: state, holders and items of each live room.

Any process reads it without locking; writers serialise on one table-wide lock
(``SegmentLock``: a ``flock`` the kernel drops when its holder dies). An update
holds it for a few microseconds; a flock pair costs less here than a per-entry
``lockf`` byte range, and one lock lets ``insert`` check for a duplicate room and
claim a FREE slot atomically.

Torn updates: each entry is a pair of records published by a sequence number
(ipc/room_record.py), so a writer killed at any point leaves the update undone and a
reader never takes a half-written record.

Records carry ``time.monotonic()`` stamps (system-wide on Linux, so comparable
across processes). Contiguous columns hold each copy's room and state, written
with the copy before it is published, so ``held_by`` scans them with numpy and
then verifies the few candidates' records.

Finding a room without a scan: ``RoomIndex`` (ipc/room_index.py), a hash index of
room ids updated under the lock, with its own sequence word so that a writer killed
while changing it leaves it to be rebuilt. A FREE slot is looked for from a cursor
(the slot after the last insert), a chunk of columns at a time.

Custody without the lock: ``RoomClaims`` (ipc/room_claims.py), a claim per slot and
owner that only that owner writes, counted only while its room is the slot's room.

``room`` is an unsigned 64-bit id (the protocol's); ``request_id`` (128 UTF-8 bytes)
and ``reason`` (256) are cut with '…' when longer. ``keys`` are the tags
(``wire.key_tag``) of the CurveZMQ keys the room belongs to, gateway's first; all 0
without CURVE (stages/ownership.py says what they allow).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from operator import index as _index
from typing import Any

import numpy as np

from . import shm
from .room_claims import MAX_OWNERS, RoomClaims
from .room_entry import RoomEntry, RoomState, TableFull
from .room_index import RoomIndex
from .room_record import BODY, CONCLUDED, CREATED, DEADLINE, DONE, FREE_FIELDS, KEYS, REASON, REASON_BYTES, REASONLEN
from .room_record import RECORD_BYTES, REQUEST_ID_BYTES, RID, RIDLEN, ROOM, ROOM_KEYS, STATE, TOTAL, cut, verify
from .segment_lock import SegmentLock
from .shared_table import SharedTable, lay_out

__all__ = ["RoomEntry", "RoomState", "RoomTable", "TableFull"]

_FINAL = (RoomState.SUCCESS, RoomState.FAILED)

# header words (u64) after the magic, the capacity and the size
_H_REPAIRS, _H_INDEX_SEQ, _H_CURSOR = 3, 4, 5
_FREE_CHUNK = 1024  # slots whose states one step of the FREE-slot search reads


def _layout(capacity: int) -> dict[str, int]:
    """Segment layout: header, seq u32[cap], columns room u64 / state u8 [cap, 2], records
    [cap, 2] (ipc/room_record.py), custody claims, room index, progress u8[cap]."""
    return lay_out(
        (
            ("seq", 4 * capacity),
            ("room", 16 * capacity),
            ("state", 2 * capacity),
            ("rec", 2 * RECORD_BYTES * capacity),
            *RoomClaims.columns(capacity),
            ("index", 4 * RoomIndex.entries(capacity)),
            ("progress", capacity),
        )
    )


_U64 = (0, 2**64 - 1)
_U32_MAX = 2**32 - 1
_READ_SPINS = 64
_STATES = tuple(RoomState)
_new_entry = object.__new__

# Test hook: called with a point name inside a write (tests SIGKILL the process there).
_fault_hook = None


def _slots(copy_mask: np.ndarray) -> list[int]:
    """Slots (in order, once each) of the set entries of a flat [slot, copy] mask."""
    idx = np.flatnonzero(copy_mask)
    if idx.size == 0:
        return []
    return list(dict.fromkeys((idx >> 1).tolist()))


def _check_range(name: str, v, lo: int, hi: int) -> int:
    v = _index(v)
    if not lo <= v <= hi:
        raise ValueError(f"{name} {v} out of range {lo}..{hi}")
    return v


class RoomTable(SharedTable):
    """Rooms in shared memory: readable lock-free by any process, updated under a lock."""

    MAGIC = 0x6D6F_6F72_0000_0005  # "room", layout 5
    KIND = "room table"
    capacity: int  # the geometry (SharedTable.__init__ sets it from the header)

    @classmethod
    def segment_size(cls, capacity: int) -> int:
        if not 1 <= capacity <= 2**20:
            raise ValueError(f"room table capacity {capacity} must be 1..2**20")
        return _layout(capacity)["total"]

    @classmethod
    def format(cls, buf: memoryview, capacity: int) -> None:
        """Zeroed by posix_fallocate: seq 0, columns FREE. Records: both copies FREE and
        valid (copy 1 as the version before seq 0)."""
        pair = bytearray(2 * RECORD_BYTES)
        for copy, ver in ((0, 0), (1, _U32_MAX)):
            body = BODY.pack(ver, *FREE_FIELDS)
            pair[copy * RECORD_BYTES : copy * RECORD_BYTES + 4] = zlib.crc32(body).to_bytes(4, "little")
            pair[copy * RECORD_BYTES + 4 : (copy + 1) * RECORD_BYTES] = body
        at = _layout(capacity)["rec"]
        buf[at : at + 2 * RECORD_BYTES * capacity] = bytes(pair) * capacity

    def __init__(self, seg: shm.Segment):
        super().__init__(seg)
        cap = self.capacity
        lay = _layout(cap)
        mv = self._mv = seg.buf
        mm = seg.mapped
        self._hdr = mv[: lay["seq"]].cast("Q")
        self._seqv = mv[lay["seq"] : lay["seq"] + 4 * cap].cast("I")
        self._roomv = mv[lay["room"] : lay["room"] + 16 * cap].cast("Q")
        self._statev = mv[lay["state"] : lay["state"] + 2 * cap]
        self._rec0 = lay["rec"]
        self._seq = np.frombuffer(mm, np.uint32, cap, lay["seq"])
        self._rooms = np.frombuffer(mm, np.uint64, 2 * cap, lay["room"]).reshape(cap, 2)
        self._states = np.frombuffer(mm, np.uint8, 2 * cap, lay["state"]).reshape(cap, 2)
        self._claims = RoomClaims(mv, lay["claim_room"], lay["claim_on"], cap)
        self._room_index = RoomIndex(mv, lay["index"], cap, self._hdr, _H_INDEX_SEQ, self._active_room)
        self._progv = mv[lay["progress"] : lay["progress"] + cap]
        self._lock = SegmentLock(seg)

    # -- raw records ---------------------------------------------------------

    def _slot_index(self, slot) -> int:
        slot = _index(slot)
        if not 0 <= slot < self.capacity:
            raise IndexError(f"room table slot {slot} out of range 0..{self.capacity - 1}")
        return slot

    def _load(self, slot: int):
        """(seq, body fields or None if damaged); lock-free, retries past writers."""
        base = self._rec0 + slot * 2 * RECORD_BYTES
        seqv, mv = self._seqv, self._mv
        for _ in range(_READ_SPINS):
            s = seqv[slot]
            off = base + (s & 1) * RECORD_BYTES
            raw = mv[off : off + RECORD_BYTES].tobytes()
            if seqv[slot] == s:
                return s, verify(raw, s)
        # Writers kept publishing under us: read under their lock.
        with self._lock:
            return self._load_locked(slot)

    def _load_locked(self, slot: int):
        s = self._seqv[slot]
        off = self._rec0 + slot * 2 * RECORD_BYTES + (s & 1) * RECORD_BYTES
        return s, verify(self._mv[off : off + RECORD_BYTES].tobytes(), s)

    def _store(self, slot: int, seq: int, fields) -> None:
        """Lock held: write ``fields`` into the inactive copy, then publish it."""
        new = (seq + 1) & _U32_MAX
        c = 2 * slot + (new & 1)
        off = self._rec0 + c * RECORD_BYTES
        body = BODY.pack(new, *fields)
        mv = self._mv
        # The inactive copy's index columns first (hints, verified against records) ...
        self._roomv[c] = fields[ROOM]
        self._statev[c] = fields[STATE]
        # ... then its record, body before crc ...
        mv[off + 4 : off + RECORD_BYTES] = body
        if _fault_hook is not None:
            _fault_hook("rooms.body")
        mv[off : off + 4] = zlib.crc32(body).to_bytes(4, "little")
        if _fault_hook is not None:
            _fault_hook("rooms.crc")
        self._seqv[slot] = new  # ... and publish: one aligned 4-byte store

    def _current(self, slot: int):
        """Lock held: (seq, fields) of the entry, repairing a damaged one first."""
        s, f = self._load_locked(slot)
        if f is None:
            s, f = self._repair(slot, s)
        return s, f

    def _repair(self, slot: int, seq: int):
        """Lock held, active copy damaged: salvage the other copy or conclude the entry."""
        off = self._rec0 + (2 * slot + ((seq & 1) ^ 1)) * RECORD_BYTES
        raw = self._mv[off : off + RECORD_BYTES].tobytes()
        other = verify(raw, BODY.unpack_from(raw, 4)[0])
        fields: tuple[Any, ...]
        if other is None:
            fields = FREE_FIELDS
        else:
            salvaged = list(other)
            if 0 < salvaged[STATE] < RoomState.SUCCESS:
                reason = cut("room table entry was damaged; concluded by repair", REASON_BYTES)
                salvaged[STATE], salvaged[CONCLUDED] = int(RoomState.FAILED), time.monotonic()
                salvaged[REASON], salvaged[REASONLEN] = reason, len(reason)
            fields = tuple(salvaged)
        self._store(slot, seq, fields)
        self._hdr[_H_REPAIRS] += 1
        return (seq + 1) & _U32_MAX, fields

    def _entry(self, slot: int, f) -> RoomEntry:
        # Filled through __dict__: a frozen dataclass's __init__ costs several times as much.
        e = _new_entry(RoomEntry)
        e.__dict__.update(
            slot=slot,
            room=f[ROOM],
            request_id=f[RID][: f[RIDLEN]].decode("utf-8", "replace"),
            state=_STATES[max(f[STATE], self._progv[slot]) if f[STATE] < RoomState.SUCCESS else f[STATE]],
            holders=self._claims.holders(slot, f[ROOM]),
            items_total=f[TOTAL],
            items_done=f[DONE],
            reason=f[REASON][: f[REASONLEN]].decode("utf-8", "replace"),
            deadline=f[DEADLINE],
            created=f[CREATED],
            concluded=f[CONCLUDED],
            keys=tuple(f[KEYS]),
        )
        return e

    def _update(self, slot, room, change):
        """Under the lock: ``change(fields)`` -> new fields list, or a result to return as is."""
        slot = self._slot_index(slot)
        with self._lock:
            s, f = self._current(slot)
            if f[STATE] == RoomState.FREE or f[ROOM] != room:
                return None
            new = change(list(f))
            if isinstance(new, list):
                self._store(slot, s, new)
                return True
            return new

    # -- the room index and the FREE slots (lock held) ---------------------------------

    def _active_room(self, slot: int) -> tuple[int, int]:
        """(room, state) of ``slot``'s active copy, from the columns."""
        c = 2 * slot + (self._seqv[slot] & 1)
        return self._roomv[c], self._statev[c]

    def _clean_index(self) -> None:
        """Lock held: rebuild the index from the records if a writer died while changing it."""
        if self._room_index.dirty:
            self._room_index.rebuild(self._rooms_in_use())

    def _rooms_in_use(self):
        """Lock held: (room, slot) of every entry not FREE, from the records."""
        for slot in np.flatnonzero(self.active_states() != 0).tolist():
            _, f = self._current(slot)
            if f[STATE] != RoomState.FREE:
                yield f[ROOM], slot

    def _free_slot(self):
        """Lock held: (slot, seq) of a FREE slot, searched from the cursor; None if none."""
        cap, start = self.capacity, self._hdr[_H_CURSOR] % self.capacity
        if not self._active_room(start)[1]:  # the usual case: the slot after the last insert
            s, f = self._current(start)
            if f[STATE] == RoomState.FREE:  # the column is a hint; the record decides
                return start, s
        for a in list(range(start, cap, _FREE_CHUNK)) + list(range(0, start, _FREE_CHUNK)):
            free = self.active_states(a, min(a + _FREE_CHUNK, cap if a >= start else start)) == 0
            while True:
                i = int(free.argmax())
                if not free[i]:
                    break
                s, f = self._current(a + i)
                if f[STATE] == RoomState.FREE:
                    return a + i, s
                free[i] = False
        return None

    # -- reads -----------------------------------------------------------------

    def get(self, slot: int) -> RoomEntry | None:
        """The entry in ``slot``, None if FREE."""
        slot = self._slot_index(slot)
        s, f = self._load(slot)
        if f is None:
            with self._lock:
                s, f = self._current(slot)
        if f[STATE] == RoomState.FREE:
            return None
        return self._entry(slot, f)

    def find(self, room: int) -> int | None:
        """Slot of the non-FREE entry for ``room``, or None."""
        room = _index(room)
        if not _U64[0] <= room <= _U64[1]:
            return None
        slots: Sequence[int] | None = self._room_index.lookup(room)
        if slots is None:  # a writer is changing the index (or died doing it): scan
            slots = self._room_candidates(room)
        for slot in slots:
            e = self.get(slot)
            if e is not None and e.room == room:
                return slot
        return None

    def entries(self) -> list[RoomEntry]:
        """Every non-FREE entry, by slot."""
        return [e for e in map(self.get, _slots(self._states.ravel() != 0)) if e is not None]

    def _room_candidates(self, room: int) -> list[int]:
        """Slots where either copy's column says ``room`` (and not FREE): to be verified."""
        hit = self._rooms.ravel() == room
        if room == 0:  # FREE records hold room 0
            hit &= self._states.ravel() != 0
        return _slots(hit)

    def count_live(self) -> int:
        """Rooms not yet concluded (a vectorised count; may be off by one under a concurrent write)."""
        st = self.active_states()
        return int(((st > RoomState.FREE) & (st < RoomState.SUCCESS)).sum())

    def active_states(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The active copy's state column of slots [lo, hi)."""
        st = self._states[lo:hi]
        return np.where(self._seq[lo:hi] & 1, st[:, 1], st[:, 0])

    # -- writes ----------------------------------------------------------------

    def insert(
        self,
        room: int,
        request_id: str,
        items_total: int,
        holders: int,
        deadline: float = 0.0,
        state: RoomState = RoomState.BOOTSTRAPPING,
        existing_ok: bool = False,
        keys: tuple[int, ...] = (),
    ) -> int:
        """Record a new room; return its slot. TableFull when no slot is FREE.

        ``keys``: the tags of the keys it belongs to, at most ROOM_KEYS (none without CURVE).

        ValueError if a non-FREE entry (live or tombstone) already has this room id, or
        with ``existing_ok`` that entry's slot: looked up under the lock, so a room another
        process is inserting at that moment is found, where find() may miss it.
        """
        room = _check_range("room", room, *_U64)
        items_total = _check_range("items_total", items_total, 0, _U32_MAX)
        holders = _check_range("holders", holders, 0, 2**MAX_OWNERS - 1)
        state = RoomState(state)
        if state == RoomState.FREE:
            raise ValueError("a room cannot be inserted FREE")
        if len(keys) > ROOM_KEYS:
            raise ValueError(f"a room belongs to at most {ROOM_KEYS} keys, not {len(keys)}")
        tags = [_check_range("key tag", k, *_U64) for k in keys] + [0] * (ROOM_KEYS - len(keys))
        rid = cut(str(request_id), REQUEST_ID_BYTES)
        now = time.monotonic()
        fields = [
            room,
            int(state),
            len(rid),
            0,
            items_total,
            0,
            float(deadline),
            now,
            now if state in _FINAL else 0.0,
            rid,
            b"",
            *tags,
        ]
        with self._lock:
            self._clean_index()
            dup = self._find_locked(room)
            if dup is not None and existing_ok:
                return dup
            if dup is not None:
                raise ValueError(f"room {room} is already in the table (slot {dup})")
            free = self._free_slot()
            if free is None:
                raise TableFull(
                    f"room table {self.segment.name!r} is full: all {self.capacity} slots hold rooms "
                    f"(live or concluded tombstones not yet freed); cannot record room {room} "
                    f"(request {request_id!r})"
                )
            slot, s = free
            self._room_index.begin_change()
            self._claims.reset(slot, room, holders)  # before the room is there: void until then
            self._progv[slot] = 0
            self._store(slot, s, fields)
            if _fault_hook is not None:
                _fault_hook("rooms.index")
            self._room_index.add(room, slot)
            self._hdr[_H_CURSOR] = slot + 1
            self._room_index.end_change()
            return slot

    def _find_locked(self, room: int) -> int | None:
        """Index clean: the slot of ``room``'s non-FREE entry, or None."""
        slot = self._room_index.slot_of(room)
        if slot is None:
            return None
        _, f = self._current(slot)
        return slot if f[STATE] != RoomState.FREE and f[ROOM] == room else None

    def advance(self, slot: int, room: int, state: RoomState) -> bool:
        """Move a live room forward to ``state`` (skipping states is fine); False if not forward,
        already concluded, or ``slot`` no longer holds ``room``.

        The live states past BOOTSTRAPPING (queued, encoding, transferring) say where a room
        is, for an operator; three stages set them for every room, so they are not written
        into the record under the lock but into a progress byte of the slot, lock-free (the
        record's state, while live, is the greater of the two; ``insert`` clears it). Two
        stages advancing one room at the same instant may leave the lesser of their states
        until the next advance."""
        state = RoomState(state)
        if state < RoomState.SUCCESS:
            slot = self._slot_index(slot)
            _, f = self._load(slot)
            if f is not None:  # (a damaged record is repaired by the locked way below)
                if (
                    f[STATE] == RoomState.FREE
                    or f[ROOM] != room
                    or f[STATE] >= RoomState.SUCCESS
                    or state <= max(f[STATE], self._progv[slot])
                ):
                    return False
                self._progv[slot] = int(state)
                return True

        def change(f):
            cur = f[STATE]
            if cur >= RoomState.SUCCESS or state <= max(cur, self._progv[slot]):
                return False
            f[STATE] = int(state)
            if state in _FINAL:
                f[CONCLUDED] = time.monotonic()
            return f

        return bool(self._update(slot, room, change))

    def claim(self, slot: int, room: int, tag: int) -> tuple[int, ...] | None:
        """The room's key tags once ``tag`` claimed it, if it could: a live room whose
        gateway named no receiver (keys[1] is 0) is claimed by the first key that allocs
        into it (stages/ownership.py). None if ``slot`` no longer holds ``room``."""
        tag = _check_range("key tag", tag, 1, _U64[1])
        out = []

        def change(f):
            keys = f[KEYS]
            if keys[0] and not keys[1] and tag not in keys and f[STATE] < RoomState.SUCCESS:
                f[KEYS.start + 1] = tag
            out.append(tuple(f[KEYS]))
            return f if out[0] != tuple(keys) else True

        return out[0] if self._update(slot, room, change) else None

    def _is_there(self, slot: int, room: int) -> bool:
        # The usual answer from the active copy's columns (written with that copy, before it
        # was published); anything else from its record, checked.
        s = self._seqv[slot]
        c = 2 * slot + (s & 1)
        if self._roomv[c] == room and self._statev[c] and self._seqv[slot] == s:
            return True
        _, f = self._load(slot)
        if f is None:
            e = self.get(slot)  # repairs it under the lock
            return e is not None and e.room == room
        return f[STATE] != RoomState.FREE and f[ROOM] == room

    def hold(self, slot: int, room: int, bits: int) -> bool:
        """Claim custody ``bits`` of ``room``, even when concluded (no lock: each owner writes
        only its own claims); False, claims unchanged, if ``slot`` does not hold ``room``."""
        slot = self._slot_index(slot)
        before = self._claims.take(slot, room, bits)
        if self._is_there(slot, room):  # read after the claim is written: see ipc/room_claims.py
            return True
        self._claims.put_back(slot, before)
        return False

    def unhold(self, slot: int, room: int, bits: int) -> bool:
        """Give up custody ``bits`` of ``room``; False if ``slot`` does not hold ``room``."""
        slot = self._slot_index(slot)
        self._claims.give_up(slot, room, bits)
        return self._is_there(slot, room)

    def held_by(self, bits: int, failed_too: bool = False) -> list[RoomEntry]:
        """Live entries whose holders have any of ``bits``; with ``failed_too``, Failed ones
        still held as well (a failed room the sender holds until its writes are fenced)."""
        if not bits:
            return []
        rooms = np.where(self._seq & 1, self._rooms[:, 1], self._rooms[:, 0])
        st = self.active_states()
        claimed = self._claims.claimed(bits, rooms)
        wanted = (st > 0) & (st < RoomState.SUCCESS)
        if failed_too:
            wanted |= st == RoomState.FAILED
        out = []
        for slot in np.flatnonzero(claimed & wanted).tolist():
            e = self.get(slot)
            if e is not None and e.holders & bits and (e.live or failed_too and e.state == RoomState.FAILED):
                out.append(e)
        return out

    def item_done(self, slot: int, room: int, done_so_far: int | None = None) -> int:
        """Count one more item done, or with ``done_so_far`` raise the count to it (a report
        repeated by a writer that died before it knew the first was taken then changes
        nothing); return the count (-1 if ``slot`` no longer holds ``room``).

        A concluded room is final: its count is returned unchanged.
        """
        return self._count_item(slot, room, done_so_far, False)[0]

    def complete_item(self, slot: int, room: int, done_so_far: int) -> tuple[int, bool]:
        """``item_done(slot, room, done_so_far)``, and, in the same update, SUCCESS once the
        count reaches the room's items (also when it had already: a writer that died between
        the two). Returns (the count, whether this call concluded the room); (-1, False) if
        ``slot`` no longer holds ``room``."""
        return self._count_item(slot, room, done_so_far, True)

    def _count_item(self, slot: int, room: int, done_so_far: int | None, conclude: bool) -> tuple[int, bool]:
        out: list[Any] = [-1, False]  # (the count, whether this call concluded the room)

        def change(f):
            out[0] = f[DONE]
            if f[STATE] >= RoomState.SUCCESS or f[DONE] >= _U32_MAX:
                return False
            new = out[0] = f[DONE] + 1 if done_so_far is None else min(max(f[DONE], done_so_far), _U32_MAX)
            out[1] = conclude and new >= f[TOTAL]
            if new == f[DONE] and not out[1]:
                return False
            f[DONE] = new
            if out[1]:
                f[STATE], f[CONCLUDED] = int(RoomState.SUCCESS), time.monotonic()
            return f

        self._update(slot, room, change)
        return out[0], out[1]

    def _conclude(self, slot, room, state: RoomState, reason: str) -> bool:
        rb = cut(str(reason), REASON_BYTES)

        def change(f):
            if f[STATE] >= RoomState.SUCCESS:
                return False
            f[STATE], f[CONCLUDED] = int(state), time.monotonic()
            f[REASON], f[REASONLEN] = rb, len(rb)
            return f

        return bool(self._update(slot, room, change))

    def fail(self, slot: int, room: int, reason: str) -> bool:
        """Conclude a live room FAILED with ``reason``; False if already concluded or not there."""
        return self._conclude(slot, room, RoomState.FAILED, reason)

    def succeed(self, slot: int, room: int) -> bool:
        """Conclude a live room SUCCESS; False if already concluded or not there."""
        return self._conclude(slot, room, RoomState.SUCCESS, "")

    def free(self, slot: int, room: int) -> bool:
        """Return a concluded entry (an expired tombstone) to FREE; False for a live one or not there."""

        slot = self._slot_index(slot)
        with self._lock:
            self._clean_index()
            s, f = self._current(slot)
            if f[STATE] < RoomState.SUCCESS or f[ROOM] != room:
                return False
            self._room_index.begin_change()
            self._room_index.remove(room, slot)
            if _fault_hook is not None:
                _fault_hook("rooms.index")
            self._store(slot, s, FREE_FIELDS)
            self._room_index.end_change()
            return True

    @property
    def repairs(self) -> int:
        """How many damaged entries were repaired (should stay 0: a killed writer damages nothing)."""
        return self._hdr[_H_REPAIRS]

    # -- teardown ----------------------------------------------------------------

    def close(self) -> None:
        self._lock.close()
        self._claims.close()
        self._room_index.close()
        super().close()
