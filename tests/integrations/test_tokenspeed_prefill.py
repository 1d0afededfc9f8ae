"""The tokenspeed fronts against tokenspeed's own code (docs/tokenspeed.md): tokenspeed
0.1.1's EPD prefill manager and receiver (three prefill ranks, in one process of
.venv-tokenspeed: scripts/setup_tokenspeed.sh), and a gateway built on smg's gRPC stubs,
against one worker of each mode serving both fronts beside the native protocol."""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import grpc
import numpy as np
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import (common_pb2, tokenspeed_encoder_pb2, tokenspeed_encoder_pb2_grpc,
                                      tokenspeed_scheduler_pb2, tokenspeed_scheduler_pb2_grpc)

from ipc import shm
from pipeline.runtime.background import free_port
from pipeline.peers.client import Client, Item
from pipeline.peers.receiver import Receiver
from pipeline.testing.sim import expected_sim_rows, image
from pipeline.testing.workers import sim_config, start_worker
from stages import registry
from tests.conftest import TOKEN

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-tokenspeed"
HIDDEN = 64
SUCCESS, FAILED = 5, 0
UNTOUCHED = 0xDEAD  # what a rank's receive memory holds where nothing was written
BOOTSTRAP_TIMEOUT_S = 5.0
_rooms = itertools.count(1000)


def tokenspeed_env() -> dict:
    if not (VENV / "bin" / "python").exists():
        pytest.fail(f"{VENV} is missing: these tests drive tokenspeed's own prefill side from it. "
                    f"Run scripts/setup_tokenspeed.sh (after scripts/setup.sh) first.", pytrace=False)
    site = next((VENV / "lib").glob("python3*/site-packages"))
    return dict(os.environ, MC_FORCE_TCP="1",  # no RDMA device here: tokenspeed hard-codes rdma
                LD_LIBRARY_PATH=f"{VENV}:{site / 'nvidia' / 'cu13' / 'lib'}")


class Prefill:
    """tokenspeed prefill ranks: tests/tokenspeed_side/prefill_rank.py, one process."""

    def __init__(self, specs: list[tuple[int, int]], env: dict, rows: int = 1024):
        self.log = tempfile.TemporaryFile(mode="w+")  # tokenspeed's and Mooncake's logs, shown if it dies
        self.proc = subprocess.Popen([str(VENV / "bin" / "python"), str(ROOT / "tests/tokenspeed_side/prefill_rank.py"),
                                      ",".join(f"{r}:{tp}" for r, tp in specs), str(rows), str(HIDDEN)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env=env, text=True)
        answer = self.answer()
        assert "ready" in answer, answer
        self.ranks = [Rank(self, who) for who in range(len(specs))]

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.log.seek(0)
            raise AssertionError(f"tokenspeed's prefill process exited ({code}):\n{self.log.read()[-3000:]}")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


class Rank:
    """One tokenspeed prefill rank of a Prefill process."""

    def __init__(self, prefill: Prefill, who: int):
        self.prefill, self.who = prefill, who

    def room(self, bootstrap: str, room: int, span: int, at: int = 0, identity: bool = False) -> int:
        return self.prefill.ask(op="room", who=self.who, bootstrap=bootstrap, room=room, span=span, at=at,
                                identity=identity)["status"]

    def wait(self, room: int, timeout: float = 20.0) -> tuple[int, np.ndarray]:
        got = self.prefill.ask(op="wait", who=self.who, room=room, timeout=timeout)
        return got["status"], np.frombuffer(bytes.fromhex(got["rows"]), dtype=np.uint16).reshape(-1, HIDDEN)


@pytest.fixture(scope="module")
def ranks():
    """tokenspeed prefill ranks: one of a tp 1 prefill, and the two of a tp 2 prefill."""
    prefill = Prefill([(0, 1), (0, 2), (1, 2)], tokenspeed_env())
    solo, *pair = prefill.ranks
    yield {"solo": solo, "pair": pair}
    prefill.close()


def ts_config(prefix: str, run_dir, **over):
    return sim_config(prefix, run_dir, sim_hidden=HIDDEN, sim_deepstack_width=0,
                      bootstrap_timeout_s=BOOTSTRAP_TIMEOUT_S, tokenspeed_grpc=f"127.0.0.1:{free_port()}",
                      tokenspeed_bootstrap=f"127.0.0.1:{free_port()}", **over)


def serve(mode: str, cfg):
    """A worker serving both fronts, with a gateway: `.gateway` (Encode), `.discovery`."""
    w = start_worker(mode, cfg)
    w.channel = grpc.insecure_channel(cfg.tokenspeed_grpc, options=[("grpc.max_send_message_length", 64 << 20)])
    w.gateway = tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderStub(w.channel)
    w.discovery = tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerStub(w.channel)
    w.prefill_bootstrap = cfg.tokenspeed_bootstrap
    return w


def stop(w) -> None:
    w.channel.close()
    w.close()


@pytest.fixture(scope="module", params=["inprocess", "pipeline"])
def worker(request, tmp_path_factory):
    tokenspeed_env()
    prefix = f"t{TOKEN}_{os.getpid()}_ts{request.param[0]}"
    w = serve(request.param, ts_config(prefix, tmp_path_factory.mktemp("ts")))
    try:
        yield w
    finally:
        stop(w)
        left = shm.list_objects(prefix)
        shm.sweep(prefix, include_live=True)
        assert not left, f"left shared-memory objects behind: {left}"


def gateway_segment(pixels: np.ndarray, offset: int = 0, slack: int = 0) -> str:
    """A segment as tokenspeed's gateway makes one (SharedMemory(create=True): psm_ names),
    pixels at `offset`, `slack` bytes more after them; closed, not unlinked (the encode
    side unlinks it)."""
    data = np.ascontiguousarray(pixels).tobytes()
    seg = SharedMemory(create=True, size=offset + len(data) + slack)
    seg.buf[offset:offset + len(data)] = data
    name = seg.name
    seg.close()
    resource_tracker.unregister("/" + name, "shared_memory")  # the worker unlinks it
    return name


def encode_request(room: int, grid: list, pixels: np.ndarray, *, span: int | None = None, shm_name=None,
                   offset: int = 0, n_items: int = 1, remote: bool = False):
    t, h, w = grid[0]
    rows = t * h * w // 4 if span is None else span
    px = tokenspeed_scheduler_pb2.TensorData(shape=list(pixels.shape), dtype="float32")
    if remote:
        px.remote.CopyFrom(common_pb2.RemoteTensorHandle(transport="nixl", nbytes=pixels.nbytes))
    elif shm_name:
        px.shm.CopyFrom(common_pb2.ShmHandle(name=shm_name, offset=offset, nbytes=pixels.nbytes, owner_id="gw"))
    else:
        px.inline = pixels.tobytes()
    item = tokenspeed_scheduler_pb2.MultimodalItem(modality=common_pb2.IMAGE, encoder_input=px,
                                                   placeholders=[tokenspeed_scheduler_pb2.PlaceholderRange(
                                                       offset=5, length=rows)])
    item.model_specific_tensors["image_grid_thw"].CopyFrom(tokenspeed_scheduler_pb2.TensorData(
        shape=[1, 3], dtype="int64", inline=np.array(grid, dtype="<i8").tobytes()))
    return tokenspeed_encoder_pb2.EncodeRequest(
        request_id=f"ts-{room}", mm_inputs=tokenspeed_scheduler_pb2.MultimodalInputs(items=[item] * n_items),
        items=[tokenspeed_encoder_pb2.EncodeItemAssignment(bootstrap_room=room)])


def expected(pixels: np.ndarray, span: int) -> np.ndarray:
    return expected_sim_rows(pixels, "image", span, HIDDEN, 0, "bfloat16")[0]


def native_rows(w, room: int, grid: list, pixels: np.ndarray) -> np.ndarray:
    """The same pixels through the native protocol: a Client and a Receiver."""
    span = grid[0][0] * grid[0][1] * grid[0][2] // 4
    rx = Receiver(f"native-{room}", w.cfg.bootstrap, buffer_bytes=4 << 20)
    client = Client(w.cfg.intake, None)
    try:
        rx.alloc(room, 0, span=span, hidden=HIDDEN, dtype="bfloat16")
        client.encode(room, f"native-{room}", [Item("image", grid, pixels)])
        assert rx.wait({room: 1}, timeout=20) and room not in rx.failed, rx.failed
        return rx.rows(room, 0)[0]
    finally:
        client.close()
        rx.close()


@pytest.mark.parametrize("how", ["inline", "shm", "shm at an offset", "448x448 in shm"])
def test_one_rank_gets_the_native_rows(worker, ranks, how):
    grid, pixels = image(next(_rooms), (1, 32, 32) if how.startswith("448") else (1, 4, 8))
    span = grid[0][1] * grid[0][2] // 4
    room = next(_rooms)
    assert ranks["solo"].room(worker.prefill_bootstrap, room, span) != FAILED
    offset = 4096 + 8 if "offset" in how else 0
    name = gateway_segment(pixels, offset, slack=100 if "offset" in how else 0) if "shm" in how else None
    assert worker.gateway.Encode(encode_request(room, grid, pixels, shm_name=name, offset=offset),
                                 timeout=10).accepted
    status, rows = ranks["solo"].wait(room)
    assert status == SUCCESS
    assert np.array_equal(rows, expected(pixels, span))
    assert np.array_equal(rows, native_rows(worker, next(_rooms), grid, pixels))
    if name:
        assert not os.path.exists(f"/dev/shm/{name}"), "the gateway's segment was not unlinked"


@pytest.mark.parametrize("identity", [False, True], ids=["row-sharded", "identity broadcast"])
def test_two_ranks_each_get_their_rows(worker, ranks, identity):
    grid, pixels = image(next(_rooms), (1, 4, 6))  # 6 rows: 3 and 3
    room = next(_rooms)
    for r in ranks["pair"]:
        assert r.room(worker.prefill_bootstrap, room, 6, at=16, identity=identity) != FAILED
    assert worker.gateway.Encode(encode_request(room, grid, pixels), timeout=10).accepted
    want = expected(pixels, 6)
    got = [r.wait(room) for r in ranks["pair"]]
    assert [s for s, _ in got] == [SUCCESS, SUCCESS]
    if identity:
        assert all(np.array_equal(rows, want) for _, rows in got)
    else:
        assert np.array_equal(np.concatenate([rows for _, rows in got]), want)


def test_a_wrong_span_fails_on_both_sides_and_writes_nothing(worker, ranks):
    """Refused up front by the gRPC front (the placeholders disagree with the grid), and
    at the sender (a pre-alloc of the wrong span): INVALID_ARGUMENT to the gateway, "0"
    to the rank, its memory untouched."""
    for gateway_span, rank_span in ((5, 5), (4, 5)):
        grid, pixels = image(next(_rooms), (1, 4, 4))
        room = next(_rooms)
        ranks["solo"].room(worker.prefill_bootstrap, room, rank_span, at=512)
        request = encode_request(room, grid, pixels, span=gateway_span)
        if gateway_span != 4:
            with pytest.raises(grpc.RpcError) as e:
                worker.gateway.Encode(request, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "span" in e.value.details()
        else:
            assert worker.gateway.Encode(request, timeout=10).accepted
        status, rows = ranks["solo"].wait(room)
        assert status == FAILED and (rows == UNTOUCHED).all()
    # the room failed with the front's reason, not with what intake makes of a stand-in
    reason = "the placeholders take 5 rows; the grid makes 4 (span)"
    deadline = time.monotonic() + 10
    while reason not in worker.stats()["intake_failed"] and time.monotonic() < deadline:
        pass  # stats() waits a moment in the pipeline, for its stages' boards
    assert reason in worker.stats()["intake_failed"], worker.stats()["intake_failed"]


def test_a_pre_alloc_refused_by_the_frame_front_is_answered_failed(worker):
    """Its room and status endpoint can be read: its rank hears "0" now, not at its timeout."""
    host, port = worker.prefill_bootstrap.rsplit(":", 1)
    ctx = zmq.Context()
    status = ctx.socket(zmq.PULL)
    status_port = status.bind_to_random_port("tcp://127.0.0.1")
    frames = ctx.socket(zmq.PUSH)
    frames.connect(f"tcp://{host}:{int(port) + 1}")
    room = next(_rooms)
    try:
        frames.send_multipart([str(room).encode(), b"127.0.0.1", str(status_port).encode(), b"127.0.0.1:9", bytes(8),
                               bytes(8), b"4", str(HIDDEN).encode(), b"torch.int8", b"0", b"1", b"0", b"4"])
        assert status.poll(10_000), "the refused pre-alloc's rank heard nothing"
        assert status.recv_multipart() == [str(room).encode(), b"0", b"0"]
    finally:
        frames.close(0)
        status.close(0)
        ctx.term()


@pytest.mark.parametrize("what", ["two items", "remote pixels", "a negative room"])
def test_requests_the_front_cannot_serve_are_refused_with_a_reason(worker, what):
    grid, pixels = image(next(_rooms))
    room = -5 if "negative" in what else next(_rooms)
    request = encode_request(room, grid, pixels, n_items=2 if "two" in what else 1, remote="remote" in what)
    with pytest.raises(grpc.RpcError) as e:
        worker.gateway.Encode(request, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert {"two items": "exactly one item", "remote pixels": "remote",
            "a negative room": "negative"}[what] in e.value.details()


def test_rooms_near_2_63_and_discovery(worker, ranks):
    grid, pixels = image(next(_rooms))
    room = 2**63 - 1 - next(_rooms)
    ranks["solo"].room(worker.prefill_bootstrap, room, 4, at=600)
    assert worker.gateway.Encode(encode_request(room, grid, pixels), timeout=10).accepted
    status, rows = ranks["solo"].wait(room)
    assert status == SUCCESS and np.array_equal(rows, expected(pixels, 4))
    info = worker.discovery.GetModelInfo(tokenspeed_scheduler_pb2.GetModelInfoRequest(), timeout=5)
    server = worker.discovery.GetServerInfo(tokenspeed_scheduler_pb2.GetServerInfoRequest(), timeout=5)
    assert server.server_args["disaggregation_mode"] == "encode"
    assert server.server_args["disaggregation_bootstrap_port"] == int(worker.prefill_bootstrap.rsplit(":")[1])
    assert server.scheduler_info["shm_namespace_id"]
    assert info.supports_vision and worker.discovery.HealthCheck(
        tokenspeed_scheduler_pb2.HealthCheckRequest(), timeout=5).healthy
    with pytest.raises(grpc.RpcError) as e:
        next(iter(worker.discovery.Generate(tokenspeed_scheduler_pb2.GenerateRequest(), timeout=5)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    health = health_pb2_grpc.HealthStub(worker.channel)
    for service in ("", "tokenspeed.grpc.encoder.TokenSpeedEncoder", "tokenspeed.grpc.scheduler.TokenSpeedScheduler"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
    host, port = worker.prefill_bootstrap.rsplit(":", 1)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{worker.prefill_bootstrap}/route?engine_rank=1&target_dp_group=0", timeout=5)
    assert e.value.code == 404
    with urllib.request.urlopen(f"http://{worker.prefill_bootstrap}/route?engine_rank=0&target_dp_group=0",
                                timeout=5) as reply:
        assert json.loads(reply.read()) == {"rank_ip": host, "rank_port": int(port) + 1}


def test_a_room_whose_item_never_comes_and_a_late_pre_alloc_hear_failed(worker, ranks):
    """No cancel exists on tokenspeed's wire: a pre-alloc for a room the worker never sees
    is answered "0" at the bootstrap timeout; one that comes after its room timed out
    waiting for it, at once."""
    never = next(_rooms)
    ranks["solo"].room(worker.prefill_bootstrap, never, 4, at=700)
    grid, pixels = image(next(_rooms))
    late = next(_rooms)
    assert worker.gateway.Encode(encode_request(late, grid, pixels), timeout=10).accepted
    status, rows = ranks["solo"].wait(never, timeout=BOOTSTRAP_TIMEOUT_S + 10)
    assert status == FAILED and (rows == UNTOUCHED).all()
    deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S + 10
    while worker.runtime.rooms.find(late) is not None and worker.runtime.rooms.get(
            worker.runtime.rooms.find(late)).live and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks["solo"].room(worker.prefill_bootstrap, late, 4, at=710)
    status, rows = ranks["solo"].wait(late)
    assert status == FAILED and (rows == UNTOUCHED).all()


def test_malformed_frames_are_dropped_and_the_rank_is_still_served(worker, ranks):
    host, port = worker.prefill_bootstrap.rsplit(":", 1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"tcp://{host}:{int(port) + 1}")
    # the oversized one last: it is cut off with its connection
    for parts in ([b"x"], [b"1"] * 13, [b"None"] * 6, [b"7", b"127.0.0.1", b"1", b"s"] + [b""] * 9, [b"\xff" * 9000]):
        sock.send_multipart(parts)
    sock.close(linger=1000)
    ctx.term()
    test_rooms_near_2_63_and_discovery(worker, ranks)
    assert sum(worker.stats()["tokenspeed_frames_dropped"].values()) >= 4


def test_a_killed_sender_fails_the_rooms_it_held_and_the_next_room_is_served(worker, ranks):
    """A room that waits at the sender for its second rank's pre-alloc when the sender is
    SIGKILLed: its first rank hears "0", never a row; the second, pre-allocating after the
    restart, hears "0" too; a new room after the restart succeeds on both."""
    if worker.mode != "pipeline":
        pytest.skip("a stage of its own to kill: the pipeline only")
    first, second = ranks["pair"]
    grid, pixels = image(next(_rooms), (1, 4, 6))
    room = next(_rooms)
    first.room(worker.prefill_bootstrap, room, 6, at=800)
    assert worker.gateway.Encode(encode_request(room, grid, pixels), timeout=10).accepted
    sup = worker.runtime
    deadline = time.monotonic() + 10
    while not sup.stats().get("sender_live_rooms") and time.monotonic() < deadline:
        time.sleep(0.02)
    old = sup.procs[registry.SENDER].pid
    os.kill(old, signal.SIGKILL)
    status, rows = first.wait(room)
    assert status == FAILED and (rows == UNTOUCHED).all()
    deadline = time.monotonic() + 30
    while (getattr(sup.procs.get(registry.SENDER), "pid", old) == old or sup.stages_not_ready()) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    second.room(worker.prefill_bootstrap, room, 6, at=800)
    status, rows = second.wait(room)
    assert status == FAILED and (rows == UNTOUCHED).all()
    test_two_ranks_each_get_their_rows(worker, ranks, identity=False)


@pytest.mark.parametrize("mode", ["inprocess", "pipeline"])
def test_a_prefill_that_registered_with_a_worker_is_served_by_its_restart(ranks, mode, shm_prefix, tmp_path):
    """tokenspeed's prefill asks /route and registers once per process, for its life: a
    worker restarted on the same ports (the frame port with them) serves its next room
    from the pre-alloc alone."""
    cfg = ts_config(shm_prefix, tmp_path)
    for incarnation in ("first", "restarted"):
        w = serve(mode, cfg)
        try:
            grid, pixels = image(next(_rooms))
            room = next(_rooms)
            ranks["solo"].room(w.prefill_bootstrap, room, 4, at=900)
            assert w.gateway.Encode(encode_request(room, grid, pixels), timeout=10).accepted
            status, rows = ranks["solo"].wait(room)
            assert status == SUCCESS and np.array_equal(rows, expected(pixels, 4)), incarnation
        finally:
            stop(w)
