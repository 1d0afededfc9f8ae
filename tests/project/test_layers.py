"""The layers only point down: ipc/ <- stages/ <- pipeline/, and no import circles.

Inside pipeline/, each part may import only the parts below it (LAYERS): the peer
libraries (peers/) nothing of the worker; the runtime the settings (cli/config.py), the
operations and the fronts it serves; the integrations the wiring; the command line
everything. Nothing but pipeline/testing/ and the tests imports pipeline/testing/.

Every import counts, the ones inside functions too: a lazy import is still a
dependency, and hiding a circle behind one is what this test exists to stop.
"""
from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ipc", "stages", "pipeline")
# What each package may import of the project (itself always).
ALLOWED = {"ipc": {"ipc"}, "stages": {"ipc", "stages"}, "pipeline": {"ipc", "stages", "pipeline"}}
# What each part of pipeline/ may import of pipeline/ (itself always; by module prefix).
LAYERS = {
    "pipeline.peers": (),  # for the other side of the wire (gateways, prefill ranks)
    "pipeline.ops": ("pipeline.peers", "pipeline.cli.config"),
    "pipeline.integrations": ("pipeline.peers", "pipeline.ops", "pipeline.runtime.wiring"),
    "pipeline.runtime": ("pipeline.peers", "pipeline.ops", "pipeline.cli.config", "pipeline.integrations"),
    "pipeline.cli": ("pipeline.peers", "pipeline.ops", "pipeline.runtime", "pipeline.integrations"),
    "pipeline.testing": ("pipeline.peers", "pipeline.ops", "pipeline.runtime", "pipeline.integrations",
                         "pipeline.cli"),
}
# Libraries for the other side of the wire: no stage inside either.
CLIENT_LIBRARIES = "pipeline/peers/"


def module_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> list[tuple[str, int]]:
    """(project module, line) for every import in the file, resolved to a module where one exists."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_of(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` names a module when pkg/mod.py exists
            names = [f"{base}.{a.name}" if _exists(f"{base}.{a.name}", root) else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES:
                while name and not _exists(name, root):
                    name = name.rpartition(".")[0]
                if name:
                    out.append((name, node.lineno))
    return out


def _exists(module: str, root: Path) -> bool:
    p = root.joinpath(*module.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _file(module: str, root: Path) -> str:
    p = root.joinpath(*module.split("."))
    return str((p.with_suffix(".py") if p.with_suffix(".py").is_file() else p / "__init__.py").relative_to(root))


def violations(root: Path = ROOT) -> list[str]:
    """Every upward import and every circle, each naming the files involved."""
    graph: dict[str, set[str]] = {}
    problems = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            mod = module_of(path, root)
            rel = str(path.relative_to(root))
            graph.setdefault(mod, set())
            for target, line in imports_of(path, root):
                if target == mod:
                    continue
                graph[mod].add(target)
                top = target.split(".")[0]
                if top not in ALLOWED[pkg]:
                    problems.append(f"{rel}:{line} imports {_file(target, root)}: {pkg}/ may import only "
                                    f"{', '.join(sorted(ALLOWED[pkg]))}")
                elif rel.startswith(CLIENT_LIBRARIES) and top == "stages":
                    problems.append(f"{rel}:{line} imports {_file(target, root)}: a client library "
                                    f"must not pull in a stage")
                elif top == "pipeline" and (why := _layer_problem(mod, target)):
                    problems.append(f"{rel}:{line} imports {_file(target, root)}: {why}")
    for cycle in _cycles(graph):
        problems.append("import circle: " + " -> ".join(_file(m, root) for m in cycle + cycle[:1]))
    return problems


def _part(module: str) -> str | None:
    return next((p for p in LAYERS if module == p or module.startswith(p + ".")), None)


def _layer_problem(mod: str, target: str) -> str:
    """Why `mod` may not import `target` (both in pipeline/), or ""."""
    here, there = _part(mod), _part(target)
    if here is None or there is None or here == there:
        return ""
    if any(target == a or target.startswith(a + ".") for a in LAYERS[here]):
        return ""
    allowed = ", ".join(LAYERS[here]) or "nothing else of pipeline/"
    return f"{here.replace('.', '/')}/ may import only {allowed}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(_path_through(sorted(comp), graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _path_through(comp: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A cycle inside the component, starting from its first module."""
    members = set(comp)
    start = comp[0]
    path, seen = [start], {start}
    while True:
        nxt = sorted(w for w in graph[path[-1]] if w in members)
        back = [w for w in nxt if w == start]
        if back and len(path) > 1:
            return path
        fresh = [w for w in nxt if w not in seen]
        if not fresh:
            return path
        path.append(fresh[0])
        seen.add(fresh[0])


def test_layers_point_down_and_have_no_circles():
    assert violations() == []


def _copy_tree(tmp_path: Path) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_a_planted_upward_import_is_named_with_both_files(tmp_path):
    root = _copy_tree(tmp_path)
    ring = root / "ipc" / "ring.py"
    ring.write_text(ring.read_text() + "\n\ndef _planted():\n    from pipeline.runtime import supervisor\n")
    found = violations(root)
    assert found[0].startswith("ipc/ring.py:") \
        and "imports pipeline/runtime/supervisor.py" in found[0], found


def test_a_client_library_that_imports_a_stage_is_named(tmp_path):
    root = _copy_tree(tmp_path)
    client = root / "pipeline" / "peers" / "client.py"
    client.write_text(client.read_text() + "\nfrom stages import intake\n")
    found = violations(root)
    assert len(found) == 1 and "pipeline/peers/client.py" in found[0] and "stages/intake.py" in found[0], found


def test_a_planted_circle_is_named_with_its_files(tmp_path):
    root = _copy_tree(tmp_path)
    shm = root / "ipc" / "shm.py"
    shm.write_text(shm.read_text() + "\n\ndef _planted():\n    from ipc import ring\n")
    found = violations(root)
    assert len(found) == 1 and found[0].startswith("import circle:") \
        and "ipc/ring.py" in found[0] and "ipc/shm.py" in found[0], found


def test_a_peer_library_that_imports_the_runtime_is_named(tmp_path):
    root = _copy_tree(tmp_path)
    receiver = root / "pipeline" / "peers" / "receiver.py"
    receiver.write_text(receiver.read_text() + "\nfrom pipeline.runtime import wiring\n")
    found = violations(root)
    assert len(found) == 1 and "pipeline/peers/receiver.py" in found[0] \
        and "pipeline/runtime/wiring.py" in found[0] and "pipeline/peers/ may import only" in found[0], found


def test_production_code_that_imports_the_test_support_is_named(tmp_path):
    root = _copy_tree(tmp_path)
    loop = root / "pipeline" / "runtime" / "loop.py"
    loop.write_text(loop.read_text() + "\nfrom pipeline.testing import sim\n")
    found = violations(root)
    assert len(found) == 1 and "pipeline/runtime/loop.py" in found[0] and "pipeline/testing/sim.py" in found[0], found


def configuration_readers(root: Path = ROOT) -> list[str]:
    """Lines of stages/ that read the worker's configuration: a stage takes its own
    settings type (stages/settings.py), which the runtime maps the configuration onto."""
    found = []
    for path in sorted((root / "stages").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\benv\.cfg\b|\.cfg\.|\bWorkerConfig\b", line):
                found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return found


def test_no_stage_reads_the_workers_configuration(tmp_path):
    assert configuration_readers() == []
    root = _copy_tree(tmp_path)
    scheduler = root / "stages" / "scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\n\ndef _planted(env):\n    return env.cfg.ring_bytes\n")
    found = configuration_readers(root)
    assert len(found) == 1 and found[0].startswith("stages/scheduler.py:"), found
