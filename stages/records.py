"""Records that move between stages. Small: pixels and rows stay in the arenas.

Owners: each stage holds arena references under its own owner number, so the
supervisor can reclaim exactly what a dead stage held.
"""
from __future__ import annotations

from dataclasses import dataclass

from ipc.arena import Lease

OWNER_SUPERVISOR, OWNER_INTAKE, OWNER_CACHE, OWNER_SCHEDULER, OWNER_TOWER, OWNER_SENDER, OWNER_REAPER = range(7)
STAGE_NAMES = {OWNER_INTAKE: "intake", OWNER_CACHE: "hash/cache", OWNER_SCHEDULER: "scheduler",
               OWNER_TOWER: "tower", OWNER_SENDER: "sender", OWNER_REAPER: "reaper"}
# In start order: a stage's consumers come after it only where a cycle forces otherwise.
STAGES = ["reaper", "sender", "tower", "scheduler", "cache", "intake"]


@dataclass
class RoomOpened:
    """Intake accepted a room: what the sender needs to check allocs and the reaper to time it."""
    slot: int
    room: int
    request_id: str
    spans: list[int]
    deadline: float  # time.monotonic() seconds; 0 = none


@dataclass
class WorkItem:
    """One vision item on its way to an embedding."""
    slot: int
    room: int
    item: int
    seq: int                 # arrival order, for FIFO scheduling
    modality: str
    grid_thw: list
    pixel_dtype: str
    n_patches: int
    patch_dim: int
    span: int
    pixels: Lease            # in the pixel arena
    client_hash: int | None = None
    key: tuple | None = None  # cache key, once hashed
    out: Lease | None = None  # in the embedding arena, once the scheduler reserved it


@dataclass
class ReadyItem:
    """An item's rows lie in the embedding arena; the sender holds one reference on `lease`."""
    slot: int
    room: int
    item: int
    span: int
    lease: Lease


@dataclass
class RoomFailure:
    """A stage found that a room cannot succeed; the reaper concludes it."""
    slot: int
    room: int
    reason: str
