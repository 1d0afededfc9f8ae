"""Intake: validates `encode` messages, takes ownership of pixel segments, records rooms."""
from __future__ import annotations

import logging
import os
import queue
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass

from ipc import shm
from ipc.arena import Arena, Lease
from ipc.rooms import RoomState, RoomTable, TableFull
from ipc import wire
from ipc.stats import reason_class
from ipc.wire import ProtocolError
from stages.base import POLL_S, Stage
from stages.records import OWNER_INTAKE, RoomFailure, RoomOpened, WorkItem

log = logging.getLogger("epd.intake")

# A count scans the room table (135 us at the default 70k slots): every 10 ms it took
# 5 us per request at 2,400 requests/s. Between counts the estimate errs high by the
# requests accepted since, so near the limit every request counts again.
LIVE_RECOUNT_S = 0.05
READ_PIECE = 512 << 10  # pixels read and hashed at a time: fits a core's L2


# A segment its read found at most this large is closed in the handling thread:
# handing a descriptor to the closer thread costs about 25 us of CPU (a wake-up, the GIL
# changing hands twice), more than the close of a 75 KB segment (14 us), against 0.7 ms
# for a 4.8 MB one.
CLOSE_INLINE_BYTES = 128 << 10


class _Closer:
    """Closes taken segments' descriptors on a thread of its own: the last close of an
    unlinked segment frees its pages, about a third of intake's time per large image,
    and os.close releases the GIL while the kernel does it."""

    def __init__(self):
        self.fds: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.pid = 0

    def close(self, fd: int) -> None:
        if self.thread is None or self.pid != os.getpid():  # none yet, or inherited by a fork
            self.pid = os.getpid()
            self.thread = threading.Thread(target=self._run, name="segment-closer", daemon=True)
            self.thread.start()
        self.fds.put(fd)

    def _run(self) -> None:
        while True:
            fd = self.fds.get()
            try:
                os.close(fd)
            except OSError:
                pass


_closer = _Closer()


@dataclass
class IntakeResult:
    opened: RoomOpened | None = None
    items: list[WorkItem] | None = None
    failure: RoomFailure | None = None
    stalled: bool = False   # the pixel arena is full: hand the same frame back later


def segment_name_problem(prefix: str, name: str) -> str | None:
    """Why the worker will not open `name`, or None if it is a client segment it may take."""
    if len(name) > 255:
        return f"segment name {name[:80]!r}... is {len(name)} characters, longer than 255"
    if not name.startswith("/" + prefix):
        return f"segment {name[:80]!r} is outside the worker's shm prefix '/{prefix}'"
    rest = name[1:]
    if "/" in rest or "\0" in rest or rest in (".", ".."):
        return f"segment name {name[:80]!r} may not contain '/' or NUL"
    if rest.startswith("sem.") or shm.parse_name(rest) is not None:
        return f"segment {name[:80]!r} names one of the worker's own objects"
    return None


class Intake:
    def __init__(self, *, prefix: str, run_id: str, pixel_arena: Arena, rooms: RoomTable,
                 patch_dim: int, merge: int, row_bytes: int, emb_arena_bytes: int, max_items_per_request: int,
                 max_pixel_bytes_per_request: int, max_live_rooms: int, trust_client_hash: bool = False):
        self.prefix = prefix
        self.run_id = run_id
        self.pixel_arena = pixel_arena
        self.rooms = rooms
        self.patch_dim = patch_dim
        self.merge = merge
        self.row_bytes = row_bytes  # of one embedding row, main and deepstack
        self.emb_arena_bytes = emb_arena_bytes
        self.max_items = max_items_per_request
        self.max_pixel_bytes = max_pixel_bytes_per_request
        self.max_live_rooms = max_live_rooms
        self.trust_client_hash = trust_client_hash  # the cache keys such items by the client's hash
        # Live rooms, counted at most every LIVE_RECOUNT_S and when the count reaches the
        # limit (a count scans the whole table); rooms accepted since are added, rooms
        # concluded since are not, so it errs high and is exact wherever it refuses.
        self._live, self._live_at = 0, float("-inf")
        self.journal = None        # journal(room or None, segment names), set by a host that wants it
        self.refusing = ""         # why every request now fails at once (a drain's end), if it does
        self.dropped = Counter()   # reason -> messages dropped without a room to fail
        self.failed = Counter()    # reason kind -> rooms failed at intake
        self.requests = Counter()  # (accepted / rejected: room failed here / dropped, reason class)
        self._seq = 0
        self._logged = set()

    # ------------------------------------------------------------ helpers
    def _drop(self, reason: str) -> IntakeResult:
        wire.count_reason(self.dropped, reason.split(":")[0])
        self.requests[("dropped", reason_class(reason))] += 1
        self._log_once(f"dropped a message: {reason}")
        return IntakeResult()

    def _log_once(self, text: str) -> None:
        if text not in self._logged:
            if len(self._logged) >= 1000:  # hostile clients make every text new: stay bounded
                self._logged.clear()
            self._logged.add(text)
            log.warning(text)

    def segment_name_problem(self, name: str) -> str | None:
        return segment_name_problem(self.prefix, name)

    def _take_segments(self, msg: dict) -> dict[str, int | str]:
        """Open and unlink every acceptable segment the message names: name -> fd, or a reason."""
        taken: dict[str, int | str] = {}
        for name in wire.shm_names(msg):
            if name in taken:
                continue
            problem = self.segment_name_problem(name)
            if problem:
                taken[name] = problem
                continue
            path = os.path.join(shm.SHM_DIR, name[1:])
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                taken[name] = f"segment {name!r} does not exist"
                continue
            except OSError as e:
                taken[name] = f"segment {name!r} cannot be opened: {e.strerror}"
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    os.close(fd)
                    taken[name] = f"segment {name!r} is not a regular segment of the worker's user"
                    continue
                os.unlink(path)
            except OSError:
                pass
            taken[name] = fd
        return taken

    # ------------------------------------------------------------ the work
    def handle(self, frame: bytes, arrival: float | None = None) -> IntakeResult:
        arrival = time.monotonic() if arrival is None else arrival
        try:
            msg = wire.decode(frame)
        except ProtocolError as e:
            return self._drop(str(e))
        room = wire.room_of(msg)
        if self.journal is not None:
            self.journal(room, wire.shm_names(msg))
        if room is None:
            # Nobody to answer, but the segments are still ours to remove.
            self._close(self._take_segments(msg))
            return self._drop("room cannot be read")
        rid = msg.get("request_id") if isinstance(msg.get("request_id"), str) else ""
        rid = rid[: wire.MAX_REQUEST_ID]
        if self.refusing:
            self._close(self._take_segments(msg))
            return self._fail_new_room(room, rid, self.refusing)

        try:
            req = wire.parse_encode(msg, self.max_items)
            spans = [wire.check_item_against_tower(i, it, self.patch_dim, self.merge)
                     for i, it in enumerate(req.items)]
            for i, span in enumerate(spans):
                if span * self.row_bytes > self.emb_arena_bytes:
                    # It could never be reserved: refused here rather than waited for forever.
                    raise ProtocolError(
                        f"item {i} needs {span * self.row_bytes} bytes of embedding ({span} rows of "
                        f"{self.row_bytes} bytes); the embedding arena holds {self.emb_arena_bytes} "
                        f"(embedding_arena_bytes)")
            total = sum(it.pixels.nbytes for it in req.items)
            if total > self.max_pixel_bytes:
                raise ProtocolError(
                    f"request has {total} pixel bytes; this worker takes at most "
                    f"{self.max_pixel_bytes} per request (max_pixel_bytes_per_request)")
            if total > self.pixel_arena.size:
                raise ProtocolError(
                    f"request has {total} pixel bytes; the pixel arena holds {self.pixel_arena.size}")
            if self._live >= self.max_live_rooms or arrival - self._live_at > LIVE_RECOUNT_S:
                self._live, self._live_at = self.rooms.count_live(), arrival
            if self._live >= self.max_live_rooms:
                raise ProtocolError(
                    f"worker is at its limit of {self.max_live_rooms} live rooms (max_live_rooms)")
        except ProtocolError as e:
            self._close(self._take_segments(msg))
            return self._fail_new_room(room, rid, str(e))

        # Space first: a full arena stalls the frame with its segments untouched.
        leases: list[Lease] = []
        for it in req.items:
            lease = self.pixel_arena.alloc(it.pixels.nbytes, OWNER_INTAKE)
            if lease is None:
                for taken in leases:
                    self.pixel_arena.drop(taken, OWNER_INTAKE)
                return IntakeResult(stalled=True)
            leases.append(lease)

        segments = self._take_segments(msg)
        hashes = []
        checked = None  # each segment's size, once every read has found it as the request says
        try:
            for it, lease in zip(req.items, leases):
                hasher = (None if self.trust_client_hash and it.hash is not None
                          else wire.content_hasher(it.modality, it.grid_thw, it.pixels.dtype))
                self._read_pixels(it.pixels, segments, lease, hasher)
                hashes.append(None if hasher is None else hasher.intdigest())
            checked = {it.pixels.shm: it.pixels.nbytes for it in req.items}
        except ProtocolError as e:
            for lease in leases:
                self.pixel_arena.drop(lease, OWNER_INTAKE)
            return self._fail_new_room(room, rid, str(e))
        finally:
            self._close(segments, checked)

        deadline = arrival + req.deadline_ms / 1000.0 if req.deadline_ms else 0.0
        try:
            slot = self.rooms.insert(room, req.request_id, len(req.items), 1 << OWNER_INTAKE,
                                     deadline=deadline, state=RoomState.BOOTSTRAPPING)
        except TableFull as e:
            for lease in leases:
                self.pixel_arena.drop(lease, OWNER_INTAKE)
            return self._drop(f"room table full: {e}")
        except ValueError as e:  # the room is there already
            for lease in leases:
                self.pixel_arena.drop(lease, OWNER_INTAKE)
            return self._inserted_meanwhile(room, e)
        self._live += 1
        items = []
        for i, (it, sp, lease, h) in enumerate(zip(req.items, spans, leases, hashes)):
            self._seq += 1
            items.append(WorkItem(
                slot=slot, room=room, item=i, seq=self._seq, modality=it.modality,
                grid_thw=tuple(tuple(g) for g in it.grid_thw), pixel_dtype=it.pixels.dtype,
                n_patches=it.pixels.shape[0], patch_dim=it.pixels.shape[1], span=sp,
                pixels=lease, client_hash=it.hash, pixel_hash=h))
        self.requests[("accepted", "none")] += 1
        return IntakeResult(opened=RoomOpened(slot, room, req.request_id, tuple(spans), deadline),
                            items=items)

    @staticmethod
    def _close(segments: dict, nbytes: dict | None = None) -> None:
        """`nbytes`: each segment's size, as its read checked it; a segment whose size is not
        known so (a request refused, or a read that failed) goes to the closer thread."""
        for name, fd in segments.items():
            if not isinstance(fd, int):
                continue
            if nbytes is not None and nbytes.get(name, CLOSE_INLINE_BYTES + 1) <= CLOSE_INLINE_BYTES:
                try:
                    os.close(fd)
                except OSError:
                    pass
            else:
                _closer.close(fd)

    def _read_pixels(self, px: wire.PixelsRef, segments: dict, lease: Lease, hasher) -> None:
        """Into the lease, hashed piece by piece as each lands (`hasher`, if given): the
        bytes are read once, while they are in this core's cache, where hashing them in
        the cache stage read them again from memory."""
        view = self.pixel_arena.view(lease)
        if px.data is not None:
            view[:] = px.data
            if hasher is not None:
                hasher.update(view)
            return
        fd = segments[px.shm]
        if isinstance(fd, str):
            raise ProtocolError(fd)
        size = os.fstat(fd).st_size
        if size != px.nbytes:
            raise ProtocolError(
                f"segment {px.shm!r} holds {size} bytes; shape and dtype need {px.nbytes}")
        got = 0
        while got < px.nbytes:
            n = os.preadv(fd, [view[got:got + READ_PIECE]], got)
            if n <= 0:
                raise ProtocolError(f"segment {px.shm!r} shrank while it was read")
            if hasher is not None:
                hasher.update(view[got:got + n])
            got += n

    def _inserted_meanwhile(self, room: int, e: ValueError) -> IntakeResult:
        # A second message for a room, or one the reaper recorded when it failed it before
        # intake saw it (canceled while its allocs were held): the first one's stands.
        if self.rooms.find(room) is None:
            raise e
        return self._drop("duplicate room")

    def _fail_new_room(self, room: int, rid: str, reason: str) -> IntakeResult:
        try:
            slot = self.rooms.insert(room, rid or "?", 0, 1 << OWNER_INTAKE)
        except TableFull as e:
            return self._drop(f"room table full: {e}")
        except ValueError as e:
            return self._inserted_meanwhile(room, e)
        wire.count_reason(self.failed, reason.split(":")[0][:60])
        # One line per room would flood under overload; the reaper logs each failed room at INFO.
        log.debug("room failed at intake: room=%d request_id=%s reason=%s", room, rid, reason)
        self.requests[("rejected", reason_class(reason))] += 1
        return IntakeResult(failure=RoomFailure(slot, room, reason))


class IntakeStage(Stage):
    """Frames from the intake socket in; rooms to the reaper and sender, items to the cache.

    With a `journal` (the pipeline's), the room and segment names of the frame being
    handled are recorded in shared memory, so that the successor of an intake that died
    mid-frame unlinks the segments it was about to take and fails that room.
    """

    name = "intake"
    owner = OWNER_INTAKE

    def __init__(self, emit, intake: Intake, custody=None, *, endpoint: str = "", max_frame: int = 0,
                 journal=None):
        super().__init__(emit, custody)
        self.intake = intake
        self.endpoint = endpoint
        self.max_frame = max_frame
        self.journal = journal
        intake.journal = journal.record if journal is not None else None
        self.stalled: tuple[bytes, float] | None = None

    def socket(self) -> tuple[str, int] | None:
        return (self.endpoint, self.max_frame) if self.endpoint else None

    def takes_frames(self) -> bool:
        return self.stalled is None

    def start(self) -> None:
        if self.journal is None:
            return
        room, names = self.journal.read()
        for name in names:
            self._unlink_client_segment(name)
        self.journal.record(None, [])
        if room is not None and self.intake.rooms.find(room) is None:
            self.emit("reaper", RoomFailure(None, room, "the intake stage died while it held this room"))

    def _unlink_client_segment(self, name: str) -> None:
        """By the rules intake takes segments by: a name under the prefix, a regular file of ours."""
        if not name or self.intake.segment_name_problem(name) is not None:
            return
        path = os.path.join(shm.SHM_DIR, name[1:])
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)
        except FileNotFoundError:
            pass

    def refuse(self, reason: str) -> None:
        self.intake.refusing = reason

    def handle(self, source: str, frame) -> None:
        self._handle(frame, time.monotonic())

    def _handle(self, frame: bytes, arrival: float) -> None:
        res = self.intake.handle(frame, arrival)
        if res.stalled:
            self.stalled = (frame, arrival)
            return
        if res.failure is not None:
            self.emit("reaper", res.failure)
            self.custody.release(res.failure.slot, res.failure.room)
        elif res.opened is not None:
            o = res.opened
            self.emit("reaper", o)
            self.emit("sender", o)
            for w in res.items:
                self.emit("cache", w)
            self.intake.rooms.advance(o.slot, o.room, RoomState.QUEUED)
            self.custody.release(o.slot, o.room)
        if self.journal is not None:
            self.journal.record(None, [])

    def tick(self, now: float) -> None:
        if self.stalled is not None:
            frame, arrival = self.stalled
            self.stalled = None
            self._handle(frame, arrival)

    def next_tick_in(self, now: float) -> float | None:
        return POLL_S if self.stalled is not None else None  # until the pixel arena has room

    def stats(self) -> dict:
        return {"intake_dropped": dict(self.intake.dropped), "intake_failed": dict(self.intake.failed),
                "requests": dict(self.intake.requests)}


def build(env, name, emit, custody) -> IntakeStage:
    cfg, spec = env.cfg, env.spec
    intake = Intake(prefix=cfg.shm_prefix, run_id=env.run_id, pixel_arena=env.shared.pixel_arena,
                    rooms=env.shared.rooms, patch_dim=spec.patch_dim, merge=spec.merge,
                    row_bytes=spec.row_bytes, emb_arena_bytes=env.shared.emb_arena.size,
                    max_items_per_request=cfg.max_items_per_request,
                    max_pixel_bytes_per_request=cfg.max_pixel_bytes_per_request,
                    max_live_rooms=cfg.max_live_rooms, trust_client_hash=cfg.trust_client_hash)
    # Inline pixels of a whole request, and room for its item list.
    max_frame = cfg.max_pixel_bytes_per_request + (1 << 20) + 4096 * cfg.max_items_per_request
    return IntakeStage(emit, intake, custody, endpoint=cfg.intake, max_frame=max_frame,
                       journal=env.journal)
