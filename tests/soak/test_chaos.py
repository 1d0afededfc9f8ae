"""Chaos under load, short and dense (issue #11): for 60 s a stage is SIGKILLed every
0.5-1.2 s (often one holding rooms, sometimes two within 50 ms, sometimes a stage again
while it starts, now and then a SIGSTOP past the heartbeat limit), receivers are killed
and rooms canceled, under a window of 32 rooms in flight; every invariant of
benchmarks/chaos.py must hold. The long run is `benchmarks/chaos.py --dense --minutes M`
(the steady, sparser soak is `benchmarks/chaos.py --minutes M`)."""
from __future__ import annotations

import random

import pytest

from pipeline.testing.chaos import run_chaos

pytestmark = pytest.mark.timeout(600)


def test_dense_chaos_every_room_concludes(shm_prefix, tmp_path):
    seed = random.randrange(1 << 31)
    print(f"seed {seed} (replay: benchmarks/chaos.py --dense --seed {seed})")
    res = run_chaos(60.0, seed, shm_prefix=shm_prefix, run_dir=str(tmp_path), dense=True)
    summary = {k: res[k] for k in ("rooms_hung", "duplicate_statuses", "wrong_rows", "serving_at_end",
                                   "kills", "median_rooms_held_at_kill", "rooms_submitted")}
    assert res["violations"] == [], f"seed {seed}: {summary}: {res['violations']}"
    assert res["rooms_hung"] == 0, (seed, summary)
    assert res["duplicate_statuses"] == 0, (seed, summary)
    assert res["wrong_rows"] == 0, (seed, summary)
    assert res["serving_at_end"], (seed, summary)
    # the chaos happened, densely, to stages that held rooms, and the load with it
    assert res["kills"] >= 20, (seed, res["kill_log"])
    # Counted, not a median: while a SIGSTOPped stage's replacement is awaited nothing
    # moves and no stage holds a room, so on a loaded machine kills in such a stretch
    # can be half of them; those kills are still chaos, but they test no custody.
    kills_holding = sum(n for held, n in res["rooms_held_at_kill"].items() if held >= 1)
    assert kills_holding >= 10, (seed, res["rooms_held_at_kill"])
    assert res["restarts"] >= 10, (seed, res["restarts_by_stage"])
    assert res["rooms_submitted"] >= 200, (seed, summary)
    assert res["rooms_succeeded"] >= res["rooms_submitted"] // 2, (seed, summary)
    assert res["cancels_sent"] >= 1, (seed, summary)
