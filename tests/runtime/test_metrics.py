"""The Prometheus endpoint: scraped over HTTP under a known load, its counters equal what was
sent; a stage SIGKILLed and restarted moves no counter backwards and counts the restart."""
from __future__ import annotations

import itertools
import os
import pickle
import platform
import random
import subprocess
import sys
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.peers.client import Item
from ipc.stats import REASON_CLASSES, ReasonCode, reason_class
from pipeline.ops.metrics import StageTotals, totals_of
from pipeline.runtime.supervisor import PipelineError
from stages.records import RoomFailure
from tests.helpers import PipelineWorker, image, sim_config

pytestmark = pytest.mark.timeout(300)
_rooms = itertools.count(1)
SPAN = 4  # grid (1, 4, 4) merged 2x2
ROW_BYTES = (64 + 32) * 2  # sim_config: hidden 64 + deepstack 32, bfloat16


def scrape(w) -> dict:
    """{(sample name, sorted labels): value} from the worker's endpoint."""
    url = f"http://127.0.0.1:{w.runtime.metrics.port}/metrics"
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def total(m: dict, name: str) -> float:
    return sum(v for (n, _), v in m.items() if n == name)


def scrape_until(w, done, timeout: float = 60.0) -> dict:
    """Scrape until `done(metrics)`: stages publish their counters a few times a second."""
    end = time.monotonic() + timeout
    while True:
        m = scrape(w)
        if done(m) or time.monotonic() > end:
            return m
        time.sleep(0.1)


def send(client, r, w, room, pixels_seed, *, grid=(1, 4, 4), n_items=1, hidden=None, alloc=True):
    spec = w.spec
    items = [Item("image", *image(pixels_seed, grid=grid)) for _ in range(n_items)]
    client.encode(room, f"req-{room}", items)
    if alloc:
        for i in range(n_items):
            r.alloc(room, i, span=SPAN, hidden=hidden or spec.hidden, dtype=spec.dtype,
                    deepstack_width=spec.deepstack_width)


@pytest.fixture
def started(worker_rig):
    def start(mode="pipeline", **over):
        w, client, (r,) = worker_rig(mode, buffer_bytes=16 << 20,
                                     metrics_endpoint="127.0.0.1:0", bootstrap_timeout_s=10.0, **over)
        return w, client, r

    return start


def test_counters_equal_what_was_sent(started):
    w, client, r = started()
    first = next(_rooms)
    rooms = [first] + [next(_rooms) for _ in range(3)]
    for k, room in enumerate(rooms):  # four misses
        send(client, r, w, room, 1000 + k)
    assert r.wait({room: 1 for room in rooms}, 60)
    hit = next(_rooms)  # the first room's pixels again: a hit in the arena tier
    send(client, r, w, hit, 1000)
    assert r.wait({hit: 1}, 60)
    twins = next(_rooms)  # two identical items in one room: one encode, one in-flight duplicate
    send(client, r, w, twins, 2000, n_items=2)
    assert r.wait({twins: 2}, 60)
    # A room whose alloc the sender refuses (wrong hidden), sent once its item is encoded,
    # so that the tower's counts do not depend on which came first.
    bad_alloc = next(_rooms)
    send(client, r, w, bad_alloc, 3000, alloc=False)
    scrape_until(w, lambda m: value(m, "epd_tower_items_total") == 6)
    r.alloc(bad_alloc, 0, span=SPAN, hidden=w.spec.hidden + 1, dtype=w.spec.dtype,
            deepstack_width=w.spec.deepstack_width)
    assert r.wait({bad_alloc: 1}, 60) and "hidden" in r.failed[bad_alloc]
    send(client, r, w, next(_rooms), 4000, grid=(1, 3, 4), alloc=False)  # rejected at intake
    send(client, r, w, first, 1000, alloc=False)  # the same room id again: dropped

    m = scrape_until(w, lambda m: total(m, "epd_requests_total") == 9 and total(m, "epd_rooms_total") == 8)
    assert value(m, "epd_requests_total", outcome="accepted", reason="none") == 7
    assert value(m, "epd_requests_total", outcome="rejected", reason="bad_request") == 1
    assert value(m, "epd_requests_total", outcome="dropped", reason="duplicate_room") == 1
    assert value(m, "epd_rooms_total", outcome="success", reason="none") == 6
    assert value(m, "epd_rooms_total", outcome="failed", reason="bad_alloc") == 1
    assert value(m, "epd_rooms_total", outcome="failed", reason="bad_request") == 1
    assert value(m, "epd_items_total", cache="miss") == 6
    assert value(m, "epd_items_total", cache="hit_arena") == 1
    assert value(m, "epd_items_total", cache="hit_host") == 0
    assert value(m, "epd_items_total", cache="inflight_duplicate") == 1
    assert value(m, "epd_tower_items_total") == 6
    assert value(m, "epd_tower_rows_total") == 6 * SPAN
    batches = value(m, "epd_tower_batches_total")
    assert 1 <= batches <= 6 and value(m, "epd_tower_batch_seconds_count") == batches
    # seven items written (four misses, the hit, the twins), one shard each
    assert value(m, "epd_transfer_bytes_total") == 7 * SPAN * ROW_BYTES
    assert value(m, "epd_transfer_seconds_count") == 7
    assert value(m, "epd_transfer_failures_total") == 0
    assert value(m, "epd_room_latency_seconds_count") == 8
    assert value(m, "epd_room_latency_seconds_bucket", le="+Inf") == 8
    assert value(m, "epd_room_latency_seconds_sum") > 0
    assert value(m, "epd_rooms_live") == 0
    assert value(m, "epd_arena_bytes", tier="pixels") == w.cfg.pixel_arena_bytes
    for tier in ("pixels", "embeddings"):  # the deprecated name reads the same for one release
        assert value(m, "epd_arena_used_bytes", tier=tier) == value(m, "epd_arena_bytes_used", tier=tier)
    # every item the tower encoded waited at the scheduler once
    assert value(m, "epd_scheduler_queue_wait_seconds_count") == value(m, "epd_tower_items_total")
    # every item written had its allocs complete once (the seven below)
    assert value(m, "epd_alloc_wait_seconds_count") == 7
    info = [dict(labels) for (n, labels), v in m.items() if n == "epd_build_info" and v == 1]
    assert len(info) == 1 and info[0]["python"] == platform.python_version(), info
    assert info[0]["tower"] == w.spec.name and info[0]["torch"] and info[0]["version"], info
    assert 0 < value(m, "epd_cache_bytes", tier="arena") <= w.cfg.arena_cache_bytes
    assert value(m, "epd_cache_entries", tier="arena") == 6
    for stage in ("intake", "cache", "scheduler", "tower", "sender", "reaper"):
        assert value(m, "epd_stage_restarts_total", stage=stage) == 0
        assert ("epd_ring_depth_records", (("stage", stage),)) in m
        assert 0 <= value(m, "epd_stage_busy_ratio", stage=stage) <= 1


def test_counters_under_a_burst(started):
    """Rooms sent as fast as the client can, repeating images: which repeat is a hit and
    which waits for its twin in flight varies, but every sum is exact."""
    w, client, r = started()
    rng = random.Random(7)
    sent, seeds = {}, set()
    scrapes = []
    for k in range(40):
        room = next(_rooms)
        picks = [rng.randrange(12) for _ in range(rng.choice((1, 2)))]
        items = [Item("image", *image(8000 + p)) for p in picks]
        client.encode(room, f"burst-{room}", items)
        for i in range(len(items)):
            r.alloc(room, i, span=SPAN, hidden=w.spec.hidden, dtype=w.spec.dtype,
                    deepstack_width=w.spec.deepstack_width)
        sent[room] = len(items)
        seeds.update(picks)
        if k % 10 == 0:
            scrapes.append(scrape(w))  # scraped while the load runs
    assert r.wait(sent, 60) and not r.failed
    n_items, distinct = sum(sent.values()), len(seeds)
    m = scrape_until(w, lambda m: total(m, "epd_rooms_total") == 40 and total(m, "epd_items_total") == n_items)
    for earlier in scrapes:
        assert total(earlier, "epd_rooms_total") <= 40 and total(earlier, "epd_items_total") <= n_items
    assert value(m, "epd_requests_total", outcome="accepted", reason="none") == 40
    assert value(m, "epd_rooms_total", outcome="success", reason="none") == 40
    assert value(m, "epd_room_latency_seconds_count") == 40
    # the cache holds every image: each is encoded once, every repeat is a hit or waits
    assert value(m, "epd_items_total", cache="miss") == distinct == value(m, "epd_tower_items_total")
    assert value(m, "epd_items_total", cache="hit_arena") + \
        value(m, "epd_items_total", cache="inflight_duplicate") == n_items - distinct
    assert value(m, "epd_tower_rows_total") == distinct * SPAN
    assert value(m, "epd_transfer_bytes_total") == n_items * SPAN * ROW_BYTES
    assert value(m, "epd_transfer_seconds_count") == n_items


def test_a_restarted_stage_moves_no_counter_backwards(started):
    w, client, r = started()
    rooms = [next(_rooms) for _ in range(3)]
    for k, room in enumerate(rooms):
        send(client, r, w, room, 5000 + k)
    assert r.wait({room: 1 for room in rooms}, 60)
    before = scrape_until(w, lambda m: value(m, "epd_rooms_total", outcome="success", reason="none") == 3)
    last = before
    # the reaper counts rooms, the cache items
    for n, stage in enumerate(("reaper", "cache")):
        os.kill(w.runtime.procs[stage].pid, signal.SIGKILL)
        end = time.monotonic() + 60
        while value(last, "epd_stage_restarts_total", stage=stage) < 1:
            assert time.monotonic() < end, f"the {stage} stage was not restarted"
            m = scrape(w)
            counters = [k for k in last if k[0].endswith(("_total", "_count", "_sum", "_bucket"))
                        and not k[0].endswith("_created")]
            went_back = [(k, last[k], m.get(k)) for k in counters if m.get(k, 0) < last[k]]
            assert not went_back, f"after the {stage} stage was killed: {went_back}"
            last = m
            time.sleep(0.05)
    more = [next(_rooms) for _ in range(2)]
    for k, room in enumerate(more):
        send(client, r, w, room, 6000 + k)
    assert r.wait({room: 1 for room in more}, 60)
    m = scrape_until(w, lambda m: value(m, "epd_rooms_total", outcome="success", reason="none") >= 5
                     and value(m, "epd_items_total", cache="miss") >= 5)
    assert value(m, "epd_rooms_total", outcome="success", reason="none") == 5
    assert value(m, "epd_items_total", cache="miss") == 5
    assert value(m, "epd_requests_total", outcome="accepted", reason="none") == 5
    assert value(m, "epd_room_latency_seconds_count") == 5
    assert value(m, "epd_stage_restarts_total", stage="reaper") == 1
    assert value(m, "epd_stage_restarts_total", stage="cache") == 1


def test_inprocess_worker_serves_the_same_counters(started):
    w, client, r = started("inprocess")
    room = next(_rooms)
    send(client, r, w, room, 7000)
    assert r.wait({room: 1}, 60)
    m = scrape_until(w, lambda m: total(m, "epd_rooms_total") == 1)
    assert value(m, "epd_requests_total", outcome="accepted", reason="none") == 1
    assert value(m, "epd_rooms_total", outcome="success", reason="none") == 1
    assert value(m, "epd_items_total", cache="miss") == 1
    assert value(m, "epd_transfer_bytes_total") == SPAN * ROW_BYTES


def test_a_taken_port_fails_the_start_with_a_reason(shm_prefix, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PipelineError, match=f"127.0.0.1:{port}.*metrics_endpoint"):
            PipelineWorker(sim_config(shm_prefix, tmp_path, metrics_endpoint=f"127.0.0.1:{port}"))


def test_reason_classes_are_bounded():
    assert reason_class("deadline exceeded (deadline_ms)") == "deadline"
    assert reason_class("the tower stage died while it held this room") == "stage_died"
    assert reason_class("transfer to receiver rx-17 failed: connection reset") == "transfer_error"
    assert reason_class("alloc for item 3 says span 9; the worker's span is 4") == "bad_alloc"
    assert reason_class("item 0: grid [1, 3, 4] has h or w not divisible by the merge size 2") == "bad_request"
    assert reason_class("not a msgpack message (ExtraData)") == "unreadable"
    assert reason_class("duplicate room") == "duplicate_room"
    assert reason_class("something nobody wrote yet") == "other"


def test_a_reason_code_set_where_the_failure_is_raised_is_the_label():
    # the code wins over the text; the text is classed only where no code was set
    assert reason_class("pixels were lost before scheduling (cache died)", ReasonCode.STAGE_DIED) == "stage_died"
    assert reason_class("tower failed: item 0 was canceled by the model", ReasonCode.TOWER_ERROR) == "tower_error"
    assert reason_class("tower failed: item 0 was canceled by the model") == "canceled"  # what text matching did
    with pytest.raises(ValueError):
        reason_class("x", "not_a_code")  # a label outside the bounded set is a bug, not a new label
    # every class the text fallback gives is a code, so both paths give one label set
    assert {name for name, _ in REASON_CLASSES} | {"other"} == {c.value for c in ReasonCode}
    failure = RoomFailure(3, 17, "pixels were lost", ReasonCode.STAGE_DIED)
    again = pickle.loads(pickle.dumps(failure))  # as it crosses a ring to the reaper
    assert again == failure and again.code == "stage_died"
    assert RoomFailure(None, 17, "canceled").code == ""  # a raise site that sets none yet


def test_every_reason_code_is_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    missing = [c.value for c in ReasonCode if f"`{c.value}`" not in doc]
    assert not missing, missing


def test_totals_of_a_dead_stage_are_carried():
    t = StageTotals(["reaper"])
    with t.lock:
        t.seen("reaper", {"rooms_concluded": {("success", "none"): 4}})
        t.retire("reaper", {})  # unreadable as it died: its last readable totals count
        assert t.total().counters[("epd_rooms_total", ("success", "none"))] == 4
        t.seen("reaper", {"rooms_concluded": {("success", "none"): 1}})  # the successor's
        assert t.total().counters[("epd_rooms_total", ("success", "none"))] == 5
    assert totals_of({}).counters == {}


def test_build_versions_import_nothing():
    """The supervisor has no torch loaded: epd_build_info's versions come from package metadata."""
    code = ("import sys; from pipeline.ops.metrics import build_versions; v = build_versions(); "
            "assert 'torch' not in sys.modules and 'mooncake' not in sys.modules, sorted(sys.modules); "
            "print(v)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert "'python'" in out.stdout and "'torch'" in out.stdout


# ---------------------------------------------------------------- bounds of the endpoint

def test_the_endpoint_binds_off_loopback_only_when_the_operator_accepts_the_risk():
    from pipeline.cli.config import ConfigError, WorkerConfig

    WorkerConfig(metrics_endpoint="127.0.0.1:9100").resolved().validate()
    WorkerConfig(metrics_endpoint="[::1]:9100").resolved().validate()
    with pytest.raises(ConfigError, match="allow-insecure-network") as e:
        WorkerConfig(metrics_endpoint="0.0.0.0:9100").resolved().validate()
    assert e.value.key == "metrics_endpoint"
    WorkerConfig(metrics_endpoint="0.0.0.0:9100", allow_insecure_network=True).resolved().validate()


def _held(conns: list) -> int:
    """How many of these client connections the server still holds open."""
    held = 0
    for c in conns:
        c.setblocking(False)  # a socket with a timeout would wait that long in recv
        try:
            if c.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                held += 1
        except BlockingIOError:
            held += 1  # open, nothing sent: still held
        except OSError:
            pass  # reset: closed
    return held


@pytest.mark.parametrize("mode", ["inprocess", "pipeline"])
def test_idle_connections_hold_at_most_the_cap_and_rooms_are_served(started, mode):
    """Hundreds of connections that send nothing: the endpoint holds at most its cap
    (the rest closed as they come), drops those after its idle timeout, and the worker
    serves rooms throughout. Old code held every one, each a descriptor and a thread,
    for good."""
    MAX_HTTP_CONNECTIONS = 16

    w, client, r = started(mode)
    port = w.runtime.metrics.port
    conns = []
    try:
        for _ in range(300):
            conns.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        room = next(_rooms)
        send(client, r, w, room, 4000)
        assert r.wait({room: 1}, 60) and room not in r.failed, r.failed.get(room)
        end = time.monotonic() + 30
        while _held(conns) > MAX_HTTP_CONNECTIONS and time.monotonic() < end:
            time.sleep(0.1)  # the accepts still in the listen queue
        held = _held(conns)
        assert held <= MAX_HTTP_CONNECTIONS, f"{held} idle connections held open (cap {MAX_HTTP_CONNECTIONS})"
        while _held(conns) and time.monotonic() < end + 30:
            time.sleep(0.1)
        assert _held(conns) == 0, "idle connections never dropped"
    finally:
        for c in conns:
            c.close()
    assert scrape(w), "the endpoint serves again once the idle connections are gone"


def test_the_preprocess_workers_outcomes_are_counted():
    from pipeline.ops.metrics import totals_of

    c = totals_of({"preprocess_items": {"decoded": 3, "fetched": 2, "fetch_failed": 1}}).counters
    assert c[("epd_preprocess_items_total", ("fetched",))] == 2
    assert c[("epd_preprocess_items_total", ("fetch_failed",))] == 1
