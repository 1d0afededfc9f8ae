"""run.py bench's plot: drawn from the JSON the benchmarks write, without running them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import bench
from benchmarks.harness import report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_plot_writes_a_png_of_both_modes(tmp_path):
    def lat(base: float) -> dict:
        return {"p50": base, "p90": base + 1, "p99": base + 3}

    results = {"pipeline": {
        "load": {"windows": [1, 4, 16], "inprocess": [200.0, 350.0, 420.0], "pipeline": [150.0, 330.0, 440.0]},
        "raw": {"cpu_bound_inprocess": {"latency_ms": lat(4.0), "images_per_s": 450.0},
                "cpu_bound_pipeline": {"latency_ms": lat(5.0), "images_per_s": 400.0},
                "small_inprocess": {"latency_ms": lat(1.2), "images_per_s": 1500.0},
                "small_pipeline": {"latency_ms": lat(2.5), "images_per_s": 1000.0},
                "tiny_qwen_pipeline": {"images_per_s": 210.0}},
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


def test_run_py_bench_runs_the_small_scenario():
    assert "small" in bench.PIPELINE_SCENARIOS.split(",")


def test_withdrawn_targets_are_reported_not_judged(capsys):
    """A withdrawn target's figure is printed and written with "(no target)", never MISSED;
    the two targets still held are judged; every figure's key is in the JSON."""
    results = {"small_pipeline_vs_inprocess_throughput": 0.5, "pipeline_vs_device_bound": 0.5}
    report.print_ratio("pipeline_cpu_per_image_vs_inprocess", 3.0, 1.0, results, ".3f")
    assert "(no target)" in capsys.readouterr().out
    summary = report.judge(results)
    assert results["targets_met"]["small_pipeline_vs_inprocess_throughput"] is None
    assert results["targets_met"]["pipeline_cpu_per_image_vs_inprocess"] is None
    assert results["targets_met"]["pipeline_vs_device_bound"] is False
    assert results["targets"]["replicas2_vs_one_device_bound"] == ">= 1.8"
    assert results["replicas2_vs_one_device_bound"] is None  # not measured, still a key
    assert "MISSED" in summary and summary.count("MISSED") == 1
    assert set(results["targets"]) == set(report.TARGETS) == set(results["targets_met"])


def test_gpu_bench_runs_its_logic_on_cpu(tmp_path):
    """benchmarks/gpu.py --device cpu --tiny --replicas 2: the checkpoint of random weights,
    both workers on it, the tower alone on the scheduler's batches, the pipeline with two
    tower replicas, the ratios (not asserted)."""
    out = tmp_path / "gpu.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--device", "cpu", "--tiny",
                        "--images", "24", "--trials", "1", "--replicas", "2", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["failed_rooms"] == 0 and r["violations"] == 0
    for key in ("pipeline_vs_tower_alone", "inprocess_vs_tower_alone", "replicas2_vs_one"):
        assert r[key] > 0
    assert "pipeline_vs_tower_alone = " in p.stdout


def test_gpu_bench_refuses_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "no CUDA device" in p.stderr
