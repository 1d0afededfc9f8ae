"""The tables a pipeline run keeps in shared memory besides rings, arenas and rooms:
each stage's heartbeat row, its published counters, and intake's journal of the
frame in hand. The supervisor creates them, a row or region per stage of the run;
stages attach, and find the run's stages from the size (stages.registry.replicas_of)."""
from __future__ import annotations

import pickle
import time
from enum import IntEnum

from ipc import shm
from stages import registry


class DrainOrder(IntEnum):
    """What the supervisor asks of the request stage at a drain, in the order a drain asks
    it: each order is a step past the one before, so a stage acts on one larger than the
    last it saw."""

    NONE = 0         # serving
    FINISH_READ = 1  # read what is in the socket now, do those requests, then read no more
    REFUSE = 2       # the same, but fail each of those requests instead of doing it


class Heartbeats:
    """Per stage: pid, last beat (time.monotonic), ready flag, restarts, the fraction of
    the last second its loop spent working, and the drain's handshake. float64 in shared memory."""

    FIELDS = 7
    PID, BEAT, READY, RESTARTS, BUSY, DRAIN_ORDER, DRAIN_DONE = range(7)
    # DRAIN_ORDER is the supervisor's ask of the request stage (a DrainOrder); DRAIN_DONE
    # the stage's answer, the order it carried out once it read its socket to the end.

    def __init__(self, seg: shm.Segment):
        import numpy as np

        self.seg = seg
        rows = seg.size // (self.FIELDS * 8)
        self.stages = registry.stage_names(registry.replicas_of(rows))
        self.table = np.frombuffer(seg.buf, dtype=np.float64).reshape(rows, self.FIELDS)

    @classmethod
    def create(cls, prefix: str, run_id: str, stages: list[str]) -> "Heartbeats":
        return cls(shm.Segment.create(shm.object_name(prefix, run_id, "heartbeats"),
                                      len(stages) * cls.FIELDS * 8))

    @classmethod
    def attach(cls, prefix: str, run_id: str) -> "Heartbeats":
        return cls(shm.Segment.attach(shm.object_name(prefix, run_id, "heartbeats")))

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

    def close(self) -> None:
        self.table = None
        self.seg.close()

    def unlink(self) -> None:
        self.seg.unlink()


class IntakeJournal:
    """The segment names of the frame intake is handling, for the supervisor to unlink
    if intake dies between taking a frame and unlinking its segments."""

    SIZE = 64 << 10

    def __init__(self, seg: shm.Segment):
        self.seg = seg

    @classmethod
    def create(cls, prefix: str, run_id: str) -> "IntakeJournal":
        return cls(shm.Segment.create(shm.object_name(prefix, run_id, "intake.journal"), cls.SIZE))

    @classmethod
    def attach(cls, prefix: str, run_id: str) -> "IntakeJournal":
        return cls(shm.Segment.attach(shm.object_name(prefix, run_id, "intake.journal")))

    def record(self, room: int | None, names: list[str]) -> None:
        buf = self.seg.buf
        if room is None and not names:
            buf[:4] = b"\0\0\0\0"
            return
        # NUL separates: a segment name cannot hold one (a newline it may)
        data = "\0".join([str(room if room is not None else "")] + names).encode()[: self.SIZE - 4]
        buf[4:4 + len(data)] = data
        buf[:4] = len(data).to_bytes(4, "little")  # last: the names are whole when the length is set

    def read(self) -> tuple[int | None, list[str]]:
        """(room, segment names) of the frame in hand, or (None, [])."""
        n = int.from_bytes(self.seg.buf[:4], "little")
        if not n:
            return None, []
        room, *names = bytes(self.seg.buf[4:4 + n]).decode(errors="replace").split("\0")
        return (int(room) if room.isdigit() else None), names

    def close(self) -> None:
        self.seg.close()

    def unlink(self) -> None:
        self.seg.unlink()


class StatsBoard:
    """Each stage's counters (a pickled dict), rewritten by the stage a few times a second,
    read by the supervisor: `run.py status`, tests and benchmarks see them."""

    REGION = 64 << 10

    def __init__(self, seg: shm.Segment):
        self.seg = seg
        self.stages = registry.stage_names(registry.replicas_of(seg.size // self.REGION))

    @classmethod
    def create(cls, prefix: str, run_id: str, stages: list[str]) -> "StatsBoard":
        return cls(shm.Segment.create(shm.object_name(prefix, run_id, "stats"),
                                      len(stages) * cls.REGION))

    @classmethod
    def attach(cls, prefix: str, run_id: str) -> "StatsBoard":
        return cls(shm.Segment.attach(shm.object_name(prefix, run_id, "stats")))

    def write(self, stage: str, stats: dict) -> None:
        data = pickle.dumps(stats, protocol=5)
        if len(data) > self.REGION - 16:
            return
        base = self.stages.index(stage) * self.REGION
        buf = self.seg.buf
        seq = int.from_bytes(buf[base:base + 8], "little") + 1
        buf[base:base + 8] = (seq | 1).to_bytes(8, "little")  # odd: being written
        buf[base + 16:base + 16 + len(data)] = data
        buf[base + 8:base + 16] = len(data).to_bytes(8, "little")
        buf[base:base + 8] = ((seq | 1) + 1).to_bytes(8, "little")

    def read(self, stage: str) -> dict:
        base = self.stages.index(stage) * self.REGION
        buf = self.seg.buf
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

    def close(self) -> None:
        self.seg.close()

    def unlink(self) -> None:
        self.seg.unlink()
