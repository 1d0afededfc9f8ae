"""Scenario media: compressed images (protocol 1.2) against pixels.

- media_preprocess_per_process_vs_hf: images/s of ipc/media.py's preprocess (what the
  preprocess stage runs per item) against vLLM's loader and Hugging Face's
  Qwen2VLImageProcessor (PIL backend) in one process, on the same JPEGs.
- media_preprocess_scaling_2_vs_1: end-to-end images/s of a pipeline worker (sim tower
  at no device time, so the preprocess stage is the bottleneck) fed distinct JPEGs (no
  cache hit), a window of rooms in flight, with preprocess_workers 2 against 1; trials
  in ABBA order, the better of each.
- media_intake_cpu_vs_pixels: the intake process's CPU per image of a pipeline worker
  (sim tower) fed the JPEGs compressed, against the same images sent as the
  processor's pixels in shared memory; with the end-to-end images/s of both.
"""
from __future__ import annotations

import io
import itertools
import os
import time

import numpy as np

from benchmarks.harness.report import verdict
from benchmarks.scenarios.common import Bench

SIZES = ((640, 480), (1288, 1288), (1024, 768), (333, 517))
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # Qwen2.5-VL's defaults


def jpegs(n: int, seed: int) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (w + h)], -1)
        img = np.clip(base + rng.integers(-30, 31, base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def per_process(data: list[bytes], trials: int) -> dict:
    from PIL import Image, ImageOps
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ipc import media

    s = media.ImageSettings(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    hf = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)

    def ours():
        for d in data:
            media.preprocess(d, "jpeg", s)

    def theirs():
        for d in data:
            image = ImageOps.exif_transpose(Image.open(io.BytesIO(d)))
            hf(images=[image.convert("RGB")], return_tensors="np")

    ours(), theirs()  # warm: imports, tables
    best = {}
    for name, fn in (("ours", ours), ("hf", theirs)):
        times = []
        for _ in range(trials):
            t = time.process_time()
            fn()
            times.append(time.process_time() - t)
        best[name] = len(data) / min(times)
    return best


def intake_cpu(b: Bench, data: list[bytes], compressed: bool, tag: str) -> dict:
    import psutil

    from ipc import media
    from pipeline.peers.client import Client, Item, image_item
    from pipeline.peers.receiver import Receiver
    from pipeline.testing.workers import sim_config, start_worker

    prefix = f"bm{os.getpid() % 100000}{tag}"
    cfg = sim_config(prefix, f"{b.tmp}/{tag}", pixel_arena_bytes=256 << 20, embedding_arena_bytes=64 << 20,
                     max_pixel_bytes_per_request=64 << 20)
    os.makedirs(f"{b.tmp}/{tag}", exist_ok=True)
    s = media.ImageSettings(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    items = []
    for d in data:
        if compressed:
            items.append(image_item(d, "jpeg", min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS))
        else:
            px, grid = media.preprocess(d, "jpeg", s)
            items.append(Item("image", [list(grid)], px))
    w = start_worker("pipeline", cfg)
    client = Client(cfg.intake, prefix)
    rx = Receiver("rx", cfg.bootstrap, buffer_bytes=256 << 20)
    try:
        intake = psutil.Process(w.runtime.procs["intake"].pid)
        rooms = itertools.count(1)
        c0, t0 = intake.cpu_times(), time.monotonic()
        sent = {}
        for i, it in enumerate(items):
            room = next(rooms)
            g = it.grid_thw[0]
            rx.alloc(room, 0, span=g[0] * g[1] * g[2] // 4, hidden=64, dtype="bfloat16", deepstack_width=32)
            client.encode(room, f"r{room}", [it])
            sent[room] = 1
            if len(sent) % 8 == 0:  # a window, so that the worker's arenas are not outrun
                rx.wait(sent, timeout=120)
                for r in list(sent):
                    rx.release(r)
                sent.clear()
        rx.wait(sent, timeout=120)
        t1, c1 = time.monotonic(), intake.cpu_times()
        failed = len(rx.failed)
    finally:
        rx.close()
        client.close()
        w.close()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    return {"images_per_s": len(items) / (t1 - t0), "intake_cpu_ms_per_image": cpu * 1000 / len(items),
            "failed": failed}


def scaling_trial(b: Bench, data: list[bytes], workers: int, tag: str, window: int = 8) -> dict:
    """Images/s of a pipeline worker with `workers` preprocess processes, `window` rooms in flight."""
    from pipeline.peers.client import Client, image_item
    from pipeline.peers.receiver import Receiver
    from pipeline.testing.workers import sim_config, start_worker

    prefix = f"bm{os.getpid() % 100000}{tag}"
    os.makedirs(f"{b.tmp}/{tag}", exist_ok=True)
    cfg = sim_config(prefix, f"{b.tmp}/{tag}", pixel_arena_bytes=256 << 20, embedding_arena_bytes=64 << 20,
                     max_pixel_bytes_per_request=64 << 20, preprocess_workers=workers)
    items = [image_item(d, "jpeg", min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS) for d in data]
    w = start_worker("pipeline", cfg)
    client = Client(cfg.intake, prefix)
    rx = Receiver("rx", cfg.bootstrap, buffer_bytes=256 << 20)
    try:
        inflight: set[int] = set()
        t0 = time.monotonic()
        for room, it in enumerate(items, 1):
            while len(inflight) >= window:
                rx.poll(0.05)
                for r in [r for r in inflight if rx.concluded(r, 1)]:
                    rx.release(r)
                    inflight.discard(r)
            g = it.grid_thw[0]
            rx.alloc(room, 0, span=g[0] * g[1] * g[2] // 4, hidden=64, dtype="bfloat16", deepstack_width=32)
            client.encode(room, f"r{room}", [it])
            inflight.add(room)
        rx.wait({r: 1 for r in inflight}, timeout=120)
        t1 = time.monotonic()
        failed = len(rx.failed)
        per_worker = {name: s.get("preprocess_items", {}).get("decoded", 0)
                      for name, s in w.stats()["per_stage"].items() if name.startswith("preprocess")}
    finally:
        rx.close()
        client.close()
        w.close()
    return {"images_per_s": len(items) / (t1 - t0), "failed": failed, "decoded_by": per_worker}


def scaling(b: Bench, data: list[bytes]) -> dict:
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for k, workers in enumerate((1, 2, 2, 1)):
        runs[workers].append(scaling_trial(b, data, workers, f"sc{k}"))
    best = {n: max(r["images_per_s"] for r in rs) for n, rs in runs.items()}
    return {"trials": runs, "images_per_s": best, "ratio": best[2] / best[1]}


def media_scenario(b: Bench) -> None:
    n = 16 if b.quick else 64
    data = jpegs(n, b.args.seed)
    print(f"media: {n} JPEGs of {', '.join(f'{w}x{h}' for w, h in SIZES)}, Qwen2.5-VL's processor settings",
          flush=True)
    pp = per_process(data, 2 if b.quick else 4)
    ratio = pp["ours"] / pp["hf"]
    res = {"preprocess_images_per_cpu_s": pp["ours"], "hf_images_per_cpu_s": pp["hf"]}
    b.results["media_preprocess_per_process_vs_hf"] = ratio
    print(f"media_preprocess_per_process_vs_hf = {pp['ours']:.1f} / {pp['hf']:.1f} images per CPU second = "
          f"{ratio:.2f}  {verdict('media_preprocess_per_process_vs_hf', ratio)}", flush=True)
    sc = scaling(b, jpegs(3 * n, b.args.seed + 1))
    res["scaling"] = sc
    b.results["media_preprocess_scaling_2_vs_1"] = sc["ratio"]
    failed = sum(r["failed"] for rs in sc["trials"].values() for r in rs)
    print(f"media_preprocess_scaling_2_vs_1 = {sc['images_per_s'][2]:.1f} / {sc['images_per_s'][1]:.1f} images/s "
          f"= {sc['ratio']:.2f} ({os.cpu_count()} CPUs; decoded by {sc['trials'][2][0]['decoded_by']}; "
          f"failed {failed})  {verdict('media_preprocess_scaling_2_vs_1', sc['ratio'])}", flush=True)
    pixels = intake_cpu(b, data, False, "px")
    comp = intake_cpu(b, data, True, "jp")
    res["pixels"], res["compressed"] = pixels, comp
    cpu_ratio = comp["intake_cpu_ms_per_image"] / max(pixels["intake_cpu_ms_per_image"], 1e-9)
    b.results["media_intake_cpu_vs_pixels"] = cpu_ratio
    b.results["media"] = res
    print(f"media end to end (pipeline, sim tower): pixels {pixels['images_per_s']:.1f} images/s, compressed "
          f"{comp['images_per_s']:.1f} images/s; failed {pixels['failed']}, {comp['failed']}", flush=True)
    print(f"media_intake_cpu_vs_pixels = {comp['intake_cpu_ms_per_image']:.2f} / "
          f"{pixels['intake_cpu_ms_per_image']:.2f} ms per image = {cpu_ratio:.2f}  "
          f"{verdict('media_intake_cpu_vs_pixels', cpu_ratio)}", flush=True)
