"""Test helpers: a worker running in a thread, pixels, and the sim tower's rows computed independently."""
from __future__ import annotations

import os
import time
import traceback

import numpy as np
import xxhash

from pipeline.config import WorkerConfig
from pipeline.background import Running, free_port  # noqa: F401 (tests import it from here)

PATCH_DIM = 3 * 2 * 14 * 14


def fork_call(fn, *args) -> int:
    """Run ``fn(*args)`` in a forked child (exit 0 if it returns, 1 if it raises); its pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            fn(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def wait_child(pid: int) -> int:
    """Wait for a child; its exit code, or -signal if a signal killed it."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def expected_sim_rows(pixels: np.ndarray, modality: str, span: int, hidden: int, ds_width: int,
                      dtype: str):
    """The sim tower's documented formula, written out again here on purpose."""
    f32 = np.random.default_rng(0x5EED7043).standard_normal(1_000_003 + (1 << 22), dtype=np.float32)
    if dtype == "float32":
        pattern = f32
    elif dtype == "float16":
        pattern = f32.astype(np.float16)
    else:
        pattern = (f32.view(np.uint32) >> 16).astype(np.uint16)
    seed = xxhash.xxh3_64_intdigest(np.ascontiguousarray(pixels).tobytes(),
                                    seed={"image": 0, "video": 1}[modality])
    idx = lambda off, n: pattern[(off + np.arange(n)) % pattern.size]
    main = idx(seed % 1_000_003, span * hidden).reshape(span, hidden)
    deep = None
    if ds_width:
        deep = idx((seed // 1_000_003) % 1_000_003, span * ds_width).reshape(span, ds_width)
    return main, deep


def image(seed: int, grid=(1, 4, 4), dtype=np.float32) -> tuple[list, np.ndarray]:
    t, h, w = grid
    rng = np.random.default_rng(seed)
    px = rng.standard_normal((t * h * w, PATCH_DIM), dtype=np.float32).astype(dtype)
    return [list(grid)], px


def start_worker(mode: str, cfg: WorkerConfig, tower=None) -> Running:
    w = Running(cfg, mode, tower=tower)
    if mode == "pipeline":
        real_stats = w.stats
        w.stats = lambda: (time.sleep(0.3), real_stats())[1]  # stages publish a few times a second
    return w


def PipelineWorker(cfg: WorkerConfig) -> Running:
    return start_worker("pipeline", cfg)


def ThreadedWorker(cfg: WorkerConfig, tower=None) -> Running:
    return start_worker("inprocess", cfg, tower)
def sim_config(prefix: str, tmp_path, **over) -> WorkerConfig:
    base = dict(shm_prefix=prefix, intake=f"ipc://{tmp_path}/intake.sock",
                bootstrap=f"tcp://127.0.0.1:{free_port()}", run_dir=str(tmp_path),
                tower="sim", sim_hidden=64, sim_deepstack_width=32, sim_dtype="bfloat16",
                sim_time_per_row_s=0.0, pixel_arena_bytes=64 << 20, embedding_arena_bytes=32 << 20,
                arena_cache_bytes=8 << 20, host_cache_bytes=16 << 20, max_tombstones=1024,
                max_live_rooms=256)
    base.update(over)
    return WorkerConfig(**base)
