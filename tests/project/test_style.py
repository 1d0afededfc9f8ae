"""One style: ruff's lint over the whole tree, and ruff's format and mypy over ipc/ and
the records (the parts every process and every peer of the wire shares), as
pyproject.toml configures them. Run by the README's test command, so CI runs them too;
each fails with the tool's own report.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ("ipc", "stages", "pipeline", "tests", "benchmarks", "scripts", "run.py", "pyproject.toml")
FORMATTED = ("ipc", "stages/records.py")


def _tool(root: Path, *args: str) -> subprocess.CompletedProcess:
    """A tool of this environment (the test extra installs both) run in ``root``."""
    return subprocess.run([sys.executable, "-m", *args], cwd=root, capture_output=True, text=True, timeout=300)


def lint(root: Path = ROOT) -> subprocess.CompletedProcess:
    return _tool(root, "ruff", "check", "--no-cache", "--output-format", "concise", ".")


def format_check(root: Path = ROOT) -> subprocess.CompletedProcess:
    return _tool(root, "ruff", "format", "--no-cache", "--check", *FORMATTED)


def typecheck(root: Path = ROOT, cache: Path | None = None) -> subprocess.CompletedProcess:
    # The files and settings are pyproject.toml's; the cache is the tool's own in a checkout.
    return _tool(root, "mypy", *(["--cache-dir", str(cache)] if cache else []))


def _report(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_the_tree_is_lint_clean():
    proc = lint()
    assert proc.returncode == 0, _report(proc)


def test_ipc_and_the_records_are_formatted():
    proc = format_check()
    assert proc.returncode == 0, _report(proc)


def test_ipc_and_the_records_type_check():
    proc = typecheck()
    assert proc.returncode == 0, _report(proc)


def _copy_tree(root: Path) -> Path:
    for name in TREE:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(src, root / name)
    return root


def test_a_planted_violation_of_each_is_named(tmp_path):
    root = _copy_tree(tmp_path / "tree")
    assert lint(root).returncode == format_check(root).returncode == 0  # the copy is as clean as the tree
    ring = root / "ipc" / "ring.py"
    ring.write_text(ring.read_text() + '\n\ndef planted() -> int:\n    import os\n    return "not an int"\n')
    records = root / "stages" / "records.py"
    records.write_text(records.read_text() + "\nPLANTED = ( 1,2 )\n")
    linted = lint(root)
    assert linted.returncode != 0 and "ipc/ring.py" in linted.stdout and "F401" in linted.stdout, _report(linted)
    formatted = format_check(root)
    assert formatted.returncode != 0 and "stages/records.py" in formatted.stdout, _report(formatted)
    typed = typecheck(root, tmp_path / "mypy-cache")
    assert typed.returncode != 0 and "ipc/ring.py" in typed.stdout and "return-value" in typed.stdout, _report(typed)
