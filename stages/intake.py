"""Intake: validates `encode` messages, takes ownership of pixel segments, records rooms."""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import NamedTuple

from ipc import fetch, hashing, media_video, wire
from ipc.arena import Arena, ArenaFull, Lease
from ipc.fetch import AllowList
from ipc.rooms import RoomState, RoomTable, TableFull
from ipc.stats import ReasonCode, reason_class
from ipc.wire import ProtocolError
from stages import registry, segments
from stages.base import POLL_S, Stage
from stages.embedding_cache import cache_key
from stages.records import OWNER_INTAKE, RoomFailure, RoomOpened, WorkItem
from stages.settings import IntakeSettings

log = logging.getLogger("epd.intake")

# A count of live rooms scans the whole room table, too long to do for every request.
# Between counts the estimate errs high by the requests accepted since, so near the
# limit every request counts again.
LIVE_RECOUNT_S = 0.05
BUSY = "worker busy"  # what a request hears when the worker has no room for it now


class Request(NamedTuple):
    """A checked `encode` whose room is not open yet (its segments not yet taken)."""
    msg: dict
    req: wire.EncodeRequest
    spans: list[int]
    room: int
    rid: str
    arrival: float
    keys: tuple[int, ...]  # the room's key tags (ipc/rooms.py): none without CURVE


class IntakeStage(Stage):
    """Frames from the intake socket in; rooms to the reaper and sender, items to the cache.

    A request whose pixels the pixel arena has no room (or no free lease slot) for waits
    (`stalled`), checked once, its segments untouched, and no other frame is taken until it
    goes: the frames wait in the socket, whose high-water mark pushes back on the gateway.

    With a `journal` (the pipeline's), the room and segment names of the frame being
    handled are recorded in shared memory, so that the successor of an intake that died
    mid-frame unlinks the segments it was about to take and fails that room.
    """

    name = registry.INTAKE
    owner = OWNER_INTAKE

    def __init__(self, emit, *, prefix: str, pixel_arena: Arena, rooms: RoomTable, patch_dim: int, merge: int,
                 row_bytes: int, emb_arena_bytes: int, max_items_per_request: int,
                 max_pixel_bytes_per_request: int, max_live_rooms: int, trust_client_hash: bool = False,
                 custody=None, endpoint: str = "", max_frame: int = 0, journal=None,
                 content_key: bytes | None = None, image_pixels: tuple[int, int] = (56 * 56, 28 * 28 * 1280),
                 image_backend: str = "pil", url_hosts: AllowList | None = None,
                 video: tuple[int, int, float] = (128 * 28 * 28, 28 * 28 * 768, 2.0)):
        super().__init__(emit, custody)
        self.image_pixels = image_pixels  # compressed images' min_pixels and max_pixels where an item gives none
        self.video = video  # compressed videos' min_pixels, max_pixels and fps where an item gives none
        self.image_backend = image_backend  # whose processor's pixels the preprocess stage makes of them
        self.url_hosts = url_hosts or AllowList()  # http(s) media.url hosts (media_url_hosts): none, none taken
        # Pixels are hashed under the run's secret key (the cache keys items by it): no peer can compute a key.
        self.content_key = content_key if content_key is not None else hashing.new_cache_key()
        self.content_key_id = hashing.cache_key_id(self.content_key)
        self.prefix = prefix
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
        self.endpoint = endpoint
        self.max_frame = max_frame
        self.journal = journal
        self.stalled: Request | None = None
        # Live rooms, counted at most every LIVE_RECOUNT_S and when the count reaches the
        # limit (a count scans the whole table); rooms accepted since are added, rooms
        # concluded since are not, so it errs high and is exact wherever it refuses.
        self._live, self._live_at = 0, float("-inf")
        self.refusing = ""         # why every request now fails at once (a drain's end), if it does
        self.dropped = Counter()   # reason -> messages dropped without a room to fail
        self.failed = Counter()    # reason kind -> rooms failed at intake
        self.requests = Counter()  # (accepted / rejected: room failed here / dropped, reason class)
        self._seq = 0
        self._logged = set()

    # ------------------------------------------------------------ the stage's surface
    def socket(self) -> tuple[str, int] | None:
        return (self.endpoint, self.max_frame) if self.endpoint else None

    def takes_frames(self) -> bool:
        return self.stalled is None

    def start(self) -> None:
        if self.journal is None:
            return
        room, names = self.journal.read()
        for name in names:
            segments.unlink_left(self.prefix, name)
        self.journal.record(None, [])
        if room is not None and self.rooms.find(room) is None:
            self.emit(registry.REAPER, RoomFailure(None, room, "the intake stage died while it held this room",
                                                   ReasonCode.STAGE_DIED))

    def refuse(self, reason: str) -> None:
        self.refusing = reason

    def handle(self, source: str, frame) -> None:
        key = ""
        if isinstance(frame, wire.KeyedFrame):  # CurveZMQ admitted the gateway: its rooms are its key's
            frame, key = frame.data, frame.key
        self._handle(frame, time.monotonic(), key)

    def tick(self, now: float) -> None:
        if self.stalled is None:
            return
        request, self.stalled = self.stalled, None
        if self.refusing:
            # The drain's end: the request it waited with fails as every later one does.
            segments.close(segments.take(self.prefix, wire.shm_names(request.msg)))
            self._fail_new_room(request.room, request.rid, self.refusing, ReasonCode.SHUTDOWN, request.keys[:1])
            self._journal_done()
        else:
            self._try_open(request)

    def next_tick_in(self, now: float) -> float | None:
        return POLL_S if self.stalled is not None else None  # until the pixel arena has room

    def stats(self) -> dict:
        return {"intake_waiting": int(self.stalled is not None),
                "intake_dropped": dict(self.dropped), "intake_failed": dict(self.failed),
                "requests": dict(self.requests), "cache_key_id": self.content_key_id}

    # ------------------------------------------------------------ one frame
    def _handle(self, frame: bytes, arrival: float, key: str = "") -> None:
        request = self._take_frame(frame, arrival, key)
        if request is None:
            self._journal_done()
        else:
            self._try_open(request)

    def _try_open(self, request: Request) -> None:
        if not self._open_room(*request):
            # The journal keeps naming its room and segments: they are still to be taken.
            self.stalled = request
            return
        self._journal_done()

    def _journal_done(self) -> None:
        if self.journal is not None:
            self.journal.record(None, [])

    def _take_frame(self, frame: bytes, arrival: float, key: str) -> Request | None:
        """The frame's request, checked; None if the frame was dropped or its room failed."""
        try:
            msg = wire.decode(frame)
        except ProtocolError as e:
            self._drop(str(e))
            return None
        room = wire.room_of(msg)
        if self.journal is not None:
            self.journal.record(room, wire.shm_names(msg))
        if room is None:
            # Nobody to answer, but the segments are still ours to remove.
            segments.close(segments.take(self.prefix, wire.shm_names(msg)))
            self._drop("room cannot be read")
            return None
        if msg.get("type") not in ("encode", hashing.REFUSED):
            # Not a request: whoever sent it (a status pushed here, say) may not fail the
            # room it names, which a gateway may still send.
            segments.close(segments.take(self.prefix, wire.shm_names(msg)))
            self._drop(f"intake takes 'encode' messages only: not {str(msg.get('type'))[:40]!r}")
            return None
        rid = msg.get("request_id") if isinstance(msg.get("request_id"), str) else ""
        rid = rid[: wire.MAX_REQUEST_ID]
        # A failed room is its gateway's alone: the receivers it names may not be readable.
        gateway = (wire.key_tag(key),) if key else ()
        refused = hashing.refusal_reason(self.content_key, msg) if msg.get("type") == hashing.REFUSED else None
        if refused is not None:  # a front of this worker refused the room: its reason
            self._fail_new_room(room, rid, refused, ReasonCode.BAD_REQUEST, gateway)
            return None
        try:
            req, spans = self._check(msg, arrival)
        except ProtocolError as e:
            segments.close(segments.take(self.prefix, wire.shm_names(msg)))
            self._fail_new_room(room, rid, str(e), "", gateway)
            return None
        # Without CURVE nothing is anyone's: the receivers it names are not looked at.
        return Request(msg, req, spans, room, rid, arrival,
                       gateway + tuple(map(wire.key_tag, req.receivers)) if gateway else ())

    def _check(self, msg: dict, arrival: float) -> tuple[wire.EncodeRequest, list[int]]:
        """The request and each item's span; ProtocolError if this worker will not take it."""
        if self.refusing:
            raise ProtocolError(self.refusing)
        req = wire.parse_encode(msg, self.max_items)
        self._check_urls(req)
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
        return req, spans

    def _check_urls(self, req: wire.EncodeRequest) -> None:
        """An http(s) media.url's host must be allowed; only as written (no resolution
        here, in the one process that serves every gateway: the fetch checks addresses)."""
        for i, it in enumerate(req.items):
            url = it.pixels.media.url if it.pixels.media is not None else ""
            if not url:
                continue
            if not self.url_hosts:
                raise ProtocolError(f"item {i}: media.url is an http(s) URL, and this worker fetches no http(s) "
                                    f"URL (media_url_hosts is empty)")
            host = fetch.parse_url(url).host
            if not self.url_hosts.allows_host(host):
                raise ProtocolError(f"item {i}: media.url's host {host} is not one this worker fetches from "
                                    f"(media_url_hosts)")

    def _open_room(self, msg: dict, req: wire.EncodeRequest, spans: list[int], room: int, rid: str,
                   arrival: float, keys: tuple[int, ...]) -> bool:
        """Opens the room, or fails it; False: the pixel arena has no room for it now."""
        # Space first: a full arena stalls the request with its segments untouched.
        leases = self._alloc_pixels(req)
        if leases is None:
            return False
        deadline = arrival + req.deadline_ms / 1000.0 if req.deadline_ms else 0.0
        try:
            hashes = self._read_pixels(msg, req, leases)
            slot = self.rooms.insert(room, req.request_id, len(req.items), 1 << OWNER_INTAKE,
                                     deadline=deadline, state=RoomState.BOOTSTRAPPING, keys=keys)
        except (ProtocolError, TableFull, ValueError) as e:
            # Until the room is in the table the pixels are nobody's but ours.
            self._give_back(leases)
            if isinstance(e, ProtocolError):
                self._fail_new_room(room, rid, str(e), "", keys[:1])
            else:
                self._not_inserted(room, rid, e)
            return True
        self._live += 1
        self.requests[("accepted", "none")] += 1
        opened = RoomOpened(slot, room, req.request_id, tuple(spans), deadline)
        self.emit(registry.REAPER, opened)
        self.emit(registry.SENDER, opened)
        for i, (it, span, lease, h) in enumerate(zip(req.items, spans, leases, hashes)):
            self._seq += 1
            n_patches, patch_dim = it.pixels.shape
            if it.pixels.media is not None:  # the preprocess stage makes the patches, as float32
                n_patches, patch_dim = sum(t * gh * gw for t, gh, gw in it.grid_thw), self.patch_dim
            url = (it.pixels.media.url or None) if it.pixels.media is not None else None
            self.emit(registry.CACHE, WorkItem(
                slot=slot, room=room, item=i, seq=self._seq, modality=it.modality,
                grid_thw=tuple(tuple(g) for g in it.grid_thw), pixel_dtype=it.pixels.dtype,
                n_patches=n_patches, patch_dim=patch_dim, span=span,
                pixels=lease, client_hash=it.hash, pixel_hash=h, cache_salt=req.cache_salt,
                media=self._media(it.pixels.media), url=url))
        self.rooms.advance(slot, room, RoomState.QUEUED)
        self.custody.release(slot, room)
        return True

    def _alloc_pixels(self, req: wire.EncodeRequest) -> list[Lease | None] | None:
        """A lease in the pixel arena for each item, or None (and none taken) if it is full."""
        if not self.pixel_arena.room_for([it.pixels.nbytes for it in req.items if not _fetched(it)]):
            return None  # tried again at every tick while it waits: cheaply
        leases: list[Lease | None] = []
        for it in req.items:
            if _fetched(it):  # its bytes are the preprocess stage's to fetch, and lease
                leases.append(None)
                continue
            try:
                lease = self.pixel_arena.alloc(it.pixels.nbytes, OWNER_INTAKE)
            except ArenaFull:  # every lease slot is live: as short of room as no space, waited for alike
                lease = None
            if lease is None:
                self._give_back(leases)
                return None
            leases.append(lease)
        return leases

    def _give_back(self, leases: list[Lease | None]) -> None:
        for lease in leases:
            if lease is not None:
                self.pixel_arena.drop(lease, OWNER_INTAKE)

    def _read_pixels(self, msg: dict, req: wire.EncodeRequest, leases: list[Lease | None]) -> list[bytes | None]:
        """Each item's pixels into its lease, and their content hash (None where the cache
        keys the item by the client's hash). The segments are closed before it returns."""
        taken = segments.take(self.prefix, wire.shm_names(msg))
        checked = None  # each segment's size, once every read has found it as the request says
        try:
            hashes = [self._read_item(it, taken, lease) for it, lease in zip(req.items, leases)]
            checked = {it.pixels.shm: it.pixels.nbytes for it in req.items}
        finally:
            segments.close(taken, checked)
        return hashes

    def _media(self, m: wire.MediaRef | None) -> tuple | None:
        """A compressed item's WorkItem.media: its settings made the worker's where it gives none
        (a video's min_frames and max_frames: vLLM's loader's, 4 and 768)."""
        if m is None:
            return None
        if m.format in wire.VIDEO_FORMATS:
            lo, hi, fps = self.video
            return (m.format, m.size, m.min_pixels or lo, m.max_pixels or hi, m.fps or fps,
                    m.min_frames or media_video.MIN_FRAMES, m.max_frames or media_video.MAX_FRAMES)
        return (m.format, m.size, m.min_pixels or self.image_pixels[0], m.max_pixels or self.image_pixels[1])

    def _read_item(self, it: wire.EncodeItem, taken: dict, lease: Lease | None) -> bytes | None:
        if lease is None:  # fetched and hashed by the preprocess stage
            return None
        # Hashed as it is read: the cache stage would read the bytes again from memory.
        # A compressed image's bytes are hashed with its settings (what else makes its
        # patches is the tower's, which the cache key names): a repeat skips the decode.
        kind = it.pixels.dtype
        if it.pixels.media is not None:
            kind = hashing.media_kind(self._media(it.pixels.media), self.image_backend)
        hasher = (None if self.trust_client_hash and it.hash is not None
                  else hashing.cache_hasher(self.content_key, it.modality, it.grid_thw, kind))
        view = self.pixel_arena.view(lease)
        if it.pixels.data is not None:
            view[:] = it.pixels.data
            if hasher is not None:
                hasher.update(view)
        else:
            segments.read_into(taken[it.pixels.shm], it.pixels, view, hasher)
        return None if hasher is None else hasher.digest()

    # ------------------------------------------------------------ a frame that opens no room
    def _fail_new_room(self, room: int, rid: str, reason: str, code: ReasonCode | str = "",
                       keys: tuple[int, ...] = ()) -> None:
        """`code` "": a protocol error, classed by its text (wire.ProtocolError carries none)."""
        try:
            slot = self.rooms.insert(room, rid or "?", 0, 1 << OWNER_INTAKE, keys=keys)
        except (TableFull, ValueError) as e:
            self._not_inserted(room, rid, e)
            return
        wire.count_reason(self.failed, reason.split(":")[0][:60])
        # One line per room would flood under overload; the reaper logs each failed room at INFO.
        log.debug("room failed at intake: room=%d request_id=%s reason=%s", room, rid, reason)
        self.requests[("rejected", reason_class(reason, code))] += 1
        self.emit(registry.REAPER, RoomFailure(slot, room, reason, code))
        self.custody.release(slot, room)

    def _not_inserted(self, room: int, rid: str, e: TableFull | ValueError) -> None:
        if isinstance(e, TableFull):
            # Answered, not dropped: the reaper tells the room's receivers, who would
            # otherwise wait for bootstrap_timeout_s to hear of a room nobody holds.
            reason = (f"{BUSY}: room table full ({self.rooms.capacity} rooms, live and concluded: "
                      f"max_live_rooms + max_tombstones); send it again later")
            wire.count_reason(self.failed, BUSY)
            self.requests[("rejected", ReasonCode.TABLE_FULL.value)] += 1
            self._log_once(f"room failed at intake: {reason}")
            log.debug("room failed at intake: room=%d request_id=%s reason=%s", room, rid, reason)
            self.emit(registry.REAPER, RoomFailure(None, room, reason, ReasonCode.TABLE_FULL))
        elif self.rooms.find(room) is None:
            raise e
        else:
            # A second message for a room, or one the reaper recorded when it failed it before
            # intake saw it (canceled while its allocs were held): the first one's stands.
            self._drop("duplicate room")

    def _drop(self, reason: str) -> None:
        wire.count_reason(self.dropped, reason.split(":")[0])
        self.requests[("dropped", reason_class(reason))] += 1
        self._log_once(f"dropped a message: {reason}")

    def _log_once(self, text: str) -> None:
        if text not in self._logged:
            if len(self._logged) >= 1000:  # hostile clients make every text new: stay bounded
                self._logged.clear()
            self._logged.add(text)
            log.warning(text)


def _fetched(it: wire.EncodeItem) -> bool:
    return it.pixels.media is not None and bool(it.pixels.media.url)


def build(env, settings: IntakeSettings, name, emit, custody) -> IntakeStage:
    s, spec = settings, env.spec
    # Inline pixels of a whole request, and room for its item list.
    max_frame = s.max_pixel_bytes_per_request + (1 << 20) + 4096 * s.max_items_per_request
    return IntakeStage(emit, prefix=s.shm_prefix, pixel_arena=env.shared.pixel_arena, rooms=env.shared.rooms,
                       patch_dim=spec.patch_dim, merge=spec.merge, row_bytes=spec.row_bytes,
                       emb_arena_bytes=env.shared.emb_arena.size,
                       max_items_per_request=s.max_items_per_request,
                       max_pixel_bytes_per_request=s.max_pixel_bytes_per_request,
                       max_live_rooms=s.max_live_rooms, trust_client_hash=s.trust_client_hash,
                       custody=custody, endpoint=s.endpoint, max_frame=max_frame, journal=env.journal,
                       content_key=cache_key(s.cache_key_file, s.shm_prefix, env.run_id),
                       image_pixels=(s.image_min_pixels, s.image_max_pixels), image_backend=s.image_backend,
                       url_hosts=AllowList(s.media_url_hosts),
                       video=(*media_video.default_pixels(s.tower, s.video_min_pixels, s.video_max_pixels),
                              s.video_fps))
