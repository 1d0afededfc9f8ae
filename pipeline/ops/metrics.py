"""Prometheus metrics: one collector that reads the worker's state when it is scraped.

Each stage keeps monotonic totals (and histograms with the fixed buckets below) in
its `stats()` dict. In the pipeline every stage process publishes that dict to the
StatsBoard a few times a second, and the supervisor serves the endpoint: its
collector reads the board, the heartbeat rows, the rings and the arenas at scrape
time. That is what makes it multi-process aware without prometheus_client's
file-based multiprocess mode (which leaves files behind). A restarted stage starts
counting from zero, so `StageTotals` keeps what a dead stage last published and adds
it: counters never go backwards.

The histogram and the reason classes that stages count with are in ipc/stats.py;
this module imports prometheus_client only where it serves.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from socketserver import ThreadingMixIn
from typing import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from ipc.stats import SECONDS_BUCKETS
from pipeline.ops.exposure import HTTP_IDLE_TIMEOUT_S, BoundedHTTP
from stages.registry import CACHE

log = logging.getLogger("epd.metrics")

# ------------------------------------------------------------------ totals

@dataclass
class Totals:
    """Monotonic samples: counters by (metric, labels), histograms by metric ([counts], sum)."""
    counters: dict = field(default_factory=dict)
    histograms: dict = field(default_factory=dict)

    def add(self, other: "Totals") -> None:
        for key, v in other.counters.items():
            self.counters[key] = self.counters.get(key, 0) + v
        for name, (counts, total) in other.histograms.items():
            mine = self.histograms.get(name)
            if mine is None:
                self.histograms[name] = (list(counts), total)
            else:
                self.histograms[name] = ([a + b for a, b in zip(mine[0], counts)], mine[1] + total)


# stats() key -> counter (no labels)
_PLAIN_COUNTERS = {
    "tower_batches": "epd_tower_batches_total",
    "tower_items": "epd_tower_items_total",
    "tower_rows": "epd_tower_rows_total",
    "bytes_written": "epd_transfer_bytes_total",
    "transfer_failures": "epd_transfer_failures_total",
}
# stats() key -> histogram
_HISTOGRAMS = {
    "tower_batch_seconds": "epd_tower_batch_seconds",
    "transfer_seconds": "epd_transfer_seconds",
    "room_latency_seconds": "epd_room_latency_seconds",
    "scheduler_queue_wait_seconds": "epd_scheduler_queue_wait_seconds",
    "alloc_wait_seconds": "epd_alloc_wait_seconds",
    "store_get_seconds": "epd_store_get_seconds",
}


def totals_of(stats: dict) -> Totals:
    """The monotonic totals in one stage's stats() (each stage reports keys of its own)."""
    t = Totals()
    c = t.counters
    for (outcome, reason), n in stats.get("requests", {}).items():
        c[("epd_requests_total", (outcome, reason))] = n
    for (outcome, reason), n in stats.get("rooms_concluded", {}).items():
        c[("epd_rooms_total", (outcome, reason))] = n
    for kind, n in stats.get("sender_refused", {}).items():
        c[("epd_refused_total", (kind,))] = n
    for outcome, n in stats.get("cache_items", {}).items():
        c[("epd_items_total", (outcome,))] = n
    for outcome, n in stats.get("preprocess_items", {}).items():
        c[("epd_preprocess_items_total", (outcome,))] = n
    for what in ("gets", "puts"):
        for outcome, n in stats.get(f"store_{what}", {}).items():
            c[(f"epd_store_{what}_total", (outcome,))] = n
    for key, name in _PLAIN_COUNTERS.items():
        if key in stats:
            c[(name, ())] = stats[key]
    for key, name in _HISTOGRAMS.items():
        if key in stats:
            t.histograms[name] = (list(stats[key]["counts"]), stats[key]["sum"])
    return t


def merge_stats(per_stage: dict[str, dict]) -> dict:
    """The worker's stats: every stage's stats() in one dict, numbers that several stages
    report (the tower replicas' counters) summed, and counts by outcome too (the
    preprocess workers'), and each stage's own under "per_stage"."""
    out: dict = {}
    for stats in per_stage.values():
        for key, value in stats.items():
            before = out.get(key)
            if isinstance(value, (int, float)) and isinstance(before, (int, float)):
                out[key] = before + value
            elif _counts(value) and _counts(before):
                out[key] = {k: before.get(k, 0) + value.get(k, 0) for k in before.keys() | value.keys()}
            else:
                out[key] = value
    out["per_stage"] = per_stage
    return out


def _counts(value) -> bool:
    return isinstance(value, dict) and all(isinstance(n, int) for n in value.values())


class StageTotals:
    """Each stage's last published stats, and the totals its dead predecessors had counted.

    `lock` orders a scrape against a stage's death: the supervisor retires a dead stage's
    stats and clears its board region under it, so no scrape sees them twice or not at all.
    """

    def __init__(self, stages):
        self.lock = threading.Lock()
        self.last: dict[str, dict] = {s: {} for s in stages}
        self.carried: dict[str, Totals] = {s: Totals() for s in stages}

    def seen(self, stage: str, stats: dict) -> dict:
        """Lock held: `stats` as just read ({} when unreadable: mid-write, or not yet
        published); returns the latest readable."""
        if stats:
            self.last[stage] = stats
        return self.last[stage]

    def retire(self, stage: str, stats: dict) -> None:
        """Lock held: the stage died; `stats` is what its board region holds now."""
        self.carried[stage].add(totals_of(self.seen(stage, stats)))
        self.last[stage] = {}

    def total(self) -> Totals:
        """Lock held: every stage's totals, dead predecessors' included."""
        out = Totals()
        for stage, stats in self.last.items():
            out.add(self.carried[stage])
            out.add(totals_of(stats))
        return out


@dataclass
class Snapshot:
    """What one scrape reports. `stages` (pipeline only): stage -> ring_depth, busy_ratio,
    heartbeat_age_s, restarts; `arenas`: tier -> (bytes used, bytes)."""
    totals: Totals
    stats: dict  # stage -> its last published stats(), for the gauges
    stages: dict = field(default_factory=dict)
    arenas: dict = field(default_factory=dict)
    live_rooms: int = 0


# ------------------------------------------------------------------ the collector

_COUNTERS = [
    # name, help, label names, label values always reported (as 0 until counted)
    ("epd_requests_total", "Encode requests taken from the intake socket, by outcome: accepted (a room "
     "opened), rejected (the room failed at intake), dropped (no room to fail: unreadable, duplicate), "
     "and reason class", ("outcome", "reason"), [("accepted", "none")]),
    ("epd_rooms_total", "Rooms concluded, by outcome (success, failed) and failure reason class",
     ("outcome", "reason"), [("success", "none")]),
    ("epd_refused_total", "Bootstrap messages refused under CurveZMQ because the room they name is not their "
     "key's (answered as a room never seen), by message: alloc, cancel, query",
     ("message",), [("alloc",), ("cancel",), ("query",)]),
    ("epd_items_total", "Items by cache outcome: hit_arena, hit_host (promoted), miss (encoded), "
     "inflight_duplicate (waited for an identical item being encoded)",
     ("cache",), [("hit_arena",), ("hit_host",), ("miss",), ("inflight_duplicate",)]),
    ("epd_preprocess_items_total", "Compressed images the preprocess workers took, by outcome: decoded, "
     "failed (did not decode), fetched (an http(s) media.url's bytes, then looked up in the cache), "
     "fetch_failed (the URL's room failed with why)", ("outcome",), []),
    ("epd_store_gets_total", "Lookups of the shared store (store_master), by outcome: hit, miss, rejected "
     "(the value failed its size or digest check), failed (the call failed: the master gone), timeout (no "
     "answer within store_get_timeout_s), skipped (not asked: not connected, or a call stuck past its "
     "deadline); all but hit encode the item", ("outcome",), []),
    ("epd_store_puts_total", "Encoded rows put into the shared store, by outcome: stored, failed, dropped "
     "(not queued: not connected, or too many queued)", ("outcome",), []),
    ("epd_tower_batches_total", "Batches the vision tower ran", (), [()]),
    ("epd_tower_items_total", "Items the vision tower encoded", (), [()]),
    ("epd_tower_rows_total", "Embedding rows (merged tokens) the vision tower produced", (), [()]),
    ("epd_transfer_bytes_total", "Embedding bytes submitted to Mooncake writes", (), [()]),
    ("epd_transfer_failures_total", "Mooncake writes that failed or could not start", (), [()]),
]
_HISTOGRAM_HELP = {
    "epd_tower_batch_seconds": "Tower batch time, from its start to its result being collected",
    "epd_transfer_seconds": "Mooncake write time per receiver shard, from submit to completion",
    "epd_room_latency_seconds": "Room latency from intake to its conclusion (success or failed)",
    "epd_scheduler_queue_wait_seconds": "Time an item waited at the scheduler, from its arrival there to "
                                        "its batch going to a tower",
    "epd_alloc_wait_seconds": "Time from an item's embedding being ready at the sender to its allocs "
                              "being complete (every shard's alloc arrived)",
    "epd_store_get_seconds": "Shared-store lookup time, from the call to its answer, hit or not (a lookup "
                             "past store_get_timeout_s counts as a timeout instead)",
}


MOONCAKE_DISTRIBUTIONS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda",
                          "mooncake-transfer-engine-cuda13")


def _installed_version(*distributions: str) -> str:
    from importlib import metadata

    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return ""


def build_versions() -> dict[str, str]:
    """The labels of epd_build_info but the tower's, read from the installed packages'
    metadata: nothing is imported (a supervisor has no torch loaded, and must not load it)."""
    import platform

    return {"version": _installed_version("epd-encode-worker"), "python": platform.python_version(),
            "torch": _installed_version("torch"), "mooncake": _installed_version(*MOONCAKE_DISTRIBUTIONS)}


def _bucket_bounds() -> list[str]:
    from prometheus_client.utils import floatToGoString

    return [floatToGoString(b) for b in SECONDS_BUCKETS] + ["+Inf"]


class Collector:
    """A prometheus_client collector: `snapshot()` is called at every scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot]):
        self.snapshot = snapshot
        self.bounds = _bucket_bounds()
        self.versions = build_versions()

    def _build_info(self, stats: dict):
        from prometheus_client.core import GaugeMetricFamily

        # The tower's name comes from the first tower stage that has published its stats.
        tower = next((st["tower_name"] for st in stats.values() if st.get("tower_name")), "")
        labels = {**self.versions, "tower": tower}
        fam = GaugeMetricFamily("epd_build_info", "Always 1; the labels tell workers apart: the worker's "
                                "version, Python's, torch's and Mooncake's (\"\" when not installed), and "
                                "the vision tower", labels=list(labels))
        fam.add_metric(list(labels.values()), 1)
        return fam

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        s = self.snapshot()
        counters = s.totals.counters
        # The store's families only where it is configured: without it, the same families as before it.
        store = s.stats.get(CACHE, {}).get("store")
        for name, text, labels, always in _COUNTERS:
            if name.startswith("epd_store_") and not store:
                continue
            fam = CounterMetricFamily(name, text, labels=labels)
            values = dict.fromkeys(always, 0)
            values.update({lv: v for (n, lv), v in counters.items() if n == name})
            for lv, v in sorted(values.items()):
                fam.add_metric(list(lv), v)
            yield fam
        for name, text in _HISTOGRAM_HELP.items():
            if name.startswith("epd_store_") and not store:
                continue
            counts, total = s.totals.histograms.get(name, ([0] * len(self.bounds), 0.0))
            cumulative, run = [], 0
            for bound, n in zip(self.bounds, counts):
                run += n
                cumulative.append((bound, run))
            yield HistogramMetricFamily(name, text, buckets=cumulative, sum_value=total)

        if s.stages:
            per_stage = [
                ("epd_ring_depth_records", "Records waiting in a stage's input rings", "ring_depth"),
                ("epd_stage_busy_ratio", "Fraction of the last second a stage's loop spent working "
                 "rather than waiting for records", "busy_ratio"),
                ("epd_stage_heartbeat_age_seconds", "Seconds since a stage's last heartbeat", "heartbeat_age_s"),
            ]
            for name, text, key in per_stage:
                fam = GaugeMetricFamily(name, text, labels=["stage"])
                for stage, row in s.stages.items():
                    fam.add_metric([stage], row[key])
                yield fam
            fam = CounterMetricFamily("epd_stage_restarts_total", "Times the supervisor restarted a stage",
                                      labels=["stage"])
            for stage, row in s.stages.items():
                fam.add_metric([stage], row["restarts"])
            yield fam

        used_text = ("Bytes leased in a shared-memory arena (pixels: requests' pixels; embeddings: rows in "
                     "flight and the cache's arena tier)")
        used = GaugeMetricFamily("epd_arena_used_bytes", used_text, labels=["tier"])
        # The name before the unit went last; exported one more release so dashboards can move.
        old_used = GaugeMetricFamily("epd_arena_bytes_used", "DEPRECATED: use epd_arena_used_bytes (removed in "
                                     "the next release). " + used_text, labels=["tier"])
        size = GaugeMetricFamily("epd_arena_bytes", "Size of a shared-memory arena", labels=["tier"])
        for tier, (n_used, n_size) in s.arenas.items():
            used.add_metric([tier], n_used)
            old_used.add_metric([tier], n_used)
            size.add_metric([tier], n_size)
        yield used
        yield old_used
        yield size
        yield self._build_info(s.stats)

        cache = s.stats.get(CACHE, {}).get("cache")
        if cache:
            occupancy = GaugeMetricFamily("epd_cache_bytes", "Bytes the embedding cache holds, by tier",
                                          labels=["tier"])
            budget = GaugeMetricFamily("epd_cache_budget_bytes", "The embedding cache's budget, by tier",
                                       labels=["tier"])
            entries = GaugeMetricFamily("epd_cache_entries", "Entries in the embedding cache, by tier",
                                        labels=["tier"])
            for tier in ("arena", "host"):
                occupancy.add_metric([tier], cache[f"{tier}_bytes"])
                budget.add_metric([tier], cache[f"{tier}_budget"])
                entries.add_metric([tier], cache[f"{tier}_entries"])
            yield occupancy
            yield budget
            yield entries
        if store:
            yield GaugeMetricFamily("epd_store_connected", "1 while the cache stage's store client is set up "
                                    "(it finds a restarted master by itself)", value=int(store["connected"]))
        yield GaugeMetricFamily("epd_rooms_live", "Rooms not yet concluded", value=s.live_rooms)


# ------------------------------------------------------------------ the endpoint

class MetricsError(RuntimeError):
    """The metrics endpoint could not be served."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """"host:port" (port 0: any free port; "[::1]:9100" for IPv6) -> (host, port)."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or int(port) > 65535:
        raise MetricsError(f"metrics_endpoint must be host:port (a port 0-65535), got {endpoint!r}")
    return host, int(port)


# What /readyz needs of the health callable's conditions, each with the value that
# means ready. A condition missing from the answer counts as failing.
READY_WHEN = {"loop_alive": True, "stages_ready": True, "draining": False, "restart_budget_left": True}


def probe(path: str, health: Callable[[], dict]) -> tuple[int, dict]:
    """/healthz or /readyz -> (HTTP status, JSON body). `health()` answers the conditions
    of READY_WHEN (plus any detail worth showing, e.g. which stages are not ready)."""
    try:
        conditions = dict(health())
    except Exception as e:  # a probe that cannot tell says so rather than guess
        log.warning("the health check raised: %r", e, exc_info=True)
        return 503, {"error": f"the health check raised {e!r}"}
    if path == "/healthz":
        alive = conditions.get("loop_alive") is True
        return (200 if alive else 503), {"alive": alive, "loop_alive": conditions.get("loop_alive")}
    failing = [name for name, want in READY_WHEN.items() if conditions.get(name) is not want]
    return (503 if failing else 200), {**conditions, "ready": not failing, "failing": failing}


class _Server(BoundedHTTP, ThreadingMixIn, WSGIServer):
    """Bounded as every HTTP listener is (pipeline/ops/exposure.py): a few hundred idle
    connections would otherwise hold as many descriptors and threads, for good."""

    def __init__(self, address, handler, family):
        self.address_family = family  # IPv6 as well: the base class binds AF_INET
        super().__init__(address, handler)


class _QuietHandler(WSGIRequestHandler):
    timeout = HTTP_IDLE_TIMEOUT_S

    def log_message(self, format, *args):
        """A probe every few seconds must not write a line to stderr each time."""


class MetricsServer:
    """The Prometheus endpoint on a thread of its own, with a registry of its own
    (nothing registers in prometheus_client's global one): `/metrics`, and with a
    `health` callable the probes `/healthz` and `/readyz` (see `probe`); any other
    path is 404."""

    def __init__(self, endpoint: str, snapshot: Callable[[], Snapshot],
                 health: Callable[[], dict] | None = None):
        from prometheus_client import CollectorRegistry, make_wsgi_app

        host, port = parse_endpoint(endpoint)
        registry = CollectorRegistry()
        registry.register(Collector(snapshot))
        self._metrics_app = make_wsgi_app(registry)
        self._health = health
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
            self._httpd = _Server((host, port), _QuietHandler, family)
        except OSError as e:
            raise MetricsError(f"cannot serve metrics on {endpoint} (metrics_endpoint): "
                               f"{e.strerror or e}; choose a free port, or 0 for any") from None
        self._httpd.set_app(self._app)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        self.host = host
        self.port = self._httpd.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def _app(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path in ("/healthz", "/readyz") and self._health is not None:
            status, body = probe(path, self._health)
            start_response(f"{status} {HTTPStatus(status).phrase}", [("Content-Type", "application/json")])
            return [json.dumps(body, default=str).encode() + b"\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: /metrics" + (b", /healthz, /readyz" if self._health else b"") + b"\n"]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
