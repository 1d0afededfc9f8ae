"""A mooncake_master on loopback for the tests and benchmarks of the shared store: on free
ports of its own, killed and started again on the same port."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from pipeline.runtime.background import free_port


def master_binary() -> str:
    """The mooncake_master the Mooncake wheel installed beside this Python, else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mooncake_master")
    if not found:
        raise RuntimeError("mooncake_master not found: install the Mooncake wheel (scripts/setup.sh)")
    return found


class StoreMaster:
    """`address` is its host:port; `kill()` is SIGKILL, `start()` brings it back on that port."""

    def __init__(self, log_path: str):
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        args = [master_binary(), f"-rpc_port={self.port}", "-rpc_address=127.0.0.1",
                f"-metrics_port={self.metrics_port}", "-metrics_host=127.0.0.1",
                "-enable_http_metadata_server=false", "-enable_metric_reporting=false"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        end = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    self.kill()
                    raise RuntimeError(f"mooncake_master did not come up on port {self.port}: see "
                                       f"{self.log_path}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGSTOP: a master that stalls (its port still accepts; nothing answers)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        self.kill()
