"""The round that runs stages, in one process or one stage per process.

Both modes run the same loop over the same stage objects; they differ in the
channel between stages and in how many stages one loop holds:

- `QueueChannel` (in-process): every stage in one loop; a record emitted is handled
  by its destination right away, in the order records were emitted.
- `RingChannel` (pipeline): one stage per process; records go out over one
  shared-memory ring per edge and come in from the rings that end here.

The order of a round is what makes a death at any instant safe in the pipeline:
  1. peek records from the input rings (they stay there until step 4),
  2. handle them: the stage takes custody (sets its bit) of what it keeps,
  3. push what it emitted to the output rings,
  4. release the input records, then clear the custody bits of rooms handed on.
A death before 4 leaves the inputs for the successor; rooms this stage had taken
are failed by the supervisor (their bit is set), so a record handled twice only
meets a room that is already concluded.
"""
from __future__ import annotations

import importlib
import logging
import os
import pickle
import queue
import sys
import threading
import time
from collections import deque
from typing import Callable

import zmq

from ipc.ring import Ring, wait_any
from ipc.transport import Engine
from ipc import wire
from pipeline.peers import curve
from pipeline.runtime import stage_settings, wiring
from stages import registry
from stages.base import Stage
from stages.records import UNHURRIED

log = logging.getLogger("epd.host")

FRAMES_PER_ROUND = 64  # socket frames a round takes, so timers and records interleave with a burst
PUSH_TIMEOUT_S = 1.0   # a full output ring is waited on in slices, beating the heart in between
READ_AHEAD_FRAMES = 1024  # frames a reader thread holds for its stage, at most


class Env:
    """What stages are built from: each stage's settings (mapped from the configuration,
    which the stages themselves never read), the run's shared objects, the
    towers' spec, and what only some stages use (each replica's tower, the Mooncake
    engine, a ZeroMQ context), made on first use. `spec` comes from a tower, built here
    or elsewhere; `tower`, if given, is the first replica's."""

    def __init__(self, cfg, run_id: str, shared: wiring.Shared, *, spec=None, tower=None, journal=None):
        self.cfg = cfg
        self.run_id = run_id
        self.shared = shared
        self.journal = journal
        self._spec = spec
        self._towers = {} if tower is None else {0: tower}
        self._engine = None
        self._ctx = None
        self._curve = None

    def tower(self, replica: int):
        """Tower replica `replica`'s tower, on its own GPU."""
        if replica not in self._towers:
            from stages.towers import build_tower

            self._towers[replica] = build_tower(self.cfg.tower, **self.cfg.replica_config(replica).tower_settings())
            set_torch_threads(self.cfg.tower_threads)
        return self._towers[replica]

    @property
    def spec(self):
        return self._spec if self._spec is not None else self.tower(0).spec

    @property
    def engine(self) -> Engine:
        """The Mooncake engine; the embedding arena is its writes' source (over TCP not
        registered, so no peer reads or writes it through Mooncake)."""
        if self._engine is None:
            cfg, arena = self.cfg, self.shared.emb_arena
            self._engine = Engine(cfg.hostname, cfg.protocol, cfg.device)
            self._engine.register_source(arena.address, arena.size)
        return self._engine

    @property
    def curve(self) -> curve.ServerKeys | None:
        """The worker's CurveZMQ key pair and the public keys it admits, when configured."""
        if self._curve is None and self.cfg.curve_cert:
            self._curve = curve.ServerKeys.load(self.cfg.curve_cert, self.cfg.curve_clients)
        return self._curve

    @property
    def curve_keypair(self) -> curve.KeyPair | None:
        """The worker's own CurveZMQ key pair (for the status sockets it connects), or None."""
        return self.curve.own if self.curve is not None else None

    @property
    def zmq_context(self) -> zmq.Context:
        if self._ctx is None:
            self._ctx = zmq.Context()
        return self._ctx

    def build(self, name: str, emit, custody) -> Stage:
        """Stage `name`, from its own settings (stage_settings.py), which is all of the
        configuration it sees."""
        module = importlib.import_module(registry.MODULES[registry.kind_of(name)])
        return module.build(self, stage_settings.settings_of(name, self.cfg), name, emit, custody)

    def close(self) -> None:
        """After the stages and their sockets are closed."""
        for tower in self._towers.values():
            tower.close()
        self._towers = {}
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._ctx is not None:
            curve.stop(self._ctx)  # its ZAP handler's socket, which term() would wait for
            self._ctx.term()
            self._ctx = None


class QueueChannel:
    """Records between stages of one process: handled by their destination at once."""

    has_rings = False

    def __init__(self):
        self.queue: deque = deque()
        self.stages: dict[str, Stage] = {}

    def emitter(self, source: str):
        q = self.queue
        return lambda dest, rec: q.append((dest, source, rec))

    def take(self, stage: Stage, settle) -> bool:
        return False  # records were handled when they were emitted

    def push(self) -> None:
        pass

    def deliver(self) -> None:
        q, stages = self.queue, self.stages
        while q:
            dest, source, rec = q.popleft()
            stages[dest].handle(source, rec)
            stages[dest].pushed()  # what it emitted is in the queue

    def pending(self) -> bool:
        return bool(self.queue)

    def wait(self, timeout: float) -> None:
        time.sleep(timeout)

    def close(self) -> None:
        pass


class RingChannel:
    """Records between stage processes: a ring per edge; `bell` wakes this stage's loop."""

    def __init__(self, inputs: dict[str, Ring], outputs: dict[str, Ring], bell, beat: Callable[[], None]):
        self.has_rings = bool(inputs)  # else the loop sleeps on its socket alone
        self.inputs = inputs
        self.outputs = outputs
        self.bell = bell
        self.beat = beat
        self.out_buf: dict[str, list[bytes]] = {dst: [] for dst in outputs}
        self.urgent: set[str] = set()  # destinations of this round's records that wake their consumer

    def emitter(self, source: str):
        out, urgent = self.out_buf, self.urgent

        def emit(dest: str, rec) -> None:
            out[dest].append(pickle.dumps(rec, protocol=5))
            if (dest, type(rec)) not in UNHURRIED:
                urgent.add(dest)
        return emit

    def take(self, stage: Stage, settle) -> bool:
        worked = False
        for src, ring in self.inputs.items():
            recs, end = ring.peek_batch(256)
            if not recs:
                continue
            worked = True
            if stage.settle_each_record:
                for raw in recs:
                    stage.handle(src, pickle.loads(raw))
                    settle(stage, ring.release_one)
                continue
            for raw in recs:
                stage.handle(src, pickle.loads(raw))
            settle(stage, lambda: ring.release(end))
        return worked

    def push(self) -> None:
        for dest, recs in self.out_buf.items():
            while recs:
                n = self.outputs[dest].push_batch(recs, timeout=PUSH_TIMEOUT_S, wake_consumer=dest in self.urgent)
                del recs[:n]
                if recs:
                    self.beat()
                    log.warning("ring to %s is full; waiting", dest)
        self.urgent.clear()

    def deliver(self) -> None:
        pass

    def pending(self) -> bool:
        return False

    def wait(self, timeout: float) -> None:
        wait_any(list(self.inputs.values()), self.bell, timeout)

    def close(self) -> None:
        for ring in list(self.inputs.values()) + list(self.outputs.values()):
            ring.close()


class FrameQueue:
    """Frames a reader thread took from a socket, waiting for the loop: at most
    `max_frames` of them and, but for the last one taken, `max_bytes`. While it is full
    the reader leaves the socket alone, whose own queue fills until its high-water mark
    pushes back on the peer."""

    def __init__(self, max_frames: int, max_bytes: int):
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.frames: deque = deque()
        self.bytes = 0
        self.changed = threading.Condition()

    def full(self) -> bool:
        return len(self.frames) >= self.max_frames or self.bytes >= self.max_bytes

    def put(self, frame: bytes) -> None:
        with self.changed:
            self.frames.append(frame)
            self.bytes += len(frame)

    def get_nowait(self) -> bytes:
        with self.changed:
            if not self.frames:
                raise queue.Empty
            was_full = self.full()
            frame = self.frames.popleft()
            self.bytes -= len(frame)
            if was_full:  # only then can the reader be waiting for room
                self.changed.notify()
            return frame

    def wait_for_room(self, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: not self.full(), timeout)


class Loop:
    """Rounds over `stages` joined by `channel`; each stage's socket bound here.

    A stage that reads both rings and a socket has the socket read by a thread of its
    own, which rings the bell: the loop sleeps on the rings' doorbell alone."""

    def __init__(self, stages: list[Stage], channel, ctx: zmq.Context, curve_keys: curve.ServerKeys | None = None):
        self.stages = stages
        self.channel = channel
        self.sockets: list[tuple[Stage, zmq.Socket]] = []
        # With CurveZMQ each frame goes to its stage with the key its peer authenticated with.
        self.keyed = curve_keys is not None
        self.frames: dict[Stage, FrameQueue] = {}  # frames read by a thread, per stage
        self.closing: set[Stage] = set()  # stages that read their socket until it is empty, then pause
        self.paused: set[Stage] = set()   # stages whose socket is left unread (after a drain began)
        self.idle_s = 0.0      # time spent waiting for work, for the busy ratio
        self._readers: list[threading.Thread] = []
        self._closing = threading.Event()
        try:
            for stage in stages:
                sock = stage.socket()
                if sock is None:
                    continue
                endpoint, max_frame = sock
                self.sockets.append((stage, wiring.bind_pull(ctx, endpoint, max_frame, curve_keys)))
            if channel.has_rings:
                for stage, sock in self.sockets:
                    _, max_frame = stage.socket()
                    # As much as the socket itself queues for a peer, in bytes.
                    self.frames[stage] = q = FrameQueue(READ_AHEAD_FRAMES, wiring.SOCKET_QUEUE_FRAMES * max_frame)
                    t = threading.Thread(target=self._read_socket, args=(sock, q), daemon=True)
                    t.start()
                    self._readers.append(t)
        except BaseException:
            self.close()
            raise

    def _read_socket(self, sock: zmq.Socket, frames: FrameQueue) -> None:
        while not self._closing.is_set():
            try:
                if not frames.wait_for_room(0.1) or not sock.poll(100):
                    continue
                while not frames.full():
                    frames.put(self._recv(sock))
                self.channel.bell.release()
            except zmq.Again:
                self.channel.bell.release()
            except zmq.ZMQError:
                return

    def _recv(self, sock: zmq.Socket) -> bytes | wire.KeyedFrame:
        if not self.keyed:
            return sock.recv(zmq.NOBLOCK)
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        return wire.KeyedFrame(frame.bytes, curve.peer_key(frame))

    # ------------------------------------------------------------ one round
    def step(self, max_wait: float) -> bool:
        """One round; waits up to `max_wait` for work when it found none. True if it found some."""
        worked = False
        for stage in self.stages:
            worked |= self.channel.take(stage, self.settle)
        for stage, sock in self.sockets:
            worked |= self._take_frames(stage, sock)
        now = time.monotonic()
        for stage in self.stages:
            stage.tick(now)
            self.settle(stage)
        if not worked:
            started = time.monotonic()
            self._wait(max_wait)
            self.idle_s += time.monotonic() - started
        return worked

    def settle(self, stage: Stage, release: Callable[[], None] | None = None) -> None:
        """After `stage` handled or ticked: push what it emitted, let it know, give back
        the input records it handled, then clear custody of what it handed on."""
        self.channel.push()
        stage.pushed()
        if release is not None:
            release()
        stage.custody.flush()
        self.channel.deliver()

    def _take_frames(self, stage: Stage, sock: zmq.Socket) -> bool:
        frames = self.frames.get(stage)
        took = False
        for _ in range(FRAMES_PER_ROUND):
            if stage in self.paused or not stage.takes_frames():
                break  # they wait, in the socket or in the reader's queue
            try:
                frame = frames.get_nowait() if frames is not None else self._recv(sock)
            except (queue.Empty, zmq.Again):
                if stage in self.closing:
                    self.closing.discard(stage)
                    self.paused.add(stage)
                break
            stage.handle("socket", frame)
            self.settle(stage)
            took = True
        return took

    def close_when_read(self, stage: Stage) -> None:
        """Read what is in `stage`'s socket now, then no more (a drain)."""
        self.paused.discard(stage)
        self.closing.add(stage)

    def read_to_the_end(self, stage: Stage) -> bool:
        """Whether `stage` has read its socket until it was empty, and handled it all."""
        return stage in self.paused and stage.takes_frames()

    def _wait(self, max_wait: float) -> None:
        now = time.monotonic()
        timeout = max_wait
        for stage in self.stages:
            left = stage.next_tick_in(now)
            if left is not None:
                timeout = min(timeout, left)
        if self.channel.pending() or timeout <= 0:
            return
        polled = [sock for stage, sock in self.sockets
                  if stage not in self.frames and stage not in self.paused and stage.takes_frames()]
        if timeout < 1e-3 or not (polled or self.channel.has_rings):
            # Work completes elsewhere (a device, Mooncake's threads): yield the core to it.
            time.sleep(timeout)
        elif polled:
            zmq.select(polled, [], [], timeout=timeout)
        else:
            self.channel.wait(timeout)

    def close(self) -> None:
        # The readers first: a ZeroMQ socket is not to be closed under a thread using it.
        self._closing.set()
        for t in self._readers:
            t.join(1.0)
        for _, sock in self.sockets:
            sock.close(linger=0)
        self.sockets = []


def set_torch_threads(threads: int) -> int:
    """Give torch's intra-op pool `threads`, or (0) one per CPU this process may run on;
    the count set, 0 when torch is not loaded (a tower without torch). Torch's own default
    is the host's cores, which oversubscribes a process pinned to fewer, or one that
    shares its cores with an inference engine."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    n = threads or len(os.sched_getaffinity(0))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
