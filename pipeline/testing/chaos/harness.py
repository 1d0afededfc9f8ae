"""The chaos harness: a worker in --mode pipeline (the sim tower, Mooncake over loopback
TCP) under a steady load of multi-item rooms, its receivers each a process of its own,
and the chaos (events.py) between them; at the end every room is judged (checks.py).
benchmarks/chaos.py is its command line and says what it checks; tests/soak/test_chaos.py
runs it short and dense."""
from __future__ import annotations

import dataclasses
import itertools
import multiprocessing as mp
import os
import random
import signal
import statistics
import time
from collections import Counter, deque
from multiprocessing.connection import wait as wait_conns

from ipc.rooms import RoomState
from ipc.told import incarnation
from pipeline.runtime.background import Running
from pipeline.runtime.boards import Heartbeats
from pipeline.peers.client import Client, Item
from pipeline.testing.chaos import events
from pipeline.testing.chaos.checks import EndChecks
from pipeline.testing.chaos.receiver import receiver_main
from pipeline.testing.chaos.settings import (CANCEL_P, DENSE_WINDOW, FINAL_ROOMS, GRIDS, HOT_POOL, MAX_OPEN_ROOMS,
                                             ROOMS_PER_S, STATS_SETTLE_S, ZERO_ROW_SHARD_P, ChaosSettings, span_of)
from pipeline.testing.chaos.timeline import KillTimeline
from pipeline.testing.sim import pixels
from stages import registry


@dataclasses.dataclass
class Slot:
    """A receiver position: its current id and process (`inc` counts its incarnations)."""
    index: int
    rx_id: str
    inc: int = 0
    proc: object = None
    conn: object = None
    state: str = "dead"       # starting | up | dead | finished (gave its final report)
    restart_at: float = 0.0
    final: dict | None = None

    @property
    def key(self):
        return (self.index, self.inc)


@dataclasses.dataclass
class Room:
    room: int
    sent_at: float
    segments: list              # its pixel segments' names
    observers: dict = dataclasses.field(default_factory=dict)  # slot key -> {"items", "success", "failed"}


class Chaos:
    """The worker in --mode pipeline under load, its receivers, and the chaos between them;
    run() returns the result (see benchmarks/chaos.py for what each key means)."""

    def __init__(self, settings: ChaosSettings, *, shm_prefix: str, run_dir: str, log=print):
        self.s = settings
        self.rng = random.Random(settings.seed)
        self.log_fn = log
        self.t0 = time.monotonic()
        self.prefix = shm_prefix
        self.mp = mp.get_context("spawn")
        self.violations: list[str] = []
        self.timeline = KillTimeline(self.t0, settings, self.log)
        self.rooms: dict[int, Room] = {}
        self.next_room = 1
        self.fresh_seed = 10_000
        self.recent_fresh: deque = deque(maxlen=5)
        self.cancels_sent = 0
        self.receiver_restarts = 0
        self.incarnations: dict = {}        # observer key -> the told table's names for it
        self.told_lost: set[int] = set()    # rooms told_then_reaper_killed() excused at the end
        self.gave_up = False
        self.final_sent: list[int] = []
        self.served_at: list[float] = []  # when a room succeeded at a receiver: the outages are the gaps
        self.chaos_span = (0.0, 0.0)
        self.stopped: tuple | None = None   # (stage, pid, restarts before, deadline) of a SIGSTOPped stage
        self.signalled: Counter = Counter()  # stage -> the harness's SIGKILLs and SIGSTOPs of it
        self.unasked: Counter = Counter()    # stage -> deaths the harness did not cause
        self.violation_kinds: Counter = Counter()
        self.recovered_by_query = 0  # statuses receivers lacked and got as a query's repeat
        self.observer_end: dict = {}        # slot key -> when that incarnation died
        self.load_on = True
        self.next_progress = 0.0
        self.max_rooms = settings.max_rooms
        self.checks: EndChecks | None = None
        self.cfg = settings.worker_config(shm_prefix, run_dir)
        self.w = Running(self.cfg, "pipeline")
        self.client = Client(self.w.cfg.intake, shm_prefix)
        self.slots = [Slot(i, f"rx{i}") for i in range(settings.receivers)]
        for slot in self.slots:
            self.start_receiver(slot)

    # ------------------------------------------------------------ helpers
    def rel(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.t0, 3)

    def log(self, text: str) -> None:
        self.log_fn(f"[{time.monotonic() - self.t0:7.2f}s] {text}")

    def violation(self, text: str, kind: str = "other") -> None:
        self.violations.append(text)
        self.violation_kinds[kind] += 1
        self.log(f"VIOLATION: {text}")

    def start_receiver(self, slot: Slot) -> None:
        parent, child = self.mp.Pipe()
        slot.inc += 1
        slot.proc = self.mp.Process(target=receiver_main, name=f"chaos-{slot.rx_id}",
                                    args=(slot.rx_id, self.w.cfg.bootstrap, child, 64 << 20), daemon=True)
        slot.proc.start()
        child.close()
        slot.conn = parent
        slot.state = "starting"

    def up_slots(self) -> list[Slot]:
        return [s for s in self.slots if s.state == "up"]

    def alive_observer(self, key) -> bool:
        slot = self.slots[key[0]]
        return slot.inc == key[1] and slot.state in ("up", "finished")

    def open_rooms(self) -> int:
        n = 0
        for rm in itertools.islice(reversed(self.rooms.values()), 4 * max(MAX_OPEN_ROOMS, DENSE_WINDOW)):
            if any(self.alive_observer(k) and ob["failed"] is None and ob["success"] != ob["items"]
                   for k, ob in rm.observers.items()):
                n += 1
        return n

    # ------------------------------------------------------------ receivers' news
    def pump(self, timeout: float) -> None:
        conns = {s.conn: s for s in self.slots if s.state in ("starting", "up") and s.conn is not None}
        if not conns:
            time.sleep(timeout)
            return
        for conn in wait_conns(list(conns), timeout):
            slot = conns[conn]
            try:
                while slot.conn is conn and conn.poll(0):
                    self.on_message(slot, conn.recv())
            except (EOFError, OSError):
                if slot.state != "dead" and slot.conn is conn:
                    self.violation(f"receiver {slot.rx_id} (pid {slot.proc.pid}) died unasked "
                                   f"(exit code {slot.proc.exitcode})")
                    self.receiver_down(slot, 0.5)

    def on_message(self, slot: Slot, msg) -> None:
        kind = msg[0]
        if kind == "ready":
            slot.state = "up"
            # whom the worker's told table records a status for (stages/reaper.py, _incarnation)
            self.incarnations[slot.key] = (slot.rx_id, incarnation(slot.rx_id, msg[2], msg[4]))
            self.log(f"receiver {slot.rx_id} up (pid {msg[1]}, incarnation {slot.inc})")
        elif kind == "status":
            _, room, item, state, reason, at = msg
            ob = self.rooms[room].observers[slot.key]
            if state == "success":
                ob["success"].add(item)
                if ob["success"] == ob["items"]:
                    ob["done_at"] = at
                    self.served_at.append(at)
            else:
                ob["failed"], ob["failed_at"] = reason, at
                ob.setdefault("done_at", at)
        elif kind == "violation":
            self.violation(msg[1], msg[2])
        elif kind == "recovered":
            self.recovered_by_query += 1
        elif kind == "final":
            slot.final = msg[1]
            slot.state = "finished"
        elif kind == "error":
            self.violation(f"receiver {slot.rx_id} could not start: {msg[1]}")
            self.receiver_down(slot, 1.0)

    def receiver_down(self, slot: Slot, restart_in: float) -> None:
        self.observer_end[slot.key] = time.monotonic()
        slot.state = "dead"
        slot.conn.close()
        slot.conn = None
        slot.restart_at = time.monotonic() + restart_in

    # ------------------------------------------------------------ load
    def pick_item(self):
        r = self.rng.random()
        if r < 0.5:
            k = self.rng.randrange(HOT_POOL)
            seed = k
        elif r < 0.65 and self.recent_fresh:
            seed = self.rng.choice(self.recent_fresh)  # an identical miss, likely still in flight
        else:
            seed = self.fresh_seed
            self.fresh_seed += 1
            self.recent_fresh.append(seed)
        modality, grid = GRIDS[seed % len(GRIDS)]
        return modality, grid, seed

    def send_room(self, skip: Slot | None = None, cancels: bool = True) -> int | None:
        """Encode one room and send its receivers their shards; `skip` is sent none (it is
        about to die before sending its allocs). None when no receiver is up."""
        up = self.up_slots()
        if not up:
            return None
        room = self.next_room
        self.next_room += 1
        items = [self.pick_item() for _ in range(self.rng.choice((1, 1, 2, 3)))]
        msg = self.client.message(room, f"chaos-{room}", [Item(m, [list(g)], pixels(seed, g))
                                                          for m, g, seed in items])
        per_slot: dict[int, list] = {}
        for i, (modality, grid, seed) in enumerate(items):
            span = span_of(grid)
            base = dict(item=i, span=span, seed=seed, grid=grid, modality=modality)
            if len(up) >= 2 and self.rng.random() < self.s.fanout2_p:
                a, b = self.rng.sample(up, 2)
                cut = 0 if self.rng.random() < ZERO_ROW_SHARD_P else self.rng.randrange(1, span)
                per_slot.setdefault(a.index, []).append(dict(base, fanout=2, row_start=0, n_rows=cut))
                per_slot.setdefault(b.index, []).append(dict(base, fanout=2, row_start=cut, n_rows=span - cut))
            else:
                a = self.rng.choice(up)
                per_slot.setdefault(a.index, []).append(dict(base, fanout=1, row_start=0, n_rows=span))
        rm = self.rooms[room] = Room(room, time.monotonic(), [it["pixels"]["shm"] for it in msg["items"]])
        self.client.send(msg)
        cancel_after = self.rng.uniform(0, 0.05) if cancels and self.rng.random() < CANCEL_P else None
        canceler = self.rng.choice(sorted(per_slot)) if cancel_after is not None else None
        for index, shards in sorted(per_slot.items()):
            slot = self.slots[index]
            if slot is skip:
                continue
            try:
                slot.conn.send(("room", room, shards, cancel_after if index == canceler else None))
            except (OSError, ValueError):
                continue
            rm.observers[slot.key] = {"items": {s["item"] for s in shards}, "success": set(), "failed": None}
            if index == canceler:
                self.cancels_sent += 1
        return room

    # ------------------------------------------------------------ chaos
    def live_stage_pid(self, name: str) -> int | None:
        proc = self.w.runtime.procs.get(name)
        if proc is None or not proc.is_alive() or not self.w.runtime.hb.row(name)[Heartbeats.READY]:
            return None
        return proc.pid

    def stage_ready(self, name: str) -> bool:
        return bool(self.w.runtime.hb.row(name)[Heartbeats.READY])

    def held_by(self, name: str) -> int:
        """Rooms whose custody bit for `name` is set in the room table."""
        return len(self.w.runtime.rooms.held_by(1 << registry.owner_of(name)))

    def watch(self) -> None:
        """The SIGSTOPped stage must be killed and restarted; dead receivers come back."""
        now = time.monotonic()
        if self.stopped is not None:
            name, pid, before, deadline = self.stopped
            if self.w.runtime.restart_counts[name] > before:
                self.log(f"stage {name} restarted after SIGSTOP (missed heartbeats)")
                self.stopped = None
            elif now > deadline:
                self.violation(f"stage {name} (pid {pid}) SIGSTOPped {self.s.heartbeat_timeout_s + 30:g} s "
                               f"ago was not killed and restarted")
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                self.stopped = None
        for name, restarts in self.w.runtime.restart_counts.items():
            while restarts > self.signalled[name] + self.unasked[name]:
                self.unasked[name] += 1
                self.timeline.stage_died_unasked(name, now)
        for slot in self.slots:
            if slot.state == "dead" and now >= slot.restart_at:
                self.receiver_restarts += 1
                self.start_receiver(slot)
        if self.w.runtime.fatal and not self.gave_up:
            self.gave_up = True
            self.violation(f"the worker gave up: {self.w.runtime.fatal}")
        degraded = self.stopped is not None or bool(self.w.runtime.stages_not_ready())
        if degraded:
            self.timeline.start_degraded(now)
        else:
            self.timeline.end_degraded(now)

    def tick(self) -> None:
        self.pump(0.005)
        self.watch()
        self.load()
        now = time.monotonic()
        if self.s.dense and now >= self.next_progress:
            self.next_progress = now + 5.0
            holders = [n for n in registry.stage_names(self.w.cfg.tower_replicas, self.w.cfg.preprocess_workers)
                       if n != registry.REAPER]
            self.log(f"progress: {len(self.rooms)} rooms sent, {self.open_rooms()} open; held by "
                     + ", ".join(f"{n} {self.held_by(n)}" for n in holders))

    def tick_until(self, cond, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if cond():
                return True
            self.tick()
        return cond()

    def load(self) -> None:
        """--dense: a window of rooms in flight; otherwise ROOMS_PER_S, at most MAX_OPEN_ROOMS open."""
        if not self.load_on or self.next_room > self.max_rooms:
            return
        if self.s.dense:
            for _ in range(DENSE_WINDOW - self.open_rooms()):
                if self.send_room() is None:
                    break
            return
        now = time.monotonic()
        if now >= self.next_send:
            self.next_send = max(self.next_send + 1 / ROOMS_PER_S, now - 1.0)
            if self.open_rooms() < MAX_OPEN_ROOMS:
                self.send_room()

    # ------------------------------------------------------------ phases
    def run(self) -> dict:
        self.log(f"seed {self.s.seed}; worker up (prefix {self.prefix}); chaos for {self.s.chaos_s:g} s")
        self.wait_receivers_up()
        end = time.monotonic() + self.s.chaos_s
        self.chaos_span = (time.monotonic(), end)
        next_event = time.monotonic() + self.rng.uniform(*self.s.event_every_s)
        self.next_send = time.monotonic()
        try:
            while time.monotonic() < end and not self.gave_up:
                self.tick()
                now = time.monotonic()
                if now >= next_event:
                    (events.dense_event if self.s.dense else events.chaos_event)(self)
                    next_event = time.monotonic() + self.rng.uniform(*self.s.event_every_s)
            self.load_on = False
            self.log(f"chaos over: {len(self.timeline.kills)} kills, {len(self.rooms)} rooms sent")
            if self.next_room > self.max_rooms:
                self.log(f"the load stopped at {self.max_rooms} rooms (the room table keeps every verdict)")
            if not self.gave_up:
                self.settle()
                self.final_rooms()
                self.settle()
            self.checked_at = time.monotonic()
            self.timeline.end_degraded(self.checked_at)
            verdicts = self.worker_verdicts()
            self.told_lost = {r for r in self.unconcluded_rooms() if self.statuses_lost_with_reaper(r)}
        finally:
            self.shutdown()
        self.checks = EndChecks(self, verdicts)
        self.checks.run()
        return self.result()

    def wait_until(self, cond, timeout: float, what: str) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self.gave_up:
            self.pump(0.02)
            self.watch()
            if cond():
                return True
        self.violation(f"waited {timeout:g} s for {what}")
        return False

    def wait_receivers_up(self) -> None:
        self.wait_until(lambda: all(s.state == "up" for s in self.slots), 120, "every receiver to be up")

    def settle(self) -> None:
        """Every stage and receiver up, every room concluded wherever someone alive listens."""
        self.wait_until(lambda: self.stopped is None and all(self.live_stage_pid(n) for n in self.w.runtime.stages),
                        120, "every stage to be up")
        self.wait_receivers_up()
        # a room whose statuses went down with a killed reaper (known limit 1) never concludes,
        # nor one whose request and allocs both died in killed stages' sockets (known limit 3)
        self.wait_until(lambda: all(self.statuses_lost_with_reaper(r) or self.never_seen_allocs_lost(r)
                                    for r in self.unconcluded_rooms()),
                        self.s.settle_timeout_s, "every room to conclude at its receivers")
        self.wait_until(lambda: self.w.runtime.rooms.count_live() == 0, self.s.settle_timeout_s,
                        "the worker's live rooms to drop to 0")

    def unconcluded_rooms(self) -> list[int]:
        return [rm.room for rm in self.rooms.values()
                if any(self.alive_observer(k) and ob["failed"] is None and ob["success"] != ob["items"]
                       for k, ob in rm.observers.items())]

    def statuses_lost_with_reaper(self, room: int) -> bool:
        """Known limit 1 (docs/design.md): statuses the reaper sent just before it was killed (or
        stopped, then killed) can be lost with its socket buffers."""
        slot = self.w.runtime.rooms.find(room)
        e = self.w.runtime.rooms.get(slot) if slot is not None else None
        concluded = e.concluded if e is not None and not e.live else None
        return concluded is not None and (self.timeline.reaper_killed_near(concluded)
                                          or self.told_then_reaper_killed(room, e))

    def told_then_reaper_killed(self, room: int, e) -> bool:
        """Known limit (1) where the room concluded well after the kill (its successor took a
        while to start and finish it), so reaper_killed_near() misses it: a reaper was killed
        between the room's sending and a moment after it concluded, and every status a live
        receiver misses is recorded as told in the worker's told table, for that receiver's
        incarnation. A status never told (a bug) is not excused."""
        rm = self.rooms[room]
        if not self.timeline.reaper_killed_between(rm.sent_at, e.concluded + self.s.reaper_loss_before_s):
            return False
        told = self.w.runtime.shared.told
        for k, ob in rm.observers.items():
            if not self.alive_observer(k) or ob["failed"] is not None or ob["success"] == ob["items"]:
                continue
            failed, items = told.recorded(room, self.incarnations.get(k, ()))
            ok = failed if e.state == RoomState.FAILED else ob["items"] - ob["success"] <= items
            if not ok:
                return False
        return True

    def never_seen_allocs_lost(self, room: int) -> bool:
        rm = self.rooms[room]
        return (self.w.runtime.rooms.find(room) is None and self.timeline.intake_killed_after(rm.sent_at)
                and self.timeline.sender_killed_after(rm.sent_at))

    def final_rooms(self) -> None:
        """With the chaos over, the worker must still serve: ten rooms, all succeed."""
        sent = [self.send_room(cancels=False) for _ in range(FINAL_ROOMS)]
        self.wait_until(lambda: not [r for r in sent if r in self.unconcluded_rooms()], 30,
                        "the final rooms to conclude")
        self.final_sent = sent

    def worker_verdicts(self) -> dict:
        rooms = self.w.runtime.rooms
        out = {}
        for room in self.rooms:
            slot = rooms.find(room)
            e = rooms.get(slot) if slot is not None else None
            out[room] = None if e is None else (e.state, e.reason, e.request_id, e.concluded)
        live = self.w.runtime.run.live_rooms()
        if live:
            self.violation(f"{len(live)} rooms still live in the worker after settling: " + ", ".join(
                f"{e.room} ({e.state.name}, custody bits {e.holders:#x}, items {e.items_done}/{e.items_total})"
                for e in live[:10]))
        # Stages publish their counters a few times a second: what the last answer changed
        # may not be on the board yet, so the counters get a few publishing rounds to clear.
        # Allocs held for rooms the worker never saw (their requests died in a killed intake)
        # are answered "unknown room" only bootstrap_timeout_s after they came (docs/protocol.md
        # §4), and settle() does not wait for such rooms (known limit 3): they get that long.
        keys = ("sender_live_rooms", "sender_held_allocs", "sender_early_items", "scheduler_pending")
        start = time.monotonic()
        while True:
            stats = self.w.stats()
            left = {key: stats[key] for key in keys if stats.get(key)}
            waited = time.monotonic() - start
            if not left or waited >= STATS_SETTLE_S and (
                    set(left) != {"sender_held_allocs"} or waited >= STATS_SETTLE_S + self.s.bootstrap_timeout_s):
                break
            time.sleep(0.05)
        for key, value in left.items():
            self.violation(f"after settling the worker's {key} is {value}, not 0")
        self.worker_stats = stats
        return {r: (v if v is None else (RoomState(v[0]).name, *v[1:])) for r, v in out.items()}

    def shutdown(self) -> None:
        for slot in self.slots:
            if slot.state == "up":
                try:
                    slot.conn.send(("finish",))
                except OSError:
                    pass
        end = time.monotonic() + 60
        while time.monotonic() < end and any(s.state == "up" and s.final is None for s in self.slots):
            self.pump(0.05)
        for slot in self.slots:
            if slot.proc is not None:
                slot.proc.join(10)
                if slot.proc.is_alive():
                    slot.proc.kill()
                    slot.proc.join(5)
        self.client.close()
        # Stages alive now: one killed a moment ago (by the chaos, or by the hang killer on a
        # loaded machine) and not restarted yet did not exit at shutdown.
        procs = {name: p for name, p in self.w.runtime.procs.items() if p is not None and p.is_alive()}
        self.w.close()
        self.stage_exit_codes = {name: p.exitcode for name, p in procs.items()}

    def longest_outage(self) -> float:
        """The longest time during the chaos in which no room succeeded at any receiver (the
        load keeps rooms in flight all along, so the worker served nothing then)."""
        begin, end = self.chaos_span
        times = sorted(t for t in self.served_at if begin <= t <= end)
        edges = [begin, *times, end]
        return max(b - a for a, b in zip(edges, edges[1:]))

    def result(self) -> dict:
        t, ch = self.timeline, self.checks
        return {
            "seed": self.s.seed,
            "minutes": round(self.s.chaos_s / 60, 3),
            "rooms_submitted": len(self.rooms),
            "rooms_succeeded": ch.outcomes["succeeded"],
            "rooms_failed": ch.outcomes["failed"] + ch.outcomes["lost"],
            "rooms_failed_by_reason": dict(ch.failed_by_reason.most_common()),
            "cancels_sent": self.cancels_sent,
            "kills_done": len(t.kills),
            "kills": len(t.kills),
            "stage_kills": len(t.held_at_kill),
            "median_rooms_held_at_kill": statistics.median(t.held_at_kill) if t.held_at_kill else 0,
            "rooms_held_at_kill": dict(sorted(Counter(t.held_at_kill).items())),
            "median_rooms_in_flight_at_kill": (statistics.median(t.in_flight_at_kill)
                                               if t.in_flight_at_kill else 0),
            "rooms_hung": len(ch.hung),
            "longest_outage_s": round(self.longest_outage(), 1),
            "duplicate_statuses": self.violation_kinds["duplicate"],
            "wrong_rows": self.violation_kinds["wrong_rows"],
            "digest_mismatches": self.violation_kinds["digest_mismatch"],
            "statuses_recovered_by_query": self.recovered_by_query,
            "serving_at_end": ch.serving_at_end,
            "dense": self.s.dense,
            "degraded_s": round(t.degraded_total[-1], 1),
            "kill_log": t.kills,
            "restarts": sum(self.worker_stats.get("restarts", {}).values()),
            "restarts_by_stage": self.worker_stats.get("restarts", {}),
            "receiver_restarts": self.receiver_restarts,
            "segments_lost_in_intake_socket": ch.lost_segments,
            "rooms_with_statuses_lost_with_reaper": ch.lost_with_reaper,
            "rooms_never_seen_with_allocs_lost_with_sender": ch.allocs_lost_with_sender,
            "stage_exit_codes": self.stage_exit_codes,
            "violations": self.violations,
            "violation_count": len(self.violations),
        }
