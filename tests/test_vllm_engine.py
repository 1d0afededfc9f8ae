"""vLLM with the encode worker as its encoder: EPDConnector (pipeline/integrations/vllm.py)
and the proxy (pipeline/integrations/proxy.py) against a real vLLM engine on a tiny
random-weight Qwen2.5-VL built here (no download).

It runs in .venv-vllm, the environment scripts/setup_vllm.sh builds; tests/test_vllm.py
runs it there, serially (one engine takes both cores while it starts). In the project's
own environment vLLM is not importable and this module is skipped: test_vllm.py fails
instead when .venv-vllm is missing.
"""
from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm", reason="runs in .venv-vllm, driven by tests/test_vllm.py")

import torch  # noqa: E402

from ipc import shm  # noqa: E402
from pipeline.background import free_port  # noqa: E402
from pipeline.client import Client, Item, WorkerAddress, routing_key  # noqa: E402
from pipeline.integrations import proxy as proxy_mod  # noqa: E402
from pipeline.integrations import tiny_qwen  # noqa: E402
from pipeline.integrations.vllm import EPDConnector, Load  # noqa: E402
from pipeline.receiver import Receiver  # noqa: E402
from pipeline.testing.sim import expected_sim_rows, image  # noqa: E402
from pipeline.testing.workers import sim_config, start_worker, worker_config  # noqa: E402
from vllm.config import ECTransferConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.multimodal.inputs import PlaceholderRange  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = os.environ.get("TEST_SHM_TOKEN", "vllm")
LOGPROB_TOLERANCE = 0.05  # vLLM's own bfloat16 tower against the worker's float32 rows cast to bfloat16


def wait_for(cond, timeout: float, what: str, step=None):
    end = time.monotonic() + timeout
    while True:
        if step is not None:
            step()
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ---------------------------------------------------------------- the connector alone
def fake_config(bootstrap: str, prefix: str, **extra):
    ec = ECTransferConfig(ec_connector="EPDConnector", ec_role="ec_consumer", ec_connector_extra_config={
        "workers": [bootstrap], "buffer_bytes": 4 << 20, "shm_prefix": prefix, "hidden": 64,
        "deepstack_width": 32, **extra})
    hf = SimpleNamespace(vision_config=SimpleNamespace(out_hidden_size=64))
    return SimpleNamespace(ec_transfer_config=ec, model_config=SimpleNamespace(hf_config=hf, dtype=torch.bfloat16))


def fake_request(rid: str, room: int, worker: str, uuids: list[str], span: int = 4, offset: int = 3):
    feats = [SimpleNamespace(identifier=u, modality="image", mm_position=PlaceholderRange(offset + 10 * i, span))
             for i, u in enumerate(uuids)]
    return SimpleNamespace(request_id=rid, mm_features=feats,
                           ec_transfer_params={"room": room, "worker": worker,
                                               "items": {u: i for i, u in enumerate(dict.fromkeys(uuids))}})


@pytest.fixture
def sim(tmp_path):
    prefix = f"t{TOKEN}_{os.getpid()}_vsim"
    w = start_worker("inprocess", sim_config(prefix, tmp_path))
    conn_prefix = f"t{TOKEN}_{os.getpid()}_vrx"
    yield w, conn_prefix
    w.close()
    assert not shm.list_objects(prefix) and not shm.list_objects(conn_prefix)


def concluded(w, state: str, reason: str) -> bool:
    return w.stats()["rooms_concluded"].get((state, reason), 0) > 0


def test_rows_reach_the_encoder_cache_as_main_then_deepstack(sim):
    w, prefix = sim
    cfg = fake_config(w.cfg.bootstrap, prefix)
    sched = EPDConnector(cfg, ECConnectorRole.SCHEDULER)
    worker_side = EPDConnector(cfg, ECConnectorRole.WORKER)
    try:
        grid, px = image(1)
        Client(w.cfg.intake, w.cfg.shm_prefix).encode(11, "r11", [Item("image", grid, px)])
        req = fake_request("a", 11, w.cfg.bootstrap, ["u1"])
        wait_for(lambda: sched.ensure_cache_available(req, 0), 30, "room 11's rows")
        assert sched.has_cache_item("u1") and not sched.has_cache_item("u2")
        sched.update_state_after_alloc(req, 0)
        worker_side.bind_connector_metadata(sched.build_connector_meta(None))
        cache: dict = {}
        worker_side.start_load_caches(cache)
        main, deep = expected_sim_rows(px, "image", 4, 64, 32, "bfloat16")
        got = cache["u1"].view(torch.uint16).numpy()
        assert got.shape == (4, 96) and cache["u1"].dtype == torch.bfloat16
        assert np.array_equal(got[:, :64], main) and np.array_equal(got[:, 64:], deep)
        assert sched.request_finished(req) == (False, None)
        assert not sched.receiver.shards and not sched.has_cache_item("u1")
    finally:
        worker_side.shutdown()
        sched.shutdown()


def test_a_room_the_worker_fails_makes_the_request_unavailable(sim):
    w, prefix = sim
    sched = EPDConnector(fake_config(w.cfg.bootstrap, prefix), ECConnectorRole.SCHEDULER)
    try:
        grid, px = image(2)  # 16 patches: 4 rows, where vLLM counts 9
        Client(w.cfg.intake, w.cfg.shm_prefix).encode(12, "r12", [Item("image", grid, px)])
        req = fake_request("b", 12, w.cfg.bootstrap, ["u2"], span=9)
        wait_for(lambda: "b" in sched.unavailable, 30, "room 12's failure",
                 step=lambda: sched.ensure_cache_available(req, 0))
        assert "span" in sched.unavailable["b"]
        assert sched.take_unavailable_requests() == {"b"} and not sched.ensure_cache_available(req, 0)
        sched.request_finished(req)
        assert not sched.receiver.shards
        # Params naming a worker this engine was not given are refused, never followed.
        bad = fake_request("c", 13, "tcp://10.9.9.9:1", ["u3"])
        assert not sched.ensure_cache_available(bad, 0) and "not one of" in sched.unavailable["c"]
    finally:
        sched.shutdown()


def test_aborted_request_and_deadline_cancel_their_rooms(sim):
    w, prefix = sim
    sched = EPDConnector(fake_config(w.cfg.bootstrap, prefix, deadline_s=0.5), ECConnectorRole.SCHEDULER)
    try:
        # No encode ever comes for these rooms: the worker holds their allocs.
        aborted = fake_request("d", 14, w.cfg.bootstrap, ["u4"])
        assert not sched.ensure_cache_available(aborted, 0)
        sched.request_finished(aborted)  # vLLM aborts it: the connector cancels its room
        wait_for(lambda: concluded(w, "failed", "canceled"), 30, "the worker to cancel room 14")
        wait_for(lambda: not sched.draining, 30, "room 14's buffer to be released", step=sched.poll)
        assert not sched.receiver.shards
        late = fake_request("e", 15, w.cfg.bootstrap, ["u5"])
        wait_for(lambda: "e" in sched.unavailable, 30, "room 15's deadline",
                 step=lambda: sched.ensure_cache_available(late, 0))
        assert "deadline_s" in sched.unavailable["e"]
        sched.request_finished(late)
        wait_for(lambda: not sched.draining and not sched.receiver.shards, 30, "room 15's release",
                 step=sched.poll)
        # A request whose media vLLM's prefix cache already covers needs no room.
        cached = fake_request("f", 16, w.cfg.bootstrap, ["u6"])
        assert sched.ensure_cache_available(cached, 100) and "f" not in sched.rooms
    finally:
        sched.shutdown()


def test_a_dead_engines_segment_is_swept_at_start(sim):
    w, prefix = sim
    dead = subprocess.run([sys.executable, "-c", (
        "import os; from ipc import shm\n"
        f"lock = shm.RunLock({prefix!r}); shm.Segment.create(shm.object_name({prefix!r}, lock.run_id, 'rx'), 4096)\n"
        "os._exit(0)")], cwd=ROOT, capture_output=True, text=True)
    assert dead.returncode == 0, dead.stderr
    left = shm.list_objects(prefix)
    assert len(left) == 2
    sched = EPDConnector(fake_config(w.cfg.bootstrap, prefix), ECConnectorRole.SCHEDULER)
    try:
        assert not set(left) & set(shm.list_objects(prefix))
    finally:
        sched.shutdown()
