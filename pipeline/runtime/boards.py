"""The tables a pipeline run keeps in shared memory besides rings, arenas and rooms:
each stage's heartbeat row, its published counters, and intake's journal of the
frame in hand. Each is an ipc.shared_table.SharedTable: the supervisor creates them, a
row or region per stage of the run; stages attach, and find the run's stages from the
numbers of tower replicas and preprocess workers in the header."""
from __future__ import annotations

import pickle
import time
from enum import IntEnum

from ipc.shared_table import HEADER_BYTES, SharedTable
from stages import registry


def run_stages(towers: int, preprocessors: int) -> list[str]:
    """The stages of a run whose board has this geometry: a row or region for each."""
    if not (1 <= towers <= registry.MAX_TOWER_REPLICAS and 1 <= preprocessors <= registry.MAX_PREPROCESS_WORKERS):
        raise ValueError(f"a board of {towers} towers and {preprocessors} preprocess workers: not a run's stages")
    return registry.stage_names(towers, preprocessors)


class DrainOrder(IntEnum):
    """What the supervisor asks of the request stage at a drain, in the order a drain asks
    it: each order is a step past the one before, so a stage acts on one larger than the
    last it saw."""

    NONE = 0         # serving
    FINISH_READ = 1  # read what is in the socket now, do those requests, then read no more
    REFUSE = 2       # the same, but fail each of those requests instead of doing it


class Heartbeats(SharedTable):
    """Per stage: pid, last beat (time.monotonic), ready flag, restarts, the fraction of
    the last second its loop spent working, and the drain's handshake. float64 in shared memory."""

    MAGIC = 0x6862_6561_7400_0002  # layout 2: its stages by towers and preprocess workers
    KIND = "heartbeat table"
    GEOMETRY = ("towers", "preprocessors")
    FIELDS = 7
    PID, BEAT, READY, RESTARTS, BUSY, DRAIN_ORDER, DRAIN_DONE = range(7)
    # DRAIN_ORDER is the supervisor's ask of the request stage (a DrainOrder); DRAIN_DONE
    # the stage's answer, the order it carried out once it read its socket to the end.

    @classmethod
    def segment_size(cls, towers: int, preprocessors: int) -> int:
        return HEADER_BYTES + len(run_stages(towers, preprocessors)) * cls.FIELDS * 8

    @classmethod
    def create(cls, prefix: str, run_id: str, stages: list[str]) -> "Heartbeats":
        return super().create(prefix, run_id, "heartbeats", *registry.counts_of(stages))

    @classmethod
    def attach(cls, prefix: str, run_id: str, readonly: bool = False) -> "Heartbeats":
        return super().attach(prefix, run_id, "heartbeats", readonly)

    def __init__(self, segment):
        import numpy as np

        super().__init__(segment)
        self.stages = run_stages(self.towers, self.preprocessors)
        self.rows = len(self.stages)
        self.table = np.frombuffer(self.buf, dtype=np.float64, count=self.rows * self.FIELDS,
                                   offset=HEADER_BYTES).reshape(self.rows, self.FIELDS)

    def row(self, stage: str):
        return self.table[self.stages.index(stage)]

    def order_drain(self, stage: str, order: DrainOrder) -> None:
        self.row(stage)[self.DRAIN_ORDER] = order

    def drain_order(self, stage: str) -> DrainOrder:
        return DrainOrder(int(self.row(stage)[self.DRAIN_ORDER]))

    def report_drained(self, stage: str, order: DrainOrder) -> None:
        """`stage` has carried out `order` (NONE: forget a predecessor's answer)."""
        self.row(stage)[self.DRAIN_DONE] = order

    def drained(self, stage: str) -> bool:
        """Whether `stage` has carried out the drain order it was given last."""
        row = self.row(stage)
        return row[self.DRAIN_DONE] >= row[self.DRAIN_ORDER]


class IntakeJournal(SharedTable):
    """The segment names of the frame intake is handling, for the supervisor to unlink
    if intake dies between taking a frame and unlinking its segments."""

    MAGIC = 0x6A72_6E6C_0000_0001  # layout 1
    KIND = "intake journal"
    SIZE = 64 << 10  # the journal's capacity, bytes: a length word, then the names

    @classmethod
    def segment_size(cls, capacity: int) -> int:
        if capacity != cls.SIZE:
            raise ValueError(f"an intake journal holds {cls.SIZE} bytes, not {capacity}")
        return HEADER_BYTES + capacity

    @classmethod
    def create(cls, prefix: str, run_id: str) -> "IntakeJournal":
        return super().create(prefix, run_id, "intake.journal", cls.SIZE)

    @classmethod
    def attach(cls, prefix: str, run_id: str, readonly: bool = False) -> "IntakeJournal":
        return super().attach(prefix, run_id, "intake.journal", readonly)

    def __init__(self, segment):
        super().__init__(segment)
        self.journal = self.buf[HEADER_BYTES:HEADER_BYTES + self.capacity]

    def record(self, room: int | None, names: list[str]) -> None:
        buf = self.journal
        if room is None and not names:
            buf[:4] = b"\0\0\0\0"
            return
        # NUL separates: a segment name cannot hold one (a newline it may)
        data = "\0".join([str(room if room is not None else "")] + names).encode()[: self.capacity - 4]
        buf[4:4 + len(data)] = data
        buf[:4] = len(data).to_bytes(4, "little")  # last: the names are whole when the length is set

    def read(self) -> tuple[int | None, list[str]]:
        """(room, segment names) of the frame in hand, or (None, [])."""
        buf = self.journal
        n = int.from_bytes(buf[:4], "little")
        if not n:
            return None, []
        room, *names = bytes(buf[4:4 + n]).decode(errors="replace").split("\0")
        return (int(room) if room.isdigit() else None), names


class StatsBoard(SharedTable):
    """Each stage's counters (a pickled dict), rewritten by the stage a few times a second,
    read by the supervisor: `run.py status`, tests and benchmarks see them."""

    MAGIC = 0x7374_6174_7300_0002  # layout 2: its stages by towers and preprocess workers
    KIND = "stats board"
    GEOMETRY = ("towers", "preprocessors")
    REGION = 64 << 10

    @classmethod
    def segment_size(cls, towers: int, preprocessors: int) -> int:
        return HEADER_BYTES + len(run_stages(towers, preprocessors)) * cls.REGION

    @classmethod
    def create(cls, prefix: str, run_id: str, stages: list[str]) -> "StatsBoard":
        return super().create(prefix, run_id, "stats", *registry.counts_of(stages))

    @classmethod
    def attach(cls, prefix: str, run_id: str, readonly: bool = False) -> "StatsBoard":
        return super().attach(prefix, run_id, "stats", readonly)

    def __init__(self, segment):
        super().__init__(segment)
        self.stages = run_stages(self.towers, self.preprocessors)

    def write(self, stage: str, stats: dict) -> None:
        data = pickle.dumps(stats, protocol=5)
        if len(data) > self.REGION - 16:
            return
        base = HEADER_BYTES + self.stages.index(stage) * self.REGION
        buf = self.buf
        seq = int.from_bytes(buf[base:base + 8], "little") + 1
        buf[base:base + 8] = (seq | 1).to_bytes(8, "little")  # odd: being written
        buf[base + 16:base + 16 + len(data)] = data
        buf[base + 8:base + 16] = len(data).to_bytes(8, "little")
        buf[base:base + 8] = ((seq | 1) + 1).to_bytes(8, "little")

    def read(self, stage: str) -> dict:
        base = HEADER_BYTES + self.stages.index(stage) * self.REGION
        buf = self.buf
        for _ in range(100):
            seq = int.from_bytes(buf[base:base + 8], "little")
            if seq == 0:
                return {}
            if seq & 1:
                time.sleep(0.0005)
                continue
            n = int.from_bytes(buf[base + 8:base + 16], "little")
            data = bytes(buf[base + 16:base + 16 + n])
            if int.from_bytes(buf[base:base + 8], "little") == seq:
                try:
                    return pickle.loads(data)
                except Exception:
                    return {}
        return {}
