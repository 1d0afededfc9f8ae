"""Under a process supervisor: the systemd notify protocol (pipeline/ops/notify.py), the HTTP
probes next to /metrics (pipeline/ops/metrics.py), `run.py serve` speaking both to a fake
systemd, and a demo whose stderr holds no line of Mooncake's at the default log level."""
from __future__ import annotations

import json
import os
import re
import socket
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from pipeline.peers.client import Client, Item
from pipeline.ops.metrics import MetricsServer, Snapshot, Totals
from pipeline.ops.notify import Notifier
from pipeline.peers.receiver import Receiver
from tests.helpers import free_port, image, with_sim_tower

pytestmark = pytest.mark.timeout(180)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# glog's line prefix (severity, date, time, thread, file:line]) and its one-off warning.
MOONCAKE_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] |InitGoogleLogging")


# ------------------------------------------------------------------ notify
class Manager:
    """Plays systemd's side: a datagram socket bound at a path or an abstract name."""

    def __init__(self, where: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(where.replace("@", "\0", 1) if where.startswith("@") else where)
        self.sock.settimeout(5)
        self.env = where

    def next(self) -> list[str]:
        return self.sock.recv(4096).decode().split("\n")

    def nothing(self) -> bool:
        self.sock.settimeout(0.2)
        try:
            self.sock.recv(4096)
            return False
        except TimeoutError:
            return True
        finally:
            self.sock.settimeout(5)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=["path", "abstract"])
def manager(request, tmp_path):
    m = Manager(str(tmp_path / "notify") if request.param == "path"
                else f"@epd-test-{os.getpid()}-{free_port()}")
    yield m
    m.close()


def test_notifications_reach_a_path_or_an_abstract_socket(manager):
    n = Notifier({"NOTIFY_SOCKET": manager.env})
    assert n.enabled
    assert n.status("starting the tower stage")
    assert manager.next() == ["STATUS=starting the tower stage"]
    assert n.ready("serving\non two lines")
    assert manager.next() == ["READY=1", "STATUS=serving on two lines"]
    assert n.stopping("draining: 3 rooms in flight")
    assert manager.next() == ["STOPPING=1", "STATUS=draining: 3 rooms in flight"]


def test_without_a_manager_every_call_is_a_no_op():
    n = Notifier({"WATCHDOG_USEC": "2000000"})
    assert not n.enabled
    assert not n.ready() and not n.status("x") and not n.stopping()
    assert not n.watchdog({"tower": 0.0}, now=100.0)


def test_a_manager_gone_is_a_warning_not_a_crash(tmp_path, caplog):
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody")})
    assert not n.ready() and not n.status("x")
    assert len([r for r in caplog.records if "cannot notify" in r.message]) == 1  # once per outage


def test_watchdog_pings_every_half_interval_while_every_heartbeat_is_fresh(manager):
    n = Notifier({"NOTIFY_SOCKET": manager.env, "WATCHDOG_USEC": "4000000"})
    assert n.watchdog_s == 2.0
    fresh = {"intake": 0.1, "tower": 1.9}
    assert not n.watchdog(fresh, now=9.0)  # the manager arms its watchdog at READY=1
    assert n.ready() and manager.next()[0] == "READY=1"
    assert n.watchdog(fresh, now=10.0)
    assert manager.next() == ["WATCHDOG=1"]
    assert not n.watchdog(fresh, now=11.9)  # not due yet
    assert n.watchdog(fresh, now=12.0)
    assert manager.next() == ["WATCHDOG=1"]
    # A stage whose heartbeat is as old as the interval, or one not running, stops the pings...
    assert not n.watchdog({"intake": 0.1, "tower": 2.0}, now=14.5)
    assert not n.watchdog({"intake": 0.1, "tower": None}, now=20.0)
    assert manager.nothing()
    # ...until it (or its successor) beats again: then the ping is due at once.
    assert n.watchdog({"intake": 0.1, "tower": 0.05}, now=20.1)
    assert manager.next() == ["WATCHDOG=1"]


@pytest.mark.parametrize("env", [{}, {"WATCHDOG_USEC": "0"}, {"WATCHDOG_USEC": "5000000", "WATCHDOG_PID": "1"}])
def test_watchdog_off_unless_asked_of_this_process(env, manager):
    n = Notifier({"NOTIFY_SOCKET": manager.env, **env})
    assert n.watchdog_s is None
    assert n.ready() and manager.next()[0] == "READY=1"
    assert not n.watchdog({"tower": 0.0}, now=1.0)
    assert manager.nothing()


def test_watchdog_pid_of_this_process_is_honoured(manager):
    n = Notifier({"NOTIFY_SOCKET": manager.env, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())})
    n.ready()
    assert n.watchdog_s == 0.5 and n.watchdog({}, now=1.0)


def test_the_environment_is_taken_so_stage_processes_cannot_notify(monkeypatch, manager):
    monkeypatch.setenv("NOTIFY_SOCKET", manager.env)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    n = Notifier()
    assert n.enabled and n.watchdog_s == 0.5
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(os.environ)


# ------------------------------------------------------------------ probes
def get(server: MetricsServer, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def empty_snapshot() -> Snapshot:
    return Snapshot(totals=Totals(), stats={})


READY = dict(loop_alive=True, stages_ready=True, draining=False, restart_budget_left=True)
STATES = {
    # state: (conditions, /healthz status, /readyz status, /readyz failing)
    "ready": (READY, 200, 200, []),
    "starting": ({**READY, "stages_ready": False, "not_ready": ["tower"]}, 200, 503, ["stages_ready"]),
    "restarting a stage": ({**READY, "stages_ready": False, "not_ready": ["sender"]}, 200, 503, ["stages_ready"]),
    "draining": ({**READY, "draining": True}, 200, 503, ["draining"]),
    "restart budget spent": ({**READY, "restart_budget_left": False}, 200, 503, ["restart_budget_left"]),
    "loop stuck": ({**READY, "loop_alive": False}, 503, 503, ["loop_alive"]),
    "says nothing": ({}, 503, 503, list(READY)),
}


@pytest.fixture
def probed():
    state = {"conditions": READY}

    def health() -> dict:
        if isinstance(state["conditions"], Exception):
            raise state["conditions"]
        return state["conditions"]

    server = MetricsServer("127.0.0.1:0", empty_snapshot, health)
    yield server, state
    server.close()


def test_probes_answer_each_state(probed):
    server, state = probed
    for name, (conditions, live, ready, failing) in STATES.items():
        state["conditions"] = conditions
        code, body = get(server, "/healthz")
        assert code == live, (name, body)
        assert json.loads(body)["alive"] is (live == 200)
        code, body = get(server, "/readyz")
        doc = json.loads(body)
        assert code == ready and doc["ready"] is (ready == 200) and doc["failing"] == failing, (name, doc)
        if "not_ready" in conditions:
            assert doc["not_ready"] == conditions["not_ready"]  # detail passes through


def test_a_health_check_that_raises_answers_503_with_why(probed):
    server, state = probed
    state["conditions"] = RuntimeError("heartbeats unreadable")
    for path in ("/healthz", "/readyz"):
        code, body = get(server, path)
        assert code == 503 and "heartbeats unreadable" in json.loads(body)["error"]


def test_metrics_as_before_and_any_other_path_404(probed):
    server, _ = probed
    code, body = get(server, "/metrics")
    assert code == 200 and "epd_rooms_live 0.0" in body
    for path in ("/", "/metric", "/healthz/x", "/favicon.ico"):
        assert get(server, path)[0] == 404, path


def test_without_a_health_callable_there_are_no_probes():
    server = MetricsServer("127.0.0.1:0", empty_snapshot)
    try:
        assert get(server, "/metrics")[0] == 200
        assert get(server, "/healthz")[0] == 404 and get(server, "/readyz")[0] == 404
    finally:
        server.close()


# ------------------------------------------------------------------ quiet logs
def test_a_healthy_demo_writes_no_mooncake_line_at_the_default_level(shm_prefix, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_", "MC_", "GLOG_"))}
    p = subprocess.run([sys.executable, "run.py", "demo", "--shm-prefix", shm_prefix,
                        "--run-dir", str(tmp_path), "--bootstrap", f"tcp://127.0.0.1:{free_port()}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lines = p.stderr.replace("\r", "\n").splitlines()
    assert not [line for line in lines if MOONCAKE_LINE.search(line)], p.stderr[-3000:]


# ------------------------------------------------------------------ run.py serve under a fake systemd
class Listener:
    """A Manager whose datagrams a thread collects, each with the time it arrived."""

    def __init__(self, where: str):
        self.manager = Manager(where)
        self.got: list[tuple[float, list[str]]] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sock = self.manager.sock
        sock.settimeout(0.2)
        while sock.fileno() >= 0:
            try:
                lines = sock.recv(4096).decode().split("\n")
            except TimeoutError:
                continue
            except OSError:
                return
            with self.lock:
                self.got.append((time.monotonic(), lines))

    def times(self, line: str, since: float = 0.0) -> list[float]:
        with self.lock:
            return [t for t, lines in self.got if line in lines and t >= since]

    def wait(self, line: str, timeout: float, since: float = 0.0) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            hit = self.times(line, since)
            if hit:
                return hit[0]
            time.sleep(0.05)
        with self.lock:
            pytest.fail(f"no {line} within {timeout} s; got {self.got}")

    def close(self) -> None:
        self.manager.close()
        self.thread.join(5)


def probe_until(port: int, path: str, want, timeout: float = 60.0) -> tuple[int, dict]:
    """GET path until want(status, body) holds; the last answer."""
    end = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                answer = (r.status, json.loads(r.read()))
        except urllib.error.HTTPError as e:
            answer = (e.code, json.loads(e.read()))
        except OSError as e:  # not listening yet
            answer = (0, {"error": repr(e)})
        if want(*answer) or time.monotonic() > end:
            return answer
        time.sleep(0.05)


def stage_pids(prefix: str) -> dict[str, int]:
    p = subprocess.run([sys.executable, "run.py", "status", "--shm-prefix", prefix, "--json"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return {name: s["pid"] for name, s in json.loads(p.stdout)["runs"][0]["stages"].items()}


def encode_and_collect(w_intake, bootstrap, prefix, room: int, alloc: bool, hidden=64, deepstack=32):
    """One single-image room through a fresh client and receiver; (receiver, client)."""
    client = Client(w_intake, prefix)
    r = Receiver("rx", bootstrap, buffer_bytes=4 << 20)
    client.encode(room, f"req-{room}", [Item("image", *image(room, grid=(1, 4, 4)))])
    if alloc:
        r.alloc(room, 0, span=4, hidden=hidden, dtype="bfloat16", deepstack_width=deepstack)
    return r, client


@pytest.mark.parametrize("mode,where", [("pipeline", "path"), ("inprocess", "abstract")])
def test_serve_speaks_to_systemd_and_answers_probes(mode, where, shm_prefix, tmp_path):
    watchdog_s = 0.5  # WATCHDOG_USEC / 2
    listener = Listener(str(tmp_path / "notify") if where == "path"
                        else f"@epd-test-{os.getpid()}-{free_port()}")
    metrics = free_port()
    intake, bootstrap = f"ipc://{tmp_path}/intake.sock", f"tcp://127.0.0.1:{free_port()}"
    flags = dict(shm_prefix=shm_prefix, run_dir=str(tmp_path), intake=intake, bootstrap=bootstrap,
                 tower="sim", sim_hidden=64, sim_deepstack_width=32, sim_dtype="bfloat16",
                 pixel_arena_bytes=16 << 20, embedding_arena_bytes=16 << 20, arena_cache_bytes=4 << 20,
                 ring_bytes=1 << 20, max_tombstones=1024, max_live_rooms=256,
                 metrics_endpoint=f"127.0.0.1:{metrics}", heartbeat_timeout_s=3.0, drain_timeout_s=8.0,
                 bootstrap_timeout_s=30.0)
    flags = with_sim_tower(tmp_path, flags)  # the sim tower's settings: a file it reads
    cmd = [sys.executable, "run.py", "serve", "--mode", mode]
    for key, value in flags.items():
        cmd += ["--" + key.replace("_", "-"), str(value)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.update(NOTIFY_SOCKET=listener.manager.env, WATCHDOG_USEC=str(int(watchdog_s * 2e6)))
    made = []
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, env=env,
                                start_new_session=True)
    try:
        # Starting: the first answer says not ready (stages starting, or the loop not yet
        # turning), unless the stages were ready by then and READY=1 is on its way.
        starting = probe_until(metrics, "/readyz", lambda code, _: code != 0 or listener.times("READY=1"))
        ready_at = listener.wait("READY=1", 120)
        if starting[0] == 503:
            assert set(starting[1]["failing"]) <= {"stages_ready", "loop_alive"}, starting
        else:
            assert starting[0] in (0, 200), starting
        with listener.lock:
            along = [lines[0] for t, lines in listener.got if t < ready_at]
        assert along and all(line.startswith("STATUS=") for line in along), along

        # Ready: the first request sent the moment READY=1 arrived succeeds.
        r, client = encode_and_collect(intake, bootstrap, shm_prefix, 1, alloc=True)
        made += [r, client]
        assert r.wait({1: 1}, 30) and 1 not in r.failed and not r.violations
        assert probe_until(metrics, "/readyz", lambda code, _: code == 200)[0] == 200
        assert probe_until(metrics, "/healthz", lambda code, _: code == 200)[0] == 200

        # Keep-alives at half of WATCHDOG_USEC: about 3 s' worth, never faster than asked.
        t0 = time.monotonic()
        time.sleep(3.0)
        pings = listener.times("WATCHDOG=1", since=t0)
        assert len(pings) >= 2, pings  # a noisy machine may delay some; none may come early
        assert (pings[-1] - pings[0]) / (len(pings) - 1) >= watchdog_s * 0.9, pings

        if mode == "pipeline":
            # A hung stage stops the pings, and the probes say a stage is not ready while the
            # supervisor replaces it; the successor's heartbeats bring both back.
            pids = stage_pids(shm_prefix)
            os.kill(pids["scheduler"], signal.SIGSTOP)
            stopped_at = time.monotonic()
            not_ready = probe_until(metrics, "/readyz", lambda code, _: code == 503, timeout=30)
            assert not_ready[0] == 503 and not_ready[1]["failing"] == ["stages_ready"], not_ready
            assert probe_until(metrics, "/healthz", lambda code, _: code == 200)[0] == 200
            deadline = time.monotonic() + 60
            while stage_pids(shm_prefix)["scheduler"] == pids["scheduler"] and time.monotonic() < deadline:
                time.sleep(0.2)
            replaced_at = time.monotonic()
            assert stage_pids(shm_prefix)["scheduler"] != pids["scheduler"]
            listener.wait("WATCHDOG=1", 30, since=replaced_at)
            # The pings stopped soon after the SIGSTOP and stayed away until the successor
            # was ready: the heartbeat timeout (3 s) and a start later.
            pings = listener.times("WATCHDOG=1", since=stopped_at - 1.0)
            longest, began = max((b - a, a) for a, b in zip(pings, pings[1:]))
            assert longest >= 2.0 and began < stopped_at + 1.5, (stopped_at, pings)
            assert probe_until(metrics, "/readyz", lambda code, _: code == 200)[0] == 200
            r2, client2 = encode_and_collect(intake, bootstrap, shm_prefix, 2, alloc=True)
            made += [r2, client2]
            assert r2.wait({2: 1}, 30) and 2 not in r2.failed

        # Draining: a room that waits for its alloc keeps the drain going; SIGTERM says STOPPING=1.
        r3, client3 = encode_and_collect(intake, bootstrap, shm_prefix, 3, alloc=False)
        made += [r3, client3]
        time.sleep(0.5)  # let intake take it
        term_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        listener.wait("STOPPING=1", 30, since=term_at)
        draining = probe_until(metrics, "/readyz", lambda code, _: code == 503, timeout=10)
        assert draining[0] == 503 and "draining" in draining[1]["failing"], draining
        assert probe_until(metrics, "/healthz", lambda code, _: code == 200, timeout=5)[0] == 200
        assert proc.wait(60) == 0, open(tmp_path / "stderr").read()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for obj in reversed(made):
            obj.close()
        listener.close()
    assert not listener.times("READY=1", since=ready_at + 0.001), "READY=1 twice"


def _survives_being_interrupted_by_itself(handler, within: float = 30.0) -> bool:
    """Calls `handler` as a signal would, and at every line it (or what it calls) runs,
    calls it again, as a second signal arriving just then would: whether all of that
    finished. A handler that takes a lock deadlocks on the line that holds it."""
    def run() -> None:
        nesting = [False]

        def trace(frame, event, arg):
            if event == "line" and not nesting[0]:
                nesting[0] = True
                try:
                    handler(signal.SIGTERM, None)
                finally:
                    nesting[0] = False
            return trace

        sys.settrace(trace)
        try:
            handler(signal.SIGTERM, None)
        finally:
            sys.settrace(None)

    t = threading.Thread(target=run, daemon=True)  # left blocked forever if it deadlocks
    t.start()
    t.join(within)
    return not t.is_alive()


def test_a_stop_flag_set_by_a_signal_handler_can_be_interrupted_by_a_second_signal():
    """A stage can get SIGTERM twice back to back (the supervisor's stop sent two; a service
    manager or an operator signalling the process group adds theirs); a stage whose handler
    set a threading.Event hung with the second handler waiting for the lock the first held,
    until the supervisor SIGKILLed it 5 s later (the dense chaos soak's "-9 at shutdown")."""
    from pipeline.runtime.serving import SignalFlag

    flag = SignalFlag()
    assert _survives_being_interrupted_by_itself(lambda *sig: flag.set(*sig))
    assert flag.is_set()
    # The check itself finds the deadlock an Event has.
    event = threading.Event()
    assert not _survives_being_interrupted_by_itself(lambda *_: event.set(), within=1.0)
