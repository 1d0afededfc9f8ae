"""Runs one stage in its own process: rings in, rings out, a heartbeat, custody.

The order of a round is what makes a death at any instant safe:
  1. peek records from the input rings (they stay there until step 4),
  2. handle them: the stage takes custody (sets its bit) of what it keeps,
  3. push what it emitted to the output rings,
  4. release the input records, then clear the custody bits of rooms handed on.
A death before 4 leaves the inputs for the successor; rooms this stage had taken
are failed by the supervisor (their bit is set), so a record handled twice only
meets a room that is already concluded.
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time

from ipc import shm
from ipc.ring import RECORD_HEADER, Ring, wait_any
from pipeline import numa, wiring
from pipeline.config import WorkerConfig, setup_logging
from stages.base import TableCustody

log = logging.getLogger("epd.stage")

PUSH_TIMEOUT_S = 1.0


def doorbell_name(stage: str) -> str:
    return f"bell.{stage}"


class Heartbeats:
    """Per stage: pid, last beat (time.monotonic), ready flag, restarts, and the fraction of
    the last second its loop spent working. float64 in shared memory."""

    FIELDS = 5
    PID, BEAT, READY, RESTARTS, BUSY = range(5)

    def __init__(self, seg: shm.Segment):
        import numpy as np

        self.seg = seg
        self.table = np.frombuffer(seg.buf, dtype=np.float64).reshape(len(wiring.STAGES), self.FIELDS)

    @classmethod
    def create(cls, prefix: str, run_id: str) -> "Heartbeats":
        return cls(shm.Segment.create(shm.object_name(prefix, run_id, "heartbeats"),
                                      len(wiring.STAGES) * cls.FIELDS * 8))

    @classmethod
    def attach(cls, prefix: str, run_id: str) -> "Heartbeats":
        return cls(shm.Segment.attach(shm.object_name(prefix, run_id, "heartbeats")))

    def row(self, stage: str):
        return self.table[wiring.STAGES.index(stage)]

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

    @classmethod
    def create(cls, prefix: str, run_id: str) -> "StatsBoard":
        return cls(shm.Segment.create(shm.object_name(prefix, run_id, "stats"),
                                      len(wiring.STAGES) * cls.REGION))

    @classmethod
    def attach(cls, prefix: str, run_id: str) -> "StatsBoard":
        return cls(shm.Segment.attach(shm.object_name(prefix, run_id, "stats")))

    def write(self, stage: str, stats: dict) -> None:
        data = pickle.dumps(stats, protocol=5)
        if len(data) > self.REGION - 16:
            return
        base = wiring.STAGES.index(stage) * self.REGION
        buf = self.seg.buf
        seq = int.from_bytes(buf[base:base + 8], "little") + 1
        buf[base:base + 8] = (seq | 1).to_bytes(8, "little")  # odd: being written
        buf[base + 16:base + 16 + len(data)] = data
        buf[base + 8:base + 16] = len(data).to_bytes(8, "little")
        buf[base:base + 8] = ((seq | 1) + 1).to_bytes(8, "little")

    def read(self, stage: str) -> dict:
        base = wiring.STAGES.index(stage) * self.REGION
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

    def read_all(self) -> dict:
        out = {}
        for stage in wiring.STAGES:
            out.update(self.read(stage))
        return out

    def close(self) -> None:
        self.seg.close()

    def unlink(self) -> None:
        self.seg.unlink()


def stage_process(name: str, cfg_kwargs: dict, run_id: str, spec_kwargs: dict | None, conn,
                  cpus: list[int] | None = None) -> None:
    """Entry point of a stage process (multiprocessing, spawn); `cpus`: its NUMA placement."""
    numa.pin(cpus)  # first: the threads this process starts (torch, zmq, Mooncake) inherit it
    cfg = WorkerConfig(**cfg_kwargs)
    setup_logging(cfg, name)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides
    try:
        host = StageHost(name, cfg, run_id, spec_kwargs)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    conn.send(("ready", host.spec_kwargs()))
    conn.close()
    try:
        host.run(stopping)
    finally:
        host.close()
        # Interpreter teardown resets Python's handlers to the default: a second SIGTERM
        # from the supervisor's stop would then end a stage that closed cleanly with -15.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the supervisor dies (Linux), besides the ppid check."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class StageHost:
    def __init__(self, name: str, cfg: WorkerConfig, run_id: str, spec_kwargs: dict | None):
        import zmq

        self.name = name
        self.cfg = cfg
        self.run_id = run_id
        self.parent = os.getppid()
        _die_with_parent()
        p = cfg.shm_prefix
        self.hb = Heartbeats.attach(p, run_id)
        self.row = self.hb.row(name)
        self.row[Heartbeats.PID] = os.getpid()
        self.row[Heartbeats.BEAT] = time.monotonic()
        self.shared = wiring.attach_shared(cfg, run_id)
        self.bell = shm.open_semaphore(shm.object_name(p, run_id, doorbell_name(name)))
        self.inputs = {src: Ring.attach(p, run_id, wiring.ring_name(src, name),
                                        doorbell=shm.object_name(p, run_id, doorbell_name(name)))
                       for src in wiring.inputs_of(name)}
        self.outputs = {dst: Ring.attach(p, run_id, wiring.ring_name(name, dst),
                                         doorbell=shm.object_name(p, run_id, doorbell_name(dst)))
                        for dst in wiring.outputs_of(name)}
        self.out_buf: dict[str, list[bytes]] = {dst: [] for dst in self.outputs}
        self.custody = TableCustody(self.shared.rooms, wiring.OWNERS[name])
        self.ctx = zmq.Context()
        self.sock = None
        self.socket_frames: queue.SimpleQueue | None = None
        self.tower = self.engine = self.journal = None
        if name == "tower":
            from stages.tower import build_tower

            self.tower = build_tower(cfg.tower, **cfg.tower_settings())
            self.spec = self.tower.spec
        else:
            from stages.tower import TowerSpec

            self.spec = TowerSpec(**spec_kwargs)
        if name == "sender":
            from ipc.transport import Engine

            self.engine = Engine(cfg.hostname, cfg.protocol, cfg.device)
            self.engine.register(self.shared.emb_arena.address, self.shared.emb_arena.size)
        if name == "intake":
            self.journal = IntakeJournal.attach(p, run_id)
        self.stage = wiring.build_stage(name, cfg, run_id, self.shared, self.spec, self._emit, self.custody,
                                        tower=self.tower, engine=self.engine, zmq_ctx=self.ctx,
                                        journal=self.journal.record if self.journal else None)
        if name == "reaper":
            self.stage.recover()
        if name == "tower":
            self._emit("scheduler", ("restarted",))  # credits for batches a predecessor held are gone
        if name == "intake":
            self.sock = wiring.bind_pull(self.ctx, cfg.intake, wiring.intake_max_frame(cfg))
        elif name == "sender":
            self.sock = wiring.bind_pull(self.ctx, cfg.bootstrap, wiring.BOOTSTRAP_MAX_FRAME)
            self.socket_frames = queue.SimpleQueue()
            threading.Thread(target=self._socket_reader, daemon=True).start()
        self.stats_board = StatsBoard.attach(p, run_id)
        self._stats_at = 0.0
        self._busy_window_at = time.monotonic()
        self._idle_s = 0.0  # time spent in _idle() since _busy_window_at
        self.row[Heartbeats.READY] = 1.0

    def spec_kwargs(self) -> dict:
        from dataclasses import asdict

        return asdict(self.spec)

    def _socket_reader(self) -> None:
        """The sender's bootstrap socket, read by this thread alone; wakes the loop."""
        import zmq

        while True:
            try:
                if not self.sock.poll(100):
                    continue
                while True:
                    self.socket_frames.put(self.sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                self.bell.release()
            except zmq.ZMQError:
                return

    def _emit(self, dest: str, rec) -> None:
        self.out_buf[dest].append(pickle.dumps(rec, protocol=5))

    def _push_outputs(self) -> None:
        for dest, recs in self.out_buf.items():
            while recs:
                n = self.outputs[dest].push_batch(recs, timeout=PUSH_TIMEOUT_S)
                del recs[:n]
                if recs:
                    self._beat()
                    log.warning("ring to %s is full; waiting", dest)

    def _beat(self) -> None:
        now = time.monotonic()
        self.row[Heartbeats.BEAT] = now
        if os.getppid() != self.parent:
            # The supervisor is gone (killed whole): nobody can restart or clean up after
            # us; the next start with this prefix sweeps the shared objects.
            os._exit(70)
        if now - self._stats_at > 0.05:
            self._stats_at = now
            self.stats_board.write(self.name, self.stage.stats())
        if now - self._busy_window_at >= 1.0:
            wall = now - self._busy_window_at
            self.row[Heartbeats.BUSY] = min(1.0, max(0.0, 1.0 - self._idle_s / wall))
            self._busy_window_at, self._idle_s = now, 0.0

    def run(self, stopping: threading.Event) -> None:
        import zmq

        stage, name = self.stage, self.name
        while not stopping.is_set():
            self._beat()
            worked = False
            for src, ring in self.inputs.items():
                recs, end = ring.peek_batch(256)
                if not recs:
                    continue
                worked = True
                if name == "reaper":
                    # What the reaper does for a record (a status sent) cannot be undone:
                    # consume records one by one, so a death repeats at most the one in hand.
                    self._one_by_one(src, ring, recs)
                    continue
                for raw in recs:
                    stage.handle(src, pickle.loads(raw))
                self._push_outputs()
                stage.pushed()
                ring.release(end)
                self.custody.flush()
            if self.socket_frames is not None:
                frames = []
                while True:
                    try:
                        frames.append(self.socket_frames.get_nowait())
                    except queue.Empty:
                        break
                for frame in frames:
                    stage.handle("socket", frame)
                worked = worked or bool(frames)
            elif name == "intake" and stage.accepting():
                for _ in range(64):
                    try:
                        frame = self.sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    worked = True
                    stage.handle("socket", frame)
                    if not stage.accepting():
                        break
            stage.tick(time.monotonic())
            self._push_outputs()
            stage.pushed()
            self.custody.flush()
            if worked:
                continue
            idle_from = time.monotonic()
            self._idle()
            self._idle_s += time.monotonic() - idle_from

    def _one_by_one(self, src: str, ring, recs: list) -> None:
        for raw in recs:
            self.stage.handle(src, pickle.loads(raw))
            self._push_outputs()
            self.stage.pushed()
            ring.release(ring.tail + RECORD_HEADER + len(raw))
            self.custody.flush()

    def _idle(self) -> None:
        """Sleep until there may be work: a record, a frame, a timer, a job."""
        stage = self.stage
        timeout = 0.1  # heartbeats and timers
        if stage.busy():
            left = stage.next_done_in() if hasattr(stage, "next_done_in") else None
            timeout = 1e-4 if left is None else min(timeout, left)
        if self.name == "intake":
            if stage.accepting():
                self.sock.poll(int(timeout * 1000) or 0)
            else:
                time.sleep(min(timeout, 0.001))
            return
        if timeout <= 1e-4:
            time.sleep(timeout)
            return
        wait_any(list(self.inputs.values()), self.bell, timeout)

    def close(self) -> None:
        try:
            self.stats_board.write(self.name, self.stage.stats())
            self.stats_board.close()
            self.stage.close()
        except Exception as e:
            log.warning("closing: %s", e)
        if self.sock is not None:
            self.sock.close(linger=0)
        if self.engine is not None:
            self.engine.close()
        self.ctx.term()
        for ring in list(self.inputs.values()) + list(self.outputs.values()):
            ring.close()
        sh = self.shared
        for obj in (sh.pixel_arena, sh.emb_arena, sh.rooms):
            obj.close()
        self.hb.close()
        if self.journal is not None:
            self.journal.close()
        self.bell.close()
        sys.stdout.flush()
