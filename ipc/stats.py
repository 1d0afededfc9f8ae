"""Counters that stages keep and the supervisor reads: latency histograms with fixed
buckets, and the bounded label of a failure (its ReasonCode; else its text's class).

Plain Python, no prometheus_client: every stage imports this, and only the process
that serves the metrics endpoint needs the exporter (pipeline/ops/metrics.py).
"""

from __future__ import annotations

from bisect import bisect_left
from enum import StrEnum

# Upper bounds (seconds) of every histogram's buckets; +Inf is implicit.
SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class Histogram:
    """Counts per bucket (not cumulative; the last is +Inf) and the sum, for a stats() dict."""

    def __init__(self):
        self.counts = [0] * (len(SECONDS_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(SECONDS_BUCKETS, seconds)] += 1  # bucket i holds v <= bound i
        self.sum += seconds

    def snapshot(self) -> dict:
        return {"counts": list(self.counts), "sum": self.sum}


class ReasonCode(StrEnum):
    """Why a room failed, set where the failure is raised and carried with it
    (RoomFailure.code); its value is the `reason` label of epd_rooms_total and
    epd_requests_total. The reason text (room ids, sizes, receiver names in it) is for
    the person reading a status or a log line; the label set stays bounded."""

    DEADLINE = "deadline"  # deadline_ms passed
    CANCELED = "canceled"  # a receiver canceled the room
    SHUTDOWN = "shutdown"  # the worker is shutting down
    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"  # allocs incomplete within bootstrap_timeout_s
    STAGE_DIED = "stage_died"  # a stage died holding the room, its pixels or rows
    TOWER_ERROR = "tower_error"  # the vision tower failed on an item
    TRANSFER_ERROR = "transfer_error"  # a write to a receiver failed
    BAD_ALLOC = "bad_alloc"  # a receiver's alloc was refused
    DUPLICATE_ROOM = "duplicate_room"  # the room id is live already
    TABLE_FULL = "table_full"  # no room left in the room table
    TABLE_DAMAGED = "table_damaged"  # the room table's entry could not be trusted
    OVER_LIMIT = "over_limit"  # a configured limit (max_live_rooms, pixel bytes...)
    UNREADABLE = "unreadable"  # the request could not be read
    BAD_REQUEST = "bad_request"  # the request broke a rule of the protocol
    OTHER = "other"  # none of the above (a bug to name)


# Until every raise site sets its code, a failure without one is classed by its text: a
# label takes the first class whose words appear in the reason.
REASON_CLASSES = [
    ("deadline", ("deadline exceeded",)),
    ("canceled", ("canceled",)),
    ("shutdown", ("worker shutting down", "worker stopped")),
    ("bootstrap_timeout", ("bootstrap_timeout_s",)),
    ("stage_died", ("stage died", "died)", "was lost", "were lost", "lost (", "reclaimed")),
    ("tower_error", ("tower failed",)),
    ("transfer_error", ("transfer to receiver",)),
    ("bad_alloc", ("alloc for item", "allocs for item", "shards of item")),
    ("duplicate_room", ("duplicate room",)),
    ("table_full", ("room table full",)),
    ("table_damaged", ("damaged",)),
    ("over_limit", ("max_live_rooms", "max_pixel_bytes_per_request", "pixel arena holds")),
    ("unreadable", ("room cannot be read", "not a msgpack message", "message is not a map")),
    (
        "bad_request",
        (
            "item ",
            "segment ",
            "request_id",
            "deadline_ms",
            "items must",
            "intake takes",
            "room must",
            "protocol version",
            "message type",
        ),
    ),
]


def reason_class(reason: str, code: str = "") -> str:
    """The bounded label for a failure: its code when the raise site set one, else the
    class of its reason text (one of REASON_CLASSES' names), else "other"."""
    if code:
        return ReasonCode(code).value
    for name, words in REASON_CLASSES:
        if any(w in reason for w in words):
            return name
    return "other"
