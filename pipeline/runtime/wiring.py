"""Who talks to whom, and the shared objects of a run.

Both modes use this: the in-process worker builds every stage and runs them in one
loop; the pipeline builds one stage per process and joins them with one ring per edge.
The records each edge carries are listed in stages/records.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ipc.arena import Arena
from ipc.held import HeldAllocs
from ipc.receivers import ReceiverTable
from ipc.rooms import RoomTable
from ipc.told import ToldTable
from pipeline.ops import numa
from pipeline.cli.config import WorkerConfig
from stages import registry
from stages.registry import CACHE, INTAKE, PREPROCESS, REAPER, SCHEDULER, SENDER, SUPERVISOR, TOWER


# (producer, consumer) between stage kinds; `edges()` gives each tower replica and each
# preprocess worker its own.
EDGES = [
    # A consumer takes its rings in this order each round. The supervisor's first: the
    # reaper must learn of a sender's death (RoomsLost) before it handles what the
    # successor sender answers (a Fenced that names only the receivers the successor
    # saw), or it tells only those and a receiver whose alloc died waits for ever.
    (SUPERVISOR, REAPER),
    # then items: they are on the critical path (the sender holds an item that
    # overtakes its room's RoomOpened until the room arrives)
    (INTAKE, CACHE), (INTAKE, SENDER), (INTAKE, REAPER),
    (CACHE, SCHEDULER), (CACHE, SENDER), (CACHE, REAPER), (CACHE, PREPROCESS),
    (PREPROCESS, SCHEDULER), (PREPROCESS, CACHE), (PREPROCESS, REAPER),
    (SCHEDULER, TOWER), (SCHEDULER, REAPER), (SCHEDULER, CACHE),
    (TOWER, SENDER), (TOWER, CACHE), (TOWER, SCHEDULER), (TOWER, REAPER),
    (SENDER, REAPER),
    (REAPER, SENDER), (REAPER, CACHE), (REAPER, SCHEDULER),
]


def edges(replicas: int, workers: int = 1) -> list[tuple[str, str]]:
    """(producer, consumer) with `replicas` towers and `workers` preprocess workers: one
    single-producer single-consumer ring each."""
    many = {TOWER: registry.tower_names(replicas), PREPROCESS: registry.preprocess_names(workers)}
    expand = lambda stage: many.get(stage, [stage])  # noqa: E731
    return [(p, c) for src, dst in EDGES for p in expand(src) for c in expand(dst)]


def inputs_of(stage: str, replicas: int, workers: int = 1) -> list[str]:
    return [p for p, c in edges(replicas, workers) if c == stage]


def outputs_of(stage: str, replicas: int, workers: int = 1) -> list[str]:
    return [c for p, c in edges(replicas, workers) if p == stage]


def supervisor_reader() -> str:
    """The one stage the supervisor's records (RoomsLost) go to, in either mode."""
    (reader,) = (c for p, c in EDGES if p == SUPERVISOR)
    return reader


def ring_name(producer: str, consumer: str) -> str:
    return f"ring.{producer}.{consumer}"


def doorbell_name(stage: str) -> str:
    return f"bell.{stage}"


@dataclass
class Shared:
    pixel_arena: Arena
    emb_arena: Arena
    rooms: RoomTable
    receivers: ReceiverTable  # registrations: written by the sender, read by it and the reaper
    told: ToldTable           # statuses the reaper recorded before it sent them
    held: HeldAllocs          # allocs the sender holds for rooms it has not seen yet

    def close(self) -> None:
        for obj in (self.pixel_arena, self.emb_arena, self.rooms, self.receivers, self.told, self.held):
            obj.close()


# Frames a socket of the worker queues for each connected peer (its receive high-water
# mark). ZeroMQ counts frames, not bytes, so this times the largest frame is what the
# queue may hold; once it is full, ZeroMQ stops reading the connection and the peer's
# own queue fills, until its send blocks (or says EAGAIN). A few frames keep a stage
# that reads promptly fed.
SOCKET_QUEUE_FRAMES = 4
# A ZeroMQ listener's idle bounds: a connection that has not finished its handshake
# (ZMTP, and CURVE's with certificates) this long after it opened is dropped, so raw
# TCP connections that say nothing cannot pile up; a peer that answers no heartbeat
# for HEARTBEAT_TIMEOUT_S (gone without a FIN) is dropped too.
HANDSHAKE_S = 10.0
HEARTBEAT_S = 10.0
HEARTBEAT_TIMEOUT_S = 30.0


def bound_listener(sock) -> None:
    """The idle bounds above, on a ZeroMQ socket that binds a listener."""
    import zmq

    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))


def bind_pull(ctx, endpoint: str, max_frame: int, curve_keys=None):
    """The worker's PULL socket at `endpoint` (intake or bootstrap); a CurveZMQ server
    that admits only `curve_keys.allowed` when they are given (pipeline/peers/curve.py).

    A frame over `max_frame` bytes makes ZeroMQ drop it and the peer's connection
    before it is buffered; at most SOCKET_QUEUE_FRAMES frames per peer wait in it, so
    a stage that stops reading pushes back on its peers. An ipc:// socket file is made
    0600 (a dead predecessor's is replaced)."""
    import zmq

    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, SOCKET_QUEUE_FRAMES)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    bound_listener(sock)
    if curve_keys is not None:
        from pipeline.peers import curve

        curve.serve(sock, curve_keys)
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
    if endpoint.startswith("ipc://"):
        try:
            os.unlink(endpoint[len("ipc://"):])
        except FileNotFoundError:
            pass


def room_capacity(cfg: WorkerConfig) -> int:
    return cfg.max_live_rooms + cfg.max_tombstones + 64


# Receivers told about one room, on average over the rooms remembered at once: a room
# has one per shard of its items, typically 1 to 8.
TOLD_PER_ROOM = 8


def told_capacity(cfg: WorkerConfig) -> int:
    return room_capacity(cfg) * TOLD_PER_ROOM


ARENA_BLOCK = 4096  # bytes of an arena block: a lease takes whole blocks, one at least
ARENA_OWNERS = 16


def arena_owners(cfg: WorkerConfig) -> int:
    """Owner slots of the arenas: 16, and more for preprocess workers past the first
    (their owner numbers, stages/registry.py, lie past 16)."""
    return max([ARENA_OWNERS] + [registry.owner_of(s) + 1 for s in registry.preprocess_names(cfg.preprocess_workers)])


def lease_slots(arena_bytes: int, in_flight: int) -> int:
    """Lease slots for an arena of `arena_bytes` that holds up to `in_flight` leases at
    once by the limits; never more than its blocks (each lease takes one at least), so
    where the limits allow more, the arena runs out of space before it runs out of
    slots. Either is waited for by the stage that leases."""
    return max(1, min(-(-arena_bytes // ARENA_BLOCK), in_flight, Arena.MAX_LEASES))


def pixel_leases(cfg: WorkerConfig) -> int:
    """Every item of every live room may hold pixels at once."""
    return lease_slots(cfg.pixel_arena_bytes, cfg.max_live_rooms * cfg.max_items_per_request)


def embedding_leases(cfg: WorkerConfig) -> int:
    """Every item of every live room may hold rows at once, beside the cached entries."""
    return lease_slots(cfg.embedding_arena_bytes, cfg.max_live_rooms * cfg.max_items_per_request
                       + cfg.arena_cache_bytes // ARENA_BLOCK)


def tables_bytes(cfg: WorkerConfig) -> int:
    """/dev/shm taken by the receiver, told and held-alloc tables and the arenas' lease
    tables (for the start-up check)."""
    arenas = sum(Arena.segment_size(-(-size // ARENA_BLOCK) * ARENA_BLOCK, ARENA_BLOCK, leases, arena_owners(cfg))
                 for size, leases in ((cfg.pixel_arena_bytes, pixel_leases(cfg)),
                                      (cfg.embedding_arena_bytes, embedding_leases(cfg))))
    return (ReceiverTable.size_of() + ToldTable.size_of(told_capacity(cfg), cfg.max_items_per_request)
            + HeldAllocs.size_of(cfg.max_held_allocs) + arenas)


def create_shared(cfg: WorkerConfig, run_id: str, own, placement: dict | None = None) -> Shared:
    """Create the arenas and the tables; `own(obj)` takes each for cleanup.

    With `placement` (stage -> CPUs), each arena is made on the CPUs of the stage that
    writes most into it: a page lands on the node of the CPU that first touches it
    (posix_fallocate, at creation). The embedding arena is cut in one slice per tower
    replica, each touched on its replica's CPUs."""
    placement = placement or {}
    p = cfg.shm_prefix
    with numa.first_touch(placement.get(INTAKE)):
        pixel_arena = own(Arena.create(p, run_id, "pixels", cfg.pixel_arena_bytes, block_size=ARENA_BLOCK,
                                       max_leases=pixel_leases(cfg), max_owners=arena_owners(cfg)))
    towers = registry.tower_names(cfg.tower_replicas)
    emb_arena = own(Arena.create(p, run_id, "emb", cfg.embedding_arena_bytes, block_size=ARENA_BLOCK,
                                 max_leases=embedding_leases(cfg), max_owners=arena_owners(cfg), slices=len(towers),
                                 touch=lambda k: numa.first_touch(placement.get(towers[k]))))
    return Shared(pixel_arena, emb_arena, own(RoomTable.create(p, run_id, "rooms", room_capacity(cfg))),
                  own(ReceiverTable.create(p, run_id, "receivers")),
                  own(ToldTable.create(p, run_id, "told", told_capacity(cfg), cfg.max_items_per_request)),
                  own(HeldAllocs.create(p, run_id, "held", cfg.max_held_allocs)))


def attach_shared(cfg: WorkerConfig, run_id: str) -> Shared:
    p = cfg.shm_prefix
    return Shared(Arena.attach(p, run_id, "pixels"), Arena.attach(p, run_id, "emb"),
                  RoomTable.attach(p, run_id, "rooms"), ReceiverTable.attach(p, run_id, "receivers"),
                  ToldTable.attach(p, run_id, "told"), HeldAllocs.attach(p, run_id, "held"))
