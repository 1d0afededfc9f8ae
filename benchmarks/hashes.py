#!/usr/bin/env python
"""The content hash's cost: keyed BLAKE3 against xxh3, hashed as intake hashes pixels.

    .venv/bin/python benchmarks/hashes.py [--quick] [--json PATH]

Two image sizes of float32 pixels: 4.8 MB (a 1x32x32 patch grid, the `cpu` scenario of
benchmarks/pipeline.py) and 75 KB (1x4x4, the `small` scenario). Each hash is taken as
the intake stage takes it: the header (modality, dtype, grid) first, then the pixels
piece by piece, stages.segments.READ_PIECE bytes at a time, as each piece lands.

- ``hash``: the hashing alone, the pixels resident in a buffer (what hashing adds to a
  read that is done anyway).
- ``read_and_hash``: the intake's own read, ``stages.segments.read_into`` from a
  shared-memory segment of the gateway's kind into a resident buffer, hashing as it
  reads; and the same read without a hasher (``read``).

Hashes: ``xxh3_64`` (``ipc.hashing.content_hasher``: the cache key before protocol 1.1, now only
what gateways route by; unkeyed, 64 bits), ``xxh3_128`` (unkeyed, 128 bits), and
``blake3_keyed`` (``ipc.hashing.cache_hasher``, the cache key: BLAKE3 in keyed mode, a
32-byte key, 256 bits out); and ``blake2b_keyed`` (the standard library's keyed BLAKE2b,
256 bits out), the keyed hash one could have without a dependency. Every figure is the best
(least disturbed) of several trials of many images, the methods taken in turn within
each trial so that a change in the machine's load meets all of them, and printed as a
ratio against ``xxh3_64`` measured in the same run. No targets: the figures say what
the keyed hash costs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import blake3  # noqa: E402
import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from ipc import hashing, shm, wire  # noqa: E402
from stages import segments  # noqa: E402

PATCH_DIM = 1176  # 3 x 2 x 14 x 14: the Qwen towers' patch
SIZES = {"4.8MB": [(1, 32, 32)], "75KB": [(1, 4, 4)]}  # grid_thw of one image
PREFIX = "hashbench"


def header_hasher(kind: str, key: bytes, grid):
    """A running hash of `kind` that has taken the header intake hashes before the pixels."""
    if kind == "blake3_keyed":
        return hashing.cache_hasher(key, "image", grid, "float32")
    if kind == "xxh3_64":
        return hashing.content_hasher("image", grid, "float32")
    if kind == "blake2b_keyed":
        h = hashlib.blake2b(key=key, digest_size=32)
        h.update(b"image|float32|" + np.array(grid, "<i8").tobytes())
        return h
    h = xxhash.xxh3_128()
    h.update(b"image|float32|")
    h.update(np.array(grid, "<i8").tobytes())
    return h


def finish(h) -> bytes:
    return h.digest()


KINDS = ("xxh3_64", "xxh3_128", "blake3_keyed", "blake2b_keyed")


def time_hash(kind: str, key: bytes, grid, view: memoryview, n: int) -> float:
    """Seconds per image: header, then the pixels READ_PIECE at a time."""
    size = len(view)
    t0 = time.perf_counter()
    for _ in range(n):
        h = header_hasher(kind, key, grid)
        for at in range(0, size, segments.READ_PIECE):
            h.update(view[at:at + segments.READ_PIECE])
        finish(h)
    return (time.perf_counter() - t0) / n


def time_read(kind: str | None, key: bytes, grid, fd: int, px: wire.PixelsRef, view: memoryview, n: int) -> float:
    """Seconds per image of intake's read_into from the segment `fd`, hashing with `kind` (None: no hash)."""
    t0 = time.perf_counter()
    for _ in range(n):
        h = None if kind is None else header_hasher(kind, key, grid)
        segments.read_into(fd, px, view, h)
        if h is not None:
            finish(h)
    return (time.perf_counter() - t0) / n


def make_segment(data: np.ndarray) -> tuple[str, int]:
    """A segment as a gateway makes it (0600, under a prefix of its own), opened for reading."""
    path = os.path.join(shm.SHM_DIR, f"{PREFIX}.px.{os.getpid()}.{data.nbytes}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data.tobytes())
    finally:
        os.close(fd)
    return path, os.open(path, os.O_RDONLY)


def measure_size(label: str, grid, trials: int, budget_s: float) -> dict:
    n_patches = sum(t * h * w for t, h, w in grid)
    data = np.random.default_rng(7).standard_normal((n_patches, PATCH_DIM), dtype=np.float32)
    buf = np.ones(data.nbytes, np.uint8)  # resident: every page touched
    buf[:] = data.view(np.uint8).reshape(-1)
    view = memoryview(buf)
    key = secrets.token_bytes(32)
    # As many images per trial as take about budget_s / trials with the slowest method.
    probe = max(time_hash(k, key, grid, view, 3) for k in KINDS)
    n = max(5, int(budget_s / trials / (2 * len(KINDS) + 1) / max(probe, 1e-7)))
    best: dict[str, float] = {}
    samples: dict[str, list[float]] = {}
    path, fd = make_segment(data)
    px = wire.PixelsRef(shape=(n_patches, PATCH_DIM), dtype="float32", shm="/" + os.path.basename(path))
    try:
        for _ in range(trials):
            for kind in KINDS:
                for name, secs in ((f"hash.{kind}", time_hash(kind, key, grid, view, n)),
                                   (f"read_and_hash.{kind}", time_read(kind, key, grid, fd, px, view, n))):
                    samples.setdefault(name, []).append(secs)
            samples.setdefault("read", []).append(time_read(None, key, grid, fd, px, view, n))
    finally:
        os.close(fd)
        os.unlink(path)
    best = {name: min(xs) for name, xs in samples.items()}
    return {"bytes": int(data.nbytes), "grid": list(grid), "images_per_trial": n, "trials": trials,
            "seconds_per_image": best, "samples": samples}


def report(label: str, r: dict) -> dict:
    """Print one size's figures as ratios against xxh3_64 of the same run; return them."""
    s, nbytes = r["seconds_per_image"], r["bytes"]
    print(f"{label} ({nbytes} bytes, best of {r['trials']} trials of {r['images_per_trial']} images):")
    ratios = {}
    for part in ("hash", "read_and_hash"):
        base = s[f"{part}.xxh3_64"]
        for kind in KINDS:
            secs = s[f"{part}.{kind}"]
            ratios[f"{label}.{part}.{kind}_vs_xxh3_64"] = secs / base
            print(f"  {part:<14} {kind:<13} {secs * 1e6:9.1f} us/image  {nbytes / secs / 1e9:6.2f} GB/s  "
                  f"{secs / base:5.2f} x xxh3_64")
    added = s["read_and_hash.blake3_keyed"] - s["read"]
    ratios[f"{label}.read_and_hash.blake3_keyed_vs_read"] = s["read_and_hash.blake3_keyed"] / s["read"]
    ratios[f"{label}.read_and_hash.xxh3_64_vs_read"] = s["read_and_hash.xxh3_64"] / s["read"]
    print(f"  read alone                   {s['read'] * 1e6:9.1f} us/image; keyed BLAKE3 adds "
          f"{added * 1e6:.1f} us ({ratios[f'{label}.read_and_hash.blake3_keyed_vs_read']:.2f} x the read; "
          f"xxh3_64: {ratios[f'{label}.read_and_hash.xxh3_64_vs_read']:.2f} x)")
    return ratios


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer, shorter trials (a few seconds)")
    ap.add_argument("--json", metavar="PATH", help="write every figure and trial here")
    args = ap.parse_args(argv)
    trials, budget_s = (3, 1.0) if args.quick else (7, 6.0)
    results = {"blake3_version": blake3.__version__, "xxhash_version": xxhash.VERSION,
               "read_piece": segments.READ_PIECE, "sizes": {}, "ratios": {}}
    for label, grid in SIZES.items():
        r = measure_size(label, grid, trials, budget_s)
        results["sizes"][label] = r
        results["ratios"].update(report(label, r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
