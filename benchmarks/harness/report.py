"""A benchmark's figures: rates and percentiles, each figure a ratio against a baseline
measured in the same run, printed with its target where one is held, and the JSON."""
from __future__ import annotations

import json

# Every ratio benchmarks/pipeline.py reports by name, with its target; None where the
# target was withdrawn: the figure is still measured, printed and written, not judged.
TARGETS = {
    "pipeline_vs_inprocess_throughput": None,
    "small_pipeline_vs_inprocess_throughput": None,
    "pipeline_cpu_per_image_vs_inprocess": None,
    "small_pipeline_cpu_per_image_vs_inprocess": None,
    "added_latency_vs_hop_floor": None,
    "intake_cpu_vs_raw_read": None,
    "pipeline_vs_device_bound": (">=", 0.97),
    "tiny_pipeline_vs_tower_alone": None,
    "replicas2_vs_one_device_bound": (">=", 1.8),
    "tokenspeed_front_vs_native_throughput": (">=", 0.95),
    "tokenspeed_front_cpu_per_image_vs_native": None,
    "store_tower_work_saved": (">=", 0.45),
    "store_hit_latency_vs_local_miss": ("<=", 0.5),
    # issue #35: per core, against the Hugging Face processor; intake's CPU per image
    "media_preprocess_per_process_vs_hf": (">=", 2.0),
    "media_preprocess_scaling_2_vs_1": None,
    "media_intake_cpu_vs_pixels": ("<=", 0.2),
}


def met(key: str, value) -> bool | None:
    """Whether `value` meets the target of `key`; None where it holds none or was not measured."""
    target = TARGETS.get(key)
    if target is None or value is None:
        return None
    op, bound = target
    return value >= bound if op == ">=" else value <= bound


def verdict(key: str, value) -> str:
    """What follows a figure on its line."""
    if value is None:
        return "not measured"
    if TARGETS.get(key) is None:
        return "(no target)"
    op, bound = TARGETS[key]
    return f"(target {op} {bound}: {'met' if met(key, value) else 'MISSED'})"


def print_ratio(key: str, num: float, den: float, results: dict, fmt: str = ".1f", note: str = "") -> float:
    """results[key] = num / den, printed as `key = num / den = ratio  (verdict)note`."""
    ratio = num / den
    results[key] = ratio
    print(f"{key} = {num:{fmt}} / {den:{fmt}} = {ratio:.2f}  {verdict(key, ratio)}{note}", flush=True)
    return ratio


def judge(results: dict) -> str:
    """The targets into the results (every figure's key present, None where not measured);
    the summary line."""
    results["targets"] = {k: (None if t is None else f"{t[0]} {t[1]}") for k, t in TARGETS.items()}
    results["targets_met"] = {k: met(k, results.get(k)) for k in TARGETS}
    for k in TARGETS:
        results.setdefault(k, None)
    judged = [f"{k} {'not measured' if results[k] is None else ('met' if ok else 'MISSED')}"
              for k, ok in results["targets_met"].items() if TARGETS[k] is not None]
    withdrawn = [k for k in TARGETS if TARGETS[k] is None]
    return "targets: " + ", ".join(judged) + "; no target: " + ", ".join(withdrawn)


def write_json(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def steady_rate(done_at: list[float], skip: int) -> float:
    """Completions per second: least-squares slope of index against time, `skip` left
    out at both ends (fill and drain of the window)."""
    ts = sorted(done_at)
    if len(ts) < 4 * skip:  # too few to leave both ends out: the whole run
        skip = 0
    ts = ts[skip:len(ts) - skip]
    n = len(ts)
    if n < 2:
        return 0.0
    mt = sum(ts) / n
    mi = (n - 1) / 2
    var = sum((t - mt) ** 2 for t in ts)
    cov = sum((t - mt) * (i - mi) for i, t in enumerate(ts))
    return cov / var if var > 0 else 0.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return str(x)


def cpu_line(trial: dict) -> str:
    sys_ = trial["cpu_sys_ms_per_image"]
    return ", ".join(f"{k} {v:.2f} ({sys_[k]:.2f} sys)" for k, v in trial["cpu_ms_per_image"].items())


def describe(r: dict) -> str:
    s = (f"  {r['mode']:<9}  {r.get('images_per_s', 0.0):7.1f} images/s")
    if r.get("trials"):
        s += "  (trials " + ", ".join(f"{t['images_per_s']:.1f}" for t in r["trials"]) + ";"
        s += " end-to-end " + ", ".join(f"{t['images_per_s_end_to_end']:.1f}" for t in r["trials"]) + ")"
    s += f"  peak RSS {r['peak_rss_mib']:.0f} MiB, PSS {r['peak_pss_mib']:.0f} MiB, start {r.get('start_s', 0):.1f} s"
    if r.get("trials"):
        s += f"\n             cpu ms/image: {cpu_line(r['trials'][r['best_trial']])}"
    return s
