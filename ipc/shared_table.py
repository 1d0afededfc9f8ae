"""One base for the named tables a pipeline run keeps in shared memory.

A table is one segment named ``<prefix>-<run id>-<what>`` (``shm.object_name``), so
``shm.sweep`` takes it with the rest of its run's objects: a dead run's at the next
start, a run's own at its close. The segment begins with u64 header words::

    0           MAGIC: the kind of table and its layout version
    1 .. n      the geometry, the numbers its layout is computed from (GEOMETRY names
                them; each becomes an int attribute of the table: ``t.capacity``)
    n + 1       the segment's size for that geometry
    after that  the table's own words (counters, sequence words), up to the end of
                its header (HEADER_BYTES unless its layout gives it more)

A table class says what it is and how large::

    MAGIC                    a u64 of its own; a new layout gets a new one
    KIND                     its name in errors ("room table")
    GEOMETRY                 the names of its geometry words; ("capacity",) unless said
    segment_size(*geometry)  classmethod: the segment's bytes; ValueError when out of range
    format(buf, *geometry)   classmethod, optional: content other than zeros
    segment_name(prefix, run_id, what)
                             classmethod, optional: shm.object_name(prefix, run_id, what)

and gets::

    create(prefix, run_id, what, *geometry)
        the segment with its whole size reserved now (shm.Segment.create:
        posix_fallocate, zeroed, mode 0600), formatted, then its header written with
        the magic last, so that attach refuses a half-made table; closed and
        unlinked again when anything fails
    attach(prefix, run_id, what, readonly=False)
    Table(segment)           checks the header: shm.ShmError unless it is a whole table
                             of this kind and layout; sets ``segment`` and ``buf``
    close()                  drops every numpy array and releases every memoryview the
                             table holds as an attribute (so the mapping goes now, and a
                             use after close fails loudly), then the segment; ``closed``
    unlink()                 removes the name; mappings stay valid until closed
    with table: ...          closes it at the end
    create_segment(...), attach_segment(...)
                             the segment alone, for a table that keeps another segment
                             beside its own (the arena's data) and builds itself

A table with a signature of its own (a default capacity, a fixed name) defines
``create``/``attach`` and calls ``super()``'s. ``lay_out`` places a table's columns
after its header, each on a cache line. ``SlotTable`` is a SharedTable of slots each
published by a generation word.
"""

from __future__ import annotations

from operator import index as _index
from typing import Any, Self

import numpy as np

from . import shm

__all__ = ["HEADER_BYTES", "SharedTable", "SlotTable", "lay_out"]

HEADER_BYTES = 64
LINE = 64  # columns start on a cache line: two writers' columns never share one


def lay_out(columns, start: int = HEADER_BYTES) -> dict[str, int]:
    """Offsets of ``columns`` ((name, bytes), in order) from ``start``, each on a cache
    line of its own; ``"total"``: where the last one ends."""
    offsets, pos = {}, start
    for name, nbytes in columns:
        pos = (pos + LINE - 1) // LINE * LINE
        offsets[name] = pos
        pos += nbytes
    offsets["total"] = pos
    return offsets


class SharedTable:
    """A named table in shared memory: create, attach with the header checked, close, unlink."""

    MAGIC = 0
    KIND = "shared table"
    GEOMETRY: tuple[str, ...] = ("capacity",)

    # segment_size and format take each table's own geometry: typed as taking anything, so
    # that a table's (capacity) or (size, block_size, ...) overrides them.
    @classmethod
    def segment_size(cls, *geometry: Any, **_: Any) -> int:
        """The segment's bytes for ``geometry``; ValueError when out of range (each table says)."""
        raise NotImplementedError(f"a {cls.KIND} says its segment_size")

    @classmethod
    def format(cls, buf: memoryview, *geometry: Any, **_: Any) -> None:
        """Content other than zeros, written before the header (a table that needs it says so)."""

    @classmethod
    def segment_name(cls, prefix: str, run_id: str, what: str) -> str:
        return shm.object_name(prefix, run_id, what)

    @classmethod
    def create_segment(cls, prefix: str, run_id: str, what: str, *geometry: int) -> shm.Segment:
        geometry = tuple(_index(g) for g in geometry)
        if len(geometry) != len(cls.GEOMETRY):
            raise TypeError(f"a {cls.KIND} takes {len(cls.GEOMETRY)} numbers {cls.GEOMETRY}, not {geometry}")
        size = cls.segment_size(*geometry)
        seg = shm.Segment.create(cls.segment_name(prefix, run_id, what), size)
        try:
            cls.format(seg.buf, *geometry)
            words = seg.buf[: 8 * (len(geometry) + 2)].cast("Q")
            try:
                for k, value in enumerate(geometry + (size,), 1):
                    words[k] = value
                words[0] = cls.MAGIC  # last: attach refuses a half-made table
            finally:
                words.release()
            return seg
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def create(cls, prefix: str, run_id: str, what: str, *geometry: int) -> Self:
        seg = cls.create_segment(prefix, run_id, what, *geometry)
        try:
            return cls(seg)
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def attach_segment(cls, prefix: str, run_id: str, what: str, readonly: bool = False) -> shm.Segment:
        return shm.Segment.attach(cls.segment_name(prefix, run_id, what), readonly=readonly)

    @classmethod
    def attach(cls, prefix: str, run_id: str, what: str, readonly: bool = False) -> Self:
        seg = cls.attach_segment(prefix, run_id, what, readonly)
        try:
            return cls(seg)
        except BaseException:
            seg.close()
            raise

    def __init__(self, segment: shm.Segment):
        for name, value in zip(self.GEOMETRY, self.geometry_of(segment)):
            setattr(self, name, value)
        self.segment = segment
        self.buf = segment.buf
        self.closed = False

    @classmethod
    def geometry_of(cls, seg: shm.Segment) -> tuple[int, ...]:
        """The geometry in ``seg``'s header, once the header is checked: ShmError unless the
        segment holds a whole table of this kind and layout, as large as its header says."""
        n = len(cls.GEOMETRY)
        if seg.size < 8 * (n + 2):
            raise shm.ShmError(f"{seg.name!r} is too small to be a {cls.KIND}")
        words = seg.buf[: 8 * (n + 2)].cast("Q")
        magic, *geometry, size = words.tolist()
        words.release()
        if magic != cls.MAGIC:
            raise shm.ShmError(
                f"{seg.name!r} is not an initialised {cls.KIND} (bad magic: half-made, or another kind or layout)"
            )
        try:
            expected = cls.segment_size(*geometry)
        except ValueError:
            expected = None
        if expected != size:
            raise shm.ShmError(
                f"{seg.name!r} is not an initialised {cls.KIND} (its header's geometry "
                f"{dict(zip(cls.GEOMETRY, geometry))} and size {size} disagree)"
            )
        if seg.size < size:
            raise shm.ShmError(f"{cls.KIND} {seg.name!r} is smaller than its header says")
        return tuple(geometry)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        held = vars(self)
        for name, value in list(held.items()):
            if isinstance(value, np.ndarray):
                held[name] = None
        for value in held.values():
            if isinstance(value, memoryview):
                value.release()
        self.segment.close()

    def unlink(self) -> None:
        self.segment.unlink()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        geometry = ", ".join(f"{name}={getattr(self, name)}" for name in self.GEOMETRY)
        return f"{type(self).__name__}({self.segment.name!r}, {geometry})"


class SlotTable(SharedTable):
    """A SharedTable of ``capacity`` slots of SLOT_BYTES, each published by a u64
    generation (0 while free), for one writer: a slot is written while free, then
    published by one aligned 8-byte store of a generation higher than any before, so a
    writer killed at any instruction leaves every slot free or whole.

    A subclass says SLOT_BYTES and CAPACITY (the capacities allowed, both ends in). The
    table has ``generations`` (u64 per slot, numpy) and ``slots_at`` (where slot 0
    begins; slot ``k`` is SLOT_BYTES further on per step)."""

    SLOT_BYTES = 64
    CAPACITY = (1, 2**28)
    capacity: int  # its geometry (SharedTable.__init__ sets it from the header)

    @classmethod
    def layout(cls, capacity: int) -> dict[str, int]:
        """Header, generations u64[capacity], slots."""
        return lay_out((("generations", 8 * capacity), ("slots", cls.SLOT_BYTES * capacity)))

    @classmethod
    def segment_size(cls, capacity: int) -> int:
        lo, hi = cls.CAPACITY
        if not lo <= capacity <= hi:
            raise ValueError(f"{cls.KIND} capacity {capacity} must be {lo}..{hi}")
        return cls.layout(capacity)["total"]

    size_of = segment_size  # the name the start-up check calls

    def __init__(self, seg: shm.Segment):
        super().__init__(seg)
        lay = self.layout(self.capacity)
        self.slots_at = lay["slots"]
        self.generations = np.frombuffer(seg.mapped, np.uint64, self.capacity, lay["generations"])

    def next_generation(self) -> int:
        """One more than the highest generation in the table: where a writer starts."""
        return int(self.generations.max()) + 1
