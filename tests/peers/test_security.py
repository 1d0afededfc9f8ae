"""Security: which segments the worker opens and unlinks, cache poisoning, and resource bounds.

The segment rules (docs/protocol.md section 1): a name is taken only if it is `/<prefix>...`
without another `/`, not one of the worker's own objects, a regular file (never through a
symlink) owned by the worker's user, and of exactly the size the request says. Anything
else fails its room, and is left where it was.
"""
from __future__ import annotations

import itertools
import os
import time

import numpy as np
import pytest

from ipc import shm
from ipc.arena import Arena
from ipc.rooms import RoomTable
from ipc import hashing, wire
from pipeline.peers.client import Item
from stages import registry, segments
from stages.intake import IntakeStage
from stages.records import RoomFailure, WorkItem
from tests.helpers import PATCH_DIM, expected_sim_rows, image

pytestmark = pytest.mark.timeout(300)
_rooms = itertools.count(90_000)
SPAN4 = dict(span=4, hidden=64, dtype="bfloat16", deepstack_width=32)  # a (1, 4, 4) image
IMAGE_BYTES = 16 * PATCH_DIM * 4


@pytest.fixture
def env(worker_rig):
    def start(mode="inprocess", **over):
        w, client, (rx,) = worker_rig(mode, buffer_bytes=16 << 20, **over)
        return w, client, rx

    return start


def alloc_all(rx, room, items):
    for i, it in enumerate(items):
        span = sum(t * h * w for t, h, w in it.grid_thw) // 4
        rx.alloc(room, i, span=span, hidden=64, dtype="bfloat16", deepstack_width=32)


def serve(client, rx, items, room=None, **kw) -> int:
    room = next(_rooms) if room is None else room
    client.encode(room, f"req-{room}", items, **kw)
    alloc_all(rx, room, items)
    return room


def assert_rows(rx, room, it, i=0):
    span = sum(t * h * w for t, h, w in it.grid_thw) // 4
    main, deep = expected_sim_rows(it.pixels, it.modality, span, 64, 32, "bfloat16")
    got_main, got_deep = rx.rows(room, i)
    assert np.array_equal(got_main, main) and np.array_equal(got_deep, deep), f"room {room} item {i}"


def segment_msg(room, name) -> dict:
    return {"v": 1, "type": "encode", "request_id": "seg", "room": room,
            "items": [{"modality": "image", "grid_thw": [[1, 4, 4]],
                       "pixels": {"shm": name, "shape": [16, PATCH_DIM], "dtype": "float32"}}]}


def write_file(path, data: bytes, mode=0o600) -> bytes:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return data


# ---------------------------------------------------------------- segments


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


@needs_root
def test_worker_never_unlinks_or_follows_what_is_not_its_own(env, shm_prefix, tmp_path):
    """Decoys outside the prefix, a segment of another user, a symlink under the prefix,
    the worker's own arenas: named in requests (valid, duplicate and roomless), none is
    removed or changed, each named room fails with a reason, and the worker serves on."""
    w, client, rx = env()
    pixels = Item("image", *image(1)).pixels.tobytes()
    decoy = f"decoy_{shm_prefix}"                           # in /dev/shm, outside the prefix
    tmp_decoy = tmp_path / "decoy"                          # outside /dev/shm altogether
    foreign = f"{shm_prefix}.foreign"                       # under the prefix, another user's
    link = f"{shm_prefix}.link"                             # under the prefix, a symlink to the decoy
    own = [n for n in shm.list_objects(shm_prefix) if not n.startswith("sem.")]
    made = [shm.SHM_DIR + "/" + n for n in (decoy, foreign, link)]
    try:
        contents = {shm.SHM_DIR + "/" + decoy: write_file(shm.SHM_DIR + "/" + decoy, pixels),
                    str(tmp_decoy): write_file(tmp_decoy, pixels)}
        contents[shm.SHM_DIR + "/" + foreign] = write_file(shm.SHM_DIR + "/" + foreign, pixels)
        os.chown(shm.SHM_DIR + "/" + foreign, 4242, 4242)
        os.symlink(shm.SHM_DIR + "/" + decoy, shm.SHM_DIR + "/" + link)
        names = {"/" + decoy: "outside the worker's shm prefix",
                 f"/../..{tmp_decoy}": "outside the worker's shm prefix",
                 f"/{shm_prefix}/../{decoy}": "may not contain '/'",
                 "/" + foreign: "not a regular segment of the worker's user",
                 "/" + link: "cannot be opened",
                 **{"/" + n: "one of the worker's own objects" for n in own}}
        failing = {}
        for name, why in names.items():
            room = next(_rooms)
            client.send(segment_msg(room, name))
            rx.alloc(room, 0, **SPAN4)
            failing[room] = why
            client.send(segment_msg(None, name))                 # roomless: dropped
        healthy = Item("image", *image(2))
        good = serve(client, rx, [healthy])
        client.send(segment_msg(good, "/" + foreign))            # duplicate room: dropped
        for name in names:
            client.send(segment_msg(good, name))
        assert rx.wait({**{room: 1 for room in failing}, good: 1}, 60)
        for room, why in failing.items():
            assert why in rx.failed[room], rx.failed[room]
        assert good not in rx.failed
        assert_rows(rx, good, healthy)
        for path, data in contents.items():
            with open(path, "rb") as f:
                assert f.read() == data, f"{path} was changed"
        assert os.path.islink(shm.SHM_DIR + "/" + link)
        assert set(own) <= set(shm.list_objects(shm_prefix)), "the worker lost one of its own objects"
        later = Item("image", *image(3))
        room = serve(client, rx, [later])
        assert rx.wait({room: 1}, 60) and room not in rx.failed
        assert_rows(rx, room, later)
        assert w.stats()["intake_dropped"] == {"room cannot be read": len(names), "duplicate room": 1 + len(names)}
    finally:
        for path in made:
            if os.path.lexists(path):
                os.unlink(path)


def test_unreadable_mode_and_ownership(env, shm_prefix):
    """Mode 000 does not stop root, so the worker relies on ownership: a mode-000 segment
    of the worker's own user is taken (and unlinked); as another user it could not be read
    and fails its room, and stays."""
    w, client, rx = env()
    it = Item("image", *image(4))
    name = f"/{shm_prefix}.mode000"
    write_file(shm.SHM_DIR + name, it.pixels.tobytes(), mode=0o000)
    try:
        room = next(_rooms)
        client.send(segment_msg(room, name))
        rx.alloc(room, 0, **SPAN4)
        assert rx.wait({room: 1}, 60)
        if os.geteuid() == 0:
            assert room not in rx.failed, rx.failed[room]
            assert_rows(rx, room, it)
            assert not os.path.exists(shm.SHM_DIR + name)
        else:
            assert "cannot be opened: Permission denied" in rx.failed[room]
            assert os.path.exists(shm.SHM_DIR + name)
    finally:
        if os.path.exists(shm.SHM_DIR + name):
            os.unlink(shm.SHM_DIR + name)


class IntakeRig:
    """An intake stage over real shared memory, without sockets: frames go straight to
    its handle(); `handle` returns what it emitted for that frame."""

    def __init__(self, prefix):
        run_id = shm.new_run_id()
        self.arena = Arena.create(prefix, run_id, "pixels", 4 << 20)
        self.rooms = RoomTable.create(prefix, run_id, "rooms", 64)
        self.sent: list[tuple[str, object]] = []
        self.stage = IntakeStage(lambda dest, rec: self.sent.append((dest, rec)), prefix=prefix,
                                 pixel_arena=self.arena, rooms=self.rooms, patch_dim=PATCH_DIM, merge=2,
                                 row_bytes=192, emb_arena_bytes=32 << 20, max_items_per_request=8,
                                 max_pixel_bytes_per_request=1 << 20, max_live_rooms=32)

    def handle(self, msg: dict) -> list[tuple[str, object]]:
        self.stage.handle("socket", wire.encode(msg))
        sent, self.sent = self.sent, []
        return sent

    def items(self, msg: dict) -> list[WorkItem]:
        """The items of a request intake takes, as they go to the cache."""
        return [rec for dest, rec in self.handle(msg) if dest == registry.CACHE]

    def close(self) -> None:
        for obj in (self.arena, self.rooms):
            obj.close()
            obj.unlink()


@pytest.fixture
def intake(shm_prefix):
    rig = IntakeRig(shm_prefix)
    try:
        yield rig
    finally:
        rig.close()


@pytest.mark.parametrize("change", ["truncated", "grown", "truncated mid-read"])
def test_segment_changed_after_the_worker_took_it(intake, shm_prefix, monkeypatch, change):
    """The client keeps a descriptor and truncates or grows the segment after the worker
    has opened and unlinked it. The worker reads with pread, not mmap: no SIGBUS, the room
    fails with the reason, and the arena space goes back."""
    name = f"/{shm_prefix}.px.changing"
    fd = os.open(shm.SHM_DIR + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, Item("image", *image(5)).pixels.tobytes())
        new_size = {"truncated": 100, "grown": IMAGE_BYTES + 4096, "truncated mid-read": 100}[change]
        real_take, real_fstat = segments.take, os.fstat

        def take_then_change(prefix, names):
            taken = real_take(prefix, names)
            assert isinstance(taken[name], int), taken[name]
            if change == "truncated mid-read":
                # the size check sees the old size; the file shrinks before pread runs
                def fstat_then_truncate(f):
                    st = real_fstat(f)
                    os.ftruncate(fd, new_size)
                    return st
                monkeypatch.setattr(os, "fstat", fstat_then_truncate)
            else:
                os.ftruncate(fd, new_size)
            return taken

        monkeypatch.setattr(segments, "take", take_then_change)
        sent = intake.handle(segment_msg(7, name))
        monkeypatch.undo()
        [(dest, failure)] = sent  # the room fails, and nothing else goes out
        assert dest == registry.REAPER and isinstance(failure, RoomFailure)
        want = {"truncated": "holds 100 bytes", "grown": f"holds {IMAGE_BYTES + 4096} bytes",
                "truncated mid-read": "shrank while it was read"}[change]
        assert want in failure.reason, failure.reason
        assert not os.path.exists(shm.SHM_DIR + name)  # taken: the worker's to unlink
        assert intake.arena.used_bytes() == 0 and not intake.arena.live_leases()
    finally:
        os.close(fd)
        if os.path.exists(shm.SHM_DIR + name):
            os.unlink(shm.SHM_DIR + name)


@pytest.mark.parametrize("good", [True, False])
def test_a_room_the_reaper_records_while_intake_reads_its_request_is_a_duplicate(intake, good):
    """The reaper records a room it fails before intake has seen it (a cancel while its
    allocs were held at the sender): it can land while intake reads the request, just
    before its insert. That request is a duplicate (dropped, its pixels given back), not
    a crash of the intake stage (one that cost a restart and the requests in its socket)."""
    room = 7
    real_insert = intake.rooms.insert
    calls = []

    def reaper_inserts_first(r, *args, **kw):
        if not calls:
            calls.append(r)
            real_insert(r, "?", 0, 0, existing_ok=True)  # the reaper, on the other core
        return real_insert(r, *args, **kw)

    intake.rooms.insert = reaper_inserts_first
    msg = {"v": 1, "type": "encode", "request_id": "raced", "room": room,
           "items": [{"modality": "image", "grid_thw": [[1, 4, 4] if good else [1, 3, 4]],
                      "pixels": {"data": image(5)[1].tobytes(), "shape": [16, PATCH_DIM], "dtype": "float32"}}]}
    assert intake.handle(msg) == [], "no room opened, none failed"
    assert intake.stage.dropped["duplicate room"] == 1
    assert intake.arena.used_bytes() == 0


def test_segment_name_rules(shm_prefix):
    p = shm_prefix
    ok = [f"/{p}.px.1", f"/{p}", f"/{p}x y", f"/{p}..", f"/{p}-notours"]
    bad = {"/other.px": "outside", f"{p}.px": "outside", f"/{p}/x": "may not contain",
           f"/{p}/../x": "may not contain", f"/{p}\0": "may not contain", "/../" + p: "outside",
           f"/{p}-0123abcd-ring.a.b": "own objects", f"/{p}-0123abcd-lock": "own objects",
           f"/sem.{p}-0123abcd-x": "outside", f"/{p}" + "x" * 300: "longer than 255",
           f"/{p}-0123abcd-pixels": "own objects"}
    for name in ok:
        assert segments.name_problem(p, name) is None, name
    for name, why in bad.items():
        problem = segments.name_problem(p, name)
        assert problem and why in problem, (name, problem)


# ---------------------------------------------------------------- cache poisoning


def test_client_hash_is_ignored_unless_trusted(env):
    """Client B sends other pixels under the hash of A's image. With trust_client_hash off
    (the default) B gets its own rows and A, served again from the cache, still its own."""
    w, client, rx = env()
    a_item = Item("image", *image(10), hash=0xA11CE)
    b_item = Item("image", *image(11), hash=0xA11CE)     # other pixels, A's hash
    a1 = serve(client, rx, [a_item])
    assert rx.wait({a1: 1}, 60)
    b = serve(client, rx, [b_item])
    assert rx.wait({b: 1}, 60)
    encoded = w.stats()["tower_items"]
    a2 = serve(client, rx, [Item("image", *image(10), hash=0xA11CE)])
    assert rx.wait({a2: 1}, 60)
    assert not rx.failed, rx.failed
    assert_rows(rx, a1, a_item)
    assert_rows(rx, b, b_item)                          # B's own embedding, not A's
    assert_rows(rx, a2, a_item)                         # A's entry was not overwritten
    assert encoded == 2 and w.stats()["tower_items"] == 2  # and A came from the cache


def test_trusted_client_hash_lets_a_client_poison_the_cache(env):
    """With trust_client_hash on (the operator's choice: it saves hashing, and trusts every
    client that can reach the intake) the same attack works: B gets A's rows, and had B
    come first, A would get B's. Documented, not prevented."""
    w, client, rx = env(trust_client_hash=True)
    a_item = Item("image", *image(10), hash=0xA11CE)
    b_item = Item("image", *image(11), hash=0xA11CE)
    b = serve(client, rx, [b_item])                    # B first: its rows go in under A's hash
    assert rx.wait({b: 1}, 60)
    a = serve(client, rx, [a_item])
    assert rx.wait({a: 1}, 60)
    assert not rx.failed, rx.failed
    assert_rows(rx, a, b_item)                          # A was served B's embedding
    assert w.stats()["tower_items"] == 1


# ---------------------------------------------------------------- resource bounds


def test_pixel_bytes_per_request_bound(env):
    w, client, rx = env(max_pixel_bytes_per_request=IMAGE_BYTES)
    one = [Item("image", *image(20))]
    two = [Item("image", *image(21)), Item("image", *image(22))]
    big = serve(client, rx, two, inline=True)
    ok = serve(client, rx, one)
    assert rx.wait({big: 2, ok: 1}, 60)
    assert f"at most {IMAGE_BYTES} per request (max_pixel_bytes_per_request)" in rx.failed[big]
    assert ok not in rx.failed
    assert_rows(rx, ok, one[0])


def test_items_per_request_bound(env):
    w, client, rx = env(max_items_per_request=2)
    three = [Item("image", *image(30 + k)) for k in range(3)]
    room = serve(client, rx, three)
    ok = serve(client, rx, three[:2])
    assert rx.wait({room: 3, ok: 2}, 60)
    assert "items must be a list of 1..2 items (max_items_per_request)" in rx.failed[room]
    assert ok not in rx.failed
    # the refused request's segments were still removed
    assert not [n for n in os.listdir(shm.SHM_DIR) if n.startswith(w.cfg.shm_prefix + ".px.")]


def test_live_rooms_bound(env):
    """Rooms wait for their allocs (live) until the bound is reached; the next one fails
    with a reason; once the first conclude, new rooms are taken again."""
    w, client, rx = env(max_live_rooms=2)
    waiting = [next(_rooms), next(_rooms)]
    items = {room: [Item("image", *image(room % 50))] for room in waiting}
    for room in waiting:
        client.encode(room, "waits", items[room])           # no alloc yet: stays live
    over = serve(client, rx, [Item("image", *image(40))])
    assert rx.wait({over: 1}, 60)
    assert "limit of 2 live rooms (max_live_rooms)" in rx.failed[over]
    for room in waiting:
        alloc_all(rx, room, items[room])
    assert rx.wait({room: 1 for room in waiting}, 60) and not set(waiting) & set(rx.failed)
    later = serve(client, rx, [Item("image", *image(41))])
    assert rx.wait({later: 1}, 60) and later not in rx.failed


def test_held_allocs_bound(env):
    """Allocs for rooms the worker has not seen are held up to max_held_allocs; past it the
    receiver is told at once why; the held ones are answered when bootstrap_timeout_s ends."""
    w, client, rx = env(max_held_allocs=3, bootstrap_timeout_s=1.5)
    held = [next(_rooms) for _ in range(3)]
    for room in held:
        rx.alloc(room, 0, **SPAN4)
    extra = next(_rooms)
    rx.alloc(extra, 0, **SPAN4)
    assert rx.wait({extra: 1}, 30)
    assert "already holds 3 such allocs (max_held_allocs)" in rx.failed[extra]
    assert not set(held) & set(rx.failed)                 # those are still held
    assert w.stats()["sender_held_allocs"] == 3
    assert rx.wait({room: 1 for room in held}, 30)
    assert all(rx.failed[room] == "unknown room" for room in held)
    assert w.stats()["sender_held_allocs"] == 0
    ok = serve(client, rx, [Item("image", *image(50))])   # held space is free again
    assert rx.wait({ok: 1}, 60) and ok not in rx.failed
    rx.poll(0.3)
    assert not rx.violations, rx.violations


def test_tombstones_bound(env):
    """Concluded rooms are remembered up to max_tombstones; past it the oldest is forgotten
    (its id may be used again) and the reaper's and the room table's memory stay bounded,
    also for rooms it only ever heard about from allocs."""
    w, client, rx = env(max_tombstones=5, bootstrap_timeout_s=0.5)
    reaper, rooms = w.runtime.stages["reaper"], w.runtime.rooms
    unknown = [next(_rooms) for _ in range(8)]
    for room in unknown:                                  # allocs for rooms never seen
        rx.alloc(room, 0, **SPAN4)
    assert rx.wait({room: 1 for room in unknown}, 30)
    assert all(rx.failed[room] == "unknown room" for room in unknown)
    sent = {}
    for k in range(12):
        it = Item("image", *image(60 + k))
        sent[serve(client, rx, [it])] = it
        assert rx.wait({room: 1 for room in sent}, 60)
    time.sleep(0.3)                                       # the reaper's next tick
    assert len(reaper.tombstones) <= 5
    assert len(reaper.unknown) <= 5  # a budget of their own, which evicts no concluded room
    assert len(reaper.told.rooms()) <= 5 + 5
    assert len(rooms.entries()) <= 5
    first, last = list(sent)[0], list(sent)[-1]
    assert rooms.find(first) is None                      # forgotten: its id may be used again
    again = Item("image", *image(99))
    rx.release(first)
    rx.failed.pop(first, None)
    serve(client, rx, [again], room=first)
    assert rx.wait({first: 1}, 60) and first not in rx.failed
    assert_rows(rx, first, again)
    assert rooms.find(last) is not None
    client.encode(last, "reuse", [Item("image", *image(98))])  # remembered: a duplicate
    end = time.monotonic() + 30
    while not w.stats()["intake_dropped"].get("duplicate room") and time.monotonic() < end:
        time.sleep(0.05)
    assert w.stats()["intake_dropped"] == {"duplicate room": 1}
    rx.poll(0.3)
    assert not rx.violations, rx.violations


@pytest.mark.parametrize("socket_name", ["intake", "bootstrap"])
def test_an_oversized_frame_is_cut_off_before_it_is_buffered(env, socket_name):
    """No request can be larger than its bounds allow, so ZeroMQ refuses a frame past
    them (and drops the peer) before queueing it: a flood of huge frames cannot grow
    the worker. Peers that keep to the bounds are served as before."""
    import zmq

    w, client, rx = env("inprocess", max_pixel_bytes_per_request=1 << 20)
    before = w.stats()
    ctx = zmq.Context()
    try:
        peer = ctx.socket(zmq.PUSH)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(getattr(w.cfg, socket_name))
        # A msgpack map whose one string is larger than any request may be: were it
        # received, it would be counted as dropped (bootstrap) or fail at intake.
        peer.send(wire.encode({"v": 1, "type": "junk", "pad": "x" * (8 << 20)}))
        time.sleep(0.5)
        it = Item("image", *image(7))
        room = serve(client, rx, [it])
        assert rx.wait({room: 1}, 30) and room not in rx.failed
        assert_rows(rx, room, it)
        after = w.stats()
        for key in ("intake_dropped", "sender_dropped"):
            assert sum(after.get(key, {}).values()) == sum(before.get(key, {}).values()), key
    finally:
        ctx.destroy(linger=0)


def test_registered_receivers_are_bounded(env, monkeypatch):
    """Each receiver costs a table slot: past the bound a new id takes the place of the one
    heard from least recently that owns no room in flight (counted), and the receiver that
    gave way is served again once it registers again."""
    import zmq

    import stages.registrations

    monkeypatch.setattr(stages.registrations, "MAX_RECEIVERS", 3)
    w, client, rx = env("inprocess")
    first = serve(client, rx, [Item("image", *image(59))])  # rx is registered before the others
    assert rx.wait({first: 1}, 60) and first not in rx.failed
    ctx = zmq.Context()
    try:
        peer = ctx.socket(zmq.PUSH)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(w.cfg.bootstrap)
        for rid in ("r2", "r3", "r4", "r5", "r2"):
            peer.send(wire.encode({"v": 1, "type": "register", "receiver": rid,
                                       "session": "127.0.0.1:1", "status": "tcp://127.0.0.1:1"}))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and w.stats().get("receivers_evicted", 0) < 3:
            time.sleep(0.1)
        stats = w.stats()
        assert stats["receivers_evicted"] == 3, stats  # rx, r2, r3 gave way to r4, r5, r2 again
        assert stats["receivers_registered"] == 3 and not stats.get("sender_dropped"), stats
        rx.register()  # the receiver that gave way registers again
        room = serve(client, rx, [Item("image", *image(60))])
        assert rx.wait({room: 1}, 60) and room not in rx.failed
    finally:
        ctx.destroy(linger=0)


def test_intake_hashes_pixels_as_it_reads_them(intake, shm_prefix, monkeypatch):
    """The hash intake takes piece by piece while reading (a piece smaller than the
    segment, so several) is the cache's content hash of the whole; with the client's
    hash trusted, intake does not hash."""
    monkeypatch.setattr(segments, "READ_PIECE", 1000)  # not a multiple of anything
    name = f"/{shm_prefix}.px.hashed"
    data = write_file(shm.SHM_DIR + name, Item("image", *image(9)).pixels.tobytes())
    (w,) = intake.items(segment_msg(21, name))
    want = hashing.cache_hash(intake.stage.content_key, "image", ((1, 4, 4),), "float32", data)
    assert w.pixel_hash == want and bytes(intake.arena.view(w.pixels)) == data

    intake.stage.trust_client_hash = True
    name2 = f"/{shm_prefix}.px.trusted"
    write_file(shm.SHM_DIR + name2, data)
    msg = segment_msg(22, name2)
    msg["items"][0]["hash"] = 12345
    (w2,) = intake.items(msg)
    assert w2.pixel_hash is None and w2.client_hash == 12345
    for lease in (w.pixels, w2.pixels):
        intake.arena.drop(lease, 1)


def test_intake_closes_every_segment_it_takes(intake, shm_prefix):
    """A small segment's descriptor is closed before handle() returns; a large one's (its
    last close frees its pages) by intake's closer thread soon after. None stays open."""
    def open_segments() -> list[str]:
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if f"{shm_prefix}.px.closed" in target:
                found.append(target)
        return found

    leases, sizes = [], []
    for k, grid in enumerate([(1, 4, 4), (1, 8, 8)]):
        it = Item("image", *image(30 + k, grid=grid))
        sizes.append(it.pixels.nbytes)
        name = f"/{shm_prefix}.px.closed{k}"
        write_file(shm.SHM_DIR + name, it.pixels.tobytes())
        msg = segment_msg(40 + k, name)
        msg["items"][0]["grid_thw"] = [list(grid)]
        msg["items"][0]["pixels"]["shape"] = list(it.pixels.shape)
        (w,) = intake.items(msg)
        leases.append(w.pixels)
        if k == 0:
            assert open_segments() == []
    assert sizes[0] <= segments.CLOSE_INLINE_BYTES < sizes[1]  # one of each way
    deadline = time.monotonic() + 10
    while open_segments() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert open_segments() == []
    for lease in leases:
        intake.arena.drop(lease, 1)
