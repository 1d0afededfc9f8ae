"""Cache keys no peer can forge or share (issue #22, item 4): the keyed content hash, its
key (the run's own, or an operator's file shared among workers), and `cache_salt`
(protocol 1.1): items of different salts never share a cache entry nor an encode."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from dataclasses import replace

import msgpack
import numpy as np
import pytest

from ipc import hashing, shm, wire
from ipc.arena import Arena
from pipeline.peers.client import Client, Item
from pipeline.cli.config import ConfigError, load_config
from pipeline.peers.receiver import Receiver
from stages.cache import CacheStage
from stages.embedding_cache import EmbeddingCache, cache_key, read_key_file, run_key
from stages.records import OWNER_CACHE, WorkItem
from tests.helpers import expected_sim_rows, fork_call, image, sim_config, start_worker, wait_child

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_rooms = itertools.count(220_000)
GRID = ((1, 4, 4),)


def key_file(path, data: bytes, mode: int = 0o600) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, mode)  # whatever the umask
    return str(path)


# ---------------------------------------------------------------- the hash and its key


def test_the_cache_hash_is_keyed_and_covers_the_grid():
    px = image(1)[1].tobytes()
    k1, k2 = hashing.new_cache_key(), hashing.new_cache_key()
    h = hashing.cache_hash(k1, "image", GRID, "float32", px)
    assert len(h) == 32 and h == hashing.cache_hash(k1, "image", GRID, "float32", px)
    assert h != hashing.cache_hash(k2, "image", GRID, "float32", px)
    assert h != hashing.cache_hash(k1, "image", ((1, 2, 8),), "float32", px)
    assert h != hashing.cache_hash(k1, "video", GRID, "float32", px)
    running = hashing.cache_hasher(k1, "image", GRID, "float32")
    for at in range(0, len(px), 1000):  # in pieces, as intake hashes while it reads
        running.update(px[at:at + 1000])
    assert running.digest() == h


def test_key_files_refused_unless_private_and_the_right_size(tmp_path):
    raw = os.urandom(32)
    assert read_key_file(key_file(tmp_path / "raw", raw)) == raw
    assert read_key_file(key_file(tmp_path / "hex", raw.hex().encode() + b"\n")) == raw
    assert read_key_file(key_file(tmp_path / "group", raw, 0o640)) == raw
    cases = {
        "short": (os.urandom(31), 0o600, "holds 31 bytes; a cache key is 32 raw bytes or 64 hex digits"),
        "long": (os.urandom(33), 0o600, "holds 33 bytes"),
        "badhex": (b"zz" * 32, 0o600, "holds 64 bytes"),
        "public": (raw, 0o644, "readable or writable by every user (mode 644)"),
        "writable": (raw, 0o602, "readable or writable by every user (mode 602)"),
    }
    for name, (data, mode, want) in cases.items():
        path = key_file(tmp_path / name, data, mode)
        with pytest.raises(ValueError, match=want.replace("(", r"\(").replace(")", r"\)")):
            read_key_file(path)
        with pytest.raises(ConfigError) as e:
            load_config(flags={"cache_key_file": path}, environ={})
        assert e.value.key == "cache_key_file" and str(e.value).startswith("cache_key_file: "), str(e.value)
    with pytest.raises(ValueError, match="cannot read"):
        read_key_file(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not a regular file"):
        read_key_file(str(tmp_path))


@pytest.mark.parametrize("command, problem", [("serve", "public"), ("config", "short")])
def test_run_py_refuses_a_bad_key_file_with_exit_2(tmp_path, command, problem):
    data, mode = {"public": (os.urandom(32), 0o644), "short": (os.urandom(16), 0o600)}[problem]
    path = key_file(tmp_path / "key", data, mode)
    p = subprocess.run([sys.executable, "run.py", command, "--tower", "sim", "--cache-key-file", path,
                        "--shm-prefix", f"w4k{os.getpid()}", "--run-dir", str(tmp_path / "run")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if not k.startswith("EPD_")})
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "cache_key_file" in p.stderr and path in p.stderr, p.stderr


def test_the_runs_key_is_one_per_run_private_and_swept(shm_prefix):
    run_a, run_b = shm.new_run_id(), shm.new_run_id()
    try:
        key = run_key(shm_prefix, run_a)
        assert len(key) == 32 and cache_key("", shm_prefix, run_a) == key
        # Another process of the run (a stage, or its successor) gets the same key.
        child = fork_call(lambda: os._exit(0 if run_key(shm_prefix, run_a) == key else 1))
        assert wait_child(child) == 0
        assert run_key(shm_prefix, run_b) != key  # the next run has its own
        path = os.path.join(shm.SHM_DIR, shm.object_name(shm_prefix, run_a, "cachekey"))
        assert os.stat(path).st_mode & 0o777 == 0o600
        os.chmod(path, 0o644)  # someone else could read it: refused, not used
        with pytest.raises(RuntimeError, match="not this user's alone"):
            run_key(shm_prefix, run_a)
        names = shm.list_objects(shm_prefix)
        assert sorted(names) == sorted(shm.object_name(shm_prefix, r, "cachekey") for r in (run_a, run_b))
    finally:
        shm.sweep(shm_prefix, include_live=True)  # the run's own sweep removes it
    assert shm.list_objects(shm_prefix) == []


def test_the_runs_key_made_by_many_processes_at_once_is_one(shm_prefix):
    run = shm.new_run_id()
    r, w = os.pipe()
    children = [fork_call(lambda: os.write(w, run_key(shm_prefix, run))) for _ in range(6)]
    try:
        assert all(wait_child(c) == 0 for c in children)
        got = os.read(r, 32 * 6)
        assert len(got) == 32 * 6 and len({got[i:i + 32] for i in range(0, len(got), 32)}) == 1
        assert shm.list_objects(shm_prefix) == [shm.object_name(shm_prefix, run, "cachekey")]
    finally:
        os.close(r)
        os.close(w)
        shm.sweep(shm_prefix, include_live=True)


# ---------------------------------------------------------------- cache_salt on the wire


def encode_msg(**extra) -> dict:
    return {"v": 1, "type": "encode", "request_id": "r", "room": 5, **extra,
            "items": [{"modality": "image", "grid_thw": [[1, 4, 4]],
                       "pixels": {"data": b"", "shape": [16, 1176], "dtype": "float32"}}]}


def test_parse_encode_takes_a_cache_salt():
    assert wire.parse_encode(encode_msg(), 4).cache_salt == ""
    assert wire.parse_encode(encode_msg(cache_salt=None), 4).cache_salt == ""
    assert wire.parse_encode(encode_msg(cache_salt="tenant-7"), 4).cache_salt == "tenant-7"
    assert wire.parse_encode(encode_msg(cache_salt="é" * 128), 4).cache_salt == "é" * 128
    for bad in ["x" * 129, 7, b"tenant", ["a"], {"a": 1}, True]:
        with pytest.raises(wire.ProtocolError, match="cache_salt must be a string of at most 128 characters"):
            wire.parse_encode(encode_msg(cache_salt=bad), 4)


def test_client_sends_the_salt_only_when_given():
    client = Client("inproc://nowhere", None)
    try:
        it = Item("image", *image(1))
        assert "cache_salt" not in client.message(1, "r", [it])
        assert client.message(1, "r", [it], cache_salt="t1")["cache_salt"] == "t1"
        assert client.message(1, "r", [it], cache_salt="")["cache_salt"] == ""
    finally:
        client.close()


def test_keys_separate_salts_and_client_hashes(shm_prefix):
    """The cache stage's key: the keyed pixel hash, the salt; a trusted client's hash can
    never equal a keyed one, even one whose number is the same."""
    arena = Arena.create(shm_prefix, shm.new_run_id(), "px", 1 << 16)
    try:
        stage = CacheStage(lambda *a: None, pixel_arena=arena,
                           cache=EmbeddingCache(arena, OWNER_CACHE, 1 << 12, 1 << 12), hidden=64,
                           dtype="bfloat16", trust_client_hash=True)
        px = image(3)[1].tobytes()
        digest = hashing.cache_hash(stage.content_key, "image", GRID, "float32", px)
        w = WorkItem(slot=0, room=1, item=0, seq=1, modality="image", grid_thw=GRID, pixel_dtype="float32",
                     n_patches=16, patch_dim=1176, span=4, pixels=None, pixel_hash=digest)
        assert stage.key_of(w) == ("image", digest, 4, 64, "bfloat16", "")
        assert stage.key_of(replace(w, cache_salt="a")) != stage.key_of(replace(w, cache_salt="b"))
        assert stage.key_of(replace(w, cache_salt="a")) == stage.key_of(replace(w, cache_salt="a"))
        forged = replace(w, pixel_hash=None, client_hash=int.from_bytes(digest[:8], "little"))
        assert stage.key_of(forged) != stage.key_of(w)
        assert stage.stats()["cache_key_id"] == hashing.cache_key_id(stage.content_key)
    finally:
        arena.close()
        arena.unlink()


# ---------------------------------------------------------------- the worker, both modes


@pytest.fixture(params=["inprocess", "pipeline"])
def env(request, shm_prefix, tmp_path):
    """Start workers of the test's mode one after another (`start(**over)`), each with a
    client and a receiver; `stop()` the last one; all torn down at the end."""
    made = []

    def start(**over):
        w = start_worker(request.param, sim_config(shm_prefix, tmp_path, **over))
        made.append(w)
        client = Client(w.cfg.intake, shm_prefix)
        rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=16 << 20)
        made.extend([client, rx])
        return w, client, rx

    def stop():
        while made:
            made.pop().close()

    start.stop = stop
    start.mode = request.param
    yield start
    stop()


def send(client, rx, items, *, room=None, **kw) -> int:
    room = next(_rooms) if room is None else room
    client.encode(room, f"req-{room}", items, **kw)
    for i, it in enumerate(items):
        span = sum(t * h * w for t, h, w in it.grid_thw) // 4
        rx.alloc(room, i, span=span, hidden=64, dtype="bfloat16", deepstack_width=32)
    return room


def assert_rows(rx, room, it):
    main, deep = expected_sim_rows(it.pixels, it.modality, 4, 64, 32, "bfloat16")
    got_main, got_deep = rx.rows(room, 0)
    assert np.array_equal(got_main, main) and np.array_equal(got_deep, deep), f"room {room}"


def tower_items(w, want: int | None = None) -> int:
    """The tower's count of items encoded; with `want`, waits (a while) for the counter to reach it."""
    deadline = time.monotonic() + 10
    while True:
        n = w.stats().get("tower_items", 0)
        if want is None or n >= want or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def test_salts_never_share_an_entry_the_same_salt_does(env):
    """The same pixels under two salts are encoded twice (the tower's count); the same
    salt again is a cache hit; no salt and the empty salt are one."""
    w, client, rx = env()
    it = Item("image", *image(40))
    a = send(client, rx, [it], cache_salt="tenant-a")
    assert rx.wait({a: 1}, 60)
    b = send(client, rx, [it], cache_salt="tenant-b")
    assert rx.wait({b: 1}, 60)
    assert tower_items(w, 2) == 2  # before issue #22 item 4: 1 (b was a hit of a's entry)
    a2 = send(client, rx, [it], cache_salt="tenant-a")
    none = send(client, rx, [it])
    assert rx.wait({a2: 1, none: 1}, 60)
    empty = send(client, rx, [it], cache_salt="")
    assert rx.wait({empty: 1}, 60)
    assert not rx.failed, rx.failed
    for room in (a, b, a2, none, empty):
        assert_rows(rx, room, it)
    assert tower_items(w) == 3  # a, b, and the unsalted one; a2 and empty were hits
    items = w.stats()["cache_items"]
    assert items.get("hit_arena", 0) + items.get("hit_host", 0) == 2, items


def test_salts_never_share_an_encode_in_flight(env):
    """Identical pixels in flight at once: the same salt waits for one encode, another
    salt is encoded on its own (a slow sim tower keeps the first in flight)."""
    w, client, rx = env(sim_time_per_row_s=0.05)
    it = Item("image", *image(41))
    rooms = [send(client, rx, [it], cache_salt=s) for s in ("x", "y", "x", "y")]
    assert rx.wait({room: 1 for room in rooms}, 60)
    assert not rx.failed, rx.failed
    for room in rooms:
        assert_rows(rx, room, it)
    assert tower_items(w) == 2  # one encode per salt
    items = w.stats()["cache_items"]
    assert items.get("miss") == 2, items


def test_a_bad_salt_fails_its_room_with_a_reason_and_the_worker_serves_on(env):
    w, client, rx = env()
    it = Item("image", *image(42))
    long_salt = send(client, rx, [it], cache_salt="s" * 129)
    msg = client.message(next(_rooms), "typed", [it], cache_salt="x")
    msg["cache_salt"] = 12345
    client.send_raw(msgpack.packb(msg, use_bin_type=True))
    rx.alloc(msg["room"], 0, span=4, hidden=64, dtype="bfloat16", deepstack_width=32)
    ok = send(client, rx, [it], cache_salt="s" * 128)
    assert rx.wait({long_salt: 1, msg["room"]: 1, ok: 1}, 60)
    want = "cache_salt must be a string of at most 128 characters"
    assert want in rx.failed.get(long_salt, ""), rx.failed  # before: the room succeeded
    assert want in rx.failed.get(msg["room"], ""), rx.failed
    assert ok not in rx.failed
    assert_rows(rx, ok, it)


def key_ids(w) -> set[str]:
    """The key id each hashing stage reports (intake's and the cache's must agree); a
    stage process publishes its counters a moment after it starts."""
    deadline = time.monotonic() + 30
    while True:
        per_stage = w.stats()["per_stage"]
        ids = {per_stage.get(stage, {}).get("cache_key_id") for stage in ("intake", "cache")}
        if None not in ids or time.monotonic() > deadline:
            return ids
        time.sleep(0.1)


def test_workers_with_one_key_file_share_keys_and_default_runs_do_not(env, tmp_path):
    """Two workers started with the same --cache-key-file hash under the same key (every
    stage process of each: intake's and the cache's key ids), one with another file under
    another; a worker without one under a key of its run's own, another every run."""
    key_a, key_b = os.urandom(32), os.urandom(32)
    file_a = key_file(tmp_path / "a.key", key_a)
    file_a2 = key_file(tmp_path / "a2.key", key_a.hex().encode() + b"\n")
    file_b = key_file(tmp_path / "b.key", key_b)
    seen = {}
    for name, over in [("a", dict(cache_key_file=file_a)), ("a2", dict(cache_key_file=file_a2)),
                       ("b", dict(cache_key_file=file_b)), ("run1", {}), ("run2", {})]:
        w, client, rx = env(**over)
        ids = key_ids(w)
        assert len(ids) == 1, f"{name}: stages of one worker hash under different keys: {ids}"
        seen[name] = ids.pop()
        if name == "a" and env.mode == "inprocess":
            # What intake hashed with is the file's key: the cache holds the item under it.
            it = Item("image", *image(43))
            room = send(client, rx, [it])
            assert rx.wait({room: 1}, 60) and not rx.failed
            want = hashing.cache_hash(key_a, "image", GRID, "float32", it.pixels.tobytes())
            cached = w.runtime.stages["cache"].cache.keys("arena")
            assert [k[1] for k in cached] == [want], cached
        env.stop()
    assert seen["a"] == seen["a2"] == hashing.cache_key_id(key_a)
    assert seen["b"] == hashing.cache_key_id(key_b) != seen["a"]
    assert seen["run1"] != seen["run2"] and not {seen["run1"], seen["run2"]} & {seen["a"], seen["b"]}
