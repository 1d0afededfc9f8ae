"""The encode worker end to end: real Mooncake over loopback TCP, real sockets, sim and tiny towers."""
from __future__ import annotations

import itertools
import os

import msgpack
import numpy as np
import pytest

from pipeline.peers.client import Item
from tests.helpers import expected_sim_rows, image

pytestmark = pytest.mark.timeout(300)
_rooms = itertools.count(1000)


@pytest.fixture(params=["inprocess", "pipeline"])
def env(request, worker_rig):
    """Start a worker (built from `over`) in either mode, a client and receivers; tear all down."""
    def start(tower_obj=None, receivers=1, **over):
        return worker_rig(request.param, names=[f"rx{i}" for i in range(receivers)], tower_obj=tower_obj, **over)

    start.mode = request.param
    return start


def spec_of(w):
    return w.spec


def send_room(client, rx, w, items, *, room=None, deadline_ms=None, inline=False, fanout_rx=None):
    """Send an encode and allocs for it (whole item per receiver unless fanout_rx shards)."""
    room = next(_rooms) if room is None else room
    spec = spec_of(w)
    client.encode(room, f"req-{room}", items, deadline_ms=deadline_ms, inline=inline)
    for i, it in enumerate(items):
        span = sum(t * h * ww for t, h, ww in it.grid_thw) // spec.merge ** 2
        targets = fanout_rx or [rx[0]]
        per = -(-span // len(targets))
        for k, r in enumerate(targets):
            start = min(k * per, span)
            n = min(per, span - start)
            r.alloc(room, i, span=span, hidden=spec.hidden, dtype=spec.dtype,
                    deepstack_width=spec.deepstack_width, fanout=len(targets), row_start=start, n_rows=n)
    return room


def check_rows(r, w, room, i, it, row_start=0, n_rows=None):
    spec = spec_of(w)
    span = sum(t * h * ww for t, h, ww in it.grid_thw) // spec.merge ** 2
    main, deep = expected_sim_rows(it.pixels, it.modality, span, spec.hidden, spec.deepstack_width, spec.dtype)
    got_main, got_deep = r.rows(room, i)
    n = span - row_start if n_rows is None else n_rows
    assert np.array_equal(got_main, main[row_start:row_start + n])
    if spec.deepstack_width:
        assert np.array_equal(got_deep, deep[row_start:row_start + n])


def test_multi_item_rooms_arrive_bit_exact(env):
    w, client, (r,) = env()
    sent = {}
    for k in range(6):
        items = [Item("image", *image(10 * k + j, grid=(1, 2 * (j + 1), 4))) for j in range(k % 3 + 1)]
        if k == 4:
            items.append(Item("video", *image(99, grid=(2, 4, 4))))
        sent[send_room(client, [r], w, items, inline=(k == 2))] = items
    assert r.wait({room: len(items) for room, items in sent.items()}, 60)
    assert not r.failed, r.failed
    for room, items in sent.items():
        for i, it in enumerate(items):
            check_rows(r, w, room, i, it)
    assert not r.violations
    assert not [n for n in os.listdir("/dev/shm") if ".px." in n and n.startswith(w.cfg.shm_prefix)]


def test_fanout_two_receivers_get_their_shards(env):
    w, client, rx = env(receivers=2)
    it = Item("image", *image(7, grid=(1, 6, 8)))  # span 12
    room = send_room(client, rx, w, [it], fanout_rx=rx)
    for r in rx:
        assert r.wait({room: 1}, 60)
        assert not r.failed
    check_rows(rx[0], w, room, 0, it, 0, 6)
    check_rows(rx[1], w, room, 0, it, 6, 6)


def test_repeated_image_skips_tower_and_still_arrives(env):
    w, client, (r,) = env()
    it = Item("image", *image(3))
    a = send_room(client, [r], w, [it])
    assert r.wait({a: 1}, 60)
    items_before = w.stats()["tower_items"]
    b = send_room(client, [r], w, [Item("image", *image(3))])
    assert r.wait({b: 1}, 60)
    assert not r.failed
    check_rows(r, w, b, 0, it)
    stats = w.stats()
    assert stats["tower_items"] == items_before
    assert stats["cache"]["hits_arena"] >= 1


def test_identical_misses_in_flight_encode_once(env):
    w, client, (r,) = env(sim_time_per_row_s=0.01)  # the first encode takes a while
    rooms = [send_room(client, [r], w, [Item("image", *image(42))]) for _ in range(3)]
    assert r.wait({room: 1 for room in rooms}, 60)
    assert not r.failed
    stats = w.stats()
    assert stats["tower_items"] == 1
    assert stats["dedup_hits"] == 2


def test_oversize_entry_is_not_cached(env):
    # An item of 64 rows x 96 cols x 2 bytes = 12 KiB; the arena tier holds 8 KiB.
    w, client, (r,) = env(arena_cache_bytes=8 << 10)
    it = Item("image", *image(5, grid=(1, 16, 16)))
    a = send_room(client, [r], w, [it])
    assert r.wait({a: 1}, 60)
    b = send_room(client, [r], w, [it])
    assert r.wait({b: 1}, 60)
    assert not r.failed
    stats = w.stats()
    assert stats["tower_items"] == 2
    assert stats["cache"]["oversize_skipped"] >= 1


def test_two_cache_tiers_stay_exclusive(env):
    # Each 4-row item is 4 x 96 x 2 = 768 bytes: the arena tier holds two of them.
    w, client, (r,) = env(arena_cache_bytes=1600)
    items = [Item("image", *image(100 + k)) for k in range(6)]
    rooms = [send_room(client, [r], w, [it]) for it in items]
    assert r.wait({room: 1 for room in rooms}, 60)
    again = send_room(client, [r], w, [Item("image", *image(100))])  # demoted to host: promoted
    assert r.wait({again: 1}, 60)
    assert not r.failed
    check_rows(r, w, again, 0, items[0])
    stats = w.stats()["cache"]
    assert stats["demotions"] >= 1 and stats["promotions"] >= 1
    # six distinct images, none evicted: a key in both tiers would count twice
    assert stats["arena_entries"] + stats["host_entries"] == 6


def test_duplicate_room_is_dropped_and_original_succeeds(env):
    w, client, (r,) = env(sim_time_per_row_s=0.005)
    it = Item("image", *image(8))
    room = send_room(client, [r], w, [it])
    client.encode(room, "dup", [Item("image", *image(9))])
    assert r.wait({room: 1}, 60)
    assert not r.failed
    check_rows(r, w, room, 0, it)
    assert w.stats()["intake_dropped"]["duplicate room"] == 1


def test_alloc_for_unknown_room_fails_after_bootstrap_timeout(env):
    w, client, (r,) = env(bootstrap_timeout_s=0.5)
    r.alloc(999_999, 0, span=4, hidden=64, dtype="bfloat16", deepstack_width=32)
    assert r.wait({999_999: 1}, 30)
    assert r.failed[999_999] == "unknown room"


def test_tower_failure_fails_only_its_batch(env):
    w, client, (r,) = env(max_items_per_batch=1, sim_fail_batches=1)
    bad = send_room(client, [r], w, [Item("image", *image(20))])
    good = send_room(client, [r], w, [Item("image", *image(21))])
    assert r.wait({bad: 1, good: 1}, 60)
    assert "tower failed" in r.failed[bad]
    assert good not in r.failed
    check_rows(r, w, good, 0, Item("image", *image(21)))


def test_cancel_fails_room_once(env):
    w, client, (r,) = env(sim_time_per_row_s=0.05)
    room = send_room(client, [r], w, [Item("image", *image(30, grid=(1, 8, 8)))])
    r.cancel(room)
    assert r.wait({room: 1}, 60)
    assert r.failed[room] == "canceled"
    r.poll(0.5)
    assert not r.violations


def test_deadline_fails_room(env):
    w, client, (r,) = env(sim_time_per_row_s=0.05)
    room = next(_rooms)
    client.encode(room, "late", [Item("image", *image(31, grid=(1, 8, 8)))], deadline_ms=50)
    r.alloc(room, 0, span=16, hidden=64, dtype="bfloat16", deepstack_width=32)
    assert r.wait({room: 1}, 60)
    assert "deadline" in r.failed[room]


# ---------------------------------------------------------------- every rule broken once

def _mutate_message(client, w, it, how):
    uses_segment = how in ("missing segment", "segment truncated", "shape/byte-size mismatch")
    msg = client.message(0, "bad", [it], inline=not uses_segment)
    item = msg["items"][0]
    if how == "bad dtype":
        item["pixels"]["dtype"] = "int8"
    elif how == "shape/byte-size mismatch":
        item["pixels"]["shape"][0] += 4
    elif how == "grid not divisible":
        item["grid_thw"] = [[1, 3, 16]]
        item["pixels"]["shape"][0] = 48
    elif how == "missing segment":
        os.unlink("/dev/shm/" + item["pixels"]["shm"][1:])
    elif how == "foreign-prefix segment":
        del item["pixels"]["data"]
        item["pixels"]["shm"] = "/someoneelse.px"
    elif how == "inline data of the wrong length":
        item["pixels"]["data"] = b"\0" * 10
    elif how == "segment truncated":
        os.truncate("/dev/shm/" + item["pixels"]["shm"][1:], 100)
    elif how == "no items":
        msg["items"] = []
    elif how == "bad modality":
        item["modality"] = "audio"
    return msg


INTAKE_CASES = ["bad dtype", "shape/byte-size mismatch", "grid not divisible", "missing segment",
                "foreign-prefix segment", "inline data of the wrong length", "segment truncated",
                "no items", "bad modality"]


def test_every_intake_rule_broken_fails_only_its_room(env):
    w, client, (r,) = env()
    healthy = Item("image", *image(50))
    bad_rooms = {}
    for how in INTAKE_CASES:
        msg = _mutate_message(client, w, Item("image", *image(51)), how)
        msg["room"] = room = next(_rooms)
        client.send(msg)
        r.alloc(room, 0, span=4, hidden=64, dtype="bfloat16", deepstack_width=32)
        bad_rooms[room] = how
    good = send_room(client, [r], w, [healthy])
    assert r.wait({**{room: 1 for room in bad_rooms}, good: 1}, 60)
    assert good not in r.failed
    check_rows(r, w, good, 0, healthy)
    for room, how in bad_rooms.items():
        assert room in r.failed, how
        assert r.failed[room], how  # a readable reason
    assert not r.violations
    # the foreign-prefix name was never touched; our own segments were all unlinked
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(w.cfg.shm_prefix + ".px.")]


ALLOC_CASES = {
    "span mismatch": dict(span=5),
    "hidden mismatch": dict(hidden=65),
    "dtype mismatch": dict(dtype="float16"),
    "deepstack mismatch": dict(deepstack_width=0),
    "gap": "gap",
    "overlap": "overlap",
}


@pytest.mark.parametrize("case", list(ALLOC_CASES))
def test_bad_alloc_fails_its_room_and_healthy_room_succeeds(env, case):
    w, client, rx = env(receivers=2)
    it = Item("image", *image(60))  # span 4
    room = next(_rooms)
    client.encode(room, "r", [it])
    spec = dict(span=4, hidden=64, dtype="bfloat16", deepstack_width=32)
    if ALLOC_CASES[case] == "gap":
        rx[0].alloc(room, 0, fanout=2, row_start=0, n_rows=1, **spec)
        rx[1].alloc(room, 0, fanout=2, row_start=2, n_rows=2, **spec)
    elif ALLOC_CASES[case] == "overlap":
        rx[0].alloc(room, 0, fanout=2, row_start=0, n_rows=3, **spec)
        rx[1].alloc(room, 0, fanout=2, row_start=2, n_rows=2, **spec)
    else:
        rx[0].alloc(room, 0, **{**spec, **ALLOC_CASES[case]})
    good_item = Item("image", *image(61))
    good = send_room(client, rx, w, [good_item])
    assert rx[0].wait({room: 1, good: 1}, 60)
    assert room in rx[0].failed and rx[0].failed[room]
    if ALLOC_CASES[case] in ("gap", "overlap"):
        assert rx[1].wait({room: 1}, 60) and room in rx[1].failed
    assert good not in rx[0].failed
    check_rows(rx[0], w, good, 0, good_item)


def test_unparseable_and_roomless_messages_are_counted(env):
    w, client, (r,) = env()
    client.send_raw(b"\xc1 not msgpack")
    client.send_raw(msgpack.packb({"v": 1, "type": "encode", "room": -1}))
    good_item = Item("image", *image(70))
    good = send_room(client, [r], w, [good_item])
    assert r.wait({good: 1}, 60)
    assert good not in r.failed
    dropped = w.stats()["intake_dropped"]
    assert sum(dropped.values()) == 2


# ---------------------------------------------------------------- real towers

@pytest.mark.parametrize("name", ["qwen2.5-vl", "qwen3-vl"])
def test_tiny_qwen_rows_arrive_as_the_tower_made_them(env, name):
    """In-process the rows are compared bit for bit with what the worker's own tower
    wrote; in the pipeline (the tower lives in another process) with the same seeded
    tower run here on the item alone, within float32 rounding."""
    from stages.towers import build_tower

    tower = build_tower(name, config="tiny")
    made = {}
    real_start = tower.start

    def recording_start(items, outs):
        job = real_start(items, outs)
        job.result()
        for item, (main, deep) in zip(items, outs):
            made[item.pixels.tobytes()] = (main.copy(), None if deep is None else deep.copy())
        return job

    pipeline = env.mode == "pipeline"
    if pipeline:
        w, client, (r,) = env(max_items_per_batch=1, tower=name, tower_config="tiny")
    else:
        tower.start = recording_start
        w, client, (r,) = env(tower_obj=tower, max_items_per_batch=1)
    spec = w.spec
    items = [Item("image", *image(80 + k, grid=(1, 4, 2 * (k + 1)))) for k in range(3)]
    items.append(Item("video", *image(90, grid=(2, 4, 4))))
    rooms = {send_room(client, [r], w, [it]): it for it in items}
    assert r.wait({room: 1 for room in rooms}, 120)
    assert not r.failed
    for room, it in rooms.items():
        main, deep = r.rows(room, 0)
        if not pipeline:
            want_main, want_deep = made[it.pixels.tobytes()]
            assert main.tobytes() == want_main.tobytes()
            if spec.deepstack_width:
                assert deep.tobytes() == want_deep.tobytes()
            continue
        span = sum(t * h * ww for t, h, ww in it.grid_thw) // spec.merge ** 2
        outs = [(np.empty((span, spec.hidden), np.float32),
                 np.empty((span, spec.deepstack_width), np.float32) if spec.deepstack_width else None)]
        from stages.towers import TowerItem

        real_start([TowerItem(it.modality, [tuple(g) for g in it.grid_thw], it.pixels)], outs).result()
        np.testing.assert_allclose(main, outs[0][0], rtol=1e-5, atol=1e-6)
        if spec.deepstack_width:
            np.testing.assert_allclose(deep, outs[0][1], rtol=1e-5, atol=1e-6)


def restarts(w) -> int:
    return sum(w.runtime.restart_counts.values()) if w.mode == "pipeline" else 0


def test_an_item_larger_than_the_embedding_arena_fails_at_intake_naming_the_sizes(env):
    """Rows of 192 bytes (hidden 64 + deepstack 32, bfloat16); a 64 KiB arena holds 341 of them."""
    w, client, (r,) = env(embedding_arena_bytes=64 << 10, arena_cache_bytes=16 << 10)
    big = Item("image", *image(70, grid=(1, 40, 40)))  # 400 rows: 76,800 bytes
    room = next(_rooms)
    client.encode(room, "too-big", [Item("image", *image(71)), big])
    r.alloc(room, 0, span=4, hidden=64, dtype="bfloat16", deepstack_width=32)
    assert r.wait({room: 2}, 60)
    assert r.failed[room] == ("item 1 needs 76800 bytes of embedding (400 rows of 192 bytes); "
                              "the embedding arena holds 65536 (embedding_arena_bytes)")
    good_item = Item("image", *image(72))
    good = send_room(client, [r], w, [good_item])
    assert r.wait({good: 1}, 60) and good not in r.failed
    check_rows(r, w, good, 0, good_item)
    assert restarts(w) == 0, "a request must never cost a stage restart"


def test_an_item_that_fits_only_if_the_cache_gives_space_back_succeeds(env):
    """A 64 KiB arena whose 32 KiB ship-ready tier is full of earlier images, then an item
    of 48,000 bytes: the cache gives space back instead of the worker wedging."""
    w, client, (r,) = env(embedding_arena_bytes=64 << 10, arena_cache_bytes=32 << 10)
    earlier = {}
    for k in range(14):  # 14 x 3,072 bytes: the tier is full
        it = Item("image", *image(200 + k, grid=(1, 8, 8)))
        earlier[send_room(client, [r], w, [it])] = 1
    assert r.wait(earlier, 60) and not r.failed
    assert w.stats()["cache"]["arena_bytes"] > (32 << 10) - 3072
    big_item = Item("image", *image(300, grid=(1, 20, 50)))  # 250 rows: 48,000 bytes
    big = send_room(client, [r], w, [big_item])
    after_item = Item("image", *image(301))
    after = send_room(client, [r], w, [after_item])
    assert r.wait({big: 1, after: 1}, 60), "the worker is wedged"
    assert not r.failed, r.failed
    check_rows(r, w, big, 0, big_item)
    check_rows(r, w, after, 0, after_item)
    assert w.stats()["cache"]["given_back"] > 0
    assert restarts(w) == 0
