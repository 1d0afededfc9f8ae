"""A worker of either mode serving in a thread, with the configurations the tests and
the benchmarks run it with."""
from __future__ import annotations

import hashlib
import json
import os
import time

from pipeline.runtime.background import Running, free_port
from pipeline.cli.config import WorkerConfig
from stages.towers import sim as sim_tower


def worker_config(prefix: str, run_dir, **over) -> WorkerConfig:
    """A worker of its own: shm prefix, intake socket and run directory, a free
    bootstrap port; `over`: other WorkerConfig fields, or these replaced, and the sim
    tower's settings as `sim_<key>` (`with_sim_tower`)."""
    base = dict(shm_prefix=prefix, intake=f"ipc://{run_dir}/intake.sock",
                bootstrap=f"tcp://127.0.0.1:{free_port()}", run_dir=str(run_dir))
    return WorkerConfig(**with_sim_tower(run_dir, {**base, **over}))


def with_sim_tower(run_dir, settings: dict) -> dict:
    """`settings` (configuration keys) with its `sim_<key>` entries, the sim tower's
    settings and faults (stages/towers/sim.py's SIM_SETTINGS and SIM_FAULTS), written to
    a settings file in `run_dir` that `tower_config` names; where there are none, or
    another tower is chosen (a test that swaps the sim tower for a real one), they are
    left out. The file is named by its contents, so configurations that differ never
    share one."""
    sim = {k.removeprefix("sim_"): os.fspath(v) if isinstance(v, os.PathLike) else v
           for k, v in settings.items() if k.startswith("sim_") and v is not None}
    if sim and "tower" not in settings:
        raise TypeError(f"sim tower settings {sorted(sim)} without tower='sim'")
    if not sim or settings["tower"] != "sim":
        return {k: v for k, v in settings.items() if not k.startswith("sim_")}
    unknown = sim.keys() - sim_tower.SIM_SETTINGS.keys() - sim_tower.SIM_FAULTS.keys()
    if unknown:
        raise TypeError(f"no sim tower settings {sorted('sim_' + k for k in unknown)}")
    doc = {"faults": {k: v for k, v in sim.items() if k in sim_tower.SIM_FAULTS}}
    doc.update((k, v) for k, v in sim.items() if k in sim_tower.SIM_SETTINGS)
    text = json.dumps(doc, sort_keys=True)
    os.makedirs(run_dir, 0o700, exist_ok=True)
    path = os.path.join(run_dir, f"sim-tower-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json")
    with open(path, "w") as f:
        f.write(text)
    return {**{k: v for k, v in settings.items() if not k.startswith("sim_")}, "tower_config": path}


SIM_SETTINGS = dict(tower="sim", sim_hidden=64, sim_deepstack_width=32, sim_dtype="bfloat16",
                    sim_time_per_row_s=0.0, pixel_arena_bytes=64 << 20, embedding_arena_bytes=32 << 20,
                    arena_cache_bytes=8 << 20, host_cache_bytes=16 << 20, max_tombstones=1024,
                    max_live_rooms=256)


def sim_config(prefix: str, run_dir, **over) -> WorkerConfig:
    """worker_config with the sim tower and small arenas: quick to start, rows cheap to check."""
    return worker_config(prefix, run_dir, **{**SIM_SETTINGS, **over})


def start_worker(mode: str, cfg: WorkerConfig, tower=None) -> Running:
    """`Running(cfg, mode)`; in the pipeline its stats() first waits a moment, as the
    stages publish their counters a few times a second."""
    w = Running(cfg, mode, tower=tower)
    if mode == "pipeline":
        real_stats = w.stats
        w.stats = lambda: (time.sleep(0.3), real_stats())[1]
    return w
