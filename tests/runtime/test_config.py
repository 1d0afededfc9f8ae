"""The configuration: defaults < TOML file < EPD_* environment < flags, with sources;
every error names the key and where the bad value came from."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import tomllib

import pytest

from pipeline.cli.config import (FIELDS, SIZE_FORMS, ConfigError, WorkerConfig, add_flags, flags_given,
                                 format_config, load_config, parse_numa, parse_size)
from pipeline.ops.logs import setup_logging


def write(tmp_path, text: str) -> str:
    path = tmp_path / "worker.toml"
    path.write_text(text)
    return str(path)


def test_defaults_alone():
    cfg, sources = load_config(environ={})
    assert cfg == WorkerConfig().resolved()
    assert sources["run_dir"] == "derived from shm_prefix"
    assert sources["intake"] == "derived from run_dir"
    assert sources["gpus"] == "derived from gpu and tower_replicas" and cfg.gpus == "0"
    assert {s for k, s in sources.items() if k not in ("run_dir", "intake", "gpus")} == {"default"}


def test_precedence_file_env_flag_with_sources(tmp_path):
    path = write(tmp_path, 'ring_bytes = 1024\nmax_tokens_per_batch = 100\nmax_items_per_batch = 10\n'
                           'tower = "sim"\nstore_get_timeout_s = 1\ntrust_client_hash = true\n')
    environ = {"EPD_MAX_TOKENS_PER_BATCH": "2048", "EPD_MAX_ITEMS_PER_BATCH": "20", "PATH": "/bin"}
    cfg, sources = load_config(path, flags={"max_items_per_batch": 30}, environ=environ)
    assert (cfg.ring_bytes, cfg.max_tokens_per_batch, cfg.max_items_per_batch) == (1024, 2048, 30)
    assert cfg.tower == "sim" and cfg.trust_client_hash is True
    assert cfg.store_get_timeout_s == 1.0 and isinstance(cfg.store_get_timeout_s, float)
    assert sources["ring_bytes"] == path
    assert sources["max_tokens_per_batch"] == "EPD_MAX_TOKENS_PER_BATCH"
    assert sources["max_items_per_batch"] == "--max-items-per-batch"
    assert sources["status_hwm"] == "default"


def test_lower_layer_defaults_are_overridden_and_labelled(tmp_path):
    cfg, sources = load_config(environ={"EPD_SHM_PREFIX": "mine"},
                               defaults={"shm_prefix": "epd_demo", "bootstrap": "tcp://127.0.0.1:1"},
                               defaults_source="demo default")
    assert cfg.shm_prefix == "mine" and sources["shm_prefix"] == "EPD_SHM_PREFIX"
    assert cfg.bootstrap == "tcp://127.0.0.1:1" and sources["bootstrap"] == "demo default"
    assert cfg.run_dir == "/tmp/epd-mine"


def test_environment_values_are_parsed_by_type():
    cfg, _ = load_config(environ={"EPD_TRUST_CLIENT_HASH": "yes", "EPD_DRAIN_TIMEOUT_S": "2.5",
                                  "EPD_RING_BYTES": " 4096 ", "EPD_DEVICE": "mlx5_0"})
    assert cfg.trust_client_hash is True and cfg.drain_timeout_s == 2.5
    assert cfg.ring_bytes == 4096 and cfg.device == "mlx5_0"


@pytest.mark.parametrize("name, value, expected", [
    ("EPD_MAX_LIVE_ROOMS", "x", "EPD_MAX_LIVE_ROOMS: expected an integer, got 'x'"),
    ("EPD_MAX_LIVE_ROOMS", "1.5", "EPD_MAX_LIVE_ROOMS: expected an integer, got '1.5'"),
    ("EPD_RING_BYTES", "x", f"EPD_RING_BYTES: expected an integer, got 'x' (a size: {SIZE_FORMS})"),
    ("EPD_RING_BYTES", "1.5", f"EPD_RING_BYTES: expected a whole number of bytes, got '1.5' (1.5 bytes; "
                              f"a size: {SIZE_FORMS})"),
    ("EPD_RING_BYTES", "8 MeB", f"EPD_RING_BYTES: expected an integer, got '8 MeB' (a size: {SIZE_FORMS})"),
    ("EPD_DRAIN_TIMEOUT_S", "soon", "EPD_DRAIN_TIMEOUT_S: expected a number, got 'soon'"),
    ("EPD_TRUST_CLIENT_HASH", "maybe", "EPD_TRUST_CLIENT_HASH: expected true or false, got 'maybe'"),
])
def test_bad_environment_value_names_the_variable(name, value, expected):
    with pytest.raises(ConfigError) as e:
        load_config(environ={name: value})
    assert str(e.value) == expected


def test_unknown_environment_variable_is_an_error():
    with pytest.raises(ConfigError) as e:
        load_config(environ={"EPD_RING_BYTE": "1024"})
    assert "EPD_RING_BYTE: no such setting" in str(e.value)
    assert "did you mean EPD_RING_BYTES?" in str(e.value)
    load_config(environ={"EPDX_RING_BYTE": "1", "epd_ring_byte": "1"})  # not the prefix: not ours


@pytest.mark.parametrize("line, expected", [
    ('ring_bytes = "x"', f"ring_bytes: expected an integer, got 'x' (a size: {SIZE_FORMS})"),
    ('max_live_rooms = "x"', "max_live_rooms: expected an integer, got 'x'"),
    ("ring_bytes = 1.5", "ring_bytes: expected an integer, got 1.5"),
    ("ring_bytes = true", "ring_bytes: expected an integer, got True"),
    ("tower = 3", "tower: expected a string, got 3"),
    ('trust_client_hash = "yes"', "trust_client_hash: expected true or false, got 'yes'"),
    ("drain_timeout_s = false", "drain_timeout_s: expected a number, got False"),
])
def test_bad_type_in_file_names_the_file_and_key(tmp_path, line, expected):
    path = write(tmp_path, line + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, environ={})
    assert str(e.value) == f"{path}: {expected}"


def test_unknown_key_in_file_is_an_error(tmp_path):
    path = write(tmp_path, "max_tokens_per_bach = 10\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, environ={})
    assert str(e.value) == f"{path}: unknown key 'max_tokens_per_bach' (did you mean max_tokens_per_batch?)"
    path = write(tmp_path, "[worker]\nring_bytes = 10\n")  # keys are top level
    with pytest.raises(ConfigError, match="unknown key 'worker'"):
        load_config(path, environ={})


def test_unreadable_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match=r"--config .*nope.toml: cannot read it"):
        load_config(str(tmp_path / "nope.toml"), environ={})
    path = write(tmp_path, "ring_bytes = = 3\n")
    with pytest.raises(ConfigError, match=f"--config {re.escape(path)}: not valid TOML"):
        load_config(path, environ={})


def test_invalid_value_names_the_key_and_its_source(tmp_path):
    path = write(tmp_path, "ring_bytes = 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, environ={})
    assert str(e.value) == f"ring_bytes must be >= 1, got 0 (set by {path})" and e.value.key == "ring_bytes"
    with pytest.raises(ConfigError) as e:
        load_config(environ={"EPD_PROTOCOL": "udp"})
    assert str(e.value).startswith("protocol must be one of")
    assert str(e.value).endswith("(set by EPD_PROTOCOL)")
    with pytest.raises(ConfigError) as e:
        load_config(flags={"restart_window_s": 0.0}, environ={})
    assert str(e.value) == "restart_window_s must be > 0, got 0.0 (set by --restart-window-s)"


@pytest.mark.parametrize("key, value", [
    ("gpu", -1), ("log_level", "LOUD"), ("metrics_endpoint", "9100"), ("metrics_endpoint", "host:"),
    ("metrics_endpoint", "host:99999"), ("metrics_endpoint", ":9100"), ("numa", "two"), ("numa", "tower"),
    ("numa", "tower=x"), ("numa", "towr=1"), ("numa", "tower=1,tower=2"), ("numa", "-1"),
    ("tower", "clip"), ("tower_config", "/nonexistent/checkpoint"), ("tower_dtype", "int8"),
    ("bootstrap", "ipc:///tmp/x"), ("intake", "udp://x"),
    ("shm_prefix", "a/b"), ("max_live_rooms", 0), ("tower_replicas", 0), ("tower_replicas", 9),
    ("gpus", "0,1"), ("gpus", "x"), ("drain_timeout_s", -1.0), ("arena_cache_bytes", 1 << 40),
    ("media_url_hosts", "http://example.com"), ("media_url_hosts", "ex_ample.com"), ("media_url_max_bytes", 0),
    ("media_url_timeout_s", 0.0),
])
def test_validate_names_the_key(key, value):
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(WorkerConfig(), **{key: value}).resolved().validate()
    assert e.value.key == key and str(e.value).startswith(key), str(e.value)


@pytest.mark.parametrize("key, value", [
    ("gpu", 3), ("log_level", "debug"), ("log_level", "ERROR"), ("metrics_endpoint", "127.0.0.1:9100"),
    ("metrics_endpoint", "[::1]:0"), ("tower_config", "/"), ("numa", "off"), ("numa", "1"),
    ("numa", "tower=1, sender=1,*=0"), ("media_url_hosts", "images.example.com, 10.0.0.0/8, 127.0.0.1, ::1"),
])
def test_validate_accepts(key, value):
    dataclasses.replace(WorkerConfig(), **{key: value}).resolved().validate()


@pytest.mark.parametrize("key, value", [
    ("bootstrap", "tcp://0.0.0.0:17600"), ("bootstrap", "tcp://*:17600"), ("bootstrap", "tcp://10.1.2.3:17600"),
    ("intake", "tcp://0.0.0.0:17601"), ("intake", "tcp://eth0:17601"),
])
def test_off_loopback_without_curve_is_refused_unless_allowed(key, value):
    cfg = dataclasses.replace(WorkerConfig(), **{key: value}).resolved()
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert e.value.key == key and "--allow-insecure-network" in str(e.value) and "curve_cert" in str(e.value)
    dataclasses.replace(cfg, allow_insecure_network=True).validate()
    for loopback in ("tcp://127.0.0.1:17600", "tcp://[::1]:17600", "tcp://localhost:17600"):
        dataclasses.replace(cfg, **{key: loopback}).validate()


def test_parse_numa():
    assert parse_numa("auto") == "auto" and parse_numa("off") == "off"
    assert parse_numa("2") == {"*": 2}
    assert parse_numa("tower=1,sender=1,*=0") == {"tower": 1, "sender": 1, "*": 0}


def test_every_key_has_one_line_of_help():
    for name, f in FIELDS.items():
        text = f.metadata.get("help", "")
        assert text and "\n" not in text, name


def test_printed_configuration_loads_back_as_toml(tmp_path):
    cfg, sources = load_config(flags={"ring_bytes": 4096, "trust_client_hash": True, "tower_dtype": ""},
                               environ={"EPD_STORE_GET_TIMEOUT_S": "2e-7"})
    text = format_config(cfg, sources)
    lines = text.splitlines()
    assert len(lines) == len(FIELDS)
    assert re.fullmatch(r"ring_bytes = 4096 +# --ring-bytes", lines[list(FIELDS).index("ring_bytes")])
    assert re.fullmatch(r"store_get_timeout_s = 2e-07 +# EPD_STORE_GET_TIMEOUT_S",
                        lines[list(FIELDS).index("store_get_timeout_s")])
    path = write(tmp_path, text)
    assert tomllib.loads(text) == dataclasses.asdict(cfg)
    again, again_sources = load_config(path, environ={})
    assert again == cfg and set(again_sources.values()) == {path}
    as_json = json.loads(format_config(cfg, sources, as_json=True))
    assert as_json["ring_bytes"] == {"value": 4096, "source": "--ring-bytes"}
    assert as_json["run_dir"] == {"value": "/tmp/epd-epd", "source": "derived from shm_prefix"}
    assert list(as_json) == list(FIELDS)


def test_setup_logging_format_and_level(root_logger, capsys):
    setup_logging(WorkerConfig(log_level="info"), "sender")
    log = logging.getLogger("epd.test")
    log.info("room failed: room=%d request_id=%s", 7, "r-7")
    log.debug("not shown")
    setup_logging(WorkerConfig(log_level="ERROR"), "supervisor")  # replaces, not adds, a handler
    log.warning("not shown either")
    log.error("shown")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO sender\[\d+\] epd\.test: "
                        r"room failed: room=7 request_id=r-7", lines[0])
    assert re.fullmatch(r"\S+ \S+ ERROR supervisor\[\d+\] epd\.test: shown", lines[1])


def test_setup_logging_json_one_object_per_line(root_logger, capsys):
    setup_logging(WorkerConfig(log_level="INFO", log_format="json"), "sender")
    log = logging.getLogger("epd.test")
    log.info("room failed: room=%d reason=%s", 7, 'a "quoted"\nreason')
    log.debug("not shown")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("a stage raised")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines  # the message's newline and the traceback stay inside the object
    first, second = (json.loads(line) for line in lines)
    assert set(first) == {"time", "level", "stage", "pid", "logger", "message"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    assert (first["level"], first["stage"], first["logger"]) == ("INFO", "sender", "epd.test")
    assert first["message"] == 'room failed: room=7 reason=a "quoted"\nreason'
    assert isinstance(first["pid"], int) and first["pid"] > 0
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exception"]


def test_log_format_is_validated():
    with pytest.raises(ConfigError, match="log_format must be one of text, json, got 'xml'") as e:
        load_config(environ={"EPD_LOG_FORMAT": "xml"})
    assert e.value.key == "log_format" and "(set by EPD_LOG_FORMAT)" in str(e.value)


@pytest.mark.parametrize("text, expected", [
    ("536870912", 512 << 20), ("512MiB", 512 << 20), ("1GiB", 1 << 30), ("64KiB", 64 << 10),
    ("1.5GiB", 3 << 29), ("2 mib", 2 << 20), ("100B", 100), ("1MB", 10 ** 6), ("0", 0),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "x", "-1", "1.5", "0.3KiB", "12XB", "1e6", "MiB", "1 GiB 2"])
def test_parse_size_refuses_naming_the_forms(text):
    with pytest.raises(ValueError, match="expected a.*a size: bytes, or a number and a unit: 512MiB"):
        parse_size(text)


def test_sizes_with_units_in_file_environment_and_flags(tmp_path):
    path = write(tmp_path, 'pixel_arena_bytes = "1GiB"\nembedding_arena_bytes = 268435456\n'
                           'host_cache_bytes = "2GiB"\n')
    parser = argparse.ArgumentParser()
    add_flags(parser)
    flags = flags_given(parser.parse_args(["--ring-bytes", "16MiB", "--max-pixel-bytes-per-request", "64MiB"]))
    cfg, sources = load_config(path, flags, environ={"EPD_ARENA_CACHE_BYTES": "64MiB",
                                                     "EPD_HOST_CACHE_BYTES": "512 MiB"})
    assert (cfg.pixel_arena_bytes, cfg.embedding_arena_bytes) == (1 << 30, 256 << 20)
    assert (cfg.arena_cache_bytes, cfg.host_cache_bytes) == (64 << 20, 512 << 20)
    assert (cfg.ring_bytes, cfg.max_pixel_bytes_per_request) == (16 << 20, 64 << 20)
    assert sources["pixel_arena_bytes"] == path and sources["host_cache_bytes"] == "EPD_HOST_CACHE_BYTES"
    assert sources["ring_bytes"] == "--ring-bytes"
    # `config` shows bytes and the source, as TOML that loads back
    shown = format_config(cfg, sources)
    assert re.search(r"^pixel_arena_bytes = 1073741824 +# " + re.escape(path) + "$", shown, re.M), shown
    assert re.search(r"^ring_bytes = 16777216 +# --ring-bytes$", shown, re.M), shown
    again = write(tmp_path, "\n".join(line.split("  #")[0] for line in shown.splitlines()) + "\n")
    assert load_config(again, environ={})[0] == cfg


def test_a_bad_size_names_the_key_the_source_and_the_forms(tmp_path, capsys):
    path = write(tmp_path, 'ring_bytes = "16 MeB"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path, environ={})
    assert str(e.value) == f"{path}: ring_bytes: expected an integer, got '16 MeB' (a size: {SIZE_FORMS})"
    assert e.value.key == "ring_bytes"
    parser = argparse.ArgumentParser()
    add_flags(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--ring-bytes", "lots"])
    err = capsys.readouterr().err
    assert "argument --ring-bytes: expected an integer, got 'lots' (a size: bytes, or" in err, err
    assert "512MiB" in err, err
    with pytest.raises(ConfigError, match=r"ring_bytes must be >= 1, got 0 \(set by EPD_RING_BYTES\)"):
        load_config(environ={"EPD_RING_BYTES": "0MiB"})


def test_the_tower_takes_one_torch_thread_per_cpu_it_may_run_on():
    """tower_threads 0: as many torch threads as CPUs the tower's process may run on
    (here pinned to one), not torch's own count; a number: that many."""
    import os
    import subprocess
    import sys

    code = ("import os, torch\n"
            "from pipeline.cli.config import WorkerConfig\n"
            "from pipeline.runtime.loop import Env\n"
            "torch.set_num_threads(4)\n"
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "Env(WorkerConfig(tower='qwen2.5-vl', tower_config='tiny', gpus='0'), '00000000', None).tower(0)\n"
            "print(torch.get_num_threads())\n"
            "Env(WorkerConfig(tower='qwen2.5-vl', tower_config='tiny', gpus='0', tower_threads=3), '00000000',"
            " None).tower(0)\n"
            "print(torch.get_num_threads())\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "3"]


def test_every_stage_is_given_its_settings():
    """The runtime maps the configuration onto each stage's own settings type, all of its fields."""
    from pipeline.runtime import stage_settings
    from stages import registry

    assert set(stage_settings.MAPPINGS) == set(registry.MODULES)
    cfg = WorkerConfig(tower_replicas=2, preprocess_workers=2, max_items_per_batch=3,
                       status_ipc_dirs="/run/a,/run/b").resolved()
    made = {name: stage_settings.settings_of(name, cfg) for name in registry.stage_names(2, 2)}
    assert made["scheduler"].max_items_per_batch == 3 and made["tower0"] is None
    assert made["preprocess1"] == made["preprocess0"] and made["cache"].store is None
    assert made["sender"].status_ipc_dirs == ("/run/a", "/run/b")
    assert made["intake"].endpoint == cfg.intake and made["sender"].endpoint == cfg.bootstrap
