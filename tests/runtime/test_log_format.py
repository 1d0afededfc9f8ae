"""--log-format json on a live worker: every line on stderr is one JSON object, the
stage processes' as well as the supervisor's, and a failed room is logged with its stage."""
from __future__ import annotations

import json
import os
import re
import time

import pytest

from pipeline.peers.client import Client, Item
from pipeline.ops.logs import setup_logging
from tests.helpers import PipelineWorker, ThreadedWorker, image, sim_config

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("mode", ["pipeline", "inprocess"])
def test_json_lines_from_every_process(mode, shm_prefix, tmp_path, capfd, root_logger):
    cfg = sim_config(shm_prefix, tmp_path, log_format="json", log_level="INFO", max_items_per_request=1)
    # As run.py serve does in the process it runs in; stage processes set up their own from cfg.
    setup_logging(cfg, "supervisor" if mode == "pipeline" else "worker")
    w = PipelineWorker(cfg) if mode == "pipeline" else ThreadedWorker(cfg)
    client = Client(w.cfg.intake, shm_prefix)
    try:
        client.encode(11, "req-11", [Item("image", *image(1)), Item("image", *image(2))])  # one too many
        err, end = "", time.monotonic() + 60
        while "room failed" not in err and time.monotonic() < end:
            time.sleep(0.1)
            err += capfd.readouterr().err
    finally:
        client.close()
        w.close()
    err += capfd.readouterr().err
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    failed = [x for x in lines if x["message"].startswith("room failed: room=11")]
    assert failed, err
    assert failed[0]["stage"] == ("reaper" if mode == "pipeline" else "worker")
    assert failed[0]["level"] == "INFO" and failed[0]["logger"] == "epd.reaper"
    assert all(set(x) >= {"time", "level", "stage", "pid", "logger", "message"} for x in lines)
    # the reaper's line comes from its own process in the pipeline
    assert (failed[0]["pid"] != os.getpid()) == (mode == "pipeline")
    text_lines = [line for line in err.splitlines() if re.match(r"\S+ \S+ (INFO|WARNING|ERROR) ", line)]
    assert not text_lines, text_lines  # no process kept the text format
