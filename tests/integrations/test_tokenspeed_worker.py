"""The worker's side of tokenspeed's wire (docs/tokenspeed.md), without tokenspeed: an alloc
that describes its receiver needs no register, identity broadcast is a tiling, the frame
front's translation and the status frames tokenspeed's status thread can read."""
from __future__ import annotations

import os
import struct

import pytest

from ipc import hashing, wire
from pipeline.integrations.tokenspeed_front import FrameError, translate
from stages.alloc_checks import tiling_problem
from stages.records import OWNER_INTAKE, OWNER_TOWER, ReadyItem, Registered, RoomOpened, ShardWritten
from stages.registry import INTAKE, TOWER
from tests.stages.test_sender import ROOM, _Engine, make_sender, tables  # noqa: F401 (a fixture)


def _alloc(rx, row_start, n_rows, span=4, fanout=2, **more):
    return wire.Alloc(rx, ROOM, 0, 4096, 0, row_start, n_rows, span, 8, "bfloat16", 0, fanout, **more)


def test_identity_broadcast_is_a_tiling_and_a_mix_is_not():
    assert tiling_problem(0, 4, [_alloc("a", 0, 4), _alloc("b", 0, 4)]) is None
    assert tiling_problem(0, 4, [_alloc("a", 0, 2), _alloc("b", 2, 2)]) is None
    assert "overlap" in tiling_problem(0, 4, [_alloc("a", 0, 4), _alloc("b", 2, 2)])


def _send_alloc(s, rx, row_start, n_rows, session="127.0.0.1:1111", status="tcp://127.0.0.1:2222", fanout=2):
    s.handle("socket", wire.encode({"v": wire.VERSION, "type": "alloc", "receiver": rx, "room": ROOM, "item": 0,
                                    "dst": 4096, "dst_deepstack": 0, "row_start": row_start, "n_rows": n_rows,
                                    "span": 4, "hidden": 8, "dtype": "bfloat16", "deepstack_width": 0,
                                    "fanout": fanout, "session": session, "status": status}))


def test_an_alloc_that_describes_its_receiver_needs_no_register_and_identity_copies_are_written(tables):  # noqa: F811
    """tokenspeed's prefill registers once per process: a worker restarted since has no
    registration, and every pre-alloc must stand on its own. Two receivers, each the
    whole embedding (identity broadcast): both written."""
    s, out = make_sender(tables)
    s.engine = engine = _Engine()
    rooms = tables[1]
    slot = rooms.insert(ROOM, "req", 1, OWNER_INTAKE)
    s.handle(INTAKE, RoomOpened(slot, ROOM, "req", [4], 0.0))
    _send_alloc(s, "rx-a", 0, 4, session="127.0.0.1:1111", status="tokenspeed+tcp://127.0.0.1:2222")
    _send_alloc(s, "rx-b", 0, 4, session="127.0.0.1:3333", status="tokenspeed+tcp://127.0.0.1:4444")
    registered = [r.registration.receiver for r in out if isinstance(r, Registered)]
    assert registered == ["rx-a", "rx-b"], out
    assert set(tables[2].load()) == {"rx-a", "rx-b"}  # in the shared table: a successor knows them
    s.handle(TOWER, ReadyItem(slot, ROOM, 0, 4, s.arena.alloc(4 * 8 * 2, OWNER_TOWER)))
    assert sorted(engine.writes) == [("127.0.0.1:1111", [4096]), ("127.0.0.1:3333", [4096])]


def test_a_zero_row_shard_is_answered_without_a_write(tables):  # noqa: F811
    s, out = make_sender(tables)
    s.engine = engine = _Engine()
    slot = tables[1].insert(ROOM, "req", 1, OWNER_INTAKE)
    s.handle(INTAKE, RoomOpened(slot, ROOM, "req", [4], 0.0))
    _send_alloc(s, "rx-a", 0, 4, fanout=2)
    _send_alloc(s, "rx-b", 4, 0, session="127.0.0.1:3333", status="tcp://127.0.0.1:4444", fanout=2)
    s.handle(TOWER, ReadyItem(slot, ROOM, 0, 4, s.arena.alloc(4 * 8 * 2, OWNER_TOWER)))
    assert engine.writes == [("127.0.0.1:1111", [4096])]
    assert [(r.room, r.item, r.receiver) for r in out if isinstance(r, ShardWritten)] == [(ROOM, 0, "rx-b")]


def _pre_alloc(room=b"1311768467463790320", n=b"256", dtype=b"torch.bfloat16", deep=b"0", fanout=b"1",
               start=b"0", span=b"256", ptr=struct.pack("<Q", 0x7EFF75BFB040)):
    return [room, b"127.0.0.1", b"38649", b"127.0.0.1:15585", ptr, struct.pack("<Q", 0), n, b"1024", dtype, deep,
            fanout, start, span]


def test_frames_translate_into_native_messages():
    msg = translate(_pre_alloc(), deepstack_width=32)
    assert msg == {"v": 1, "type": "alloc", "receiver": "tokenspeed 127.0.0.1:38649", "session": "127.0.0.1:15585",
                   "status": "tokenspeed+tcp://127.0.0.1:38649", "room": 1311768467463790320, "item": 0,
                   "dst": 0x7EFF75BFB040, "dst_deepstack": 0, "n_rows": 256, "hidden": 1024, "dtype": "bfloat16",
                   "deepstack_width": 0, "fanout": 1, "row_start": 0, "span": 256}
    assert isinstance(wire.parse_bootstrap(msg), wire.Alloc)
    assert translate(_pre_alloc(deep=b"1"), deepstack_width=32)["deepstack_width"] == 32
    reg = translate([b"None", b"127.0.0.1", b"38649", b"127.0.0.1:15585", bytes(8), bytes(8)], 0)
    assert isinstance(wire.parse_bootstrap(reg), wire.Register)


@pytest.mark.parametrize("parts", [
    [], [b"x"] * 12, [b"x"] * 14, _pre_alloc(room=b"-1"), _pre_alloc(room=b"\xff"),
    _pre_alloc(room=str(2**64).encode()),
    _pre_alloc(dtype=b"torch.int8"), _pre_alloc(deep=b"2"), _pre_alloc(fanout=b"0"), _pre_alloc(ptr=b"1234"),
    _pre_alloc(n=b"1e3"), [b"None", b"h", b"0", b"s", bytes(8), bytes(8)],
])
def test_malformed_frames_are_refused_with_a_reason(parts):
    with pytest.raises(FrameError):
        translate(parts, 0)


def test_a_refused_pre_alloc_names_where_to_answer_when_it_can_be_read():
    from pipeline.integrations.tokenspeed_front import refused_room

    assert refused_room(_pre_alloc(dtype=b"torch.int8")) == (1311768467463790320, "tcp://127.0.0.1:38649")
    assert refused_room(_pre_alloc(room=b"-1")) is None
    unreadable_port = _pre_alloc(dtype=b"torch.int8")
    unreadable_port[2] = b"0"
    assert refused_room(unreadable_port) is None and refused_room([b"x"] * 6) is None


def test_a_refusal_is_honoured_only_under_its_key():
    key, other = hashing.new_cache_key(), hashing.new_cache_key()
    msg = wire.decode(wire.encode(hashing.refusal(key, 42, "gw-1", "shm segment is not a regular file")))
    assert hashing.refusal_reason(key, msg) == "shm segment is not a regular file"
    assert hashing.refusal_reason(other, msg) is None
    assert hashing.refusal_reason(key, {**msg, "room": 43}) is None
    assert hashing.refusal_reason(key, {**msg, "reason": "another"}) is None


@pytest.mark.parametrize("room", [0, 2**63 - 1, 2**63 + 5])
def test_status_frames_are_three_ascii_integers(room):
    ok = wire.tokenspeed_status(wire.status_message(room, 0, True))
    failed = wire.tokenspeed_status(wire.status_message(room, None, False, "some reason"))
    assert ok == [str(room).encode(), b"5", b"0"] and failed == [str(room).encode(), b"0", b"0"]
    assert all(int(p.decode("ascii")) >= 0 for p in ok + failed)


@pytest.mark.parametrize("key", ["tokenspeed_grpc", "tokenspeed_bootstrap"])
def test_the_fronts_bind_off_loopback_only_when_the_operator_accepts_the_risk(key):
    from pipeline.cli.config import ConfigError, WorkerConfig

    WorkerConfig(**{key: "127.0.0.1:9000"}).resolved().validate()
    with pytest.raises(ConfigError, match="allow-insecure-network"):
        WorkerConfig(**{key: "0.0.0.0:9000"}).resolved().validate()
    WorkerConfig(**{key: "0.0.0.0:9000"}, allow_insecure_network=True).resolved().validate()
    with pytest.raises(ConfigError, match="host:port"):
        WorkerConfig(**{key: "9000"}).resolved().validate()


# -- bounds: a flood through either front pushes back on its peer -----------------------------


@pytest.fixture
def stalled_intake(tmp_path):
    """A native intake socket nobody reads: the worker busy for as long as the test wants."""
    import zmq

    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    sink.setsockopt(zmq.RCVHWM, 1)
    endpoint = f"ipc://{tmp_path}/intake.sock"
    sink.bind(endpoint)
    yield ctx, endpoint
    sink.close(0)
    ctx.term()


def _grpc_front(ctx, intake, monkeypatch, draining=lambda: False):
    from types import SimpleNamespace

    from pipeline.integrations import tokenspeed_grpc
    from pipeline.runtime.background import free_port

    monkeypatch.setattr(tokenspeed_grpc, "MAX_CONCURRENT_RPCS", 4)
    monkeypatch.setattr(tokenspeed_grpc, "SEND_TIMEOUT_S", 0.5)
    cfg = SimpleNamespace(tower="sim", tower_config="", shm_prefix="tsbound", intake=intake,
                          tokenspeed_grpc=f"127.0.0.1:{free_port()}")
    spec = SimpleNamespace(patch_dim=1176, merge=2, dtype="bfloat16", deepstack_width=0)
    return tokenspeed_grpc.GrpcFront(ctx, cfg, spec, draining, hashing.new_cache_key())


def test_a_grpc_flood_is_turned_away_or_waits_and_every_call_ends(stalled_intake, monkeypatch):
    import grpc
    import numpy as np
    from smg_grpc_proto.generated import tokenspeed_encoder_pb2_grpc

    from tests.integrations.test_tokenspeed_prefill import encode_request

    ctx, intake = stalled_intake
    front = _grpc_front(ctx, intake, monkeypatch)
    channel = grpc.insecure_channel(front.cfg.tokenspeed_grpc, options=[("grpc.max_send_message_length", 64 << 20)])
    try:
        stub = tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderStub(channel)
        pixels = np.ones((256, 1176), dtype=np.float32)  # 1.2 MB inline: the intake's queues fill at once
        calls = [stub.Encode.future(encode_request(room, [[1, 16, 16]], pixels), timeout=30) for room in range(24)]
        codes = [c.exception().code() if c.exception() else grpc.StatusCode.OK for c in calls]
    finally:
        channel.close()
        front.close()
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.UNAVAILABLE in codes, codes
    assert codes.count(grpc.StatusCode.OK) <= 8, codes  # what the sockets' queues hold


PLANTED = ["a wrong span", "a link", "another worker's run lock", "another file", "a wrong owner",
           "a wrong size", "our own prefix"]


def _plant(what: str, pixels, tmp_path) -> tuple[str, str | None]:
    """A file in /dev/shm a call names, and the file a link in it points to."""
    import secrets

    from tests.integrations.test_tokenspeed_prefill import gateway_segment

    if what == "a wrong span":
        return gateway_segment(pixels), None
    if what == "another worker's run lock":
        name = f"epdother-{secrets.token_hex(4)}-lock"  # what ipc.shm.RunLock names a run's lock
    elif what == "another file":
        name = f"notagateway{os.getpid()}"
    elif what == "our own prefix":
        name = f"tsbound.px.{os.getpid()}.0"
    else:
        name = f"psm_{secrets.token_hex(4)}"
    path = f"/dev/shm/{name}"
    if what == "a link":
        target = tmp_path / "target"
        target.write_bytes(pixels.tobytes())
        os.symlink(target, path)
        return name, str(target)
    with open(path, "wb") as f:
        f.write(pixels.tobytes()[:-4 if what == "a wrong size" else None])
    if what == "a wrong owner":
        if os.geteuid() != 0:
            os.unlink(path)
            pytest.skip("only root can give a file to another user")
        os.chown(path, 65534, 65534)
    return name, None


@pytest.mark.parametrize("what", PLANTED)
def test_a_refused_call_leaves_every_file_where_it_was(stalled_intake, monkeypatch, tmp_path, what):
    """A call names a file in /dev/shm: refused, whatever it names stays, never unlinked,
    renamed or followed (the worker takes only tokenspeed's names, regular files of its
    own user of the size the call says). Old code unlinked every one of these."""
    import grpc
    import numpy as np
    from smg_grpc_proto.generated import tokenspeed_encoder_pb2_grpc

    from tests.integrations.test_tokenspeed_prefill import encode_request

    ctx, intake = stalled_intake
    front = _grpc_front(ctx, intake, monkeypatch)
    channel = grpc.insecure_channel(front.cfg.tokenspeed_grpc)
    pixels = np.ones((16, 1176), dtype=np.float32)
    name, target = _plant(what, pixels, tmp_path)
    before = os.lstat(f"/dev/shm/{name}")
    try:
        stub = tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Encode(encode_request(7, [[1, 4, 4]], pixels, span=5 if what == "a wrong span" else None,
                                       shm_name=name), timeout=10)
        after = os.lstat(f"/dev/shm/{name}")
        ours = [n for n in os.listdir("/dev/shm") if n.startswith("tsbound.ts")]
    finally:
        channel.close()
        front.close()
        os.unlink(f"/dev/shm/{name}")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    why = {"a wrong span": "span", "a link": "not a regular file", "a wrong owner": "worker's user",
           "a wrong size": "runs past it"}.get(what, "not a tokenspeed gateway's segment name")
    assert why in e.value.details()
    assert (after.st_ino, after.st_nlink, after.st_size) == (before.st_ino, before.st_nlink, before.st_size)
    assert not ours, ours
    assert target is None or os.path.exists(target)


def test_an_accepted_call_takes_the_segment_and_only_then_unlinks_its_name(monkeypatch):
    """A call the worker accepts: the gateway's name is gone (tokenspeed's encode side
    unlinks after its read) and its bytes are under the worker's prefix, for intake."""
    import grpc
    import numpy as np
    import zmq
    from smg_grpc_proto.generated import tokenspeed_encoder_pb2_grpc

    from tests.integrations.test_tokenspeed_prefill import encode_request, gateway_segment

    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    intake = f"ipc:///tmp/tsintake-{os.getpid()}.sock"
    sink.bind(intake)
    front = _grpc_front(ctx, intake, monkeypatch)
    channel = grpc.insecure_channel(front.cfg.tokenspeed_grpc)
    pixels = np.arange(16 * 1176, dtype=np.float32).reshape(16, 1176)
    names = [gateway_segment(pixels), gateway_segment(pixels, offset=64, slack=8)]
    ours = []
    try:
        stub = tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderStub(channel)
        for room, name in enumerate(names):
            stub.Encode(encode_request(room, [[1, 4, 4]], pixels, shm_name=name, offset=64 * room), timeout=10)
            ours.append(wire.decode(sink.recv())["items"][0]["pixels"]["shm"])
        gone = [not os.path.lexists(f"/dev/shm/{n}") for n in names]
        held = [np.fromfile(f"/dev/shm/{o[1:]}", dtype=np.float32) for o in ours]
    finally:
        channel.close()
        front.close()
        for n in [f"/{n}" for n in names] + ours:
            if os.path.lexists(f"/dev/shm/{n[1:]}"):
                os.unlink(f"/dev/shm/{n[1:]}")
        sink.close(0)
        ctx.term()
    assert gone == [True, True]
    assert all(np.array_equal(h, pixels.ravel()) for h in held)


def test_a_frame_flood_pushes_back_on_the_prefill(stalled_intake):
    import zmq

    from pipeline.runtime.background import free_port
    from pipeline.integrations.tokenspeed_front import FrameFront

    ctx, _ = stalled_intake
    stalled = ctx.socket(zmq.PULL)  # the sender, not reading
    stalled.setsockopt(zmq.RCVHWM, 1)
    port = stalled.bind_to_random_port("tcp://127.0.0.1")
    frames_port = free_port()
    front = FrameFront(ctx, "127.0.0.1", frames_port, f"tcp://127.0.0.1:{port}", 0)
    prefill = ctx.socket(zmq.PUSH)
    prefill.setsockopt(zmq.SNDHWM, 1)
    prefill.setsockopt(zmq.SNDTIMEO, 500)
    prefill.connect(f"tcp://127.0.0.1:{frames_port}")
    sent = 0
    try:
        while sent < 1_000_000:
            prefill.send_multipart(_pre_alloc(room=str(sent).encode()))
            sent += 1
    except zmq.Again:
        pass
    finally:
        prefill.close(0)
        front.close()
        stalled.close(0)
    assert sent < 1_000_000, "the front took every frame: nothing pushed back"
    print(f"\nframe flood: {sent} frames taken before the prefill's send blocked")


def test_a_draining_worker_answers_unavailable_and_leaves_the_segment(stalled_intake, monkeypatch):
    import grpc
    import numpy as np
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from smg_grpc_proto.generated import tokenspeed_encoder_pb2_grpc

    from tests.integrations.test_tokenspeed_prefill import encode_request, gateway_segment

    ctx, intake = stalled_intake
    front = _grpc_front(ctx, intake, monkeypatch, draining=lambda: True)
    channel = grpc.insecure_channel(front.cfg.tokenspeed_grpc)
    pixels = np.ones((16, 1176), dtype=np.float32)
    name = gateway_segment(pixels)
    try:
        with pytest.raises(grpc.RpcError) as e:
            tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderStub(channel).Encode(
                encode_request(7, [[1, 4, 4]], pixels, shm_name=name), timeout=10)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        channel.close()
        front.close()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert os.path.exists(f"/dev/shm/{name}")  # the gateway's, to send elsewhere or unlink
    os.unlink(f"/dev/shm/{name}")


def test_refused_pre_allocs_naming_many_endpoints_open_a_bounded_number_of_sockets(stalled_intake):
    """Each names another status endpoint: the front answers on at most MAX_STATUS_SOCKETS
    at once and closes none sooner than its linger after use, so a flood cannot pile up
    sockets in the worker's main process; the first ones are answered "0"."""
    import time

    import zmq

    from pipeline.runtime.background import free_port
    from pipeline.integrations.tokenspeed_front import MAX_STATUS_SOCKETS, FrameFront

    ctx, intake = stalled_intake
    status = ctx.socket(zmq.PULL)
    status_port = status.bind_to_random_port("tcp://127.0.0.1")
    frames_port = free_port()
    front = FrameFront(ctx, "127.0.0.1", frames_port, intake, 0)
    prefill = ctx.socket(zmq.PUSH)
    prefill.connect(f"tcp://127.0.0.1:{frames_port}")
    n = 3 * MAX_STATUS_SOCKETS
    try:
        for i in range(n):  # the first to our status socket, the others to addresses nobody listens on
            frame = _pre_alloc(room=str(i).encode(), dtype=b"torch.int8")
            frame[1:3] = [f"127.0.0.{1 + i}".encode(), str(status_port).encode()]
            prefill.send_multipart(frame)
        deadline = time.monotonic() + 10
        while sum(front.dropped.values()) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert status.poll(10_000) and status.recv_multipart() == [b"0", b"0", b"0"]
        assert sum(front.dropped.values()) == n
        assert front.answered <= MAX_STATUS_SOCKETS and len(front.status) <= MAX_STATUS_SOCKETS
    finally:
        prefill.close(0)
        status.close(0)
        front.close()
