"""The shared store tier: two workers of either mode and a real mooncake_master on loopback
(served across workers, a forged value, a stalled, killed and restarted master, a killed
store node, a worker stopped once its master is gone); then the tier alone and the cache
stage beside it, on a client in memory that stalls at will; and the towers' identities."""
from __future__ import annotations

import ctypes
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from ipc import hashing, shm
from pipeline.peers.client import Client, Item
from pipeline.cli import status
from pipeline.cli.config import ConfigError, WorkerConfig
from pipeline.peers.receiver import Receiver
from pipeline.testing.store_master import StoreMaster
from stages.embedding_cache import make_key
from stages.records import RoomAbandoned
from stages.store_tier import ABANDONED, PUT_STUCK_S, StoreSettings, StoreTier, tower_identity
from tests.runtime.test_metrics import scrape_until, value
from tests.helpers import expected_sim_rows, free_port, image, sim_config, start_worker
from tests.runtime.test_startup import REPO, kill_session, serve_cmd, start_serving, wait_session_gone

pytestmark = pytest.mark.timeout(180)

_rooms = itertools.count(1)


@pytest.fixture
def master(tmp_path):
    m = StoreMaster(str(tmp_path / "master.log"))
    yield m
    m.close()


def key_file(tmp_path) -> str:
    path = tmp_path / "cache.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    return str(path)


def wait_for(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def store(w) -> dict:
    return w.stats().get("store", {})


class Pair:
    """Workers A and B sharing the store, a client of each, one receiver registered with both."""

    def __init__(self, mode, master, shm_prefix, tmp_path):
        keys = key_file(tmp_path)
        self.prefixes = [f"{shm_prefix}_a", f"{shm_prefix}_b"]
        self.workers, self.clients, self.rx = [], [], None
        for p in self.prefixes:
            run_dir = tmp_path / p
            run_dir.mkdir()
            cfg = sim_config(p, run_dir, store_master=master.address, cache_key_file=keys,
                             store_segment_bytes=32 << 20, store_buffer_bytes=8 << 20, store_get_timeout_s=0.5,
                             metrics_endpoint="127.0.0.1:0")
            self.workers.append(start_worker(mode, cfg))
            self.clients.append(Client(cfg.intake, shm_prefix=p))
        self.rx = Receiver("rx", [w.cfg.bootstrap for w in self.workers], buffer_bytes=16 << 20)
        wait_for(lambda: all(store(w).get("connected") for w in self.workers), 60, "the store clients")

    def encode(self, which: int, seeds: list[int]) -> dict[int, tuple]:
        """A room per seed on worker `which`; room -> its item's pixels."""
        w, rooms = self.workers[which], {}
        for seed in seeds:
            room = next(_rooms)
            grid, pixels = image(seed, grid=(1, 4, 4))
            self.clients[which].encode(room, f"req-{room}", [Item("image", grid, pixels)])
            self.rx.alloc(room, 0, span=4, hidden=w.spec.hidden, dtype=w.spec.dtype,
                          deepstack_width=w.spec.deepstack_width, worker=w.cfg.bootstrap)
            rooms[room] = pixels
        return rooms

    def check(self, rooms: dict[int, np.ndarray]) -> None:
        """Every room succeeded with the sim tower's rows, bit for bit."""
        spec = self.workers[0].spec
        assert self.rx.wait({room: 1 for room in rooms}, 60), "rooms did not conclude"
        failed = {room: self.rx.failed[room] for room in rooms if room in self.rx.failed}
        assert not failed, failed
        for room, pixels in rooms.items():
            main, deep = expected_sim_rows(pixels, "image", 4, spec.hidden, spec.deepstack_width, spec.dtype)
            got_main, got_deep = self.rx.rows(room, 0)
            assert np.array_equal(got_main, main) and np.array_equal(got_deep, deep), room
            self.rx.release(room)

    def close(self) -> None:
        for obj in [self.rx, *self.clients, *self.workers]:
            if obj is not None:
                obj.close()
        for p in self.prefixes:
            left = shm.list_objects(p)
            shm.sweep(p, include_live=True)
            assert not left, f"left behind: {left}"


@pytest.fixture
def pair(mode, master, shm_prefix, tmp_path):
    p = Pair(mode, master, shm_prefix, tmp_path)
    try:
        yield p
    finally:
        p.close()


def test_worker_b_serves_from_the_store_what_worker_a_encoded(pair, capsys):
    a, b = pair.workers
    pair.check(pair.encode(0, [11, 12]))
    wait_for(lambda: store(a)["puts"] == 2, 30, "A's puts")
    pair.check(pair.encode(1, [11, 12]))  # the same images, on B
    stats = b.stats()
    assert stats["tower_items"] == 0, "B's tower ran"
    assert stats["cache_items"].get("hit_store") == 2
    assert stats["store_gets"]["hit"] == 2 and stats["store_gets"]["rejected"] == 0
    m = scrape_until(b, lambda m: value(m, "epd_store_gets_total", outcome="hit") == 2)
    assert value(m, "epd_items_total", cache="hit_store") == 2 and value(m, "epd_store_connected") == 1
    assert value(m, "epd_store_get_seconds_count") == 2
    m = scrape_until(a, lambda m: value(m, "epd_store_puts_total", outcome="stored") == 2)
    assert value(m, "epd_store_gets_total", outcome="miss") == 2
    if b.mode == "pipeline":  # run.py status reads the tier from the published stats
        assert status.main(WorkerConfig(shm_prefix=b.cfg.shm_prefix), False) == 0
        text = capsys.readouterr().out
        assert f"store tier: master {b.cfg.store_master}, connected; gets hit 2, miss 0" in text, text


def test_a_value_that_fails_its_check_is_dropped_and_the_item_encoded(master, shm_prefix, tmp_path):
    pair = Pair("inprocess", master, shm_prefix, tmp_path)
    try:
        b = pair.workers[1]
        cache = b.runtime.stages["cache"]
        grid, pixels = image(41, grid=(1, 4, 4))
        key = _key(cache, grid, pixels)
        rows = b.spec.row_bytes * 4
        forged = os.urandom(rows + 32)  # the right size, a digest made without the key
        assert cache.store.client.put(cache.store.name(key), forged) == 0
        pair.check(pair.encode(1, [41]))
        stats = b.stats()
        assert stats["store_gets"]["rejected"] == 1 and stats["store_gets"]["hit"] == 0
        assert stats["tower_items"] == 1
    finally:
        pair.close()


def _key(cache, grid, pixels) -> tuple:
    """The cache stage's key of an image of these pixels (its keyed hash, taken here)."""
    h = hashing.cache_hash(cache.content_key, "image", grid, "float32", pixels.tobytes())
    return make_key("image", h, 4, cache.hidden, cache.dtype, "")


def test_killed_master_fails_no_room_and_hits_resume_after_its_restart(pair, master):
    a, b = pair.workers
    pair.check(pair.encode(0, [21, 22, 23]))
    wait_for(lambda: store(a)["puts"] == 3, 30, "A's puts")
    master.stop()  # a stalled master: B's lookups pass their deadline, its tower encodes
    try:
        pair.check(pair.encode(1, [28, 29]))
        assert store(b)["get_timeouts"] + store(b)["skipped"] >= 1, store(b)
    finally:
        master.resume()
    in_flight = pair.encode(1, [21, 22, 23]) | pair.encode(0, [24, 25])
    master.kill()
    in_flight |= pair.encode(1, [24, 25, 26]) | pair.encode(0, [27])
    pair.check(in_flight)  # every room succeeds: what the store could not answer was encoded
    failures = store(b)["get_failures"] + store(b)["get_timeouts"] + store(b)["skipped"]
    assert failures > 0, store(b)

    master.start()
    # The clients find the new master by themselves, each in its own time: A encodes a new
    # image, puts it, B asks for it, until B is served from the store again.
    seeds = itertools.count(30)

    def put_attempts() -> int:  # stored, failed or dropped
        return sum(a.stats()["store_puts"].values())

    def b_hits_again() -> bool:
        seed, attempts, hits = next(seeds), put_attempts(), store(b)["hits"]
        pair.check(pair.encode(0, [seed]))
        wait_for(lambda: put_attempts() > attempts, 30, "A's put")
        pair.check(pair.encode(1, [seed]))
        return store(b)["hits"] > hits

    wait_for(b_hits_again, 60, "a hit on B after the master's restart")


def test_a_store_node_killed_fails_no_room_of_the_others(master, shm_prefix, tmp_path):
    """A's cache stage lends the store its segment: SIGKILLed, what the master placed there is
    gone without an unmount; B's rooms of those images all succeed (fetched elsewhere, or encoded)."""
    pair = Pair("pipeline", master, shm_prefix, tmp_path)
    try:
        a, b = pair.workers
        pair.check(pair.encode(0, [51, 52, 53, 54]))
        wait_for(lambda: store(a)["puts"] == 4, 30, "A's puts")
        pid = a.runtime.procs["cache"].pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: getattr(a.runtime.procs["cache"], "pid", None) != pid, 30,
                 "the supervisor to restart A's cache stage")
        pair.check(pair.encode(1, [51, 52, 53, 54]))
        # The master places entries on its segments in turn: those in A's fail (or, once the
        # master has dropped A's segment, miss) and are encoded.
        stats = b.stats()
        assert stats["store_gets"]["hit"] + stats["tower_items"] == 4, stats["store_gets"]
    finally:
        pair.close()


@pytest.mark.parametrize("mode", ["inprocess", "pipeline"])
def test_a_worker_stopped_once_its_master_is_gone_exits_cleanly(mode, master, shm_prefix, tmp_path):
    """The client's close would wait on the dead master, holding the process (in the pipeline
    the supervisor killed the cache stage past its stop limit, its stacks logged): SIGTERM
    ends `run.py serve` with 0 within the drain bound, no stage killed, nothing left in
    /dev/shm, no process left."""
    drain_s, metrics = 2.0, f"127.0.0.1:{free_port()}"
    cmd = serve_cmd(mode, shm_prefix, tmp_path, store_master=master.address, cache_key_file=key_file(tmp_path),
                    store_segment_bytes=32 << 20, store_buffer_bytes=8 << 20, drain_timeout_s=drain_s,
                    metrics_endpoint=metrics)
    stderr = tmp_path / "stderr"
    proc = start_serving(cmd, stderr)
    client = Client(cmd[cmd.index("--intake") + 1], shm_prefix)
    rx = Receiver("rx", cmd[cmd.index("--bootstrap") + 1])
    try:
        put = 'epd_store_puts_total{outcome="stored"} 1.0'
        wait_for(lambda: "epd_store_connected 1.0" in scraped(metrics), 60, "the store client")
        grid, pixels = image(61, grid=(1, 4, 4))
        client.encode(1, "req-1", [Item("image", grid, pixels)])
        rx.alloc(1, 0, span=4, hidden=64, dtype="bfloat16", deepstack_width=32)
        assert rx.wait({1: 1}, 60) and not rx.failed
        wait_for(lambda: put in scraped(metrics), 30, "the put")
        master.kill()
        # The client has begun to reconnect, which its close would wait for.
        wait_for(lambda: "Failed to ping master" in stderr.read_text(), 60, "the client to miss the master")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(drain_s + 5.0) == 0
        log = stderr.read_text()
        assert "did not exit within" not in log and "Current thread" not in log, log[-3000:]
        assert "does not answer: leaving without unmounting" in log
        assert not wait_session_gone(proc.pid), "a process outlived the stop"
        assert not shm.list_objects(shm_prefix), "the stop left objects in /dev/shm"
    finally:
        client.close()
        rx.close()
        kill_session(proc.pid)
        proc.wait(30)


def scraped(endpoint: str) -> str:
    return urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=30).read().decode()


_QUIET_SCRIPT = """
import logging, sys, time
logging.basicConfig(level=sys.argv[1])
from stages.store_tier import StoreSettings, StoreTier
tier = StoreTier(StoreSettings(sys.argv[2], "P2PHANDSHAKE", 16 << 20, 1 << 20, "tcp", "", "127.0.0.1", 1.0),
                 b"tower", bytes(32))
end = time.monotonic() + 60
while not tier.connected():
    assert time.monotonic() < end, "not connected"
    time.sleep(0.05)
tier.close()
"""


@pytest.mark.parametrize("level", ["DEBUG", "WARNING"])
def test_the_store_clients_set_up_says_nothing_above_debug(level, master):
    """Like the transfer engine's (test_transport): a healthy set-up logs a dozen INFO lines
    and an error-level "Local segment descriptor not found"; only at DEBUG do they show."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MC_", "GLOG_"))}
    p = subprocess.run([sys.executable, "-c", _QUIET_SCRIPT, level, master.address], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    said = [text for text in ("Mounting segment", "Local segment descriptor not found") if text in p.stderr]
    assert said == {"DEBUG": ["Mounting segment", "Local segment descriptor not found"], "WARNING": []}[level], \
        p.stderr


def test_the_store_needs_a_shared_cache_key(tmp_path):
    cfg = sim_config("x", tmp_path, store_master="127.0.0.1:50051").resolved()
    with pytest.raises(ConfigError, match="cache_key_file"):
        cfg.validate()
    with pytest.raises(ConfigError, match="host:port"):
        sim_config("x", tmp_path, store_master="nowhere", cache_key_file=key_file(tmp_path)).resolved().validate()


# ---------------------------------------------------------------- the tier alone, a client that stalls at will

class StallingClient:
    """A store client in memory whose lookups wait while `gate` is clear (a stalled master)."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.put_gate = threading.Event()  # the same for puts
        self.put_gate.set()
        self.closed = False

    def setup(self, *args) -> int:
        return 0

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0

    def get_into(self, name: str, ptr: int, size: int) -> int:
        self.gate.wait()
        value = self.values.get(name)
        if value is None:
            return -704
        ctypes.memmove(ptr, value, len(value))
        return len(value)

    def is_exist(self, name: str) -> int:
        self.gate.wait()
        return int(name in self.values)

    def put_parts(self, name: str, *parts) -> int:
        self.put_gate.wait()
        self.values[name] = b"".join(bytes(p) for p in parts)
        return 0

    def close(self) -> None:
        self.closed = True


def answers_until(tier, n: int = 1) -> list:
    """The next `n` answers, (key, the rows as bytes or None)."""
    got: list = []
    wait_for(lambda: got.extend(tier.answers(time.monotonic())) or len(got) >= n, 10, "the store's answers")
    return [(key, None if rows is None else bytes(rows)) for key, rows in got]


def test_the_tier_answers_every_ask_by_its_deadline_and_skips_a_stalled_store():
    listener = socket.create_server(("127.0.0.1", 0))  # what the tier waits for before set-up
    client = StallingClient()
    settings = StoreSettings(f"127.0.0.1:{listener.getsockname()[1]}", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "",
                             "127.0.0.1", get_timeout_s=0.2)
    tier = StoreTier(settings, b"tower", os.urandom(32), client_factory=lambda: client)
    try:
        wait_for(tier.connected, 10, "the tier to connect")
        rows = os.urandom(4096)
        key, other = ("image", b"h1", 4, 64, "bfloat16", ""), ("image", b"h2", 4, 64, "bfloat16", "")
        assert tier.put(key, memoryview(rows), "token")
        wait_for(lambda: tier.done() == ["token"], 10, "the put")
        assert tier.ask(key, len(rows), time.monotonic())
        assert tier.ask(other, len(rows), time.monotonic())
        assert sorted(answers_until(tier, 2), key=lambda a: a[0][1]) == [(key, rows), (other, None)]

        name = tier.name(key)
        client.values[name] = client.values[name][:-1] + bytes([client.values[name][-1] ^ 1])
        assert tier.ask(key, len(rows), time.monotonic())
        assert answers_until(tier) == [(key, None)]
        assert tier.stats()["store_gets"] == {"hit": 1, "miss": 1, "rejected": 1, "failed": 0, "timeout": 0,
                                              "skipped": 0}

        client.gate.clear()  # stalled: the ask concludes a miss at its deadline, the next is not made
        assert tier.ask(key, len(rows), time.monotonic())
        assert answers_until(tier) == [(key, None)]
        assert not tier.ask(key, len(rows), time.monotonic())
        client.gate.set()
        wait_for(lambda: not tier.stalled(time.monotonic()), 10, "the stuck call to return")
        assert tier.ask(other, len(rows), time.monotonic())
        assert answers_until(tier) == [(other, None)]
        gets = tier.stats()["store_gets"]
        assert gets["timeout"] == 1 and gets["skipped"] == 1

        client.put_gate.clear()  # a put that stalls gives its rows back at once, and no more are queued
        assert tier.put(other, memoryview(rows), "stalled")
        wait_for(lambda: tier.done() == ["stalled"], 10, "the rows' copy")
        wait_for(lambda: tier.putting_since is not None and time.monotonic() - tier.putting_since > PUT_STUCK_S,
                 10, "the put to be stuck")
        assert not tier.put(key, memoryview(rows), "refused")
        client.put_gate.set()
        wait_for(lambda: tier.stats()["store_puts"] == {"stored": 2, "failed": 0, "dropped": 1}, 10, "the put")
    finally:
        client.gate.set()
        client.put_gate.set()
        tier.close()
        listener.close()


@pytest.mark.parametrize("answers", [True, False])
def test_close_tells_a_master_that_answers_and_abandons_a_client_whose_master_does_not(answers):
    """A close against a stalled master would hold the process (the client's close keeps the
    GIL while it waits): the client is left open, kept from its destructor, for the process
    to end past its exit handlers."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = StallingClient()
    settings = StoreSettings(f"127.0.0.1:{listener.getsockname()[1]}", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "",
                             "127.0.0.1", get_timeout_s=0.2)
    tier = StoreTier(settings, b"tower", os.urandom(32), client_factory=lambda: client)
    try:
        wait_for(tier.connected, 10, "the tier to connect")
        if not answers:
            client.gate.clear()
        tier.close()
        assert client.closed == answers
        assert (client in ABANDONED) != answers
    finally:
        client.gate.set()
        ABANDONED[:] = [c for c in ABANDONED if c is not client]
        listener.close()


# ---------------------------------------------------------------- the cache stage while the store is asked

@pytest.fixture
def store_rig(shm_prefix):
    """test_cache's CacheRig (the test plays intake, scheduler, tower and reaper) with a store
    tier on a client in memory; `rig.client.gate` clear holds the lookups."""
    from tests.stages.test_cache import CacheRig

    listener = socket.create_server(("127.0.0.1", 0))
    rig = CacheRig(shm_prefix)
    rig.client = StallingClient()
    settings = StoreSettings(f"127.0.0.1:{listener.getsockname()[1]}", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "",
                             "127.0.0.1", get_timeout_s=5.0)
    rig.stage.store = StoreTier(settings, b"tower", os.urandom(32), client_factory=lambda: rig.client)
    rig.stage.row_bytes = 16  # hidden 4, float32, no deepstack
    try:
        wait_for(rig.stage.store.connected, 10, "the tier to connect")
        yield rig
    finally:
        rig.client.gate.set()
        rig.stage.close()
        rig.close()
        listener.close()


def ticks_until(rig, dest: str) -> list:
    """Tick the stage until it sends something to `dest`."""
    got: list = []
    wait_for(lambda: rig.stage.tick(time.monotonic()) or got.extend(rig.take(dest)) or got, 10, dest)
    return got


@pytest.mark.parametrize("stored", [True, False])
def test_a_room_abandoned_while_the_store_is_asked_leaves_its_waiters_to_the_answer(store_rig, stored):
    rig = store_rig
    rig.client.gate.clear()
    a = rig.item(1)
    b = rig.item(2)
    assert rig.sent == [], "the first asks the store; the second waits for it"
    if stored:  # what another worker put meanwhile
        rig.stage.store.put(a.key, memoryview(b"\xcc" * 16), "token")
        wait_for(lambda: rig.stage.store.done() == ["token"], 10, "the put")
    rig.stage.handle("reaper", RoomAbandoned(1))
    assert rig.take("scheduler") == [], "the store's answer decides, not the abandon"
    rig.client.gate.set()
    if stored:
        assert rig.received(ticks_until(rig, "sender")) == [(2, b"\xcc" * 16)]
    else:
        assert ticks_until(rig, "scheduler") == [b]
        rig.into_tower(b)
        rig.encoded(b, fill=0xBB)
    assert rig.sent == []
    rig.check_no_leaks()


def test_an_item_after_every_waiter_left_waits_for_the_pending_answer(store_rig):
    rig = store_rig
    rig.client.gate.clear()
    a = rig.item(1)
    rig.stage.handle("reaper", RoomAbandoned(1))
    rig.stage.store.put(a.key, memoryview(b"\xdd" * 16), "token")  # what another worker put meanwhile
    wait_for(lambda: rig.stage.store.done() == ["token"], 10, "the put")
    rig.item(2)
    assert rig.sent == [], "no second ask, no encode: the first ask's answer serves it"
    rig.client.gate.set()
    assert rig.received(ticks_until(rig, "sender")) == [(2, b"\xdd" * 16)]
    rig.check_no_leaks()


def test_checkpoints_of_the_same_shapes_and_other_weights_have_other_identities(tmp_path):
    from stages.towers.base import TowerSpec

    spec = TowerSpec("qwen2.5-vl", 3584, 0, "bfloat16", 2, 1176, 2, 14)
    dirs = []
    for k, weights in enumerate((b"\x01" * (1 << 20), b"\x01" * (1 << 20), b"\x01" * ((1 << 20) - 1) + b"\x02")):
        d = tmp_path / f"ckpt{k}"
        d.mkdir()
        (d / "config.json").write_text('{"vision_config": {}}')
        (d / "model.safetensors").write_bytes(weights)
        dirs.append(str(d))
    ids = [tower_identity("qwen2.5-vl", spec, d) for d in dirs]
    assert ids[0] == ids[1], "the same checkpoint in two places"
    assert ids[0] != ids[2], "a fine-tune of the same shapes"
    assert tower_identity("qwen2.5-vl", spec, "tiny") != ids[0]
    assert tower_identity("qwen3-vl", spec, "tiny") != tower_identity("qwen2.5-vl", spec, "tiny")


def test_checkpoints_that_differ_between_any_old_samples_have_other_identities(tmp_path):
    """Old code read 16 blocks of 64 KiB of each weight file: two checkpoints that differ
    only between them (a fine-tuned projector) had one identity and shared entries."""
    from stages.towers.base import TowerSpec

    spec = TowerSpec("qwen2.5-vl", 3584, 0, "bfloat16", 2, 1176, 2, 14)
    size = 16 << 20
    ids = []
    for k in range(2):
        d = tmp_path / f"ckpt{k}"
        d.mkdir()
        (d / "config.json").write_text('{"vision_config": {}}')
        weights = bytearray(size)
        weights[size // 2 + 100_000] = k  # between the old samples at size/2 and the next one
        (d / "model.safetensors").write_bytes(bytes(weights))
        ids.append(tower_identity("qwen2.5-vl", spec, str(d)))
    assert ids[0] != ids[1], "two checkpoints that differ in one byte share an identity"


def test_a_restart_finds_the_weight_files_digests_kept_and_a_changed_file_is_read_again(tmp_path, monkeypatch):
    from stages import store_tier
    from stages.towers.base import TowerSpec

    spec = TowerSpec("qwen2.5-vl", 3584, 0, "bfloat16", 2, 1176, 2, 14)
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    ckpt.mkdir()
    run_dir.mkdir()
    (ckpt / "config.json").write_text('{"vision_config": {}}')
    (ckpt / "model.safetensors").write_bytes(b"\x01" * 4096)
    read = []
    real = store_tier._file_digest
    monkeypatch.setattr(store_tier, "_file_digest", lambda p: (read.append(p), real(p))[1])
    first = tower_identity("qwen2.5-vl", spec, str(ckpt), str(run_dir))
    assert (run_dir / store_tier.DIGESTS_FILE).exists() and len(read) == 1
    assert tower_identity("qwen2.5-vl", spec, str(ckpt), str(run_dir)) == first and len(read) == 1
    (ckpt / "model.safetensors").write_bytes(b"\x02" * 4096)  # same size, new bytes
    assert tower_identity("qwen2.5-vl", spec, str(ckpt), str(run_dir)) != first and len(read) == 2
    assert tower_identity("qwen2.5-vl", spec, str(ckpt)) == tower_identity("qwen2.5-vl", spec, str(ckpt),
                                                                            str(run_dir))
