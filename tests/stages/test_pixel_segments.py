"""Clients' pixel segments a worker never takes: unlinked by their client once the room
concludes or its keep passes (or at its exit), and by a worker that starts after
their creator died. Named for their creator (ipc/shm.py), so that anyone can tell."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from ipc import shm
from pipeline.peers import client as client_module
from pipeline.peers.client import Client, Item
from pipeline.testing.sim import image
from tests.helpers import sim_config, start_worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pixel_segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix + ".px."))


def test_a_worker_at_start_removes_the_segments_of_a_dead_creator(shm_prefix, tmp_path):
    # A gateway sends an encode that nobody reads (no worker yet) and dies: its segment
    # is no one's to remove but a worker's.
    dead = subprocess.run([sys.executable, "-c", (
        "import os, numpy as np\n"
        "from pipeline.peers.client import Client, Item\n"
        f"c = Client('ipc://{tmp_path}/nobody.sock', {shm_prefix!r})\n"
        "c.message(1, 'r1', [Item('image', [[1, 2, 2]], np.zeros((4, 1176), np.float32))])\n"
        "os._exit(0)")], cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert dead.returncode == 0, dead.stderr
    left = pixel_segments(shm_prefix)
    assert len(left) == 1
    # One of a live creator (this process) stays: its client may still send it.
    live = Client(f"ipc://{tmp_path}/nobody.sock", shm_prefix)
    live.message(2, "r2", [Item("image", *image(2))])
    mine = set(pixel_segments(shm_prefix)) - set(left)
    w = start_worker("inprocess", sim_config(shm_prefix, tmp_path))
    try:
        assert pixel_segments(shm_prefix) == sorted(mine)
    finally:
        w.close()
        live.conclude(2)
        live.close()
    assert not pixel_segments(shm_prefix)


def test_a_client_unlinks_what_the_worker_never_took(shm_prefix, tmp_path, monkeypatch):
    """Encodes to a worker that does not read them: conclude(room) unlinks the room's
    segments, a keep passed unlinks them at the next encode, and close(abandon=True)
    the rest. A passed deadline does not: the worker counts it from its reading of the
    message, which may still be queued."""
    c = Client(f"ipc://{tmp_path}/nobody.sock", shm_prefix)
    try:
        px = np.zeros((4, 1176), np.float32)
        c.message(1, "r1", [Item("image", [[1, 2, 2]], px), Item("image", [[1, 2, 2]], px + 1)])
        sent = time.monotonic()
        c.message(2, "r2", [Item("image", [[1, 2, 2]], px)], deadline_ms=1)
        assert len(pixel_segments(shm_prefix)) == 3
        c.conclude(1)
        assert len(pixel_segments(shm_prefix)) == 1
        while time.monotonic() < sent + 0.002:  # room 2's deadline passes
            time.sleep(0.001)
        c.message(3, "r3", [Item("image", [[1, 2, 2]], px)])
        assert len(pixel_segments(shm_prefix)) == 2 and 2 in c.segments
        monkeypatch.setattr(client_module, "SEGMENT_KEEP_S", 0.0)
        c.message(4, "r4", [Item("image", [[1, 2, 2]], px)])  # rooms 2 and 3 kept as long as they may be
        assert len(pixel_segments(shm_prefix)) == 1 and list(c.segments) == [4]
    finally:  # a failed check leaves none behind either
        c.close(abandon=True)
    assert not pixel_segments(shm_prefix)
