"""Hostile input on every socket: a fixed corpus per socket (intake, bootstrap, status) and
Hypothesis-made messages with one field corrupted at a time.

What each check holds the worker (and the receiver library) to: a message that names a
room concludes exactly that room, failed, with a reason that says why; a message whose
room cannot be read is dropped and counted; healthy rooms sent in between succeed bit
for bit; no stage dies.
"""
from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc import shm
from pipeline.peers.client import Client, Item
from pipeline.peers.receiver import Receiver
from tests.helpers import PATCH_DIM, expected_sim_rows, free_port, image, sim_config, start_worker

pytestmark = pytest.mark.timeout(300)
_rooms = itertools.count(50_000)
SPAN4 = dict(span=4, hidden=64, dtype="bfloat16", deepstack_width=32)  # a (1, 4, 4) image
ROW_BYTES = (64 + 32) * 2


def pack(msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def span_of(it: Item) -> int:
    return sum(t * h * w for t, h, w in it.grid_thw) // 4


class RawPeer:
    """A receiver written by hand: sends any frame to the bootstrap socket and reads its
    statuses raw. Rows go into memory borrowed from a real Receiver (`mem`)."""

    def __init__(self, rid: str, bootstrap: str, mem: Receiver | None = None, session: str | None = None):
        ctx = zmq.Context.instance()
        self.id = rid
        self.mem = mem
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.connect(bootstrap)
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.status = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        self.statuses: dict[int, list[dict]] = {}
        self._next = 0
        self.send({"v": 1, "type": "register", "receiver": rid,
                   "session": session or mem.engine.session, "status": self.status})

    def send(self, msg) -> None:
        self.push.send(msg if isinstance(msg, bytes) else pack(msg))

    def dst(self, n_rows: int) -> tuple[int, int]:
        """Addresses (main, deepstack) of fresh rows in the borrowed memory."""
        off = self._next
        self._next += (n_rows * ROW_BYTES + 63) // 64 * 64
        assert self._next <= self.mem.buffer.size
        return self.mem.address + off, self.mem.address + off + n_rows * 64 * 2

    def alloc(self, room: int, item: int = 0, **over) -> dict:
        msg = {"v": 1, "type": "alloc", "receiver": self.id, "room": room, "item": item,
               "row_start": 0, "n_rows": 4, "fanout": 1, **SPAN4}
        msg.update(over)
        n = msg.get("n_rows")
        main, ds = self.dst(n if isinstance(n, int) and 0 <= n <= 64 else 0)
        msg.setdefault("dst", main)
        msg.setdefault("dst_deepstack", ds)
        return msg

    def rows(self, dst: int, n_rows: int) -> np.ndarray:
        off = dst - self.mem.address
        return self.mem.buffer[off:off + n_rows * 64 * 2].view(np.uint16).reshape(n_rows, 64).copy()

    def poll(self, timeout: float = 0.0) -> None:
        if self.pull.poll(int(timeout * 1000)):
            while True:
                try:
                    st_ = msgpack.unpackb(self.pull.recv(zmq.NOBLOCK), raw=False)
                except zmq.Again:
                    return
                self.statuses.setdefault(st_["room"], []).append(st_)

    def wait(self, rooms, timeout: float, state: str = "failed") -> bool:
        end = time.monotonic() + timeout
        while not all(any(s["state"] == state for s in self.statuses.get(r, ())) for r in rooms):
            if time.monotonic() > end:
                return False
            self.poll(0.05)
        return True

    def reason(self, room: int) -> str:
        return next(s["reason"] for s in self.statuses[room] if s["state"] == "failed")

    def close(self) -> None:
        self.push.close()
        self.pull.close()


@dataclass
class Rig:
    w: object
    client: Client
    rx: Receiver
    prefix: str
    made: list
    healthy: dict = field(default_factory=dict)  # room -> [Item]

    def send_healthy(self, seed: int, room: int | None = None) -> int:
        room = next(_rooms) if room is None else room
        it = Item("image", *image(seed, grid=(1, 4, 2 * (1 + seed % 3))))
        self.client.encode(room, f"healthy-{room}", [it], inline=bool(seed % 2))
        self.rx.alloc(room, 0, span=span_of(it), hidden=64, dtype="bfloat16", deepstack_width=32)
        self.healthy[room] = [it]
        return room

    def check_healthy(self, timeout: float = 60) -> None:
        assert self.rx.wait({r: len(items) for r, items in self.healthy.items()}, timeout), \
            [r for r in self.healthy if not self.rx.concluded(r, 1)]
        failed = {r: self.rx.failed[r] for r in self.healthy if r in self.rx.failed}
        assert not failed, failed
        for room, items in self.healthy.items():
            for i, it in enumerate(items):
                main, deep = expected_sim_rows(it.pixels, it.modality, span_of(it), 64, 32, "bfloat16")
                got_main, got_deep = self.rx.rows(room, i)
                assert np.array_equal(got_main, main) and np.array_equal(got_deep, deep), room

    def assert_alive(self) -> None:
        if self.w.mode == "pipeline":
            stats = self.w.stats()
            assert not any(stats["restarts"].values()), stats["restarts"]
            assert all(p.is_alive() for p in self.w.runtime.procs.values())
        else:
            assert self.w.thread.is_alive() and self.w.error is None, self.w.error

    def outcome(self, room: int):
        """(state name, reason) of a room in the worker's room table, or None."""
        rooms = self.w.runtime.rooms
        slot = rooms.find(room)
        e = rooms.get(slot) if slot is not None else None
        return None if e is None else (e.state.name, e.reason)


@pytest.fixture(params=["inprocess", "pipeline"])
def rig(request, shm_prefix, worker_rig):
    def start(mode=None, **over):
        w, client, (rx,) = worker_rig(mode or request.param, buffer_bytes=16 << 20, **over)
        return Rig(w, client, rx, shm_prefix, worker_rig.made)

    start.mode = request.param
    return start


def counted(counter: dict, prefix: str) -> int:
    return sum(v for k, v in counter.items() if k.startswith(prefix))


# ================================================================ intake corpus

class IntakeCtx:
    """What the intake cases build from: items, messages, segments, the worker's own names."""

    def __init__(self, rig: Rig, tmp_path):
        self.rig = rig
        self.prefix = rig.prefix
        self.tmp = tmp_path
        self.items_of: dict[int, list[Item]] = {}   # rooms expected to succeed
        self.vanish: list[str] = []    # paths the worker must have unlinked
        self.survive: list[str] = []   # paths the worker must not have touched
        self.cleanup: list[str] = []
        self.later: list[int] = []     # rooms a gateway sends once the corpus is in
        own = [n for n in shm.list_objects(rig.prefix) if not n.startswith("sem.")]
        assert own, "the worker's own objects should be listed"
        self.own = own

    def next_room(self) -> int:
        """A room id a gateway sends, served, after the corpus."""
        self.later.append(next(_rooms))
        return self.later[-1]

    def item(self, seed=1, **over) -> dict:
        it = Item("image", *image(seed))
        d = {"modality": "image", "grid_thw": [[1, 4, 4]],
             "pixels": {"data": it.pixels.tobytes(), "shape": [16, PATCH_DIM], "dtype": "float32"}}
        d.update(over)
        return d

    def msg(self, room, items=None, **over) -> dict:
        m = {"v": 1, "type": "encode", "request_id": f"hostile-{room}", "room": room,
             "items": [self.item()] if items is None else items}
        m.update(over)
        return m

    def ok(self, room, seed, **msg_over) -> dict:
        """A valid request the worker must serve (its rows are checked)."""
        it = Item("image", *image(seed))
        self.items_of[room] = [it]
        return self.msg(room, [self.item(seed)], **msg_over)

    def with_px(self, **px) -> dict:
        it = self.item()
        it["pixels"] = {**it["pixels"], **px}
        return it

    def segment(self, data: bytes = None, name: str = None) -> str:
        """A client segment under the prefix holding `data` (a valid image by default)."""
        name = name or f"/{self.prefix}.hostile.{len(self.cleanup)}"
        path = shm.SHM_DIR + name
        with open(path, "wb") as f:
            f.write(Item("image", *image(1)).pixels.tobytes() if data is None else data)
        self.cleanup.append(path)
        return name

    def seg_item(self, name: str) -> dict:
        it = self.item()
        it["pixels"] = {"shm": name, "shape": [16, PATCH_DIM], "dtype": "float32"}
        return it

    def video(self, data: bytes | None = None, **media) -> dict:
        """A compressed video item (1.2) claiming grid [1, 4, 4]: `data` (by default a
        short mp4 whose grid is another) with `media` over its map."""
        if data is None:
            data = _short_mp4()
        return {"modality": "video", "grid_thw": [[1, 4, 4]], "media": {"format": "mp4", "data": data, **media}}


@functools.cache
def _short_mp4() -> bytes:
    from tests.ipc.test_media_video import make_video

    return make_video()


def _foreign_segment(c: IntakeCtx) -> str:
    name = c.segment()
    fd = os.open(shm.SHM_DIR + name, os.O_RDONLY)
    try:
        os.fchown(fd, 4242, 4242)
    finally:
        os.close(fd)
    c.survive.append(shm.SHM_DIR + name)
    return name


def _symlink_segment(c: IntakeCtx) -> str:
    target = str(c.tmp / "symlink-target")
    with open(target, "wb") as f:
        f.write(Item("image", *image(1)).pixels.tobytes())
    name = f"/{c.prefix}.hostile.link"
    os.symlink(target, shm.SHM_DIR + name)
    c.cleanup.append(shm.SHM_DIR + name)
    c.survive += [target, shm.SHM_DIR + name]
    return name


def _fifo_segment(c: IntakeCtx) -> str:
    name = f"/{c.prefix}.hostile.fifo"
    os.mkfifo(shm.SHM_DIR + name, 0o600)
    c.cleanup.append(shm.SHM_DIR + name)
    return name


def _dir_segment(c: IntakeCtx) -> str:
    name = f"/{c.prefix}.hostile.dir"
    os.mkdir(shm.SHM_DIR + name, 0o700)
    c.cleanup.append(shm.SHM_DIR + name)
    return name


def _vanishing_segment(c: IntakeCtx) -> str:
    name = c.segment()
    c.vanish.append(shm.SHM_DIR + name)
    return name


BIG = 2**64 + 1.0  # msgpack cannot carry an integer this big: it goes as a float

# (name, expectation, build(ctx, room) -> message dict or raw frame)
#   ("fail", text): the room fails with a reason containing text
#   ("drop", key):  dropped, counted under a key starting with key
#   ("ok", None):   served (the message is odd but valid)
INTAKE_CASES = [
    ("not msgpack", ("drop", "not a msgpack message"), lambda c, r: b"\xc1\xc1 garbage"),
    ("empty frame", ("drop", "not a msgpack message"), lambda c, r: b""),
    ("trailing bytes", ("drop", "not a msgpack message"), lambda c, r: pack(c.msg(r)) + b"\x00"),
    ("nesting bomb", ("drop", "not a msgpack message"), lambda c, r: b"\x91" * 100_000 + b"\x00"),
    ("non-string keys", ("drop", "not a msgpack message"), lambda c, r: pack({1: 2, "v": 1})),
    ("a list", ("drop", "message is not a map"), lambda c, r: pack([1, 2, 3])),
    ("an integer", ("drop", "message is not a map"), lambda c, r: pack(7)),
    ("no version", ("drop", "unsupported protocol version"), lambda c, r: {k: v for k, v in c.msg(r).items() if k != "v"}),
    ("version 2", ("drop", "unsupported protocol version"), lambda c, r: c.msg(r, v=2)),
    ("version as string", ("drop", "unsupported protocol version"), lambda c, r: c.msg(r, v="1")),
    ("type missing", ("drop", "missing message type"), lambda c, r: {k: v for k, v in c.msg(r).items() if k != "type"}),
    ("type not a string", ("drop", "missing message type"), lambda c, r: c.msg(r, type=3)),
    ("room missing", ("drop", "room cannot be read"), lambda c, r: {k: v for k, v in c.msg(r).items() if k != "room"}),
    ("room negative", ("drop", "room cannot be read"), lambda c, r: c.msg(-r)),
    ("room beyond u64", ("drop", "room cannot be read"), lambda c, r: c.msg(BIG)),
    ("room as string", ("drop", "room cannot be read"), lambda c, r: c.msg(str(r))),
    ("room as bool", ("drop", "room cannot be read"), lambda c, r: c.msg(True)),
    ("room as list", ("drop", "room cannot be read"), lambda c, r: c.msg([r])),
    ("roomless with a segment", ("drop", "room cannot be read"),
     lambda c, r: c.msg(None, [c.seg_item(_vanishing_segment(c))])),
    ("duplicate of a live room", ("drop", "duplicate room"), lambda c, r: c.msg(c.last_healthy)),
    ("largest u64 room", ("ok", None), lambda c, r: c.ok(2**64 - 1, 11)),
    ("room 0", ("ok", None), lambda c, r: c.ok(0, 12)),
    ("extra keys", ("ok", None), lambda c, r: {**c.ok(r, 13), "colour": "blue", "x": [1, 2]}),
    # Not a request: dropped, and its room is still the gateway's to send (old code failed it).
    ("wrong type on intake", ("drop", "intake takes 'encode'"), lambda c, r: c.msg(r, type="alloc")),
    ("a status on intake", ("drop", "intake takes 'encode'"),
     lambda c, r: {"v": 1, "type": "status", "room": r, "item": None, "state": "failed", "reason": "unknown room"}),
    ("a status naming a room a gateway sends next", ("drop", "intake takes 'encode'"),
     lambda c, r: {"v": 1, "type": "status", "room": c.next_room(), "item": None, "state": "failed", "reason": "x"}),
    ("request_id missing", ("fail", "request_id"), lambda c, r: {k: v for k, v in c.msg(r).items() if k != "request_id"}),
    ("request_id oversize", ("fail", "request_id"), lambda c, r: c.msg(r, request_id="x" * 100_000)),
    ("request_id not a string", ("fail", "request_id"), lambda c, r: c.msg(r, request_id=5)),
    ("items not a list", ("fail", "items must be a list"), lambda c, r: c.msg(r, items={"0": c.item()})),
    ("no items", ("fail", "items must be a list"), lambda c, r: c.msg(r, items=[])),
    ("10^5 items", ("fail", "items must be a list"), lambda c, r: c.msg(r, items=[{}] * 100_000)),
    ("item not a map", ("fail", "not a map"), lambda c, r: c.msg(r, items=["image"])),
    ("modality unknown", ("fail", "modality"), lambda c, r: c.msg(r, items=[c.item(modality="audio")])),
    ("grid missing", ("fail", "grid_thw"), lambda c, r: c.msg(r, items=[{k: v for k, v in c.item().items() if k != "grid_thw"}])),
    ("grid zero", ("fail", "grid_thw"), lambda c, r: c.msg(r, items=[c.item(grid_thw=[[1, 0, 4]])])),
    ("grid negative", ("fail", "grid_thw"), lambda c, r: c.msg(r, items=[c.item(grid_thw=[[1, -4, 4]])])),
    ("grid huge", ("fail", "grid_thw"), lambda c, r: c.msg(r, items=[c.item(grid_thw=[[1, 2**40, 4]])])),
    ("grid of floats", ("fail", "grid_thw"), lambda c, r: c.msg(r, items=[c.item(grid_thw=[[1.0, 4.0, 4.0]])])),
    ("grid entry short", ("fail", "grid_thw"), lambda c, r: c.msg(r, items=[c.item(grid_thw=[[4, 4]])])),
    ("grid product overflows", ("fail", "patches"),
     lambda c, r: c.msg(r, items=[c.item(grid_thw=[[2**20, 2**20, 2**20]] * 4)])),
    ("embedding larger than the embedding arena", ("fail", "the embedding arena holds"),
     lambda c, r: c.msg(r, items=[{**c.seg_item(f"/{c.prefix}.nothing"), "grid_thw": [[1, 840, 840]],
                                   "pixels": {"shm": f"/{c.prefix}.nothing", "shape": [705600, PATCH_DIM],
                                              "dtype": "float32"}}])),
    ("grid not divisible by merge", ("fail", "not divisible"), lambda c, r: c.msg(r, items=[c.item(grid_thw=[[1, 3, 4]])])),
    ("pixels missing", ("fail", "pixels must be a map"), lambda c, r: c.msg(r, items=[{k: v for k, v in c.item().items() if k != "pixels"}])),
    ("pixels with shm and data", ("fail", "exactly one"), lambda c, r: c.msg(r, items=[c.with_px(shm=f"/{c.prefix}.x")])),
    ("pixels with neither", ("fail", "exactly one"), lambda c, r: c.msg(r, items=[c.item(pixels={"shape": [16, PATCH_DIM], "dtype": "float32"})])),
    ("shape lies about patches", ("fail", "grid_thw gives 16"), lambda c, r: c.msg(r, items=[c.with_px(shape=[20, PATCH_DIM])])),
    ("shape lies about patch_dim", ("fail", "patch_dim"), lambda c, r: c.msg(r, items=[c.with_px(shape=[16, PATCH_DIM + 1])])),
    ("shape negative", ("fail", "pixels.shape"), lambda c, r: c.msg(r, items=[c.with_px(shape=[-16, PATCH_DIM])])),
    ("shape of three", ("fail", "pixels.shape"), lambda c, r: c.msg(r, items=[c.with_px(shape=[16, PATCH_DIM, 1])])),
    ("dtype unknown", ("fail", "dtype"), lambda c, r: c.msg(r, items=[c.with_px(dtype="int8")])),
    ("dtype as list", ("fail", "dtype"), lambda c, r: c.msg(r, items=[c.with_px(dtype=["float32"])])),
    ("version as bool", ("drop", "unsupported protocol version"), lambda c, r: c.msg(r, v=True)),
    ("version as float", ("drop", "unsupported protocol version"), lambda c, r: c.msg(r, v=1.0)),
    ("dtype lies about byte size", ("fail", "inline data has"), lambda c, r: c.msg(r, items=[c.with_px(dtype="float16")])),
    ("inline data short", ("fail", "inline data has"), lambda c, r: c.msg(r, items=[c.with_px(data=b"\0" * 10)])),
    ("inline data long", ("fail", "inline data has"), lambda c, r: c.msg(r, items=[c.with_px(data=b"\0" * (16 * PATCH_DIM * 4 + 1))])),
    ("inline data as string", ("fail", "pixels.data must be bytes"), lambda c, r: c.msg(r, items=[c.with_px(data="abc")])),
    ("hash negative", ("fail", "hash"), lambda c, r: c.msg(r, items=[c.item(hash=-1)])),
    ("hash as string", ("fail", "hash"), lambda c, r: c.msg(r, items=[c.item(hash="abc")])),
    ("deadline zero", ("fail", "deadline_ms"), lambda c, r: c.msg(r, deadline_ms=0)),
    ("deadline negative", ("fail", "deadline_ms"), lambda c, r: c.msg(r, deadline_ms=-5)),
    ("deadline huge", ("fail", "deadline_ms"), lambda c, r: c.msg(r, deadline_ms=2**63)),
    # legal, past max_deadline_s (about 11.6 days): served now, capped in the reaper's heap
    ("deadline at its largest", ("ok", None), lambda c, r: c.ok(r, 14, deadline_ms=10**9)),
    ("cache_salt too long", ("fail", "cache_salt must be a string of at most 128"), lambda c, r: c.msg(r, cache_salt="s" * 129)),
    ("cache_salt an integer", ("fail", "cache_salt must be a string"), lambda c, r: c.msg(r, cache_salt=7)),
    ("cache_salt as bytes", ("fail", "cache_salt must be a string"), lambda c, r: c.msg(r, cache_salt=b"tenant")),
    ("cache_salt as a list", ("fail", "cache_salt must be a string"), lambda c, r: c.msg(r, cache_salt=["a"])),
    ("cache_salt at its longest", ("ok", None), lambda c, r: c.ok(r, 15, cache_salt="é" * 128)),
    ("cache_salt nil", ("ok", None), lambda c, r: c.ok(r, 16, cache_salt=None)),
    # (1.2) The receivers a room belongs to under CurveZMQ: checked for form, and without
    # CURVE (this corpus) otherwise ignored.
    ("receivers not a list", ("fail", "receivers must be a list of 1..7"), lambda c, r: c.msg(r, receivers="0" * 40)),
    ("receivers empty", ("fail", "receivers must be a list of 1..7"), lambda c, r: c.msg(r, receivers=[])),
    ("eight receivers", ("fail", "receivers must be a list of 1..7"), lambda c, r: c.msg(r, receivers=["0" * 40] * 8)),
    ("receiver key short", ("fail", "receivers must be a list of 1..7"), lambda c, r: c.msg(r, receivers=["0" * 39])),
    ("receiver key not Z85", ("fail", "receivers must be a list of 1..7"), lambda c, r: c.msg(r, receivers=["~" * 40])),
    ("receiver key as bytes", ("fail", "receivers must be a list of 1..7"), lambda c, r: c.msg(r, receivers=[b"0" * 40])),
    ("receivers without CURVE", ("ok", None), lambda c, r: c.ok(r, 17, receivers=["0" * 40, "rx" * 20])),
    ("receivers nil", ("ok", None), lambda c, r: c.ok(r, 18, receivers=None)),
    ("deadline float", ("fail", "deadline_ms"), lambda c, r: c.msg(r, deadline_ms=1.5)),
    ("shm name not a string", ("fail", "pixels.shm must be a string"), lambda c, r: c.msg(r, items=[c.seg_item(7)])),
    ("segment outside the prefix", ("fail", "outside the worker's shm prefix"),
     lambda c, r: c.msg(r, items=[c.seg_item("/somebody_else.px.1")])),
    ("segment with a slash", ("fail", "may not contain '/'"), lambda c, r: c.msg(r, items=[c.seg_item(f"/{c.prefix}/x")])),
    ("segment with ..", ("fail", "may not contain '/'"),
     lambda c, r: c.msg(r, items=[c.seg_item(f"/{c.prefix}/../../etc/passwd")])),
    ("segment climbing out", ("fail", "outside the worker's shm prefix"),
     lambda c, r: c.msg(r, items=[c.seg_item("/../etc/passwd")])),
    ("segment with NUL", ("fail", "may not contain"), lambda c, r: c.msg(r, items=[c.seg_item(f"/{c.prefix}\0x")])),
    ("segment name oversize", ("fail", "longer than"), lambda c, r: c.msg(r, items=[c.seg_item(f"/{c.prefix}" + "x" * 10_000)])),
    ("segment is one of the worker's objects", ("fail", "one of the worker's own objects"),
     lambda c, r: c.msg(r, items=[c.seg_item("/" + c.own[0])])),
    ("segment is another of the worker's objects", ("fail", "one of the worker's own objects"),
     lambda c, r: c.msg(r, items=[c.seg_item("/" + c.own[-1])])),
    ("segment is a semaphore", ("fail", "outside the worker's shm prefix"),
     lambda c, r: c.msg(r, items=[c.seg_item(f"/sem.{c.own[0]}")])),
    ("segment missing", ("fail", "does not exist"), lambda c, r: c.msg(r, items=[c.seg_item(f"/{c.prefix}.nothing")])),
    ("segment truncated before it is read", ("fail", "holds 100 bytes"), lambda c, r: c.msg(r, items=[c.seg_item(c.segment(b"\0" * 100))])),
    ("segment grown before it is read", ("fail", "holds"),
     lambda c, r: c.msg(r, items=[c.seg_item(c.segment(b"\0" * (16 * PATCH_DIM * 4 + 4096)))])),
    ("segment of another user", ("fail", "not a regular segment of the worker's user"),
     lambda c, r: c.msg(r, items=[c.seg_item(_foreign_segment(c))])),
    ("segment is a symlink", ("fail", "cannot be opened"), lambda c, r: c.msg(r, items=[c.seg_item(_symlink_segment(c))])),
    ("segment is a fifo", ("fail", "not a regular segment"), lambda c, r: c.msg(r, items=[c.seg_item(_fifo_segment(c))])),
    ("segment is a directory", ("fail", "not a regular segment"), lambda c, r: c.msg(r, items=[c.seg_item(_dir_segment(c))])),
    # (1.2) Compressed videos: a bad one fails its own room, from the wire or the preprocess stage.
    ("video truncated", ("fail", "does not open"), lambda c, r: c.msg(r, items=[c.video(_short_mp4()[:400])])),
    ("video of another format", ("fail", "not an mp4 file"), lambda c, r: c.msg(r, items=[c.video(b"\x89PNG" + bytes(60))])),
    ("video not its grid", ("fail", "is not the video's"), lambda c, r: c.msg(r, items=[c.video()])),
    ("video claiming huge frames", ("fail", "max_decoded_pixels"),
     lambda c, r: c.msg(r, items=[c.video(_claiming_huge_frames(), format="webm")])),
    ("video claiming many frames", ("fail", "max_stream_pixels"),
     lambda c, r: c.msg(r, items=[c.video(_claiming_many_frames())])),
    ("video fps zero", ("fail", "media.fps"), lambda c, r: c.msg(r, items=[c.video(fps=0)])),
    ("video fps as string", ("fail", "media.fps"), lambda c, r: c.msg(r, items=[c.video(fps="2")])),
    ("video fps infinite", ("fail", "media.fps"), lambda c, r: c.msg(r, items=[c.video(fps=float("inf"))])),
    ("video max_frames beyond 768", ("fail", "media.max_frames"), lambda c, r: c.msg(r, items=[c.video(max_frames=769)])),
    ("video as an image", ("fail", "is not image"), lambda c, r: c.msg(r, items=[{**c.video(), "modality": "image"}])),
    ("video with an image format", ("fail", "is not video"), lambda c, r: c.msg(r, items=[c.video(format="png")])),
    ("video sampling on an image", ("fail", "is for a video"),
     lambda c, r: c.msg(r, items=[{"modality": "image", "grid_thw": [[1, 4, 4]],
                                   "media": {"format": "png", "data": b"x", "min_frames": 4}}])),
    ("video url of another type", ("fail", "media.url must be"),
     lambda c, r: c.msg(r, items=[{**c.video(), "media": {"url": "data:video/avi;base64,AAAA"}}])),
    ("video with two grids", ("fail", "one [t, h, w]"),
     lambda c, r: c.msg(r, items=[{**c.video(), "grid_thw": [[1, 2, 2], [1, 2, 2]]}])),
]
if importlib.util.find_spec("cv2") is None:  # the worker's extra, not every checkout's: set up again
    INTAKE_CASES = [c for c in INTAKE_CASES if not c[0].startswith("video")]


def _claiming_huge_frames() -> bytes:
    from tests.ipc.test_media_video import claiming_huge_frames

    return claiming_huge_frames()


def _claiming_many_frames() -> bytes:
    from tests.ipc.test_media_video import claiming_many_frames

    return claiming_many_frames()
if os.geteuid() != 0:  # only root can give a file away
    INTAKE_CASES = [c for c in INTAKE_CASES if c[0] != "segment of another user"]


def test_intake_corpus(rig, tmp_path):
    assert len(INTAKE_CASES) >= 30
    r = rig()
    ctx = IntakeCtx(r, tmp_path)
    drops, fails = Counter(), {}
    ctx.last_healthy = r.send_healthy(0)
    for k, (name, (kind, text), build) in enumerate(INTAKE_CASES):
        room = next(_rooms)
        msg = build(ctx, room)
        r.client.send_raw(msg if isinstance(msg, bytes) else pack(msg))
        if kind == "drop":
            drops[text] += 1
        elif kind == "fail":
            fails[room] = (name, text)
            r.rx.alloc(room, 0, **SPAN4)
        else:
            room = msg["room"]
            for i, it in enumerate(ctx.items_of[room]):
                r.rx.alloc(room, i, span=span_of(it), hidden=64, dtype="bfloat16", deepstack_width=32)
            r.healthy[room] = ctx.items_of[room]
        if k % 5 == 4:
            ctx.last_healthy = r.send_healthy(k)
    for k, room in enumerate(ctx.later):
        r.send_healthy(1000 + k, room)
    try:
        assert r.rx.wait({room: 1 for room in fails}, 60), [fails[x] for x in fails if x not in r.rx.failed]
        for room, (name, text) in fails.items():
            assert text in r.rx.failed[room], f"{name}: {r.rx.failed[room]!r}"
            assert r.outcome(room)[0] == "FAILED", name
        r.check_healthy()
        dropped = r.w.stats()["intake_dropped"]
        for text, n in drops.items():
            assert counted(dropped, text) == n, (text, dropped)
        assert sum(dropped.values()) == sum(drops.values()), dropped
        assert not r.rx.violations, r.rx.violations
        for path in ctx.survive:
            assert os.path.lexists(path), f"the worker removed {path}, which was not its own"
        for path in ctx.vanish:
            assert not os.path.exists(path), f"the worker left {path}, handed over to it"
        r.assert_alive()
    finally:
        for path in ctx.cleanup:
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            elif os.path.lexists(path):
                os.unlink(path)


def _lowest_free_fd(pid: int) -> int:
    fds = {int(n) for n in os.listdir(f"/proc/{pid}/fd")}
    return next(n for n in itertools.count() if n not in fds)


def test_a_segment_whose_open_failed_is_unlinked(rig):
    """Intake out of descriptors: the segment it could not open is still handed over,
    unlinked by name (old code left it in /dev/shm for good), and its room fails with
    the reason; once descriptors are back the worker serves as before."""
    import resource

    r = rig()
    warm = r.send_healthy(0)  # every socket the failure path needs exists before the limit drops
    assert r.rx.wait({warm: 1}, 60)
    pid = r.w.runtime.procs["intake"].pid if rig.mode == "pipeline" else os.getpid()
    room = next(_rooms)
    name = r.client.publish(Item("image", *image(3)).pixels)
    path = shm.SHM_DIR + name
    msg = {"v": 1, "type": "encode", "request_id": f"nofd-{room}", "room": room,
           "items": [{"modality": "image", "grid_thw": [[1, 4, 4]],
                      "pixels": {"shm": name, "shape": [16, PATCH_DIM], "dtype": "float32"}}]}
    limit = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (_lowest_free_fd(pid), limit[1]))
    try:
        r.client.send_raw(pack(msg))
        deadline = time.monotonic() + 30
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = os.path.exists(path)
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limit)
        if os.path.exists(path):
            os.unlink(path)
    assert not left, f"{name} stayed in /dev/shm after its open failed"
    r.rx.alloc(room, 0, **SPAN4)
    assert r.rx.wait({room: 1}, 60) and "Too many open files" in r.rx.failed.get(room, ""), r.rx.failed.get(room)
    r.send_healthy(1)
    r.check_healthy()
    r.assert_alive()


# ================================================================ bootstrap corpus

class BootCtx:
    def __init__(self, rig: Rig, evil: RawPeer, ghost: RawPeer):
        self.rig, self.evil, self.ghost = rig, evil, ghost
        self.rx_rooms: set[int] = set()   # hostile rooms the healthy receiver allocated too

    @property
    def intake(self) -> str:
        return self.rig.w.cfg.intake

    @property
    def bootstrap_port(self) -> int:
        return int(self.rig.w.cfg.bootstrap.rsplit(":", 1)[1])

    def room(self, room: int) -> int:
        """Open `room` with one (1, 4, 4) image: span 4."""
        self.rig.client.encode(room, f"boot-{room}", [Item("image", *image(room % 97))], inline=True)
        return room

    def reg(self, **over) -> dict:
        return {"v": 1, "type": "register", "receiver": "spare", "session": "127.0.0.1:1",
                "status": "tcp://127.0.0.1:1", **over}

    def cancel(self, room, **over) -> dict:
        return {"v": 1, "type": "cancel", "receiver": self.evil.id, "room": room, **over}

    def victim(self, room: int) -> list:
        """The healthy receiver's room (rows [0, 2) of two shards), whose shard the hostile
        receiver claims too."""
        self.rx_rooms.add(room)
        return [("room", self.room(room)), ("rx", room), self.evil.alloc(room, fanout=2, n_rows=2)]


def _without(msg: dict, key: str) -> dict:
    return {k: v for k, v in msg.items() if k != key}


# (name, expectation, build(ctx, room) -> list of frames; ("room", r): r was opened,
# ("rx", r): the healthy receiver allocs rows [0, 2) of r, ("ghost", msg): sent by the ghost)
BOOT_CASES = [
    ("not msgpack", ("drop", "bootstrap message: not a msgpack"), lambda c, r: [b"\xc1"]),
    ("empty frame", ("drop", "bootstrap message: not a msgpack"), lambda c, r: [b""]),
    ("a list", ("drop", "bootstrap message: message is not a map"), lambda c, r: [pack([1])]),
    ("version 0", ("drop", "bootstrap message: unsupported"), lambda c, r: [{**c.evil.alloc(r), "v": 0}]),
    ("type missing", ("drop", "bootstrap message: missing message type"), lambda c, r: [_without(c.evil.alloc(r), "type")]),
    ("an encode", ("drop", "bootstrap message: bootstrap takes"), lambda c, r: [{**c.evil.alloc(r), "type": "encode"}]),
    ("a status", ("drop", "bootstrap message: bootstrap takes"), lambda c, r: [{**c.evil.alloc(r), "type": "status"}]),
    ("register without id", ("drop", "bootstrap message: receiver must be"), lambda c, r: [_without(c.reg(), "receiver")]),
    ("register oversize id", ("drop", "bootstrap message: receiver must be"), lambda c, r: [c.reg(receiver="x" * 5000)]),
    ("register session not a string", ("drop", "bootstrap message: session must be"), lambda c, r: [c.reg(session=5)]),
    ("register udp status", ("drop", "bootstrap message: status must be"), lambda c, r: [c.reg(status="udp://1.2.3.4:5")]),
    ("register status without port", ("drop", "bootstrap message: status must be"), lambda c, r: [c.reg(status="tcp://x")]),
    ("register status wildcard", ("drop", "bootstrap message: status must be"), lambda c, r: [c.reg(status="tcp://*:5")]),
    ("register status port 0", ("drop", "bootstrap message: status must be"), lambda c, r: [c.reg(status="tcp://127.0.0.1:0")]),
    ("register status port too big", ("drop", "bootstrap message: status must be"), lambda c, r: [c.reg(status="tcp://127.0.0.1:70000")]),
    ("register empty ipc status", ("drop", "bootstrap message: status must be"), lambda c, r: [c.reg(status="ipc://")]),
    ("register ipc status too long", ("drop", "bootstrap message: status must be"), lambda c, r: [c.reg(status="ipc://" + "a" * 200)]),
    # The worker's own sockets as a status endpoint: the reaper would push statuses into
    # them (into intake: rooms failed before a gateway sent them). Old code took these.
    ("register status is the worker's intake", ("drop", "register: status"), lambda c, r: [c.reg(status=c.intake)]),
    ("register status is the worker's bootstrap", ("drop", "register: status"),
     lambda c, r: [c.reg(status=c.rig.w.cfg.bootstrap)]),
    ("register status is the bootstrap port by name", ("drop", "register: status"),
     lambda c, r: [c.reg(status=f"tcp://localhost:{c.bootstrap_port}")]),
    ("register status is the bootstrap port on any address", ("drop", "register: status"),
     lambda c, r: [c.reg(status=f"tcp://0.0.0.0:{c.bootstrap_port}")]),
    ("register tokenspeed status on the bootstrap port", ("drop", "register: status"),
     lambda c, r: [c.reg(status=f"tokenspeed+tcp://127.0.0.1:{c.bootstrap_port}")]),
    ("register ipc status outside status_ipc_dirs", ("drop", "register: status"),
     lambda c, r: [c.reg(status="ipc:///tmp/elsewhere.sock")]),
    ("register ipc status: the intake spelt otherwise", ("drop", "register: status"),
     lambda c, r: [c.reg(status="ipc://" + c.intake[len("ipc://"):].replace("/intake.sock", "/./intake.sock"))]),
    # Self-describing allocs (1.1): their session and status register the receiver, so
    # they are held to a register's rules (and a NUL, or a session with no room left for
    # its incarnation, would damage the shared receiver table).
    ("self-describing alloc session not a string", ("drop", "bootstrap message: session must be"),
     lambda c, r: [c.evil.alloc(r, receiver="sd", session=5, status="tcp://127.0.0.1:1")]),
    ("self-describing alloc session empty", ("drop", "bootstrap message: session must be"),
     lambda c, r: [c.evil.alloc(r, receiver="sd", session="", status="tcp://127.0.0.1:1")]),
    ("self-describing alloc session with a NUL", ("drop", "bootstrap message: session must hold no NUL"),
     lambda c, r: [c.evil.alloc(r, receiver="sd", session="127.0.0.1:1\x002", status="tcp://127.0.0.1:1")]),
    ("self-describing alloc session too long for the table", ("drop", "bootstrap message: session must hold no NUL"),
     lambda c, r: [c.evil.alloc(r, receiver="sd", session="\U0001F600" * 256, status="tcp://127.0.0.1:1",
                                incarnation=1)]),
    ("self-describing alloc session too long", ("drop", "bootstrap message: session must be"),
     lambda c, r: [c.evil.alloc(r, receiver="sd", session="x" * 5000, status="tcp://127.0.0.1:1")]),
    ("self-describing alloc without status", ("drop", "bootstrap message: status must be"),
     lambda c, r: [c.evil.alloc(r, receiver="sd", session="127.0.0.1:1")]),
    ("self-describing alloc without session", ("drop", "bootstrap message: session must be"),
     lambda c, r: [c.evil.alloc(r, receiver="sd", status="tcp://127.0.0.1:1")]),
    ("self-describing alloc status wildcard", ("drop", "bootstrap message: status must be"),
     lambda c, r: [c.evil.alloc(r, receiver="sd", session="127.0.0.1:1", status="tcp://*:5")]),
    ("self-describing alloc status too long", ("drop", "bootstrap message: status must be"),
     lambda c, r: [c.evil.alloc(r, receiver="sd", session="127.0.0.1:1", status="ipc://" + "a" * 5000)]),
    ("self-describing alloc incarnation negative", ("drop", "bootstrap message: incarnation must be"),
     lambda c, r: [c.evil.alloc(r, receiver="sd", session="127.0.0.1:1", status="tcp://127.0.0.1:1",
                                incarnation=-1)]),
    ("alloc from an unregistered receiver", ("drop", "alloc from unregistered receiver"),
     lambda c, r: [{**c.evil.alloc(r), "receiver": "nobody"}]),
    ("cancel from an unregistered receiver", ("drop", "cancel from unregistered receiver"),
     lambda c, r: [c.cancel(r, receiver="nobody")]),
    ("alloc without receiver", ("drop", "bootstrap message: receiver must be"), lambda c, r: [_without(c.evil.alloc(r), "receiver")]),
    ("alloc room negative", ("drop", "bootstrap message: room must be"), lambda c, r: [c.evil.alloc(-1)]),
    ("alloc room as string", ("drop", "bootstrap message: room must be"), lambda c, r: [c.evil.alloc(str(r))]),
    ("alloc dst negative", ("drop", "bootstrap message: dst must be"), lambda c, r: [c.evil.alloc(r, dst=-4096)]),
    ("alloc dst beyond u64", ("drop", "bootstrap message: dst must be"), lambda c, r: [c.evil.alloc(r, dst=BIG)]),
    ("alloc item negative", ("drop", "bootstrap message: item must be"), lambda c, r: [c.evil.alloc(r, item=-1)]),
    ("alloc n_rows huge", ("drop", "bootstrap message: n_rows must be"), lambda c, r: [c.evil.alloc(r, n_rows=2**50, dst=4096)]),
    ("alloc span as string", ("drop", "bootstrap message: span must be"), lambda c, r: [c.evil.alloc(r, span="4")]),
    ("alloc hidden missing", ("drop", "bootstrap message: hidden must be"), lambda c, r: [_without(c.evil.alloc(r), "hidden")]),
    ("alloc fanout 0", ("drop", "bootstrap message: fanout must be"), lambda c, r: [c.evil.alloc(r, fanout=0)]),
    ("alloc fanout huge", ("drop", "bootstrap message: fanout must be"), lambda c, r: [c.evil.alloc(r, fanout=10**6)]),
    ("alloc dtype unknown", ("drop", "bootstrap message: dtype must be"), lambda c, r: [c.evil.alloc(r, dtype="int4")]),
    ("alloc dtype as list", ("drop", "bootstrap message: dtype must be"), lambda c, r: [c.evil.alloc(r, dtype=[1])]),
    ("cancel without room", ("drop", "bootstrap message: room must be"), lambda c, r: [_without(c.cancel(r), "room")]),
    ("cancel of an unknown room", ("drop", "cancel of a room this worker does not hold"), lambda c, r: [c.cancel(r)]),
    ("register of a fresh receiver", ("ok", None), lambda c, r: [c.reg()]),
    ("alloc for an item the room lacks", ("fail", "the room has 1 items"), lambda c, r: [("room", c.room(r)), c.evil.alloc(r, item=3)]),
    ("pointer 0", ("fail", "dst 0"), lambda c, r: [("room", c.room(r)), c.evil.alloc(r, dst=0, dst_deepstack=0)]),
    ("deepstack pointer 0", ("fail", "dst_deepstack 0"), lambda c, r: [("room", c.room(r)), c.evil.alloc(r, dst_deepstack=0)]),
    ("rows beyond the span", ("fail", "beyond the span"), lambda c, r: [("room", c.room(r)), c.evil.alloc(r, row_start=2)]),
    ("span lie", ("fail", "says span 5"), lambda c, r: [("room", c.room(r)), c.evil.alloc(r, span=5)]),
    ("fanout disagreement", ("fail", "disagree on fanout"),
     lambda c, r: [("room", c.room(r)), c.evil.alloc(r, fanout=2, n_rows=2), c.evil.alloc(r, fanout=3, row_start=2, n_rows=2)]),
    ("fanout lie: allocs never complete", ("fail", "incomplete"), lambda c, r: [("room", c.room(r)), c.evil.alloc(r, fanout=3)]),
    ("shards overlap", ("fail", "overlap"),
     lambda c, r: [("room", c.room(r)), c.evil.alloc(r, fanout=2, n_rows=3), c.evil.alloc(r, fanout=2, row_start=2, n_rows=2)]),
    ("shards short of the span", ("fail", "cover rows [0, 2)"),
     lambda c, r: [("room", c.room(r)), c.evil.alloc(r, fanout=2, n_rows=1), c.evil.alloc(r, fanout=2, row_start=1, n_rows=1)]),
    ("dst outside the receiver's memory", ("fail", "failed"), lambda c, r: [("room", c.room(r)), c.evil.alloc(r, dst=4096, dst_deepstack=8192)]),
    ("alloc for another receiver's room", ("fail", "overlap"), lambda c, r: c.victim(r)),
    ("cancel of a room", ("fail", "canceled"),
     lambda c, r: [c.evil.alloc(r, fanout=2, n_rows=2), ("room", c.room(r)), c.cancel(r)]),
]


def test_bootstrap_corpus(rig):
    assert len(BOOT_CASES) >= 30
    r = rig(bootstrap_timeout_s=3.0)
    mem = Receiver("mem", r.w.cfg.bootstrap, buffer_bytes=8 << 20)
    r.made.append(mem)
    evil = RawPeer("evil", r.w.cfg.bootstrap, mem)
    ghost = RawPeer("ghost", r.w.cfg.bootstrap, mem, session="127.0.0.1:1")  # nobody listens there
    r.made += [evil, ghost]
    ctx = BootCtx(r, evil, ghost)
    cases = BOOT_CASES + [
        ("writes to a receiver that is not there", ("fail", "transfer to receiver ghost"),
         lambda c, x: [("room", c.room(x)), ("ghost", c.ghost.alloc(x))]),
    ]
    drops, fails = Counter(), {}
    for k, (name, (kind, text), build) in enumerate(cases):
        room = next(_rooms)
        for frame in build(ctx, room):
            if isinstance(frame, tuple):
                what, arg = frame
                if what == "rx":
                    r.rx.alloc(arg, 0, **SPAN4, fanout=2, n_rows=2)
                elif what == "ghost":
                    ghost.send(arg)
                continue
            evil.send(frame)
        if kind == "drop":
            drops[text] += 1
        elif kind == "fail":
            fails[room] = (name, text)
        if k % 5 == 4:
            r.send_healthy(k)
    ghosts = [x for x in fails if fails[x][0].startswith("writes to")]
    evil.wait([x for x in fails if x not in ghosts], 60)
    ghost.wait(ghosts, 60)
    peers = {**evil.statuses, **{x: s for x, s in ghost.statuses.items() if x in fails}}
    missing = [fails[x] for x in fails if not any(s["state"] == "failed" for s in peers.get(x, ()))]
    assert not missing, missing
    for room, (name, text) in fails.items():
        reason = next(s["reason"] for s in peers[room] if s["state"] == "failed")
        assert text in reason, f"{name}: {reason!r}"
        assert [s["state"] for s in peers[room]].count("failed") == 1, name
        assert r.outcome(room)[0] == "FAILED", name
    for room in ctx.rx_rooms:  # the healthy receiver heard about the room it shared
        assert r.rx.wait({room: 1}, 30) and "overlap" in r.rx.failed[room]
        del r.rx.failed[room]
    r.check_healthy()
    end = time.monotonic() + 10
    while sum(r.w.stats()["sender_dropped"].values()) < sum(drops.values()) and time.monotonic() < end:
        time.sleep(0.1)
    dropped = r.w.stats()["sender_dropped"]
    for text, n in drops.items():
        assert counted(dropped, text) == n, (text, dropped)
    assert sum(dropped.values()) == sum(drops.values()), dropped
    r.assert_alive()


# ================================================================ status endpoints

def _sender_dropped(r: Rig, prefix: str, n: int, timeout: float = 30) -> int:
    end = time.monotonic() + timeout
    while counted(r.w.stats()["sender_dropped"], prefix) < n and time.monotonic() < end:
        time.sleep(0.05)
    return counted(r.w.stats()["sender_dropped"], prefix)


def test_a_status_endpoint_may_not_be_the_workers_own_socket(rig):
    """A peer that reaches only bootstrap registers the worker's own intake as its status
    endpoint (by register, and by a self-describing alloc) and queries room ids a gateway
    has yet to send. Both registrations are refused, so nobody pushes statuses into intake;
    the rooms, sent next, are served. Old code took the registration and the reaper pushed
    "unknown room" into intake, which failed the rooms before the gateway sent them."""
    r = rig()
    intake = r.w.cfg.intake
    peer = zmq.Context.instance().socket(zmq.PUSH)
    peer.setsockopt(zmq.LINGER, 1000)
    peer.connect(r.w.cfg.bootstrap)
    r.made.append(peer)
    rooms = [next(_rooms) for _ in range(4)]
    peer.send(pack({"v": 1, "type": "register", "receiver": "squatter", "session": "127.0.0.1:1",
                    "status": intake}))
    peer.send(pack({"v": 1, "type": "alloc", "receiver": "squatter2", "session": "127.0.0.1:1", "status": intake,
                    "room": rooms[3], "item": 0, "row_start": 0, "n_rows": 4, "fanout": 1, "dst": 4096,
                    "dst_deepstack": 8192, **SPAN4}))
    for room in rooms[:3]:
        peer.send(pack({"v": 1, "type": "query", "receiver": "squatter", "room": room}))
    # The gateway sends once the queries were dropped, or (old code) once what the reaper
    # pushed into intake had failed the rooms.
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if counted(r.w.stats()["sender_dropped"], "query from unregistered receiver") >= 3:
            break
        if all(r.outcome(room) is not None for room in rooms[:3]):
            break
        time.sleep(0.05)
    for k, room in enumerate(rooms[:3]):
        r.send_healthy(k, room)
    r.check_healthy()  # served, bit for bit: none failed in advance
    assert _sender_dropped(r, "register: status", 2) == 2, r.w.stats()["sender_dropped"]
    assert counted(r.w.stats()["intake_dropped"], "intake takes") == 0  # nothing was pushed there
    r.assert_alive()


def test_a_status_on_intake_fails_no_room(rig):
    """Intake drops, and counts, any message but an encode, without failing the room it
    names: that room is the gateway's to send (old code failed it: "intake takes 'encode'
    messages, not 'status'")."""
    r = rig()
    room = next(_rooms)
    r.client.send_raw(pack({"v": 1, "type": "status", "room": room, "item": None, "state": "failed",
                            "reason": "unknown room"}))
    r.send_healthy(1, room)
    r.check_healthy()
    assert counted(r.w.stats()["intake_dropped"], "intake takes 'encode' messages") == 1
    r.assert_alive()


def test_status_rule_names_own_sockets_and_ipc_dirs(tmp_path):
    from stages.registrations import StatusRule

    allowed = tmp_path / "status"
    allowed.mkdir()
    run = allowed / "run"  # the worker's run directory inside an allowed one
    run.mkdir()
    rule = StatusRule([f"ipc://{run}/intake.sock", "tcp://127.0.0.1:17600", "0.0.0.0:9100"], [str(allowed)])
    assert rule.problem(f"ipc://{allowed}/rx.sock") is None
    assert "own sockets" in rule.problem(f"ipc://{run}/intake.sock")
    assert "own sockets" in rule.problem(f"ipc://{run}/../run/./intake.sock")
    link = allowed / "link.sock"
    link.symlink_to(run / "intake.sock")
    assert "own sockets" in rule.problem(f"ipc://{link}")
    assert "outside status_ipc_dirs" in rule.problem(f"ipc://{allowed}/../elsewhere.sock")
    for own in ("tcp://127.0.0.1:17600", "tcp://localhost:9100", "tcp://[::1]:17600", "tcp://0.0.0.0:9100",
                "tokenspeed+tcp://127.0.0.1:17600"):
        assert "own sockets" in rule.problem(own), own
    assert rule.problem("tcp://127.0.0.1:17601") is None
    assert rule.problem("tcp://192.0.2.7:17600") is None  # another host's port 17600 (TEST-NET-1)

    from pipeline.cli.config import ConfigError, WorkerConfig

    WorkerConfig(status_ipc_dirs=str(allowed)).resolved().validate()
    with pytest.raises(ConfigError, match="every user may write") as e:
        WorkerConfig(status_ipc_dirs=f"{allowed},/tmp").resolved().validate()
    assert e.value.key == "status_ipc_dirs"


# ================================================================ tombstones

def test_unknown_room_queries_never_evict_a_real_rooms_tombstone(rig):
    """60 queries for rooms nobody sent, under max_tombstones 50: each hears "unknown room",
    and the finished room is still remembered: its late alloc hears that it concluded, and
    its id sent again is a duplicate. Old code spent the one budget on the unknown rooms and
    evicted the real room's tombstone: its late alloc heard "unknown room" (and the id ran
    again)."""
    r = rig(max_tombstones=50, tombstone_ttl_s=3600.0, bootstrap_timeout_s=3.0)
    done = r.send_healthy(0)
    r.check_healthy()
    mem = Receiver("mem", r.w.cfg.bootstrap, buffer_bytes=1 << 20)
    r.made.append(mem)
    asker = RawPeer("asker", r.w.cfg.bootstrap, mem)
    r.made.append(asker)
    unknown = [next(_rooms) for _ in range(61)]
    for room in unknown[:60]:
        asker.send({"v": 1, "type": "query", "receiver": "asker", "room": room})
    assert asker.wait(unknown[:60], 60), sorted(set(unknown[:60]) - set(asker.statuses))
    assert all(asker.reason(room) == "unknown room" for room in unknown[:60])
    # One more, answered in a later round: the reaper has expired what it would after the 60.
    asker.send({"v": 1, "type": "query", "receiver": "asker", "room": unknown[60]})
    assert asker.wait(unknown[60:], 30)
    asker.send(asker.alloc(done))
    assert asker.wait([done], 30)
    assert asker.reason(done) == "room already concluded", asker.reason(done)
    assert r.outcome(done) == ("SUCCESS", "")
    r.client.encode(done, "again", [Item("image", *image(5))], inline=True)
    end = time.monotonic() + 30
    while counted(r.w.stats()["intake_dropped"], "duplicate room") < 1 and time.monotonic() < end:
        time.sleep(0.05)
    assert counted(r.w.stats()["intake_dropped"], "duplicate room") == 1, "a finished room's id ran again"
    def remembered():
        stats = r.w.stats()
        return stats.get("tombstones"), stats.get("unknown_rooms_remembered")

    while remembered() != (1, 50) and time.monotonic() < end:  # stages publish their stats now and then
        time.sleep(0.05)
    assert remembered() == (1, 50)
    r.assert_alive()


# ================================================================ status corpus (the receiver library)

def _status(room, item=None, state="failed", reason="forged", **over):
    return pack({"v": 1, "type": "status", "room": room, "item": item, "state": state,
                 "reason": reason, **over})


# (name, expected count key in Receiver.dropped, build(ctx) -> frame); ctx has ok_room (its
# item 0 succeeded), failed_room (failed), live (allocated, not yet concluded), target
# (allocated, never sent: the forgery it hears is all it hears)
STATUS_CASES = [
    ("not msgpack", "unparseable", lambda c: b"\xc1 garbage"),
    ("empty", "unparseable", lambda c: b""),
    ("a list", "unparseable", lambda c: pack([1, 2])),
    ("nesting bomb", "unparseable", lambda c: b"\x91" * 100_000 + b"\x00"),
    ("no version", "unparseable", lambda c: pack({"type": "status", "room": c.ok_room, "state": "failed"})),
    ("version 9", "unparseable", lambda c: _status(c.live, v=9)),
    ("type missing", "unparseable", lambda c: pack({"v": 1, "room": c.live, "state": "failed", "reason": "x"})),
    ("type alloc", "malformed", lambda c: _status(c.live, type="alloc")),
    ("room missing", "malformed", lambda c: pack({"v": 1, "type": "status", "state": "failed", "reason": "x"})),
    ("room negative", "malformed", lambda c: _status(-c.live)),
    ("room as string", "malformed", lambda c: _status(str(c.live))),
    ("room as list", "malformed", lambda c: _status([c.live])),
    ("room as map", "malformed", lambda c: _status({"a": 1})),
    ("room beyond u64", "malformed", lambda c: _status(BIG)),
    ("room as bool", "malformed", lambda c: _status(True)),
    ("state missing", "malformed", lambda c: pack({"v": 1, "type": "status", "room": c.live, "reason": ""})),
    ("state unknown", "malformed", lambda c: _status(c.live, state="done")),
    ("state as int", "malformed", lambda c: _status(c.live, state=1)),
    ("reason missing", "malformed", lambda c: pack({"v": 1, "type": "status", "room": c.live, "state": "failed"})),
    ("reason as int", "malformed", lambda c: _status(c.live, reason=5)),
    ("item as string", "malformed", lambda c: _status(c.live, item="0", state="success", reason="")),
    ("item negative", "malformed", lambda c: _status(c.live, item=-1, state="success", reason="")),
    ("item as list", "malformed", lambda c: _status(c.live, item=[0], state="success", reason="")),
    ("success for a room never allocated", "no shard", lambda c: _status(c.never, 0, "success", "")),
    ("success for an item without a shard", "no shard", lambda c: _status(c.live, 5, "success", "")),
    ("success without an item", "no shard", lambda c: _status(c.live, None, "success", "")),
    ("success after failed", "after failed", lambda c: _status(c.failed_room, 0, "success", "")),
    ("second success", "second success", lambda c: _status(c.ok_room, 0, "success", "")),
    ("second failed", "second failed", lambda c: _status(c.failed_room, None, "failed", "forged again")),
    ("failed after failed, item set", "second failed", lambda c: _status(c.failed_room, 0, "failed", "x")),
    ("failed for a room never allocated", "never allocated", lambda c: _status(c.never)),
    ("failed for another room never allocated", "never allocated", lambda c: _status(2**64 - 1)),
    # The worker said hello (it speaks 1.1): a success without a digest fails its room, where
    # old code concluded it with rows nobody wrote.
    ("success without a digest", "no digest", lambda c: _status(c.target, 0, "success", "")),
]


class StatusCtx:
    pass


def test_status_corpus(rig):
    """Forged statuses pushed straight at a receiver's status socket, between real ones."""
    assert len(STATUS_CASES) >= 30
    if rig.mode == "pipeline":
        pytest.skip("the receiver library does not depend on the worker's mode")
    r = rig()
    rx = r.rx
    c = StatusCtx()
    c.ok_room = r.send_healthy(1)
    c.failed_room = next(_rooms)
    r.client.encode(c.failed_room, "to-fail", [Item("image", *image(2))])
    rx.alloc(c.failed_room, 0, **{**SPAN4, "span": 7})
    c.never = next(_rooms)
    assert rx.wait({c.ok_room: 1, c.failed_room: 1}, 60)
    first_reason = rx.failed[c.failed_room]
    assert "span" in first_reason
    c.live = r.send_healthy(3)  # the forgeries that name it must not conclude it
    c.target = next(_rooms)
    rx.alloc(c.target, 0, **SPAN4)
    forger = zmq.Context.instance().socket(zmq.PUSH)
    forger.setsockopt(zmq.LINGER, 1000)
    forger.connect(rx.status_endpoint)
    expected = Counter()
    try:
        for k, (name, key, build) in enumerate(STATUS_CASES):
            forger.send(build(c))
            expected[key] += 1
            if k % 4 == 3:
                r.send_healthy(10 + k)
                rx.poll(0.01)
        end = time.monotonic() + 30
        while sum(rx.dropped.values()) < sum(expected.values()) and time.monotonic() < end:
            rx.poll(0.1)
        assert rx.dropped == expected, (rx.dropped, expected)
        r.check_healthy()
        # nothing forged was applied
        assert rx.failed[c.failed_room] == first_reason
        assert c.never not in rx.failed and 2**64 - 1 not in rx.failed
        assert "without a digest" in rx.failed[c.target] and (c.target, 0) not in rx.success
        assert not [key for key in rx.success if key[0] in (c.never, c.failed_room) or key[1] != 0]
        breaches = sum(n for kind, n in expected.items() if kind != "never allocated")
        assert len(rx.violations) == breaches
        # a peer sending a frame over the status size limit is cut off; the receiver goes on
        big = zmq.Context.instance().socket(zmq.PUSH)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(rx.status_endpoint)
        big.send(_status(c.never, reason="x" * (2 << 20)))
        rx.poll(0.3)
        big.close()
        assert c.never not in rx.failed
        r.send_healthy(99)
        r.check_healthy()
        assert rx.dropped == expected
    finally:
        forger.close()


def test_a_forged_success_without_a_digest_fails_the_room(rig):
    """Anyone who reaches a receiver's status socket pushes `success` without a digest for
    a room it allocated, before the worker wrote a row. The worker said hello at register
    (it speaks 1.1), so the receiver requires digests: the room fails, with the reason, and
    nothing the worker sends of it later changes that; real successes (digests all) and a
    receiver that opts out go on as before. Old code concluded the room with zero rows."""
    r = rig()
    rx = r.rx
    r.send_healthy(0)
    r.check_healthy()  # its hello came first, on the same socket
    forger = zmq.Context.instance().socket(zmq.PUSH)
    forger.setsockopt(zmq.LINGER, 1000)
    forger.connect(rx.status_endpoint)
    r.made.append(forger)
    room = next(_rooms)
    rx.alloc(room, 0, **SPAN4)
    forger.send(_status(room, 0, "success", ""))
    end = time.monotonic() + 30
    while room not in rx.failed and (room, 0) not in rx.success and time.monotonic() < end:
        rx.poll(0.05)
    assert (room, 0) not in rx.success, "a forged success concluded the room with rows nobody wrote"
    assert rx.failed[room].startswith("success without a digest"), rx.failed[room]
    assert rx.digest_required and rx.worker_speaks == "1.1"
    assert rx.digests_missing == 1 and rx.dropped["no digest"] == 1
    # The worker's own status for it (the room sent now) is dropped: the room failed here.
    r.client.encode(room, "after", [Item("image", *image(4))], inline=True)
    end = time.monotonic() + 30
    while not rx.dropped["after digest mismatch"] and time.monotonic() < end:
        rx.poll(0.05)
    assert rx.dropped["after digest mismatch"] == 1 and rx.failed[room].startswith("success without")
    r.send_healthy(1)
    r.check_healthy()
    # Opted out (workers of 1.0 share it): a success without a digest is taken as before.
    lax = Receiver("lax", r.w.cfg.bootstrap, buffer_bytes=1 << 20, require_digest=False)
    r.made.append(lax)
    other = next(_rooms)
    lax.alloc(other, 0, **SPAN4)
    loose = zmq.Context.instance().socket(zmq.PUSH)
    loose.setsockopt(zmq.LINGER, 1000)
    loose.connect(lax.status_endpoint)
    r.made.append(loose)
    loose.send(_status(other, 0, "success", ""))
    assert lax.wait({other: 1}, 30) and (other, 0) in lax.success and not lax.digest_required
    r.assert_alive()


# ================================================================ Hypothesis: one field corrupted

NON_INT = st.one_of(st.none(), st.text(max_size=5), st.floats(allow_nan=False), st.booleans(),
                    st.lists(st.integers(0, 5), max_size=2), st.binary(max_size=4))
NON_STR = st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False), st.booleans(),
                    st.lists(st.integers(0, 5), max_size=2), st.binary(max_size=4))
NON_LIST = st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=5), st.booleans(),
                     st.dictionaries(st.text(max_size=3), st.integers(-5, 5), max_size=2))
NON_MAP = st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=5), st.lists(st.integers(-5, 5), max_size=2))
HUGE = st.one_of(st.integers(2**64, 2**70).map(float), st.integers(-(2**63), -1))
DROP, FAIL, VALID = "drop", "fail", "valid"


@st.composite
def encode_messages(draw):
    """A valid encode message from the schema (1-3 inline items) and its items."""
    items, dicts = [], []
    for _ in range(draw(st.integers(1, 3))):
        t, h, w = draw(st.sampled_from([(1, 2, 2), (1, 4, 4), (2, 2, 4), (1, 2, 6)]))
        dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
        modality = draw(st.sampled_from(["image", "video"]))
        seed = draw(st.integers(0, 2**16))
        rng = np.random.default_rng(seed)
        if dtype == "bfloat16":  # raw bits
            px = rng.integers(0, 2**16, (t * h * w, PATCH_DIM), dtype=np.uint16)
        else:
            px = rng.standard_normal((t * h * w, PATCH_DIM), dtype=np.float32).astype(dtype)
        it = Item(modality, [[t, h, w]], px, dtype=dtype)
        d = {"modality": modality, "grid_thw": [[t, h, w]],
             "pixels": {"data": px.tobytes(), "shape": [t * h * w, PATCH_DIM], "dtype": dtype}}
        if draw(st.booleans()):
            d["hash"] = draw(st.integers(0, 2**64 - 1))
        items.append(it)
        dicts.append(d)
    msg = {"v": 1, "type": "encode", "request_id": draw(st.text(min_size=1, max_size=20)), "room": 0, "items": dicts}
    if draw(st.booleans()):
        msg["deadline_ms"] = draw(st.integers(60_000, 10**9))
    return msg, items


def _set(msg, path, value):
    target = msg
    for p in path[:-1]:
        target = target[p]
    if value is _DELETE:
        target.pop(path[-1], None)
    else:
        target[path[-1]] = value


_DELETE = object()


@st.composite
def one_corruption(draw, msg):
    """(path, new value or _DELETE, expected outcome) for one field of `msg`."""
    i = draw(st.integers(0, len(msg["items"]) - 1))
    item = ("items", i)
    px = item + ("pixels",)
    n = msg["items"][i]["pixels"]["shape"][0]
    other_size = "float32" if msg["items"][i]["pixels"]["dtype"] != "float32" else "float16"
    choices = [
        (("v",), st.one_of(st.just(_DELETE), st.integers(2, 9), NON_INT), DROP),
        (("type",), st.one_of(st.just(_DELETE), NON_STR), DROP),
        (("type",), st.sampled_from(["alloc", "Encode", "", "register", "status"]), DROP),
        (("room",), st.one_of(st.just(_DELETE), NON_INT, HUGE), DROP),
        (("request_id",), st.one_of(st.just(_DELETE), NON_STR, st.just(""), st.just("r" * 129)), FAIL),
        (("items",), st.one_of(st.just(_DELETE), NON_LIST, st.just([]), st.just([{}] * 9)), FAIL),
        (("deadline_ms",), st.one_of(NON_INT.filter(lambda x: x is not None), st.integers(-(2**40), 0),
                                     st.integers(10**9 + 1, 2**63)), FAIL),
        (("deadline_ms",), st.just(_DELETE), VALID),
        (item, NON_MAP, FAIL),
        (item + ("modality",), st.one_of(st.just(_DELETE), NON_STR, st.sampled_from(["audio", "IMAGE"])), FAIL),
        (item + ("grid_thw",), st.one_of(st.just(_DELETE), NON_LIST, st.just([]),
                                         st.sampled_from([[[1, 4]], [[0, 4, 4]], [[1, 3, 4]], [[1, -2, 2]],
                                                          [[1, 2**21, 2]], [[1.0, 2.0, 2.0]]])), FAIL),
        (px, st.one_of(st.just(_DELETE), NON_MAP), FAIL),
        (px + ("shape",), st.one_of(st.just(_DELETE), NON_LIST, st.sampled_from(
            [[n], [n + 1, PATCH_DIM], [n, PATCH_DIM - 1], [0, PATCH_DIM], [n, PATCH_DIM, 1], [-n, PATCH_DIM]])), FAIL),
        (px + ("dtype",), st.one_of(st.just(_DELETE), NON_STR, st.just("int8"), st.just(other_size)), FAIL),
        (px + ("data",), st.one_of(st.just(_DELETE), NON_STR.filter(lambda x: not isinstance(x, bytes)),
                                   st.binary(max_size=64)), FAIL),
        (px + ("shm",), st.text(max_size=10), FAIL),
        (item + ("hash",), st.one_of(NON_INT.filter(lambda x: x is not None), HUGE), FAIL),
        (item + ("hash",), st.integers(0, 2**64 - 1), VALID),
        (("colour",), st.integers(-5, 5), VALID),
        (item + ("extra",), st.text(max_size=5), VALID),
    ]
    path, values, outcome = draw(st.sampled_from(choices))
    return path, draw(values), outcome


@pytest.mark.parametrize("mode", ["inprocess"])
def test_hypothesis_encode_with_one_field_corrupted(mode, shm_prefix, tmp_path):
    w = start_worker(mode, sim_config(shm_prefix, tmp_path, max_items_per_request=8))
    client = Client(w.cfg.intake, shm_prefix)
    rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=32 << 20)
    rig = Rig(w, client, rx, shm_prefix, [])
    try:
        @settings(max_examples=40, deadline=None)
        @given(st.data())
        def run(data):
            msg, items = data.draw(encode_messages())
            room = next(_rooms)
            msg["room"] = room
            path, value, outcome = data.draw(one_corruption(msg))
            _set(msg, path, value)
            before = sum(w.stats()["intake_dropped"].values())
            client.send_raw(pack(msg))
            if outcome == DROP:
                probe = rig.send_healthy(room % 7)
                assert rx.wait({probe: 1}, 30) and probe not in rx.failed
                assert sum(w.stats()["intake_dropped"].values()) == before + 1
                assert rig.outcome(room) is None
            elif outcome == FAIL:
                rx.alloc(room, 0, **SPAN4)
                assert rx.wait({room: 1}, 30)
                assert room in rx.failed and len(rx.failed[room]) > 5, rx.failed.get(room)
            else:
                for i, it in enumerate(items):
                    rx.alloc(room, i, span=span_of(it), hidden=64, dtype="bfloat16", deepstack_width=32)
                assert rx.wait({room: len(items)}, 30)
                assert room not in rx.failed, rx.failed[room]
                for i, it in enumerate(items):
                    main, deep = expected_sim_rows(it.pixels, it.modality, span_of(it), 64, 32, "bfloat16")
                    got_main, got_deep = rx.rows(room, i)
                    assert np.array_equal(got_main, main) and np.array_equal(got_deep, deep)
            rx.release(room)
            probe = rig.send_healthy(room % 5)
            assert rx.wait({probe: 1}, 30) and probe not in rx.failed, rx.failed.get(probe)
            rx.release(probe)
            rig.healthy.clear()

        run()
        assert not rx.violations, rx.violations
        rig.assert_alive()
    finally:
        rx.close()
        client.close()
        w.close()


@st.composite
def boot_messages(draw, room, dst, ds):
    """A valid register, alloc or cancel from the schema, one field corrupted: (msg, outcome)."""
    kind = draw(st.sampled_from(["alloc", "alloc", "alloc", "register", "cancel"]))
    if kind == "register":
        msg = {"v": 1, "type": "register", "receiver": "spare", "session": "127.0.0.1:1",
               "status": "tcp://127.0.0.1:1"}
        choices = [
            (("receiver",), st.one_of(st.just(_DELETE), NON_STR, st.just(""), st.just("r" * 257)), DROP),
            (("session",), st.one_of(st.just(_DELETE), NON_STR, st.just("")), DROP),
            (("status",), st.one_of(st.just(_DELETE), NON_STR, st.sampled_from(
                ["", "tcp://", "tcp://h", "tcp://h:0", "tcp://h:65536", "ipc://", "inproc://x", "tcp://*:1"])), DROP),
            (("v",), st.one_of(st.just(_DELETE), NON_INT), DROP),
            (("extra",), st.integers(-5, 5), VALID),
        ]
    elif kind == "cancel":
        msg = {"v": 1, "type": "cancel", "receiver": "evil", "room": room}
        choices = [
            (("receiver",), st.one_of(st.just(_DELETE), NON_STR, st.just("nobody")), DROP),
            (("room",), st.one_of(st.just(_DELETE), NON_INT, HUGE), DROP),
            (("extra",), st.integers(-5, 5), "canceled"),
        ]
    else:
        msg = {"v": 1, "type": "alloc", "receiver": "evil", "room": room, "item": 0, "dst": dst,
               "dst_deepstack": ds, "row_start": 0, "n_rows": 4, "fanout": 1, **SPAN4}
        choices = [(("receiver",), st.one_of(st.just(_DELETE), NON_STR, st.just("nobody")), DROP),
                   (("type",), st.one_of(st.just(_DELETE), NON_STR, st.just("allocate")), DROP)]
        for key in ("room", "dst", "dst_deepstack", "item", "row_start", "n_rows", "span", "hidden",
                    "deepstack_width", "fanout"):
            choices.append(((key,), st.one_of(st.just(_DELETE), NON_INT, HUGE), DROP))
        choices += [
            (("dtype",), st.one_of(st.just(_DELETE), NON_STR, st.just("int8")), DROP),
            (("fanout",), st.sampled_from([0, 1025]), DROP),
            (("item",), st.integers(1, 2**40), FAIL),
            (("span",), st.sampled_from([0, 3, 5, 2**40]), FAIL),
            (("hidden",), st.sampled_from([0, 63, 65, 2**40]), FAIL),
            (("deepstack_width",), st.sampled_from([0, 31, 33]), FAIL),
            (("dtype",), st.sampled_from(["float32", "float16"]), FAIL),
            (("row_start",), st.integers(1, 2**40), FAIL),
            (("n_rows",), st.integers(5, 2**40), FAIL),
            (("n_rows",), st.integers(1, 3), FAIL),     # leaves a gap: the tiling check
            (("dst",), st.just(0), FAIL),
            (("dst_deepstack",), st.just(0), FAIL),
            (("fanout",), st.integers(2, 1024), FAIL),  # never completes: bootstrap_timeout_s
            (("extra",), st.integers(-5, 5), VALID),
        ]
    path, values, outcome = draw(st.sampled_from(choices))
    _set(msg, path, draw(values))
    return msg, outcome


def test_hypothesis_bootstrap_with_one_field_corrupted(shm_prefix, tmp_path):
    w = start_worker("inprocess", sim_config(shm_prefix, tmp_path, bootstrap_timeout_s=2.0))
    client = Client(w.cfg.intake, shm_prefix)
    rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=16 << 20)
    mem = Receiver("mem", w.cfg.bootstrap, buffer_bytes=1 << 20)
    evil = RawPeer("evil", w.cfg.bootstrap, mem)
    rig = Rig(w, client, rx, shm_prefix, [])
    try:
        @settings(max_examples=40, deadline=None)
        @given(st.data())
        def run(data):
            room = next(_rooms)
            evil._next = 0
            dst, ds = evil.dst(4)
            msg, outcome = data.draw(boot_messages(room, dst, ds))
            it = Item("image", *image(room % 11))
            client.encode(room, "hyp", [it], inline=True)
            before = sum(w.stats()["sender_dropped"].values())
            if outcome == "canceled":  # the receiver of a room that waits for its second shard
                rx.alloc(room, 0, **{**SPAN4, "fanout": 2, "n_rows": 2})
                time.sleep(0.2)  # its alloc in first (another connection)
            evil.send(msg)
            if outcome == DROP:
                end = time.monotonic() + 10
                while sum(w.stats()["sender_dropped"].values()) == before and time.monotonic() < end:
                    time.sleep(0.02)
                assert sum(w.stats()["sender_dropped"].values()) == before + 1
            elif outcome == VALID and msg["type"] == "alloc":
                assert evil.wait([room], 30, state="success"), evil.statuses.get(room)
                main, _ = expected_sim_rows(it.pixels, "image", 4, 64, 32, "bfloat16")
                assert np.array_equal(evil.rows(dst, 4), main)
            elif outcome == "canceled":
                assert rx.wait({room: 1}, 30) and rx.failed[room] == "canceled", rx.failed.get(room)
                rx.release(room)
            elif outcome == FAIL:
                assert evil.wait([room], 30), (msg, evil.statuses.get(room))
                assert len(evil.reason(room)) > 5, evil.reason(room)
            probe = rig.send_healthy(room % 5)
            assert rx.wait({probe: 1}, 30) and probe not in rx.failed, rx.failed.get(probe)
            rx.release(probe)
            rig.healthy.clear()

        run()
        assert not [s for ss in evil.statuses.values() for s in ss
                    if [x["state"] for x in ss].count("failed") > 1], "a second failed"
        rig.assert_alive()
    finally:
        evil.close()
        mem.close()
        rx.close()
        client.close()
        w.close()


def test_a_failed_heard_before_the_receivers_alloc_concludes_the_room_when_it_allocates():
    """A worker that cannot know who allocated (its sender died) tells every registered
    receiver `failed`, once: one that allocates for the room only afterwards hears nothing
    more, so the receiver keeps the early status and the room concludes at its alloc."""
    rx = Receiver("rx-early", f"tcp://127.0.0.1:{free_port()}", buffer_bytes=1 << 20)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(rx.status_endpoint)
    try:
        push.send(_status(42, reason="the sender stage died while it held this room"))
        deadline = time.monotonic() + 10
        while not rx.early_failed and time.monotonic() < deadline:  # nothing to apply yet
            assert rx.poll(0.05) == []
        assert 42 not in rx.failed and not rx.violations
        rx.alloc(42, 0, span=4, hidden=64, dtype="bfloat16")
        assert rx.concluded(42, 1) and rx.failed[42] == "the sender stage died while it held this room"
        assert [st["room"] for st in rx.poll()] == [42]  # reported once, as if it came now
        assert rx.poll() == [] and not rx.violations
    finally:
        push.close()
        rx.workers.popitem()[1].close(linger=0)
        rx.close()


# ================================================================ bootstrap under CurveZMQ

from pipeline.peers import curve  # noqa: E402
from tests.peers.test_curve import Pusher, certs, peer  # noqa: E402,F401 (certs: the key pairs' fixture)

REFUSED_KEY = "naming a receiver registered under another key"
# (name, build(room of the owner's, owner) -> a message naming the owner, 'rx'): each sent
# by a peer with another admitted key, and by a stranger's key and a peer without CURVE.
CURVE_CASES = [
    ("register under another's id", lambda room, rx: {"type": "register", "session": "127.0.0.1:1",
                                                      "status": "tcp://127.0.0.1:1"}),
    ("register under another's id, its own session and status",
     lambda room, rx: {"type": "register", "session": rx.engine.session, "status": rx.status_endpoint}),
    ("alloc naming another receiver, into its memory",
     lambda room, rx: {"type": "alloc", "room": room, "item": 0, "dst": rx.address, "dst_deepstack": rx.address + 4096,
                       "row_start": 0, "n_rows": 4, "fanout": 1, **SPAN4}),
    ("alloc naming another receiver, a room not seen yet",
     lambda room, rx: {"type": "alloc", "room": room + 10**6, "item": 0, "dst": rx.address,
                       "dst_deepstack": rx.address + 4096, "row_start": 0, "n_rows": 4, "fanout": 1, **SPAN4}),
    ("self-describing alloc naming another receiver, its own session and status",
     lambda room, rx: {"type": "alloc", "room": room, "item": 0, "dst": rx.address, "dst_deepstack": rx.address + 4096,
                       "row_start": 0, "n_rows": 4, "fanout": 1, "session": rx.engine.session,
                       "status": rx.status_endpoint, "incarnation": 1, **SPAN4}),
    ("self-describing alloc naming another receiver, a session of its own",
     lambda room, rx: {"type": "alloc", "room": room + 10**6, "item": 0, "dst": 4096, "dst_deepstack": 8192,
                       "row_start": 0, "n_rows": 4, "fanout": 1, "session": "127.0.0.1:1",
                       "status": "tcp://127.0.0.1:1", **SPAN4}),
    ("cancel of another's room", lambda room, rx: {"type": "cancel", "room": room}),
    ("cancel naming another receiver, a room unknown", lambda room, rx: {"type": "cancel", "room": 2**64 - 1}),
]


@pytest.mark.parametrize("mode", ["inprocess", "pipeline"])
def test_bootstrap_corpus_under_curve(mode, shm_prefix, tmp_path, certs):
    """A receiver id is its first key's: another admitted key naming it is refused and
    counted, whatever it sends; a key not admitted, and a peer without CURVE, are not
    heard at all. The owner's rooms are served bit for bit meanwhile."""
    w = start_worker(mode, sim_config(shm_prefix, tmp_path, curve_cert=certs["worker"],
                                      curve_clients=certs["clients"]))
    made = [w]
    try:
        client = Client(w.cfg.intake, None, **peer(certs, "gateway"))
        rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=16 << 20, **peer(certs, "rx"))
        made += [client, rx]
        r = Rig(w, client, rx, shm_prefix, made)
        r.send_healthy(0)
        r.check_healthy()  # registered, under its key
        worker_public = curve.load_public(certs["worker_public"])
        thief = Pusher(w.cfg.bootstrap, (curve.load_keypair(certs["other"]), worker_public))
        stranger = Pusher(w.cfg.bootstrap, (curve.load_keypair(certs["stranger"]), worker_public))
        plain = Pusher(w.cfg.bootstrap)
        made += [thief, stranger, plain]
        expected = Counter()
        for k, (name, build) in enumerate(CURVE_CASES):
            msg = {"v": 1, "receiver": "rx", **build(r.send_healthy(k + 1), rx)}
            for p in (thief, stranger, plain):
                p.send(msg)
            expected[msg["type"]] += 1
        assert stranger.refused() and plain.refused()
        end = time.monotonic() + 30
        while sum(w.stats()["sender_dropped"].values()) < sum(expected.values()) and time.monotonic() < end:
            time.sleep(0.1)
        dropped = w.stats()["sender_dropped"]
        for kind, n in expected.items():
            assert counted(dropped, f"{kind} {REFUSED_KEY}") == n, (kind, dropped)
        assert sum(dropped.values()) == sum(expected.values()), dropped
        r.check_healthy()
        assert w.stats()["receivers_registered"] == 1
        r.assert_alive()
    finally:
        for obj in reversed(made):
            obj.close()


# ================================================================ rooms of other keys under CurveZMQ (#32)

class RoomsCtx:
    """An owner's rooms (gateway 'gateway', receiver 'rx') and a thief under another
    admitted key ('other'): a `Receiver` for its memory and status socket, and a raw
    socket under the same key for what the library would not send."""

    def __init__(self, w, client: Client, rx: Receiver, rx_key: str, thief: Receiver, raw):
        self.w, self.client, self.rx, self.rx_key, self.thief, self.raw = w, client, rx, rx_key, thief, raw
        self.items: dict[int, list[Item]] = {}  # the owner's rooms: served bit for bit
        self.owned: set[tuple[int, int]] = set()  # (room, item) the owner allocated already
        self._next = 0

    def entry(self, room: int):
        rooms = self.w.runtime.rooms
        slot = rooms.find(room)
        return None if slot is None else rooms.get(slot)

    def wait_for(self, cond, what: str, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < end, what
            time.sleep(0.02)

    def open(self, room: int, named: bool = True, n_items: int = 1) -> None:
        """The owner's room, in the table before anything else is sent (so that what the
        thief sends meets a room the worker holds, and each refusal is counted)."""
        items = [Item("image", *image((room + i) % 97)) for i in range(n_items)]
        msg = self.client.message(room, f"owned-{room}", items, inline=True)
        self.client.send({**msg, "receivers": [self.rx_key]} if named else msg)
        self.items[room] = items
        self.wait_for(lambda: self.entry(room) is not None, f"room {room} was not opened")

    def own(self, room: int, item: int = 0) -> None:
        """The owner's alloc, written before anything else is sent (the first claims a room
        that names no receiver)."""
        self.rx.alloc(room, item, **SPAN4)
        self.owned.add((room, item))
        self.wait_for(lambda: self.rx.poll(0.02) is None or (room, item) in self.rx.success,
                      f"room {room} item {item} was not written")

    def alloc(self, room: int, item: int = 0, **over) -> None:
        off, self._next = self._next, self._next + 4096
        self.send({"type": "alloc", "room": room, "item": item, "dst": self.thief.address + off,
                   "dst_deepstack": self.thief.address + off + 1024, "row_start": 0, "n_rows": 4,
                   "fanout": 1, **SPAN4, **over})

    def cancel(self, room: int) -> None:
        self.send({"type": "cancel", "room": room})

    def query(self, room: int) -> None:
        self.send({"type": "query", "room": room})

    def send(self, msg: dict) -> None:
        self.raw.send(pack({"v": 1, "receiver": "thief", **msg}))

    def failed_at_intake(self, room: int) -> None:
        self.client.send({"v": 1, "type": "encode", "request_id": "a tenant's secret", "room": room, "items": []})
        self.wait_for(lambda: self.entry(room) is not None, f"room {room} was not failed")


UNKNOWN = "unknown room"
# (name, what the thief hears of the room: a failed status's reason, or None (nothing),
#  {message kind: refusals counted}, build(ctx, room)). The last ones are a room never
# opened: what each refusal must be indistinguishable from.
ROOM_CASES = [
    ("alloc into a room named for another key", UNKNOWN, {"alloc": 1},
     lambda c, r: (c.open(r), c.alloc(r))),
    ("alloc into a room before it opens", UNKNOWN, {"alloc": 1},
     lambda c, r: (c.alloc(r), c.open(r))),
    ("alloc for half of a named room's rows", UNKNOWN, {"alloc": 1},
     lambda c, r: (c.open(r), c.alloc(r, fanout=2, n_rows=2))),
    ("self-describing alloc into a named room", UNKNOWN, {"alloc": 1},
     lambda c, r: (c.open(r), c.alloc(r, session=c.thief.engine.session, status=c.thief.status_endpoint,
                                              incarnation=c.thief.incarnation))),
    ("alloc into a room its first alloc claimed", UNKNOWN, {"alloc": 1},
     lambda c, r: (c.open(r, named=False, n_items=2), c.own(r, 0), c.alloc(r, 1))),
    ("cancel of a named room", None, {"cancel": 1}, lambda c, r: (c.open(r), c.cancel(r))),
    ("cancel of a claimed room", None, {"cancel": 1},
     lambda c, r: (c.open(r, named=False, n_items=2), c.own(r, 0), c.cancel(r))),
    ("alloc then cancel of a named room", "canceled", {"alloc": 1, "cancel": 1},
     lambda c, r: (c.open(r), c.alloc(r), c.cancel(r))),
    ("query of a live named room", UNKNOWN, {"query": 1}, lambda c, r: (c.open(r), c.query(r))),
    ("query of a room that failed at intake", UNKNOWN, {"query": 1}, lambda c, r: (c.failed_at_intake(r), c.query(r))),
    ("alloc into a room failed at intake", UNKNOWN, {"alloc": 1},
     lambda c, r: (c.failed_at_intake(r), c.alloc(r))),
    ("never opened: alloc", UNKNOWN, {}, lambda c, r: c.alloc(r)),
    ("never opened: cancel", None, {}, lambda c, r: c.cancel(r)),
    ("never opened: alloc then cancel", "canceled", {}, lambda c, r: (c.alloc(r), c.cancel(r))),
    ("never opened: query", UNKNOWN, {}, lambda c, r: c.query(r)),
]


@pytest.mark.parametrize("mode", ["inprocess", "pipeline"])
def test_rooms_of_other_keys_under_curve(mode, shm_prefix, tmp_path, certs):
    """Another admitted key's alloc, cancel or query for a room of the owner's keys is
    refused and counted, and the thief hears of it exactly what it hears of a room never
    opened; the owner's rooms are served bit for bit, none fails, no row reaches the thief."""
    w = start_worker(mode, sim_config(shm_prefix, tmp_path, curve_cert=certs["worker"],
                                      curve_clients=certs["clients"], bootstrap_timeout_s=2.0))
    made = [w]
    try:
        client = Client(w.cfg.intake, None, **peer(certs, "gateway"))
        rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=16 << 20, **peer(certs, "rx"))
        thief = Receiver("thief", w.cfg.bootstrap, buffer_bytes=16 << 20, **peer(certs, "other"))
        made += [client, rx, thief]
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        curve.connect_as(raw, *curve.peer_keys(certs["other"], certs["worker_public"]))
        raw.connect(w.cfg.bootstrap)
        made.append(raw)
        c = RoomsCtx(w, client, rx, curve.load_public(certs["rx"]).decode(), thief, raw)
        # The raw socket is another connection than the one the thief registered on.
        c.wait_for(lambda: w.stats().get("receivers_registered") == 2, "the receivers did not register")
        rooms, expected = {}, Counter()
        for name, hears, refused, build in ROOM_CASES:
            room = next(_rooms)
            build(c, room)
            rooms[room] = (name, hears)
            expected.update(refused)
        for room, items in c.items.items():  # the owner's remaining allocs
            for i in range(len(items)):
                if (room, i) not in c.owned:
                    rx.alloc(room, i, **SPAN4)
        rx.wait({room: len(items) for room, items in c.items.items()}, 60)
        owner = {rooms[room][0]: rx.failed.get(room) or ("served" if all((room, i) in rx.success for i in range(len(items)))
                                                          else "nothing heard") for room, items in c.items.items()}
        assert set(owner.values()) == {"served"}, owner
        for room, items in c.items.items():
            for i, it in enumerate(items):
                main, deep = expected_sim_rows(it.pixels, "image", 4, 64, 32, "bfloat16")
                got_main, got_deep = rx.rows(room, i)
                assert np.array_equal(got_main, main) and np.array_equal(got_deep, deep), rooms[room][0]
        heard = lambda room: (thief.early_failed.get(room) or {}).get("reason")  # noqa: E731
        end = time.monotonic() + 60
        while any(heard(room) != hears for room, (_, hears) in rooms.items() if hears) and time.monotonic() < end:
            thief.poll(0.1)
        thief.poll(0.5)  # what else it is told, if anything
        got = {name: heard(room) for room, (name, _) in rooms.items()}
        assert got == {name: hears for name, hears in rooms.values()}, got
        assert not thief.success and not thief.dropped.get("no shard"), thief.dropped
        refused = lambda: w.stats().get("sender_refused")  # noqa: E731 (the pipeline's stats come a little later)
        c.wait_for(lambda: refused() == dict(expected), f"refusals counted: {refused()}, expected {dict(expected)}")
        assert not any(e.state.name == "FAILED" for room in c.items if (e := c.entry(room)) is not None)
    finally:
        for obj in reversed(made):
            obj.close()


# ---------------------------------------------------------------- http(s) media URLs (issue #35)
from tests.ipc.test_fetch import default_routes, http_server  # noqa: E402

URL_CAP = 4096  # media_url_max_bytes of the worker below: the test server's big bodies pass it


def _url_cases(port: int) -> list[tuple[str, object, str]]:
    """(name, media.url, what the room's failure says): URLs a hostile gateway may send a
    worker that fetches from 127.0.0.1 only, each failing its own room."""
    local = f"http://127.0.0.1:{port}"
    return [
        ("not a string", 7, "media.url must be"),
        ("file scheme", "file:///etc/passwd", "media.url must be"),
        ("gopher scheme", "gopher://127.0.0.1:70/", "media.url must be"),
        ("user info", f"http://user:pw@127.0.0.1:{port}/img.png", "user name or password"),
        ("user info hiding the host", f"http://127.0.0.1:{port}@169.254.169.254/", "user name or password"),
        ("decimal address", "http://2130706433/img.png", "not a host name"),
        ("hex address", "http://0x7f.1/img.png", "not a host name"),
        ("ipv6 zone", "http://[fe80::1%25eth0]/", "IPv6 zone"),
        ("bad port", "http://127.0.0.1:0x50/", "port"),
        ("control characters", f"{local}/img.png\r\nX-Injected: 1", "control characters"),
        ("too long", f"{local}/" + "a" * 3000, "1..2048"),
        ("cloud metadata", "http://169.254.169.254/latest/meta-data/", "not one this worker fetches from"),
        ("loopback v6", f"http://[::1]:{port}/img.png", "not one this worker fetches from"),
        ("loopback by name", f"http://localhost:{port}/img.png", "not one this worker fetches from"),
        ("redirect to metadata", f"{local}/redirect", "follows no redirect"),
        ("404", f"{local}/missing", "answered 404"),
        ("Content-Length over the cap", f"{local}/claims-big", "media_url_max_bytes"),
        ("chunked over the cap", f"{local}/chunked-big", "media_url_max_bytes"),
        ("unsized over the cap", f"{local}/unsized-big", "media_url_max_bytes"),
        ("compressed though asked not", f"{local}/gzip", "compressed (gzip)"),
        ("an error page as 200", f"{local}/html", "not a png file"),
        ("a byte at a time", f"{local}/drip", "longer than media_url_timeout_s"),
        ("no answer", f"{local}/slow", "longer than media_url_timeout_s"),
    ]


def test_media_url_corpus(rig):
    """Hostile http(s) media URLs: each fails its own room with a reason naming what to
    fix, and the healthy rooms sent among them are served, no stage restarting."""
    import threading

    release = threading.Event()
    with http_server(default_routes(release)) as server:
        r = rig(media_url_hosts="127.0.0.1", media_url_max_bytes=URL_CAP, media_url_timeout_s=1.0)
        fails = {}
        try:
            for k, (name, url, text) in enumerate(_url_cases(server.server_address[1])):
                room = next(_rooms)
                r.client.send({"v": 1, "type": "encode", "request_id": f"url-{room}", "room": room,
                               "items": [{"modality": "image", "grid_thw": [[1, 4, 4]],
                                          "media": {"format": "png", "url": url}}]})
                r.rx.alloc(room, 0, **SPAN4)
                fails[room] = (name, text)
                if k % 4 == 3:
                    r.send_healthy(k)
            assert r.rx.wait({room: 1 for room in fails}, 60), [fails[x] for x in fails if x not in r.rx.failed]
            for room, (name, text) in fails.items():
                assert text in r.rx.failed[room], f"{name}: {r.rx.failed[room]!r}"
            r.check_healthy()
            r.assert_alive()
        finally:
            release.set()
