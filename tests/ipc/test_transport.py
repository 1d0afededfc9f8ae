"""ipc.transport against the real Mooncake engine over loopback TCP (no mocks).

The receiver runs in a spawned child process, as a prefill rank would: it registers
a buffer (numpy or a shared-memory segment), reports its session and address over a
pipe, and checks the bytes the parent wrote against the pattern it was told.
"""
from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from ipc import shm
from ipc.transport import Engine, Pending, TransportError

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                       reason="the Mooncake transfer engine is not installed"),
    pytest.mark.timeout(120),
]

MB18 = 1_800_000
RECV_SIZE = 32 << 20
CTX = mp.get_context("spawn")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# -- the receiver (child process) -------------------------------------------------

def _receiver_main(conn, size: int, shm_name: str | None, env: dict) -> None:
    os.environ.update(env)
    seg = None
    try:
        eng = Engine("127.0.0.1", "tcp")
        if shm_name:
            seg = shm.Segment.attach(shm_name)
            buf = np.frombuffer(seg.buf, np.uint8)
        else:
            buf = np.zeros(size, np.uint8)
        buf[:] = 0                                     # pre-fault every page
        addr = buf.ctypes.data
        eng.register(addr, buf.nbytes)
        conn.send(("ready", eng.session, addr, buf.nbytes))
    except Exception as e:  # report, so the parent fails with the reason
        conn.send(("error", repr(e), 0, 0))
        return
    while True:
        msg = conn.recv()
        op = msg[0]
        if op == "check":                # ("check", [(offset, seed, n), ...])
            bad = []
            for off, seed, n in msg[1]:
                got = buf[off:off + n]
                want = pattern(seed, n)
                if not np.array_equal(got, want):
                    diff = np.flatnonzero(got != want)
                    bad.append((off, n, int(diff.size), int(diff[0])))
            conn.send(("checked", bad))
        elif op == "zero":
            buf[:] = 0
            conn.send(("zeroed",))
        elif op == "unregister":
            eng.unregister(addr)
            conn.send(("unregistered",))
        elif op == "quit":
            eng.close()
            del buf
            if seg is not None:
                seg.close()
            conn.send(("bye",))
            return


class Receiver:
    def __init__(self, size: int = RECV_SIZE, shm_name: str | None = None, env: dict | None = None):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_receiver_main, args=(child, size, shm_name, env or {}),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            self.kill()
            raise AssertionError("receiver did not start within 60 s")
        kind, self.session, self.addr, self.size = self.conn.recv()
        assert kind == "ready", f"receiver failed to start: {self.session}"

    def call(self, *msg, timeout: float = 30):
        self.conn.send(msg)
        assert self.conn.poll(timeout), f"receiver did not answer {msg[0]!r}"
        return self.conn.recv()

    def check(self, regions) -> list:
        return self.call("check", list(regions))[1]

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("quit", timeout=15)
            except (AssertionError, OSError, EOFError):
                pass
        self.kill()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def sender():
    e = Engine("127.0.0.1", "tcp")
    yield e
    e.close(timeout=30)


@pytest.fixture
def src():
    """Source bytes: region i of size n at offset off holds pattern(seed=off, n)."""
    return np.empty(RECV_SIZE, np.uint8)


def fill(src: np.ndarray, off: int, n: int, seed: int) -> int:
    src[off:off + n] = pattern(seed, n)
    return src.ctypes.data + off


# -- tests -------------------------------------------------------------------------

def test_engine_session_and_registrations():
    buf = np.zeros(1 << 20, np.uint8)
    a = buf.ctypes.data
    with Engine() as e:
        host, port = e.session.rsplit(":", 1)
        assert host == "127.0.0.1" and 0 < int(port) < 65536
        e.register(a, 4096)
        e.register(a + 8192, 4096)
        assert e.registered == {a: 4096, a + 8192: 4096}
        with pytest.raises(TransportError, match="overlaps"):
            e.register(a + 1024, 4096)
        with pytest.raises(TransportError, match="positive"):
            e.register(a, 0)
        e.unregister(a)
        with pytest.raises(TransportError, match="not registered"):
            e.unregister(a)
        assert e.registered == {a + 8192: 4096}
    assert e.registered == {}                       # close() unregistered the rest
    with pytest.raises(TransportError, match="closed"):
        e.register(a, 4096)
    with pytest.raises(TransportError, match="closed"):
        e.submit("127.0.0.1:1", [a], [a], [1])


@pytest.mark.parametrize("kind", ["numpy", "shm"])
def test_sync_and_async_writes_land_exactly(kind, sender, src, shm_prefix):
    seg = None
    if kind == "shm":
        seg = shm.Segment.create(shm.object_name(shm_prefix, shm.new_run_id(), "recv"), RECV_SIZE)
    try:
        rx = Receiver(shm_name=seg.name if seg else None)
        try:
            _exercise_writes(rx, sender, src)
        finally:
            rx.close()
    finally:
        if seg is not None:
            seg.close()
            seg.unlink()


def _exercise_writes(rx: Receiver, sender: Engine, src: np.ndarray) -> None:
    D = rx.addr
    # Synchronous writes of several sizes, including 1.8 MB and odd lengths.
    regions, off = [], 0
    for n in (1, 7, 4096, 65_537, MB18, 3 * MB18 + 5):
        s = fill(src, off, n, seed=off + 1)
        sender.write(rx.session, s, D + off, n)
        regions.append((off, off + 1, n))
        off += n + 13
    assert rx.check(regions) == []

    # One async batch: main and "deepstack" halves of different sizes.
    rx.call("zero")
    s1 = fill(src, 0, MB18, seed=101)
    s2 = fill(src, MB18, 300_000, seed=102)
    p = sender.submit(rx.session, [s1, s2], [D + 5 * MB18, D + 1000], [MB18, 300_000])
    assert isinstance(p, Pending)
    assert p.wait(30), p.error
    assert p.poll() is True and p.error == ""
    assert rx.check([(5 * MB18, 101, MB18), (1000, 102, 300_000)]) == []

    # A batch of many small writes, and several 1.8 MB batches in flight at once.
    rx.call("zero")
    many = [(i * 40_000, 7_000 + i * 100) for i in range(96)]        # (offset, length)
    srcs = [fill(src, o, n, seed=500 + i) for i, (o, n) in enumerate(many)]
    p_many = sender.submit(rx.session, srcs, [D + o for o, _ in many], [n for _, n in many])
    big_base = 4 << 20
    pend = []
    for k in range(6):
        o = big_base + k * 2 * MB18
        a = fill(src, o, MB18, seed=900 + 2 * k)
        b = fill(src, o + MB18, MB18, seed=901 + 2 * k)
        pend.append(sender.submit(rx.session, [a, b], [D + o, D + o + MB18], [MB18, MB18]))
    deadline = time.monotonic() + 60
    while any(q.poll() is None for q in [p_many, *pend]) and time.monotonic() < deadline:
        time.sleep(0.001)
    for q in [p_many, *pend]:
        assert q.poll() is True, q.error
    expect = [(o, 500 + i, n) for i, (o, n) in enumerate(many)]
    for k in range(6):
        o = big_base + k * 2 * MB18
        expect += [(o, 900 + 2 * k, MB18), (o + MB18, 901 + 2 * k, MB18)]
    assert rx.check(expect) == []

    # Zero-length entries and an empty batch complete without touching the peer.
    assert sender.submit(rx.session, [], [], []).wait(10)
    assert sender.submit(rx.session, [src.ctypes.data], [D], [0]).wait(10)


def test_write_outside_registered_memory_fails(receiver, sender, src):
    s = fill(src, 0, 8192, seed=7)
    past_end = receiver.addr + receiver.size - 4096           # straddles the end
    with pytest.raises(TransportError, match=receiver.session):
        sender.write(receiver.session, s, past_end, 8192)
    p = sender.submit(receiver.session, [s, s], [receiver.addr, receiver.addr + (1 << 40)],
                      [8192, 8192])
    assert p.wait(30) is False
    assert p.poll() is False and receiver.session in p.error
    # The receiver is unharmed and still takes valid writes.
    sender.write(receiver.session, s, receiver.addr + 64, 8192)
    assert receiver.check([(64, 7, 8192)]) == []


def test_a_tcp_source_is_not_registered_and_no_peer_reaches_it(receiver, sender, src):
    """Over TCP a write needs only its destination registered: the source is not, so
    a stranger's engine finds nothing of the sender's to read or write."""
    from mooncake.engine import TransferEngine

    s = fill(src, 0, 65_537, seed=21)
    sender.register_source(src.ctypes.data, src.nbytes)
    assert sender.registered == {}
    sender.write(receiver.session, s, receiver.addr + 5, 65_537)
    assert receiver.check([(5, 21, 65_537)]) == []

    stranger = TransferEngine()
    assert stranger.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert stranger.send_probe(sender.session) == 0                  # the session answers
    assert stranger.get_first_buffer_address(sender.session) == 0    # with no buffer
    stolen = np.zeros(4096, np.uint8)
    assert stranger.transfer_sync_read(sender.session, stolen.ctypes.data, s, 4096) != 0
    assert not stolen.any()
    forged = np.full(4096, 0xA5, np.uint8)
    assert stranger.transfer_sync_write(sender.session, forged.ctypes.data, s, 4096) != 0
    assert np.array_equal(src[:65_537], pattern(21, 65_537))
    sender.close(timeout=30)
    with pytest.raises(TransportError, match="closed"):
        sender.register_source(s, 4096)


def test_unregistered_region_rejects_writes(receiver, sender, src):
    s = fill(src, 0, 4096, seed=3)
    sender.write(receiver.session, s, receiver.addr, 4096)
    receiver.call("unregister")
    with pytest.raises(TransportError):
        sender.write(receiver.session, s, receiver.addr, 4096)


def test_dead_peer_fails_in_bounded_time(sender, src):
    s = fill(src, 0, MB18, seed=11)
    rx = Receiver()
    try:
        sender.write(rx.session, s, rx.addr, MB18)      # connected, then the peer dies
        rx.kill()
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=rx.session):
            sender.write(rx.session, s, rx.addr, MB18)
        p = sender.submit(rx.session, [s, s], [rx.addr, rx.addr + MB18], [MB18, MB18])
        assert p.wait(60) is False
        assert p.poll() is False and p.error
        assert time.monotonic() - t0 < 60
    finally:
        rx.close()

    # A peer that died before we ever reached it: the session cannot be opened.
    rx2 = Receiver()
    rx2.kill()
    p = sender.submit(rx2.session, [s], [rx2.addr], [MB18])
    assert p.wait(60) is False
    assert "unreachable" in p.error
    with pytest.raises(TransportError, match="unreachable"):
        sender.write(rx2.session, s, rx2.addr, MB18)


def test_stalled_peer_fails_after_progress_timeout(monkeypatch, src):
    # The timeout is read from the environment when an engine is created.
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "30")
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "30")
    s = fill(src, 0, 4 << 20, seed=5)
    rx = Receiver()
    eng = Engine(progress_timeout_s=2)
    try:
        eng.write(rx.session, s, rx.addr, 4096)
        os.kill(rx.proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        p = eng.submit(rx.session, [s] * 3, [rx.addr, rx.addr + (4 << 20), rx.addr + (8 << 20)],
                       [4 << 20] * 3)
        assert p.wait(60) is False
        assert p.poll() is False and p.error
    finally:
        if rx.proc.is_alive():
            os.kill(rx.proc.pid, signal.SIGCONT)
        rx.close()
        eng.close(timeout=30)


@pytest.mark.parametrize("session", ["127.0.0.1:1", "no-such-host.invalid:1234", "garbage"])
def test_bad_session(sender, src, session):
    s = fill(src, 0, 4096, seed=1)
    p = sender.submit(session, [s], [0x10000], [4096])
    assert p.wait(30) is False
    assert p.poll() is False and "unreachable" in p.error
    with pytest.raises(TransportError, match="unreachable"):
        sender.write(session, s, 0x10000, 4096)


def test_bad_arguments(sender, src):
    with pytest.raises(TransportError, match="differ"):
        sender.submit("127.0.0.1:1", [1, 2], [1], [1, 1])
    with pytest.raises(TransportError, match="bad write"):
        sender.submit("127.0.0.1:1", [src.ctypes.data], [0], [16])
    with pytest.raises(TransportError, match="session"):
        sender.write("", src.ctypes.data, 0x1000, 16)


def test_init_failures_are_readable():
    with pytest.raises(TransportError, match="unknown Mooncake protocol 'bogus'"):
        Engine(protocol="bogus")
    with pytest.raises(TransportError, match="does not resolve"):
        Engine(hostname="no-such-host.invalid")
    with pytest.raises(TransportError, match="bare host"):
        Engine(hostname="127.0.0.1:5000")
    try:
        Engine(protocol="rdma").close()          # a machine with RDMA devices
    except TransportError as e:
        assert "no RDMA devices" in str(e)


def test_missing_library_is_a_transport_error(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)   # makes the import fail
    with pytest.raises(TransportError, match="not installed"):
        Engine()


def _init_in_child(conn, env):
    os.environ.update(env)
    try:
        Engine().close()
        conn.send("ok")
    except TransportError as e:
        conn.send(f"TransportError: {e}")
    except Exception as e:
        conn.send(f"other: {e!r}")


def _free_low_port() -> int:
    rng = np.random.default_rng()
    for _ in range(200):
        port = int(rng.integers(20_000, 32_000))
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port below 32000")


def test_library_init_failure_is_a_transport_error():
    # One allowed port: the RPC server takes it and the TCP data server finds none.
    # (The library ignores a range above ~32k, so pick a free port below it.)
    port = _free_low_port()
    env = {"MC_MIN_RPC_PORT": str(port), "MC_MAX_RPC_PORT": str(port)}
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_init_in_child, args=(child, env), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "child did not report"
        msg = parent.recv()
    finally:
        proc.join(15)
        if proc.is_alive():
            proc.kill()
    assert msg.startswith("TransportError:") and "initialize" in msg and "failed" in msg, msg


def test_engine_refuses_use_after_fork(sender, src):
    pid = os.fork()
    if pid == 0:                                  # child: never returns into pytest
        code = 3
        try:
            sender.submit("127.0.0.1:1", [src.ctypes.data], [0x1000], [16])
        except TransportError as e:
            code = 0 if "fork" in str(e) else 4
        except BaseException:
            code = 5
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


_LOGGING_SCRIPT = """
import logging, sys
import numpy as np
logging.basicConfig(level=sys.argv[1])
from ipc.transport import Engine, TransportError
e = Engine("127.0.0.1")
buf = np.zeros(4096, np.uint8)
try:
    e.write("127.0.0.1:" + sys.argv[2], buf.ctypes.data, buf.ctypes.data, 16)
except TransportError:
    pass
e.close()
"""


@pytest.mark.parametrize("level", ["DEBUG", "WARNING", "CRITICAL"])
def test_mooncake_logs_follow_the_python_log_level(level):
    """A healthy start says nothing above DEBUG (not the error-level "Local segment
    descriptor not found" every start logs); a failed handshake's detail shows up to
    ERROR; at DEBUG everything Mooncake says."""
    with socket.socket() as s:  # a port nobody listens on: the write fails at the handshake
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MC_", "GLOG_"))}
    p = subprocess.run([sys.executable, "-c", _LOGGING_SCRIPT, level, str(dead)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    healthy = ["Local segment descriptor not found", "Transfer Engine RPC using P2P handshake"]
    failed = f"connect()127.0.0.1:{dead}: Connection refused"
    said = [text for text in healthy + [failed] if text in p.stderr]
    assert said == {"DEBUG": healthy + [failed], "WARNING": [failed], "CRITICAL": []}[level], p.stderr
