"""Bounds that hold under any legal load (issue #22, item 1): a burst of requests within
every limit, and a flood of large inline requests while the worker cannot progress.

The burst: many requests of many tiny items, their allocs sent only once the worker has
taken all it can. Every room must succeed, no stage restart, every segment unlinked: a
stage that cannot lease waits (and its socket pushes back) instead of raising.

The flood: inline requests of a few MiB while no alloc ever comes and the embedding arena
is small. Intake's private memory must stay within a bound derived from the settings
(the socket's frames at most, times the largest frame), and the gateway's socket must
block: a non-blocking send gets `zmq.Again`.
"""
from __future__ import annotations

import itertools
import os
import time

import msgpack
import numpy as np
import psutil
import pytest
import zmq

from ipc import shm, wire
from ipc.arena import Arena
from ipc.rooms import RoomTable
from pipeline.runtime import wiring
from pipeline.peers.client import Client, Item
from pipeline.peers.receiver import Receiver
from stages import registry
from stages.intake import IntakeStage
from stages.records import RoomFailure, RoomOpened
from tests.helpers import PATCH_DIM, image, sim_config, start_worker

pytestmark = pytest.mark.timeout(240)
_rooms = itertools.count(90_000)
ROW = dict(hidden=64, dtype="bfloat16", deepstack_width=32)  # the sim tower of sim_config

# The burst: 9,600 tiny items (18,816 bytes of pixels each, five 4 KiB blocks), within
# every limit. With 4,096 lease slots per arena, as before they were sized from the
# limits, the embedding arena's slots fill first and then the pixel arena's, while its
# blocks would hold 4,505 items. Sized from the limits, the embedding arena holds every
# item's rows, so the drain once the allocs come is quick.
BURST_REQUESTS = 150
BURST_ITEMS = 64
BURST = dict(pixel_arena_bytes=88 << 20, embedding_arena_bytes=48 << 20, arena_cache_bytes=1 << 20,
             max_live_rooms=1024)
ALLOCS_AFTER_S = 8.0  # at the latest; earlier once the worker holds all it can

# The flood: 1,024 float32 patches of the sim tower per request (4.8 MB inline).
FLOOD_GRID = (1, 32, 32)
FLOOD_MAX_PIXEL_BYTES = 8 << 20
FLOOD_FRAMES = 150
FLOOD = dict(max_pixel_bytes_per_request=FLOOD_MAX_PIXEL_BYTES, embedding_arena_bytes=1 << 20,
             arena_cache_bytes=256 << 10)
SLACK_BYTES = 96 << 20  # the interpreter's own growth while it serves (allocator pools, imports)


def restarts(w) -> int:
    return sum(w.stats().get("restarts", {}).values()) if w.mode == "pipeline" else 0


def alive(w) -> bool:
    if w.mode == "pipeline":
        return w.runtime.fatal is None and all(p.is_alive() for p in w.runtime.procs.values())
    return w.thread.is_alive() and w.error is None


def client_segments(prefix: str) -> list[str]:
    return [e for e in os.listdir(shm.SHM_DIR) if e.startswith(f"{prefix}.px.")]


def intake_waits(w) -> bool:
    if w.mode == "inprocess":
        return not w.runtime.stages[registry.INTAKE].takes_frames()
    return bool(w.stats().get("intake_waiting"))


# ================================================================ intake's own bounds

class IntakeRig:
    """An intake stage over real shared memory, without sockets: frames go straight to handle()."""

    def __init__(self, prefix, *, max_leases=4096, table=64):
        run_id = shm.new_run_id()
        self.arena = Arena.create(prefix, run_id, "pixels", 4 << 20, max_leases=max_leases)
        self.rooms = RoomTable.create(prefix, run_id, "rooms", table)
        self.sent: list[tuple[str, object]] = []
        self.stage = IntakeStage(lambda dest, rec: self.sent.append((dest, rec)), prefix=prefix,
                                 pixel_arena=self.arena, rooms=self.rooms, patch_dim=PATCH_DIM, merge=2,
                                 row_bytes=192, emb_arena_bytes=32 << 20, max_items_per_request=8,
                                 max_pixel_bytes_per_request=1 << 20, max_live_rooms=1000)

    def send(self, room: int, n_items: int = 1, **over) -> list[tuple[str, object]]:
        items = [{"modality": "image", "grid_thw": [[1, 4, 4]],
                  "pixels": {"data": image(room * 8 + i)[1].tobytes(), "shape": [16, PATCH_DIM],
                             "dtype": "float32"}} for i in range(n_items)]
        msg = {"v": 1, "type": "encode", "request_id": f"r-{room}", "room": room, "items": items, **over}
        self.stage.handle("socket", wire.encode(msg))
        sent, self.sent = self.sent, []
        return sent

    def close(self) -> None:
        for obj in (self.arena, self.rooms):
            obj.close()
            obj.unlink()


def test_intake_waits_when_every_lease_slot_is_live(shm_prefix):
    """A request needing more lease slots than are free waits (no ArenaFull out of the
    stage), its frame's successors in the socket; it goes once the slots are free."""
    rig = IntakeRig(shm_prefix, max_leases=4)
    try:
        assert any(isinstance(r, RoomOpened) for _, r in rig.send(1, n_items=2))
        assert rig.send(2, n_items=3) == [] and not rig.stage.takes_frames()
        assert rig.stage.stats()["intake_waiting"] == 1
        rig.stage.tick(time.monotonic())
        assert rig.sent == [] and not rig.stage.takes_frames()  # still no room
        for lease in rig.arena.live_leases():
            rig.arena.drop(lease, rig.stage.owner)
        rig.stage.tick(time.monotonic())
        assert rig.stage.takes_frames()
        assert [r.room for _, r in rig.sent if isinstance(r, RoomOpened)] == [2, 2]  # to the reaper and sender
    finally:
        rig.close()


def test_full_room_table_answers_worker_busy(shm_prefix):
    """A request the room table has no slot for is failed with a reason, to the reaper
    (which tells its receivers), valid or not; nothing is dropped without a word."""
    rig = IntakeRig(shm_prefix, table=2)
    try:
        for room in (1, 2):
            assert any(isinstance(r, RoomOpened) for _, r in rig.send(room))
        for room, over in ((3, {}), (4, {"deadline_ms": -1})):
            (dest, rec), = rig.send(room, **over)
            assert dest == registry.REAPER and isinstance(rec, RoomFailure)
            assert rec.slot is None and rec.room == room
            assert rec.reason.startswith("worker busy: room table full"), rec.reason
            assert rec.code == "table_full"
        stats = rig.stage.stats()
        assert stats["intake_failed"] == {"worker busy": 2} and not stats["intake_dropped"], stats
    finally:
        rig.close()


# ================================================================ the burst

def test_burst_of_legal_requests_loses_no_room(mode, shm_prefix, tmp_path):
    w = start_worker(mode, sim_config(shm_prefix, tmp_path, **BURST))
    client = Client(w.cfg.intake, shm_prefix)
    rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=8 << 20)
    rooms = []
    try:
        seeds = itertools.count()
        for _ in range(BURST_REQUESTS):
            room = next(_rooms)
            items = [Item("image", *image(next(seeds), grid=(1, 2, 2))) for _ in range(BURST_ITEMS)]
            client.encode(room, f"burst-{room}", items)
            rooms.append(room)
        # Allocs once the worker has taken all it can (its intake waits, or a stage died),
        # or at the latest ALLOCS_AFTER_S after the last request.
        end = time.monotonic() + ALLOCS_AFTER_S
        while time.monotonic() < end and alive(w) and not restarts(w) and not intake_waits(w):
            time.sleep(0.1)
        for room in rooms:
            for i in range(BURST_ITEMS):
                rx.alloc(room, i, span=1, **ROW)
        rx.wait({room: BURST_ITEMS for room in rooms}, 150 if alive(w) else 1)
        succeeded = sum(1 for r in rooms if r not in rx.failed and rx.concluded(r, BURST_ITEMS))
        reasons = sorted({rx.failed[r].split(":")[0][:60] for r in rooms if r in rx.failed})
        left = client_segments(shm_prefix)
        n_restarts = restarts(w)
        print(f"\nburst ({mode}): {succeeded} of {len(rooms)} rooms succeeded, {n_restarts} stage "
              f"restarts, {len(left)} segments never unlinked, worker alive: {alive(w)}; failed: {reasons}")
        assert alive(w), w.error if mode == "inprocess" else w.runtime.fatal
        assert n_restarts == 0
        assert succeeded == len(rooms), reasons
        assert not left
        assert not rx.violations, rx.violations[:3]
    finally:
        for entry in client_segments(shm_prefix):
            os.unlink(os.path.join(shm.SHM_DIR, entry))
        rx.close()
        client.close()
        try:
            w.close()
        except Exception as e:  # an in-process worker that ended: its error was reported above
            print(f"closing the worker: {e!r}")


# ================================================================ the flood

def private_bytes(pid: int) -> int:
    return psutil.Process(pid).memory_full_info().uss


def flood_frame(room: int, base: np.ndarray, n: int) -> bytes:
    px = base.copy()
    px[0, 0] = n  # each request its own pixels: no cache hit, no shared encode
    t, h, ww = FLOOD_GRID
    return msgpack.packb({"v": 1, "type": "encode", "request_id": f"flood-{room}", "room": room,
                          "items": [{"modality": "image", "grid_thw": [list(FLOOD_GRID)],
                                     "pixels": {"data": px.tobytes(), "shape": [t * h * ww, PATCH_DIM],
                                                "dtype": "float32"}}]}, use_bin_type=True)


def memory_bound(cfg, mode: str) -> int:
    """What intake may hold beyond its start: its socket's frames (and the one ZeroMQ is
    reading) of the largest size, and in process the arenas and caches it shares a
    process with, which are its private pages there."""
    max_frame = cfg.max_pixel_bytes_per_request + (1 << 20) + 4096 * cfg.max_items_per_request
    bound = (wiring.SOCKET_QUEUE_FRAMES + 1) * max_frame + SLACK_BYTES
    if mode == "inprocess":
        bound += cfg.pixel_arena_bytes + cfg.embedding_arena_bytes + cfg.host_cache_bytes
    return bound


def test_flood_of_inline_requests_blocks_the_gateway(mode, shm_prefix, tmp_path):
    w = start_worker(mode, sim_config(shm_prefix, tmp_path, **FLOOD))
    gateway = zmq.Context.instance().socket(zmq.PUSH)
    gateway.setsockopt(zmq.SNDHWM, 1)  # the gateway's own queue stays small: only the worker's is measured
    gateway.setsockopt(zmq.LINGER, 0)
    gateway.connect(w.cfg.intake)
    rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=16 << 20)
    sent = []
    try:
        pid = w.runtime.procs[registry.INTAKE].pid if mode == "pipeline" else os.getpid()
        base = np.random.default_rng(7).standard_normal((FLOOD_GRID[1] * FLOOD_GRID[2], PATCH_DIM),
                                                         dtype=np.float32)
        span = FLOOD_GRID[1] * FLOOD_GRID[2] // 4
        # One room served first: what serving costs once is in the baseline.
        room = next(_rooms)
        gateway.send(flood_frame(room, base, -1))
        rx.alloc(room, 0, span=span, **ROW)
        assert rx.wait({room: 1}, 60) and room not in rx.failed, rx.failed.get(room)
        before = private_bytes(pid)
        blocked = False
        peak = before
        for n in range(FLOOD_FRAMES):
            room = next(_rooms)
            frame = flood_frame(room, base, n)
            try:
                gateway.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                # Full for now; blocked once it stays full while the worker cannot progress.
                if not gateway.poll(2000, zmq.POLLOUT):
                    blocked = True
                    break
                gateway.send(frame, zmq.NOBLOCK)
            sent.append(room)
            peak = max(peak, private_bytes(pid))
        for _ in range(10):
            peak = max(peak, private_bytes(pid))
            time.sleep(0.1)
        bound = memory_bound(w.cfg, mode)
        grew = peak - before
        print(f"\nflood ({mode}): {len(sent)} requests of {len(frame) / 2**20:.1f} MiB sent, gateway "
              f"blocked: {blocked}; intake's private memory {before / 2**20:.0f} MiB -> {peak / 2**20:.0f} MiB "
              f"(+{grew / 2**20:.0f} MiB, bound +{bound / 2**20:.0f} MiB)")
        assert blocked, f"the gateway sent {len(sent)} requests without blocking"
        assert grew <= bound, (grew, bound)
        # The worker keeps serving: once allocs come, every room sent succeeds.
        for room in sent:
            rx.alloc(room, 0, span=span, **ROW)
        assert rx.wait({room: 1 for room in sent}, 120), [r for r in sent if not rx.concluded(r, 1)][:5]
        assert not [r for r in sent if r in rx.failed], {r: rx.failed[r] for r in sent if r in rx.failed}
        assert alive(w) and restarts(w) == 0
    finally:
        gateway.close()
        rx.close()
        w.close()
