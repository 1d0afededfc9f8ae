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
``capacity - 5`` bytes.  A batch peek copies a run of records out and splits it with
one ``pickle.loads``.

Publishing.  The producer copies headers and payloads into free space first and
only then stores the new ``head``: one aligned 8-byte store (the other header words
go through a ``memoryview`` cast to ``'Q'``, also one 8-byte store each; tests check
that a reader never sees a torn value).  A producer SIGKILLed at any instruction
leaves either the old or the new ``head``, so a consumer never sees part of a
record.  A batch is one ``bytes`` object (headers and payloads; for records of one
size the header is simply the ``join`` separator) copied in with one or two slice
copies.  The consumer copies records out and only then stores the new ``tail``;
until then they stay in the ring for whoever consumes next.  ``peek_batch`` +
``release`` let an exactly-once consumer log what it took before it gives the space
back; ``release_one`` gives records back one at a time.

Memory ordering (ipc.ordering).  ``head`` and ``tail`` are stored with release
stores and loaded with acquire loads: a consumer that loads the new ``head`` sees
every byte stored before it (the records, and the arena bytes a record points at,
written before the push), and a producer that loads the new ``tail`` knows the
consumer's reads of that space are done.  Plain moves on x86-64 (TSO); on aarch64
the barriers without which a consumer could read the bytes of a lap before.  The
sleeper handshake adds full fences (ipc.sleepers).

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
from ipc.framing import (
    RECORD_HEADER,
    RECORD_TAG,
    as_bytes_like,
    frame,
    header_of,
    length_at,
    pack_header,
    read_at,
    unframe,
    unpack_u32,
    write_at,
)
from ipc.ordering import Words, check_cpu
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
        self._seg: shm.Segment | None = seg  # None once closed
        self._data_sem = data_sem
        self._space_sem = space_sem
        q = seg.buf[:DATA_OFFSET].cast("Q")
        words = Words(q)
        if words.load_acquire(_MAGIC) != MAGIC or q[_VERSION] != VERSION:  # pairs with create's release
            magic = q[_MAGIC]
            words.release()
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
            words.release()
            q.release()
            raise RingError(f"ring {seg.name!r} is inconsistent: {seg.size} bytes for capacity {self.capacity}")
        self._q = q
        # head and tail, the words the other side reads, go through these (ipc.ordering)
        self._words = words
        self._load_acquire = words.load_acquire
        self._store_release = words.store_release
        self._data = seg.buf[DATA_OFFSET : DATA_OFFSET + self.capacity]
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
    def create(cls, prefix: str, run_id: str, what: str, capacity: int, doorbell: str | None = None) -> "Ring":
        """Create the segment (``capacity`` data bytes, reserved up front) and both
        semaphores.  Fails if any of them exists.

        ``doorbell``: the name of an existing semaphore to wake the consumer with
        instead of a data semaphore of the ring's own: a consumer of several rings
        gives them all its doorbell and sleeps on it in ``wait_any``."""
        check_cpu()
        capacity = int(capacity)
        if not MIN_CAPACITY <= capacity <= MAX_CAPACITY:
            raise ValueError(f"ring capacity {capacity} must be between {MIN_CAPACITY} and {MAX_CAPACITY} bytes")
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
            words = Words(q)
            words.store_release(_MAGIC, MAGIC)  # last: whoever sees it sees the rest
            words.release()
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
        return self._load_acquire(_HEAD)

    @property
    def tail(self) -> int:
        """Read index: bytes ever released (monotonic)."""
        return self._load_acquire(_TAIL)

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

    # --- records in the data area ---------------------------------------------
    def _len_at(self, index: int) -> int:
        """Payload length of the record at ``index`` (checks its tag)."""
        n = length_at(self._data, index)
        if n < 0:
            raise self._corrupt(index, "no record header")
        return n

    def _corrupt(self, at: int, what: str) -> RingError:
        q = self._q
        return RingError(f"ring {self.name!r} is corrupt at index {at} (tail {q[_TAIL]}, head {q[_HEAD]}): {what}")

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
        # THE publish.  A release store: every byte this process stored before it -- the
        # records, and the arena bytes a record points at, written before the push -- is
        # visible to whoever loads this head (with an acquire load) before the head is.
        self._store_release(_HEAD, new_head)
        if wake_consumer:
            self._data_posted_for = wake(q, _CWAIT, self._data_posted_for, self._data_sem, _DATA_POSTS)
        q[_PUSHED] = pushed

    def _wait_space(self, need: int, timeout: float | None) -> bool:
        """Wait until ``need`` bytes are free; False on timeout."""
        q, cap, tail = self._q, self.capacity, self._load_acquire
        return sleep_until(
            q, lambda: cap - (q[_HEAD] - tail(_TAIL)) >= need, timeout, _PWAIT, _PSLEEPS, self._space_sem
        )

    def push(self, record, timeout: float | None = 0.0) -> bool:
        """Append one record; False if it did not fit within ``timeout`` seconds (0:
        don't wait, None: wait for ever).  Never overwrites unconsumed records."""
        if type(record) is not bytes:
            record = as_bytes_like(record)
        n = len(record)
        if n > self.max_record:
            raise self._too_large(n)
        need = n + RECORD_HEADER
        head = self._q[_HEAD]
        # an acquire load: the consumer's reads of the space it frees are done before we write
        if self.capacity - (head - self._load_acquire(_TAIL)) < need and not self._wait_space(need, timeout):
            return False
        if n <= _JOIN_MAX_AVG:
            write_at(self._data, head, header_of(n) + record, need)
        else:
            write_at(self._data, head, pack_header(RECORD_TAG, n), RECORD_HEADER)
            write_at(self._data, head + RECORD_HEADER, record, n)
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
        tail = self._load_acquire  # as in push
        head = q[_HEAD]
        if nbytes <= cap - (head - tail(_TAIL)):  # all fit: the common case
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
            stop = bisect_right(ends, ends[start] + cap - (head - tail(_TAIL)), start + 1) - 1
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
            write_at(self._data, head, frame(records, lens), nbytes)
        else:
            at = head
            for rec, n in zip(records, lens):
                write_at(self._data, at, pack_header(RECORD_TAG, n), RECORD_HEADER)
                write_at(self._data, at + RECORD_HEADER, rec, n)
                at += RECORD_HEADER + n

    # --- consumer side ----------------------------------------------------------
    def _wait_data(self, timeout: float | None) -> bool:
        """Wait until the ring holds a record; False on timeout."""
        q, head = self._q, self._load_acquire
        return sleep_until(q, lambda: head(_HEAD) != q[_TAIL], timeout, _CWAIT, _CSLEEPS, self._data_sem)

    def _release(self, tail: int, end: int, count: int) -> None:
        q = self._q
        popped = q[_PEND_POPPED] if tail == q[_PEND_TAIL] else q[_POPPED]
        if q[_POPPED] != popped:  # a predecessor died before its last counter store
            q[_POPPED] = popped
        popped += count
        q[_PEND_TAIL] = end
        q[_PEND_POPPED] = popped
        # One aligned 8-byte store, and a release: every read of that space is done
        # before the producer (loading tail with an acquire load) can write into it.
        self._store_release(_TAIL, end)
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

    def peek_batch(self, max_records: int = 1024, timeout: float | None = 0.0) -> tuple[list[bytes], int]:
        """Up to ``max_records`` oldest records, without consuming them, and the read
        index just after them (for ``release``); ``([], tail)`` on timeout.  Returns as
        soon as at least one record is there."""
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, not {max_records}")
        tail = self._q[_TAIL]
        if self._rd_at == tail:
            i = self._rd_i
            out = self._rd_recs[i : i + max_records]
            end = tail + RECORD_HEADER * len(out) + sum(map(len, out))
        else:
            # an acquire load: the records' bytes are read after it, so they are the ones
            # the producer stored before it published this head
            head = self._load_acquire(_HEAD)
            if head == tail:
                if timeout is not None and timeout <= 0 or not self._wait_data(timeout):
                    return [], tail
                head = self._load_acquire(_HEAD)
            out, nbytes = self._parse(tail, head - tail, max_records)
            end = tail + nbytes
        self._peeked = (tail, end, len(out))
        return out, end

    def _parse(self, tail: int, avail: int, max_records: int) -> tuple[list[bytes], int]:
        """Copy whole records out from ``tail`` (at most ``_PARSE_LIMIT`` bytes, at least
        one record) and split them; records past ``max_records`` are kept for later.
        Returns the first ``max_records`` of them and the bytes they span."""
        n = self._len_at(tail)
        first = RECORD_HEADER + n
        if first > avail:
            raise self._corrupt(tail, f"record of {n} bytes runs past head")
        if first >= _DIRECT or first == avail:
            return [read_at(self._data, tail + RECORD_HEADER, n)], first
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
        data = read_at(self._data, tail, limit)
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
        tail = self._q[_TAIL]
        if end == tail:
            return
        head = self._load_acquire(_HEAD)  # the headers counted below were stored before it
        if not tail < end <= head:
            raise RingError(
                f"release({end}) on ring {self.name!r} is outside the unconsumed range (tail {tail}, head {head})"
            )
        pk = self._peeked
        if pk is not None and pk[0] == tail and pk[1] == end:
            count = pk[2]
        else:
            count = self._count_records(tail, end)
        self._release(tail, end, count)

    def release_one(self) -> None:
        """Consume the oldest record (one ``peek_batch`` returned): for a consumer that
        gives records back one at a time, as it finishes each."""
        tail = self._q[_TAIL]
        if self._rd_at == tail:
            n = len(self._rd_recs[self._rd_i])
        else:
            head = self._load_acquire(_HEAD)  # its header was stored before it
            if head == tail:
                raise RingError(f"release_one() on ring {self.name!r}, which holds no record (tail {tail})")
            n = self._len_at(tail)
            if tail + RECORD_HEADER + n > head:
                raise self._corrupt(tail, f"record of {n} bytes runs past head")
        self._release(tail, tail + RECORD_HEADER + n, 1)

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
        self._words.release()  # it holds a view of _q
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
        return f"<Ring {self.name!r} capacity={self.capacity} head={self.head} tail={self.tail} depth={self.depth()}>"


def wait_any(rings: list, doorbell, timeout: float) -> bool:
    """Sleep until one of ``rings`` (all created with ``doorbell``) holds a record, or
    ``timeout`` seconds pass."""
    return _wait_any([r._q for r in rings], doorbell, timeout, _HEAD, _TAIL, _CWAIT)
