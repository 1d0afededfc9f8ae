"""The worker's side of tokenspeed's wire (docs/tokenspeed.md), without tokenspeed: an alloc
that describes its receiver needs no register, identity broadcast is a tiling, the frame
front's translation and the status frames tokenspeed's status thread can read."""
from __future__ import annotations

import struct

import pytest

from ipc import wire
from pipeline.tokenspeed_front import FrameError, translate
from stages.alloc_checks import tiling_problem
from stages.records import OWNER_INTAKE, OWNER_TOWER, ReadyItem, Registered, RoomOpened, ShardWritten
from stages.registry import INTAKE, TOWER
from tests.test_sender import ROOM, _Engine, make_sender, tables  # noqa: F401 (a fixture)


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
    assert ShardWritten(ROOM, 0, "rx-b") in out


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
    [], [b"x"] * 12, [b"x"] * 14, _pre_alloc(room=b"-1"), _pre_alloc(room=b"\xff"), _pre_alloc(room=str(2**64).encode()),
    _pre_alloc(dtype=b"torch.int8"), _pre_alloc(deep=b"2"), _pre_alloc(fanout=b"0"), _pre_alloc(ptr=b"1234"),
    _pre_alloc(n=b"1e3"), [b"None", b"h", b"0", b"s", bytes(8), bytes(8)],
])
def test_malformed_frames_are_refused_with_a_reason(parts):
    with pytest.raises(FrameError):
        translate(parts, 0)


@pytest.mark.parametrize("room", [0, 2**63 - 1, 2**63 + 5])
def test_status_frames_are_three_ascii_integers(room):
    ok = wire.tokenspeed_status(wire.status_message(room, 0, True))
    failed = wire.tokenspeed_status(wire.status_message(room, None, False, "some reason"))
    assert ok == [str(room).encode(), b"5", b"0"] and failed == [str(room).encode(), b"0", b"0"]
    assert all(int(p.decode("ascii")) >= 0 for p in ok + failed)


@pytest.mark.parametrize("key", ["tokenspeed_grpc", "tokenspeed_bootstrap"])
def test_the_fronts_bind_off_loopback_only_when_the_operator_accepts_the_risk(key):
    from pipeline.config import ConfigError, WorkerConfig

    WorkerConfig(**{key: "127.0.0.1:9000"}).resolved().validate()
    with pytest.raises(ConfigError, match="allow-insecure-network"):
        WorkerConfig(**{key: "0.0.0.0:9000"}).resolved().validate()
    WorkerConfig(**{key: "0.0.0.0:9000"}, allow_insecure_network=True).resolved().validate()
    with pytest.raises(ConfigError, match="host:port"):
        WorkerConfig(**{key: "9000"}).resolved().validate()
