"""`run.py status`: what a running worker of a shm prefix is doing, read from its shared memory.

Every object is mapped read-only (PROT_READ), so this command cannot change the
worker's state; it creates and unlinks nothing and signals nobody. It reads the room
table (rooms by state), the heartbeat rows (pid, heartbeat age, busy fraction,
restarts), the rings (records waiting for each stage) and the StatsBoard (cache
occupancy per tier). An in-process worker (`--mode inprocess`) has only its room
table in shared memory: that much is shown.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter

from ipc import shm
from ipc.ring import Ring, RingError
from ipc.rooms import RoomState, RoomTable
from pipeline.runtime import wiring
from pipeline.cli.config import WorkerConfig
from pipeline.runtime.boards import Heartbeats, StatsBoard
from stages import registry

NO_WORKER = 4


class _NoSemaphore:
    """Stands in for a ring's semaphores: status only reads the ring's counters."""

    def close(self) -> None:
        pass


def lock_holder(path: str) -> int | None:
    """The pid holding a flock on `path`, from /proc/locks, or None. Read there rather than
    probed with flock(): a probe that held the lock for an instant could make a worker
    starting at that instant fail to take its own."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    dev_ino = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as f:
        for line in f:
            # "1: FLOCK  ADVISORY  WRITE 4242 00:1b:207155 0 EOF"; a waiter's has "->" before FLOCK
            parts = line.split()
            if "->" in parts or "FLOCK" not in parts:
                continue
            i = parts.index("FLOCK")
            if parts[i + 4:i + 5] == [dev_ino]:
                return int(parts[i + 3])
    return None


def live_runs(prefix: str) -> dict[str, int]:
    """Run id -> pid of the worker holding its run lock, for every live run of `prefix`."""
    out = {}
    for rid in sorted({shm.parse_name(entry)[1] for entry in shm.list_objects(prefix)}):
        pid = lock_holder(os.path.join(shm.SHM_DIR, shm.object_name(prefix, rid, "lock")))
        if pid is not None:
            out[rid] = pid
    return out


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_run(prefix: str, run_id: str, pid: int) -> dict:
    """The state of one live run (`pid`: its supervisor or in-process worker). OSError,
    ShmError or RingError if it stops, or has not made its objects yet, while it is read."""
    opened = []

    def segment(what: str) -> shm.Segment:
        seg = shm.Segment.attach(shm.object_name(prefix, run_id, what), readonly=True)
        opened.append(seg)
        return seg

    out: dict = {"prefix": prefix, "run_id": run_id, "pid": pid}
    try:
        rooms = RoomTable(segment("rooms"))
        try:
            states = Counter(e.state for e in rooms.entries())
        finally:
            rooms.close()
        out["rooms"] = {s.name.lower(): states.get(s, 0) for s in RoomState if s != RoomState.FREE}
        out["live_rooms"] = sum(n for s, n in states.items() if s < RoomState.SUCCESS)
        if not os.path.exists(os.path.join(shm.SHM_DIR, shm.object_name(prefix, run_id, "heartbeats"))):
            out["mode"] = "inprocess"
            return out
        out["mode"] = "pipeline"
        hb = Heartbeats(segment("heartbeats"))  # its rows say which stages the run has
        try:
            depth = Counter()
            for src, dst in wiring.edges(hb.towers, hb.preprocessors):
                ring = Ring(segment(wiring.ring_name(src, dst)), _NoSemaphore(), _NoSemaphore(),
                            (wiring.ring_name(src, dst), "", ""))
                try:
                    depth[dst] += ring.depth()
                finally:
                    ring.close()
            now = time.monotonic()
            stages = {}
            for stage in hb.stages:
                row = hb.row(stage)
                pid, beat, ready, restarts, busy = (float(row[field]) for field in (
                    Heartbeats.PID, Heartbeats.BEAT, Heartbeats.READY, Heartbeats.RESTARTS, Heartbeats.BUSY))
                stages[stage] = {
                    "pid": int(pid), "alive": _pid_alive(int(pid)), "ready": bool(ready),
                    "heartbeat_age_s": round(max(0.0, now - beat), 3), "busy_ratio": round(busy, 3),
                    "queue_depth": depth[stage], "restarts": int(restarts),
                }
        finally:
            hb.close()
        out["stages"] = stages
        published = StatsBoard(segment("stats")).read(registry.CACHE)
        cache = published.get("cache")
        if cache:
            out["cache"] = {tier: {"bytes": cache[f"{tier}_bytes"], "budget_bytes": cache[f"{tier}_budget"],
                                   "entries": cache[f"{tier}_entries"]} for tier in ("arena", "host")}
        if published.get("store"):
            out["store"] = {**published["store"], "gets": published["store_gets"],
                            "puts": published["store_puts"]}
        return out
    finally:
        for seg in opened:
            seg.close()


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def format_run(run: dict) -> str:
    rooms = run["rooms"]
    lines = [f"worker {run['prefix']} (run {run['run_id']}, {run['mode']}, pid {run['pid']})",
             f"rooms: {run['live_rooms']} live (" +
             ", ".join(f"{s} {rooms[s]}" for s in ("bootstrapping", "queued", "encoding", "transferring")) +
             f"); concluded, kept as tombstones: success {rooms['success']}, failed {rooms['failed']}"]
    if run["mode"] == "inprocess":
        lines.append("stages: one process (--mode inprocess); it publishes no heartbeats or queues")
        return "\n".join(lines)
    lines.append(f"{'stage':<10} {'pid':>8} {'state':<8} {'heartbeat':>10} {'busy':>5} {'queue':>7} {'restarts':>8}")
    for stage, s in run["stages"].items():
        state = "ready" if s["alive"] and s["ready"] else "starting" if s["alive"] else "down"
        lines.append(f"{stage:<10} {s['pid']:>8} {state:<8} {s['heartbeat_age_s']:>8.2f} s "
                     f"{s['busy_ratio']:>5.0%} {s['queue_depth']:>7} {s['restarts']:>8}")
    cache = run.get("cache")
    if cache:
        lines.append("cache: " + "; ".join(
            f"{tier} tier {_size(c['bytes'])} of {_size(c['budget_bytes'])} ({c['entries']} entries)"
            for tier, c in cache.items()))
    else:
        lines.append("cache: not published yet (the cache stage is starting)")
    store = run.get("store")
    if store:
        state = "connected" if store["connected"] else "not connected (local tiers only)"
        lines.append(f"store tier: master {store['master']}, {state}; gets " +
                     ", ".join(f"{k} {v}" for k, v in store["gets"].items()) + "; puts " +
                     ", ".join(f"{k} {v}" for k, v in store["puts"].items()))
    return "\n".join(lines)


def main(cfg: WorkerConfig, as_json: bool) -> int:
    """Print the state of every live worker of `cfg.shm_prefix`; 4 if there is none."""
    prefix = cfg.shm_prefix
    runs, unreadable = [], []
    for rid, pid in live_runs(prefix).items():
        try:
            runs.append(read_run(prefix, rid, pid))
        except (OSError, shm.ShmError, RingError) as e:  # starting or stopping as we read, or not ours
            unreadable.append(f"run {rid} of pid {pid} cannot be read: {e}")
    if not runs:
        if unreadable:
            error = f"no worker with shm prefix {prefix!r} could be read: " + "; ".join(unreadable)
        else:
            error = (f"no worker is running with shm prefix {prefix!r}; "
                     f"give the prefix the worker was started with (--shm-prefix)")
        print(json.dumps({"prefix": prefix, "runs": [], "error": error}) if as_json else error)
        return NO_WORKER
    if as_json:
        print(json.dumps({"prefix": prefix, "runs": runs}, indent=2))
    else:
        print("\n\n".join(format_run(r) for r in runs))
    return 0
