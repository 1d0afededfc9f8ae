"""Scenario vllm: the same images served through vLLM with the worker as its encoder
(EPDConnector, the proxy's preprocessing) and with vLLM's own encoder, in one run, on one
engine (the tiny random-weight Qwen2.5-VL of pipeline/testing/vllm.py, distinct
224 x 224 images): first one request at a time, the two paths alternating, then four
in flight, one path after the other.

vLLM runs in .venv-vllm (scripts/setup_vllm.sh): `vllm(b)` runs this module there as a
script, which writes its figures as JSON:
- vllm_epd_vs_local_encoder_ttft_p50: p50 time to first token (a one-token request,
  sent to answered; through the worker the proxy's preprocessing and the encode count)
  through the worker / through vLLM's own encoder. No target on CPU cores: the figure
  is for GPU runs.
- vllm_epd_vs_local_encoder_images_per_s_4: images a second with four requests (one
  image each) in flight, through the worker / through vLLM's own encoder; each path's
  own figure is in images_per_s_4.
- vllm_epd_logprob_max_abs_diff: the largest difference between the two paths'
  log-probabilities of the first token's five most likely tokens, over every image.

    .venv/bin/python benchmarks/pipeline.py --scenarios vllm [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
FIGURES = ("vllm_epd_vs_local_encoder_ttft_p50", "vllm_epd_logprob_max_abs_diff",
           "vllm_epd_vs_local_encoder_images_per_s_4")
IN_FLIGHT = 4


def vllm(b) -> None:
    from benchmarks.harness.report import verdict

    if not os.path.exists(VLLM_PYTHON):
        raise RuntimeError(f"scenario vllm needs {VLLM_PYTHON}: build it with scripts/setup_vllm.sh")
    n = b.args.images or (8 if b.quick else 40)
    out = os.path.join(b.tmp, "vllm.json")
    print(f"vllm: {n} distinct 224x224 images, each through the worker and through vLLM's own "
          f"encoder, alternating, one engine", flush=True)
    subprocess.run([VLLM_PYTHON, os.path.abspath(__file__), "--json", out, "--images", str(n)],
                   cwd=ROOT, check=True)
    with open(out) as f:
        r = json.load(f)
    b.results["vllm"] = r
    for key in FIGURES:
        b.results[key] = r[key]
    p50 = r["ttft_p50_s"]
    print(f"vllm_epd_vs_local_encoder_ttft_p50 = {p50['epd'] * 1e3:.1f} ms / {p50['local'] * 1e3:.1f} ms = "
          f"{r[FIGURES[0]]:.2f}  {verdict(FIGURES[0], r[FIGURES[0]])}", flush=True)
    print(f"vllm_epd_logprob_max_abs_diff = {r[FIGURES[1]]:.3g}  {verdict(FIGURES[1], r[FIGURES[1]])}", flush=True)
    ips = r["images_per_s_4"]
    print(f"vllm_epd_vs_local_encoder_images_per_s_4 = {ips['epd']:.1f} / {ips['local']:.1f} = "
          f"{r[FIGURES[2]]:.2f}  {verdict(FIGURES[2], r[FIGURES[2]])}", flush=True)


def top_logprobs(reply: dict) -> dict[str, float]:
    first = reply["choices"][0]["logprobs"]["content"][0]
    return {t["token"]: t["logprob"] for t in first["top_logprobs"]}


def post(url: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def measure(n: int, tmp: str) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from ipc import shm
    from pipeline.peers.client import WorkerAddress
    from pipeline.integrations.proxy import Preprocessor, Proxy
    from pipeline.testing.vllm import build_model, chat, picture, start_server, stop, wait_ready
    from pipeline.testing.workers import start_worker, worker_config

    model = build_model(os.path.join(tmp, "model"), max_pixels=448 * 448)
    cfg = worker_config("bench_vllm", tmp, tower="qwen2.5-vl", tower_config=model, tower_dtype="float32",
                        pixel_arena_bytes=64 << 20, embedding_arena_bytes=32 << 20,
                        arena_cache_bytes=8 << 20, host_cache_bytes=16 << 20)
    worker = start_worker("inprocess", cfg)
    ec = {"ec_connector": "EPDConnector", "ec_connector_module_path": "pipeline.integrations.vllm",
          "ec_role": "ec_consumer", "ec_connector_extra_config": {
              "workers": [cfg.bootstrap], "dtype": "float32", "buffer_bytes": 64 << 20, "shm_prefix": "bench_vllmrx"}}
    log = os.path.join(tmp, "server.log")
    proc, url = start_server(model, ec, log)
    proxy = Proxy(Preprocessor(model), [WorkerAddress(cfg.intake, cfg.bootstrap, cfg.shm_prefix)], url)
    ttft: dict[str, list[float]] = {"epd": [], "local": []}
    ips: dict[str, float] = {}
    diff = 0.0
    try:
        wait_ready(proc, url, log)

        def one(path: str, seed: int, measured: bool = True) -> dict:
            body = chat(model, {"type": "image_url", "image_url": {"url": picture(seed, (224, 224))}},
                        max_tokens=1, top_logprobs=5)
            start = time.perf_counter()
            sent = proxy.prepare(body, f"bench-{seed}") if path == "epd" else body
            reply = post(url, sent)
            took = time.perf_counter() - start
            proxy.conclude(sent)
            if measured:
                ttft[path].append(took)
            return top_logprobs(reply)

        for seed in (n, n + 1):  # warm-up: vLLM's first multimodal requests are slower
            one("epd", seed, False), one("local", seed, False)
        for i in range(n):
            order = ("epd", "local") if i % 2 == 0 else ("local", "epd")
            got = {path: one(path, i) for path in order}
            common = set(got["epd"]) & set(got["local"])
            diff = max([diff] + [abs(got["epd"][t] - got["local"][t]) for t in common])
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            for path in ("epd", "local"):
                seeds = range(10_000 * (1 + (path == "local")), 10_000 * (1 + (path == "local")) + 2 * n)
                start = time.perf_counter()
                list(pool.map(lambda seed: one(path, seed, False), seeds))
                ips[path] = len(seeds) / (time.perf_counter() - start)
    finally:
        stop(proc)
        proxy.close()
        worker.close()
        shm.sweep("bench_vllmrx")  # vLLM kills its engine core before the connector's shutdown
    p50 = {path: float(np.median(v)) for path, v in ttft.items()}
    return {"images": n, "ttft_s": ttft, "ttft_p50_s": p50, "images_per_s_4": ips,
            FIGURES[0]: p50["epd"] / p50["local"], FIGURES[1]: diff, FIGURES[2]: ips["epd"] / ips["local"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--images", type=int, default=8)
    args = ap.parse_args()
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    with tempfile.TemporaryDirectory(prefix="epd-bench-vllm-") as tmp:
        result = measure(args.images, tmp)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
