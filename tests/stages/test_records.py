"""The table of records in stages/records.py is the wiring: every route in it has its
ring, every ring carries a record of the table, and what the stages really emit, under
a workload that takes most paths, is in the table."""
from __future__ import annotations

import dataclasses
import io
import itertools

import numpy as np
import PIL.Image
import zmq

import stages.records as records
from ipc import wire
from pipeline.runtime import wiring
from pipeline.peers.client import Client, Item, url_item
from pipeline.runtime.loop import QueueChannel
from pipeline.peers.receiver import Receiver
from tests.helpers import image, sim_config, start_worker
from tests.ipc.test_fetch import http_server, reply

# Routes only a stage's death takes: the pipeline's fault tests and the chaos soak take them.
ON_DEATH_ONLY = {
    ("RoomFailure", "scheduler", "reaper"),  # pixels lost before scheduling
    ("RoomFailure", "tower", "reaper"),      # pixels or output space lost
    ("RoomFailure", "preprocess", "reaper"),  # a compressed image's bytes lost
    ("IntakeRestarted", "reaper", "sender"),  # forwarded after an intake's restart (tests/runtime/test_start_hangs.py)
}
# Taken when the embedding arena runs short (tests/runtime/test_end_to_end.py's give-back test).
ON_SHORTAGE_ONLY = {("SpaceWanted", "scheduler", "cache")}
# Written by the runtime itself, not emitted by a stage: to the reaper, and on a dead
# tower's or preprocess worker's ring in its place (stages/registry.py's last_words).
SENT_BY_THE_RUNTIME = {("RoomsLost", "supervisor", "reaper"), ("TowerDown", "tower", "scheduler"),
                       ("PreprocessDown", "preprocess", "cache"),
                       ("IntakeRestarted", "supervisor", "reaper")}


def table() -> set[tuple[str, str, str]]:
    rows = set()
    for line in records.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("record", "---"):
            for dest in cells[2].split(","):
                rows.add((cells[0], cells[1], dest.strip()))
    return rows


def record_types() -> set[str]:
    return {name for name, obj in vars(records).items()
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == records.__name__}


def test_every_record_is_in_the_table_and_every_row_names_a_record():
    named = {rec for rec, _, _ in table()}
    assert named == record_types(), (named ^ record_types())


def test_records_are_immutable_values():
    for name in record_types():
        params = getattr(records, name).__dataclass_params__
        assert params.frozen, f"{name} is not frozen"
        assert "__slots__" in vars(getattr(records, name)), f"{name} has no slots"


def test_every_unhurried_record_is_a_route_of_the_table():
    """A record pushed without waking its consumer (stages/records.py, UNHURRIED) is one
    the table sends there; the records that must wake, the items and statuses, are not."""
    routes = {(rec, dst) for rec, _, dst in table()}
    for dest, cls in records.UNHURRIED:
        assert (cls.__name__, dest) in routes, (cls.__name__, dest)
    urgent = {records.WorkItem, records.Batch, records.ReadyItem, records.ShardWritten, records.ItemDone,
              records.RoomFailure, records.Fence, records.Fenced, records.RoomsLost, records.TowerCredit}
    assert not {cls for _, cls in records.UNHURRIED} & urgent


def test_the_table_and_the_rings_name_the_same_edges():
    routes = {(src, dst) for _, src, dst in table()}
    assert routes == set(wiring.EDGES), (routes ^ set(wiring.EDGES))


def test_what_the_stages_emit_is_in_the_table(shm_prefix, tmp_path, monkeypatch):
    """An in-process worker whose every emit is watched from its start, under rooms that
    take the success, cache, dedup, cancel, bad-request, bad-alloc, tower-failure, timeout
    and late-alloc paths."""
    seen: set[tuple[str, str, str]] = set()
    plain = QueueChannel.emitter

    def watched_emitter(self, source):
        emit = plain(self, source)

        def watched(dest, rec):
            seen.add((type(rec).__name__, source, dest))
            emit(dest, rec)
        return watched

    monkeypatch.setattr(QueueChannel, "emitter", watched_emitter)
    png = io.BytesIO()
    PIL.Image.new("RGB", (56, 56), (10, 200, 30)).save(png, "PNG")
    served = http_server({"/a.png": lambda h: reply(h, 200, png.getvalue())})
    server = served.__enter__()
    w = start_worker("inprocess", sim_config(shm_prefix, tmp_path, sim_fail_batches=1, max_items_per_batch=1,
                                              bootstrap_timeout_s=0.5, sim_time_per_row_s=0.002,
                                              media_url_hosts="127.0.0.1"))
    client = Client(w.cfg.intake, shm_prefix)
    rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=16 << 20)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 1000)
    raw.connect(w.cfg.intake)
    rooms = itertools.count(1)
    spec = dict(span=4, hidden=64, dtype="bfloat16", deepstack_width=32)
    try:
        def room_of(px_seed: int, alloc: dict | None = None, cancel: bool = False) -> int:
            room = next(rooms)
            client.encode(room, f"r{room}", [Item("image", *image(px_seed))])
            rx.alloc(room, 0, **{**spec, **(alloc or {})})
            if cancel:
                rx.cancel(room)
            return room

        expect = {room_of(1): 1}                       # the tower's first batch fails: EncodeFailed
        expect.update({room_of(2): 1, room_of(3): 1})  # fresh encodes
        assert rx.wait(expect, 60)
        expect = {room_of(3): 1}                       # a cache hit
        expect.update({room_of(4): 1, room_of(4): 1})  # identical misses in flight
        expect[room_of(5, alloc={"span": 5})] = 1      # a bad alloc: the sender fails the room
        expect[room_of(6, cancel=True)] = 1
        bad = next(rooms)                              # a request that breaks a rule: intake fails it
        raw.send(wire.encode({"v": 1, "type": "encode", "request_id": "bad", "room": bad, "items": []}))
        rx.alloc(bad, 0, **spec)
        expect[bad] = 1
        url_room = next(rooms)                         # an image fetched from a URL, then decoded
        client.encode(url_room, "u", [url_item(f"http://127.0.0.1:{server.server_address[1]}/a.png", "png",
                                               [1, 4, 4])])
        rx.alloc(url_room, 0, **spec)
        expect[url_room] = 1
        for data in (png.getvalue(), b"not a png"):   # a compressed image decoded; one that fails
            media_room = next(rooms)
            client.encode(media_room, "m", [Item("image", [[1, 4, 4]], np.frombuffer(data, np.uint8), media="png")])
            rx.alloc(media_room, 0, **spec)
            expect[media_room] = 1
        rx.alloc(10**9, 0, **spec)                     # a room never seen: UnknownRoom
        expect[10**9] = 1
        assert rx.wait(expect, 60)
        late = room_of(7)
        assert rx.wait({late: 1}, 60)
        rx.alloc(late, 0, **spec)                      # after the room concluded: LateAlloc
        rx.query(late)                                 # a query: Queried
        rx.register()                                  # a receiver registers again
        rx.poll(0.5)
    finally:
        raw.close()
        rx.close()
        client.close()
        w.close()
        served.__exit__(None, None, None)
    unknown = seen - table()
    assert not unknown, f"emitted but not in the table: {sorted(unknown)}"
    untaken = table() - seen - ON_DEATH_ONLY - ON_SHORTAGE_ONLY - SENT_BY_THE_RUNTIME
    assert not untaken, f"routes this workload should take but did not: {sorted(untaken)}"


def test_the_reaper_takes_the_supervisors_ring_first():
    """A consumer takes its rings in EDGES order each round: the reaper must handle a
    sender's death (RoomsLost) before its successor's answers (Fenced naming only the
    receivers the successor saw), or it would not tell every receiver."""
    for replicas in (1, 3):
        assert wiring.inputs_of("reaper", replicas)[0] == "supervisor"
