"""Test helpers: forked children, and the worker wrappers the tests name. What the
benchmarks use too (a worker serving in a thread, pixels, the sim tower's rows computed
independently, sim configs) lives in pipeline/testing and is imported from here."""
from __future__ import annotations

import os
import traceback

from pipeline.runtime.background import Running, free_port  # noqa: F401 (tests import it from here)
from pipeline.cli.config import WorkerConfig
from pipeline.testing.sim import PATCH_DIM, expected_sim_rows, image  # noqa: F401
from pipeline.testing.workers import sim_config, start_worker, with_sim_tower  # noqa: F401


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


def PipelineWorker(cfg: WorkerConfig) -> Running:
    return start_worker("pipeline", cfg)


def ThreadedWorker(cfg: WorkerConfig, tower=None) -> Running:
    return start_worker("inprocess", cfg, tower)
