#!/usr/bin/env python3
"""The pipeline against Qwen2.5-VL-7B's vision tower alone, on a GPU, same run.

    .venv/bin/python benchmarks/gpu.py [--json PATH]          # CUDA; under 8 minutes on one H200
    .venv/bin/python benchmarks/gpu.py --device cpu --tiny    # the same steps, small, on CPU

The tower has Qwen2.5-VL-7B's vision dimensions (QWEN25_7B_VISION: depth 32, hidden
1280, 16 heads, MLP 3420, out hidden 3584, patch 14, temporal patch 2, spatial merge
2, window 112, full attention in blocks 7, 15, 23, 31), random weights (seeded;
nothing is downloaded), bfloat16 on CUDA. The weights are written once as a local
checkpoint (config.json and model.safetensors under "visual.") that both workers'
towers load, as `--tower-config DIR` does for a real one.

The workload cycles through images of real sizes (GRIDS: 448x448, 672x896, 896x896
and 728x1288 pixels, i.e. 256 to 1196 embedding rows each), float32 pixels in
shared-memory segments, distinct pixels per image. benchmarks/pipeline.py's
machinery (benchmarks/harness/) runs it: a fresh worker per mode, the gateway and the receiver in a client
process, a window of rooms in flight, the steady rate of completions, best trial.

Figures:
- pipeline_vs_tower_alone: images/s of the pipeline / images/s of the tower's forward
  alone (built as the tower stage builds it, start(...).result() one batch after
  another in one process, outs in page-locked host memory like the embedding arena)
  on the batches the scheduler forms from the same images. Target >= 0.95.
- inprocess_vs_tower_alone: the same for the in-process worker (no target).
- with --replicas N (N > 1): replicasN_vs_one, images/s of the pipeline with N tower
  replicas (on --gpus, default every replica on GPU 0: on a one-GPU machine this
  shows that N replicas work, not that they scale) / the N = 1 pipeline's (no target).

Without CUDA (and without --device cpu) it refuses, exit 2. --device cpu hides the
GPUs from every process it starts; --tiny uses a two-block tower and small images.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path or sys.path[0] != ROOT:
    sys.path.insert(0, ROOT)  # before benchmarks/, whose pipeline.py would shadow the package

from benchmarks.harness.baselines import in_child, tower_alone  # noqa: E402
from benchmarks.harness.report import describe, jsonable  # noqa: E402
from benchmarks.harness.session import Session, run_pair  # noqa: E402

QWEN25_7B_VISION = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
    in_channels=3, patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", tokens_per_second=2,
)
TINY_VISION = dict(QWEN25_7B_VISION, depth=2, hidden_size=64, intermediate_size=128, num_heads=4,
                   out_hidden_size=128, window_size=56, fullatt_block_indexes=[1])
# (t, h, w) in 14-pixel patches: 448x448, 672x896 (h x w), 896x896, 728x1288
GRIDS = [(1, 32, 32), (1, 48, 64), (1, 64, 64), (1, 52, 92)]
TINY_GRIDS = [(1, 8, 8), (1, 16, 16)]
TARGET = 0.95
MIB = 1 << 20


def write_checkpoint(path: str, vision: dict, device: str, seed: int) -> int:
    """A checkpoint directory of the vision tower with random weights; its size in bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(seed)
    with torch.device(device):  # random init of 0.67 G parameters is minutes on a CPU, instant on a GPU
        model = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**vision))
    state = {f"visual.{k}": v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in model.state_dict().items()}
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2_5_vl", "vision_config": vision}, f)
    return sum(t.numel() * t.element_size() for t in state.values())


def sizes(grids: list, window: int, n: int, vision: dict) -> dict:
    """Arena sizes for `window` rooms in flight of the largest image, and the /dev/shm
    that both workers and the client's segments need at once (the client publishes a
    trial's n images before its clock starts)."""
    patch_dim = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    patches = [t * h * w for t, h, w in grids]
    px = max(patches) * patch_dim * 4
    emb = max(patches) // vision["spatial_merge_size"] ** 2 * vision["out_hidden_size"] * 2
    pixel_mib = (window + 8) * px // MIB + 64
    emb_mib = (2 * window + 8) * emb // MIB + 64
    rings = 17 * 8  # one 8 MiB ring per edge of pipeline/runtime/wiring.py
    segments = n * sum(patches) // len(patches) * patch_dim * 4 // MIB
    need = 2 * (pixel_mib + emb_mib + rings) + segments
    return {"pixel_arena_mib": pixel_mib, "embedding_arena_mib": emb_mib, "shm_needed_mib": need}


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a two-block tower and small images (a check of the logic)")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--images", type=int, help="measured images per trial (default 240; --tiny 48)")
    ap.add_argument("--trials", type=int, default=2, help="measured runs per mode (best counts)")
    ap.add_argument("--window", type=int, help="rooms in flight (default 32; --tiny 8)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=1, help="also run the pipeline with this many tower replicas")
    ap.add_argument("--gpus", help="their CUDA devices, comma-separated (default: 0 for every replica)")
    return ap.parse_args(argv)


def refusal(args, n: int, window: int, sz: dict) -> str | None:
    """Why this machine cannot run it (no CUDA device, too little /dev/shm), or None."""
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return ("benchmarks/gpu.py: no CUDA device here (torch.cuda.is_available() is False); it measures "
                    "a GPU tower and will not run without one. For a check of its logic on CPU: "
                    "benchmarks/gpu.py --device cpu --tiny")
    free_mib = shutil.disk_usage("/dev/shm").free // MIB
    if sz["shm_needed_mib"] > free_mib:
        return (f"benchmarks/gpu.py: /dev/shm has {free_mib} MiB free, the run needs about "
                f"{sz['shm_needed_mib']} MiB (window {window}, {n} images per trial); pass smaller --window "
                f"and --images")
    return None


def run_replicas(args, bargs, tmp: str, ckpt: str, grids: list, n: int, window: int) -> dict:
    """The pipeline with --replicas tower replicas on --gpus, measured alone."""
    s = Session("pipeline", f"gpu_rep{args.replicas}", tmp, bargs, rooms=2 * window + args.trials * n,
                tower="qwen", device_s=0.0, grids=grids, tower_config=ckpt,
                config={"tower_replicas": args.replicas, "gpus": args.gpus or ",".join(["0"] * args.replicas)})
    try:
        s.warmup(2 * window, window)
        for _ in range(args.trials):
            s.trial(n, window)
        return s.finish()
    finally:
        s.close()


def measure(args, bargs, tmp: str, vision: dict, grids: list, n: int, window: int, results: dict) -> list:
    """The checkpoint, both modes and the tower alone, the replicas; the runs made."""
    ckpt = os.path.join(tmp, "checkpoint")
    t = time.monotonic()
    results["checkpoint_bytes"] = in_child(write_checkpoint, ckpt, vision, args.device, args.seed)
    print(f"tower: Qwen2.5-VL vision, depth {vision['depth']}, hidden {vision['hidden_size']}, out "
          f"{vision['out_hidden_size']}, random weights {results['checkpoint_bytes'] / 1e9:.2f} GB "
          f"(written in {time.monotonic() - t:.0f} s); images {grids} cycled, {n} x {args.trials} trials "
          f"per mode, window {window}", flush=True)

    def alone(sessions) -> dict:
        cfg = dataclasses.asdict(sessions["pipeline"].cfg)
        return {"tower_alone": in_child(tower_alone, cfg, grids, n, args.trials, args.seed)}

    pair = run_pair("gpu", tmp, bargs, tower="qwen", tower_config=ckpt, grids=grids, n=n,
                    trials=args.trials, warmup=2 * window, between=alone)
    for mode, r in pair.items():
        results[mode] = r
        print(describe(r), flush=True)
    ta = pair["pipeline"]["between"]["tower_alone"]
    results["tower_alone"] = ta
    pip, inp = pair["pipeline"]["images_per_s"], pair["inprocess"]["images_per_s"]
    results["pipeline_vs_tower_alone"] = pip / ta["images_per_s"]
    results["inprocess_vs_tower_alone"] = inp / ta["images_per_s"]
    runs = list(pair.values())
    if args.replicas > 1:
        key = f"replicas{args.replicas}_vs_one"
        rep = run_replicas(args, bargs, tmp, ckpt, grids, n, window)
        runs.append(rep)
        results[f"pipeline_replicas{args.replicas}"] = rep
        results[key] = rep["images_per_s"] / pip
        print(describe(rep), flush=True)
        print(f"{key} = {rep['images_per_s']:.1f} / {pip:.1f} = {results[key]:.2f}  (no target)", flush=True)
    return runs


def report(results: dict) -> None:
    ta = results["tower_alone"]
    pip, inp = results["pipeline"]["images_per_s"], results["inprocess"]["images_per_s"]
    ok = results["pipeline_vs_tower_alone"] >= TARGET
    print(f"tower alone: {ta['images_per_s']:.1f} images/s ({ta['batches']} batches, {ta['items_per_batch']:.1f} "
          f"images each; trials {', '.join(f'{x:.1f}' for x in ta['trials'])})")
    print(f"pipeline_vs_tower_alone = {pip:.1f} / {ta['images_per_s']:.1f} = {results['pipeline_vs_tower_alone']:.2f}"
          f"  (target >= {TARGET}: {'met' if ok else 'MISSED'})")
    print(f"inprocess_vs_tower_alone = {inp:.1f} / {ta['images_per_s']:.1f} = "
          f"{results['inprocess_vs_tower_alone']:.2f}  (no target)")
    results["targets"] = {"pipeline_vs_tower_alone": f">= {TARGET}"}
    results["targets_met"] = {"pipeline_vs_tower_alone": ok}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read by torch in every process started from here
    vision = TINY_VISION if args.tiny else QWEN25_7B_VISION
    grids = TINY_GRIDS if args.tiny else GRIDS
    n = args.images or (48 if args.tiny else 240)
    window = args.window or (8 if args.tiny else 32)
    sz = sizes(grids, window, max(n, 2 * window), vision)
    refused = refusal(args, n, window, sz)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    # what benchmarks/harness's Session and run_pair read
    bargs = argparse.Namespace(window=window, seed=args.seed, pixel_arena_mib=sz["pixel_arena_mib"],
                               embedding_arena_mib=sz["embedding_arena_mib"], arena_cache_mib=8,
                               host_cache_mib=64)
    t_start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="epd-gpu-bench-")
    results: dict = {"device": args.device, "tiny": args.tiny, "vision_config": vision,
                     "grids": [list(g) for g in grids], "window": window, **sz}
    try:
        runs = measure(args, bargs, tmp, vision, grids, n, window, results)
        results["failed_rooms"] = sum(r["failed_rooms"] + r["timed_out"] for r in runs)
        results["violations"] = sum(r["n_violations"] for r in runs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(results)
    results["seconds"] = time.monotonic() - t_start
    print(f"({results['seconds']:.0f} s)")
    if results["failed_rooms"] or results["violations"]:
        print(f"FAILED rooms: {results['failed_rooms']}, receiver protocol violations: {results['violations']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(jsonable(results), f, indent=2)
    return 0 if not results["failed_rooms"] and not results["violations"] else 1


if __name__ == "__main__":
    sys.exit(main())
