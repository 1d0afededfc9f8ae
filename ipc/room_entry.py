"""What the room table answers: a room's state, its entry, and the table's one refusal."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["RoomEntry", "RoomState", "TableFull"]


class RoomState(enum.IntEnum):
    FREE = 0
    BOOTSTRAPPING = 1
    QUEUED = 2
    ENCODING = 3
    TRANSFERRING = 4
    SUCCESS = 5
    FAILED = 6


class TableFull(RuntimeError):
    """No FREE slot left in the room table."""


@dataclass(frozen=True)
class RoomEntry:
    slot: int
    room: int
    request_id: str
    state: RoomState
    holders: int  # custody bit mask, from the claims
    items_total: int
    items_done: int
    reason: str
    deadline: float
    created: float
    concluded: float
    keys: tuple[int, ...] = ()  # tags of the CurveZMQ keys it belongs to (ipc/rooms.py)

    @property
    def live(self) -> bool:
        return RoomState.FREE < self.state < RoomState.SUCCESS
