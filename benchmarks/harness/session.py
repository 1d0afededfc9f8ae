"""A benchmark's worker and client: a Session is one fresh worker (its own shm prefix and
process tree) with its client process; run_pair measures two alive together, their runs
alternating, so a change in the shared machine's load meets both."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import statistics

from benchmarks.harness.client import MIB, PHASE_TIMEOUT_S, client_main
from benchmarks.harness.report import pct, steady_rate
from benchmarks.harness.worker import Sampler, host_main

HIDDEN, DTYPE = 3584, "bfloat16"


class Session:
    """One fresh worker (own shm prefix, process tree) and its client process."""

    def __init__(self, mode: str, tag: str, tmp: str, args, *, rooms: int, tower: str, device_s: float,
                 grids: list, tower_config: str = "tiny", config: dict | None = None,
                 client=client_main, endpoints: tuple[str, str] | None = None):
        """`client`: the client process's entry point (client_main's signature), given
        `endpoints` (intake, bootstrap) in place of the worker's native ones if set."""
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
        self.host_conn = self.client_conn = None
        ctx = mp.get_context("spawn")
        try:
            self.host_conn, child = ctx.Pipe()
            self.host = ctx.Process(target=host_main, name=f"bench-{mode}",
                                    args=(child, mode, dataclasses.asdict(cfg)), daemon=False)
            self.host.start()
            child.close()
            kind, info = self.recv(self.host_conn, cfg.start_timeout_s + 60, "the worker to start")
            if kind != "ready":
                raise RuntimeError(f"the {mode} worker could not start: {info}")
            self.res["start_s"] = info["start_s"]
            self.sampler = Sampler(self.host.pid)
            self.sampler.start()
            self.client_conn, child = ctx.Pipe()
            intake, bootstrap = endpoints or (info["intake"], info["bootstrap"])
            self.client = ctx.Process(target=client, name="bench-client", daemon=True,
                                      args=(child, intake, self.prefix, bootstrap, info["spec"],
                                            self.grids, args.seed, args.window))
            self.client.start()
            child.close()
            self.recv(self.client_conn, 120, "the client process to start")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def recv(conn, timeout: float, what: str):
        if not conn.poll(timeout):
            raise RuntimeError(f"timed out waiting for {what}")
        return conn.recv()

    def worker(self, cmd: str):
        self.host_conn.send(cmd)
        return self.recv(self.host_conn, 60, f"the worker's {cmd}")

    def run(self, kind: str, n: int, *extra) -> dict:
        self.client_conn.send((kind, self.room, n, *extra))
        _, out = self.recv(self.client_conn, PHASE_TIMEOUT_S + 120, f"the client's {kind} run")
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
        # the batches the scheduler formed, for a model tower (a stats read waits for the stages to publish)
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
            for conn, proc in ((self.client_conn, self.client), (self.host_conn, self.host)):
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
            unlink_pixels(self.prefix)


def run_pair(tag: str, tmp: str, args, *, modes=("inprocess", "pipeline"), tower: str = "sim",
             device_s: float = 0.0, grids, n: int, trials: int, warmup: int, latency: int = 0,
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


def make_config(prefix: str, tmp: str, tag: str, *, rooms: int, tower: str, device_s: float,
                args, grid, tower_config: str = "tiny", **settings):
    """The WorkerConfig of a benchmark's worker; `settings`: more fields, over the benchmark's."""
    from pipeline.testing.workers import worker_config

    run_dir = os.path.join(tmp, tag)
    over = dict(pixel_arena_bytes=args.pixel_arena_mib * MIB,
                embedding_arena_bytes=args.embedding_arena_mib * MIB,
                arena_cache_bytes=args.arena_cache_mib * MIB, host_cache_bytes=args.host_cache_mib * MIB,
                max_live_rooms=rooms + 64, max_tombstones=rooms + 64)
    if tower == "sim":
        over.update(tower="sim", sim_hidden=HIDDEN, sim_dtype=DTYPE, sim_deepstack_width=0,
                    sim_time_per_row_s=device_s / (grid[0] * grid[1] * grid[2] // 4))
    else:
        over.update(tower="qwen2.5-vl", tower_config=tower_config)
    return worker_config(prefix, run_dir, **over, **settings)


def unlink_pixels(prefix: str) -> None:
    """Pixel segments a killed client left (named /<prefix>.px.<pid>.<n>: not swept by shm.sweep)."""
    from ipc import shm

    for entry in os.listdir(shm.SHM_DIR):
        if entry.startswith(prefix + ".px."):
            try:
                os.unlink(os.path.join(shm.SHM_DIR, entry))
            except FileNotFoundError:
                pass
