"""Single-producer single-consumer ring of length-prefixed records in POSIX shared memory.

Segment ``<prefix>-<run id>-<what>``, all integers little-endian u64::

    byte 0     constant line  magic, version, capacity, max_record, data offset, record header
    byte 128   producer line  head, pushed, pend_head, pend_pushed, data_posts,
                              producer_wait, producer_sleeps   (stored only by the producer)
    byte 256   consumer line  tail, popped, pend_tail, pend_popped, space_posts,
                              consumer_wait, consumer_sleeps   (stored only by the consumer)
    byte 512   data           ``capacity`` bytes

plus two semaphores, ``<what>.data`` (wakes a sleeping consumer) and ``<what>.space``
(wakes a sleeping producer), or a consumer's doorbell in place of the data semaphore
(ipc.sleepers).

Records.  ``head`` and ``tail`` are monotonic byte indices (never wrapped); index
``i`` lives at ``data[i % capacity]``.  A record (ipc.framing: a 5-byte header, then
the payload) that runs past the end of the buffer continues at its start (it is
copied in two parts), so all of ``capacity`` is usable and the largest record is
``capacity - 5`` bytes.  A batch pop copies a run of records out and splits it with
one ``pickle.loads``.

Publishing.  The producer copies headers and payloads into free space first and
only then stores the new ``head``: one aligned 8-byte store.  Header words are
accessed through a ``memoryview`` cast to ``'Q'`` over the mapping; CPython packs an
item of it with a fixed-size 8-byte ``memcpy`` (``PACK_SINGLE``), which compiles to
one ``mov``, exactly like a ctypes ``c_uint64`` store (reads are about three times
cheaper than through ctypes; tests/test_ring.py checks that a reader in another
process never sees a torn value).  A producer SIGKILLed at any instruction leaves
either the old or the new ``head``, so a consumer never sees part of a record.  A
batch is one ``bytes`` object (headers and payloads; for records of one size the
header is simply the ``join`` separator) copied in with one or two slice copies.
The consumer copies records out and only then stores the new ``tail``; until then
they stay in the ring for whoever consumes next.  ``peek_batch`` + ``release`` let
an exactly-once consumer log what it took before it gives the space back.

Memory ordering.  Correct on x86-64, whose TSO model keeps stores in order with
stores and loads in order with loads, and never lets a store pass an earlier load:
a consumer that loads the new ``head`` sees the payload stored before it, and a
producer that loads the new ``tail`` knows the consumer's reads of that space are
done.  (The C compiler cannot reorder them either: each copy and each index store
is a separate call from the interpreter.  A weakly ordered CPU would need release
stores and acquire loads, which CPython cannot express; this module assumes x86-64.)
The one reordering TSO does allow -- a store followed by a load of another location
-- is the one the sleeper handshake must rule out, hence its explicit fences.

Counters.  ``pushed``/``popped`` (records) cannot share one store with
``head``/``tail``, so each side first brings ``pushed`` up to date if a predecessor
died before its last store, then stores the pair it is about to reach
(``pend_head``, ``pend_pushed``), then the index, then the counter.  The effective
counter is ``pend_pushed`` when ``head == pend_head`` and ``pushed`` otherwise, which
is right after a SIGKILL anywhere in that sequence.  Read by the other side while a
call is in progress, the counters are a snapshot.

Sleeping.  A consumer with nothing to read, or a producer without room, sleeps on
a semaphore until the other side moves its index: the handshake is ipc.sleepers'.
Each side's waiting flag and sleep count are in its own line.
"""
from __future__ import annotations

import os
import time
from bisect import bisect_right
from itertools import accumulate

import posix_ipc

from ipc import shm
from ipc.framing import RECORD_HEADER, RECORD_TAG, as_bytes_like, frame, header_of, pack_header, \
    unframe, unpack_u32
from ipc.sleepers import sleep_until, wake
from ipc.sleepers import wait_any as _wait_any

__all__ = ["Ring", "RingError", "RecordTooLarge", "RECORD_HEADER", "wait_any"]

MAGIC = 0x32474E4952445045  # b"EPDRING2" little-endian
VERSION = 2
MIN_CAPACITY = 16
MAX_CAPACITY = 1 << 40
DATA_OFFSET = 512

# header words (index into the 'Q' view)
_MAGIC, _VERSION, _CAPACITY, _MAX_RECORD, _DATA_OFFSET, _RECORD_HEADER = range(6)
_HEAD, _PUSHED, _PEND_HEAD, _PEND_PUSHED, _DATA_POSTS, _PWAIT, _PSLEEPS = range(16, 23)
_TAIL, _POPPED, _PEND_TAIL, _PEND_POPPED, _SPACE_POSTS, _CWAIT, _CSLEEPS = range(32, 39)

# A first record at least this big is copied straight out of the ring by itself (one
# copy) rather than through a batch buffer (two copies).
_DIRECT = 32 * 1024
# Most bytes one batch parse copies out (it always takes at least one record).
_PARSE_LIMIT = 1 << 20
# Batches whose records average more than this are written record by record
# instead of being joined into one buffer first.
_JOIN_MAX_AVG = 4096

_add_header = RECORD_HEADER.__add__
_monotonic = time.monotonic


class RingError(RuntimeError):
    """The ring cannot do what was asked (not a ring, bad release index, corruption)."""


class RecordTooLarge(ValueError):
    """A record is larger than the ring's ``max_record``."""


def _names(prefix: str, run_id: str, what: str, doorbell: str | None = None) -> tuple[str, str, str]:
    return (
        shm.object_name(prefix, run_id, what),
        doorbell or shm.object_name(prefix, run_id, what + ".data"),
        shm.object_name(prefix, run_id, what + ".space"),
    )


_NO_RECORDS: list = []


class Ring:
    """One SPSC ring.  At any time one process pushes and one pops; either may die and
    be replaced, and the successor attaches and continues from ``head``/``tail``."""

    def __init__(self, seg: shm.Segment, data_sem, space_sem, names, shared_doorbell: bool = False):
        self.name, self.data_sem_name, self.space_sem_name = names
        self.shared_doorbell = shared_doorbell
        self._seg = seg
        self._data_sem = data_sem
        self._space_sem = space_sem
        q = seg.buf[:DATA_OFFSET].cast("Q")
        if q[_MAGIC] != MAGIC or q[_VERSION] != VERSION:
            magic = q[_MAGIC]
            q.release()
            raise RingError(
                f"segment {seg.name!r} is not a version-{VERSION} ring (magic {magic:#x}); "
                "was it made by Ring.create, and did that finish?"
            )
        self.capacity: int = q[_CAPACITY]
        self.max_record: int = q[_MAX_RECORD]
        if (
            q[_DATA_OFFSET] != DATA_OFFSET
            or q[_RECORD_HEADER] != RECORD_HEADER
            or seg.size < DATA_OFFSET + self.capacity
        ):
            q.release()
            raise RingError(
                f"ring {seg.name!r} is inconsistent: {seg.size} bytes for capacity {self.capacity}"
            )
        self._q = q
        self._data = seg.buf[DATA_OFFSET:DATA_OFFSET + self.capacity]
        # The waiting-flag value each side last posted for (at most one post per sleep).
        self._data_posted_for = 0
        self._space_posted_for = 0
        # Records parsed but not yet consumed: _rd_recs[_rd_i:] start at index _rd_at
        # (valid only while _rd_at == tail).
        self._rd_at = -1
        self._rd_recs = _NO_RECORDS
        self._rd_i = 0
        # (tail, end, count) of the last peek, so release(end) need not re-count.
        self._peeked: tuple[int, int, int] | None = None

    # --- creation ---------------------------------------------------------------
    @classmethod
    def create(cls, prefix: str, run_id: str, what: str, capacity: int,
               doorbell: str | None = None) -> "Ring":
        """Create the segment (``capacity`` data bytes, reserved up front) and both
        semaphores.  Fails if any of them exists.

        ``doorbell``: the name of an existing semaphore to wake the consumer with
        instead of a data semaphore of the ring's own: a consumer of several rings
        gives them all its doorbell and sleeps on it in ``wait_any``."""
        capacity = int(capacity)
        if not MIN_CAPACITY <= capacity <= MAX_CAPACITY:
            raise ValueError(
                f"ring capacity {capacity} must be between {MIN_CAPACITY} and {MAX_CAPACITY} bytes"
            )
        names = _names(prefix, run_id, what, doorbell)
        seg = shm.Segment.create(names[0], DATA_OFFSET + capacity)
        sems, created = [], []
        try:
            q = seg.buf[:DATA_OFFSET].cast("Q")
            q[_VERSION] = VERSION
            q[_CAPACITY] = capacity
            q[_MAX_RECORD] = min(capacity - RECORD_HEADER, 0xFFFFFFFF)
            q[_DATA_OFFSET] = DATA_OFFSET
            q[_RECORD_HEADER] = RECORD_HEADER
            q[_MAGIC] = MAGIC  # last: whoever sees it sees the rest
            q.release()
            if doorbell:
                sems.append(shm.open_semaphore(names[1]))
            else:
                sems.append(shm.create_semaphore(names[1]))
                created.append(names[1])
            sems.append(shm.create_semaphore(names[2]))
            created.append(names[2])
            return cls(seg, sems[0], sems[1], names, doorbell is not None)
        except BaseException:
            for s in sems:
                s.close()
            for name in created:  # only what this call made (an existing one is not ours)
                shm.unlink_semaphore(name)
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def attach(cls, prefix: str, run_id: str, what: str, doorbell: str | None = None) -> "Ring":
        """Open an existing ring (a restarted producer or consumer continues from it);
        ``doorbell`` as given to ``create``."""
        names = _names(prefix, run_id, what, doorbell)
        seg = shm.Segment.attach(names[0])
        sems = []
        try:
            if seg.size < DATA_OFFSET:
                raise RingError(f"segment {names[0]!r} ({seg.size} bytes) is too small to be a ring")
            sems.append(shm.open_semaphore(names[1]))
            sems.append(shm.open_semaphore(names[2]))
            return cls(seg, sems[0], sems[1], names, doorbell is not None)
        except BaseException:
            for s in sems:
                s.close()
            seg.close()
            raise

    # --- indices and counters ---------------------------------------------------
    @property
    def head(self) -> int:
        """Write index: bytes ever published (monotonic)."""
        return self._q[_HEAD]

    @property
    def tail(self) -> int:
        """Read index: bytes ever released (monotonic)."""
        return self._q[_TAIL]

    def _pushed(self) -> int:
        q = self._q
        pend = q[_PEND_PUSHED]
        return pend if q[_HEAD] == q[_PEND_HEAD] else q[_PUSHED]

    def _popped(self) -> int:
        q = self._q
        pend = q[_PEND_POPPED]
        return pend if q[_TAIL] == q[_PEND_TAIL] else q[_POPPED]

    def depth(self) -> int:
        """Records published and not yet released (exact while neither side is mid-call)."""
        return self._pushed() - self._popped()

    def stats(self) -> dict:
        q = self._q
        pushed, popped = self._pushed(), self._popped()
        return {
            "capacity": self.capacity,
            "max_record": self.max_record,
            "head": q[_HEAD],
            "tail": q[_TAIL],
            "used_bytes": q[_HEAD] - q[_TAIL],
            "pushed": pushed,
            "popped": popped,
            "depth": pushed - popped,
            "data_posts": q[_DATA_POSTS],
            "space_posts": q[_SPACE_POSTS],
            "consumer_sleeps": q[_CSLEEPS],
            "producer_sleeps": q[_PSLEEPS],
            "consumer_waiting": bool(q[_CWAIT] & 1),
            "producer_waiting": bool(q[_PWAIT] & 1),
        }

    # --- raw copies -------------------------------------------------------------
    def _write(self, index: int, blob, n: int) -> None:
        cap = self.capacity
        p = index % cap
        e = p + n
        if e <= cap:
            self._data[p:e] = blob
        else:
            k = cap - p
            mv = memoryview(blob)
            self._data[p:cap] = mv[:k]
            self._data[: e - cap] = mv[k:]

    def _read(self, index: int, n: int) -> bytes:
        cap = self.capacity
        p = index % cap
        e = p + n
        d = self._data
        if e <= cap:
            return d[p:e].tobytes()
        return b"".join((d[p:cap], d[: e - cap]))

    def _len_at(self, index: int) -> int:
        """Payload length of the record at ``index`` (checks its tag)."""
        cap = self.capacity
        p = index % cap
        if p + RECORD_HEADER <= cap:
            d = self._data
            if d[p] == RECORD_TAG:
                return unpack_u32(d, p + 1)[0]
        else:
            hdr = self._read(index, RECORD_HEADER)
            if hdr[0] == RECORD_TAG:
                return unpack_u32(hdr, 1)[0]
        q = self._q
        raise RingError(
            f"ring {self.name!r} is corrupt: no record header at index {index} "
            f"(tail {q[_TAIL]}, head {q[_HEAD]})"
        )

    def _corrupt(self, at: int, what: str) -> RingError:
        q = self._q
        return RingError(
            f"ring {self.name!r} is corrupt at index {at} (tail {q[_TAIL]}, head {q[_HEAD]}): {what}"
        )

    # --- producer side ----------------------------------------------------------
    def _too_large(self, n: int, where: str = "") -> RecordTooLarge:
        return RecordTooLarge(
            f"record of {n} bytes{where} exceeds max_record {self.max_record} bytes of ring "
            f"{self.name!r} (capacity {self.capacity} bytes, {RECORD_HEADER}-byte header per record)"
        )

    def _publish(self, new_head: int, n: int, wake_consumer: bool = True) -> None:
        q = self._q
        pushed = q[_PEND_PUSHED] if q[_HEAD] == q[_PEND_HEAD] else q[_PUSHED]
        if q[_PUSHED] != pushed:  # a predecessor died before its last counter store
            q[_PUSHED] = pushed
        pushed += n
        q[_PEND_HEAD] = new_head
        q[_PEND_PUSHED] = pushed
        q[_HEAD] = new_head  # THE publish: one aligned 8-byte store, after every payload byte
        if wake_consumer:
            self._data_posted_for = wake(q, _CWAIT, self._data_posted_for, self._data_sem, _DATA_POSTS)
        q[_PUSHED] = pushed

    def _wait_space(self, need: int, timeout: float | None) -> bool:
        """Wait until ``need`` bytes are free; False on timeout."""
        q, cap = self._q, self.capacity
        return sleep_until(q, lambda: cap - (q[_HEAD] - q[_TAIL]) >= need, timeout,
                           _PWAIT, _PSLEEPS, self._space_sem)

    def push(self, record, timeout: float | None = 0.0) -> bool:
        """Append one record; False if it did not fit within ``timeout`` seconds (0:
        don't wait, None: wait for ever).  Never overwrites unconsumed records."""
        if type(record) is not bytes:
            record = as_bytes_like(record)
        n = len(record)
        if n > self.max_record:
            raise self._too_large(n)
        need = n + RECORD_HEADER
        q = self._q
        head = q[_HEAD]
        if self.capacity - (head - q[_TAIL]) < need and not self._wait_space(need, timeout):
            return False
        if n <= _JOIN_MAX_AVG:
            self._write(head, header_of(n) + record, need)
        else:
            self._write(head, pack_header(RECORD_TAG, n), RECORD_HEADER)
            self._write(head + RECORD_HEADER, record, n)
        self._publish(head + need, 1)
        return True

    def push_batch(self, records, timeout: float | None = 0.0, wake_consumer: bool = True) -> int:
        """Append records in order: as many as fit are published together with one
        ``head`` store, then it waits (``timeout`` in all) for room for the rest.
        Returns how many were pushed, a prefix of ``records``.  Raises
        RecordTooLarge, pushing nothing, if any record exceeds ``max_record``.

        ``wake_consumer`` False: records that can wait leave a sleeping consumer asleep;
        it finds them when it next wakes, at most ``ipc.sleepers.WAIT_SLICE`` later.
        A batch that must wait for room wakes it all the same."""
        total = len(records)
        if not total:
            return 0
        if not set(map(type, records)) <= {bytes, bytearray}:
            records = [as_bytes_like(r) for r in records]
        lens = list(map(len, records))
        nbytes = sum(lens)
        if nbytes > self.max_record:  # else no record can be too large
            biggest = max(lens)
            if biggest > self.max_record:
                raise self._too_large(biggest, f" (index {lens.index(biggest)} of the batch)")
        nbytes += RECORD_HEADER * total
        q = self._q
        cap = self.capacity
        head = q[_HEAD]
        if nbytes <= cap - (head - q[_TAIL]):  # all fit: the common case
            self._write_records(head, records, lens, nbytes)
            self._publish(head + nbytes, total, wake_consumer)
            return total
        deadline = None
        if timeout is not None and timeout > 0:
            deadline = _monotonic() + timeout
        ends = list(accumulate(map(_add_header, lens), initial=0))  # ends[i]: bytes of records[:i]
        start = 0
        while True:
            head = q[_HEAD]
            stop = bisect_right(ends, ends[start] + cap - (head - q[_TAIL]), start + 1) - 1
            if stop > start:
                nbytes = ends[stop] - ends[start]
                if start == 0 and stop == total:
                    self._write_records(head, records, lens, nbytes)
                else:
                    self._write_records(head, records[start:stop], lens[start:stop], nbytes)
                self._publish(head + nbytes, stop - start)
                start = stop
                if start == total:
                    return total
            if timeout is None:
                wait = None
            elif deadline is None:
                return start
            else:
                wait = deadline - _monotonic()
                if wait <= 0:
                    return start
            if not self._wait_space(lens[start] + RECORD_HEADER, wait):
                return start

    def _write_records(self, head: int, records, lens, nbytes: int) -> None:
        k = len(lens)
        if nbytes <= _JOIN_MAX_AVG * k:
            self._write(head, frame(records, lens), nbytes)
        else:
            at = head
            for rec, n in zip(records, lens):
                self._write(at, pack_header(RECORD_TAG, n), RECORD_HEADER)
                self._write(at + RECORD_HEADER, rec, n)
                at += RECORD_HEADER + n

    # --- consumer side ----------------------------------------------------------
    def _wait_data(self, timeout: float | None) -> bool:
        """Wait until the ring holds a record; False on timeout."""
        q = self._q
        if q[_HEAD] != q[_TAIL]:  # the common case, without building a closure
            return True
        return sleep_until(q, lambda: q[_HEAD] != q[_TAIL], timeout, _CWAIT, _CSLEEPS, self._data_sem)

    def _release(self, tail: int, end: int, count: int) -> None:
        q = self._q
        popped = q[_PEND_POPPED] if tail == q[_PEND_TAIL] else q[_POPPED]
        if q[_POPPED] != popped:  # a predecessor died before its last counter store
            q[_POPPED] = popped
        popped += count
        q[_PEND_TAIL] = end
        q[_PEND_POPPED] = popped
        q[_TAIL] = end  # one aligned 8-byte store, after every read of that space
        self._space_posted_for = wake(q, _PWAIT, self._space_posted_for, self._space_sem, _SPACE_POSTS)
        q[_POPPED] = popped
        if self._rd_at == tail:  # keep the parsed records in step
            i = self._rd_i + count
            if i < len(self._rd_recs):
                self._rd_i = i
                self._rd_at = end
            else:
                self._rd_at = -1
                self._rd_recs = _NO_RECORDS
        self._peeked = None

    def pop(self, timeout: float | None = 0.0) -> bytes | None:
        """Take the oldest record; None if none arrived within ``timeout`` seconds."""
        q = self._q
        tail = q[_TAIL]
        if self._rd_at == tail:
            rec = self._rd_recs[self._rd_i]
            self._release(tail, tail + RECORD_HEADER + len(rec), 1)
            return rec
        if q[_HEAD] == tail and not self._wait_data(timeout):
            return None
        cap = self.capacity
        d = self._data
        p = tail % cap + RECORD_HEADER
        if p <= cap and d[p - RECORD_HEADER] == RECORD_TAG:
            n = unpack_u32(d, p - 4)[0]
        else:
            n = self._len_at(tail)
        end = tail + RECORD_HEADER + n
        if end > q[_HEAD]:
            raise self._corrupt(tail, f"record of {n} bytes runs past head")
        e = p + n
        rec = d[p:e].tobytes() if e <= cap else self._read(tail + RECORD_HEADER, n)
        self._release(tail, end, 1)
        return rec

    def pop_into(self, buffer, timeout: float | None = 0.0) -> int | None:
        """Copy the oldest record into ``buffer`` (writable, large enough) and take it;
        return its length, or None if none arrived within ``timeout`` seconds. For big
        records: a reused buffer is not page-faulted anew, as a fresh ``bytes`` is."""
        q = self._q
        tail = q[_TAIL]
        if self._rd_at == tail:  # parsed by an earlier batch call: it is in hand already
            rec = self.pop(0.0)
            out = memoryview(buffer).cast("B")
            out[:len(rec)] = rec
            return len(rec)
        if q[_HEAD] == tail and not self._wait_data(timeout):
            return None
        n = self._len_at(tail)
        end = tail + RECORD_HEADER + n
        if end > q[_HEAD]:
            raise self._corrupt(tail, f"record of {n} bytes runs past head")
        out = memoryview(buffer).cast("B")
        if len(out) < n:
            raise ValueError(f"pop_into: the record has {n} bytes, the buffer {len(out)}")
        cap, d = self.capacity, self._data
        p = (tail + RECORD_HEADER) % cap
        first = min(n, cap - p)
        out[:first] = d[p:p + first]
        if first < n:
            out[first:n] = d[: n - first]
        self._release(tail, end, 1)
        return n

    def peek_batch(self, max_records: int = 1024, timeout: float | None = 0.0) -> tuple[list[bytes], int]:
        """Up to ``max_records`` oldest records, without consuming them, and the read
        index just after them (for ``release``); ``([], tail)`` on timeout.  Returns as
        soon as at least one record is there."""
        out, tail, end = self._peek(max_records, timeout)
        self._peeked = (tail, end, len(out))
        return out, end

    def pop_batch(self, max_records: int = 1024, timeout: float | None = 0.0) -> list[bytes]:
        """Take up to ``max_records`` oldest records; [] if none arrived within
        ``timeout`` seconds.  Returns as soon as at least one record is there."""
        out, tail, end = self._peek(max_records, timeout)
        if out:
            self._release(tail, end, len(out))
        return out

    def _peek(self, max_records: int, timeout: float | None) -> tuple[list[bytes], int, int]:
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, not {max_records}")
        q = self._q
        tail = q[_TAIL]
        if self._rd_at == tail:
            i = self._rd_i
            out = self._rd_recs[i:i + max_records]
            return out, tail, tail + RECORD_HEADER * len(out) + sum(map(len, out))
        if q[_HEAD] == tail and (timeout is not None and timeout <= 0 or not self._wait_data(timeout)):
            return [], tail, tail
        out, nbytes = self._parse(tail, q[_HEAD] - tail, max_records)
        return out, tail, tail + nbytes

    def _parse(self, tail: int, avail: int, max_records: int) -> tuple[list[bytes], int]:
        """Copy whole records out from ``tail`` (at most ``_PARSE_LIMIT`` bytes, at least
        one record) and split them; records past ``max_records`` are kept for later.
        Returns the first ``max_records`` of them and the bytes they span."""
        n = self._len_at(tail)
        first = RECORD_HEADER + n
        if first > avail:
            raise self._corrupt(tail, f"record of {n} bytes runs past head")
        if first >= _DIRECT or first == avail:
            return [self._read(tail + RECORD_HEADER, n)], first
        take = avail if avail <= _PARSE_LIMIT else self._boundary(tail, _PARSE_LIMIT)
        cap = self.capacity
        p = tail % cap
        e = p + take
        d = self._data
        try:
            out = unframe((d[p:e],) if e <= cap else (d[p:cap], d[: e - cap]), take)
        except ValueError as exc:
            raise self._corrupt(tail, f"records between it and index {tail + take} {exc}") from exc
        if len(out) > max_records:
            self._rd_recs = out
            self._rd_i = 0
            self._rd_at = tail
            out = out[:max_records]
            return out, RECORD_HEADER * max_records + sum(map(len, out))
        return out, take

    def _boundary(self, tail: int, limit: int) -> int:
        """Bytes from ``tail`` to the last record boundary within ``limit`` bytes."""
        data = self._read(tail, limit)
        at = 0
        while at + RECORD_HEADER <= limit:
            if data[at] != RECORD_TAG:
                raise self._corrupt(tail + at, "no record header")
            nxt = at + RECORD_HEADER + unpack_u32(data, at + 1)[0]
            if nxt > limit:
                break
            at = nxt
        return at

    def release(self, end: int) -> None:
        """Consume every record before read index ``end``: a record boundary between
        ``tail`` and ``head``, such as the index ``peek_batch`` returned."""
        q = self._q
        tail = q[_TAIL]
        if end == tail:
            return
        head = q[_HEAD]
        if not tail < end <= head:
            raise RingError(
                f"release({end}) on ring {self.name!r} is outside the unconsumed range "
                f"(tail {tail}, head {head})"
            )
        pk = self._peeked
        if pk is not None and pk[0] == tail and pk[1] == end:
            count = pk[2]
        else:
            count = self._count_records(tail, end)
        self._release(tail, end, count)

    def _count_records(self, start: int, end: int) -> int:
        count = 0
        at = start
        while at < end:
            at += RECORD_HEADER + self._len_at(at)
            count += 1
        if at != end:
            raise RingError(
                f"release({end}) on ring {self.name!r} is not at a record boundary "
                f"(the record before it ends at {at}; tail {start})"
            )
        return count

    # --- lifetime ---------------------------------------------------------------
    def close(self) -> None:
        """Unmap and close this handle; the ring lives on for others."""
        if self._seg is None:
            return
        self._rd_recs = _NO_RECORDS
        self._q.release()
        self._data.release()
        for s in (self._data_sem, self._space_sem):
            try:
                s.close()
            except posix_ipc.Error:
                pass
        self._seg.close()
        self._seg = None

    def unlink(self) -> None:
        """Remove the segment and both semaphores (open handles stay usable until closed)."""
        try:
            os.unlink(os.path.join(shm.SHM_DIR, self.name))
        except FileNotFoundError:
            pass
        if not self.shared_doorbell:  # a shared doorbell belongs to whoever created it
            shm.unlink_semaphore(self.data_sem_name)
        shm.unlink_semaphore(self.space_sem_name)

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._seg is None:
            return f"<Ring {self.name!r} closed>"
        return (
            f"<Ring {self.name!r} capacity={self.capacity} head={self.head} "
            f"tail={self.tail} depth={self.depth()}>"
        )


def wait_any(rings: list, doorbell, timeout: float) -> bool:
    """Sleep until one of ``rings`` (all created with ``doorbell``) holds a record, or
    ``timeout`` seconds pass."""
    return _wait_any([r._q for r in rings], doorbell, timeout, _HEAD, _TAIL, _CWAIT)
