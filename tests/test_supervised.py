"""Under a process supervisor: the systemd notify protocol (pipeline/notify.py), the HTTP
probes next to /metrics (pipeline/metrics.py), and a demo whose stderr holds no line
of Mooncake's at the default log level."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from pipeline.metrics import MetricsServer, Snapshot, Totals
from pipeline.notify import Notifier
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(180)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    assert not n.watchdog({"tower": 0.0}, now=1.0)
    assert manager.nothing()


def test_watchdog_pid_of_this_process_is_honoured(manager):
    n = Notifier({"NOTIFY_SOCKET": manager.env, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())})
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
