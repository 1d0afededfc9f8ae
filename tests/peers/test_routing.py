"""Scale-out: rooms routed to many workers by content hash on a consistent-hash ring.
Three in-process workers on loopback, real Mooncake, the sim tower."""
from __future__ import annotations

import random

import numpy as np
import pytest

from ipc import hashing, shm
from pipeline.peers.client import Item, RoutedClient, WorkerAddress, routing_key
from pipeline.peers.receiver import Receiver
from pipeline.peers.routing import HashRing
from ipc.hashing import content_hash
from tests.helpers import ThreadedWorker, expected_sim_rows, image, sim_config

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(shm_prefix, tmp_path):
    """Three workers (own shm prefix, intake and bootstrap each), a routed client, one
    receiver registered with all three. The client treats the third worker as if it
    were on another host: no shm prefix, pixels inline."""
    prefixes = [f"{shm_prefix}_w{i}" for i in range(3)]
    made = []
    try:
        workers = []
        for i, p in enumerate(prefixes):
            run_dir = tmp_path / f"w{i}"
            run_dir.mkdir()
            w = ThreadedWorker(sim_config(p, run_dir))
            made.append(w)
            workers.append(w)
        client = RoutedClient([WorkerAddress(w.cfg.intake, w.cfg.bootstrap, w.cfg.shm_prefix if i < 2 else None)
                               for i, w in enumerate(workers)])
        made.append(client)
        rx = Receiver("rx", [w.cfg.bootstrap for w in workers], buffer_bytes=64 << 20)
        made.append(rx)
        yield workers, client, rx
    finally:
        for obj in reversed(made):
            obj.close()
    for p in prefixes:
        left = shm.list_objects(p)
        shm.sweep(p, include_live=True)
        assert not left, f"left behind: {left}"


def span_of(w, it: Item) -> int:
    return sum(t * h * ww for t, h, ww in it.grid_thw) // w.spec.merge ** 2


def send(client, rx, by_bootstrap, room, items) -> str:
    """Encode through the ring, alloc at the worker the room went to."""
    bootstrap = client.encode(room, f"req-{room}", items)
    w = by_bootstrap[bootstrap]
    for i, it in enumerate(items):
        rx.alloc(room, i, span=span_of(w, it), hidden=w.spec.hidden, dtype=w.spec.dtype,
                 deepstack_width=w.spec.deepstack_width, worker=bootstrap)
    return bootstrap


def check_rows(rx, w, room, items):
    for i, it in enumerate(items):
        main, deep = expected_sim_rows(it.pixels, it.modality, span_of(w, it), w.spec.hidden,
                                       w.spec.deepstack_width, w.spec.dtype)
        got_main, got_deep = rx.rows(room, i)
        assert np.array_equal(got_main, main) and np.array_equal(got_deep, deep), (room, i)


def cache_counts(w) -> tuple[int, int]:
    c = w.stats()["cache"]
    return c["hits_arena"] + c["hits_host"], c["misses"]


def test_repeated_images_hit_the_cache_of_the_worker_that_encoded_them(cluster):
    workers, client, rx = cluster
    by_bootstrap = {w.cfg.bootstrap: w for w in workers}
    images = [Item("image", *image(500 + k, grid=(1, 4, 4 + 2 * (k % 3)))) for k in range(18)]
    # a two-item room goes by its first item: put a new image first and a known one second
    pair = [Item("image", *image(900, grid=(1, 4, 4))), images[0]]
    rooms = iter(range(7000, 8000))
    first_worker, sent = {}, {}

    def run(batch) -> dict[int, str]:
        went = {}
        for items in batch:
            room = next(rooms)
            went[room] = send(client, rx, by_bootstrap, room, items)
            sent[room] = items
        assert rx.wait({room: len(sent[room]) for room in went}, 60)
        assert not rx.failed, rx.failed
        for room in went:
            check_rows(rx, by_bootstrap[went[room]], room, sent[room])
            rx.release(room)
            client.forget(room)
        return went

    went = run([[it] for it in images])
    for k, room in enumerate(went):
        first_worker[k] = went[room]
    assert len(set(first_worker.values())) >= 2, "18 images all routed to one of three workers"
    for w in workers:  # each worker encoded exactly the images routed to it
        mine = [k for k, b in first_worker.items() if b == w.cfg.bootstrap]
        assert cache_counts(w) == (0, len(mine))
        cache = w.runtime.stages["cache"]
        cached = {key[1] for key in cache.cache.keys("arena")}
        # the worker's own keyed hash of each image routed to it (not the gateway's routing key)
        assert cached == {hashing.cache_hash(cache.content_key, "image", images[k].grid_thw, "float32",
                                          images[k].pixels.tobytes()) for k in mine}

    # the same images again (new arrays, same content): each to the worker that has it cached
    went = run([[Item("image", *image(500 + k, grid=(1, 4, 4 + 2 * (k % 3))))] for k in range(18)] + [pair])
    rooms_again = list(went)
    for k, room in enumerate(rooms_again[:-1]):
        assert went[room] == first_worker[k]
    assert went[rooms_again[-1]] == client.ring.route(routing_key(pair))
    for w in workers:
        mine = sum(1 for b in first_worker.values() if b == w.cfg.bootstrap)
        pair_here = went[rooms_again[-1]] == w.cfg.bootstrap
        # the pair's first item is new (a miss where it went); its second is a hit only if
        # the pair landed where images[0] is cached, else another miss
        pair_hit = pair_here and first_worker[0] == w.cfg.bootstrap
        hits, misses = cache_counts(w)
        assert hits == mine + pair_hit
        assert misses == mine + (2 - pair_hit if pair_here else 0)
        assert w.stats()["tower_items"] == misses

    # one worker leaves the ring: only its images move; the others still hit where they are.
    # Not images[0]'s worker: the pair may have cached images[0] on another worker too.
    gone = next(b for b in first_worker.values() if b != first_worker[0])
    client.remove(gone)
    rx.remove_worker(gone)
    before = {w.cfg.bootstrap: cache_counts(w) for w in workers}
    went = run([[Item("image", *image(500 + k, grid=(1, 4, 4 + 2 * (k % 3))))] for k in range(18)])
    moved = 0
    for k, room in enumerate(went):
        if first_worker[k] == gone:
            assert went[room] != gone
            moved += 1
        else:
            assert went[room] == first_worker[k]
    for w in workers:
        b = w.cfg.bootstrap
        stayed = sum(1 for k, x in first_worker.items() if x == b)
        arrived = sum(1 for k, room in enumerate(went) if went[room] == b and first_worker[k] == gone)
        hits, misses = cache_counts(w)
        assert (hits - before[b][0], misses - before[b][1]) == ((0, 0) if b == gone else (stayed, arrived))
    assert moved == sum(1 for b in first_worker.values() if b == gone)
    assert not rx.violations


def test_routing_key_is_the_workers_content_hash():
    grid, px = image(3, grid=(1, 4, 6))
    it = Item("image", grid, px)
    assert routing_key([it, Item("image", *image(4))]) == content_hash("image", grid, "float32", px.tobytes())
    assert routing_key([Item("image", grid, px, hash=12345)]) == 12345  # the gateway's own hash, if given
    with pytest.raises(ValueError, match="at least one item"):
        RoutedClient([]).route([])


def test_removing_one_of_three_moves_only_its_keys(capsys):
    endpoints = [f"tcp://10.0.0.{i}:17600" for i in range(1, 4)]
    ring = HashRing(endpoints)
    rng = random.Random(7)
    keys = [rng.getrandbits(64) for _ in range(10_000)]
    before = {k: ring.route(k) for k in keys}
    shares = {ep: sum(1 for v in before.values() if v == ep) / len(keys) for ep in endpoints}
    assert all(0.25 < s < 0.42 for s in shares.values()), shares

    gone = endpoints[1]
    ring.remove(gone)
    after = {k: ring.route(k) for k in keys}
    moved = {k for k in keys if after[k] != before[k]}
    assert moved == {k for k in keys if before[k] == gone}  # exactly the removed worker's keys
    share = len(moved) / len(keys)
    assert 0.25 < share < 0.42

    ring.add(gone)  # back again: every key goes home
    assert {k: ring.route(k) for k in keys} == before

    ring.add("tcp://10.0.0.4:17600")  # a fourth: keys move only to it, about a quarter
    grown = {k: ring.route(k) for k in keys}
    moved4 = {k for k in keys if grown[k] != before[k]}
    assert all(grown[k] == "tcp://10.0.0.4:17600" for k in moved4)
    assert 0.17 < len(moved4) / len(keys) < 0.33
    with capsys.disabled():
        print(f"\nring of 3, 10000 keys: shares {', '.join(f'{s:.3f}' for s in shares.values())}; "
              f"removing one moved {share:.3f} of keys; adding a 4th moved {len(moved4) / len(keys):.3f}")


def test_receiver_needs_to_know_a_rooms_worker_when_it_has_several():
    a, b = "tcp://127.0.0.1:9", "tcp://127.0.0.1:10"  # never reached: nothing is sent below
    rx = Receiver("rx", [a, b], buffer_bytes=1 << 20)
    try:
        with pytest.raises(ValueError, match="room 5 has no worker and there are 2; pass worker="):
            rx.alloc(5, 0, span=4, hidden=8, dtype="float32")
        with pytest.raises(ValueError, match="not one of its workers"):
            rx.route(5, "tcp://127.0.0.1:11")
        rx.route(5, b)
        assert rx.worker_of(5) == b
        rx.remove_worker(b)
        with pytest.raises(ValueError, match="room 5's worker .* was removed"):
            rx.cancel(5)
        assert rx.worker_of(6) == a  # one worker left: rooms without a route go to it
        assert rx._free == [(0, 1 << 20)]  # nothing was taken by the failed alloc
    finally:
        rx.close()


def test_ring_errors():
    ring = HashRing(["a"])
    with pytest.raises(ValueError, match="already on the ring"):
        ring.add("a")
    with pytest.raises(ValueError, match="not on the ring"):
        ring.remove("b")
    ring.remove("a")
    with pytest.raises(LookupError, match="no endpoints"):
        ring.route(1)
