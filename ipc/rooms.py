"""Fixed-capacity table of rooms in shared memory: state, holders and items of each live room.

Any process reads it without locking; writers serialise on one table-wide lock
(``SegmentLock``: a ``flock`` the kernel drops when its holder dies). An update
holds it for a few microseconds; a flock pair costs ~1 us here against ~1.5 us for
a per-entry ``lockf`` byte range, and one lock lets ``insert`` check for a duplicate
room and claim a FREE slot atomically.

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

Records carry ``time.monotonic()`` stamps (system-wide on Linux, so comparable
across processes). Contiguous columns hold each copy's room and state, written
with the copy before it is published, so ``held_by`` scans them with numpy and
then verifies the few candidates' records.

Finding a room, and a FREE slot, without a scan. The table is as large as the
rooms live plus the tombstones kept (70k slots by default), and a scan of its
columns costs 25-95 us: ``insert`` did two under the lock, once per request, and
every other writer waited on them. So an index maps room ids to slots: a hash
table (linear probing, backward-shift deletion, twice the table's capacity, u32
slot + 1 per entry, 0 empty) that ``insert`` and ``free`` update under the lock.
It is a hint: every slot it gives is verified against the record (an entry left
pointing at a slot that has changed room is skipped). A writer makes the index's
sequence word odd before touching it and even after; one killed in between leaves
it odd, and the next writer rebuilds the index from the records. A lock-free
reader retries when the word moved under it, and scans the columns while it is
odd. A FREE slot is looked for from a cursor (the slot after the last insert), a
chunk of columns at a time.

Custody, without the lock. ``holders`` is a bit mask: bit ``i`` set while stage
``i`` holds some of the room's items. Every stage sets and clears its bit on every
record it takes and hands on, so it is not in the locked record: each slot has a
claim per owner (``MAX_OWNERS``), a room id and an on-byte, and only that owner (or
the supervisor, once the owner is dead) writes it. A claim counts only while its
room is the slot's room, so claims left by a room that has gone are void, and
``insert`` clears the slot's claims before it publishes the new room. ``hold``
checks the slot holds the room, writes its claim, and checks again: a room freed
and another inserted into the slot meanwhile voids the claim (a store the CPU
still buffers past that second read could in principle outlive it; its only effect
is that the owner's death would fail the new room too).
``room`` is an unsigned 64-bit id (the protocol's); ``request_id`` (128 UTF-8 bytes)
and ``reason`` (256) are cut with '…' when longer.
"""
from __future__ import annotations

import enum
import functools
import struct
import time
import zlib
from dataclasses import dataclass
from operator import index as _index

import numpy as np

from . import shm
from .segment_lock import SegmentLock

__all__ = ["RoomEntry", "RoomState", "RoomTable", "TableFull"]


class RoomState(enum.IntEnum):
    FREE = 0
    BOOTSTRAPPING = 1
    QUEUED = 2
    ENCODING = 3
    TRANSFERRING = 4
    SUCCESS = 5
    FAILED = 6


_FINAL = (RoomState.SUCCESS, RoomState.FAILED)


class TableFull(RuntimeError):
    """No FREE slot left in the room table."""


@dataclass(frozen=True)
class RoomEntry:
    slot: int
    room: int
    request_id: str
    state: RoomState
    holders: int  # custody bit mask, from the claims
    items_total: int
    items_done: int
    reason: str
    deadline: float
    created: float
    concluded: float

    @property
    def live(self) -> bool:
        return RoomState.FREE < self.state < RoomState.SUCCESS


REQUEST_ID_BYTES = 128
REASON_BYTES = 256
_MAGIC = 0x6D6F_6F72_0000_0003  # "room", layout 3
MAX_OWNERS = 32  # custody bits
# record: crc32 over the rest, then the body
_BODY = struct.Struct(f"<IQBBHIIddd{REQUEST_ID_BYTES}s{REASON_BYTES}s")
_REC = 4 + _BODY.size  # 436
_HDR = 64
# header words (u64): magic, capacity, record size, total size, repairs, index sequence, free cursor
_H_REPAIRS, _H_INDEX_SEQ, _H_CURSOR = 4, 5, 6
_GOLDEN = 0x9E37_79B9_7F4A_7C15  # Fibonacci hashing of room ids into the index
_M64 = 2**64 - 1
_FREE_CHUNK = 1024  # slots whose states one step of the FREE-slot search reads


def _index_size(capacity: int) -> int:
    """Entries of the room index: a power of two, at least twice the capacity."""
    return 1 << max(4, (2 * capacity - 1).bit_length())


def _layout(capacity: int) -> dict[str, int]:
    """Segment layout: header, seq u32[cap], columns room u64 / state u8 [cap, 2], records
    [cap, 2] of _REC bytes, custody claims: room u64 / on u8 [cap, MAX_OWNERS], room index
    u32[_index_size(cap)], progress u8[cap]."""
    off, pos = {}, _HDR
    for name, nbytes in (("seq", 4 * capacity), ("room", 16 * capacity), ("state", 2 * capacity),
                         ("rec", 2 * _REC * capacity), ("claim_room", 8 * MAX_OWNERS * capacity),
                         ("claim_on", MAX_OWNERS * capacity), ("index", 4 * _index_size(capacity)),
                         ("progress", capacity)):
        pos = (pos + 63) // 64 * 64
        off[name] = pos
        pos += nbytes
    off["total"] = pos
    return off


# body field indices (after ver)
_ROOM, _STATE, _RIDLEN, _REASONLEN, _TOTAL, _DONE, _DEADLINE, _CREATED, _CONCLUDED, _RID, _REASON = range(11)
_U64 = (0, 2**64 - 1)
_U32_MAX = 2**32 - 1
_FREE_FIELDS = (0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, b"", b"")
_NO_CLAIMS = bytes(MAX_OWNERS)
_READ_SPINS = 64
_STATES = tuple(RoomState)
_new_entry = object.__new__

# Test hook: called with a point name inside a write (tests SIGKILL the process there).
_fault_hook = None


def _cut(text: str, limit: int) -> bytes:
    b = text.encode("utf-8")
    if len(b) <= limit:
        return b
    return b[:limit - 3].decode("utf-8", "ignore").encode("utf-8") + "…".encode("utf-8")


def _slots(copy_mask: np.ndarray) -> list[int]:
    """Slots (in order, once each) of the set entries of a flat [slot, copy] mask."""
    idx = np.flatnonzero(copy_mask)
    if idx.size == 0:
        return []
    return list(dict.fromkeys((idx >> 1).tolist()))


@functools.lru_cache(maxsize=1024)
def _owners(bits: int) -> tuple[int, ...]:
    return tuple(o for o in range(MAX_OWNERS) if bits >> o & 1)


def _check_range(name: str, v, lo: int, hi: int) -> int:
    v = _index(v)
    if not lo <= v <= hi:
        raise ValueError(f"{name} {v} out of range {lo}..{hi}")
    return v


class RoomTable:
    """Rooms in shared memory: readable lock-free by any process, updated under a lock."""

    @classmethod
    def create(cls, prefix: str, run_id: str, what: str, capacity: int) -> "RoomTable":
        capacity = _index(capacity)
        if not 1 <= capacity <= 2**20:
            raise ValueError(f"room table capacity {capacity} must be 1..2**20")
        lay = _layout(capacity)
        seg = shm.Segment.create(shm.object_name(prefix, run_id, what), lay["total"])
        try:
            # Zeroed by posix_fallocate: seq 0, columns FREE. Records: both copies FREE
            # and valid (copy 1 as the version before seq 0).
            pair = bytearray(2 * _REC)
            for copy, ver in ((0, 0), (1, _U32_MAX)):
                body = _BODY.pack(ver, *_FREE_FIELDS)
                pair[copy * _REC:copy * _REC + 4] = zlib.crc32(body).to_bytes(4, "little")
                pair[copy * _REC + 4:(copy + 1) * _REC] = body
            seg.buf[lay["rec"]:lay["rec"] + 2 * _REC * capacity] = bytes(pair) * capacity
            hdr = seg.buf[:_HDR].cast("Q")
            hdr[1], hdr[2], hdr[3] = capacity, _REC, lay["total"]
            hdr[0] = _MAGIC  # last: attach refuses a half-made table
            hdr.release()
            return cls(seg)
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def attach(cls, prefix: str, run_id: str, what: str) -> "RoomTable":
        seg = shm.Segment.attach(shm.object_name(prefix, run_id, what))
        try:
            return cls(seg)
        except BaseException:
            seg.close()
            raise

    def __init__(self, seg: shm.Segment):
        self._seg = seg
        if seg.size < _HDR:
            raise shm.ShmError(f"{seg.name!r} is too small to be a room table")
        hdr = seg.buf[:_HDR].cast("Q")
        magic, capacity, rec, total = hdr[0], hdr[1], hdr[2], hdr[3]
        hdr.release()
        if magic != _MAGIC or rec != _REC or not 1 <= capacity <= 2**20 or total != _layout(capacity)["total"]:
            raise shm.ShmError(f"{seg.name!r} is not an initialised room table (bad magic or layout)")
        if seg.size < total:
            raise shm.ShmError(f"room table {seg.name!r} is smaller than its header says")
        cap = self.capacity = int(capacity)
        lay = self._lay = _layout(cap)
        mv = self._mv = seg.buf
        mm = seg.buf.obj
        self._hdr = mv[:_HDR].cast("Q")
        self._seqv = mv[lay["seq"]:lay["seq"] + 4 * cap].cast("I")
        self._roomv = mv[lay["room"]:lay["room"] + 16 * cap].cast("Q")
        self._claim_roomv = mv[lay["claim_room"]:lay["claim_room"] + 8 * MAX_OWNERS * cap].cast("Q")
        self._claim_onv = mv[lay["claim_on"]:lay["claim_on"] + MAX_OWNERS * cap]
        self._mm, self._claim_on0 = mm, lay["claim_on"]
        self._statev = mv[lay["state"]:lay["state"] + 2 * cap]
        self._rec0 = lay["rec"]
        self._seq = np.frombuffer(mm, np.uint32, cap, lay["seq"])
        self._rooms = np.frombuffer(mm, np.uint64, 2 * cap, lay["room"]).reshape(cap, 2)
        self._claim_room = np.frombuffer(mm, np.uint64, MAX_OWNERS * cap, lay["claim_room"]).reshape(cap, MAX_OWNERS)
        self._claim_on = np.frombuffer(mm, np.uint8, MAX_OWNERS * cap, lay["claim_on"]).reshape(cap, MAX_OWNERS)
        self._states = np.frombuffer(mm, np.uint8, 2 * cap, lay["state"]).reshape(cap, 2)
        n = _index_size(cap)
        self._idxv = mv[lay["index"]:lay["index"] + 4 * n].cast("I")
        self._idx = np.frombuffer(mm, np.uint32, n, lay["index"])
        self._mask, self._shift = n - 1, 64 - (n.bit_length() - 1)
        self._progv = mv[lay["progress"]:lay["progress"] + cap]
        self._lock = SegmentLock(seg)
        self._closed = False

    # -- raw records ---------------------------------------------------------

    def _slot_index(self, slot) -> int:
        slot = _index(slot)
        if not 0 <= slot < self.capacity:
            raise IndexError(f"room table slot {slot} out of range 0..{self.capacity - 1}")
        return slot

    def _load(self, slot: int):
        """(seq, body fields or None if damaged); lock-free, retries past writers."""
        base = self._rec0 + slot * 2 * _REC
        seqv, mv = self._seqv, self._mv
        for _ in range(_READ_SPINS):
            s = seqv[slot]
            off = base + (s & 1) * _REC
            raw = mv[off:off + _REC].tobytes()
            if seqv[slot] == s:
                return s, self._verify(raw, s)
        # Writers kept publishing under us: read under their lock.
        self._lock.acquire()
        try:
            return self._load_locked(slot)
        finally:
            self._lock.release()

    def _load_locked(self, slot: int):
        s = self._seqv[slot]
        off = self._rec0 + slot * 2 * _REC + (s & 1) * _REC
        return s, self._verify(self._mv[off:off + _REC].tobytes(), s)

    @staticmethod
    def _verify(raw: bytes, seq: int):
        if zlib.crc32(memoryview(raw)[4:]) != int.from_bytes(raw[:4], "little"):
            return None
        f = _BODY.unpack_from(raw, 4)
        if f[0] != seq or f[1 + _STATE] > RoomState.FAILED or f[1 + _RIDLEN] > REQUEST_ID_BYTES \
                or f[1 + _REASONLEN] > REASON_BYTES:
            return None
        return f[1:]

    def _store(self, slot: int, seq: int, fields) -> None:
        """Lock held: write ``fields`` into the inactive copy, then publish it."""
        new = (seq + 1) & _U32_MAX
        c = 2 * slot + (new & 1)
        off = self._rec0 + c * _REC
        body = _BODY.pack(new, *fields)
        mv = self._mv
        # The inactive copy's index columns first (hints, verified against records) ...
        self._roomv[c] = fields[_ROOM]
        self._statev[c] = fields[_STATE]
        # ... then its record, body before crc ...
        mv[off + 4:off + _REC] = body
        if _fault_hook is not None:
            _fault_hook("rooms.body")
        mv[off:off + 4] = zlib.crc32(body).to_bytes(4, "little")
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
        off = self._rec0 + (2 * slot + ((seq & 1) ^ 1)) * _REC
        raw = self._mv[off:off + _REC].tobytes()
        other = self._verify(raw, _BODY.unpack_from(raw, 4)[0])
        if other is None:
            fields = _FREE_FIELDS
        else:
            fields = list(other)
            if 0 < fields[_STATE] < RoomState.SUCCESS:
                reason = _cut("room table entry was damaged; concluded by repair", REASON_BYTES)
                fields[_STATE], fields[_CONCLUDED] = int(RoomState.FAILED), time.monotonic()
                fields[_REASON], fields[_REASONLEN] = reason, len(reason)
            fields = tuple(fields)
        self._store(slot, seq, fields)
        self._hdr[_H_REPAIRS] += 1
        return (seq + 1) & _U32_MAX, fields

    def _holders(self, slot: int, room: int) -> int:
        """The custody bits of the owners whose claim on ``slot`` is for ``room``."""
        base = slot * MAX_OWNERS
        at = self._claim_on0 + base
        on = self._mm[at:at + MAX_OWNERS]  # bytes: the usual answer (no claim) in one compare
        if on == _NO_CLAIMS:
            return 0
        bits, rooms = 0, self._claim_roomv
        o = on.find(1)
        while o >= 0:
            if rooms[base + o] == room:
                bits |= 1 << o
            o = on.find(1, o + 1)
        return bits

    def _entry(self, slot: int, f) -> RoomEntry:
        # Filled through __dict__: a frozen dataclass's __init__ costs ~2 us here.
        e = _new_entry(RoomEntry)
        e.__dict__.update(
            slot=slot, room=f[_ROOM], request_id=f[_RID][:f[_RIDLEN]].decode("utf-8", "replace"),
            state=_STATES[max(f[_STATE], self._progv[slot]) if f[_STATE] < RoomState.SUCCESS else f[_STATE]],
            holders=self._holders(slot, f[_ROOM]), items_total=f[_TOTAL],
            items_done=f[_DONE],
            reason=f[_REASON][:f[_REASONLEN]].decode("utf-8", "replace"),
            deadline=f[_DEADLINE], created=f[_CREATED], concluded=f[_CONCLUDED],
        )
        return e

    def _update(self, slot, room, change):
        """Under the lock: ``change(fields)`` -> new fields list, or a result to return as is."""
        slot = self._slot_index(slot)
        self._lock.acquire()
        try:
            s, f = self._current(slot)
            if f[_STATE] == RoomState.FREE or f[_ROOM] != room:
                return None
            new = change(list(f))
            if isinstance(new, list):
                self._store(slot, s, new)
                return True
            return new
        finally:
            self._lock.release()

    # -- the room index (lock held to change it) ---------------------------------

    def _home(self, room: int) -> int:
        return ((room * _GOLDEN) & _M64) >> self._shift

    def _active_room(self, slot: int) -> tuple[int, int]:
        """(room, state) of ``slot``'s active copy, from the columns."""
        c = 2 * slot + (self._seqv[slot] & 1)
        return self._roomv[c], self._statev[c]

    def _indexed(self, room: int) -> int | None:
        """The slot the index gives for ``room`` (its columns agree; the caller verifies the record)."""
        idx, mask = self._idxv, self._mask
        i = self._home(room)
        for _ in range(mask + 1):
            e = idx[i]
            if e == 0 or e > self.capacity:
                return None
            r, state = self._active_room(e - 1)
            if r == room and state:
                return e - 1
            i = (i + 1) & mask
        return None

    def _index_add(self, room: int, slot: int) -> None:
        idx, mask = self._idxv, self._mask
        i = self._home(room)
        while idx[i]:
            i = (i + 1) & mask
        idx[i] = slot + 1

    def _index_remove(self, room: int, slot: int) -> None:
        """Take ``slot``'s entry out of ``room``'s chain, moving later entries of the chain
        back into the hole (backward-shift deletion: no tombstones to skip)."""
        idx, mask = self._idxv, self._mask
        i = self._home(room)
        while idx[i] != slot + 1:
            if idx[i] == 0:
                return
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            e = idx[j]
            if e == 0:
                break
            k = self._home(self._active_room(e - 1)[0])
            if (j - k) & mask >= (j - i) & mask:  # its home is not after the hole: it may move there
                idx[i] = e
                i = j
        idx[i] = 0

    def _clean_index(self) -> None:
        """Lock held: rebuild the index from the records if a writer died while changing it."""
        if not self._hdr[_H_INDEX_SEQ] & 1:
            return
        self._idx[:] = 0
        for slot in np.flatnonzero(self.active_states() != 0).tolist():
            _, f = self._current(slot)
            if f[_STATE] != RoomState.FREE:
                self._index_add(f[_ROOM], slot)
        self._hdr[_H_INDEX_SEQ] += 1

    def _free_slot(self):
        """Lock held: (slot, seq) of a FREE slot, searched from the cursor; None if none."""
        cap, start = self.capacity, self._hdr[_H_CURSOR] % self.capacity
        if not self._active_room(start)[1]:  # the usual case: the slot after the last insert
            s, f = self._current(start)
            if f[_STATE] == RoomState.FREE:  # the column is a hint; the record decides
                return start, s
        for a in list(range(start, cap, _FREE_CHUNK)) + list(range(0, start, _FREE_CHUNK)):
            free = self.active_states(a, min(a + _FREE_CHUNK, cap if a >= start else start)) == 0
            while True:
                i = int(free.argmax())
                if not free[i]:
                    break
                s, f = self._current(a + i)
                if f[_STATE] == RoomState.FREE:
                    return a + i, s
                free[i] = False
        return None

    # -- reads -----------------------------------------------------------------

    def get(self, slot: int) -> RoomEntry | None:
        """The entry in ``slot``, None if FREE."""
        slot = self._slot_index(slot)
        s, f = self._load(slot)
        if f is None:
            self._lock.acquire()
            try:
                s, f = self._current(slot)
            finally:
                self._lock.release()
        if f[_STATE] == RoomState.FREE:
            return None
        return self._entry(slot, f)

    def find(self, room: int) -> int | None:
        """Slot of the non-FREE entry for ``room``, or None."""
        room = _index(room)
        if not _U64[0] <= room <= _U64[1]:
            return None
        hdr = self._hdr
        for _ in range(_READ_SPINS):
            v = hdr[_H_INDEX_SEQ]
            if v & 1:  # a writer is changing the index (or died doing it): scan
                slots = self._room_candidates(room)
                break
            slot = self._indexed(room)
            if hdr[_H_INDEX_SEQ] == v:
                slots = () if slot is None else (slot,)
                break
        else:
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

    def insert(self, room: int, request_id: str, items_total: int, holders: int,
               deadline: float = 0.0, state: RoomState = RoomState.BOOTSTRAPPING,
               existing_ok: bool = False) -> int:
        """Record a new room; return its slot. TableFull when no slot is FREE.

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
        rid = _cut(str(request_id), REQUEST_ID_BYTES)
        now = time.monotonic()
        fields = [room, int(state), len(rid), 0, items_total, 0, float(deadline), now,
                  now if state in _FINAL else 0.0, rid, b""]
        self._lock.acquire()
        try:
            self._clean_index()
            dup = self._find_locked(room)
            if dup is not None and existing_ok:
                return dup
            if dup is not None:
                raise ValueError(f"room {room} is already in the table (slot {dup})")
            free = self._free_slot()
            if free is None:
                raise TableFull(
                    f"room table {self._seg.name!r} is full: all {self.capacity} slots hold rooms "
                    f"(live or concluded tombstones not yet freed); cannot record room {room} "
                    f"(request {request_id!r})"
                )
            slot, s = free
            self._hdr[_H_INDEX_SEQ] += 1  # odd: changing the index
            self._claim(slot, room, holders)  # before the room is there: void until then
            self._progv[slot] = 0
            self._store(slot, s, fields)
            if _fault_hook is not None:
                _fault_hook("rooms.index")
            self._index_add(room, slot)
            self._hdr[_H_CURSOR] = slot + 1
            self._hdr[_H_INDEX_SEQ] += 1
            return slot
        finally:
            self._lock.release()

    def _find_locked(self, room: int) -> int | None:
        """Index clean: the slot of ``room``'s non-FREE entry, or None."""
        slot = self._indexed(room)
        if slot is None:
            return None
        _, f = self._current(slot)
        return slot if f[_STATE] != RoomState.FREE and f[_ROOM] == room else None

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
                if f[_STATE] == RoomState.FREE or f[_ROOM] != room or f[_STATE] >= RoomState.SUCCESS \
                        or state <= max(f[_STATE], self._progv[slot]):
                    return False
                self._progv[slot] = int(state)
                return True

        def change(f):
            cur = f[_STATE]
            if cur >= RoomState.SUCCESS or state <= max(cur, self._progv[slot]):
                return False
            f[_STATE] = int(state)
            if state in _FINAL:
                f[_CONCLUDED] = time.monotonic()
            return f

        return bool(self._update(slot, room, change))

    def _claim(self, slot: int, room: int, bits: int) -> None:
        """Lock held, slot FREE: the new room's claims are ``bits``, every other claim void."""
        base = slot * MAX_OWNERS
        self._claim_onv[base:base + MAX_OWNERS] = _NO_CLAIMS
        for o in _owners(bits):
            self._claim_roomv[base + o] = room
            self._claim_onv[base + o] = 1

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
        return f[_STATE] != RoomState.FREE and f[_ROOM] == room

    def hold(self, slot: int, room: int, bits: int) -> bool:
        """Claim custody ``bits`` of ``room``, even when concluded (no lock: each owner writes
        only its own claims); False, claims unchanged, if ``slot`` does not hold ``room``."""
        slot = self._slot_index(slot)
        base = slot * MAX_OWNERS
        owners = _owners(bits)
        rooms, on = self._claim_roomv, self._claim_onv
        before = [(rooms[base + o], on[base + o]) for o in owners]
        for o in owners:
            rooms[base + o] = room
            on[base + o] = 1
        if self._is_there(slot, room):  # read after the claim is written: see the class doc
            return True
        for o, (r, flag) in zip(owners, before):
            on[base + o] = 0
            rooms[base + o] = r
            on[base + o] = flag
        return False

    def unhold(self, slot: int, room: int, bits: int) -> bool:
        """Give up custody ``bits`` of ``room``; False if ``slot`` does not hold ``room``."""
        slot = self._slot_index(slot)
        base = slot * MAX_OWNERS
        for o in _owners(bits):
            if self._claim_onv[base + o] and self._claim_roomv[base + o] == room:
                self._claim_onv[base + o] = 0
        return self._is_there(slot, room)

    def held_by(self, bits: int, failed_too: bool = False) -> list[RoomEntry]:
        """Live entries whose holders have any of ``bits``; with ``failed_too``, Failed ones
        still held as well (a failed room the sender holds until its writes are fenced)."""
        owners = _owners(bits)
        if not owners:
            return []
        rooms = np.where(self._seq & 1, self._rooms[:, 1], self._rooms[:, 0])
        st = self.active_states()
        owners = list(owners)
        claimed = ((self._claim_on[:, owners] != 0) & (self._claim_room[:, owners] == rooms[:, None])).any(axis=1)
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
        out = [-1, False]

        def change(f):
            out[0] = f[_DONE]
            if f[_STATE] >= RoomState.SUCCESS or f[_DONE] >= _U32_MAX:
                return False
            new = out[0] = f[_DONE] + 1 if done_so_far is None else min(max(f[_DONE], done_so_far), _U32_MAX)
            out[1] = conclude and new >= f[_TOTAL]
            if new == f[_DONE] and not out[1]:
                return False
            f[_DONE] = new
            if out[1]:
                f[_STATE], f[_CONCLUDED] = int(RoomState.SUCCESS), time.monotonic()
            return f

        self._update(slot, room, change)
        return out[0], out[1]

    def _conclude(self, slot, room, state: RoomState, reason: str) -> bool:
        rb = _cut(str(reason), REASON_BYTES)

        def change(f):
            if f[_STATE] >= RoomState.SUCCESS:
                return False
            f[_STATE], f[_CONCLUDED] = int(state), time.monotonic()
            f[_REASON], f[_REASONLEN] = rb, len(rb)
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
        self._lock.acquire()
        try:
            self._clean_index()
            s, f = self._current(slot)
            if f[_STATE] < RoomState.SUCCESS or f[_ROOM] != room:
                return False
            self._hdr[_H_INDEX_SEQ] += 1  # odd: changing the index
            self._index_remove(room, slot)
            if _fault_hook is not None:
                _fault_hook("rooms.index")
            self._store(slot, s, _FREE_FIELDS)
            self._hdr[_H_INDEX_SEQ] += 1
            return True
        finally:
            self._lock.release()

    @property
    def repairs(self) -> int:
        """How many damaged entries were repaired (should stay 0: a killed writer damages nothing)."""
        return self._hdr[_H_REPAIRS]

    # -- teardown ----------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lock.close()
        for v in (self._hdr, self._seqv, self._roomv, self._statev, self._claim_roomv, self._claim_onv,
                  self._idxv, self._progv):
            v.release()
        self._seq = self._rooms = self._states = self._claim_room = self._claim_on = self._idx = None
        self._hdr = self._seqv = self._roomv = self._statev = self._claim_roomv = self._claim_onv = self._idxv = None
        self._progv = None
        self._mv = self._mm = None
        self._seg.close()

    def unlink(self) -> None:
        self._seg.unlink()

    def __enter__(self) -> "RoomTable":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RoomTable({self._seg.name!r}, capacity={self.capacity})"
