"""What the chaos killed and when, and when the worker was not whole: the excuses (a
request lost with a killed intake, statuses with a killed reaper, allocs with a killed
sender; known limit (docs/design.md)s 1 and 3) and the serving time a room's bound counts."""
from __future__ import annotations

import bisect
import time

from pipeline.testing.chaos.settings import INTAKE_LOSS_S
from stages.registry import INTAKE, REAPER, SENDER


class KillTimeline:
    def __init__(self, t0: float, settings, log):
        self.t0 = t0
        self.s = settings
        self.log = log
        self.kills: list[dict] = []
        self.intake_kills: list[float] = []
        self.reaper_kills: list[float] = []
        self.sender_kills: list[float] = []
        self.held_at_kill: list[int] = []   # rooms the stage held as it was SIGKILLed or SIGSTOPped
        self.in_flight_at_kill: list[int] = []  # rooms open at some receiver then
        self.degraded: list[tuple] = []     # (from, to): some stage down or stopped
        self.degraded_since: float | None = None
        self.degraded_total = [0.0]         # degraded time before each interval of self.degraded

    def note_kill(self, sig: str, what: str, name: str, pid: int, note: str = "", held: int | None = None) -> None:
        t = round(time.monotonic() - self.t0, 3)
        self.kills.append({"t": t, "signal": sig, "target": what, "name": name, "pid": pid, "note": note,
                           **({} if held is None else {"held": held})})
        self.log(f"{sig} {what} {name} (pid {pid}){'' if held is None else f' holding {held} rooms'} "
                 f"{note}".rstrip())

    def stage_signalled(self, name: str, held: int, in_flight: int, now: float, killed_by: float,
                        counted: bool = True) -> None:
        """A stage was SIGKILLed at `now` (or SIGSTOPped, then the supervisor kills it by
        `killed_by`) holding `held` rooms, `in_flight` rooms open at the receivers."""
        if counted:
            self.held_at_kill.append(held)
            self.in_flight_at_kill.append(in_flight)
        self.start_degraded(now)
        self.died(name, now, killed_by)

    def stage_died_unasked(self, name: str, now: float) -> None:
        """The supervisor killed a stage the harness did not signal: one blocked on a lock that
        a SIGSTOPped stage held (docs/design.md, "Hung stages are killed by a thread that takes
        no lock"). What was in its socket is lost as with a SIGKILL (known limit 3)."""
        self.log(f"stage {name} was killed by the supervisor without a signal of the harness")
        self.died(name, now, now)

    def died(self, name: str, now: float, killed_by: float) -> None:
        """What a death loses (known limits 1 and 3): a reaper's last statuses from `now`, what
        was in an intake's or a sender's socket up to `killed_by`."""
        kills = {INTAKE: (self.intake_kills, killed_by), REAPER: (self.reaper_kills, now),
                 SENDER: (self.sender_kills, killed_by)}.get(name)
        if kills is not None:
            kills[0].append(kills[1])

    def start_degraded(self, now: float) -> None:
        if self.degraded_since is None:
            self.degraded_since = now

    def end_degraded(self, now: float) -> None:
        if self.degraded_since is not None:
            self.degraded_total.append(self.degraded_total[-1] + now - self.degraded_since)
            self.degraded.append((self.degraded_since, now))
            self.degraded_since = None

    def serving_time(self, t: float) -> float:
        """Seconds before `t` (from the run's start) when every stage was up and none stopped."""
        i = bisect.bisect_right(self.degraded, (t, float("inf"))) - 1
        down = 0.0 if i < 0 else self.degraded_total[i] + min(t, self.degraded[i][1]) - self.degraded[i][0]
        return t - down

    def intake_killed_after(self, sent_at: float) -> bool:
        """Could the request have been lost with a SIGKILLed intake (known limit (docs/design.md) 3)? The
        client's ZeroMQ may write a request sent just after the death into the dead
        connection before it notices, so a kill shortly before the send counts too."""
        return any(t >= sent_at - INTAKE_LOSS_S for t in self.intake_kills)

    def sender_killed_after(self, sent_at: float) -> bool:
        """Could the room's allocs have died in a SIGKILLed sender's socket before it held them
        (known limit (docs/design.md) 3)? Then, for a request the worker never saw, nobody answers them."""
        return any(sent_at - INTAKE_LOSS_S <= t <= sent_at + self.s.bootstrap_timeout_s for t in self.sender_kills)

    def reaper_killed_near(self, concluded: float) -> bool:
        return any(concluded - 1.0 <= t <= concluded + self.s.reaper_loss_before_s for t in self.reaper_kills)

    def reaper_killed_between(self, start: float, end: float) -> bool:
        return any(start <= t <= end for t in self.reaper_kills)
