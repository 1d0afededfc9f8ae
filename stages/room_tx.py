"""What the sender keeps of a room it holds: each item's allocs and rows, its writes in
flight (stages/sender.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ipc.wire import Alloc
from stages.records import ReadyItem


@dataclass
class Write:
    item: int
    receiver: str
    pending: object  # transport Pending
    started: float   # time.monotonic() at submit
    digest: bytes    # wire.rows_digest of the bytes it writes


@dataclass
class ItemTx:
    allocs: list[Alloc] = field(default_factory=list)
    fanout: int = 0
    ready: ReadyItem | None = None
    ready_at: float = 0.0
    started: bool = False
    writes_left: int = 0


@dataclass
class RoomTx:
    slot: int
    spans: tuple[int, ...]
    items: list[ItemTx]
    receivers: set[str] = field(default_factory=set)
    failing: bool = False
    writes: list[Write] = field(default_factory=list)
    done: int = 0  # items written to every receiver
    # Held in custody: from the end of its RoomOpened's handling, so that a room failed
    # while it opens is never held (its items that came early are released instead).
    in_custody: bool = False
