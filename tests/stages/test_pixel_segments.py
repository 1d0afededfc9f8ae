"""Clients' pixel segments a worker never takes: unlinked by their client once the room
concludes or its deadline passes (or at its exit), and by a worker that starts after
their creator died. Named for their creator (ipc/shm.py), so that anyone can tell."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from ipc import shm
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


def test_a_client_unlinks_what_the_worker_never_took(shm_prefix, tmp_path):
    """Encodes to a worker that does not read them: conclude(room) unlinks the room's
    segments, a passed deadline unlinks them at the next encode, and close(abandon=True)
    the rest."""
    c = Client(f"ipc://{tmp_path}/nobody.sock", shm_prefix)
    px = np.zeros((4, 1176), np.float32)
    c.message(1, "r1", [Item("image", [[1, 2, 2]], px), Item("image", [[1, 2, 2]], px + 1)])
    c.message(2, "r2", [Item("image", [[1, 2, 2]], px)], deadline_ms=0)
    assert len(pixel_segments(shm_prefix)) == 3
    c.conclude(1)
    assert len(pixel_segments(shm_prefix)) == 1
    c.message(3, "r3", [Item("image", [[1, 2, 2]], px)])  # room 2's deadline has passed
    assert len(pixel_segments(shm_prefix)) == 1 and 2 not in c.segments
    c.close(abandon=True)
    assert not pixel_segments(shm_prefix)
