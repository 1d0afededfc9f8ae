"""The code's shape: no module reaches into another's private state, no file or
function grows past what a reader holds in their head, and comments give reasons,
not measured figures (a figure goes stale; it belongs in a benchmark's output).
"""
from __future__ import annotations

import ast
import io
import re
import shutil
import tokenize
from pathlib import Path

from tests.project.test_layers import _copy_tree  # the same three packages

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("ipc", "stages", "pipeline")
SIZED = CHECKED + ("benchmarks",)
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
# The standard library's documented underscore names.
DOCUMENTED = {"_exit", "_replace", "_asdict", "_fields", "_make", "_field_defaults",
              "_getframe", "_current_frames", "_value_", "_name_", "_missing_"}
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ns|us|µs|ms|MB/s|GB/s|GiB/s|MiB/s)\b")


def _modules(root: Path, packages) -> list[Path]:
    return [p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]


def _defined_private(tree: ast.AST) -> set[str]:
    """Underscore names a module defines: functions, classes, attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_accesses(root: Path = ROOT) -> list[str]:
    """Every `x._name` where `_name` is private to another module of the project."""
    trees = {p: ast.parse(p.read_text(), str(p)) for p in _modules(root, CHECKED)}
    defined = {p: _defined_private(t) for p, t in trees.items()}
    elsewhere = set().union(*defined.values()) if defined else set()
    problems = []
    for path, tree in trees.items():
        own = defined[path]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            name = node.attr
            if not name.startswith("_") or name.startswith("__") or name in DOCUMENTED:
                continue
            if name in own:
                continue  # this module's own (an object of the same class)
            if name in elsewhere or not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                problems.append(f"{path.relative_to(root)}:{node.lineno} reads "
                                f"{ast.unparse(node)}, private to another module")
    return problems


def oversized(root: Path = ROOT) -> list[str]:
    problems = []
    for path in _modules(root, SIZED):
        rel = path.relative_to(root)
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            problems.append(f"{rel}: {lines} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    problems.append(f"{rel}:{node.lineno} {node.name}: {n} lines (at most {MAX_FUNCTION_LINES})")
    return problems


def figures_in_comments(root: Path = ROOT) -> list[str]:
    problems = []
    for path in _modules(root, CHECKED):
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.COMMENT and FIGURE.search(tok.string):
                problems.append(f"{path.relative_to(root)}:{tok.start[0]} {tok.string.strip()}")
    return problems


def test_no_module_reads_another_modules_private_names():
    assert private_accesses() == []


def test_no_file_or_function_is_oversized():
    assert oversized() == []


def test_comments_quote_no_measured_figures():
    assert figures_in_comments() == []


def test_a_planted_private_access_is_named(tmp_path):
    root = _copy_tree(tmp_path)
    sched = root / "stages" / "scheduler.py"
    sched.write_text(sched.read_text() + "\n\ndef planted(table):\n    return table._lock\n")
    found = private_accesses(root)
    assert any(f.startswith("stages/scheduler.py:") and "table._lock" in f for f in found), found


def test_a_planted_long_function_and_figure_are_named(tmp_path):
    root = _copy_tree(tmp_path)
    for pkg in SIZED:
        if not (root / pkg).exists():
            shutil.copytree(ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    ring = root / "ipc" / "ring.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    ring.write_text(ring.read_text() + f"\n\ndef planted():  # takes 12 us\n{body}")
    assert any("planted" in f for f in oversized(root))
    assert any("12 us" in f for f in figures_in_comments(root))
