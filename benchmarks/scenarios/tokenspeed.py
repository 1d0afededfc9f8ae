"""Scenario tokenspeed: the same images (cpu-bound's: grid 1x32x32, 4.8 MB of float32
pixels in shared memory, 256 rows out) through the tokenspeed fronts and through the
native protocol, two pipeline workers alive together, trials alternating (ABBA: each
round's two trials in the other order than the last's); each figure is the median over
rounds of the round's ratio, so that a burst of load from the machine's other users
moves one round, not the figure:
tokenspeed_front_vs_native_throughput = images/s through the fronts / natively;
tokenspeed_front_cpu_per_image_vs_native = CPU per image of every process, the same way.

The tokenspeed side is a client process of its own that speaks tokenspeed's wire as
tokenspeed 0.1.1 does (docs/tokenspeed.md): a gateway on smg's gRPC stubs, pixels in
`SharedMemory(create=True)` segments, each Encode a call in flight (its future); a
prefill rank that asks `/route` once, registers, PUSHes a 13-part pre-alloc per room
into Mooncake-registered memory and reads three-part status frames. (The tests check
the fronts against tokenspeed's own code; here only the fronts' cost is measured.)
"""
from __future__ import annotations

import json
import os
import statistics
import struct
import urllib.request

from benchmarks.harness.client import MIB, BenchClient
from benchmarks.harness.report import describe, print_ratio
from benchmarks.scenarios.common import CPU_DEVICE_S, GRID, Bench

KEY = "tokenspeed_front_vs_native_throughput"
CPU_KEY = "tokenspeed_front_cpu_per_image_vs_native"


def tokenspeed(b: Bench) -> None:
    from benchmarks.harness.session import Session
    from pipeline.runtime.background import free_port

    n, trials = b.size("tokenspeed")
    print(f"tokenspeed: {GRID}, device {CPU_DEVICE_S * 1e3:.1f} ms/image; pipeline workers, one fed through "
          f"the tokenspeed fronts and one natively, {n} images x {trials} trials each, window {b.args.window}",
          flush=True)
    grpc_at, http_at = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    rooms = b.warmup + trials * n
    sessions = {}
    try:
        sessions["native"] = Session("pipeline", "tsnat", b.tmp, b.args, rooms=rooms, tower="sim",
                                     device_s=CPU_DEVICE_S, grids=(GRID,))
        sessions["tokenspeed"] = Session("pipeline", "tsfront", b.tmp, b.args, rooms=rooms, tower="sim",
                                         device_s=CPU_DEVICE_S, grids=(GRID,), client=tokenspeed_client_main,
                                         endpoints=(grpc_at, http_at),
                                         config={"tokenspeed_grpc": grpc_at, "tokenspeed_bootstrap": http_at})
        for s in sessions.values():
            s.warmup(b.warmup, b.args.window)
        order = list(sessions.values())
        for t in range(trials):
            for s in (order if t % 2 == 0 else order[::-1]):
                s.trial(n, b.args.window)
        res = {k: s.finish() for k, s in sessions.items()}
    finally:
        for s in sessions.values():
            s.close()
    for k, r in res.items():
        b.raw[f"tokenspeed_{k}_pipeline"] = r
        print(f"  {k}:\n{describe(r)}", flush=True)
    rate = {k: [t["images_per_s"] for t in r["trials"]] for k, r in res.items()}
    cpu = {k: [sum(t["cpu_ms_per_image"].values()) for t in r["trials"]] for k, r in res.items()}
    for key, got, fmt, note in ((KEY, rate, ".1f", "images/s"),
                                (CPU_KEY, cpu, ".2f", "ms of CPU per image, every process")):
        ratios = [f / n for f, n in zip(got["tokenspeed"], got["native"])]
        b.results[f"{key}_rounds"] = ratios
        mid = ratios.index(statistics.median_low(ratios))
        print_ratio(key, got["tokenspeed"][mid], got["native"][mid], b.results, fmt=fmt,
                    note=f"  ({note}; the median round's of {len(ratios)}: {', '.join(f'{x:.2f}' for x in ratios)})")


class _Gateway:
    """tokenspeed's gateway, as BenchClient's `client`: send_raw(request) starts an Encode."""

    def __init__(self, endpoint: str):
        import grpc
        from smg_grpc_proto.generated import tokenspeed_encoder_pb2_grpc

        self.channel = grpc.insecure_channel(endpoint, options=[("grpc.max_send_message_length", 256 * MIB)])
        self.stub = tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderStub(self.channel)
        self.calls = []

    def send_raw(self, request) -> None:
        self.calls = [c for c in self.calls if not c.done()]
        self.calls.append(self.stub.Encode.future(request, timeout=300))

    def close(self) -> None:
        self.channel.close()


class _PrefillRank:
    """tokenspeed's prefill rank, as BenchClient's `rx`: memory registered with Mooncake,
    /route asked once, a registration, a pre-alloc per room, three-part status frames."""

    def __init__(self, bootstrap: str, slots: int, slot_bytes: int):
        import numpy as np
        import zmq

        from ipc.transport import Engine

        self.engine = Engine("127.0.0.1", "tcp")
        self.memory = np.zeros(slots * slot_bytes, dtype=np.uint8)
        self.engine.register(self.memory.ctypes.data, self.memory.nbytes)
        self.slot_bytes, self.free = slot_bytes, list(range(slots))
        self.slot_of: dict[int, int] = {}
        self.ctx = zmq.Context()
        self.status = self.ctx.socket(zmq.PULL)
        self.status_port = self.status.bind_to_random_port("tcp://127.0.0.1")
        layout = self._route(bootstrap, -1, -1)
        assert layout["prefill_tp_size"] == 1, layout
        rank = self._route(bootstrap, 0, 0)
        self.frames = self.ctx.socket(zmq.PUSH)
        self.frames.connect(f"tcp://{rank['rank_ip']}:{rank['rank_port']}")
        self.head = [b"127.0.0.1", str(self.status_port).encode(), self.engine.session.encode()]
        self.frames.send_multipart([b"None", *self.head, struct.pack("<Q", self.memory.ctypes.data), bytes(8)])
        self.done: set[int] = set()
        self.failed: dict[int, str] = {}
        self.violations: list[str] = []

    @staticmethod
    def _route(bootstrap: str, rank: int, group: int) -> dict:
        url = f"http://{bootstrap}/route?engine_rank={rank}&target_dp_group={group}"
        with urllib.request.urlopen(url, timeout=5) as reply:
            return json.loads(reply.read())

    def pre_alloc(self, room: int, span: int, hidden: int) -> None:
        slot = self.slot_of[room] = self.free.pop()
        dst = self.memory.ctypes.data + slot * self.slot_bytes
        self.frames.send_multipart([str(room).encode(), *self.head, struct.pack("<Q", dst), bytes(8),
                                    str(span).encode(), str(hidden).encode(), b"torch.bfloat16", b"0", b"1", b"0",
                                    str(span).encode()])

    def poll(self, timeout: float) -> list[dict]:
        import zmq

        out = []
        if self.status.poll(int(timeout * 1000)):
            while True:
                try:
                    parts = self.status.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(parts) != 3 or parts[1] not in (b"5", b"0") or not parts[0].isdigit():
                    self.violations.append(f"status frame {parts!r}")
                    continue
                room = int(parts[0])
                self.done.add(room)
                if parts[1] == b"0":
                    self.failed[room] = "0"
                out.append({"room": room})
        return out

    def concluded(self, room: int, _items: int) -> bool:
        return room in self.done

    def release(self, room: int) -> None:
        self.done.discard(room)
        self.free.append(self.slot_of.pop(room))

    def close(self) -> None:
        self.status.close(0)
        self.frames.close(0)
        self.ctx.term()


class TokenspeedBenchClient(BenchClient):
    """BenchClient's runs (windowed, one at a time) over tokenspeed's wire."""

    def __init__(self, grpc_at: str, prefix: str, bootstrap: str, spec: dict, grids: list, seed: int,
                 window: int):
        import numpy as np

        self.grids = [tuple(g) for g in grids]
        self.spans = [g[0] * g[1] * g[2] // spec["merge"] ** 2 for g in self.grids]
        self.hidden = spec["hidden"]
        item_bytes = max(self.spans) * spec["hidden"] * 2
        self.rx = _PrefillRank(bootstrap, window + 4, (item_bytes + 4095) & ~4095)
        self.client = _Gateway(grpc_at)
        rng = np.random.default_rng(seed)
        self.bases = [rng.standard_normal((g[0] * g[1] * g[2], spec["patch_dim"]), dtype=np.float32)
                      for g in self.grids]
        self.published: list[str] = []

    def alloc(self, room: int) -> None:
        self.rx.pre_alloc(room, self.spans[room % len(self.grids)], self.hidden)

    def publish(self, room: int):
        from multiprocessing import resource_tracker
        from multiprocessing.shared_memory import SharedMemory

        import numpy as np
        from smg_grpc_proto.generated import common_pb2, tokenspeed_encoder_pb2, tokenspeed_scheduler_pb2 as sched

        k = room % len(self.grids)
        base = self.bases[k]
        base[0, 0] = float(room)  # distinct pixels per room: no cache hits
        seg = SharedMemory(create=True, size=base.nbytes)
        seg.buf[:base.nbytes] = base.tobytes()
        name = seg.name
        seg.close()
        resource_tracker.unregister("/" + name, "shared_memory")  # the worker unlinks it
        self.published.append(name)
        px = sched.TensorData(shape=list(base.shape), dtype="float32",
                              shm=common_pb2.ShmHandle(name=name, nbytes=base.nbytes, owner_id="bench"))
        item = sched.MultimodalItem(modality=common_pb2.IMAGE, encoder_input=px,
                                    placeholders=[sched.PlaceholderRange(offset=0, length=self.spans[k])])
        item.model_specific_tensors["image_grid_thw"].CopyFrom(sched.TensorData(
            shape=[1, 3], dtype="int64", inline=np.array([self.grids[k]], dtype="<i8").tobytes()))
        return tokenspeed_encoder_pb2.EncodeRequest(
            request_id=f"bench-{room}", mm_inputs=sched.MultimodalInputs(items=[item]),
            items=[tokenspeed_encoder_pb2.EncodeItemAssignment(bootstrap_room=room)])

    def close(self) -> None:
        for name in self.published:  # those the worker never took
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass
        self.client.close()
        self.rx.close()


def tokenspeed_client_main(conn, grpc_at: str, prefix: str, bootstrap: str, spec: dict, grids: list,
                           seed: int, window: int) -> None:
    """The client process (spawn), as harness/client.py's client_main, over tokenspeed's wire."""
    bench = TokenspeedBenchClient(grpc_at, prefix, bootstrap, spec, grids, seed, window)
    me = os.getpid()
    try:
        conn.send(("ready", me))
        while True:
            cmd = conn.recv()
            if cmd[0] == "quit":
                break
            out = bench.windowed(*cmd[1:]) if cmd[0] == "windowed" else bench.one_at_a_time(*cmd[1:])
            out["violations"] = list(bench.rx.violations)
            bench.rx.violations = []
            conn.send(("result", out))
    finally:
        if os.getpid() == me:
            bench.close()
