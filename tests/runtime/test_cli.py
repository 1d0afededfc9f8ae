"""The command line (pipeline/cli/main.py: `epd-worker`, and run.py its shim): subcommands, --help,
`config`, exit codes, and the logs of a running pipeline."""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import types

import pytest

from pipeline.cli import main as cli
from pipeline.peers.client import Client, Item
from pipeline.cli.config import FIELDS, flag_name
from pipeline.peers.receiver import Receiver
from tests.helpers import PipelineWorker, image, sim_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """No EPD_* variable of the caller's leaks in; the root logger is put back after."""
    for name in list(os.environ):
        if name.startswith("EPD_"):
            monkeypatch.delenv(name)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def exits(argv, capsys) -> tuple[int, str, str]:
    """cli.main(argv)'s exit code (returned, or raised by argparse), stdout and stderr."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def flat(text: str) -> str:
    return " ".join(text.split())


def test_top_level_help_lists_commands_and_exit_codes(capsys):
    code, out, _ = exits(["--help"], capsys)
    assert code == 0
    for command in cli.COMMANDS:
        assert re.search(rf"^\s+{command}\s+\S", out, re.M), command
    assert "exit codes:" in out
    assert "4 no worker with this shm prefix is running" in flat(out)
    assert "3 the worker could not start" in flat(out)
    assert out.startswith("usage: epd-worker ") and "epd-worker COMMAND --help" in out


def test_run_py_is_a_shim_of_the_console_script(capsys):
    """run.py names itself in the help it prints and runs the same main()."""
    import run

    assert run.main is cli.main and run.build_parser is cli.build_parser
    with pytest.raises(SystemExit):
        run.main(["--help"], prog="run.py")
    out = capsys.readouterr().out
    assert out.startswith("usage: run.py ") and "run.py COMMAND --help" in out
    assert "epd-worker" not in out


def test_bench_outside_a_source_checkout_says_where_it_runs(monkeypatch, capsys):
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if p.endswith("bench.py") else real_exists(p))
    code, _, err = exits(["bench", "--quick"], capsys)
    assert code == 2 and "bench runs from a source checkout" in err


@pytest.mark.parametrize("command", ["demo", "serve", "config", "status"])
def test_command_help_explains_every_setting(command, capsys):
    code, out, _ = exits([command, "--help"], capsys)
    assert code == 0
    text = flat(out)
    for key, f in FIELDS.items():
        assert re.search(rf"{flag_name(key)}[ ,]", text), key
        assert flat(f.metadata["help"]) in text, key
    assert "--config PATH" in text and "exit codes:" in text
    assert ("--mode" in text) == (command in ("demo", "serve"))
    assert ("--json" in text) == (command in ("config", "status"))


def test_bench_help_is_the_benchmarks_own(capsys):
    code, out, _ = exits(["bench", "--help"], capsys)
    assert code == 0
    assert "usage: run.py bench" in out and "--quick" in out and "--only" in out


def test_config_prints_every_key_with_its_source(tmp_path, monkeypatch, capsys):
    path = tmp_path / "w.toml"
    path.write_text('ring_bytes = 65536\ntower = "sim"\nmax_tokens_per_batch = 64\n')
    monkeypatch.setenv("EPD_MAX_TOKENS_PER_BATCH", "128")
    code, out, err = exits(["config", "--config", str(path), "--max-items-per-batch", "3"], capsys)
    assert code == 0, err
    lines = {m[1]: (m[2], m[3]) for m in re.finditer(r"^(\w+) = (.*?) +# (.+)$", out, re.M)}
    assert set(lines) == set(FIELDS) and len(out.splitlines()) == len(FIELDS)
    assert lines["ring_bytes"] == ("65536", str(path))
    assert lines["tower"] == ('"sim"', str(path))
    assert lines["max_tokens_per_batch"] == ("128", "EPD_MAX_TOKENS_PER_BATCH")
    assert lines["max_items_per_batch"] == ("3", "--max-items-per-batch")
    assert lines["log_level"] == ('"WARNING"', "default")

    code, out, _ = exits(["config", "--json", "--gpu", "2"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["gpu"] == {"value": 2, "source": "--gpu"} and set(doc) == set(FIELDS)


@pytest.mark.parametrize("argv, env, named", [
    (["config", "--ring-bytes", "0"], {}, "ring_bytes must be >= 1, got 0 (set by --ring-bytes)"),
    (["serve", "--numa", "tower=9,gpu=1"], {}, "numa names no stage 'gpu'"),
    (["status"], {"EPD_SHM_PREFX": "x"}, "EPD_SHM_PREFX: no such setting"),
    (["serve"], {"EPD_RING_BYTES": "x"}, "EPD_RING_BYTES: expected an integer, got 'x'"),
    # no command: the demo, stopped by its configuration before anything starts
    (["--ring-bytes", "0"], {}, "ring_bytes must be >= 1"),
    (["--mode", "inprocess", "--log-level", "chatty"], {}, "log_level must be one of"),
    (["demo", "--metrics-endpoint", "9100"], {}, "metrics_endpoint must be"),
])
def test_bad_configuration_exits_2_naming_the_key(argv, env, named, monkeypatch, capsys):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, out, err = exits(argv, capsys)
    assert code == 2 and named in err and out == "", (code, out, err)


def test_bad_file_and_bad_flags_exit_2(tmp_path, capsys):
    path = tmp_path / "w.toml"
    path.write_text("ring_bytez = 1\n")
    code, _, err = exits(["serve", "--config", str(path)], capsys)
    assert code == 2 and f"{path}: unknown key 'ring_bytez'" in err
    code, _, err = exits(["serve", "--ring-bytes", "lots"], capsys)  # argparse's own
    assert code == 2 and "--ring-bytes" in err
    code, _, err = exits(["serve", "--no-such-flag"], capsys)
    assert code == 2 and "--no-such-flag" in err


def test_status_is_handed_the_effective_configuration(monkeypatch, capsys):
    calls = []
    fake = types.ModuleType("pipeline.cli.status")
    fake.main = lambda cfg, as_json: calls.append((cfg, as_json)) or 4
    monkeypatch.setitem(sys.modules, "pipeline.cli.status", fake)
    monkeypatch.setenv("EPD_RING_BYTES", "4096")
    code, _, _ = exits(["status", "--json", "--shm-prefix", "other"], capsys)
    assert code == 4
    [(cfg, as_json)] = calls
    assert as_json is True and cfg.shm_prefix == "other" and cfg.ring_bytes == 4096
    assert cfg.run_dir == "/tmp/epd-other"


def test_serve_prints_its_configuration_then_exits_3_when_it_cannot_start(shm_prefix, tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = exits(["serve", "--mode", "inprocess", "--tower", "sim", "--shm-prefix", shm_prefix,
                                "--run-dir", str(tmp_path), "--bootstrap", f"tcp://127.0.0.1:{port}",
                                "--pixel-arena-bytes", str(4 << 20), "--embedding-arena-bytes", str(4 << 20),
                                "--arena-cache-bytes", str(1 << 20), "--host-cache-bytes", str(1 << 20)],
                               capsys)
    assert code == 3, (code, out, err)
    block, _, rest = err.partition("error: the worker could not start")
    assert block.startswith("effective configuration:\n")
    assert re.search(rf"^bootstrap = \"tcp://127.0.0.1:{port}\" +# --bootstrap$", block, re.M)
    assert re.search(r"^log_level = \"WARNING\" +# default$", block, re.M)
    assert len(block.strip().splitlines()) == 1 + len(FIELDS)
    assert rest, err


def test_run_py_in_a_process_of_its_own(tmp_path):
    """The real entry point: `config --json` with a file and the environment; exit 2 on a typo."""
    path = tmp_path / "w.toml"
    path.write_text("max_live_rooms = 77\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    p = subprocess.run([sys.executable, "run.py", "config", "--json", "--config", str(path)],
                       cwd=ROOT, env=dict(env, EPD_LOG_LEVEL="info"), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["max_live_rooms"] == {"value": 77, "source": str(path)}
    assert doc["log_level"] == {"value": "info", "source": "EPD_LOG_LEVEL"}
    p = subprocess.run([sys.executable, "run.py", "serve", "--tower", "sim"], cwd=ROOT,
                       env=dict(env, EPD_MAX_LIVE_ROOM="1"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "EPD_MAX_LIVE_ROOM: no such setting" in p.stderr, p.stderr


def test_stage_processes_log_at_the_configured_level_and_not_per_record(shm_prefix, tmp_path, capfd):
    """log_level reaches the spawned stages; a failed room is one line each with room and request
    id; rooms that succeed log nothing."""
    w = PipelineWorker(sim_config(shm_prefix, tmp_path, log_level="INFO", sim_fail_batches=1))
    client = r = None
    try:
        client = Client(w.cfg.intake, shm_prefix)
        r = Receiver("rx", w.cfg.bootstrap)
        spec = w.spec

        def send(room: int) -> None:
            client.encode(room, f"req-{room}", [Item("image", *image(room, grid=(1, 4, 4)))])
            r.alloc(room, 0, span=4, hidden=spec.hidden, dtype=spec.dtype,
                    deepstack_width=spec.deepstack_width)

        send(101)  # the sim tower fails its first batch
        assert r.wait({101: 1}, 30) and 101 in r.failed
        for room in (102, 103, 104):
            send(room)
        assert r.wait({102: 1, 103: 1, 104: 1}, 30)
        assert not (r.failed.keys() & {102, 103, 104}) and not r.violations
    finally:
        for obj in (client, r, w):
            if obj is not None:
                obj.close()
    err = capfd.readouterr().err
    ours = [line for line in err.splitlines()
            if re.match(r"\d{4}-\d\d-\d\d \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) \w+\[\d+\] \S+: ", line)]
    tower = [line for line in ours
             if re.search(r" WARNING tower\[\d+\] epd\.tower: tower batch of 1 items failed: room=101: ", line)]
    reaper = [line for line in ours if re.search(r" INFO reaper\[\d+\] epd\.reaper: room failed: room=101 "
                                                 r"request_id=req-101 reason=tower failed", line)]
    assert len(tower) == 1 and len(reaper) == 1, "\n".join(ours)
    assert not [line for line in ours if re.search(r"\b10[234]\b", line)], "\n".join(ours)


@pytest.mark.parametrize("mode", ["pipeline", "inprocess"])
def test_console_script_runs_the_demo(mode, shm_prefix, tmp_path):
    """`epd-worker` (the installed console script, run from outside the checkout) runs the
    demo end to end: every room succeeds, a JPEG's rows equal its pixels', and the summary says so."""
    script = os.path.join(sys.prefix, "bin", "epd-worker")
    if not os.path.exists(script):
        pytest.skip(f"no console script at {script}: run scripts/setup.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    p = subprocess.run([script, "demo", "--mode", mode, "--tower", "sim", "--shm-prefix", shm_prefix,
                        "--run-dir", str(tmp_path / "run")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert re.search(r"^rooms: (\d+) succeeded, 0 failed or missing$", p.stdout, re.M), p.stdout[-2000:]
    assert f"mode {mode}" in p.stdout
    # its images go in as JPEGs, which the worker decodes into the pixels a gateway would send
    assert "the JPEG's rows and those of its pixels are equal" in p.stdout, p.stdout[-2000:]
