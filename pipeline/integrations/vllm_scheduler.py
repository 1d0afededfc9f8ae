"""EPDConnector's scheduler side, in vLLM's engine core (pipeline/integrations/vllm.py):
the settings both sides read, each request's room, the allocs, the wait on statuses and
the release of the receive buffer.

A `Receiver` whose receive buffer is a segment in /dev/shm. The first time the
scheduler asks about a request it sends an `alloc` per item (span: vLLM's own count of
the item's embeddings; hidden size and dtype: the model's), then holds the request back
until every item's `success`, or hands it to vLLM as an error when the room fails or its
deadline passes. A room whose items vLLM already holds (its prefix cache, its own
encoder cache) is canceled instead.
"""
from __future__ import annotations

import inspect
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipc import shm, wire
from pipeline.peers.receiver import Receiver, Shard
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata

log = logging.getLogger("epd.vllm")

SEGMENT_PREFIX = "epdvllm"  # /dev/shm/epdvllm-<run id>-rx; a sweep at start removes dead runs'
# An idle wait looks at vLLM's input queue this often: a request that comes meanwhile
# waits at most this long for the engine to take it.
IDLE_SLICE_MS = 5
_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}


@dataclass
class Load:
    """One item the worker side copies from the receive segment into the encoder cache."""
    identifier: str
    segment: str
    offset: int
    ds_offset: int
    rows: int
    hidden: int
    deepstack_width: int
    dtype: str


@dataclass
class EPDConnectorMetadata(ECConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


@dataclass
class Room:
    """A request's room, as the scheduler side tracks it."""
    request_id: str
    room: int
    worker: str
    deadline: float
    shards: dict[str, Shard]  # identifier -> the shard its rows land in
    n_items: int
    failed: str = ""
    ready: bool = False


@dataclass(frozen=True)
class Settings:
    workers: tuple[str, ...]  # bootstrap endpoints a request may name
    buffer_bytes: int
    deadline_s: float
    query_after_s: float
    idle_wait_s: float
    queue_spin_s: float | None  # vLLM's queue readers' spin after each read; None: vLLM's own
    hostname: str
    hidden: int
    deepstack_width: int
    dtype: str
    shm_prefix: str
    curve_cert: str | None   # CurveZMQ: this engine's .key_secret certificate
    worker_cert: str | None  # and the workers' public one

    @classmethod
    def of(cls, vllm_config) -> "Settings":
        ec = vllm_config.ec_transfer_config
        extra = dict(ec.ec_connector_extra_config or {})
        workers = extra.get("workers")
        if isinstance(workers, str):
            workers = [workers]
        if not workers or not all(isinstance(w, str) for w in workers):
            raise ValueError("EPDConnector: ec_connector_extra_config needs \"workers\": the bootstrap "
                             "endpoints of the encode workers requests may name")
        hf = vllm_config.model_config.hf_config
        vision = getattr(hf, "vision_config", None)
        hidden = int(getattr(vision, "out_hidden_size", 0) or hf.get_text_config().hidden_size)
        layers = len(getattr(vision, "deepstack_visual_indexes", None) or [])
        dtype = extra.get("dtype") or _TORCH_DTYPES.get(str(vllm_config.model_config.dtype), "bfloat16")
        if dtype not in wire.DTYPES:
            raise ValueError(f"EPDConnector: dtype {dtype!r} is not one of {sorted(wire.DTYPES)}")
        return cls(workers=tuple(workers),
                   buffer_bytes=int(extra.get("buffer_bytes", ec.ec_buffer_size)),
                   deadline_s=float(extra.get("deadline_s", 60.0)),
                   query_after_s=float(extra.get("query_after_s", 5.0)),
                   idle_wait_s=float(extra.get("idle_wait_s", 30.0)),
                   queue_spin_s=None if extra.get("queue_spin_s") is None else float(extra["queue_spin_s"]),
                   hostname=str(extra.get("hostname", "127.0.0.1")),
                   hidden=int(extra.get("hidden", hidden)),
                   deepstack_width=int(extra.get("deepstack_width", layers * hidden)),
                   dtype=dtype, shm_prefix=shm.check_prefix(str(extra.get("shm_prefix", SEGMENT_PREFIX))),
                   curve_cert=extra.get("curve_cert"), worker_cert=extra.get("worker_cert"))


def room_params(params: Any, workers: tuple[str, ...]) -> tuple[int, str, dict[str, int]]:
    """(room, worker, identifier -> item) of a request's ec_transfer_params; ValueError
    with the reason when they are not ours to follow."""
    if not isinstance(params, dict):
        raise ValueError("ec_transfer_params is not an object")
    room, worker, items = params.get("room"), params.get("worker"), params.get("items")
    if not wire.is_u64(room):
        raise ValueError(f"ec_transfer_params: room {str(room)[:40]!r} is not an unsigned 64-bit integer")
    if worker not in workers:
        raise ValueError(f"ec_transfer_params: worker {str(worker)[:80]!r} is not one of this engine's "
                         f"workers ({', '.join(workers)})")
    if (not isinstance(items, dict) or not items
            or not all(isinstance(k, str) and type(v) is int for k, v in items.items())
            or sorted(items.values()) != list(range(len(items)))):
        raise ValueError("ec_transfer_params: items must map each item's identifier to its index in the "
                         "room, 0 to n - 1 once each")
    return room, worker, items


def needed(request, num_computed_tokens: int) -> list:
    """The request's media whose placeholders vLLM has not computed yet."""
    return [f for f in request.mm_features if f.mm_position.offset + f.mm_position.length > num_computed_tokens]


def building_owner(*attrs: str) -> Any:
    """The first object up this thread's stack, not a connector, that has every one of
    `attrs`: vLLM's scheduler, or its engine core, while they build this connector."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and not isinstance(owner, ECConnectorBase) and all(hasattr(owner, a) for a in attrs):
            return owner
        frame = frame.f_back
    return None


def building_scheduler() -> Any:
    """The vLLM scheduler whose constructor is building this connector, or None.

    vLLM tells a connector of the encoder-cache entries it allocates and frees, but not
    of a hit in its own encoder cache, and an entry it evicts is reported only after the
    step; so the connector reads vLLM's encoder cache manager itself, from the scheduler
    that builds it (vllm/v1/core/sched/scheduler.py:200-204, which sets `ec_connector`
    just before)."""
    return building_owner("ec_connector")


class ConnectorScheduler:
    """The scheduler side (vLLM's engine core): rooms allocated, waited on and released."""

    def __init__(self, settings: Settings, vllm_config):
        self.settings = s = settings
        self.scheduler = building_scheduler()
        # vLLM's engine core (EngineCoreProc sets its input queue before it builds the
        # scheduler): an idle wait ends when a request comes in.
        self.engine_core = building_owner("input_queue")
        parallel = getattr(vllm_config, "parallel_config", None)
        self.data_parallel = getattr(parallel, "data_parallel_size", 1) > 1
        swept = shm.sweep(s.shm_prefix)
        if swept:
            log.info("EPDConnector: removed %d segments of dead engines: %s", len(swept), ", ".join(swept))
        self.lock = shm.RunLock(s.shm_prefix)
        self.segment = shm.Segment.create(shm.object_name(s.shm_prefix, self.lock.run_id, "rx"),
                                          s.buffer_bytes)
        buffer = np.frombuffer(self.segment.buf, dtype=np.uint8)
        self.receiver = Receiver(f"vllm-{socket.gethostname()}-{os.getpid()}-{self.lock.run_id}",
                                 list(s.workers), buffer=buffer, hostname=s.hostname,
                                 curve_cert=s.curve_cert, worker_cert=s.worker_cert,
                                 # A restarted worker has no registrations: each alloc
                                 # registers this engine itself, and a room that heard
                                 # nothing is asked about soon (the query registers first),
                                 # so a room the dead worker held fails at once ("unknown
                                 # room") rather than at deadline_s.
                                 self_describing=True, query_after_s=s.query_after_s)
        self.rooms: dict[str, Room] = {}          # request id -> its room
        # request id -> (room, worker, items) not allocated: vLLM's encoder cache holds its items
        self.deferred: dict[str, tuple[int, str, dict[str, int]]] = {}
        self.released: set[str] = set()           # request ids whose room was canceled unneeded
        self.room_owner: dict[int, str] = {}      # room -> request id
        self.ready: dict[str, set[str]] = {}      # identifier -> request ids whose rows for it are here
        self.unavailable: dict[str, str] = {}     # request id -> why its rows will not come
        self.draining: dict[int, float] = {}      # room canceled -> when we stop waiting for its status
        self.loads: list[Load] = []
        self.builds = 0                           # build_connector_meta calls so far
        self.releasing: dict[int, int] = {}       # room of a finished request -> the build that frees it

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        self.poll()
        rid = request.request_id
        room = self.rooms.get(rid)
        if room is None:
            if rid in self.unavailable:
                return False
            if not request.ec_transfer_params:
                return True  # not ours: vLLM encodes it
            if rid in self.released:
                return self._covered(request, num_computed_tokens)
            room = self._open(request, num_computed_tokens)
            if room is None:
                return rid not in self.unavailable
        if not room.ready and not room.failed:
            self._settle(room)
        return room.ready

    def _covered(self, request, num_computed_tokens: int) -> bool:
        """Whether vLLM still needs none of the rows of a request whose room was canceled
        (a preempted request recomputes its prompt, and vLLM may have evicted an item)."""
        cached = self.vllm_encoder_cache()
        if all(f.identifier in cached for f in needed(request, num_computed_tokens)):
            return True
        self._fail(request.request_id, "vLLM needs an item's rows again (the request was preempted and the "
                                        "item left vLLM's caches) after the room was canceled as unneeded")
        return False

    def vllm_encoder_cache(self):
        """The identifiers in vLLM's encoder cache now (read where vLLM schedules the
        request next, so that nothing evicts one in between)."""
        manager = getattr(self.scheduler, "encoder_cache_manager", None)
        return manager.cached if manager is not None else ()

    def _open(self, request, num_computed_tokens: int) -> Room | None:
        """Allocate a request's room; None when its rows are not needed (now or, while
        vLLM's encoder cache holds its items, yet) or it failed."""
        rid = request.request_id
        try:
            room_id, worker, items = self.deferred.get(rid) or self._params(request)
        except ValueError as e:
            self._fail(rid, str(e))
            return None
        items_needed = needed(request, num_computed_tokens)
        if not items_needed:
            # vLLM's prefix cache holds every item, or vLLM computed them from its own
            # encoder cache: the room is not needed.
            self.deferred.pop(rid, None)
            self.released.add(rid)
            self._give_up(request, room_id, worker, items)
            return None
        cached = self.vllm_encoder_cache()
        if all(f.identifier in cached for f in items_needed):
            # vLLM takes these from its own encoder cache; the room waits unallocated
            # until vLLM has computed them (then it is canceled), or allocates should
            # vLLM evict one first.
            self.deferred[rid] = (room_id, worker, items)
            return None
        self.deferred.pop(rid, None)
        s = self.settings
        room = Room(rid, room_id, worker, time.monotonic() + s.deadline_s, {}, len(items))
        try:
            for f in request.mm_features:
                same = next((sh for sh in room.shards.values() if sh.item == items[f.identifier]), None)
                room.shards[f.identifier] = same or self.receiver.alloc(
                    room_id, items[f.identifier], span=f.mm_position.get_num_embeds(), hidden=s.hidden,
                    dtype=s.dtype, deepstack_width=s.deepstack_width, worker=worker)
        except MemoryError as e:
            self._cancel(room_id, worker)
            self._fail(rid, f"room {room_id}: the connector's receive buffer is full ({e}); raise buffer_bytes")
            return None
        self.rooms[rid] = room
        self.room_owner[room_id] = rid
        return room

    def _params(self, request) -> tuple[int, str, dict[str, int]]:
        """A new request's room, worker and items, checked (ValueError with the reason)."""
        room_id, worker, items = room_params(request.ec_transfer_params, self.settings.workers)
        if (room_id in self.room_owner or room_id in self.draining or room_id in self.releasing
                or any(room_id == held[0] for held in self.deferred.values())):
            raise ValueError(f"room {room_id} is already in use by another request")
        named = {f.identifier for f in request.mm_features}
        if named != set(items):
            raise ValueError(f"ec_transfer_params: items name {sorted(items)[:4]} but the request's "
                             f"media are {sorted(named)[:4]}")
        return room_id, worker, items

    def _give_up(self, request, room: int, worker: str, items: dict[str, int]) -> None:
        """Cancel a room never allocated, and be answered. The worker answers only a
        room's receivers, and drops a cancel of a room it does not hold yet (its encode
        still on the way); so: a cancel (a room the worker holds fails now), allocs of no
        rows (the connector joins the room; no write can follow), and a cancel again (a
        room not seen yet: held with those allocs, it fails when its encode comes). The
        worker counts one of the two cancels as dropped."""
        s = self.settings
        self.receiver.route(room, worker)
        self.receiver.cancel(room)
        for f in request.mm_features:
            if (room, items[f.identifier]) not in self.receiver.shards:
                self.receiver.alloc(room, items[f.identifier], span=f.mm_position.get_num_embeds(),
                                    hidden=s.hidden, dtype=s.dtype, deepstack_width=s.deepstack_width,
                                    n_rows=0, worker=worker)
        self._cancel(room, worker)

    def _cancel(self, room: int, worker: str) -> None:
        """Give a room up that no request holds; its shards are released on the worker's
        answer (or after deadline_s without one)."""
        self.receiver.route(room, worker)
        self.receiver.cancel(room)
        self.draining[room] = time.monotonic() + self.settings.deadline_s

    def _settle(self, room: Room) -> None:
        """Mark a room ready, or failed (on its status or its deadline)."""
        rx = self.receiver
        if room.room in rx.failed:
            room.failed = rx.failed[room.room]
        elif rx.concluded(room.room, room.n_items):
            room.ready = True
            for identifier in room.shards:
                self.ready.setdefault(identifier, set()).add(room.request_id)
            return
        elif time.monotonic() > room.deadline:
            rx.cancel(room.room)
            room.failed = (f"no status from encode worker {room.worker} for room {room.room} within "
                           f"{self.settings.deadline_s:g} s (deadline_s)")
        if room.failed:
            self._fail(room.request_id, f"room {room.room}: {room.failed}")

    def _fail(self, request_id: str, reason: str) -> None:
        log.warning("EPDConnector: request %s fails: %s", request_id, reason)
        self.unavailable[request_id] = reason

    def poll(self) -> None:
        """Apply the statuses that came; release canceled rooms answered (or given up on)."""
        self.receiver.poll()
        now = time.monotonic()
        for room, until in list(self.draining.items()):
            answered = room in self.receiver.failed or room in self.receiver.early_failed
            if answered or now > until:
                if not answered:
                    log.warning("EPDConnector: room %d: no answer to its cancel; its buffer is reused", room)
                self._forget(room)
                del self.draining[room]

    def _forget(self, room: int) -> None:
        self.receiver.release(room)
        self.receiver.failed.pop(room, None)
        self.receiver.early_failed.pop(room, None)

    def take_unavailable_requests(self) -> set[str]:
        taken = set(self.unavailable)
        self.unavailable.clear()
        return taken

    def has_cache_item(self, identifier: str) -> bool:
        return bool(self.ready.get(identifier))

    def update_state_after_alloc(self, request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        owners = self.ready.get(identifier)
        if not owners:
            return
        rid = request.request_id if request.request_id in owners else next(iter(owners))
        sh = self.rooms[rid].shards[identifier]
        self.loads.append(Load(identifier, self.segment.name, sh.offset, sh.ds_offset, sh.n_rows,
                               sh.hidden, sh.deepstack_width, sh.dtype))

    def build_connector_meta(self, scheduler_output) -> EPDConnectorMetadata:
        self._idle_wait(scheduler_output)
        meta = EPDConnectorMetadata(self.loads)
        self.loads = []
        self.builds += 1
        for room, due in list(self.releasing.items()):
            if self.builds >= due:
                self._forget(room)
                del self.releasing[room]
        return meta

    def _idle_wait(self, scheduler_output) -> None:
        """Wait here while vLLM has nothing to run but requests waiting on their rooms:
        until a status comes, a room's deadline passes, or a request (or any call) comes
        to the engine; at most idle_wait_s.

        vLLM's engine core steps as long as its scheduler has requests
        (`vllm/v1/engine/core.py` has_work, :1534-1539), and a step that schedules nothing
        still goes through `execute_model` to the model runner, then sleeps only 1 ms
        (`_process_engine_step`, :1616-1617); the model runner busy-polls its
        shared-memory queue for a second after each step it reads
        (`distributed/device_communicators/shm_broadcast.py` wait, :207-208). A request
        held in WAITING_FOR_REMOTE_KVS, as KV connectors hold theirs, keeps `has_requests`
        true (`v1/core/sched/scheduler.py` :2823) and steps the same way. So the connector
        waits in the one scheduler call every step makes, only when it alone holds vLLM
        back (nothing scheduled, nothing finished to report, no request failed here), and
        only where it can see the engine's input queue (vLLM's engine core process) and
        no other engine steps in lockstep with this one (data parallel)."""
        inputs = getattr(self.engine_core, "input_queue", None)
        if (self.settings.idle_wait_s <= 0 or inputs is None or scheduler_output is None
                or getattr(scheduler_output, "total_num_scheduled_tokens", 1)
                or getattr(scheduler_output, "finished_req_ids", None) or self.unavailable
                or self.data_parallel):
            return
        waiting = [r for r in self.rooms.values() if not r.ready and not r.failed]
        if not waiting:
            return
        end = min([time.monotonic() + self.settings.idle_wait_s] + [r.deadline for r in waiting])
        # receiver.poll applies what comes and sends the queries due (query_after_s).
        while inputs.empty() and time.monotonic() < end:
            if self.receiver.poll(IDLE_SLICE_MS / 1000):
                return

    def request_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        self.unavailable.pop(request.request_id, None)
        self.released.discard(request.request_id)
        held = self.deferred.pop(request.request_id, None)
        if held is not None:
            self._give_up(request, *held)
        room = self.rooms.pop(request.request_id, None)
        if room is None:
            return False, None
        del self.room_owner[room.room]
        for identifier in room.shards:
            owners = self.ready.get(identifier)
            if owners is not None:
                owners.discard(room.request_id)
                if not owners:
                    del self.ready[identifier]
        if room.ready:
            # A step already scheduled may still copy these rows (vLLM schedules the next
            # step while one runs): the buffer is freed two steps on, never under a copy.
            self.releasing[room.room] = self.builds + 2
        elif room.room in self.receiver.failed:
            self._forget(room.room)
        else:
            # Aborted, or failed on its deadline: rows may still be written until the
            # worker answers the cancel.
            if not room.failed:
                self.receiver.cancel(room.room)
            self.draining[room.room] = time.monotonic() + self.settings.deadline_s
        return False, None

    def shutdown(self) -> None:
        if self.receiver is None:
            return
        for room in list(self.room_owner):
            self.receiver.cancel(room)
        for room, worker, _ in self.deferred.values():
            self._cancel(room, worker)
        self.receiver.close()
        self.receiver = None
        self.segment.close()
        self.segment.unlink()
        self.lock.release()
