"""A stage process starting, as the supervisor's loop tracks it: spawned, not ready yet,
and a deadline that moves only with progress. The loop looks at each start once a turn
and never waits on one, so a start that hangs (a transfer engine whose handshake never
answers, a wedged GPU, weights on a hung filesystem, a deadlock in an import, or a
SIGSTOP) holds up nothing else: the hang killer, the other stages' restarts, draining
and the probes all go on meanwhile, and several stages can be starting at once.

The bound: a stage that loads nothing must be ready within `stage_start_timeout_s` of
its spawn. A tower may legitimately load for minutes; it reports progress while it
loads (stages/progress.py: its heartbeat advances), and only a load that makes no
progress for `heartbeat_timeout_s` is a hang. Either way `start_timeout_s` caps the
whole start.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.runtime.boards import Heartbeats
from stages import registry

READY, FAILED, WAITING = "ready", "failed", "waiting"


@dataclass
class Start:
    """One stage process between its spawn and its "ready" (or its end)."""

    name: str
    proc: object      # the multiprocessing.Process
    conn: object      # the read end of the pipe its "ready" (or "error") comes on
    spawned_at: float
    short_s: float    # stage_start_timeout_s
    stall_s: float    # heartbeat_timeout_s: a load without progress this long is a hang
    cap_s: float      # start_timeout_s
    spec: dict | None = None  # what a tower answered with its "ready"

    @property
    def loads(self) -> bool:
        return registry.replica_of(self.name) is not None

    def deadline(self, row) -> float:
        """When this start is given up. The stage's heartbeat, set at its spawn, advances
        only as a tower reports load progress."""
        end = self.spawned_at + self.short_s
        if self.loads:
            end = max(end, float(row[Heartbeats.BEAT]) + self.stall_s)
        return min(end, self.spawned_at + self.cap_s)

    def poll(self, row, now: float) -> tuple[str, str]:
        """(READY, ""), (FAILED, why) or (WAITING, ""); never blocks. A stage that failed is
        the caller's to kill and count."""
        try:
            if self.conn.poll(0):
                kind, payload = self.conn.recv()
                if kind == "ready":
                    self.spec = payload
                    self.conn.close()
                    return READY, ""
                return FAILED, f"could not start: {payload}"
        except (EOFError, OSError):
            pass  # it died before it said anything: its exit code says more
        if not self.proc.is_alive():
            return FAILED, f"exited with code {self.proc.exitcode} before it was ready"
        if now > self.deadline(row):
            waited = now - self.spawned_at
            if self.loads and now - float(row[Heartbeats.BEAT]) > self.stall_s:
                return FAILED, (f"made no load progress for {now - float(row[Heartbeats.BEAT]):.1f} s "
                                f"(heartbeat_timeout_s {self.stall_s:g}) {waited:.1f} s into its start")
            return FAILED, (f"was not ready {waited:.1f} s after its spawn (stage_start_timeout_s "
                            f"{self.short_s:g}, start_timeout_s {self.cap_s:g})")
        return WAITING, ""

    def abandon(self) -> None:
        """Kill it (SIGKILL ends a stopped process too) and reap it; the pipe is closed."""
        try:
            self.proc.kill()
        except (OSError, ValueError):
            pass
        self.proc.join(5)
        try:
            self.conn.close()
        except OSError:
            pass
