"""A room's life at the sender (stages/sender.py): one `RoomLife` per room it knows of,
in one container (`RoomLives`), its phase explicit (docs/design.md, "The sender's room
life").

    (new) ─alloc held, item early─> WAITING ─RoomOpened─> OPENING ─handled─> OPEN <─> WRITING
    WAITING ─fence─> FENCED        OPENING, OPEN, WRITING ─fail─> FAILING ─writes end─> FENCED
    OPEN, WRITING ─RoomSucceeded─> GONE         WAITING, FENCED with nothing left ─> GONE

A transition checks the phase it leaves: one its phase does not allow is a bug, which the
life logs and names (`fault`) and returns False for, so that the sender fails the room
saying so instead of raising out of its loop.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from ipc.wire import Alloc
from stages.records import ReadyItem

log = logging.getLogger("epd.sender")


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


class Phase(enum.Enum):
    WAITING = "waiting"  # not opened here: allocs held for it, items that overtook its RoomOpened
    OPENING = "opening"  # its RoomOpened being handled (held allocs, early items taken in): not in custody yet
    OPEN = "open"        # in custody: allocs and items meet, writes start; none in flight
    WRITING = "writing"  # open, writes in flight
    FAILING = "failing"  # fenced, writes in flight: none starts, it concludes when the last ends
    FENCED = "fenced"    # concluded, or fenced before it opened: a later alloc is answered, and
    #                      a RoomOpened that trails its fence does not open it
    GONE = "gone"        # succeeded, or nothing of it left: out of the container


W, OPENING, OPEN, WRITING, FAILING, FENCED, GONE = Phase
LIVE = frozenset({OPENING, OPEN, WRITING, FAILING})  # opened here, not concluded
UNOPENED = frozenset({W, FENCED})


class RoomLife:
    """What the sender keeps of one room, whatever its phase."""

    __slots__ = ("room", "lives", "phase", "held", "early", "fenced_at", "slot", "spans", "items",
                 "receivers", "writes", "done", "in_custody", "fault")

    def __init__(self, room: int, lives: RoomLives):
        self.room = room
        self.lives = lives
        self.phase = W
        self.held: list[tuple[float, Alloc, int]] = []  # (since, alloc, slot in the shared held table)
        self.early: list[ReadyItem] = []  # items that overtook its RoomOpened
        self.fenced_at: float | None = None  # when fenced while not open here (or concluded)
        # While open (LIVE):
        self.slot = -1
        self.spans: tuple[int, ...] = ()
        self.items: list[ItemTx] = []
        self.receivers: set[str] = set()
        self.writes: list[Write] = []
        self.done = 0  # items written to every receiver
        # Set when its RoomOpened's handling ends, so that a room failed while it opens is
        # never held (its items that came early are released instead).
        self.in_custody = False
        self.fault = ""  # the impossible transition asked of it, if one was

    @property
    def failing(self) -> bool:
        return self.phase is FAILING

    def _move(self, what: str, allowed, to: Phase) -> bool:
        if self.phase not in allowed:
            self.fault = f"sender: impossible transition of room {self.room}: {what} while {self.phase.value}"
            log.error("%s", self.fault)
            return False
        self.phase = to
        return True

    # ------------------------------------------------------------ not open here
    def hold(self, h: tuple[float, Alloc, int]) -> bool:
        """An alloc held for its RoomOpened (a fenced room's id may come back for a new room)."""
        if not self._move("hold an alloc", UNOPENED, W):
            return False
        self.held.append(h)
        self.lives.index(self)
        return True

    def keep_early(self, r: ReadyItem) -> bool:
        """An item that overtook its RoomOpened (after a fence too: the table may say live)."""
        if not self._move("keep an early item", UNOPENED, self.phase):
            return False
        self.early.append(r)
        self.lives.index(self)
        return True

    def take_held(self, receiver: str | None = None) -> list:
        """Its held allocs (or `receiver`'s), no longer held."""
        taken = [h for h in self.held if receiver is None or h[1].receiver == receiver]
        self.held = [h for h in self.held if h not in taken] if receiver is not None else []
        self.lives.index(self)
        return taken

    def keep_held(self, keep: list) -> None:
        """Of its held allocs, only `keep` (the others were answered)."""
        self.held = keep
        self.lives.index(self)

    def take_early(self) -> list[ReadyItem]:
        early, self.early = self.early, []
        self.lives.index(self)
        return early

    def fence_unopened(self, now: float) -> bool:
        """Fenced before its RoomOpened came, or again once concluded."""
        if not self._move("fence it unopened", UNOPENED, FENCED):
            return False
        self.lives.remember_fence(self, now)
        return True

    def forget_fence(self) -> float | None:
        """Its fence, no longer remembered (its RoomOpened came, or the bound was reached)."""
        fenced_at, self.fenced_at = self.fenced_at, None
        if self.phase is FENCED:
            self.phase = W
        self.lives.index(self)
        return fenced_at

    # ------------------------------------------------------------ open here
    def open(self, slot: int, spans) -> bool:
        if not self._move("open it", UNOPENED, OPENING):
            return False
        self.slot, self.spans = slot, tuple(spans)
        self.items = [ItemTx() for _ in self.spans]
        self.lives.index(self)
        return True

    def opened(self) -> bool:
        """Its RoomOpened handled: in custody from now on (failing too, if it failed meanwhile
        with writes in flight)."""
        if not self._move("end its opening", {OPENING} | ({FAILING} if not self.in_custody else set()),
                          FAILING if self.phase is FAILING else WRITING if self.writes else OPEN):
            return False
        self.in_custody = True
        return True

    def wrote(self, w: Write) -> bool:
        """A write started."""
        if not self._move("start a write", {OPENING, OPEN, WRITING}, OPENING if self.phase is OPENING else WRITING):
            return False
        self.writes.append(w)
        self.lives.index(self)
        return True

    def polled(self, still: list[Write]) -> None:
        """Its writes still in flight, the others collected."""
        self.writes = still
        if self.phase is WRITING and not still:
            self.phase = OPEN
        self.lives.index(self)

    def fail(self) -> bool:
        """Fenced: no new write starts."""
        return self._move("fail it", {OPENING, OPEN, WRITING}, FAILING)

    def conclude(self, now: float) -> bool:
        """Fenced, no write in flight: told, and remembered so that a later alloc is answered."""
        if not self._move("conclude its fence", {FAILING}, FENCED):
            return False
        self.items, self.receivers = [], set()
        self.lives.remember_fence(self, now)
        return True

    def succeed(self) -> bool:
        """It concluded Success: forgotten."""
        if not self._move("forget it succeeded", {OPEN, WRITING}, GONE):
            return False
        self.lives.index(self)
        return True


class RoomLives:
    """Every room the sender knows of, by id, and the indexes its periodic passes read
    (kept here, by each transition, in the order the rooms entered them)."""

    def __init__(self, max_fenced: int):
        self.max_fenced = max_fenced
        self.by_room: dict[int, RoomLife] = {}
        self.live: dict[int, None] = {}      # LIVE, in the order they opened
        self.writing: set[int] = set()       # with writes in flight
        self.holding: dict[int, None] = {}   # with allocs held
        self.waiting: dict[int, None] = {}   # with early items
        self.fenced: dict[int, None] = {}    # remembered fences, oldest first

    def get(self, room: int) -> RoomLife | None:
        return self.by_room.get(room)

    def life(self, room: int) -> RoomLife:
        """The room's life; a new one (WAITING, kept once it holds something) if none."""
        return self.by_room.get(room) or RoomLife(room, self)

    def live_one(self, room: int) -> RoomLife | None:
        life = self.by_room.get(room)
        return life if life is not None and life.phase in LIVE else None

    def phase(self, room: int) -> Phase:
        life = self.by_room.get(room)
        return life.phase if life is not None else GONE

    def n_early(self) -> int:
        return sum(len(self.by_room[r].early) for r in self.waiting)

    def remember_fence(self, life: RoomLife, now: float) -> None:
        life.fenced_at = now
        self.index(life)
        if len(self.fenced) > self.max_fenced:  # a RoomOpened trails its fence by a ring's length at most
            self.by_room[next(iter(self.fenced))].forget_fence()

    def index(self, life: RoomLife) -> None:
        room = life.room
        _member(self.live, room, life.phase in LIVE)
        _member(self.holding, room, bool(life.held))
        _member(self.waiting, room, bool(life.early))
        _member(self.fenced, room, life.fenced_at is not None)
        if life.writes and life.phase in LIVE:
            self.writing.add(room)
        else:
            self.writing.discard(room)
        if life.phase is W and not (life.held or life.early or life.fenced_at is not None):
            life.phase = GONE
        if life.phase is GONE:
            self.by_room.pop(room, None)
        elif self.by_room.get(room) is not life:
            self.by_room[room] = life


def _member(index: dict, room: int, yes: bool) -> None:
    if yes:
        index.setdefault(room, None)
    else:
        index.pop(room, None)
