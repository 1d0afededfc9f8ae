"""Test helpers: a worker running in a thread, pixels, and the sim tower's rows computed independently."""
from __future__ import annotations

import socket
import threading

import numpy as np
import xxhash

from pipeline.config import WorkerConfig
from pipeline.worker import Worker

PATCH_DIM = 3 * 2 * 14 * 14


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class ThreadedWorker:
    """A Worker serving in a background thread of the test process."""

    mode = "inprocess"

    def __init__(self, cfg: WorkerConfig, tower=None):
        self.worker = Worker(cfg, tower=tower)
        self.cfg = self.worker.cfg
        self.spec = self.worker.spec
        self.stop = threading.Event()
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.worker.serve(self.stop)
        except BaseException as e:  # surfaced by close()
            self.error = e

    def stats(self) -> dict:
        return self.worker.stats()

    def close(self):
        self.stop.set()
        self.thread.join(30)
        try:
            self.worker.close()
        finally:
            if self.error is not None:
                raise self.error


class PipelineWorker:
    """The multi-process pipeline under its supervisor, watched from a background thread."""

    mode = "pipeline"

    def __init__(self, cfg: WorkerConfig):
        from pipeline.supervisor import Supervisor
        from stages.tower import TowerSpec

        self.sup = Supervisor(cfg)
        try:
            self.sup.start()
        except BaseException:
            self.sup.close()
            raise
        self.cfg = self.sup.cfg
        self.spec = TowerSpec(**self.sup.spec_kwargs)
        self.stop = threading.Event()
        self.code = None
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.code = self.sup.serve(self.stop)
        except BaseException as e:
            self.error = e

    def stats(self) -> dict:
        import time

        time.sleep(0.3)  # stages publish their counters a few times a second
        return self.sup.stats()

    def close(self):
        self.stop.set()
        self.thread.join(120)
        try:
            self.sup.close()
        finally:
            if self.error is not None:
                raise self.error


def start_worker(mode: str, cfg: WorkerConfig, tower=None):
    if mode == "pipeline":
        assert tower is None, "the pipeline builds its tower in the tower process"
        return PipelineWorker(cfg)
    return ThreadedWorker(cfg, tower=tower)


def sim_config(prefix: str, tmp_path, **over) -> WorkerConfig:
    base = dict(shm_prefix=prefix, intake=f"ipc://{tmp_path}/intake.sock",
                bootstrap=f"tcp://127.0.0.1:{free_port()}", run_dir=str(tmp_path),
                tower="sim", sim_hidden=64, sim_deepstack_width=32, sim_dtype="bfloat16",
                sim_time_per_row_s=0.0, pixel_arena_bytes=64 << 20, embedding_arena_bytes=32 << 20,
                arena_cache_bytes=8 << 20, host_cache_bytes=16 << 20, max_tombstones=1024,
                max_live_rooms=256)
    base.update(over)
    return WorkerConfig(**base)
