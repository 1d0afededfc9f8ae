"""The end of a chaos run judged: every room concluded at every receiver alive to hear
it, the same way at all of them and as the worker's room table says, within its bound;
the final rooms succeeded; receivers and stages closed cleanly; /dev/shm is clean. The
known limits (docs/design.md, 1 and 3) excuse what they describe, and the rooms they excuse are
listed in the result."""
from __future__ import annotations

import os
import re
from collections import Counter

from ipc import shm
from pipeline.testing.chaos.settings import FINAL_ROOMS, HUNG_GRACE_S
from stages.registry import SENDER


def reason_kind(reason: str) -> str:
    """A failure reason with its ids and numbers masked, so alike failures count together."""
    r = re.sub(r"receiver \S+", "receiver R", reason)
    r = re.sub(r"\d+(\.\d+)*(:\d+)?", "N", r)
    return r[:160]


class EndChecks:
    """Reads the harness (harness.Chaos) after shutdown; `verdicts`: room -> (state name,
    reason, request id, concluded at) in the worker's table, or None where it never
    recorded the room. Violations go to the harness; the counts stay here."""

    def __init__(self, chaos, verdicts: dict):
        self.c = chaos
        self.verdicts = verdicts
        self.outcomes: Counter = Counter()
        self.failed_by_reason: Counter = Counter()
        self.hung: set[int] = set()
        self.lost_with_reaper: list[int] = []
        self.allocs_lost_with_sender: list[int] = []
        self.lost_segments = 0
        self.serving_at_end = False

    def run(self) -> None:
        self.receivers_closed()
        self.stages_exited()
        for room, rm in self.c.rooms.items():
            self.room(room, rm)
        self.final_rooms()
        self.shm_clean()

    def receivers_closed(self) -> None:
        for slot in self.c.slots:
            f = slot.final
            if f is None:
                self.c.violation(f"receiver {slot.rx_id} gave no final report")
                continue
            if f["registered_after_close"] or f["engines_leaked"]:
                self.c.violation(f"receiver {slot.rx_id}: Mooncake registrations left after close: "
                                 f"{f['registered_after_close']} regions, {f['engines_leaked']} engines leaked")

    def stages_exited(self) -> None:
        for name, code in self.c.stage_exit_codes.items():
            if code != 0:
                self.c.violation(f"the {name} stage exited with code {code} at shutdown, not 0"
                                 + (" (its clean close is what unregisters its Mooncake memory)"
                                    if name == SENDER else ""))

    def room(self, room: int, rm) -> None:
        c, timeline = self.c, self.c.timeline
        verdict = self.verdicts.get(room)
        # receivers alive at the end: each must have concluded the room as the worker did
        alive = {k: ob for k, ob in rm.observers.items() if c.alive_observer(k)}
        seen = [(k, sorted(ob["success"]), ob["failed"], c.rel(ob.get("failed_at")))
                for k, ob in rm.observers.items()]
        failed = {k: ob["failed"] for k, ob in alive.items() if ob["failed"] is not None}
        missing = []
        if verdict is None:
            missing = self.never_recorded(room, rm, alive, failed, seen)
            if missing is None:
                return
        elif verdict[0] == "SUCCESS":
            self.outcomes["succeeded"] += 1
            if any(ob["failed"] is not None for ob in rm.observers.values()):
                c.violation(f"room {room} succeeded in the worker but a receiver got failed: {seen}")
            missing = [k for k, ob in alive.items() if ob["success"] != ob["items"]]
        elif verdict[0] == "FAILED":
            self.outcomes["failed"] += 1
            self.failed_by_reason[reason_kind(verdict[1])] += 1
            missing = [k for k in alive if k not in failed]
        else:
            self.hung.add(room)
            c.violation(f"room {room} is still {verdict[0]} in the worker at the end", "hung")
        concluded = verdict[3] if verdict else rm.sent_at
        lost_with_reaper = timeline.reaper_killed_near(concluded) or room in c.told_lost  # known limit (1)
        if missing:
            if lost_with_reaper:
                self.lost_with_reaper.append(room)
                c.log(f"room {room} ({verdict and verdict[:2]}, concluded at {c.rel(concluded)}): "
                      f"statuses lost with a killed reaper (known limit 1): {seen}")
            else:
                self.hung.add(room)
                c.violation(f"room {room} ({verdict[0] if verdict else 'never recorded'}"
                            f"{' ' + repr(verdict[1]) if verdict and verdict[1] else ''}, concluded at "
                            f"{c.rel(concluded)}) never concluded at receivers {missing} alive to "
                            f"hear it; all saw {seen}", "hung")
        if room not in self.hung:
            self.bound(room, rm, lost_with_reaper, verdict, seen)

    def never_recorded(self, room: int, rm, alive: dict, failed: dict, seen: list) -> list | None:
        """A room the worker never recorded: lost with a SIGKILLed intake, which must have
        died after it was sent. The receivers alive that missed its failed status, or None
        where its allocs died with a killed sender too (nobody can answer them)."""
        c, timeline = self.c, self.c.timeline
        self.outcomes["lost"] += 1
        self.failed_by_reason["never reached the worker (lost with a SIGKILLed intake)"] += 1
        if not timeline.intake_killed_after(rm.sent_at):
            c.violation(f"room {room} (sent at {c.rel(rm.sent_at)}) never reached the worker, and no "
                        f"intake was killed after it was sent (intake kills at "
                        f"{[c.rel(t) for t in timeline.intake_kills if t > rm.sent_at - 10]})")
        # "unknown room" after bootstrap_timeout_s, or sooner once an intake successor is ready
        if any(r != "unknown room" and "of the intake stage's restart" not in r for r in failed.values()):
            c.violation(f"room {room}, never recorded by the worker, failed at its receivers "
                        f"as {seen}, not 'unknown room' nor for the intake's restart")
        missing = [k for k in alive if k not in failed]
        if missing and timeline.intake_killed_after(rm.sent_at) and timeline.sender_killed_after(rm.sent_at):
            # Both the request (in a dead intake) and the allocs (in a dead sender) lost.
            self.allocs_lost_with_sender.append(room)
            c.log(f"room {room} (sent at {c.rel(rm.sent_at)}): its request lost with an intake "
                  f"and its allocs with a sender, both killed (known limit 3): {seen}")
            return None
        return missing

    def bound(self, room: int, rm, lost_with_reaper: bool, verdict, seen) -> None:
        """The room concludes at each receiver within its bound: bootstrap_timeout_s (the harness
        sets no deadline_ms), counted only while every stage is up and none stopped, so the
        time to restart what died is added, plus HUNG_GRACE_S. A receiver that died (or the end
        of the run) before its bound had nothing to wait for."""
        c = self.c
        bound = c.s.bootstrap_timeout_s + HUNG_GRACE_S
        start = c.timeline.serving_time(rm.sent_at)
        for key, ob in rm.observers.items():
            done = ob.get("done_at")
            if done is None and lost_with_reaper:
                continue
            until = done if done is not None else c.observer_end.get(key, c.checked_at)
            took = c.timeline.serving_time(until) - start
            if took > bound:
                self.hung.add(room)
                what = (f"concluded ({'failed ' + repr(ob['failed']) if ob['failed'] is not None else 'success'})"
                        if done is not None else "had not concluded")
                c.violation(f"room {room} (sent at {c.rel(rm.sent_at)}) {what} at receiver {key} "
                            f"after {until - rm.sent_at:.1f} s, {took:.1f} s of it with every stage up: "
                            f"over its bound of {bound:g} s; the worker: "
                            f"{verdict[:2] + (c.rel(verdict[3]),) if verdict else 'never recorded'}; "
                            f"all saw {seen}", "hung")
                return

    def final_rooms(self) -> None:
        """The rooms sent after the last kill all succeeded at every receiver."""
        c = self.c
        self.serving_at_end = len(c.final_sent) == FINAL_ROOMS
        for room in c.final_sent:
            rm = c.rooms.get(room)
            if rm is None or not rm.observers or any(ob["failed"] is not None or ob["success"] != ob["items"]
                                                     for ob in rm.observers.values()):
                self.serving_at_end = False
                c.violation(f"room {room}, sent after the chaos ended, did not succeed: "
                            f"{rm and [(sorted(ob['success']), ob['failed']) for ob in rm.observers.values()]} "
                            f"(the worker stopped serving)")
        if len(c.final_sent) != FINAL_ROOMS:
            c.violation(f"only {len(c.final_sent)} of the {FINAL_ROOMS} final rooms could be sent (no receiver up)")

    def shm_clean(self) -> None:
        """/dev/shm: the run's objects and semaphores, and the pixel segments the worker took."""
        c = self.c
        left = shm.list_objects(c.prefix)
        if left:
            c.violation(f"/dev/shm holds objects of the run after shutdown: {left}")
            shm.sweep(c.prefix, include_live=True)
        segs = {s.lstrip("/"): room for room, rm in c.rooms.items() for s in rm.segments}
        for entry in os.listdir(shm.SHM_DIR):
            if not entry.startswith(c.prefix + ".px."):
                continue
            room = segs.get(entry)
            verdict = self.verdicts.get(room)
            # never taken by intake: not in the table, or put there by the reaper ("?") because
            # a receiver canceled it or the dead intake's journal named it
            if room is not None and (verdict is None or verdict[2] == "?") and c.timeline.intake_killed_after(
                    c.rooms[room].sent_at):
                self.lost_segments += 1  # lost in a dead intake's socket: the gateway's to remove
            else:
                c.violation(f"pixel segment {entry} (room {room}, {verdict}) left in /dev/shm")
            os.unlink(os.path.join(shm.SHM_DIR, entry))
