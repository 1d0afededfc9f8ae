#!/usr/bin/env python3
"""The multi-process pipeline against the in-process worker, same workload, same run.

    .venv/bin/python benchmarks/pipeline.py [--quick] [--json PATH]

Workload: distinct images (no cache hits), each a (1, 32, 32) grid of float32
patches of 1176 values (4.8 MB of pixels to take in and hash), passed in
shared-memory segments (the Client default); the sim tower makes 256 rows of
hidden 3584 bfloat16 (1.835 MB) per image, which the sender writes over Mooncake
TCP on loopback into the receiver's memory.

Each mode and scenario gets a fresh worker (its own shm prefix ``bench_...``) in a
spawned worker process, started as tests/helpers.py's start_worker does: the
``InProcessWorker`` serving in a thread (inprocess, like ``run.py serve``) or the
``Supervisor`` and its stage processes (pipeline). The gateway and the prefill
receiver run together in a spawned *client* process per worker: it publishes the
pixels, sends the encode messages, allocs each room's item as it announces it,
keeps a window of rooms in flight and takes the times. This process only
orchestrates and samples memory, so nothing of the benchmark's shares a GIL with
the in-process worker. The two modes of a scenario are alive together (one idle
while the other is measured): warm-up each, then the latency samples in
alternating blocks of 25 and the measured runs alternating (A B B A ...), so a
change in the shared machine's load meets both. Pixels of a measured run are
published before its clock starts: the gateway's copies are not the worker's
cost, and on two cores they would take a large share of the CPU from either mode.

Figures (each a ratio against a baseline measured in the same run):
- pipeline_vs_inprocess_throughput (scenario cpu-bound, device time 0.2 ms per
  image): images/s of the pipeline / images/s of the in-process worker.
  Target >= 1.0. small_pipeline_vs_inprocess_throughput: the same in scenario
  small (grid 1x4x4: 75 KB of pixels, 4 rows = 28 KB out, device time 0.02 ms per
  image). Target >= 1.3. Each prints the ceiling: all cores busy at the
  in-process CPU cost per image.
- pipeline_cpu_per_image_vs_inprocess, small_...: CPU per image of every process
  (worker and client, user+system) of the pipeline / of the in-process worker,
  best trials. Target <= 1.1 (the worker-only ratio is printed too).
- added_latency_vs_hop_floor: p50 of per-image latency (encode sent -> success
  status at the receiver, one image in flight) of the pipeline minus the
  in-process worker's (added_latency_ms_p50), cpu-bound settings, / (ring hops on
  a fresh encode's critical path, FRESH_ENCODE_PATH checked against
  pipeline/wiring.py's EDGES, x the p50 one-way wake of a process asleep on a bare
  semaphore: benchmarks/ring.py's measurement, run while both workers are up and
  idle). Target <= 3. small_added_latency_vs_hop_floor: the same, small (no target).
- intake_cpu_vs_raw_read: the intake stage process's CPU per image (best
  cpu-bound trial) / the CPU per image of one process that opens a segment made
  as the gateway makes it, preadv's it into a resident buffer, unlinks and closes
  it. Target <= 1.2. small_intake_cpu_vs_raw_read: the same, small (no target).
  The intake stage also hashes the pixels as it reads them (the cache's key, once
  read by the cache stage again): intake_cpu_vs_raw_read_and_hash divides by the same
  floor with each piece hashed as it lands (no target).
- pipeline_vs_device_bound (scenario device-bound: device time per image = 3x the
  in-process CPU cost per image, that cost = 1/throughput - device time from the
  cpu-bound in-process run): images/s of the pipeline / 1 / device time.
  Target >= 0.97. The in-process worker's figure there is reported too.
- replicas2_vs_one_device_bound (scenario replicas: small images, sim device time
  10 ms per image, a sleep, so it scales on two cores too; batches of at most 4):
  images/s of the pipeline with two tower replicas / with one, both workers alive
  together, trials alternating. Target >= 1.8.
- tiny_pipeline_vs_tower_alone: images/s of the pipeline with the tiny Qwen2.5-VL
  tower (grid (1, 16, 16)) / the same tower's forward alone (built as the tower
  stage builds it, start(...).result() one batch after another, outs registered
  as the embedding arena is) on the batches the scheduler forms from the same
  images all waiting, in one process. Target >= 0.95; in-process / tower alone
  is printed too, and tiny_tower_alone_busy_neighbour_vs_alone: the tower alone
  while another process spins a Python loop, / alone (no target: what any work
  on the other core costs the forward on this machine; the pipeline's other
  stages are such work).
- peak resident memory of each worker's process tree (for the pipeline, the
  supervisor and every stage), sampled at 10 Hz as a sum of RSS (a shared page
  counts in every process that maps it); PSS (each shared page split among its
  mappers) is read at phase ends. The arenas' pages count once touched.

Throughput is the steady rate: a least-squares slope of completions against time,
the first and last `window` (default 64) completions left out (fill and drain);
each mode runs `trials` measured runs after a warm-up of 2 x window images and the
best (least disturbed: the machine is shared) counts; every trial, its end-to-end
rate and the CPU per image of every process (user+system, from /proc; for the
in-process worker split into its loop thread and its other threads, Mooncake's
and zmq's) are in the JSON under "raw". The tiny tower runs with one torch
intra-op thread in both modes (--torch-threads): two OpenMP threads on two cores
shared with the other processes stall for seconds at a time (identical runs gave
16 to 318 images/s).

Exit status: 0, also when a target is missed (MISSED is printed); 1 if a room
failed or timed out, or the receiver saw a protocol violation.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GRID = (1, 32, 32)        # 1024 patches -> 256 rows
TINY_GRID = (1, 16, 16)   # 256 patches -> 64 rows
SMALL_GRID = (1, 4, 4)    # 16 patches (75 KB of pixels) -> 4 rows (28 KB)
HIDDEN, DTYPE = 3584, "bfloat16"
CPU_DEVICE_S = 0.2e-3     # device time per image, cpu-bound
SMALL_DEVICE_S = 0.02e-3  # device time per image, small
DEVICE_FACTOR = 3.0       # device-bound: device time = this x the in-process CPU cost
# A fresh encode's critical path (README, "life of one image"): each step is a ring
# in the pipeline, checked against pipeline/wiring.py's EDGES by hops_on_fresh_path().
FRESH_ENCODE_PATH = ("intake", "cache", "scheduler", "tower", "sender", "reaper")
TARGETS = {
    "pipeline_vs_inprocess_throughput": (">=", 1.0),
    "small_pipeline_vs_inprocess_throughput": (">=", 1.3),
    "pipeline_cpu_per_image_vs_inprocess": ("<=", 1.1),
    "small_pipeline_cpu_per_image_vs_inprocess": ("<=", 1.1),
    "added_latency_vs_hop_floor": ("<=", 3.0),
    "intake_cpu_vs_raw_read": ("<=", 1.2),
    "pipeline_vs_device_bound": (">=", 0.97),
    "tiny_pipeline_vs_tower_alone": (">=", 0.95),
    "replicas2_vs_one_device_bound": (">=", 1.8),
}
REPLICAS_DEVICE_S = 10e-3  # device time per image, replicas: the (sleeping) device is the bottleneck
PHASE_TIMEOUT_S = 300.0
MIB = 1 << 20


# ============================================================ the client process
def client_main(conn, intake: str, prefix: str, bootstrap: str, spec: dict, grids: list,
                seed: int, window: int) -> None:
    """Gateway and prefill receiver in one process; answers the parent's commands.
    Room r sends one image of grid grids[r % len(grids)]."""
    import numpy as np

    from ipc import wire
    from pipeline.client import Client, Item, unlink_segment
    from pipeline.receiver import Receiver

    grids = [tuple(g) for g in grids]
    spans = [g[0] * g[1] * g[2] // spec["merge"] ** 2 for g in grids]
    isz = wire.DTYPES[spec["dtype"]]
    item_bytes = max(spans) * (spec["hidden"] + spec["deepstack_width"]) * isz
    alloc_kw = dict(hidden=spec["hidden"], dtype=spec["dtype"], deepstack_width=spec["deepstack_width"])
    rx = Receiver("bench-rx", bootstrap, buffer_bytes=(window + 4) * ((item_bytes + 4095) & ~4095) + MIB)
    client = Client(intake, prefix)
    rng = np.random.default_rng(seed)
    bases = [rng.standard_normal((g[0] * g[1] * g[2], spec["patch_dim"]), dtype=np.float32) for g in grids]
    published: list[str] = []
    me = os.getpid()

    def alloc(room: int) -> None:
        rx.alloc(room, 0, span=spans[room % len(grids)], **alloc_kw)

    def publish(room: int) -> bytes:
        k = room % len(grids)
        base = bases[k]
        base[0, 0] = float(room)  # distinct pixels per room: no cache hits
        msg = client.message(room, f"bench-{room}", [Item("image", [list(grids[k])], base)])
        published.append(msg["items"][0]["pixels"]["shm"])
        return wire.encode(msg)

    def cpu_s() -> tuple[float, float]:
        import resource

        t = resource.getrusage(resource.RUSAGE_SELF)
        return t.ru_utime + t.ru_stime, t.ru_stime

    def conclude(room: int, t: float, sent_at: dict, out: dict) -> None:
        out["done_at"].append(t)
        out["latency"].append(t - sent_at.pop(room))
        if room in rx.failed:
            out["failed"].append((room, rx.failed[room]))
        rx.release(room)

    def windowed(first: int, n: int, win: int) -> dict:
        t_pub = time.monotonic()
        frames = [(room, publish(room)) for room in range(first, first + n)]
        t_pub = time.monotonic() - t_pub
        sent_at: dict[int, float] = {}
        out = {"done_at": [], "latency": [], "failed": [], "publish_s": t_pub}
        outstanding: set[int] = set()
        i = 0
        c0 = cpu_s()
        t0 = time.monotonic()
        end = t0 + PHASE_TIMEOUT_S
        while len(out["done_at"]) < n:
            while len(outstanding) < win and i < n:
                room, frame = frames[i]
                frames[i] = None
                i += 1
                sent_at[room] = time.monotonic()
                client.send_raw(frame)
                alloc(room)
                outstanding.add(room)
            sts = rx.poll(0.05)
            t = time.monotonic()
            for st in sts:
                room = st.get("room")
                if room in outstanding and rx.concluded(room, 1):
                    outstanding.discard(room)
                    conclude(room, t, sent_at, out)
            if t > end:
                out["timed_out"] = n - len(out["done_at"])
                break
        out["t0"] = t0
        out["elapsed"] = time.monotonic() - t0
        c1 = cpu_s()
        out["client_cpu_s"] = (c1[0] - c0[0], c1[1] - c0[1])
        return out

    def one_at_a_time(first: int, n: int) -> dict:
        out = {"done_at": [], "latency": [], "failed": []}
        sent_at: dict[int, float] = {}
        for room in range(first, first + n):
            frame = publish(room)
            sent_at[room] = time.monotonic()
            client.send_raw(frame)
            alloc(room)
            end = sent_at[room] + PHASE_TIMEOUT_S
            while not rx.concluded(room, 1):
                rx.poll(1.0)
                if time.monotonic() > end:
                    out["timed_out"] = 1
                    return out
            conclude(room, time.monotonic(), sent_at, out)
        return out

    try:
        conn.send(("ready", os.getpid()))
        while True:
            cmd = conn.recv()
            if cmd[0] == "quit":
                break
            if cmd[0] == "windowed":
                out = windowed(*cmd[1:])
            elif cmd[0] == "latency":
                out = one_at_a_time(*cmd[1:])
            else:
                raise ValueError(f"unknown command {cmd[0]!r}")
            out["violations"] = list(rx.violations)
            rx.violations = []
            conn.send(("result", out))
    finally:
        if os.getpid() == me:
            for name in published:  # those the worker never took
                unlink_segment(name)
            client.close()
            rx.close()


# ============================================================ the worker side
def host_main(conn, mode: str, cfg_kwargs: dict) -> None:
    """A worker process: the InProcessWorker serving in a thread, or the Supervisor and
    its stage processes (tests/helpers.py's start_worker); answers the parent's commands."""
    from pipeline.config import WorkerConfig
    from tests.helpers import start_worker

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
                conn.send(_jsonable(w.stats()))
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
        self._procs: list = []
        self._refreshed = 0.0

    def procs(self) -> list:
        now = time.monotonic()
        if now - self._refreshed > 1.0 or not self._procs:
            self._refreshed = now
            try:
                self._procs = [self.root] + self.root.children(recursive=True)
            except self.psutil.Error:
                self._procs = []
        return self._procs

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
        self._refreshed = 0.0
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


class Session:
    """One fresh worker (own shm prefix, process tree) and its client process."""

    def __init__(self, mode: str, tag: str, tmp: str, args, *, rooms: int, tower: str, device_s: float,
                 grids: list, tower_config: str = "tiny", config: dict | None = None):
        self.mode, self.grids = mode, [tuple(g) for g in grids]
        self.prefix = f"bench_{os.getpid()}_{tag}"
        cfg = make_config(self.prefix, tmp, tag, rooms=rooms, tower=tower, device_s=device_s, args=args,
                          grid=self.grids[0], tower_config=tower_config, **(config or {}))
        self.cfg = cfg
        self.res = {"mode": mode, "tower": tower, "device_s_per_image": device_s,
                    "grids": [list(g) for g in self.grids],
                    "window": args.window, "trials": [], "failed_rooms": 0, "failed_reasons": [],
                    "violations": [], "n_violations": 0, "timed_out": 0,
                    "peak_rss_mib": 0.0, "peak_pss_mib": 0.0}
        self.room = 1
        self.host = self.client = self.sampler = None
        self._host_conn = self._client_conn = None
        ctx = mp.get_context("spawn")
        try:
            self._host_conn, child = ctx.Pipe()
            self.host = ctx.Process(target=host_main, name=f"bench-{mode}",
                                    args=(child, mode, dataclasses.asdict(cfg)), daemon=False)
            self.host.start()
            child.close()
            kind, info = self._recv(self._host_conn, cfg.start_timeout_s + 60, "the worker to start")
            if kind != "ready":
                raise RuntimeError(f"the {mode} worker could not start: {info}")
            self.res["start_s"] = info["start_s"]
            self.sampler = Sampler(self.host.pid)
            self.sampler.start()
            self._client_conn, child = ctx.Pipe()
            self.client = ctx.Process(target=client_main, name="bench-client", daemon=True,
                                      args=(child, info["intake"], self.prefix, info["bootstrap"], info["spec"],
                                            self.grids, args.seed, args.window))
            self.client.start()
            child.close()
            self._recv(self._client_conn, 120, "the client process to start")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _recv(conn, timeout: float, what: str):
        if not conn.poll(timeout):
            raise RuntimeError(f"timed out waiting for {what}")
        return conn.recv()

    def worker(self, cmd: str):
        self._host_conn.send(cmd)
        return self._recv(self._host_conn, 60, f"the worker's {cmd}")

    def run(self, kind: str, n: int, *extra) -> dict:
        self._client_conn.send((kind, self.room, n, *extra))
        _, out = self._recv(self._client_conn, PHASE_TIMEOUT_S + 120, f"the client's {kind} run")
        self.room += n
        self.res["failed_rooms"] += len(out["failed"])
        self.res["failed_reasons"] = sorted(set(self.res["failed_reasons"]) | {r for _, r in out["failed"]})[:5]
        self.res["n_violations"] += len(out["violations"])
        self.res["violations"] = (self.res["violations"] + out["violations"])[:20]
        self.res["timed_out"] += out.get("timed_out", 0)
        return out

    def warmup(self, n: int, window: int) -> None:
        out = self.run("windowed", n, window)
        self.res["warmup"] = n
        self.res["warmup_s"] = out["elapsed"]
        self.sampler.sample_pss()

    def latency(self, n: int) -> None:
        out = self.run("latency", n)
        self.res.setdefault("_lat", []).extend(x * 1000 for x in out["latency"])
        self.sampler.sample_pss()

    def trial(self, n: int, window: int) -> None:
        # the batches the scheduler formed, for a model tower (the stats read waits 0.3 s)
        b0 = self.worker("stats") if self.res["tower"] != "sim" else None
        c0 = self.worker("cpu")
        out = self.run("windowed", n, window)
        c1 = self.worker("cpu")
        b1 = self.worker("stats") if b0 is not None else None
        done = max(1, len(out["done_at"]))
        tr = {"images": len(out["done_at"]), "publish_s": out["publish_s"], "elapsed_s": out["elapsed"],
              "images_per_s": steady_rate(out["done_at"], window),
              "images_per_s_end_to_end": len(out["done_at"]) / out["elapsed"] if out["elapsed"] > 0 else 0.0,
              "latency_ms_p50_loaded": pct(out["latency"], 0.5) * 1000,
              "cpu_ms_per_image": {k: (sum(c1[k]) - sum(c0.get(k, (0.0, 0.0)))) * 1000 / done for k in c1},
              "cpu_sys_ms_per_image": {k: (c1[k][1] - c0.get(k, (0.0, 0.0))[1]) * 1000 / done for k in c1}}
        tr["cpu_ms_per_image"]["client (gateway + receiver)"] = out["client_cpu_s"][0] * 1000 / done
        tr["cpu_sys_ms_per_image"]["client (gateway + receiver)"] = out["client_cpu_s"][1] * 1000 / done
        if b0 is not None:
            tr["tower_batches"] = b1.get("tower_batches", 0) - b0.get("tower_batches", 0)
            tr["tower_items"] = b1.get("tower_items", 0) - b0.get("tower_items", 0)
        self.res["trials"].append(tr)
        self.sampler.sample_pss()

    def finish(self) -> dict:
        r = self.res
        lat = r.pop("_lat", None)
        if lat:
            r["latency_ms"] = {"n": len(lat), "p50": pct(lat, 0.5), "p90": pct(lat, 0.9), "p99": pct(lat, 0.99),
                               "mean": statistics.fmean(lat)}
        if r["trials"]:
            best = max(r["trials"], key=lambda t: t["images_per_s"])
            r["images_per_s"] = best["images_per_s"]
            r["best_trial"] = r["trials"].index(best)
        r["stats"] = self.worker("stats")
        return r

    def close(self) -> None:
        from ipc import shm

        try:
            for conn, proc in ((self._client_conn, self.client), (self._host_conn, self.host)):
                if proc is None:
                    continue
                try:
                    conn.send("quit" if proc is self.host else ("quit",))
                except (OSError, ValueError):
                    pass
                # an idle client quits at once (one stopped mid-run is killed); a worker drains
                proc.join(60 if proc is self.host else 5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
            if self.sampler is not None:
                self.sampler.stop.set()
                self.sampler.join(2)
                self.res["peak_rss_mib"] = self.sampler.peak_rss / MIB
                self.res["peak_pss_mib"] = self.sampler.peak_pss / MIB
                self.res["memory_samples"] = self.sampler.samples
        finally:
            # A killed worker leaves its objects (its lock dies with it); a killed client
            # its pixel segments, which shm.sweep does not know.
            shm.sweep(self.prefix)
            _unlink_pixels(self.prefix)


def run_pair(tag: str, tmp: str, args, *, modes=("inprocess", "pipeline"), tower: str = "sim",
             device_s: float = 0.0, grids=(GRID,), n: int, trials: int, warmup: int, latency: int = 0,
             between=None, tower_config: str = "tiny") -> dict:
    """Both modes, each a fresh worker, alive together: warm-up each, then the latency
    samples in alternating blocks and the measured runs alternating (ABBA...), so a
    change in the machine's load meets both. `between(sessions)`, if given, runs after
    the latency samples and before the measured runs (both workers alive and idle, as
    in the latency samples); what it returns is under "between" of each mode's result."""
    rooms = warmup + latency + trials * n
    sessions: dict[str, Session] = {}
    try:
        for mode in modes:
            sessions[mode] = Session(mode, f"{tag}_{mode[:3]}", tmp, args, rooms=rooms, tower=tower,
                                     device_s=device_s, grids=grids, tower_config=tower_config)
        for s in sessions.values():
            s.warmup(warmup, args.window)
        order = list(sessions.values())
        block = 25
        for k in range(0, latency, block):
            for s in (order if (k // block) % 2 == 0 else order[::-1]):
                s.latency(min(block, latency - k))
        extra = between(sessions) if between is not None else None
        for t in range(trials):
            for s in (order if t % 2 == 0 else order[::-1]):
                s.trial(n, args.window)
        out = {mode: s.finish() for mode, s in sessions.items()}
        if extra is not None:
            for r in out.values():
                r["between"] = extra
        return out
    finally:
        for s in sessions.values():
            s.close()


def run_replicas(tmp: str, args, *, n: int, trials: int, warmup: int) -> dict:
    """The pipeline with one tower replica and with two (replicas scenario), alive together,
    the measured runs alternating (ABBA...) as run_pair's."""
    sessions: dict[int, Session] = {}
    try:
        for k in (1, 2):
            sessions[k] = Session("pipeline", f"rep{k}", tmp, args, rooms=warmup + trials * n, tower="sim",
                                  device_s=REPLICAS_DEVICE_S, grids=(SMALL_GRID,),
                                  config={"tower_replicas": k, "max_items_per_batch": 4})
        for s in sessions.values():
            s.warmup(warmup, args.window)
        order = list(sessions.values())
        for t in range(trials):
            for s in (order if t % 2 == 0 else order[::-1]):
                s.trial(n, args.window)
        return {k: s.finish() for k, s in sessions.items()}
    finally:
        for s in sessions.values():
            s.close()


def load_sweep(tmp: str, args, windows: list[int], n: int) -> dict:
    """images/s of both modes (cpu-bound settings) at each number of rooms in flight,
    alternating the modes at each point as run_pair does."""
    print(f"load: device {CPU_DEVICE_S * 1e3:.1f} ms/image, {n} images per point, rooms in flight "
          f"{windows}", flush=True)
    # steady_rate leaves out the first and last `window` completions of each point
    counts = [max(n, 4 * w) for w in windows]
    out = {"windows": windows, "images_per_point": counts, "inprocess": [], "pipeline": []}
    warm = 2 * max(windows)
    sessions: dict[str, Session] = {}
    try:
        for mode in ("inprocess", "pipeline"):
            sessions[mode] = Session(mode, f"load_{mode[:3]}", tmp, args, rooms=warm + sum(counts),
                                     tower="sim", device_s=CPU_DEVICE_S, grids=[GRID])
        for s in sessions.values():
            s.warmup(warm, max(windows))
        order = list(sessions.values())
        for k, w in enumerate(windows):
            for s in (order if k % 2 == 0 else order[::-1]):
                s.trial(counts[k], w)
                out[s.mode].append(s.res["trials"][-1]["images_per_s"])
            print(f"  {w:>3} in flight: inprocess {out['inprocess'][-1]:7.1f}, pipeline "
                  f"{out['pipeline'][-1]:7.1f} images/s (ratio "
                  f"{out['pipeline'][-1] / max(out['inprocess'][-1], 1e-9):.2f})", flush=True)
        out["raw"] = {mode: s.finish() for mode, s in sessions.items()}
    finally:
        for s in sessions.values():
            s.close()
    return out


def steady_rate(done_at: list[float], skip: int) -> float:
    """Completions per second: least-squares slope of index against time, `skip` left
    out at both ends (fill and drain of the window)."""
    ts = sorted(done_at)
    if len(ts) < 4 * skip:  # too few to leave both ends out: the whole run
        skip = 0
    ts = ts[skip:len(ts) - skip]
    n = len(ts)
    if n < 2:
        return 0.0
    mt = sum(ts) / n
    mi = (n - 1) / 2
    var = sum((t - mt) ** 2 for t in ts)
    cov = sum((t - mt) * (i - mi) for i, t in enumerate(ts))
    return cov / var if var > 0 else 0.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def make_config(prefix: str, tmp: str, tag: str, *, rooms: int, tower: str, device_s: float,
                args, grid=GRID, tower_config: str = "tiny", **settings) -> "WorkerConfig":
    """`settings`: more WorkerConfig fields, over the benchmark's."""
    from pipeline.config import WorkerConfig
    from tests.helpers import free_port

    run_dir = os.path.join(tmp, tag)
    over = dict(shm_prefix=prefix, intake=f"ipc://{run_dir}/intake.sock", run_dir=run_dir,
                bootstrap=f"tcp://127.0.0.1:{free_port()}",
                pixel_arena_bytes=args.pixel_arena_mib * MIB,
                embedding_arena_bytes=args.embedding_arena_mib * MIB,
                arena_cache_bytes=args.arena_cache_mib * MIB, host_cache_bytes=args.host_cache_mib * MIB,
                max_live_rooms=rooms + 64, max_tombstones=rooms + 64)
    if tower == "sim":
        over.update(tower="sim", sim_hidden=HIDDEN, sim_dtype=DTYPE, sim_deepstack_width=0,
                    sim_time_per_row_s=device_s / (grid[0] * grid[1] * grid[2] // 4))
    else:
        over.update(tower="qwen2.5-vl", tower_config=tower_config)
    return WorkerConfig(**over, **settings)


def _unlink_pixels(prefix: str) -> None:
    """Pixel segments a killed client left (named /<prefix>.px.<pid>.<n>: not swept by shm.sweep)."""
    from ipc import shm

    for entry in os.listdir(shm.SHM_DIR):
        if entry.startswith(prefix + ".px."):
            try:
                os.unlink(os.path.join(shm.SHM_DIR, entry))
            except FileNotFoundError:
                pass


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return str(x)


# ============================================================ baselines, each in a child process
def in_child(fn, *args, timeout: float = 600.0):
    """fn(*args) in a fresh spawned process: nothing of this one (threads, loaded
    libraries, CPU time) enters the measurement; its result or its error."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_call, args=(child, fn, args))  # not daemonic: it may start its own
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise RuntimeError(f"{fn.__name__} gave no answer in {timeout:.0f} s")
        ok, value = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    if not ok:
        raise RuntimeError(f"{fn.__name__} failed in its child process: {value}")
    return value


def _child_call(conn, fn, args) -> None:
    try:
        value = (True, fn(*args))
    except BaseException as e:  # reported to the parent, which raises
        value = (False, f"{type(e).__name__}: {e}")
    conn.send(value)


def hops_on_fresh_path() -> int:
    """Ring hops of a fresh encode's critical path, each checked to be a ring of the wiring."""
    from pipeline.wiring import EDGES

    steps = list(zip(FRESH_ENCODE_PATH, FRESH_ENCODE_PATH[1:]))
    missing = [s for s in steps if s not in EDGES]
    if missing:
        raise RuntimeError(f"FRESH_ENCODE_PATH has steps that are no ring in pipeline/wiring.py: {missing}")
    return len(steps)


def raw_semaphore_wake(quick: bool) -> dict:
    """benchmarks/ring.py's wake measurement (run in a child: it forks its own);
    its raw figures, among them the one-way wake of a sleeper on a bare semaphore."""
    import contextlib
    import importlib.util
    import io

    from ipc import shm

    spec = importlib.util.spec_from_file_location("bench_ring", os.path.join(ROOT, "benchmarks", "ring.py"))
    ring = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ring)
    shm.sweep(ring.PREFIX)
    lock = shm.RunLock(ring.PREFIX)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its own report; the figures are returned
            r = ring.bench_latency(lock.run_id, quick)
    finally:
        shm.sweep(ring.PREFIX, lock.run_id, include_live=True)
        lock.release()
    return r["raw"]


def raw_intake_read(prefix: str, nbytes: int, n: int, hashed: bool = False) -> dict:
    """The least a process can spend taking a client's segment: segments made as the
    gateway makes them (Client.publish), then, timed, each opened, fstat'ed, read with
    preadv into a resident buffer, unlinked and closed (the last close frees its pages).
    Process CPU (all threads) per image, in chunks so that /dev/shm holds few at once.
    `hashed`: each piece also hashed as it lands, as the intake stage does (its READ_PIECE)."""
    import numpy as np

    from ipc import shm
    from ipc.wire import content_hasher
    from pipeline.client import Client, unlink_segment
    from stages.intake import READ_PIECE

    client = Client(f"ipc://{tempfile.gettempdir()}/epd-bench-nobody.sock", prefix)
    px = np.random.default_rng(3).standard_normal(nbytes // 4, dtype=np.float32)
    buf = np.ones(nbytes, np.uint8)  # resident: every page touched
    view = memoryview(buf)
    cpu = wall = 0.0
    done = 0
    names: list[str] = []
    try:
        while done < n:
            names = [client.publish(px) for _ in range(min(64, n - done))]
            c0, t0 = time.process_time(), time.perf_counter()
            for name in names:
                path = os.path.join(shm.SHM_DIR, name[1:])
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                size = os.fstat(fd).st_size
                os.unlink(path)
                got = 0
                if hashed:
                    h = content_hasher("image", [(1, 1, 1)], "float32")
                    while got < size:
                        k = os.preadv(fd, [view[got:min(size, got + READ_PIECE)]], got)
                        h.update(view[got:got + k])
                        got += k
                    h.intdigest()
                else:
                    while got < size:
                        got += os.preadv(fd, [view[got:size]], got)
                os.close(fd)
            cpu += time.process_time() - c0
            wall += time.perf_counter() - t0
            done += len(names)
            names = []
    finally:
        for name in names:
            unlink_segment(name)
        client.close()
    return {"images": done, "bytes": nbytes, "cpu_ms_per_image": cpu * 1000 / done,
            "wall_ms_per_image": wall * 1000 / done}


def scheduler_batches(grids: list, n: int, merge: int, max_tokens: int, max_items: int) -> list[list[tuple]]:
    """The batches the scheduler forms from n images (grids cycled as the client does)
    all waiting at once: its own packing (stages/scheduler.py) on the same queue."""
    from stages.scheduler import Pending, Scheduler

    sched = Scheduler(max_tokens, max_items)
    for room in range(n):
        g = tuple(grids[room % len(grids)])
        sched.add(Pending(room, room, 0, g[0] * g[1] * g[2] // merge ** 2, g))
    out = []
    while sched:
        out.append([p.payload for p in sched.next_batch()])
    return out


def _spin(stop) -> None:
    """A pure-Python loop: work on another core that touches next to no memory."""
    x = 0
    while not stop.is_set():
        for i in range(10000):
            x += i


def tower_alone(cfg_kwargs: dict, grids: list, n: int, trials: int, seed: int, busy_neighbour: bool = False) -> dict:
    """The worker's tower (built as the tower stage builds it: build_tower(cfg.tower,
    **cfg.tower_settings())) on the scheduler's batches of n images, one
    start(...).result() after another in this one process, outs in one buffer
    registered with the device as the embedding arena is; images/s, best of trials.
    `busy_neighbour`: while a second process spins a Python loop (another core busy with
    work that shares nothing with the tower, as the other stages are in a pipeline)."""
    import mmap

    import numpy as np

    from pipeline.config import WorkerConfig
    from stages.towers import TowerItem, build_tower

    cfg = WorkerConfig(**cfg_kwargs)
    tower = build_tower(cfg.tower, **cfg.tower_settings())
    spec = tower.spec
    batches = scheduler_batches(grids, n, spec.merge, cfg.max_tokens_per_batch, cfg.max_items_per_batch)
    most = max(sum(g[0] * g[1] * g[2] // spec.merge ** 2 for g in b) for b in batches)
    # page-aligned and resident, as the embedding arena is
    out_buf = np.frombuffer(mmap.mmap(-1, most * spec.row_bytes), spec.np_dtype)
    out_buf.fill(0)
    tower.register_host_memory(out_buf.ctypes.data, out_buf.nbytes)  # False (nothing) on CPU
    rng = np.random.default_rng(seed)
    pixels = {tuple(g): rng.standard_normal((g[0] * g[1] * g[2], spec.patch_dim), dtype=np.float32)
              for g in grids}
    def run(batch) -> None:
        items, outs, row = [], [], 0
        for g in batch:
            span = g[0] * g[1] * g[2] // spec.merge ** 2
            # one array per grid: a forward's time does not depend on the values
            items.append(TowerItem("image", [list(g)], pixels[g]))
            main = out_buf[row * spec.hidden:(row + span) * spec.hidden].reshape(span, spec.hidden)
            outs.append((main, None))
            row += span
        tower.start(items, outs).result()

    for batch in batches[:3]:  # warm-up
        run(batch)
    rates = []
    spinner = stop = None
    if busy_neighbour:
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        spinner = ctx.Process(target=_spin, args=(stop,), daemon=True)
        spinner.start()
        time.sleep(0.5)  # started and spinning
    try:
        for _ in range(trials):
            t0 = time.perf_counter()
            for batch in batches:
                run(batch)
            rates.append(n / (time.perf_counter() - t0))
    finally:
        if spinner is not None:
            stop.set()
            spinner.join(5)
    tower.close()
    return {"images_per_s": max(rates), "trials": rates, "images": n, "batches": len(batches),
            "items_per_batch": n / len(batches)}


# ============================================================ report
def _verdict(key: str, value) -> str:
    if value is None:
        return "not measured"
    op, target = TARGETS[key]
    ok = value >= target if op == ">=" else value <= target
    return f"(target {op} {target}: {'met' if ok else 'MISSED'})"


def _cpu_line(trial: dict) -> str:
    sys_ = trial["cpu_sys_ms_per_image"]
    return ", ".join(f"{k} {v:.2f} ({sys_[k]:.2f} sys)" for k, v in trial["cpu_ms_per_image"].items())


def _describe(r: dict) -> str:
    s = (f"  {r['mode']:<9}  {r.get('images_per_s', 0.0):7.1f} images/s")
    if r.get("trials"):
        s += "  (trials " + ", ".join(f"{t['images_per_s']:.1f}" for t in r["trials"]) + ";"
        s += " end-to-end " + ", ".join(f"{t['images_per_s_end_to_end']:.1f}" for t in r["trials"]) + ")"
    s += f"  peak RSS {r['peak_rss_mib']:.0f} MiB, PSS {r['peak_pss_mib']:.0f} MiB, start {r.get('start_s', 0):.1f} s"
    if r.get("trials"):
        s += f"\n             cpu ms/image: {_cpu_line(r['trials'][r['best_trial']])}"
    return s


def pair_figures(key: str, scenario: str, inp: dict, pip: dict, between: dict, hops: int, results: dict) -> None:
    """The throughput, CPU, latency and intake figures of one sim-tower pair of runs;
    `key` is the prefix of its JSON keys ("" or "small_")."""
    ratio = pip["images_per_s"] / inp["images_per_s"]
    results[f"{key}pipeline_vs_inprocess_throughput"] = ratio
    print(f"{key}pipeline_vs_inprocess_throughput = {pip['images_per_s']:.1f} / {inp['images_per_s']:.1f} "
          f"= {ratio:.2f}  {_verdict(f'{key}pipeline_vs_inprocess_throughput', ratio)}", flush=True)
    # What the cores allow: all CPU per image (worker, Mooncake's threads, the client)
    # of the in-process run, spread perfectly over every core.
    cores = len(os.sched_getaffinity(0))
    ti, tp = inp["trials"][inp["best_trial"]], pip["trials"][pip["best_trial"]]
    cpu_i, cpu_p = sum(ti["cpu_ms_per_image"].values()), sum(tp["cpu_ms_per_image"].values())
    client = "client (gateway + receiver)"
    worker_i, worker_p = cpu_i - ti["cpu_ms_per_image"][client], cpu_p - tp["cpu_ms_per_image"][client]
    ceiling = cores * 1000.0 / cpu_i
    results[f"{key}cpu_ms_per_image_all_processes"] = {"inprocess": cpu_i, "pipeline": cpu_p}
    results["cores"] = cores
    results[f"{key}pipeline_vs_inprocess_throughput_ceiling"] = ceiling / inp["images_per_s"]
    print(f"  CPU per image, all processes (client included): inprocess {cpu_i:.3f} ms, pipeline "
          f"{cpu_p:.3f} ms; {cores} cores busy at the in-process cost would give {ceiling:.0f} "
          f"images/s = {ceiling / inp['images_per_s']:.2f}x in-process (the most any split "
          f"of the same work can reach here)", flush=True)
    cpu_ratio = cpu_p / cpu_i
    results[f"{key}pipeline_cpu_per_image_vs_inprocess"] = cpu_ratio
    results[f"{key}pipeline_cpu_per_image_vs_inprocess_worker_only"] = worker_p / worker_i
    print(f"{key}pipeline_cpu_per_image_vs_inprocess = {cpu_p:.3f} / {cpu_i:.3f} = {cpu_ratio:.2f}  "
          f"{_verdict(f'{key}pipeline_cpu_per_image_vs_inprocess', cpu_ratio)}   (the worker alone, "
          f"client left out: {worker_p:.3f} / {worker_i:.3f} = {worker_p / worker_i:.2f})", flush=True)
    lp, li = pip["latency_ms"], inp["latency_ms"]
    added = lp["p50"] - li["p50"]
    wake_ms = between["wake"]["raw_semaphore_one_way_p50_us"] / 1000
    floor = hops * wake_ms
    results[f"{key}added_latency_ms_p50"] = added
    results[f"{key}raw_semaphore_one_way_wake_us_p50"] = wake_ms * 1000
    results[f"{key}added_latency_vs_hop_floor"] = added / floor
    print(f"latency one at a time, ms p50/p90/p99: inprocess {li['p50']:.3f}/{li['p90']:.3f}/"
          f"{li['p99']:.3f}, pipeline {lp['p50']:.3f}/{lp['p90']:.3f}/{lp['p99']:.3f}")
    print(f"  {key}added_latency_ms_p50 = {lp['p50']:.3f} - {li['p50']:.3f} = {added:.3f} ms; hop floor = "
          f"{hops} hops x raw one-way semaphore wake p50 {wake_ms * 1000:.1f} us = {floor:.3f} ms")
    label = "added_latency_vs_hop_floor"
    print(f"{key}{label} = {added:.3f} / {floor:.3f} = {added / floor:.2f}  "
          f"{_verdict(key + label, added / floor) if key + label in TARGETS else '(no target)'}", flush=True)
    intake = tp["cpu_ms_per_image"].get("intake")
    read = between["intake_read"]["cpu_ms_per_image"]
    if intake is not None:
        label = "intake_cpu_vs_raw_read"
        results[f"{key}intake_cpu_ms_per_image"] = intake
        results[f"{key}raw_read_cpu_ms_per_image"] = read
        results[f"{key}{label}"] = intake / read
        print(f"{key}{label} = {intake:.3f} / {read:.3f} = {intake / read:.2f}  "
              f"{_verdict(key + label, intake / read) if key + label in TARGETS else '(no target)'}   "
              f"(intake process CPU per image / open+preadv+unlink+close of a {scenario} segment "
              f"into a resident buffer, one process)", flush=True)
        # Intake also hashes the pixels as it reads them (the cache stage used to read them
        # again for that): the same floor with the hash taken the same way.
        read_hash = between["intake_read_hash"]["cpu_ms_per_image"]
        results[f"{key}raw_read_hash_cpu_ms_per_image"] = read_hash
        results[f"{key}intake_cpu_vs_raw_read_and_hash"] = intake / read_hash
        print(f"  {key}intake_cpu_vs_raw_read_and_hash = {intake:.3f} / {read_hash:.3f} = "
              f"{intake / read_hash:.2f}  (no target; the floor above, each piece hashed as it lands)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer images (under ~4 minutes)")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--window", type=int, default=64, help="rooms in flight at the receiver")
    ap.add_argument("--scenarios", default="cpu,small,device,tiny,replicas",
                    help="comma-separated subset of cpu, small, device, tiny, replicas (device needs cpu), and load: "
                         "images/s of both modes at each of --load-windows rooms in flight (not by default)")
    ap.add_argument("--load-windows", default="1,2,4,8,16,32,64",
                    help="rooms in flight for the load scenario (default %(default)s; at most --window)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--images", type=int, help="measured images per trial (overrides the defaults)")
    ap.add_argument("--trials", type=int, help="measured runs per mode (overrides the defaults)")
    ap.add_argument("--pixel-arena-mib", type=int, default=512)
    ap.add_argument("--embedding-arena-mib", type=int, default=256)
    ap.add_argument("--arena-cache-mib", type=int, default=8)
    ap.add_argument("--host-cache-mib", type=int, default=64)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="intra-op threads of the tiny Qwen tower, both modes (0: torch's default)")
    args = ap.parse_args(argv)
    scenarios = set(args.scenarios.split(","))
    if "device" in scenarios:
        scenarios.add("cpu")

    def on_term(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    q = args.quick
    n_cpu, trials_cpu = (300, 2) if q else (500, 4)
    n_small, trials_small = (2000, 2) if q else (5000, 4)
    n_dev, trials_dev = (300, 1) if q else (500, 2)
    n_tiny, trials_tiny = (300, 1) if q else (600, 2)
    n_rep, trials_rep = (300, 1) if q else (600, 2)
    n_lat = 100 if q else 400
    if args.images:
        n_cpu = n_small = n_dev = n_tiny = n_rep = args.images
    if args.trials:
        trials_cpu = trials_small = trials_dev = trials_tiny = trials_rep = args.trials
    warm = 2 * args.window
    hops = hops_on_fresh_path()
    tmp = tempfile.mkdtemp(prefix="epd-bench-")
    t_start = time.monotonic()
    results: dict = {"quick": q, "window": args.window, "image_bytes": GRID[1] * GRID[2] * 1176 * 4,
                     "embedding_bytes": (GRID[1] * GRID[2] // 4) * HIDDEN * 2,
                     "small_image_bytes": SMALL_GRID[1] * SMALL_GRID[2] * 1176 * 4,
                     "small_embedding_bytes": (SMALL_GRID[1] * SMALL_GRID[2] // 4) * HIDDEN * 2,
                     "hops_on_fresh_encode_path": hops, "fresh_encode_path": list(FRESH_ENCODE_PATH),
                     "cpu_count": os.cpu_count()}
    raw: dict = {}

    def floors(grid: tuple, n_read: int):
        """The hop and intake baselines, measured while both workers of the pair are up and idle."""
        nbytes = grid[0] * grid[1] * grid[2] * 1176 * 4

        def between(_sessions) -> dict:
            return {"wake": in_child(raw_semaphore_wake, q),
                    "intake_read": in_child(raw_intake_read, f"bench_{os.getpid()}_rd", nbytes, n_read),
                    "intake_read_hash": in_child(raw_intake_read, f"bench_{os.getpid()}_rh", nbytes, n_read, True)}
        return between

    try:
        if "cpu" in scenarios:
            print(f"cpu-bound: {GRID}, device {CPU_DEVICE_S * 1e3:.1f} ms/image, {n_cpu} images x {trials_cpu} "
                  f"trials per mode, window {args.window}; latency: {n_lat} images one at a time", flush=True)
            pair = run_pair("cpu", tmp, args, device_s=CPU_DEVICE_S, n=n_cpu, trials=trials_cpu,
                            warmup=warm, latency=n_lat, between=floors(GRID, 300 if q else 1000))
            for mode, r in pair.items():
                raw[f"cpu_bound_{mode}"] = r
                print(_describe(r), flush=True)
            pair_figures("", "4.8 MB", raw["cpu_bound_inprocess"], raw["cpu_bound_pipeline"],
                         pair["pipeline"]["between"], hops, results)
        if "small" in scenarios:
            print(f"small: {SMALL_GRID}, device {SMALL_DEVICE_S * 1e3:.2f} ms/image, {n_small} images x "
                  f"{trials_small} trials per mode, window {args.window}; latency: {n_lat} images one at a "
                  f"time", flush=True)
            pair = run_pair("small", tmp, args, device_s=SMALL_DEVICE_S, grids=(SMALL_GRID,), n=n_small,
                            trials=trials_small, warmup=warm, latency=n_lat,
                            between=floors(SMALL_GRID, 3000 if q else 10000))
            for mode, r in pair.items():
                raw[f"small_{mode}"] = r
                print(_describe(r), flush=True)
            pair_figures("small_", "75 KB", raw["small_inprocess"], raw["small_pipeline"],
                         pair["pipeline"]["between"], hops, results)
        if "device" in scenarios:
            inp = raw["cpu_bound_inprocess"]
            cost = max(1e-4, 1.0 / inp["images_per_s"] - CPU_DEVICE_S)
            device_s = DEVICE_FACTOR * cost
            ceiling = 1.0 / device_s
            results["inprocess_cpu_ms_per_image"] = cost * 1000
            results["device_bound_device_ms_per_image"] = device_s * 1000
            results["device_bound_ceiling_images_per_s"] = ceiling
            print(f"device-bound: in-process CPU cost {cost * 1e3:.2f} ms/image -> device "
                  f"{device_s * 1e3:.2f} ms/image, ceiling {ceiling:.1f} images/s; {n_dev} images x "
                  f"{trials_dev} trials per mode", flush=True)
            pair = run_pair("dev", tmp, args, modes=("pipeline", "inprocess"), device_s=device_s, n=n_dev,
                            trials=trials_dev, warmup=warm)
            for mode, r in pair.items():
                raw[f"device_bound_{mode}"] = r
                print(_describe(r), flush=True)
            pip, inp = raw["device_bound_pipeline"], raw["device_bound_inprocess"]
            ratio = pip["images_per_s"] / ceiling
            results["pipeline_vs_device_bound"] = ratio
            results["inprocess_vs_device_bound"] = inp["images_per_s"] / ceiling
            print(f"pipeline_vs_device_bound = {pip['images_per_s']:.1f} / {ceiling:.1f} = {ratio:.2f}  "
                  f"{_verdict('pipeline_vs_device_bound', ratio)}   (inprocess: "
                  f"{results['inprocess_vs_device_bound']:.2f}, no target)", flush=True)
        if "replicas" in scenarios:
            print(f"replicas: {SMALL_GRID}, device {REPLICAS_DEVICE_S * 1e3:.0f} ms/image (a sleep), at most 4 "
                  f"images per batch; the pipeline with 1 and with 2 tower replicas, {n_rep} images x "
                  f"{trials_rep} trials each, window {args.window}", flush=True)
            pair = run_replicas(tmp, args, n=n_rep, trials=trials_rep, warmup=warm)
            for k, r in pair.items():
                raw[f"replicas{k}_pipeline"] = r
                print(f"  tower_replicas {k}:\n{_describe(r)}", flush=True)
            one, two = pair[1]["images_per_s"], pair[2]["images_per_s"]
            ratio = two / one
            results["replicas2_vs_one_device_bound"] = ratio
            results["replicas_device_ceiling_images_per_s"] = {k: k / REPLICAS_DEVICE_S for k in pair}
            print(f"replicas2_vs_one_device_bound = {two:.1f} / {one:.1f} = {ratio:.2f}  "
                  f"{_verdict('replicas2_vs_one_device_bound', ratio)}   (device ceilings "
                  f"{1 / REPLICAS_DEVICE_S:.0f} and {2 / REPLICAS_DEVICE_S:.0f} images/s)", flush=True)
        if "load" in scenarios:
            windows = [int(w) for w in args.load_windows.split(",")]
            if max(windows) > args.window:
                ap.error(f"--load-windows: {max(windows)} is more than --window {args.window}")
            n_load = args.images or (80 if q else 150)
            results["load"] = load_sweep(tmp, args, windows, n_load)
            for mode, r in results["load"].pop("raw").items():
                raw[f"load_{mode}"] = r
        if "tiny" in scenarios:
            print(f"tiny Qwen2.5-VL tower: grid {TINY_GRID}, {n_tiny} images x {trials_tiny} trials "
                  f"per mode, torch threads {args.torch_threads or 'default'}; the tower alone on the "
                  f"scheduler's batches of the same images, one process", flush=True)
            tiny = {"torch_threads": args.torch_threads or "default"}
            if args.torch_threads:
                # Read when torch loads, in the worker processes (spawned after this).
                os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.torch_threads)

            def alone(sessions) -> dict:
                cfg = dataclasses.asdict(sessions["pipeline"].cfg)
                return {"tower_alone": in_child(tower_alone, cfg, [TINY_GRID], n_tiny, max(2, trials_tiny),
                                                args.seed),
                        "tower_alone_busy_neighbour": in_child(tower_alone, cfg, [TINY_GRID], n_tiny,
                                                               max(2, trials_tiny), args.seed, True)}

            pair = run_pair("tiny", tmp, args, tower="qwen", grids=(TINY_GRID,), n=n_tiny, trials=trials_tiny,
                            warmup=warm, between=alone)
            for mode, r in pair.items():
                raw[f"tiny_qwen_{mode}"] = r
                tiny[f"{mode}_images_per_s"] = r["images_per_s"]
                print(_describe(r), flush=True)
            tiny["pipeline_vs_inprocess"] = tiny["pipeline_images_per_s"] / tiny["inprocess_images_per_s"]
            ta = pair["pipeline"]["between"]["tower_alone"]
            tiny["tower_alone"] = ta
            results["tiny_qwen"] = tiny
            ratio = tiny["pipeline_images_per_s"] / ta["images_per_s"]
            results["tiny_pipeline_vs_tower_alone"] = ratio
            results["tiny_inprocess_vs_tower_alone"] = tiny["inprocess_images_per_s"] / ta["images_per_s"]
            formed = ", ".join(
                f"{m} {t['tower_items'] / max(1, t['tower_batches']):.1f}"
                for m, t in ((m, raw[f"tiny_qwen_{m}"]["trials"][raw[f"tiny_qwen_{m}"]["best_trial"]])
                             for m in ("inprocess", "pipeline")) if "tower_batches" in t)
            print(f"tiny qwen images/s: inprocess {tiny['inprocess_images_per_s']:.1f}, pipeline "
                  f"{tiny['pipeline_images_per_s']:.1f} (ratio {tiny['pipeline_vs_inprocess']:.2f}); tower "
                  f"alone {ta['images_per_s']:.1f} (trials {', '.join(f'{x:.1f}' for x in ta['trials'])}; "
                  f"{ta['items_per_batch']:.1f} images per batch; the runs formed {formed})", flush=True)
            busy = pair["pipeline"]["between"]["tower_alone_busy_neighbour"]
            tiny["tower_alone_busy_neighbour"] = busy
            results["tiny_tower_alone_busy_neighbour_vs_alone"] = busy["images_per_s"] / ta["images_per_s"]
            print(f"  the tower alone while another process spins a Python loop (the other core busy, "
                  f"nothing shared): {busy['images_per_s']:.1f} images/s = "
                  f"{results['tiny_tower_alone_busy_neighbour_vs_alone']:.2f} of alone (no target: what any "
                  f"work beside the forward costs it on this machine)", flush=True)
            print(f"tiny_pipeline_vs_tower_alone = {tiny['pipeline_images_per_s']:.1f} / {ta['images_per_s']:.1f} "
                  f"= {ratio:.2f}  {_verdict('tiny_pipeline_vs_tower_alone', ratio)}   (inprocess: "
                  f"{results['tiny_inprocess_vs_tower_alone']:.2f}, no target)", flush=True)
    except Exception as e:  # the figures measured so far still go to the JSON
        import traceback

        traceback.print_exc()
        results["error"] = f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    peak, peak_pss = {}, {}
    for key, r in raw.items():
        for mode in ("inprocess", "pipeline"):
            if key.endswith(mode):
                peak[mode] = max(peak.get(mode, 0.0), r["peak_rss_mib"])
                peak_pss[mode] = max(peak_pss.get(mode, 0.0), r["peak_pss_mib"])
    results["peak_rss_mib"] = peak
    results["peak_pss_mib"] = peak_pss
    results["peak_rss_mib_by_run"] = {k: r["peak_rss_mib"] for k, r in raw.items()}
    results["peak_pss_mib_by_run"] = {k: r["peak_pss_mib"] for k, r in raw.items()}
    print("peak resident memory, worker side (sum of RSS / PSS), MiB: " + ", ".join(
        f"{k} {r['peak_rss_mib']:.0f}/{r['peak_pss_mib']:.0f}" for k, r in raw.items()))
    failed = sum(r["failed_rooms"] + r["timed_out"] for r in raw.values())
    violations = sum(r["n_violations"] for r in raw.values())
    results["failed_rooms"] = failed
    results["violations"] = violations
    results["targets"] = {k: f"{op} {v}" for k, (op, v) in TARGETS.items()}
    results["targets_met"] = {k: (None if results.get(k) is None else
                                  (results[k] >= v if op == ">=" else results[k] <= v))
                              for k, (op, v) in TARGETS.items()}
    for k in TARGETS:
        results.setdefault(k, None)
    results["seconds"] = time.monotonic() - t_start
    results["raw"] = raw
    print("targets: " + ", ".join(
        f"{k} {'met' if ok else ('MISSED' if ok is False else 'not measured')}"
        for k, ok in results["targets_met"].items()) + f"  ({results['seconds']:.0f} s)")
    if failed or violations:
        print(f"FAILED rooms: {failed}, receiver protocol violations: {violations}")
        for key, r in raw.items():
            if r["failed_rooms"] or r["n_violations"] or r["timed_out"]:
                print(f"  {key}: {r['failed_rooms']} failed {r['failed_reasons']}, {r['timed_out']} "
                      f"timed out, violations {r['violations'][:3]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if results.get("error"):
        print(f"FAILED: {results['error']}")
    return 0 if not failed and not violations and not results.get("error") else 1


if __name__ == "__main__":
    sys.exit(main())
