"""Chaos under load, dense and short: for 60 s, a window of rooms in flight while a stage is
SIGKILLed every 0.5-1.2 s (sometimes two within 50 ms, sometimes one again while it starts),
now and then SIGSTOPped past the heartbeat limit, receivers killed, rooms canceled; every
invariant of benchmarks/chaos.py must hold (0 violations), no room may hang, and the worker
must serve ten fresh rooms afterwards. The long run is `benchmarks/chaos.py --dense --minutes M`."""
from __future__ import annotations

import random

import pytest

from benchmarks.chaos import run_chaos

pytestmark = pytest.mark.timeout(600)


def test_dense_chaos_keeps_every_invariant(shm_prefix, tmp_path):
    seed = random.randrange(1 << 31)
    print(f"seed {seed} (replay: benchmarks/chaos.py --dense --minutes 1 --seed {seed})")
    res = run_chaos(60.0, seed, shm_prefix=shm_prefix, run_dir=str(tmp_path), dense=True)
    assert res["violations"] == [], f"seed {seed}: {res['violations']}"
    assert res["violation_count"] == 0
    assert res["rooms_hung"] == 0
    assert res["duplicate_statuses"] == 0
    assert res["wrong_rows"] == 0
    assert res["serving_at_end"] is True
    # the chaos happened, while the killed stages held rooms, and the load with it
    assert res["kills"] >= 20, res["kill_log"]
    assert res["median_rooms_held_at_kill"] >= 1, res["rooms_held_at_kill"]
    assert res["restarts"] >= 1
    assert res["rooms_succeeded"] >= 200
    assert res["cancels_sent"] >= 1
