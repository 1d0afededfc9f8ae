"""vLLM with the encode worker as its encoder, from the project's environment.

vLLM lives in .venv-vllm (scripts/setup_vllm.sh builds it), so that its pins never touch
.venv: test_vllm_engine runs tests/integrations/test_vllm_engine.py there, serially, and fails when
that environment is missing. The receiver's caller-supplied buffer, which the connector
writes rows into, is checked here.
"""
from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ipc import shm
from pipeline.peers.client import Client, Item
from pipeline.peers.receiver import Receiver
from pipeline.testing.sim import expected_sim_rows, image
from pipeline.testing.workers import sim_config, start_worker

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def test_receiver_writes_rows_into_a_caller_supplied_buffer(shm_prefix, tmp_path):
    w = start_worker("inprocess", sim_config(shm_prefix, tmp_path))
    seg = shm.Segment.create(shm.object_name(shm_prefix, shm.new_run_id(), "rx"), 1 << 20)
    try:
        buffer = np.frombuffer(seg.buf, dtype=np.uint8)
        rx = Receiver("rx", w.cfg.bootstrap, buffer=buffer)
        grid, px = image(5)
        Client(w.cfg.intake, w.cfg.shm_prefix).encode(1, "r1", [Item("image", grid, px)])
        shard = rx.alloc(1, 0, span=4, hidden=64, dtype="bfloat16", deepstack_width=32)
        assert rx.wait({1: 1}, 30) and 1 not in rx.failed
        main, deep = expected_sim_rows(px, "image", 4, 64, 32, "bfloat16")
        # Another process maps the segment by name and reads the rows where the shard says.
        other = shm.Segment.attach(seg.name, readonly=True)
        got = np.frombuffer(other.buf, dtype=np.uint16, count=4 * 64, offset=shard.offset).reshape(4, 64)
        assert np.array_equal(got, main) and np.array_equal(rx.rows(1, 0)[1], deep)
        del got
        other.close()
        rx.release(1)
        rx.close()
        del buffer
    finally:
        w.close()
        seg.close()
        seg.unlink()


@pytest.mark.long
def test_vllm_engine():
    """tests/integrations/test_vllm_engine.py in .venv-vllm: the connector and the proxy against vLLM."""
    assert VLLM_PYTHON.exists(), (
        f"{VLLM_PYTHON} is missing: the vLLM tests run in their own environment; build it with "
        f"scripts/setup_vllm.sh (about two minutes, 2.7 GB)")
    # A token of its own: the inner session's /dev/shm check then sees its objects, not
    # those of this session's tests running beside it.
    env = {**os.environ, "TEST_SHM_TOKEN": secrets.token_hex(3)}
    proc = subprocess.run([str(VLLM_PYTHON), "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:randomly",
                           "tests/integrations/test_vllm_engine.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=540,
                          env=env)
    assert proc.returncode == 0, (f"tests/integrations/test_vllm_engine.py in .venv-vllm failed:\n"
                                  f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")



def test_the_proxy_runs_its_image_processor_on_one_thread_unless_told(monkeypatch):
    """run.py proxy sets torch's intra-op threads before it builds the image processor:
    one by default, N with --threads N, torch's own with 0; a negative count is refused."""
    import torch

    from pipeline.integrations import proxy

    class Built(Exception):
        pass

    def preprocessor(*args):
        raise Built(torch.get_num_threads())

    monkeypatch.setattr(proxy, "Preprocessor", preprocessor)
    base = ["--model", "m", "--vllm", "http://127.0.0.1:9", "--worker", "ipc:///x,tcp://127.0.0.1:9"]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for extra, want in (([], 1), (["--threads", "2"], 2), (["--threads", "0"], torch.get_num_threads())):
            torch.set_num_threads(2)
            with pytest.raises(Built) as e:
                proxy.main(base + extra)
            assert e.value.args[0] == want, extra
        with pytest.raises(SystemExit) as e:
            proxy.main(base + ["--threads", "-1"])
        assert e.value.code == 2
    finally:
        torch.set_num_threads(before)
