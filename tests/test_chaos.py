"""Chaos under load, short: stages SIGKILLed and SIGSTOPped, receivers killed, rooms canceled,
for 40 s of a steady load; every invariant of benchmarks/chaos.py must hold (0 violations).
The long run is `benchmarks/chaos.py --minutes M`."""
from __future__ import annotations

import random

import pytest

from benchmarks.chaos import run_chaos

pytestmark = pytest.mark.timeout(600)


def test_chaos_under_load_keeps_every_invariant(shm_prefix, tmp_path):
    seed = random.randrange(1 << 31)
    print(f"seed {seed} (replay: benchmarks/chaos.py --seed {seed})")
    res = run_chaos(40.0, seed, shm_prefix=shm_prefix, run_dir=str(tmp_path))
    assert res["violations"] == [], f"seed {seed}: {res['violations']}"
    # the chaos happened, and the load with it
    assert res["kills"] >= 8, res["kill_log"]
    assert res["restarts"] >= 1
    assert res["rooms_submitted"] >= 200
    assert res["rooms_succeeded"] >= res["rooms_submitted"] // 2
    assert res["cancels_sent"] >= 1
