"""Every record that moves between stages, and who sends it to whom.

Records are small immutable values: pixels and rows stay in the arenas, a record
carries leases into them. A stage handles its records with `match`. The same
values travel through an in-memory queue (one process) or a shared-memory ring
(one process per stage, pickled). "supervisor" is the runtime around the stages
(the supervisor process, or the in-process worker's own loop); "tower" is every
tower replica (stages/registry.py), and a tower's records to the scheduler name it;
"preprocess" is every preprocess worker, and their records to the cache name it.

| record | from | to | carries |
| --- | --- | --- | --- |
| RoomOpened | intake | sender, reaper | an accepted room: its slot, request id, each item's span, deadline |
| WorkItem | intake | cache | one item: its pixels in the pixel arena, grid, dtype, span |
| WorkItem | cache | scheduler | a miss (its cache key set), to be encoded |
| WorkItem | cache | preprocess | a miss of a compressed image or video, to be decoded into patches |
| WorkItem | cache | preprocess | an image at an http(s) URL (no key yet), to be fetched |
| WorkItem | preprocess | cache | a fetched image: its bytes in the pixel arena and their keyed hash (`url` None), keyed and looked up as any compressed image |
| WorkItem | preprocess | scheduler | the same, its patches now in the pixel arena (`media` None) |
| EncodeFailed | preprocess | cache | a compressed image that does not decode, with the reason |
| PreprocessDone | preprocess | cache | one item left that worker (decoded, failed or lost): one fewer outstanding there |
| PreprocessRestarted | preprocess | cache | a new preprocess process: the cache may send that worker items again |
| PreprocessDown | preprocess | cache | the worker died (the supervisor writes it on the dead one's ring): its count of items outstanding is dropped, none sent to it until it is back |
| Batch | scheduler | tower | the items of one tower batch, output space reserved in the embedding arena, to the replica with the most credit |
| ReadyItem | tower | sender | a fresh item's rows in the embedding arena |
| ReadyItem | cache | sender | a cache hit's rows, or a waiter served by an identical item's encode |
| Encoded | tower | cache | the encoded item, so the cache keeps its rows and serves its waiters |
| EncodeFailed | tower | cache | the item the tower failed on, with the reason and the batch's rooms |
| TowerCredit | tower | scheduler | one batch finished: the scheduler may send that replica another |
| TowerRestarted | tower | scheduler | a new tower process: credits of batches its predecessor held are gone |
| TowerDown | tower | scheduler | the replica died (the supervisor writes it on the dead one's ring): no batches to it until it is back |
| SpaceWanted | scheduler | cache | the next batch finds no room in the embedding arena: give cached rows back |
| RoomFailure | intake | reaper | a request that broke a rule |
| RoomFailure | cache | reaper | pixels lost, or the tower failed on a room's item |
| RoomFailure | scheduler | reaper | pixels lost before scheduling |
| RoomFailure | preprocess | reaper | a compressed image's bytes lost before decoding, or a URL not fetched (the reason why) |
| RoomFailure | tower | reaper | pixels or output space lost |
| RoomFailure | sender | reaper | a bad alloc, a failed write, a cancel, a bootstrap timeout |
| Registered | sender | reaper | a receiver (re)registered (already in the receiver table): its status endpoint |
| AllocSeen | sender | reaper | a receiver's first alloc for a live room (it must hear how the room ends) |
| ShardWritten | sender | reaper | one receiver's rows of an item are written: tell it `success`, with their digest |
| ItemDone | sender | reaper | every shard of an item is written, and how many of the room's items are |
| Fenced | sender | reaper | no write for the room is in flight or can start: tell its receivers `failed` |
| LateAlloc | sender | reaper | an alloc for a room that is already concluded |
| UnknownRoom | sender | reaper | an alloc for a room never seen, timed out or refused; under CurveZMQ, an alloc, cancel or query for a room not its key's, answered as for a room never seen (stages/ownership.py) |
| Queried | sender | reaper | a receiver's `query` for a room: repeat what it was told |
| Fence | reaper | sender | the room failed: stop its writes and answer `Fenced` |
| RoomSucceeded | reaper | sender | the room succeeded: drop what is left of it |
| RoomAbandoned | reaper | cache, scheduler | the room failed: drop its items that wait |
| RoomsLost | supervisor | reaper | rooms a dead stage held (or live at a drain's end): fail them |
| IntakeRestarted | supervisor | reaper | a new intake process is ready: requests in its predecessor's socket are gone |
| IntakeRestarted | reaper | sender | the same: allocs held since before it for rooms never seen are answered soon |
"""

from __future__ import annotations

import copyreg
from dataclasses import dataclass, fields
from operator import attrgetter

from ipc.arena import Lease
from ipc.wire import Register

# Each stage holds arena references under its own owner number, and the same number
# is its custody bit in the room table, so the supervisor can reclaim exactly what a
# dead stage held and fail exactly its rooms.
# The stages' names: records are routed by these (stages/registry.py builds on them).
INTAKE, CACHE, SCHEDULER, TOWER, SENDER, REAPER = "intake", "cache", "scheduler", "tower", "sender", "reaper"
PREPROCESS = "preprocess"
# Not a stage: the source of the records the supervisor writes (pipeline/runtime/wiring.py's edges).
SUPERVISOR = "supervisor"
OWNER_SUPERVISOR, OWNER_INTAKE, OWNER_CACHE, OWNER_SCHEDULER, OWNER_TOWER, OWNER_SENDER, OWNER_REAPER = range(7)
# After the tower replicas' (OWNER_REAPER + 1 .. + 7, stages/registry.py), inside the
# arenas' 16 owner slots.
OWNER_PREPROCESS = 14


@dataclass(frozen=True, slots=True)
class RoomOpened:
    slot: int
    room: int
    request_id: str
    spans: tuple[int, ...]
    deadline: float  # time.monotonic() seconds; 0 = none


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One vision item on its way to an embedding."""

    slot: int
    room: int
    item: int
    seq: int  # arrival order, for FIFO scheduling
    modality: str
    grid_thw: tuple
    pixel_dtype: str
    n_patches: int
    patch_dim: int
    span: int
    pixels: Lease | None  # in the pixel arena; None once the tower let go of them
    client_hash: int | None = None
    pixel_hash: bytes | None = None  # ipc.hashing.cache_hash of the pixels (keyed), taken by intake as it read them
    key: tuple | None = None  # cache key, once hashed
    out: Lease | None = None  # in the embedding arena, once the scheduler reserved it
    cache_salt: str = ""  # the request's cache_salt: other salts never share its cache entry or encode
    # A compressed image (protocol 1.2): (format, bytes, min_pixels, max_pixels); a video's
    # adds (fps, min_frames, max_frames). Until the preprocess stage decodes it, `pixels`
    # holds the file's bytes, and pixel_hash is the keyed hash of those bytes and the
    # settings (so a repeated image or video skips the decode).
    media: tuple | None = None
    # An http(s) URL the preprocess stage fetches the image's bytes from (protocol 1.2):
    # until then `pixels` and `pixel_hash` are None, and the item has no cache key.
    url: str | None = None


@dataclass(frozen=True, slots=True)
class Batch:
    items: tuple[WorkItem, ...]


@dataclass(frozen=True, slots=True)
class ReadyItem:
    """An item's rows lie in the embedding arena; the receiving stage holds one reference on `lease`."""

    slot: int
    room: int
    item: int
    span: int
    lease: Lease


@dataclass(frozen=True, slots=True)
class Encoded:
    item: WorkItem


@dataclass(frozen=True, slots=True)
class EncodeFailed:
    item: WorkItem
    reason: str
    rooms: frozenset[int]


@dataclass(frozen=True, slots=True)
class TowerCredit:
    replica: int


@dataclass(frozen=True, slots=True)
class TowerRestarted:
    replica: int


@dataclass(frozen=True, slots=True)
class TowerDown:
    replica: int


@dataclass(frozen=True, slots=True)
class PreprocessDone:
    worker: int


@dataclass(frozen=True, slots=True)
class PreprocessRestarted:
    worker: int


@dataclass(frozen=True, slots=True)
class PreprocessDown:
    worker: int


@dataclass(frozen=True, slots=True)
class SpaceWanted:
    nbytes: int


@dataclass(frozen=True, slots=True)
class RoomFailure:
    """A stage found that a room cannot succeed; the reaper concludes it. `slot` None: a
    room the sender saw only in allocs (never opened). `code`: a ReasonCode (ipc/stats.py),
    the label the failure is counted under; "" where the raise site sets none yet (its
    reason text is classed instead)."""

    slot: int | None
    room: int
    reason: str
    code: str = ""


@dataclass(frozen=True, slots=True)
class Registered:
    registration: Register


@dataclass(frozen=True, slots=True)
class AllocSeen:
    room: int
    receiver: str


@dataclass(frozen=True, slots=True)
class ShardWritten:
    room: int
    item: int
    receiver: str
    digest: bytes | None = None  # wire.rows_digest of exactly the bytes written to it


@dataclass(frozen=True, slots=True)
class ItemDone:
    slot: int
    room: int
    item: int
    done: int  # the room's items written so far: a successor that handles this again counts nothing twice


@dataclass(frozen=True, slots=True)
class Fenced:
    room: int
    receivers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LateAlloc:
    room: int
    receiver: str


@dataclass(frozen=True, slots=True)
class UnknownRoom:
    room: int
    receiver: str
    reason: str
    # The kind of message ("alloc", "cancel", "query") refused because the room is not its
    # key's (stages/ownership.py): answered as a room never seen would be, whatever the room.
    refused: str = ""


@dataclass(frozen=True, slots=True)
class Queried:
    room: int
    receiver: str
    pending: bool  # the sender still holds allocs for it or has it live: its status is to come


@dataclass(frozen=True, slots=True)
class Fence:
    room: int


@dataclass(frozen=True, slots=True)
class RoomSucceeded:
    room: int


@dataclass(frozen=True, slots=True)
class RoomAbandoned:
    room: int


@dataclass(frozen=True, slots=True)
class RoomsLost:
    rooms: tuple[tuple[int | None, int], ...]  # (slot, room); slot None: not in the table yet
    reason: str
    died: str = ""  # the stage that died holding them; "" at a drain's end


@dataclass(frozen=True, slots=True)
class IntakeRestarted:
    at: float  # time.monotonic() when the successor was ready


# Records whose consumer needs them no sooner than its next wake-up (at most
# ipc.sleepers.WAIT_SLICE later; sooner under load, when it wakes for other records):
# pushed without waking it, each saves that stage a round per room. Every other
# record wakes its consumer.
UNHURRIED = frozenset(
    {
        (REAPER, RoomOpened),  # a deadline to watch; the items are what is urgent, and they go elsewhere
        # found in the round that its first alloc or item wakes (items that come first poll for it)
        (SENDER, RoomOpened),
        (REAPER, AllocSeen),  # who must hear how the room ends; it ends later
        (SENDER, RoomSucceeded),  # what is left of the room can go
        (CACHE, PreprocessDone),  # counts for the next miss the cache routes, which wakes it
    }
)


def _pickled_as_tuple(cls):
    """Pickle a record as (class, its values): the dataclass default (``__getstate__``
    calling ``fields()`` on every record) costs twice as much, and every record crosses
    a ring pickled."""
    names = [f.name for f in fields(cls)]
    get = attrgetter(*names)  # one name: the value itself, not a tuple
    cls.__reduce__ = (lambda self: (cls, (get(self),))) if len(names) == 1 else (lambda self: (cls, get(self)))
    return cls


# Classes in records are pickled by a number (pickle's extension registry, copyreg) rather
# than by module and name: loading a name imports and looks it up, every record, and
# that was a large part of what unpickling a record cost. Every process that reads a
# ring imports this module, so all agree on the numbers; they are private to one run
# (rings do not outlive it).
_EXTENSION_BASE = 0xE9D0
_records = [v for v in list(globals().values()) if isinstance(v, type) and v.__module__ == __name__]
for _code, _cls in enumerate([Lease, Register] + _records, start=_EXTENSION_BASE):
    copyreg.add_extension(_cls.__module__, _cls.__qualname__, _code)
for _cls in _records:
    _pickled_as_tuple(_cls)
del _cls, _code
