"""Which stages exist, who talks to whom, and how each stage object is built.

Both hosts use this: the in-process worker builds every stage here and calls
them in one loop; the pipeline builds one stage per process and joins them with
one ring per edge.
"""
from __future__ import annotations

from dataclasses import dataclass

from ipc.arena import Arena
from ipc.rooms import RoomTable
from pipeline import numa
from pipeline.config import WorkerConfig
from stages.records import STAGES  # noqa: F401 (re-read by the hosts)
from stages.records import (OWNER_CACHE, OWNER_INTAKE, OWNER_REAPER, OWNER_SCHEDULER, OWNER_SENDER,
                            OWNER_TOWER)

OWNERS = {"intake": OWNER_INTAKE, "cache": OWNER_CACHE, "scheduler": OWNER_SCHEDULER,
          "tower": OWNER_TOWER, "sender": OWNER_SENDER, "reaper": OWNER_REAPER}

# (producer, consumer): one single-producer single-consumer ring each.
EDGES = [
    # items first: they are on the critical path (the sender holds an item that
    # overtakes its room's RoomOpened until the room arrives)
    ("intake", "cache"), ("intake", "sender"), ("intake", "reaper"),
    ("cache", "scheduler"), ("cache", "sender"), ("cache", "reaper"),
    ("scheduler", "tower"), ("scheduler", "reaper"),
    ("tower", "sender"), ("tower", "cache"), ("tower", "scheduler"), ("tower", "reaper"),
    ("sender", "reaper"),
    ("reaper", "sender"), ("reaper", "cache"), ("reaper", "scheduler"),
    ("supervisor", "reaper"),
]


def inputs_of(stage: str) -> list[str]:
    return [p for p, c in EDGES if c == stage]


def outputs_of(stage: str) -> list[str]:
    return [c for p, c in EDGES if p == stage]


def ring_name(producer: str, consumer: str) -> str:
    return f"ring.{producer}.{consumer}"


@dataclass
class Shared:
    pixel_arena: Arena
    emb_arena: Arena
    rooms: RoomTable


BOOTSTRAP_MAX_FRAME = 1 << 20  # register/alloc/cancel are a few hundred bytes


def bind_pull(ctx, endpoint: str, max_frame: int):
    """The worker's PULL socket at `endpoint` (intake or bootstrap).

    A frame over `max_frame` bytes makes ZeroMQ drop it and the peer's connection
    before it is buffered: no request can be that large, and a queue of 100,000 of
    them must stay bounded. An ipc:// socket file is made 0600 (a dead predecessor's
    is replaced)."""
    import os

    import zmq

    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 100000)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    unlink_ipc(endpoint)  # a dead predecessor's
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close()
        raise RuntimeError(f"cannot bind {endpoint}: {e}") from None
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://"):], 0o600)
    return sock


def unlink_ipc(endpoint: str) -> None:
    """Remove the socket file of an ipc:// endpoint, if there is one."""
    import os

    if endpoint.startswith("ipc://"):
        try:
            os.unlink(endpoint[len("ipc://"):])
        except FileNotFoundError:
            pass


def intake_max_frame(cfg: WorkerConfig) -> int:
    """Inline pixels of a whole request, and room for its item list."""
    return cfg.max_pixel_bytes_per_request + (1 << 20) + 4096 * cfg.max_items_per_request


def room_capacity(cfg: WorkerConfig) -> int:
    return cfg.max_live_rooms + cfg.max_tombstones + 64


def create_shared(cfg: WorkerConfig, run_id: str, own, placement: dict | None = None) -> Shared:
    """Create the arenas and the room table; `own(obj)` takes each for cleanup.

    With `placement` (stage -> CPUs), each arena is made on the CPUs of the stage that
    writes most into it: a page lands on the node of the CPU that first touches it
    (posix_fallocate, at creation)."""
    placement = placement or {}
    p = cfg.shm_prefix
    with numa.first_touch(placement.get("intake")):
        pixel_arena = own(Arena.create(p, run_id, "pixels", cfg.pixel_arena_bytes))
    with numa.first_touch(placement.get("tower")):
        emb_arena = own(Arena.create(p, run_id, "emb", cfg.embedding_arena_bytes))
    return Shared(pixel_arena, emb_arena, own(RoomTable.create(p, run_id, "rooms", room_capacity(cfg))))


def attach_shared(cfg: WorkerConfig, run_id: str) -> Shared:
    p = cfg.shm_prefix
    return Shared(Arena.attach(p, run_id, "pixels"), Arena.attach(p, run_id, "emb"),
                  RoomTable.attach(p, run_id, "rooms"))


def build_stage(name: str, cfg: WorkerConfig, run_id: str, sh: Shared, spec, emit, custody, *,
                tower=None, engine=None, zmq_ctx=None, journal=None):
    """The stage object `name`, wired to `emit(dest, record)`.

    The tower stage needs `tower`, the sender an `engine` that has the embedding
    arena registered, the reaper a `zmq_ctx` for status sockets.
    """
    if name == "intake":
        from stages.intake import Intake, IntakeStage

        intake = Intake(prefix=cfg.shm_prefix, run_id=run_id, pixel_arena=sh.pixel_arena,
                        rooms=sh.rooms, patch_dim=spec.patch_dim, merge=spec.merge,
                        max_items_per_request=cfg.max_items_per_request,
                        max_pixel_bytes_per_request=cfg.max_pixel_bytes_per_request,
                        max_live_rooms=cfg.max_live_rooms)
        return IntakeStage(emit, intake, custody, journal=journal)
    if name == "cache":
        from stages.embedding_cache import EmbeddingCache
        from stages.cache import CacheStage, HashCache

        cache = EmbeddingCache(sh.emb_arena, OWNER_CACHE, cfg.arena_cache_bytes, cfg.host_cache_bytes)
        hc = HashCache(pixel_arena=sh.pixel_arena, cache=cache, hidden=spec.hidden, dtype=spec.dtype,
                       trust_client_hash=cfg.trust_client_hash)
        return CacheStage(emit, hc, sh.emb_arena, custody)
    if name == "scheduler":
        from stages.scheduler import Scheduler, SchedulerStage

        return SchedulerStage(emit, Scheduler(cfg.max_tokens_per_batch, cfg.max_items_per_batch),
                              pixel_arena=sh.pixel_arena, emb_arena=sh.emb_arena,
                              entry_bytes=lambda span: span * spec.row_bytes, owner=OWNER_SCHEDULER,
                              prev_owner=OWNER_CACHE, custody=custody)
    if name == "tower":
        from stages.tower import TowerStage

        return TowerStage(emit, tower, pixel_arena=sh.pixel_arena, emb_arena=sh.emb_arena,
                          rooms=sh.rooms, owner=OWNER_TOWER, prev_owner=OWNER_SCHEDULER, custody=custody)
    if name == "sender":
        from stages.sender import Sender, SenderStage

        sender = Sender(arena=sh.emb_arena, engine=engine, rooms=sh.rooms, hidden=spec.hidden,
                        dtype=spec.dtype, deepstack_width=spec.deepstack_width,
                        bootstrap_timeout_s=cfg.bootstrap_timeout_s, max_held_allocs=cfg.max_held_allocs)
        return SenderStage(emit, sender, custody)
    if name == "reaper":
        from stages.reaper import ReaperStage, StatusPusher

        return ReaperStage(emit, rooms=sh.rooms, pusher=StatusPusher(zmq_ctx, cfg.status_hwm),
                           tombstone_ttl_s=cfg.tombstone_ttl_s, max_tombstones=cfg.max_tombstones,
                           custody=custody)
    raise ValueError(f"no stage named {name!r}")
