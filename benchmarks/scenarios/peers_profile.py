"""benchmarks/peers.py --profile (vLLM side, in .venv-vllm): where a request through the
worker spends its time, one request at a time, each image fresh, against vLLM's local
encoder on the same engine:
- preprocess: the proxy's image processor (decode, resize, patches);
- tower: the worker's tower forward alone, in this process, at the worker's threads;
- worker: an encode sent -> its rows' success at a native Receiver (intake, hash, tower
  threads, sender), no vLLM involved;
- vllm_with_rows: vLLM answering a metadata-only request whose rows the worker
  already holds (its cache): the connector's alloc, the wait, the copy and the prefill;
- vllm_text: vLLM answering a request of text alone (a request's floor, no image);
- proxy_text: the same through the proxy (its HTTP hop);
- ours: all of it, as the proxy does it (preprocess, encode, vLLM);
- local: vLLM with the pixels, its own processor and encoder.
"""
from __future__ import annotations

import itertools
import os
import time

from benchmarks.scenarios.peers_common import images_of, pct

_rooms = itertools.count(1 << 40)


def _steps(servers, pre, client, rx, tower, n: int) -> dict:
    import torch

    from pipeline.peers.client import routing_key
    from pipeline.testing.vllm import chat
    from benchmarks.scenarios.peers_vllm import post

    t: dict[str, list[float]] = {k: [] for k in ("preprocess", "tower", "worker", "vllm_with_rows", "vllm_text",
                                                 "proxy_text", "ours", "local")}
    model, bootstrap = servers.model, servers.cfg.bootstrap
    seen = set()
    for key, url in images_of(500_000 + 1000 * n, n):
        if key in seen:
            continue  # a repeat: the profile is of fresh images
        seen.add(key)
        start = time.perf_counter()
        item = pre.image(url)
        t["preprocess"].append(time.perf_counter() - start)
        with torch.inference_mode():
            start = time.perf_counter()
            tower.forward(torch.from_numpy(item.pixels), torch.tensor(item.grid_thw))
            t["tower"].append(time.perf_counter() - start)
        room = next(_rooms)
        span = item.grid_thw[0][0] * item.grid_thw[0][1] * item.grid_thw[0][2] // 4
        rx.alloc(room, 0, span=span, hidden=128, dtype=servers.cfg.tower_dtype)
        start = time.perf_counter()
        client.encode(room, f"prof-{room}", [item])
        if not rx.wait({room: 1}, timeout=60) or room in rx.failed:
            raise RuntimeError(f"room {room} failed at the worker: {rx.failed.get(room)}")
        t["worker"].append(time.perf_counter() - start)
        rx.release(room)
        uuid = f"{routing_key([item]):016x}"
        part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": item.grid_thw[0]}, "uuid": uuid}
        room = next(_rooms)
        client.encode(room, f"prof-{room}", [item])  # the worker's cache holds its rows
        start = time.perf_counter()
        post(servers.urls["epd"], chat(model, part, max_tokens=1, top_logprobs=5,
                                       ec_transfer_params={"room": room, "worker": bootstrap, "items": {uuid: 0}}))
        t["vllm_with_rows"].append(time.perf_counter() - start)
        text = {"model": model, "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 5,
                "messages": [{"role": "user", "content": f"Describe picture {room}."}]}
        for step, url in (("vllm_text", servers.urls["epd"]), ("proxy_text", servers.urls["proxy"])):
            start = time.perf_counter()
            post(url, text)
            t[step].append(time.perf_counter() - start)
        fresh = images_of(600_000 + key[0], 1)[0][1]  # another image of the size, for the whole paths
        body = chat(model, {"type": "image_url", "image_url": {"url": fresh}}, max_tokens=1, top_logprobs=5)
        for path in ("ours", "local"):
            start = time.perf_counter()
            servers.send(path, body)
            t[path].append(time.perf_counter() - start)
    return {k: pct(v) for k, v in t.items()}


def profile(args, tmp: str) -> dict:
    import torch

    from pipeline.peers.client import Client
    from pipeline.integrations.proxy import Preprocessor
    from pipeline.peers.receiver import Receiver
    from stages.towers.qwen import Qwen25VLTower
    from benchmarks.scenarios.peers_vllm import Servers

    servers = Servers(tmp, args, only_epd=True)
    pre = Preprocessor(servers.model)
    client = Client(servers.cfg.intake, servers.cfg.shm_prefix)
    rx = Receiver("peers-profile", servers.cfg.bootstrap, buffer_bytes=16 << 20)
    torch.set_num_threads(args.tower_threads or os.cpu_count())
    tower = Qwen25VLTower(checkpoint=servers.model, dtype="float32")
    try:
        _steps(servers, pre, client, rx, tower, 4)  # warm-up
        out = _steps(servers, pre, client, rx, tower, args.images or 12)
    finally:
        rx.close()
        client.close()
        servers.close()
    return {"profile_ms": out, "worker_mode": args.worker_mode, "tower_threads": args.tower_threads}
