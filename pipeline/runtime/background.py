"""A worker of either mode serving in a background thread of the caller's process:
for the demo, the tests and the benchmarks, which drive it from the same process."""
from __future__ import annotations

import socket
import threading

from pipeline.cli.config import WorkerConfig
from pipeline.runtime.serving import SignalFlag


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for a bootstrap endpoint of one's own)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start(cfg: WorkerConfig, mode: str, tower=None):
    """A started runtime of `mode`: the Supervisor with its stage processes ("pipeline"),
    or the InProcessWorker ("inprocess"). `tower` (a built Tower) only for "inprocess"."""
    if mode == "pipeline":
        from pipeline.runtime.supervisor import Supervisor

        if tower is not None:
            raise ValueError("the pipeline builds its tower in the tower process")
        sup = Supervisor(cfg)
        try:
            sup.start()
        except BaseException:
            sup.close()
            raise
        return sup
    if mode == "inprocess":
        from pipeline.runtime.inprocess import InProcessWorker

        return InProcessWorker(cfg, tower=tower)
    raise ValueError(f"mode must be 'pipeline' or 'inprocess', not {mode!r}")


class Running:
    """A started runtime (`start`) serving in a thread: `.runtime` is the Supervisor in
    the pipeline, the InProcessWorker in process."""

    def __init__(self, cfg: WorkerConfig, mode: str = "pipeline", tower=None):
        self.mode = mode
        self.stop = SignalFlag()
        self.code = None
        self.error = None
        self.runtime = start(cfg, mode, tower)
        self.spec = self.runtime.spec
        self.cfg = self.runtime.cfg
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.code = self.runtime.serving.serve(self.stop)
        except BaseException as e:  # surfaced by close()
            self.error = e

    def stats(self) -> dict:
        return self.runtime.stats()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(120)
        try:
            self.runtime.close()
        finally:
            if self.error is not None:
                raise self.error
