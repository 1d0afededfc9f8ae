"""The worker side of a benchmark: a worker of either mode in a process of its own,
the CPU its processes and threads spent, and the peak memory of its process tree."""
from __future__ import annotations

import signal
import threading
import time

from benchmarks.harness.report import jsonable


def host_main(conn, mode: str, cfg_kwargs: dict) -> None:
    """A worker process: the InProcessWorker serving in a thread, or the Supervisor and
    its stage processes (pipeline/testing's start_worker); answers the parent's commands."""
    from pipeline.cli.config import WorkerConfig
    from pipeline.testing.workers import start_worker

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides
    t = time.monotonic()
    try:
        w = start_worker(mode, WorkerConfig(**cfg_kwargs))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    try:
        spec = dict(hidden=w.spec.hidden, dtype=w.spec.dtype, deepstack_width=w.spec.deepstack_width,
                    merge=w.spec.merge, patch_dim=w.spec.patch_dim)
        conn.send(("ready", {"spec": spec, "start_s": time.monotonic() - t, "intake": w.cfg.intake,
                             "bootstrap": w.cfg.bootstrap}))
        while True:
            cmd = conn.recv()
            if cmd == "quit":
                break
            if cmd == "cpu":
                conn.send(cpu_by_process(w))
            elif cmd == "stats":
                conn.send(jsonable(w.stats()))
    finally:
        w.close()


def cpu_by_process(worker) -> dict:
    """(user, system) CPU seconds so far of each process of the worker; for the in-process
    worker, its loop thread and the rest of its process (Mooncake's and zmq's threads)."""
    import psutil

    out = {}
    me = psutil.Process()
    if worker.mode == "pipeline":
        for name, proc in worker.runtime.procs.items():
            if proc is not None and proc.pid:
                try:
                    t = psutil.Process(proc.pid).cpu_times()
                    out[name] = (t.user, t.system)
                except psutil.Error:
                    pass
        t = me.cpu_times()
        out["supervisor"] = (t.user, t.system)
    else:
        loop_tid = worker.thread.native_id
        total = me.cpu_times()
        loop = (0.0, 0.0)
        for th in me.threads():
            if th.id == loop_tid:
                loop = (th.user_time, th.system_time)
        out["worker loop"] = loop
        out["worker other threads"] = (total.user - loop[0], total.system - loop[1])
    return out


class Sampler(threading.Thread):
    """Peak resident memory of a process tree: the sum of RSS at 10 Hz, of PSS on demand."""

    def __init__(self, root_pid: int, interval: float = 0.1):
        super().__init__(daemon=True)
        import psutil

        self.psutil = psutil
        self.root = psutil.Process(root_pid)
        self.interval = interval
        self.stop = threading.Event()
        self.peak_rss = 0
        self.peak_pss = 0
        self.samples = 0
        self.procs_seen: list = []
        self.refreshed = 0.0

    def procs(self) -> list:
        now = time.monotonic()
        if now - self.refreshed > 1.0 or not self.procs_seen:
            self.refreshed = now
            try:
                self.procs_seen = [self.root] + self.root.children(recursive=True)
            except self.psutil.Error:
                self.procs_seen = []
        return self.procs_seen

    def sample(self) -> int:
        total = 0
        for p in self.procs():
            try:
                total += p.memory_info().rss
            except self.psutil.Error:
                pass
        self.peak_rss = max(self.peak_rss, total)
        self.samples += 1
        return total

    def sample_pss(self) -> int:
        self.refreshed = 0.0
        total = 0
        for p in self.procs():
            try:
                total += p.memory_full_info().pss
            except (self.psutil.Error, AttributeError):
                pass
        self.peak_pss = max(self.peak_pss, total)
        self.sample()
        return total

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.sample()
