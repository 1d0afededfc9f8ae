"""The client process of a benchmark: the gateway and the prefill receiver in one
process, apart from the worker and from the orchestrating parent, so nothing of the
benchmark's shares a GIL with the in-process worker. It publishes the pixels, sends the
encode messages, allocs each room's item as it announces it, keeps a window of rooms in
flight and takes the times."""
from __future__ import annotations

import os
import resource
import time

PHASE_TIMEOUT_S = 300.0
MIB = 1 << 20


def cpu_s() -> tuple[float, float]:
    """(user + system, system) CPU seconds of this process so far."""
    t = resource.getrusage(resource.RUSAGE_SELF)
    return t.ru_utime + t.ru_stime, t.ru_stime


class BenchClient:
    """Room r sends one image of grid grids[r % len(grids)], its pixels distinct per room."""

    def __init__(self, intake: str, prefix: str, bootstrap: str, spec: dict, grids: list, seed: int,
                 window: int):
        import numpy as np

        from ipc import wire
        from pipeline.peers.client import Client
        from pipeline.peers.receiver import Receiver

        self.wire = wire
        self.grids = [tuple(g) for g in grids]
        self.spans = [g[0] * g[1] * g[2] // spec["merge"] ** 2 for g in self.grids]
        isz = wire.DTYPES[spec["dtype"]]
        item_bytes = max(self.spans) * (spec["hidden"] + spec["deepstack_width"]) * isz
        self.alloc_kw = dict(hidden=spec["hidden"], dtype=spec["dtype"], deepstack_width=spec["deepstack_width"])
        self.rx = Receiver("bench-rx", bootstrap, buffer_bytes=(window + 4) * ((item_bytes + 4095) & ~4095) + MIB)
        self.client = Client(intake, prefix)
        rng = np.random.default_rng(seed)
        self.bases = [rng.standard_normal((g[0] * g[1] * g[2], spec["patch_dim"]), dtype=np.float32)
                      for g in self.grids]
        self.published: list[str] = []

    def alloc(self, room: int) -> None:
        self.rx.alloc(room, 0, span=self.spans[room % len(self.grids)], **self.alloc_kw)

    def publish(self, room: int) -> bytes:
        from pipeline.peers.client import Item

        k = room % len(self.grids)
        base = self.bases[k]
        base[0, 0] = float(room)  # distinct pixels per room: no cache hits
        msg = self.client.message(room, f"bench-{room}", [Item("image", [list(self.grids[k])], base)])
        self.published.append(msg["items"][0]["pixels"]["shm"])
        return self.wire.encode(msg)

    def conclude(self, room: int, t: float, sent_at: dict, out: dict) -> None:
        out["done_at"].append(t)
        out["latency"].append(t - sent_at.pop(room))
        if room in self.rx.failed:
            out["failed"].append((room, self.rx.failed[room]))
        self.rx.release(room)

    def windowed(self, first: int, n: int, win: int) -> dict:
        """n rooms, `win` in flight; their pixels published before the clock starts (the
        gateway's copies are not the worker's cost)."""
        t_pub = time.monotonic()
        frames = [(room, self.publish(room)) for room in range(first, first + n)]
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
                self.client.send_raw(frame)
                self.alloc(room)
                outstanding.add(room)
            sts = self.rx.poll(0.05)
            t = time.monotonic()
            for st in sts:
                room = st.get("room")
                if room in outstanding and self.rx.concluded(room, 1):
                    outstanding.discard(room)
                    self.conclude(room, t, sent_at, out)
            if t > end:
                out["timed_out"] = n - len(out["done_at"])
                break
        out["t0"] = t0
        out["elapsed"] = time.monotonic() - t0
        c1 = cpu_s()
        out["client_cpu_s"] = (c1[0] - c0[0], c1[1] - c0[1])
        return out

    def one_at_a_time(self, first: int, n: int) -> dict:
        """n rooms, each sent once the one before concluded: latency without queueing."""
        out = {"done_at": [], "latency": [], "failed": []}
        sent_at: dict[int, float] = {}
        for room in range(first, first + n):
            frame = self.publish(room)
            sent_at[room] = time.monotonic()
            self.client.send_raw(frame)
            self.alloc(room)
            end = sent_at[room] + PHASE_TIMEOUT_S
            while not self.rx.concluded(room, 1):
                self.rx.poll(1.0)
                if time.monotonic() > end:
                    out["timed_out"] = 1
                    return out
            self.conclude(room, time.monotonic(), sent_at, out)
        return out

    def close(self) -> None:
        from pipeline.peers.client import unlink_segment

        for name in self.published:  # those the worker never took
            unlink_segment(name)
        self.client.close()
        self.rx.close()


def client_main(conn, intake: str, prefix: str, bootstrap: str, spec: dict, grids: list,
                seed: int, window: int) -> None:
    """Entry point of the client process (spawn); answers the parent's commands:
    ("windowed", first, n, window), ("latency", first, n), ("quit",)."""
    bench = BenchClient(intake, prefix, bootstrap, spec, grids, seed, window)
    me = os.getpid()
    try:
        conn.send(("ready", os.getpid()))
        while True:
            cmd = conn.recv()
            if cmd[0] == "quit":
                break
            if cmd[0] == "windowed":
                out = bench.windowed(*cmd[1:])
            elif cmd[0] == "latency":
                out = bench.one_at_a_time(*cmd[1:])
            else:
                raise ValueError(f"unknown command {cmd[0]!r}")
            out["violations"] = list(bench.rx.violations)
            bench.rx.violations = []
            conn.send(("result", out))
    finally:
        if os.getpid() == me:
            bench.close()
