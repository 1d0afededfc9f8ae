"""A worker of either mode serving in a background thread of the caller's process:
for the demo, the tests and the benchmarks, which drive it from the same process."""
from __future__ import annotations

import socket
import threading

from pipeline.config import WorkerConfig


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for a bootstrap endpoint of one's own)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Running:
    """`mode` "pipeline": a Supervisor with its stage processes (`.sup`); "inprocess": a
    Worker (`.worker`). `tower` (a built Tower) only for "inprocess"."""

    def __init__(self, cfg: WorkerConfig, mode: str = "pipeline", tower=None):
        self.mode = mode
        self.stop = threading.Event()
        self.code = None
        self.error = None
        self.sup = self.worker = None
        if mode == "pipeline":
            from pipeline.supervisor import Supervisor
            from stages.tower import TowerSpec

            if tower is not None:
                raise ValueError("the pipeline builds its tower in the tower process")
            self.sup = impl = Supervisor(cfg)
            try:
                impl.start()
            except BaseException:
                impl.close()
                raise
            self.spec = TowerSpec(**impl.spec_kwargs)
        elif mode == "inprocess":
            from pipeline.worker import Worker

            self.worker = impl = Worker(cfg, tower=tower)
            self.spec = impl.spec
        else:
            raise ValueError(f"mode must be 'pipeline' or 'inprocess', not {mode!r}")
        self.impl = impl
        self.cfg = impl.cfg
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.code = self.impl.serve(self.stop)
        except BaseException as e:  # surfaced by close()
            self.error = e

    def stats(self) -> dict:
        return self.impl.stats()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(120)
        try:
            self.impl.close()
        finally:
            if self.error is not None:
                raise self.error
