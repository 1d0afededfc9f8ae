"""Scenario tiny: both modes with the tiny Qwen2.5-VL tower, against the same tower's
forward alone on the batches the scheduler forms from the same images (one process),
and that forward again beside a process spinning a Python loop."""
from __future__ import annotations

import dataclasses
import os

from benchmarks.harness.baselines import in_child, tower_alone
from benchmarks.harness.report import describe, verdict
from benchmarks.harness.session import run_pair
from benchmarks.scenarios.common import TINY_GRID, Bench


def tiny(b: Bench) -> None:
    n, trials = b.size("tiny")
    args = b.args
    print(f"tiny Qwen2.5-VL tower: grid {TINY_GRID}, {n} images x {trials} trials "
          f"per mode, torch threads {args.torch_threads or 'default'}; the tower alone on the "
          f"scheduler's batches of the same images, one process", flush=True)
    if args.torch_threads:
        # Read when torch loads, in the worker processes (spawned after this).
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.torch_threads)

    def alone(sessions) -> dict:
        cfg = dataclasses.asdict(sessions["pipeline"].cfg)
        return {"tower_alone": in_child(tower_alone, cfg, [TINY_GRID], n, max(2, trials), args.seed),
                "tower_alone_busy_neighbour": in_child(tower_alone, cfg, [TINY_GRID], n, max(2, trials),
                                                       args.seed, True)}

    pair = run_pair("tiny", b.tmp, args, tower="qwen", grids=(TINY_GRID,), n=n, trials=trials,
                    warmup=b.warmup, between=alone)
    tiny_res = {"torch_threads": args.torch_threads or "default"}
    for mode, r in pair.items():
        b.raw[f"tiny_qwen_{mode}"] = r
        tiny_res[f"{mode}_images_per_s"] = r["images_per_s"]
        print(describe(r), flush=True)
    b.results["tiny_qwen"] = tiny_res
    tiny_figures(b, tiny_res, pair["pipeline"]["between"])


def tiny_figures(b: Bench, tiny_res: dict, between: dict) -> None:
    results = b.results
    tiny_res["pipeline_vs_inprocess"] = tiny_res["pipeline_images_per_s"] / tiny_res["inprocess_images_per_s"]
    ta = between["tower_alone"]
    tiny_res["tower_alone"] = ta
    ratio = tiny_res["pipeline_images_per_s"] / ta["images_per_s"]
    results["tiny_pipeline_vs_tower_alone"] = ratio
    results["tiny_inprocess_vs_tower_alone"] = tiny_res["inprocess_images_per_s"] / ta["images_per_s"]
    formed = ", ".join(
        f"{m} {t['tower_items'] / max(1, t['tower_batches']):.1f}"
        for m, t in ((m, b.raw[f"tiny_qwen_{m}"]["trials"][b.raw[f"tiny_qwen_{m}"]["best_trial"]])
                     for m in ("inprocess", "pipeline")) if "tower_batches" in t)
    print(f"tiny qwen images/s: inprocess {tiny_res['inprocess_images_per_s']:.1f}, pipeline "
          f"{tiny_res['pipeline_images_per_s']:.1f} (ratio {tiny_res['pipeline_vs_inprocess']:.2f}); tower "
          f"alone {ta['images_per_s']:.1f} (trials {', '.join(f'{x:.1f}' for x in ta['trials'])}; "
          f"{ta['items_per_batch']:.1f} images per batch; the runs formed {formed})", flush=True)
    busy = between["tower_alone_busy_neighbour"]
    tiny_res["tower_alone_busy_neighbour"] = busy
    results["tiny_tower_alone_busy_neighbour_vs_alone"] = busy["images_per_s"] / ta["images_per_s"]
    print(f"  the tower alone while another process spins a Python loop (the other core busy, "
          f"nothing shared): {busy['images_per_s']:.1f} images/s = "
          f"{results['tiny_tower_alone_busy_neighbour_vs_alone']:.2f} of alone (no target: what any "
          f"work beside the forward costs it on this machine)", flush=True)
    print(f"tiny_pipeline_vs_tower_alone = {tiny_res['pipeline_images_per_s']:.1f} / {ta['images_per_s']:.1f} "
          f"= {ratio:.2f}  {verdict('tiny_pipeline_vs_tower_alone', ratio)}   (inprocess: "
          f"{results['tiny_inprocess_vs_tower_alone']:.2f}, no target)", flush=True)
