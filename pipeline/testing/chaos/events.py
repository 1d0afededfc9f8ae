"""The chaos itself: which stage or receiver dies, when, and how. Each event takes the
harness (harness.Chaos) and draws from its seeded random generator, in a fixed order, so
a seed replays a run's schedule."""
from __future__ import annotations

import os
import signal
import time

from pipeline.testing.chaos.settings import HOLD_WAIT_S
from stages import registry


def chaos_event(c) -> None:
    """The sparse run: a stage SIGKILLed or SIGSTOPped, or a receiver killed."""
    kind = c.rng.choices(["kill_stage", "stop_stage", "kill_receiver", "kill_receiver_before_alloc"],
                            weights=[6, 1, 2, 1])[0]
    if kind in ("kill_stage", "stop_stage"):
        name = c.rng.choice(c.w.runtime.stages)
        if c.stopped is not None:
            return
        pid = c.live_stage_pid(name)
        if pid is None:
            c.log(f"{kind} {name}: not up right now, skipped")
            return
        signal_stage(c, name, pid, signal.SIGKILL if kind == "kill_stage" else signal.SIGSTOP)
        return
    kill_receiver(c, kind)


def dense_event(c) -> None:
    """--dense: a kill of one stage, of two within 50 ms, of one and then of its successor
    while it starts, or of one and a SIGSTOP of its successor while it starts (the
    supervisor must give that start up); now and then a SIGSTOP or a receiver kill."""
    kind = c.rng.choices(["kill_stage", "kill_two", "kill_starting", "stop_starting", "stop_stage",
                          "kill_receiver", "kill_receiver_before_alloc"], weights=[10, 4, 3, 1, 1, 2, 1])[0]
    if kind in ("kill_receiver", "kill_receiver_before_alloc"):
        kill_receiver(c, kind)
        return
    stopped = c.stopped[0] if c.stopped else None
    names = [n for n in registry.stage_names(c.w.cfg.tower_replicas, c.w.cfg.preprocess_workers)
             if n != stopped and c.live_stage_pid(n)]
    if kind == "stop_stage" and stopped:
        kind = "kill_stage"  # one stopped stage at a time: the watch follows one
    if kind == "stop_starting" and stopped:
        kind = "kill_starting"
    if not names or (kind == "kill_two" and len(names) < 2):
        c.log(f"{kind}: too few stages up right now, skipped")
        return
    # mostly a stage that holds rooms now: the reaper never does (it takes no custody), and
    # the intake only between recording a room and pushing its items
    holding = [n for n in names if c.held_by(n)]
    first = c.rng.choice(holding if holding and c.rng.random() < 0.6 else names)
    # wait (a little) for a moment the stage holds rooms: a kill of an idle stage tests little
    c.tick_until(lambda: c.held_by(first) > 0, HOLD_WAIT_S)
    pid = c.live_stage_pid(first)
    if pid is None:
        return
    if kind == "stop_stage":
        signal_stage(c, first, pid, signal.SIGSTOP)
        return
    signal_stage(c, first, pid, signal.SIGKILL)
    if kind == "kill_two":
        second = c.rng.choice([n for n in names if n != first])
        c.tick_until(lambda: False, c.rng.uniform(0, 0.05))
        pid = c.live_stage_pid(second)
        if pid is not None:
            signal_stage(c, second, pid, signal.SIGKILL, "within 50 ms of another")
    elif kind in ("kill_starting", "stop_starting"):
        def starting():
            proc = c.w.runtime.procs.get(first)
            return proc is not None and proc.pid != pid and proc.is_alive()
        if not c.tick_until(starting, 10.0):
            c.log(f"the {first} stage was not restarted within 10 s; no kill while it starts")
            return
        proc = c.w.runtime.procs[first]
        if kind == "stop_starting":
            # at once, or a moment into its start: it never becomes ready
            c.tick_until(lambda: c.stage_ready(first), c.rng.uniform(0.0, 0.3))
            if proc.is_alive() and not c.stage_ready(first):
                signal_stage(c, first, proc.pid, signal.SIGSTOP, "its replacement, while it starts",
                             counted=False)
            return
        # anywhere in its start: the interpreter's imports, or its start() picking up its
        # predecessor's state (READY is set only after that)
        c.tick_until(lambda: c.stage_ready(first), c.rng.uniform(0.0, 1.0))
        note = "again, just after it started" if c.stage_ready(first) else "again, while it starts"
        if proc.is_alive():
            signal_stage(c, first, proc.pid, signal.SIGKILL, note)


def signal_stage(c, name: str, pid: int, sig, note: str = "", counted: bool = True) -> None:
    """SIGKILL or SIGSTOP a stage, with what it held and when the supervisor must have killed it;
    not `counted` in the rooms held at a kill: a replacement not yet ready, which holds none."""
    held = c.held_by(name)
    now = time.monotonic()
    c.signalled[name] += 1
    if sig == signal.SIGSTOP:
        before = c.w.runtime.restart_counts[name]
        os.kill(pid, signal.SIGSTOP)
        c.stopped = (name, pid, before, now + c.s.heartbeat_timeout_s + 30)
        # the supervisor kills it once its heartbeat is stale: no later than this
        killed_by = now + c.s.heartbeat_timeout_s + 30
    else:
        os.kill(pid, signal.SIGKILL)
        killed_by = now
    c.timeline.stage_signalled(name, held, c.open_rooms(), now, killed_by, counted)
    c.timeline.note_kill(signal.Signals(sig).name, "stage", name, pid, note, held=held)


def kill_receiver(c, kind: str) -> None:
    """SIGKILL a receiver under load, or just before it would send the allocs of rooms sent."""
    up = c.up_slots()
    if not up:
        return
    slot = c.rng.choice(up)
    if kind == "kill_receiver_before_alloc":
        rooms = [c.send_room(skip=slot) for _ in range(c.rng.randint(1, 3))]
        os.kill(slot.proc.pid, signal.SIGKILL)
        c.timeline.note_kill("SIGKILL", "receiver", slot.rx_id, slot.proc.pid, f"before its allocs of rooms {rooms}")
    else:
        os.kill(slot.proc.pid, signal.SIGKILL)
        c.timeline.note_kill("SIGKILL", "receiver", slot.rx_id, slot.proc.pid, "under load")
    slot.proc.join(10)
    c.receiver_down(slot, c.rng.uniform(0.2, 1.0))
    if c.rng.random() < 0.3:
        slot.rx_id = f"rx{slot.index}.{slot.inc + 1}"  # comes back as a new receiver

