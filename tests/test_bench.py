"""run.py bench's plot: drawn from the JSON the benchmarks write, without running them."""
from __future__ import annotations

import importlib.util
import os

import pytest

# Loaded by path: putting benchmarks/ on sys.path would let benchmarks/pipeline.py
# shadow the pipeline package for every later test in this process.
_spec = importlib.util.spec_from_file_location(
    "bench", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_plot_writes_a_png_of_both_modes(tmp_path):
    lat = lambda base: {"p50": base, "p90": base + 1, "p99": base + 3}
    results = {"pipeline": {
        "load": {"windows": [1, 4, 16], "inprocess": [200.0, 350.0, 420.0], "pipeline": [150.0, 330.0, 440.0]},
        "raw": {"cpu_bound_inprocess": {"latency_ms": lat(4.0)}, "cpu_bound_pipeline": {"latency_ms": lat(5.0)}},
    }}
    png = tmp_path / "bench.png"
    bench.plot(results, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000  # axes, two series, bars: not an empty canvas


def test_unknown_part_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--only", "ring,nonsense"])
    assert e.value.code == 2
    assert "nonsense" in capsys.readouterr().err
