"""Tower replicas (`tower_replicas`): one intake, cache, scheduler and sender feeding N
tower processes (or N tower stages of the in-process loop), each a stage of its own
under the supervisor. Real processes, SIGKILL, the sim tower."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest

from pipeline.cli import status
from stages import registry
from tests.runtime.test_stage_faults import Load, crash_loop, stage_pid, wait_restarted

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def replicas(worker_rig):
    def start(n: int, mode: str = "pipeline", **over):
        over.setdefault("bootstrap_timeout_s", 5.0)
        over.setdefault("sim_time_per_row_s", 5e-4)  # the device, not the host, is the bottleneck
        w, client, (r,) = worker_rig(mode, tower_replicas=n, **over)
        return w, client, r

    return start


def tower_batches(w) -> dict[str, int]:
    per_stage = w.stats()["per_stage"]
    return {name: stats.get("tower_batches", 0) for name, stats in per_stage.items() if name.startswith("tower")}


@pytest.mark.parametrize("mode", ["pipeline", "inprocess"])
@pytest.mark.parametrize("n", [2, 3])
def test_rows_are_bit_exact_and_every_replica_is_used(replicas, n, mode):
    w, client, r = replicas(n, mode, sim_time_per_row_s=2e-3)  # batches of 4 to 12 ms: a queue builds
    load = Load(w, client, r, seed=n)
    load.send(40, pause=0.0)
    load.settle()
    assert not r.failed, r.failed
    batches = tower_batches(w)
    assert sorted(batches) == [f"tower{k}" for k in range(n)]
    assert all(batches.values()), f"a replica did no batch: {batches}"
    assert w.stats()["tower_batches"] == sum(batches.values())
    if mode == "pipeline":
        run = status.read_run(w.cfg.shm_prefix, w.runtime.run_id, os.getpid())
        assert [s for s in run["stages"] if s.startswith("tower")] == [f"tower{k}" for k in range(n)]
        assert all(s["alive"] and s["ready"] for s in run["stages"].values())
        assert set(w.runtime.metrics_snapshot().stages) == set(w.runtime.stages)


@pytest.mark.parametrize("n", [2, 3])
def test_sigkill_of_one_replica_under_a_full_window_fails_only_its_rooms(replicas, n):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    # One item per batch, 8 to 24 ms each: every replica holds a full window (two batches)
    # while the rooms are sent.
    w, client, r = replicas(n, sim_time_per_row_s=0.004, max_items_per_batch=1, bootstrap_timeout_s=20.0)
    victim = f"tower{n - 1}"
    load = Load(w, client, r, seed)
    load.send(40, pause=0.0)
    deadline = time.monotonic() + 30
    while not w.runtime.rooms.held_by(1 << registry.owner_of(victim)):
        assert time.monotonic() < deadline, "the victim never held a room"
        time.sleep(0.002)
    os.kill(stage_pid(w, victim), signal.SIGKILL)
    before = {k: v for k, v in tower_batches(w).items() if k != victim}
    load.send(20, pause=0.0)
    wait_restarted(w, victim)
    load.settle(120)
    failed = {room: reason for room, reason in r.failed.items() if room in load.sent}
    assert failed, "the victim held no room: the window was not full"
    # Its custody's rooms, and rooms whose rows were in the sender's ring still leased by it
    # (the supervisor reclaimed the lease before the sender took it over).
    assert all(f"the {victim} stage died" in reason or f"({victim} died)" in reason
               for reason in failed.values()), failed
    after = tower_batches(w)
    assert all(after[k] > v for k, v in before.items()), (before, after)  # the others kept serving
    assert w.runtime.restart_counts == {s: int(s == victim) for s in w.runtime.stages}
    # The successor takes its share again once it is back (on a loaded machine its start
    # can outlast a few rooms): rooms until it has run a batch, all of them served.
    end = time.monotonic() + 120
    while True:
        load.send(10, pause=0.0)
        load.settle(120)
        assert not [room for room in list(load.sent)[-10:] if room in r.failed], r.failed
        if tower_batches(w)[victim] > 0:
            break
        assert time.monotonic() < end, f"the restarted {victim} never ran a batch: {tower_batches(w)}"


def test_crash_looping_replica_trips_the_restart_limit(shm_prefix, tmp_path):
    crash_loop(shm_prefix, tmp_path, "tower1", 6, 400, tower_replicas=2)
