"""`run.py status`: a live worker's rooms, stages, queues, restarts and cache read from shared
memory without touching it; no worker under the prefix is exit 4."""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ipc import shm
from pipeline.cli import status
from pipeline.peers.client import Client, Item
from pipeline.cli.config import WorkerConfig
from pipeline.peers.receiver import Receiver
from tests.helpers import PipelineWorker, ThreadedWorker, fork_call, image, sim_config, wait_child

pytestmark = pytest.mark.timeout(300)
_rooms = itertools.count(1)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_status(capsys, prefix: str, as_json: bool = True):
    code = status.main(WorkerConfig(shm_prefix=prefix), as_json)
    out = capsys.readouterr().out
    return code, (json.loads(out) if as_json else out)


def send_rooms(w, prefix: str, n: int) -> None:
    client = Client(w.cfg.intake, prefix)
    r = Receiver("rx", w.cfg.bootstrap, buffer_bytes=16 << 20)
    try:
        rooms = [next(_rooms) for _ in range(n)]
        for k, room in enumerate(rooms):
            client.encode(room, f"req-{room}", [Item("image", *image(100 + k, grid=(1, 4, 4)))])
            r.alloc(room, 0, span=4, hidden=w.spec.hidden, dtype=w.spec.dtype,
                    deepstack_width=w.spec.deepstack_width)
        assert r.wait({room: 1 for room in rooms}, 60)
    finally:
        client.close()
        r.close()


def status_until(capsys, prefix: str, done, timeout: float = 30.0) -> dict:
    """Stages publish their counters a few times a second: read until `done(run)`."""
    end = time.monotonic() + timeout
    while True:
        code, out = run_status(capsys, prefix)
        assert code == 0, out
        run = out["runs"][0]
        if done(run) or time.monotonic() > end:
            return run
        time.sleep(0.1)


def test_status_of_a_live_pipeline_worker(shm_prefix, tmp_path, capsys):
    w = PipelineWorker(sim_config(shm_prefix, tmp_path))
    try:
        send_rooms(w, shm_prefix, 3)
        objects = shm.list_objects(shm_prefix)
        run = status_until(capsys, shm_prefix, lambda run: run.get("cache", {}).get("arena", {}).get("entries") == 3)
        assert run["run_id"] == w.runtime.run_id and run["mode"] == "pipeline"
        assert run["pid"] == os.getpid()  # the supervisor, running in this process
        assert run["rooms"]["success"] == 3 and run["live_rooms"] == 0
        assert run["rooms"]["failed"] == 0 and run["rooms"]["queued"] == 0
        assert set(run["stages"]) == {"intake", "cache", "preprocess", "scheduler", "tower", "sender", "reaper"}
        for stage, s in run["stages"].items():
            assert s["pid"] == w.runtime.procs[stage].pid and s["alive"] and s["ready"], (stage, s)
            assert s["queue_depth"] == 0 and s["restarts"] == 0 and s["heartbeat_age_s"] < 30
        assert run["cache"]["arena"]["bytes"] == 3 * 4 * (64 + 32) * 2
        assert run["cache"]["arena"]["budget_bytes"] == w.cfg.arena_cache_bytes
        assert run["cache"]["host"]["entries"] == 0

        os.kill(w.runtime.procs["scheduler"].pid, signal.SIGKILL)
        run = status_until(capsys, shm_prefix, lambda run: run["stages"]["scheduler"]["restarts"] == 1
                           and run["stages"]["scheduler"]["ready"])
        assert run["stages"]["scheduler"]["restarts"] == 1
        assert run["stages"]["scheduler"]["pid"] == w.runtime.procs["scheduler"].pid

        code, text = run_status(capsys, shm_prefix, as_json=False)
        assert code == 0
        assert f"worker {shm_prefix} (run {w.runtime.run_id}, pipeline, pid {os.getpid()})" in text
        assert "concluded, kept as tombstones: success 3, failed 0" in text
        assert "scheduler" in text and "arena tier" in text
        assert shm.list_objects(shm_prefix) == objects  # created nothing, removed nothing
    finally:
        w.close()


def test_status_of_an_inprocess_worker(shm_prefix, tmp_path, capsys):
    w = ThreadedWorker(sim_config(shm_prefix, tmp_path))
    try:
        send_rooms(w, shm_prefix, 2)
        code, out = run_status(capsys, shm_prefix)
        assert code == 0
        (run,) = out["runs"]
        assert run["mode"] == "inprocess" and run["rooms"]["success"] == 2 and "stages" not in run
        code, text = run_status(capsys, shm_prefix, as_json=False)
        assert code == 0 and "inprocess" in text
    finally:
        w.close()


def test_no_worker_is_exit_4_and_touches_nothing(shm_prefix, capsys):
    # What a killed worker leaves: a run lock nobody holds. Not a live worker, and not
    # status's to remove.
    assert wait_child(fork_call(shm.RunLock, shm_prefix)) == 0
    left = shm.list_objects(shm_prefix)
    assert len(left) == 1
    code, out = run_status(capsys, shm_prefix)
    assert code == status.NO_WORKER == 4 and out["runs"] == [] and shm_prefix in out["error"]
    code, text = run_status(capsys, shm_prefix, as_json=False)
    assert code == 4 and f"no worker is running with shm prefix {shm_prefix!r}" in text
    assert shm.list_objects(shm_prefix) == left
    shm.sweep(shm_prefix)


def test_run_py_status_without_a_worker_exits_4(shm_prefix):
    proc = subprocess.run([sys.executable, "run.py", "status", "--shm-prefix", shm_prefix],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr
    assert "no worker is running" in proc.stdout


@pytest.mark.parametrize("replicas", [1, 3])
def test_boards_name_the_run_stages_and_refuse_another_kind(shm_prefix, replicas):
    """The boards `run.py status` reads: a reader finds the run's stages from the header,
    sees what a writer wrote, and refuses a segment of another kind or a half-made one."""
    from pipeline.runtime.boards import DrainOrder, Heartbeats, IntakeJournal, StatsBoard
    from stages import registry

    run_id = shm.new_run_id()
    stages = registry.stage_names(replicas)
    made = [Heartbeats.create(shm_prefix, run_id, stages), StatsBoard.create(shm_prefix, run_id, stages),
            IntakeJournal.create(shm_prefix, run_id)]
    hb, board, journal = made
    try:
        hb2, board2, journal2 = (type(t).attach(shm_prefix, run_id) for t in made)
        assert hb2.stages == board2.stages == stages
        hb.order_drain(registry.INTAKE, DrainOrder.REFUSE)
        assert hb2.drain_order(registry.INTAKE) is DrainOrder.REFUSE and not hb2.drained(registry.INTAKE)
        hb2.report_drained(registry.INTAKE, DrainOrder.REFUSE)
        assert hb.drained(registry.INTAKE)
        board.write(stages[-1], {"seen": 3})
        assert board2.read(stages[-1]) == {"seen": 3} and board2.read(stages[0]) == {}
        journal.record(7, ["a", "b\nc"])
        assert journal2.read() == (7, ["a", "b\nc"])
        for t in (hb2, board2, journal2):
            t.close()
        stats_segment = shm.Segment.attach(shm.object_name(shm_prefix, run_id, "stats"))
        half_made = shm.Segment.create(shm.object_name(shm_prefix, run_id, "half"), 4096)
        try:
            with pytest.raises(shm.ShmError, match="not an initialised heartbeat table"):
                Heartbeats(stats_segment)
            with pytest.raises(shm.ShmError, match="not an initialised stats board"):
                StatsBoard(half_made)
        finally:
            stats_segment.close()
            half_made.close()
            half_made.unlink()
    finally:
        for t in made:
            t.close()
            t.unlink()
