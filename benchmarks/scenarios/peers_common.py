"""What benchmarks/peers.py's two sides share: the images, the percentiles, the check of
every answer against the local reference, and the figures with their targets."""
from __future__ import annotations

import base64
import functools
import io

import numpy as np

LOGPROB_TOLERANCE = 0.01
# (height, width), multiples of 28, none over the tiny model's 448 x 448 pixels.
SIZES = ((224, 224), (448, 448), (336, 252), (168, 448))

# figure: (operator, bound, what it divides)
TARGETS = {
    "peers_vllm_ttft_vs_own_disagg": ("<=", 0.5, "TTFT p50 one at a time, ours / vLLM's own disaggregation"),
    "peers_vllm_throughput_vs_own_disagg": (">=", 1.5, "images/s at 4 in flight, ours / vLLM's own disaggregation"),
    "peers_vllm_throughput_vs_own_disagg_16": (">=", 1.5, "the same at 16 in flight"),
    "peers_vllm_ttft_vs_local": (None, None, "TTFT p50 one at a time, ours / vLLM's local encoder"),
    "peers_tokenspeed_throughput_vs_own": (">=", 1.2, "images/s at 4 in flight, ours / tokenspeed's encode worker"),
    "peers_tokenspeed_throughput_vs_own_16": (">=", 1.2, "the same at 16 in flight"),
    "peers_tokenspeed_latency_vs_own": ("<=", 0.8, "encode latency p50 one at a time, ours / tokenspeed's"),
}


def verdict(key: str, value) -> str:
    op, bound, _ = TARGETS[key]
    if value is None:
        return "not measured"
    if op is None:
        return "(no target)"
    ok = value >= bound if op == ">=" else value <= bound
    return f"(target {op} {bound}: {'met' if ok else 'MISSED'})"


def image_seeds(base: int, n: int) -> list[tuple[int, tuple[int, int]]]:
    """n images: the sizes in turn, and every fifth the same image as two before it
    (a repeat the caches may serve)."""
    out = []
    for i in range(n):
        out.append(out[i - 2] if i % 5 == 4 else (base + i, SIZES[i % len(SIZES)]))
    return out


@functools.lru_cache(maxsize=None)
def png_url(seed: int, size: tuple[int, int]) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def images_of(base: int, n: int) -> list[tuple[tuple, str]]:
    """(key, data: URL) of image_seeds(base, n), encoded once."""
    return [((seed, size), png_url(seed, size)) for seed, size in image_seeds(base, n)]


def pct(samples: list[float]) -> dict:
    """p50 and p99 in milliseconds of samples in seconds."""
    a = np.asarray(samples) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "n": len(a)}


class Checker:
    """Every answer of every path, checked against the reference path's answer for the
    same image: the same token, and each of the five most likely tokens both name
    within LOGPROB_TOLERANCE."""

    def __init__(self, reference: str):
        self.reference = reference
        self.answers: dict[str, dict] = {}

    def add(self, path: str, key, got: tuple[str, dict[str, float]]) -> None:
        self.answers.setdefault(path, {}).setdefault(key, []).append(got)

    def summary(self) -> dict:
        ref = {k: v[0] for k, v in self.answers.get(self.reference, {}).items()}
        out: dict = {"reference": self.reference, "tolerance": LOGPROB_TOLERANCE, "paths": {}}
        ok = True
        for path, by_key in self.answers.items():
            n, wrong, tokens, missing, diff = 0, 0, 0, 0, 0.0
            for key, answers in by_key.items():
                if key not in ref:
                    missing += len(answers)
                    continue
                token, top = ref[key]
                for got_token, got_top in answers:
                    n += 1
                    common = set(top) & set(got_top)
                    d = max([abs(top[t] - got_top[t]) for t in common] or [float("inf")])
                    diff = max(diff, d)
                    tokens += got_token != token
                    wrong += got_token != token or d > LOGPROB_TOLERANCE
            out["paths"][path] = {"answers": n, "wrong": wrong, "other_token": tokens, "without_reference": missing,
                                  "logprob_max_abs_diff": diff}
            ok = ok and not wrong and not missing
        out["ok"] = ok
        return out
