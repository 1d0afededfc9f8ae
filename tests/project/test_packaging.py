"""`pip install .` as a gateway or a prefill rank runs it: in a fresh virtual environment
(no system site-packages) the package and its base dependencies install from the index,
`pipeline.peers.client` and `pipeline.peers.receiver` import without torch, and the `epd-worker`
console script lists the subcommands. On Python 3.11 (this suite's), and on 3.12 and
3.13 where such an interpreter is on this machine."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)
# What a gateway or prefill rank must not be made to install.
HEAVY = ("torch", "transformers", "matplotlib")

IMPORTS = f"""
import importlib.util, sys
import pipeline.peers.client, pipeline.peers.receiver
assert pipeline.peers.client.__file__.startswith(sys.prefix), pipeline.peers.client.__file__
heavy = [m for m in {HEAVY!r} if importlib.util.find_spec(m) is not None]
assert not heavy, f"importable in a base install: {{heavy}}"
assert not [m for m in sys.modules if m.split(".")[0] in {HEAVY!r}]
from ipc.transport import TransportError
try:  # no Mooncake build is a base dependency: the receiver says which to install
    pipeline.peers.receiver.Receiver("rx", "tcp://127.0.0.1:9")
except TransportError as e:
    assert "mooncake" in str(e).lower(), e
else:
    raise AssertionError("a Receiver started without Mooncake")
print("imports ok")
"""


def interpreter(version: str) -> str | None:
    """A working python`version` on this machine: on PATH, or one pyenv installed."""
    if sys.version_info[:2] == tuple(map(int, version.split("."))):
        return sys.executable
    found = [shutil.which(f"python{version}")]
    found += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))
    for path in filter(None, found):
        p = subprocess.run([path, "-c", "import venv, ensurepip"], capture_output=True, timeout=30)
        if p.returncode == 0:  # a pyenv shim without that version selected fails here
            return path
    return None


def index_reachable() -> str:
    """Why pip cannot reach an index ("" when it can): the test's one reason to skip."""
    p = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "setuptools"],
                       capture_output=True, text=True, timeout=120)
    if p.returncode == 0:
        return ""
    return "pip cannot reach an index: " + (p.stderr.strip().splitlines() or ["(no message)"])[-1]


def source_copy(dest: Path) -> Path:
    """What the package is built from, copied: an in-tree build would write build/ and
    *.egg-info into the checkout that the suite's editable install uses."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for name in ("ipc", "pipeline", "stages"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest)
    return dest


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    why = index_reachable()
    if why:
        print(why)
        pytest.skip(why)
    return source_copy(tmp_path_factory.mktemp("src"))


@pytest.mark.parametrize("version", ["3.11", "3.12", "3.13"])
def test_pip_install_gives_the_libraries_without_torch(version, source, tmp_path):
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no Python {version} interpreter on this machine")
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_ = venv / "bin"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_", "VIRTUAL_ENV", "PYTHON"))}
    p = subprocess.run([str(bin_ / "python"), "-m", "pip", "install", "-q", str(source)],
                       capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    # Run from elsewhere than the checkout, so that only the installed package is found.
    p = subprocess.run([str(bin_ / "python"), "-c", IMPORTS], capture_output=True, text=True,
                       timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 0 and "imports ok" in p.stdout, p.stdout + p.stderr

    p = subprocess.run([str(bin_ / "epd-worker"), "--help"], capture_output=True, text=True,
                       timeout=60, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: epd-worker ")
    listed = re.findall(r"^    (\w+) +\S", p.stdout.split("\n  COMMAND\n", 1)[-1].split("\n\n")[0], re.M)
    assert listed == COMMANDS, p.stdout
    p = subprocess.run([str(bin_ / "epd-worker"), "config", "--json", "--tower", "sim"], capture_output=True,
                       text=True, timeout=60, env=env, cwd=tmp_path)
    assert p.returncode == 0 and '"tower"' in p.stdout, p.stderr
