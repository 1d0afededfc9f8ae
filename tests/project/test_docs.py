"""The documentation says what the code does: README.md is the front door (its two
commands first, under 300 lines, its examples run against a worker), docs/ holds the
rest; every relative link and #anchor points at something, every --flag named exists
in the command it belongs to, and docs/configuration.md is the generator's output."""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import re
from pathlib import Path

import numpy as np
import pytest

import run
from pipeline.cli.config import WorkerConfig
from tests.helpers import expected_sim_rows, free_port, start_worker

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
# `run.py [COMMAND]` (demo when none is named) or `benchmarks/NAME.py`; quotes and
# commas may stand between run.py and its command (a container's command list).
COMMAND = re.compile(r"run\.py\b(?:[\"',\s]+(demo|serve|config|status|bench|proxy)\b)?|benchmarks/(\w+)\.py")
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)(-?\*)?")


def text(path: Path) -> str:
    return path.read_text()


# ---------------------------------------------------------------- the README's shape

def test_readme_starts_with_the_two_commands_and_stays_short():
    readme = text(README)
    assert readme.startswith("# EPD encode worker\n\n```\n"
                             "scripts/setup.sh && .venv/bin/python run.py\n"
                             "scripts/setup.sh --engines && .venv/bin/python -m pytest -n 2 tests\n"
                             "```\n\n")
    lines = readme.count("\n")
    assert lines < 300, f"README.md has {lines} lines: move what is not the front door into docs/"


def test_readme_layout_names_every_module_and_no_other():
    """Every module of ipc/, stages/ and pipeline/ (their subfolders too) by its file name, a folder as `name/`."""
    layout = text(README).split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(?:\w+/)*?(\w+\.py|\w+/)`", layout))  # a path names its last part
    folders = ("ipc", "stages", "pipeline")
    present = set()
    for folder in folders:
        present |= {p.name for p in (ROOT / folder).rglob("*.py") if p.name != "__init__.py"}
        present |= {p.name + "/" for p in (ROOT / folder).rglob("*") if p.is_dir() and any(p.glob("*.py"))}
    missing = sorted(present - named)
    assert not missing, f"README.md's Layout does not name {missing}"
    everything = {p.name for p in ROOT.glob("*.py")} | {p.name + "/" for p in ROOT.iterdir() if p.is_dir()}
    for folder in (*folders, "tests"):
        everything |= {p.name for p in (ROOT / folder).rglob("*.py")}
        everything |= {p.name + "/" for p in (ROOT / folder).rglob("*") if p.is_dir()}
    stray = sorted(named - everything)
    assert not stray, f"README.md's Layout names what does not exist: {stray}"


# ---------------------------------------------------------------- links

def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", text(path)).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    problems = []
    for target in LINK.findall(FENCE.sub("", text(path))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not ours to check
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{path.name}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{path.name}: {target}: no heading #{anchor} in {dest.name}")
    return problems


def test_every_relative_link_and_anchor_exists():
    assert [d.name for d in DOCS[1:]], "docs/ holds no pages"
    problems = [p for doc in DOCS for p in broken_links(doc)]
    assert not problems, "\n".join(problems)


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](nothere.md) [bad](#no-such-heading) "
                    "[web](https://example.com/x)\n")
    assert broken_links(page) == ["page.md: nothere.md: no such file",
                                  "page.md: #no-such-heading: no heading #no-such-heading in page.md"]


# ---------------------------------------------------------------- flags

def run_py_flags(command: str) -> set[str]:
    """The flags `run.py COMMAND` takes, read from its argparse parser's help."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        run.build_parser().parse_args([command, "--help"])
    return {"--" + f for f in re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*[a-z0-9])", out.getvalue())}


def script_flags(path: Path) -> set[str]:
    """The flags a script's argparse parser takes: every `add_argument("--x", ...)` in it."""
    flags = set()
    for node in ast.walk(ast.parse(text(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags | {"--help"}


def known_flags() -> dict[str, set[str]]:
    """Flags by command: "run.py demo" ... "run.py bench", "benchmarks/NAME.py"."""
    known = {f"run.py {c}": run_py_flags(c) for c in ("demo", "serve", "config", "status")}
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        known[f"benchmarks/{path.name}"] = script_flags(path)
    known["run.py bench"] = known["benchmarks/bench.py"]
    known["tokenspeed"] = {"--disaggregation-bootstrap-port"}  # docs/tokenspeed.md: tokenspeed's own flag
    known["run.py proxy"] = script_flags(ROOT / "pipeline" / "integrations" / "proxy.py")
    known["scripts/setup.sh"] = set(re.findall(r'"\$\{1:-\}" = "(--[a-z-]+)"', text(ROOT / "scripts" / "setup.sh")))
    return known


def segments(doc: str) -> list[str]:
    """Pieces of text a flag is read in: each line of a code block (a line ending in a
    backslash joined with the next), each inline code span, and the prose around them."""
    out = []
    for block in FENCE.findall(doc):
        out += block.replace("\\\n", " ").splitlines()[1:-1]
    prose = FENCE.sub("", doc)
    out += INLINE_CODE.findall(prose)
    out.append(INLINE_CODE.sub(" ", prose))
    return out


def unknown_flags(doc: str, known: dict[str, set[str]]) -> list[str]:
    """A flag after a command must be one of that command's; any other flag must be one
    of some command's. Lines of pytest's and vLLM's command lines name their flags: skipped."""
    anywhere = set().union(*known.values())
    problems = []
    for seg in segments(doc):
        if "pytest" in seg or "vllm.entrypoints" in seg:
            continue
        commands = [(m.start(), f"run.py {m.group(1) or 'demo'}" if m.group(2) is None
                     else f"benchmarks/{m.group(2)}.py") for m in COMMAND.finditer(seg)]
        for m in FLAG.finditer(seg):
            owner = next((c for pos, c in reversed(commands) if pos < m.start()), None)
            allowed = known.get(owner, anywhere) if owner else anywhere
            flag = "--" + m.group(1)
            ok = (any(f.startswith(flag + "-") for f in allowed) if m.group(2) else flag in allowed)
            if not ok:
                problems.append(f"{flag}{m.group(2) or ''} ({owner or 'no command'}): {seg.strip()[:100]}")
    return problems


def test_every_flag_named_exists_in_its_command():
    known = known_flags()
    assert "--tower-replicas" in known["run.py serve"] and "--dense" in known["benchmarks/chaos.py"]
    problems = [f"{doc.name}: {p}" for doc in DOCS for p in unknown_flags(text(doc), known)]
    assert not problems, "flags that do not exist:\n" + "\n".join(problems)


def test_the_flag_check_finds_a_flag_its_command_lacks():
    known = {"run.py serve": {"--mode", "--ring-bytes"}, "run.py demo": {"--mode"},
             "benchmarks/ring.py": {"--quick"}}
    doc = ("Run `run.py serve --mode inprocess --ring-bytes 8` or `benchmarks/ring.py --quick`.\n"
           "```\nrun.py --mode pipeline --ring-bytes 8 \\\n    --nope\n```\n"
           "Prose may name `--quick` and `--ring-*`, not `--gone`.\n")
    assert unknown_flags(doc, known) == [
        "--ring-bytes (run.py demo): run.py --mode pipeline --ring-bytes 8      --nope",
        "--nope (run.py demo): run.py --mode pipeline --ring-bytes 8      --nope",
        "--gone (no command): --gone",
    ]


# ---------------------------------------------------------------- generated pages

def test_configuration_doc_is_current():
    spec = importlib.util.spec_from_file_location("config_doc", ROOT / "scripts" / "config_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert text(ROOT / "docs" / "configuration.md") == module.render(), (
        "docs/configuration.md is stale: .venv/bin/python scripts/config_doc.py > docs/configuration.md")


# ---------------------------------------------------------------- the README's examples

EXAMPLE = re.compile(r"<!-- example: (\w+)[^>]*-->\n```python\n(.*?)^```", re.M | re.S)


@pytest.mark.timeout(120)
def test_readme_examples_run_against_a_worker(shm_prefix, tmp_path):
    """The gateway's and the prefill rank's examples, as printed, against a worker with the
    sim tower's defaults (as `run.py serve --tower sim` starts it); only where it listens
    differs, so that the test shares nothing with another run."""
    examples = dict(EXAMPLE.findall(text(README)))
    assert set(examples) == {"gateway", "prefill"}
    cfg = WorkerConfig(tower="sim", shm_prefix=shm_prefix, run_dir=str(tmp_path),
                       intake=f"ipc://{tmp_path}/intake.sock", bootstrap=f"tcp://127.0.0.1:{free_port()}",
                       pixel_arena_bytes=64 << 20, embedding_arena_bytes=32 << 20, arena_cache_bytes=8 << 20,
                       host_cache_bytes=16 << 20, max_tombstones=1024, max_live_rooms=256)
    defaults = WorkerConfig().resolved()
    where = {f'"{defaults.intake}"': f'"{cfg.intake}"', f'"{defaults.bootstrap}"': f'"{cfg.bootstrap}"',
             f'shm_prefix="{defaults.shm_prefix}"': f'shm_prefix="{cfg.shm_prefix}"'}
    code = {}
    for name, source in examples.items():
        for default, here in where.items():
            source = source.replace(default, here)
        code[name] = compile(source, f"README.md ({name} example)", "exec")
    assert all(default in examples["gateway"] + examples["prefill"] for default in where), (
        "the examples name the worker's default endpoints and prefix")

    worker = start_worker("inprocess", cfg)
    gateway, prefill, printed = {}, {}, io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(code["gateway"], gateway)
            exec(code["prefill"], prefill)
    finally:
        worker.close()
    assert "main" in prefill, f"the prefill example got no rows: {printed.getvalue()}"
    expected, _ = expected_sim_rows(gateway["pixels"], "image", 4, 3584, 0, "bfloat16")
    assert prefill["deepstack"] is None
    assert np.array_equal(prefill["main"], expected)
