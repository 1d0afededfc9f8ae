"""`preprocess_workers` N > 1 (issue #35): N preprocess processes, each its own stage
(`preprocess0` ..), owner number and rings, supervised and restarted on its own.

The cache sends each miss of a compressed image to the live worker with the fewest
items outstanding, so both take work, a hung one is sent no more while another has
fewer, and a dead one's count is dropped at the supervisor's word of its death. A
worker killed (or stopped, then killed by the hang killer) with a window of rooms in
flight fails only the rooms it held, naming the preprocess stage; every other room is
served with the right rows, the other worker serving throughout, and rooms after it
are served too.
"""
from __future__ import annotations

import io
import itertools
import os
import signal
import threading
import time

import numpy as np
import PIL.Image
import psutil
import pytest

from ipc import media, shm
from ipc.arena import Arena
from pipeline.runtime import wiring
from pipeline.peers.client import Client, image_item
from pipeline.cli.config import ConfigError, WorkerConfig
from pipeline.peers.receiver import Receiver
from stages import registry
from stages.cache import CacheStage
from stages.embedding_cache import EmbeddingCache
from stages.records import (OWNER_CACHE, OWNER_INTAKE, PreprocessDone, PreprocessDown, PreprocessRestarted,
                            WorkItem)
from tests.helpers import expected_sim_rows, sim_config, start_worker

pytestmark = pytest.mark.timeout(180)
_rooms = itertools.count(370_000)
ROW = dict(hidden=64, dtype="bfloat16", deepstack_width=32)  # the sim tower of sim_config
BOUNDS = dict(image_min_pixels=28 * 28, image_max_pixels=112 * 112, max_decoded_pixels=16 << 20)
SETTINGS = media.ImageSettings(min_pixels=BOUNDS["image_min_pixels"], max_pixels=BOUNDS["image_max_pixels"])
WORKERS = ["preprocess0", "preprocess1"]


# ---------------------------------------------------------------- settings and names
def test_the_setting_is_bounded_and_names_itself():
    for bad in (0, registry.MAX_PREPROCESS_WORKERS + 1):
        with pytest.raises(ConfigError, match="preprocess_workers must be 1 to 8") as e:
            WorkerConfig(preprocess_workers=bad).resolved().validate()
        assert e.value.key == "preprocess_workers"
    WorkerConfig(preprocess_workers=registry.MAX_PREPROCESS_WORKERS).resolved().validate()


def test_one_worker_keeps_the_old_name_and_many_have_owners_of_their_own():
    assert registry.preprocess_names(1) == ["preprocess"]
    assert registry.owner_of("preprocess") == registry.OWNER_PREPROCESS
    assert registry.preprocess_names(2) == WORKERS
    # Every cap at once: every stage an owner number of its own, inside the arenas'
    # owner slots and the room table's custody bits.
    cfg = WorkerConfig(tower_replicas=registry.MAX_TOWER_REPLICAS,
                       preprocess_workers=registry.MAX_PREPROCESS_WORKERS).resolved().validate()
    names = registry.stage_names(cfg.tower_replicas, cfg.preprocess_workers)
    owners = [registry.owner_of(n) for n in names]
    assert len(set(owners)) == len(names)
    assert 0 not in owners  # the supervisor's
    assert max(owners) < wiring.arena_owners(cfg) <= 32
    assert registry.counts_of(names) == (cfg.tower_replicas, cfg.preprocess_workers)
    assert {registry.kind_of(n) for n in names if n.startswith("preprocess")} == {"preprocess"}
    assert wiring.arena_owners(WorkerConfig()) == wiring.ARENA_OWNERS  # one worker: the old arenas
    for n in registry.preprocess_names(3):
        assert ("cache", n) in wiring.edges(1, 3) and (n, "scheduler") in wiring.edges(1, 3)
        assert registry.last_words(n) == [("cache", PreprocessDown(registry.worker_of(n)))]


# ---------------------------------------------------------------- the cache's choice
class Rig:
    """A CacheStage of two workers on a real pixel arena; the test plays intake and the workers."""

    def __init__(self, prefix):
        run_id = shm.new_run_id()
        self.pixel_arena = Arena.create(prefix, run_id, "pixels", 1 << 20, block_size=4096)
        self.emb_arena = Arena.create(prefix, run_id, "emb", 1 << 20, block_size=4096)
        self.sent: list[tuple[str, object]] = []
        self.stage = None
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.n = 0

    def _build(self) -> None:
        self.stage = CacheStage(lambda dest, rec: self.sent.append((dest, rec)), pixel_arena=self.pixel_arena,
                                cache=EmbeddingCache(self.emb_arena, OWNER_CACHE, 4096, 4096), hidden=4,
                                dtype="float32", preprocess=tuple(WORKERS))

    def miss(self) -> str:
        """A fresh compressed image from intake: the worker the cache sends it to."""
        self.n += 1
        lease = self.pixel_arena.alloc(16, OWNER_INTAKE)
        w = WorkItem(slot=self.n, room=self.n, item=0, seq=self.n, modality="image", grid_thw=((1, 2, 2),),
                     pixel_dtype="float32", n_patches=4, patch_dim=1, span=1, pixels=lease,
                     pixel_hash=self.n.to_bytes(16, "little"), media=("jpeg", 16, 0, 0))
        self.stage.handle("intake", w)
        (dest, rec), = self.sent
        self.sent.clear()
        self.pixel_arena.drop(rec.pixels, OWNER_CACHE)  # the worker takes it over
        return dest

    def close(self) -> None:
        if self.stage is not None:
            self.stage.close()
        for a in (self.pixel_arena, self.emb_arena):
            a.close()
            a.unlink()


def test_the_cache_sends_each_miss_to_the_live_worker_with_the_fewest_outstanding(shm_prefix):
    rig = Rig(shm_prefix)
    try:
        assert [rig.miss() for _ in range(4)] == WORKERS * 2, "idle workers take turns"
        for _ in range(2):
            rig.stage.handle("preprocess1", PreprocessDone(1))
        # preprocess0 is slow (two outstanding): it is sent nothing while preprocess1 has fewer.
        assert [rig.miss() for _ in range(2)] == ["preprocess1"] * 2
        assert rig.stage.stats()["preprocess_outstanding"] == {"preprocess0": 2, "preprocess1": 2}
        # preprocess0 dies (what it held fails with its rooms): its count is dropped, and it
        # is sent nothing until its successor starts, though it has the fewest.
        rig.stage.handle("preprocess0", PreprocessDown(0))
        assert rig.stage.stats()["preprocess_outstanding"]["preprocess0"] == 0
        assert [rig.miss() for _ in range(2)] == ["preprocess1"] * 2
        rig.stage.handle("preprocess0", PreprocessRestarted(0))
        assert [rig.miss() for _ in range(4)] == ["preprocess0"] * 4, "four behind preprocess1's four"
        # Items left in the dead one's ring come back done from its successor: never below zero.
        for _ in range(6):
            rig.stage.handle("preprocess0", PreprocessDone(0))
        assert rig.stage.stats()["preprocess_outstanding"]["preprocess0"] == 0
    finally:
        rig.close()


# ---------------------------------------------------------------- through the worker
def jpeg(seed: int, size=(200, 150)) -> bytes:
    """A distinct JPEG (noise: no two share a cache key) that takes a decoder a moment."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    PIL.Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


class Sent:
    """Rooms of one compressed image each, and the rows each must get."""

    def __init__(self, client, rx, size=(200, 150)):
        self.client, self.rx, self.size = client, rx, size
        self.want: dict[int, tuple] = {}

    def rooms(self, seeds) -> list[int]:
        """One room per seed, its JPEG and rows made first, so that the rooms go at once."""
        made = []
        for seed in seeds:
            data = jpeg(seed, self.size)
            pixels, grid = media.preprocess(data, "jpeg", SETTINGS)
            span = grid[0] * grid[1] * grid[2] // 4
            made.append((data, span, expected_sim_rows(pixels, "image", span, ROW["hidden"],
                                                       ROW["deepstack_width"], ROW["dtype"])))
        rooms = []
        for data, span, want in made:
            room = next(_rooms)
            self.rx.alloc(room, 0, span=span, **ROW)
            self.client.encode(room, f"req-{room}", [image_item(data, "jpeg", min_pixels=SETTINGS.min_pixels,
                                                                max_pixels=SETTINGS.max_pixels)])
            self.want[room] = want
            rooms.append(room)
        return rooms

    def check(self, rooms, failing_ok: str | None) -> int:
        """Every room served with its rows, or failed naming the stage `failing_ok` (as
        the supervisor does, or a stage that found its pixels lost); how many failed."""
        assert self.rx.wait({r: 1 for r in rooms}, timeout=60), "some room never concluded"
        failed = 0
        for room in rooms:
            if room in self.rx.failed:
                reason = self.rx.failed[room]
                assert failing_ok and (f"the {failing_ok} stage died" in reason
                                       or f"({failing_ok} died)" in reason), reason
                failed += 1
                continue
            main, deep = self.want[room]
            got_main, got_deep = self.rx.rows(room, 0)
            assert np.array_equal(got_main, main) and np.array_equal(got_deep, deep), room
        return failed


def decoded(w, name: str) -> int:
    per_stage = w.stats()["per_stage"]
    return per_stage.get(name, {}).get("preprocess_items", {}).get("decoded", 0)


@pytest.mark.parametrize("mode", ["inprocess", "pipeline"])
def test_both_workers_take_work_and_serve_the_right_rows(mode, shm_prefix, tmp_path):
    w = start_worker(mode, sim_config(shm_prefix, tmp_path, preprocess_workers=2, **BOUNDS))
    try:
        client = Client(w.cfg.intake, shm_prefix)
        rx = Receiver("rx0", w.cfg.bootstrap, buffer_bytes=32 << 20)
        try:
            sent = Sent(client, rx)
            rooms = sent.rooms(range(12))
            assert sent.check(rooms, failing_ok=None) == 0
            per_worker = {n: decoded(w, n) for n in WORKERS}
            assert all(per_worker.values()), per_worker
            assert sum(per_worker.values()) == len(rooms), per_worker
            assert w.stats()["preprocess_items"]["decoded"] == len(rooms), "the workers' counts, summed"
            wait_for("items counted outstanding after they were done", lambda: set(
                w.stats()["per_stage"][registry.CACHE]["preprocess_outstanding"].values()) == {0}, 10)
        finally:
            rx.close()
            client.close()
    finally:
        w.close()


class Stopper:
    """SIGSTOPs the first new child of this process (the worker's supervisor runs here)
    the moment it appears: a replacement stage, long before it can be ready."""

    def __init__(self):
        self.me = psutil.Process()
        self.known = {c.pid for c in self.me.children()}
        self.stopped: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.running = True
        self.thread.start()

    def _run(self) -> None:
        while self.running and self.stopped is None:
            for c in self.me.children():
                if c.pid not in self.known:
                    os.kill(c.pid, signal.SIGSTOP)
                    self.stopped = c.pid
                    return
            time.sleep(0.002)

    def close(self) -> None:
        self.running = False
        self.thread.join(5)


def wait_for(what: str, cond, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_dead_or_hung_worker_fails_only_what_it_held_and_the_other_keeps_serving(how, shm_prefix, tmp_path):
    """A window of rooms in flight; one worker, while it holds rooms, SIGKILLed (a decoder
    that crashes) or SIGSTOPped (one that hangs: the hang killer ends it), and its
    replacement SIGSTOPped as it starts (the supervisor would give it up after
    stage_start_timeout_s; here the test kills it). While it is down, the cache sends the
    other worker every image, and those rooms are served; the rooms the dead one held
    fail naming it; every other room is served with its rows; the other worker is never
    restarted; rooms after are served by both; /dev/shm holds nothing of the run once it
    is closed."""
    cfg = sim_config(shm_prefix, tmp_path, preprocess_workers=2, heartbeat_timeout_s=1.0,
                     stage_start_timeout_s=120.0, bootstrap_timeout_s=60.0, **BOUNDS)
    w = start_worker("pipeline", cfg)
    stopper = None
    try:
        client = Client(w.cfg.intake, shm_prefix)
        rx = Receiver("rx0", w.cfg.bootstrap, buffer_bytes=64 << 20)
        try:
            sup = w.runtime
            victim, other = WORKERS
            pid, other_pid = sup.procs[victim].pid, sup.procs[other].pid
            sent = Sent(client, rx, size=(640, 480))  # a decode long enough to be caught holding
            rooms = sent.rooms(range(100, 164))
            wait_for("the victim never held a room", lambda: sup.rooms.held_by(1 << registry.owner_of(victim)))
            stopper = Stopper()
            os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            wait_for("no replacement appeared", lambda: stopper.stopped is not None)
            wait_for("the cache did not learn of the death",
                     lambda: victim in w.stats()["per_stage"][registry.CACHE].get("preprocess_down", ()))
            # Down: every image goes to the other, and is served while the replacement is stopped.
            during = sent.rooms(range(2000, 2012))
            assert sent.check(during, failing_ok=None) == 0
            assert sup.restart_counts[victim] == 0
            os.kill(stopper.stopped, signal.SIGKILL)  # a start given up: another is spawned
            wait_for(f"the {victim} stage was not restarted", lambda: sup.restart_counts[victim] >= 1)
            assert sent.check(rooms, failing_ok=victim) > 0, "the victim held no room"
            assert sup.procs[other].pid == other_pid
            assert sup.restart_counts == {s: int(s == victim) for s in sup.stages}
            # Fresh rooms after: served, by both (the successor is sent work again).
            after = sent.rooms(range(1000, 1012))
            assert sent.check(after, failing_ok=None) == 0
            assert decoded(w, victim) > 0, "the successor was sent no work"
            # Nothing in flight: the cache counts nothing outstanding, not even the items
            # the dead one took with it.
            wait_for("items counted outstanding for ever", lambda: set(
                w.stats()["per_stage"][registry.CACHE]["preprocess_outstanding"].values()) == {0}, 10)
        finally:
            rx.close()
            client.close()
    finally:
        if stopper is not None:
            stopper.close()
        w.close()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(shm_prefix)]


def test_numa_and_status_name_every_worker(shm_prefix, tmp_path):
    from pipeline.ops import numa
    from pipeline.cli.config import parse_numa

    assert parse_numa("preprocess=0,preprocess1=1,*=0", 1, 2) == {"preprocess": 0, "preprocess1": 1, "*": 0}
    with pytest.raises(ConfigError, match="preprocess2"):
        parse_numa("preprocess2=0", 1, 2)
    stages = registry.stage_names(1, 2)
    assert set(numa.plan("off", 0, stages)) == set(stages)
    cfg = sim_config(shm_prefix, tmp_path, preprocess_workers=2, **BOUNDS)
    w = start_worker("pipeline", cfg)
    try:
        from pipeline.cli.status import live_runs, read_run

        (run_id, pid), = live_runs(shm_prefix).items()
        status = read_run(shm_prefix, run_id, pid)
        assert set(WORKERS) <= set(status["stages"]) and "preprocess" not in status["stages"]
        assert all(status["stages"][n]["alive"] for n in WORKERS)
    finally:
        w.close()
