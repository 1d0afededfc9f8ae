"""CurveZMQ (#22 item 3): with curve_cert and curve_clients the intake, bootstrap and status
sockets admit only the keys they are given, a receiver id belongs to the key that
registered it (across a sender's restart too), and a worker off loopback without them
is refused at the command line unless --allow-insecure-network says so."""
from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq
import zmq.auth

from ipc import wire
from pipeline.cli import main as cli
from pipeline.peers import curve
from pipeline.ops import metrics
from pipeline.peers.client import Client, Item
from pipeline.peers.receiver import Receiver
from tests.helpers import expected_sim_rows, free_port, image, sim_config, start_worker

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_rooms = itertools.count(70_000)
SPAN4 = dict(span=4, hidden=64, dtype="bfloat16", deepstack_width=32)  # a (1, 4, 4) image
REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Key pairs of the worker, a gateway, two receivers ('rx', 'other') and a stranger;
    `clients`: the public certificates of all but the stranger."""
    root = tmp_path_factory.mktemp("certs")
    secret, clients = root / "secret", root / "clients"
    secret.mkdir()
    clients.mkdir()
    paths = {}
    for name in ("worker", "gateway", "rx", "other", "stranger"):
        public, secret_file = zmq.auth.create_certificates(str(secret), name)
        paths[name] = secret_file
        if name not in ("worker", "stranger"):
            os.link(public, clients / os.path.basename(public))
    paths["worker_public"] = str(secret / "worker.key")
    paths["clients"] = str(clients)
    return paths


@pytest.fixture(params=["inprocess", "pipeline"])
def curved(request, shm_prefix, tmp_path, certs):
    made = []

    def start(**over):
        w = start_worker(request.param, sim_config(shm_prefix, tmp_path, curve_cert=certs["worker"],
                                                   curve_clients=certs["clients"], **over))
        made.append(w)
        return w

    start.mode = request.param
    start.made = made
    yield start
    for obj in reversed(made):
        obj.close()


def peer(certs, name: str) -> dict:
    return dict(curve_cert=certs[name], worker_cert=certs["worker_public"])


class Pusher:
    """A PUSH socket to `endpoint` (a CURVE client with `keys`: (own pair, server's public
    key), or plain), watched from before it connects: ZeroMQ does not retry a handshake
    the server refused, so a watch begun later could miss it."""

    def __init__(self, endpoint: str, keys=None):
        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.monitor = self.sock.get_monitor_socket(REFUSED)
        if keys is not None:
            curve.connect_as(self.sock, *keys)
        self.sock.connect(endpoint)

    def send(self, msg: dict) -> None:
        """Sent, or dropped here once the server refused this peer (no connection is left to queue on)."""
        try:
            self.sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def refused(self, timeout: float = 20.0) -> bool:
        """Whether the server refused the handshake (its key, or its mechanism)."""
        return bool(self.monitor.poll(int(timeout * 1000)))

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def serve_one(client: Client, rx: Receiver, room: int, seed: int) -> None:
    """One room through `client` and `rx`: it succeeds with the sim tower's rows."""
    it = Item("image", *image(seed))
    client.encode(room, f"req-{room}", [it], inline=True)
    rx.alloc(room, 0, **SPAN4)
    assert rx.wait({room: 1}, 60), f"room {room} did not conclude"
    assert room not in rx.failed, rx.failed[room]
    main, deep = expected_sim_rows(it.pixels, "image", 4, 64, 32, "bfloat16")
    got_main, got_deep = rx.rows(room, 0)
    assert np.array_equal(got_main, main) and np.array_equal(got_deep, deep)
    rx.release(room)


def dropped(w, text: str) -> int:
    return sum(n for k, n in w.stats()["sender_dropped"].items() if k.startswith(text))


def wait_for(cond, timeout: float = 30.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_a_known_key_is_served_and_an_unknown_one_gets_nothing(curved, certs):
    """A gateway and a receiver with keys the worker admits: rows correct, statuses heard
    on the receiver's CURVE status socket. A stranger's key, and a peer without CURVE,
    are refused at the handshake: no room, no registration."""
    w = curved()
    made = curved.made
    stranger_keys = curve.peer_keys(certs["stranger"], certs["worker_public"])
    lost = next(_rooms)
    next(_rooms)  # lost + 1 too
    gateway = Client(w.cfg.intake, None)  # builds the messages only
    made.append(gateway)
    for n, keys in enumerate([stranger_keys, None]):
        p = Pusher(w.cfg.intake, keys)
        made.append(p)
        p.send(gateway.message(lost + n, "stranger", [Item("image", *image(n))], inline=True))
        assert p.refused(), "intake"
        p = Pusher(w.cfg.bootstrap, keys)
        made.append(p)
        p.send({"v": 1, "type": "register", "receiver": f"intruder-{n}", "session": "127.0.0.1:1",
                "status": "tcp://127.0.0.1:1"})
        assert p.refused(), "bootstrap"

    client = Client(w.cfg.intake, None, **peer(certs, "gateway"))
    rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=4 << 20, **peer(certs, "rx"))
    made += [client, rx]
    serve_one(client, rx, next(_rooms), 3)
    rooms = w.runtime.rooms
    assert rooms.find(lost) is None and rooms.find(lost + 1) is None
    stats = w.stats()
    assert stats["receivers_registered"] == 1 and not stats["sender_dropped"], stats["sender_dropped"]


def test_a_receiver_id_is_its_first_keys(curved, certs):
    """A peer with another admitted key cannot register, alloc or cancel under a receiver
    id registered under the first key: each is refused and counted, and the owner is
    served as if nothing happened; in the pipeline the binding outlives a sender SIGKILLed,
    and a reaper SIGKILLed still tells the owner over CURVE."""
    w = curved(bootstrap_timeout_s=30.0)
    made = curved.made
    client = Client(w.cfg.intake, None, **peer(certs, "gateway"))
    owner = Receiver("shared-id", w.cfg.bootstrap, buffer_bytes=4 << 20, **peer(certs, "rx"))
    made += [client, owner]
    serve_one(client, owner, next(_rooms), 1)  # registered under its key

    thief = zmq.Context.instance().socket(zmq.PUSH)
    thief.setsockopt(zmq.LINGER, 0)
    curve.connect_as(thief, *curve.peer_keys(certs["other"], certs["worker_public"]))
    thief.connect(w.cfg.bootstrap)
    made.append(thief)
    kinds = ("register", "alloc", "cancel")

    def steal_then_serve() -> None:
        """The thief's register, alloc and cancel under the owner's id for a room of the
        owner's, refused; then the owner's own alloc for it is written and told."""
        room = next(_rooms)
        it = Item("image", *image(room % 7))
        client.encode(room, "victim", [it], inline=True)
        base = {"v": 1, "receiver": "shared-id"}
        thief.send(wire.encode({**base, "type": "register", "session": "127.0.0.1:1",
                                "status": "tcp://127.0.0.1:1"}))
        thief.send(wire.encode({**base, "type": "alloc", "room": room, "item": 0, "dst": owner.address,
                                "dst_deepstack": owner.address + 4096, "row_start": 0, "n_rows": 4,
                                "fanout": 1, **SPAN4}))
        thief.send(wire.encode({**base, "type": "cancel", "room": room}))
        wait_for(lambda: all(dropped(w, f"{k} naming a receiver registered under another key") == 1
                             for k in kinds), what="the thief's messages were not refused")
        owner.alloc(room, 0, **SPAN4)
        assert owner.wait({room: 1}, 60) and room not in owner.failed, owner.failed.get(room)
        main, deep = expected_sim_rows(it.pixels, "image", 4, 64, 32, "bfloat16")
        got_main, got_deep = owner.rows(room, 0)
        assert np.array_equal(got_main, main) and np.array_equal(got_deep, deep)
        owner.release(room)

    steal_then_serve()
    if curved.mode == "pipeline":  # the binding lives with the registration, in shared memory
        os.kill(w.runtime.procs["sender"].pid, signal.SIGKILL)
        wait_for(lambda: w.runtime.restart_counts["sender"] >= 1, 60, "the sender was not restarted")
        steal_then_serve()  # the new sender's counters start at 0
        # A restarted reaper reads the owner's key back with its registration and connects
        # to the owner's status socket with it as the server's key, or the owner hears nothing.
        os.kill(w.runtime.procs["reaper"].pid, signal.SIGKILL)
        wait_for(lambda: w.runtime.restart_counts["reaper"] >= 1, 60, "the reaper was not restarted")
    serve_one(client, owner, next(_rooms), 3)  # still registered where it said


FLOOD = 4200  # past the shared table's 4,096 registrations: before the per-key bound, another key's gave way


def test_one_keys_flood_never_evicts_another_keys_registration(curved, certs):
    """An admitted key registers thousands of ids, then names another key's idle receiver
    in a register and in a self-describing alloc: its flood gives way among its own
    registrations only (max_receivers_per_key), the other key's registration stays,
    both attempts on its id are refused, and its owner is served. (Before: the flood
    pushed the owner's idle registration out of the full table and the thief's register
    took the id.)"""
    w = curved()
    made = curved.made
    client = Client(w.cfg.intake, None, **peer(certs, "gateway"))
    owner = Receiver("victim", w.cfg.bootstrap, buffer_bytes=4 << 20, **peer(certs, "rx"))
    made += [client, owner]
    serve_one(client, owner, next(_rooms), 1)  # registered, and now idle
    thief = Pusher(w.cfg.bootstrap, curve.peer_keys(certs["other"], certs["worker_public"]))
    made.append(thief)
    send = lambda msg: thief.sock.send(wire.encode(msg))  # noqa: E731 (waits for room: every message counts)
    reg = {"v": 1, "type": "register", "session": "127.0.0.1:1", "status": "tcp://127.0.0.1:1"}
    for n in range(FLOOD):
        send({**reg, "receiver": f"flood-{n}"})
    send({**reg, "receiver": "victim"})
    send({**reg, "type": "alloc", "receiver": "victim", "room": next(_rooms), "item": 0, "dst": 4096,
                "dst_deepstack": 8192, "row_start": 0, "n_rows": 4, "fanout": 1, "incarnation": 1, **SPAN4})
    send({"v": 1, "type": "the end"})  # read in order: the whole flood was read before it
    wait_for(lambda: dropped(w, "bootstrap message: bootstrap takes") == 1, 60, "the flood was not read")
    stats = w.stats()
    assert dropped(w, "register naming a receiver registered under another key") == 1, stats["sender_dropped"]
    assert dropped(w, "alloc naming a receiver registered under another key") == 1, stats["sender_dropped"]
    per_key = w.cfg.max_receivers_per_key
    assert stats["receivers_registered"] == 1 + per_key and stats["receivers_evicted"] == FLOOD - per_key, stats
    serve_one(client, owner, next(_rooms), 2)


def test_a_receivers_status_socket_admits_the_worker_alone(certs):
    """Statuses come from the worker's key only: another admitted peer's key, and a peer
    without CURVE, never reach the receiver."""
    rx = Receiver("rx", f"tcp://127.0.0.1:{free_port()}", buffer_bytes=1 << 20, **peer(certs, "rx"))
    forgers = []
    try:
        for keys in (curve.peer_keys(certs["other"], certs["worker_public"]), None):
            forger = Pusher(rx.status_endpoint, None if keys is None else (keys[0], curve.load_public(certs["rx"])))
            forgers.append(forger)
            forger.send({"v": 1, "type": "status", "room": 1, "item": None, "state": "failed", "reason": "forged"})
            assert forger.refused()
        assert rx.poll(0.2) == [] and not rx.dropped and not rx.early_failed
    finally:
        for forger in forgers:
            forger.close()
        rx.close()


# ---------------------------------------------------------------- the command line

def _serve_argv(shm_prefix, tmp_path, bootstrap: str, *extra) -> list[str]:
    return ["serve", "--mode", "inprocess", "--tower", "sim", "--shm-prefix", shm_prefix,
            "--run-dir", str(tmp_path), "--bootstrap", bootstrap, "--pixel-arena-bytes", str(4 << 20),
            "--embedding-arena-bytes", str(4 << 20), "--arena-cache-bytes", str(1 << 20),
            "--host-cache-bytes", str(1 << 20), *extra]


def test_off_loopback_without_curve_exits_2_and_says_how(shm_prefix, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    p = subprocess.run([sys.executable, "run.py", *_serve_argv(shm_prefix, tmp_path, "tcp://0.0.0.0:17699")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    err = " ".join(p.stderr.split())
    assert p.returncode == 2, p.stderr
    assert "bootstrap 'tcp://0.0.0.0:17699' is not loopback or ipc://" in err, err
    assert "curve_cert and curve_clients" in err and "--allow-insecure-network" in err, err


def _exits(argv, capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("how", ["allow-insecure-network", "curve", "bad certificate"])
def test_off_loopback_passes_with_the_flag_or_curve(how, shm_prefix, tmp_path, certs, capsys, monkeypatch):
    """Past the check, the worker goes on to bind, which fails on a port taken here (exit
    3: could not start) rather than serving; a certificate that cannot be read is exit 2."""
    for name in [n for n in os.environ if n.startswith("EPD_")]:
        monkeypatch.delenv(name)
    extra = {"allow-insecure-network": ["--allow-insecure-network"],
             "curve": ["--curve-cert", certs["worker"], "--curve-clients", certs["clients"]],
             "bad certificate": ["--curve-cert", certs["worker_public"], "--curve-clients", certs["clients"]]}[how]
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        bootstrap = f"tcp://0.0.0.0:{taken.getsockname()[1]}"
        code, err = _exits(_serve_argv(shm_prefix, tmp_path, bootstrap, *extra), capsys)
    if how == "bad certificate":
        assert code == 2 and "holds no secret key" in err, err
    else:
        assert code == 3 and "could not start" in err and "is not loopback" not in err, (code, err)


@pytest.mark.parametrize("front", ["tokenspeed_bootstrap", "tokenspeed_grpc"])
def test_a_tokenspeed_front_with_curve_is_refused_and_says_why(front, shm_prefix, tmp_path, certs, capsys,
                                                               monkeypatch):
    """tokenspeed's wire has no keys: its fronts would let unauthenticated peers in past
    CURVE, so the combination is refused at the start (exit 2), naming the setting.
    (Before: the worker served, and the fronts' frames were refused at CURVE's handshake
    without a word.)"""
    for name in [n for n in os.environ if n.startswith("EPD_")]:
        monkeypatch.delenv(name)
    argv = _serve_argv(shm_prefix, tmp_path, f"tcp://127.0.0.1:{free_port()}", "--curve-cert", certs["worker"],
                       "--curve-clients", certs["clients"], f"--{front.replace('_', '-')}",
                       f"127.0.0.1:{free_port()}")
    code, err = _exits(argv, capsys)
    err = " ".join(err.split())
    assert code == 2 and f"{front} cannot be combined with curve_cert" in err, (code, err)


def test_certificate_files_are_checked_where_they_are_given(certs, tmp_path):
    """Both files or neither; a public certificate where a secret one is needed, or a
    directory of no certificates, is refused with a reason (exit 2 at the worker)."""
    with pytest.raises(ValueError, match="go together"):
        Client("ipc:///nowhere", None, curve_cert=certs["gateway"])
    with pytest.raises(ValueError, match="go together"):
        Receiver("rx", "tcp://127.0.0.1:1", buffer_bytes=1 << 20, worker_cert=certs["worker_public"])
    with pytest.raises(ValueError, match="holds no secret key"):
        curve.load_keypair(certs["worker_public"])
    with pytest.raises(ValueError, match="cannot read"):
        curve.load_public(str(tmp_path / "missing.key"))
    with pytest.raises(ValueError, match="holds no public CurveZMQ certificate"):
        curve.load_allowed(str(tmp_path))
    assert len(curve.load_allowed(certs["clients"])) == 3


# ---------------------------------------------------------------- rooms belong to keys (#32)

def heard(rx: Receiver, rooms, timeout: float = 30.0) -> dict:
    """room -> the reason of the `failed` status `rx` heard for it, allocated there or not
    (a query of a room it never allocated for is kept aside as `early_failed`)."""
    end = time.monotonic() + timeout
    while True:
        rx.poll(0.05)
        got = {r: rx.failed.get(r) or (rx.early_failed.get(r) or {}).get("reason") for r in rooms}
        if all(got.values()) or time.monotonic() > end:
            return got


def test_a_room_is_its_gateways_and_the_receivers_it_names(curved, certs):
    """Another admitted key cannot alloc into a room (named receivers, protocol 1.2, or a
    room claimed by its first alloc), cancel it, nor query it: each is refused, counted,
    and answered exactly as a room the worker never saw ("unknown room"); the room's own
    receiver is served its rows. (Before: the thief's alloc took the rows and the rightful
    receiver heard "room already concluded"; its cancel failed the room; its query told
    why another tenant's room failed.)"""
    w = curved(bootstrap_timeout_s=2.0)
    made = curved.made
    client = Client(w.cfg.intake, None, **peer(certs, "gateway"))
    rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=4 << 20, **peer(certs, "rx"))
    thief = Receiver("thief", w.cfg.bootstrap, buffer_bytes=4 << 20, **peer(certs, "other"))
    made += [client, rx, thief]
    rx_key = curve.load_public(certs["rx"]).decode()  # protocol 1.2: the room is this receiver's
    named, claimed, canceled, failed, never, never_q = (next(_rooms) for _ in range(6))
    items = {room: Item("image", *image(room % 7)) for room in (named, claimed, canceled)}

    # Named: the thief allocs first, for the whole item; then the room's receiver.
    client.send({**client.message(named, "named", [items[named]], inline=True), "receivers": [rx_key]})
    thief.alloc(named, 0, **SPAN4)
    thief.alloc(never, 0, **SPAN4)  # a room nobody opened: what a refused alloc must look like
    wait_for(lambda: w.stats().get("sender_refused", {}).get("alloc") == 1 or thief.poll(0.05) or named in thief.failed
             or (named, 0) in thief.success, what="the thief's alloc was neither refused nor served")
    # Claimed: the receiver's alloc claims it; the thief's, once the room succeeded, is refused.
    client.encode(claimed, "claimed", [items[claimed]], inline=True)
    rx.alloc(claimed, 0, **SPAN4)
    assert rx.wait({claimed: 1}, 60)
    thief.alloc(claimed, 0, **SPAN4)
    # Cancel: the thief cancels a room named for rx before rx allocs.
    client.send({**client.message(canceled, "canceled", [items[canceled]], inline=True), "receivers": [rx_key]})
    wait_for(lambda: room_entry(w, canceled) is not None, what="the room was not opened")  # else: an unknown room's
    thief.cancel(canceled)
    wait_for(lambda: w.stats().get("sender_refused", {}).get("cancel") == 1
             or getattr(room_entry(w, canceled), "reason", "") == "canceled",
             what="the thief's cancel was neither refused nor obeyed")
    rx.alloc(named, 0, **SPAN4)
    rx.alloc(canceled, 0, **SPAN4)
    assert rx.wait({named: 1, canceled: 1}, 60)
    for room in (named, claimed, canceled):
        assert room not in rx.failed, (room, rx.failed[room])
        main, deep = expected_sim_rows(items[room].pixels, "image", 4, 64, 32, "bfloat16")
        got_main, got_deep = rx.rows(room, 0)
        assert np.array_equal(got_main, main) and np.array_equal(got_deep, deep), room
        rx.release(room)

    # Query: a room that failed at intake (its reason is its tenant's), and one never seen.
    client.send({"v": 1, "type": "encode", "request_id": "secret reason", "room": failed, "items": []})
    wait_for(lambda: room_entry(w, failed) is not None, what="the bad request was not recorded")
    thief.query(failed)
    thief.query(never_q)
    got = heard(thief, [named, never, claimed, failed, never_q], 60)
    assert got == {named: "unknown room", never: "unknown room", claimed: "unknown room",
                   failed: "unknown room", never_q: "unknown room"}, got
    assert not any(thief.success), thief.success
    refused = lambda: w.stats().get("sender_refused")  # noqa: E731 (the pipeline's stats come a little later)
    wait_for(lambda: refused() == {"alloc": 2, "cancel": 1, "query": 1}, what=f"refusals counted: {refused()}")
    counters = metrics.totals_of(w.stats()).counters
    assert [counters[("epd_refused_total", (k,))] for k in ("alloc", "cancel", "query")] == [2, 1, 1]


def room_entry(w, room: int):
    rooms = w.runtime.rooms
    slot = rooms.find(room)
    return None if slot is None else rooms.get(slot)


def test_an_alloc_held_across_a_sender_restart_keeps_its_key(shm_prefix, tmp_path, certs):
    """An alloc for a room not yet opened is held in shared memory with the key it came
    under: the sender that succeeds a SIGKILLed one checks it against the room's keys when
    the room opens, and the thief still gets no row. (A held alloc without its key would
    pass as no-CURVE's, anyone's.)"""
    w = start_worker("pipeline", sim_config(shm_prefix, tmp_path, curve_cert=certs["worker"],
                                            curve_clients=certs["clients"], bootstrap_timeout_s=30.0))
    made = [w]
    try:
        client = Client(w.cfg.intake, None, **peer(certs, "gateway"))
        rx = Receiver("rx", w.cfg.bootstrap, buffer_bytes=4 << 20, **peer(certs, "rx"))
        thief = Receiver("thief", w.cfg.bootstrap, buffer_bytes=4 << 20, **peer(certs, "other"))
        made += [client, rx, thief]
        room = next(_rooms)
        thief.alloc(room, 0, **SPAN4)
        wait_for(lambda: w.stats().get("sender_held_allocs") == 1, what="the thief's alloc was not held")
        os.kill(w.runtime.procs["sender"].pid, signal.SIGKILL)
        wait_for(lambda: w.runtime.restart_counts["sender"] >= 1, 60, "the sender was not restarted")
        it = Item("image", *image(5))
        key = curve.load_public(certs["rx"]).decode()
        client.send({**client.message(room, "after", [it], inline=True), "receivers": [key]})
        written = lambda: thief.poll(0.05) is not None and (room, 0) in thief.success  # noqa: E731
        wait_for(lambda: w.stats().get("sender_refused", {}).get("alloc") == 1 or written(), 60,
                 "the held alloc was neither refused nor written")
        rx.alloc(room, 0, **SPAN4)
        assert rx.wait({room: 1}, 60) and room not in rx.failed, rx.failed.get(room)
        main, deep = expected_sim_rows(it.pixels, "image", 4, 64, 32, "bfloat16")
        got_main, got_deep = rx.rows(room, 0)
        assert np.array_equal(got_main, main) and np.array_equal(got_deep, deep)
        assert not thief.success, thief.success
    finally:
        for obj in reversed(made):
            obj.close()
