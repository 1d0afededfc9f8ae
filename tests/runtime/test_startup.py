"""Start-up and shutdown faults of `run.py serve`, in both modes: /dev/shm too small,
a Mooncake engine or socket that cannot start, a whole run SIGKILLed (the next start
sweeps exactly what it left), and what a running worker exposes (object modes, the
interfaces it listens on). Real processes, the sim tower, small arenas."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import psutil
import pytest

from ipc import shm
from pipeline.cli.config import WorkerConfig
from pipeline.runtime.boards import Heartbeats
from stages import registry
from tests.helpers import free_port, sim_config, start_worker, with_sim_tower

pytestmark = pytest.mark.timeout(180)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ["pipeline", "inprocess"]
MOONCAKE_PORTS = range(15000, 17001)  # the library's default port range (ipc/transport.py)


def serve_cmd(mode: str, prefix: str, where, **flags) -> list[str]:
    args = dict(shm_prefix=prefix, run_dir=str(where), intake=f"ipc://{where}/intake.sock",
                bootstrap=f"tcp://127.0.0.1:{free_port()}", tower="sim", sim_hidden=64,
                sim_deepstack_width=32, pixel_arena_bytes=16 << 20, embedding_arena_bytes=16 << 20,
                arena_cache_bytes=4 << 20, ring_bytes=1 << 20, max_tombstones=1024, max_live_rooms=256)
    args = with_sim_tower(where, {**args, **flags})  # the sim tower's settings: a file it reads
    cmd = [sys.executable, "run.py", "serve", "--mode", mode]
    for key, value in args.items():
        if value is not None:  # None: leave the setting at its default
            cmd += ["--" + key.replace("_", "-"), str(value)]
    return cmd


def start_serving(cmd: list[str], stderr_path, env=None) -> subprocess.Popen:
    """`run.py serve` in a session of its own (its stages join it), once it says it serves."""
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True, env=env)
    line = proc.stdout.readline()  # printed once every stage is ready
    if not line.startswith("serving"):
        proc.kill()
        proc.wait()
        pytest.fail(f"run.py serve did not start: {line!r}, exit code {proc.returncode}, "
                    f"stderr: {open(stderr_path).read()[-3000:]}")
    return proc


def session_processes(sid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of session `sid`."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, PermissionError):
            pass
    return out


def wait_session_gone(sid: int, timeout: float = 30.0) -> list[psutil.Process]:
    """Wait until no process of session `sid` is alive; those still alive at the timeout."""
    end = time.monotonic() + timeout
    while True:
        left = session_processes(sid)
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.1)


def kill_session(sid: int) -> None:
    try:
        os.killpg(sid, signal.SIGKILL)  # the session leader's group: run.py and its stages
    except ProcessLookupError:
        pass


def run_id_of(prefix: str) -> str:
    runs = {shm.parse_name(e)[1] for e in shm.list_objects(prefix)}
    assert len(runs) == 1, f"expected one run of {prefix}, found {sorted(runs)}"
    return runs.pop()


# ------------------------------------------------------------------ /dev/shm too small
@pytest.mark.parametrize("mode", MODES)
def test_shm_too_small_fails_at_once_with_needed_and_free(mode, shm_prefix, tmp_path):
    free_before = shm.shm_free_bytes()
    too_big = free_before + (1 << 30)
    cmd = serve_cmd(mode, shm_prefix, tmp_path, pixel_arena_bytes=too_big)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-3000:]
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("error: the worker could not start: /dev/shm cannot hold"), message
    # It names the need and the room, as numbers an operator can compare.
    needed = int(message.split("it needs ")[1].split(" bytes")[0])
    free = int(message.split(" MiB) and ")[1].split(" bytes")[0])
    assert needed >= too_big and free < needed, message
    assert "shrink the arenas" in message
    # Checked before anything was created: the whole run's need, not one segment that
    # failed to reserve (reserving would have filled /dev/shm for everyone first).
    assert "this run's shared memory" in message and "pixel arena" in message, message
    assert not shm.list_objects(shm_prefix), "the failed start left objects in /dev/shm"
    # Nothing reserved and kept. (Other tests may run beside this one: allow them some.)
    assert abs(shm.shm_free_bytes() - free_before) < (1 << 30)


# ------------------------------------------------------------------ Mooncake or a socket cannot start
def _bootstrap_port_taken(tmp_path, holders):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    holders.append(s)
    port = s.getsockname()[1]
    return {"bootstrap": f"tcp://127.0.0.1:{port}"}, None, [f"tcp://127.0.0.1:{port}", "Address already in use"]


def _mooncake_ports_taken(tmp_path, holders):
    # The library takes its handshake and data ports from MC_MIN_RPC_PORT..MC_MAX_RPC_PORT
    # (a range above 32767 is ignored): a range of one port, held by someone else.
    for port in range(30000, 32000):
        s = socket.socket()
        try:
            s.bind(("", port))
        except OSError:
            s.close()
            continue
        s.listen()
        holders.append(s)
        break
    env = dict(os.environ, MC_MIN_RPC_PORT=str(port), MC_MAX_RPC_PORT=str(port))
    return {}, env, ["Mooncake initialize", "could not bind its RPC or data port", "ports in use"]


def _mooncake_missing(tmp_path, holders):
    shim = tmp_path / "shim" / "mooncake"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")
    (shim / "engine.py").write_text(
        'raise ImportError("libtransfer_engine.so: cannot open shared object file (test shim)")\n')
    path = os.pathsep.join(p for p in (str(tmp_path / "shim"), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    return {}, env, ["Mooncake transfer engine is not installed", "test shim", "scripts/setup.sh"]


FAULTS = {"bootstrap_port_taken": _bootstrap_port_taken, "mooncake_ports_taken": _mooncake_ports_taken,
          "mooncake_missing": _mooncake_missing}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("mode", MODES)
def test_engine_or_socket_that_cannot_start(mode, fault, shm_prefix, tmp_path):
    """Exit 3 with a message naming the cause; nothing left in /dev/shm, no process left."""
    holders = []
    try:
        flags, env, words = FAULTS[fault](tmp_path, holders)
        cmd = serve_cmd(mode, shm_prefix, tmp_path / "run", **flags)
        with open(tmp_path / "stderr", "w") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                    start_new_session=True, env=env)
        try:
            code = proc.wait(120)
        finally:
            kill_session(proc.pid)
        stderr = open(tmp_path / "stderr").read()
        message = stderr.strip().splitlines()[-1]
        assert code == 3, stderr[-3000:]
        assert message.startswith("error: the worker could not start: "), message
        for word in words:
            assert word in message, f"{word!r} not in {message!r}"
        assert not wait_session_gone(proc.pid), "a process of the failed start is still running"
        assert not shm.list_objects(shm_prefix), "the failed start left objects in /dev/shm"
        assert not os.path.exists(tmp_path / "run" / "intake.sock")
    finally:
        for s in holders:
            s.close()


# ------------------------------------------------------------------ a whole run SIGKILLed
def _decoys(prefix: str) -> list[str]:
    """Entries the next start of `prefix` must not touch: a dead run of another prefix
    (one that starts with this one), and names under this prefix that are not a run's."""
    other = prefix + "d"
    rid = "0badc0de"
    names = [f"{other}-{rid}-lock", f"{other}-{rid}-pixels", f"sem.{other}-{rid}-bell.tower",
             f"{prefix}-notarun0-pixels", f"{prefix}-{rid}", f"{prefix}_{rid}-lock"]
    for name in names:
        with open(os.path.join(shm.SHM_DIR, name), "x"):
            pass
    return names


@pytest.mark.parametrize("next_mode", MODES)
def test_next_start_sweeps_exactly_what_a_killed_run_left(next_mode, shm_prefix, tmp_path):
    """A pipeline run SIGKILLed whole (supervisor and stages at once) leaves its objects;
    the next start with the same prefix removes exactly those: not a live run's of the
    same prefix, not another prefix's, not names that are no run's."""
    live_mode = "inprocess" if next_mode == "pipeline" else "pipeline"
    made, decoys = [], []
    proc = start_serving(serve_cmd("pipeline", shm_prefix, tmp_path / "killed"), tmp_path / "stderr")
    try:
        killed_run = run_id_of(shm_prefix)
        killed = set(shm.list_objects(shm_prefix, killed_run))
        assert any(e.startswith("sem.") for e in killed) and any(not e.startswith("sem.") for e in killed)
        (tmp_path / "live").mkdir()
        live = start_worker(live_mode, sim_config(shm_prefix, tmp_path / "live"))
        made.append(live)
        live_run = live.runtime.run_id
        live_objects = set(shm.list_objects(shm_prefix, live_run))
        assert set(shm.list_objects(shm_prefix, killed_run)) == killed, "a live run's start swept another live run"
        decoys = _decoys(shm_prefix)

        kill_session(proc.pid)
        proc.wait(30)
        assert not wait_session_gone(proc.pid), "a stage outlived the SIGKILL of its group"
        assert set(shm.list_objects(shm_prefix, killed_run)) == killed, "the killed run's objects vanished"

        (tmp_path / "next").mkdir()
        nxt = start_worker(next_mode, sim_config(shm_prefix, tmp_path / "next"))
        made.append(nxt)
        assert not shm.list_objects(shm_prefix, killed_run), "the next start did not sweep the dead run"
        assert set(shm.list_objects(shm_prefix, live_run)) == live_objects, "the next start touched a live run"
        for name in decoys:
            assert os.path.exists(os.path.join(shm.SHM_DIR, name)), f"the next start removed {name}"
    finally:
        kill_session(proc.pid)
        proc.wait(30)
        for w in reversed(made):
            w.close()
        for name in decoys:
            os.unlink(os.path.join(shm.SHM_DIR, name))
        shm.sweep(shm_prefix)  # the killed run's, if the test failed before the next start


def test_stages_exit_when_the_supervisor_is_killed(shm_prefix, tmp_path):
    """Stages orphaned by a SIGKILLed supervisor exit by themselves; nothing then holds
    the run, so the next start's sweep takes all it left."""
    proc = start_serving(serve_cmd("pipeline", shm_prefix, tmp_path), tmp_path / "stderr")
    try:
        run_id = run_id_of(shm_prefix)
        hb = Heartbeats.attach(shm_prefix, run_id)
        stage_pids = {int(hb.row(s)[Heartbeats.PID]) for s in registry.stage_names(1)}
        hb.close()
        assert len(stage_pids) == len(registry.stage_names(1)) and all(psutil.pid_exists(p) for p in stage_pids)
        left = set(shm.list_objects(shm_prefix))
        proc.kill()  # the supervisor only
        proc.wait(30)
        assert not wait_session_gone(proc.pid), "a stage outlived its supervisor"
        assert set(shm.sweep(shm_prefix)) == left
    finally:
        kill_session(proc.pid)
        proc.wait(30)
        shm.sweep(shm_prefix)


# ------------------------------------------------------------------ what a running worker exposes
def _listeners(procs: list[psutil.Process]) -> dict[int, list]:
    out = {}
    for p in procs:
        conns = [c for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        if conns:
            out[p.pid] = conns
    return out


@pytest.mark.parametrize("mode", MODES)
def test_serving_objects_are_0600_sockets_on_loopback_and_sigterm_leaves_nothing(mode, shm_prefix, tmp_path):
    run_dir = f"/tmp/epd-{shm_prefix}"  # the defaults: run dir and an ipc:// intake in it
    assert WorkerConfig().bootstrap.startswith("tcp://127.0.0.1:")
    port = free_port()
    cmd = serve_cmd(mode, shm_prefix, tmp_path, run_dir=None, intake=None, bootstrap=f"tcp://127.0.0.1:{port}")
    proc = start_serving(cmd, tmp_path / "stderr")
    try:
        objects = shm.list_objects(shm_prefix)
        if mode == "pipeline":  # the rings' semaphores (the in-process worker has none)
            assert any(e.startswith("sem.") for e in objects), objects
        for entry in objects:
            st = os.stat(os.path.join(shm.SHM_DIR, entry))
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid(), \
                f"{entry}: mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}"
        sock = os.path.join(run_dir, "intake.sock")
        assert stat.S_ISSOCK(os.stat(sock).st_mode) and stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700

        # Everything listens on loopback except Mooncake's handshake and data listeners
        # (the library binds them to every interface; README says so), in its port range,
        # two at most, and only in the process that holds the engine.
        procs = session_processes(proc.pid)
        if mode == "pipeline":
            hb = Heartbeats.attach(shm_prefix, run_id_of(shm_prefix))
            engine_pid = int(hb.row("sender")[Heartbeats.PID])
            hb.close()
        else:
            engine_pid = proc.pid
        listening = _listeners(procs)
        assert ("127.0.0.1", port) in [tuple(c.laddr) for c in listening.get(engine_pid, [])], listening
        wildcard = []
        for pid, conns in listening.items():
            for c in conns:
                if c.laddr.ip in ("127.0.0.1", "::1"):
                    continue
                assert pid == engine_pid and c.laddr.port in MOONCAKE_PORTS, \
                    f"pid {pid} listens on {c.laddr} (engine pid {engine_pid})"
                wildcard.append(c.laddr.port)
        assert 1 <= len(set(wildcard)) <= 2, wildcard
        readme = " ".join(open(os.path.join(REPO, "README.md")).read().split())
        assert "Mooncake's own handshake and data listeners bind to every interface" in readme

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, open(tmp_path / "stderr").read()[-3000:]
        assert not wait_session_gone(proc.pid), "a stage outlived the shutdown"
        assert not shm.list_objects(shm_prefix), "SIGTERM left objects in /dev/shm"
        assert not os.path.exists(sock)
    finally:
        kill_session(proc.pid)
        proc.wait(30)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.parametrize("mode", ["inprocess", "pipeline"])
@pytest.mark.parametrize("fault", ["other_user", "world_writable", "symlink"])
def test_a_run_directory_someone_else_controls_is_refused(mode, fault, shm_prefix, tmp_path):
    """The default run directory has a predictable name under /tmp: one made first by
    another user (or open to others) could hold their socket, so it is refused."""
    run_dir = tmp_path / "run"
    if fault == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        run_dir.symlink_to(tmp_path / "elsewhere")
    else:
        run_dir.mkdir(mode=0o700)
        if fault == "other_user":
            if os.geteuid() != 0:
                pytest.skip("needs root to give the directory to another user")
            os.chown(run_dir, 4242, 4242)
        else:
            os.chmod(run_dir, 0o777)
    cfg = sim_config(shm_prefix, run_dir)  # its intake socket inside it
    with pytest.raises(Exception, match="refusing it") as e:
        start_worker(mode, cfg).close()
    assert str(run_dir) in str(e.value)
    assert not os.path.exists(run_dir / "intake.sock")


@pytest.mark.parametrize("mode", ["pipeline", "inprocess"])
def test_a_cpu_without_the_rings_barriers_is_refused_before_anything_is_made(monkeypatch, shm_prefix, tmp_path,
                                                                             mode):
    import platform

    from pipeline.runtime.serving import StartError

    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    with pytest.raises(StartError, match="refusing to start on a riscv64 CPU"):
        start_worker(mode, sim_config(shm_prefix, tmp_path))
    assert shm.list_objects(shm_prefix) == []
