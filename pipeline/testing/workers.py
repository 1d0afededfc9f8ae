"""A worker of either mode serving in a thread, with the configurations the tests and
the benchmarks run it with."""
from __future__ import annotations

import time

from pipeline.runtime.background import Running, free_port
from pipeline.cli.config import WorkerConfig


def worker_config(prefix: str, run_dir, **over) -> WorkerConfig:
    """A worker of its own: shm prefix, intake socket and run directory, a free
    bootstrap port; `over`: other WorkerConfig fields, or these replaced."""
    base = dict(shm_prefix=prefix, intake=f"ipc://{run_dir}/intake.sock",
                bootstrap=f"tcp://127.0.0.1:{free_port()}", run_dir=str(run_dir))
    return WorkerConfig(**{**base, **over})


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
