"""One style: `ruff check` (pyproject.toml's [tool.ruff]) is clean over the whole tree,
and a planted violation is named."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ("ipc", "stages", "pipeline", "tests", "benchmarks", "scripts", "run.py", "pyproject.toml")


def ruff(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=root, capture_output=True, text=True, timeout=120)


def test_ruff_is_clean():
    proc = ruff(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_planted_violation_is_named(tmp_path):
    for name in TREE:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(src, tmp_path / name)
    ring = tmp_path / "ipc" / "ring.py"
    ring.write_text(ring.read_text() + "\n\ndef _planted():\n    import json\n")
    proc = ruff(tmp_path)
    assert proc.returncode == 1 and "ipc/ring.py" in proc.stdout and "F401" in proc.stdout, proc.stdout  # json unused
