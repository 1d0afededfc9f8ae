"""benchmarks/peers.py's vLLM side (runs in .venv-vllm): the same images through
(a) vLLM's own encoder (the local reference), (b) the worker as vLLM's encoder (its
EPDConnector, `run.py proxy` in front) and (c) vLLM's own encoder disaggregation (an
`ec_producer` instance and an `ec_consumer` instance joined by vLLM's
ECExampleConnector, a client that sends each request to the producer, then to the
consumer with each image as its mm_hash and grid), all on one tiny random-weight
Qwen2.5-VL, all alive together.

Every request asks for one token with its five most likely log-probabilities; time to
first token is sent -> answered. Every answer of (b) and (c) is checked against (a)'s
for the same image: the same token, log-probabilities within LOGPROB_TOLERANCE.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from benchmarks.scenarios.peers_common import LOGPROB_TOLERANCE, Checker, images_of, pct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATHS = ("local", "ours", "theirs")
# vLLM's engine core and model runner each spin (sched_yield) on their queues for a second
# after each message they read: each measured request or run starts once the instances
# the other paths used have stopped, as on a machine of its own.
QUIET_S = 1.2


def post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: {e.code} {e.read()[:500]!r}") from None


def answer(reply: dict) -> tuple[str, dict[str, float]]:
    """The first token and its five most likely tokens' log-probabilities."""
    first = reply["choices"][0]["logprobs"]["content"][0]
    return first["token"], {t["token"]: t["logprob"] for t in first["top_logprobs"]}


def own_disagg(producer: str, consumer: str, body: dict) -> dict:
    """vLLM's own encoder disaggregation, as its disagg proxy drives it: the request to
    the encoder-only producer, whose answer names each image's mm_hash and grid; then to
    the consumer with each image replaced by that hash and grid, no pixels."""
    done = post(producer, dict(body, max_tokens=1))
    params = done.get("ec_transfer_params") or {}
    by_index = {}
    for mm_hash, entry in params.items():
        for i in entry.get("item_indices", [0]):
            by_index[i] = (mm_hash, entry["metadata"]["image_grid_thw"])
    messages, i = [], 0
    for msg in body["messages"]:
        parts = []
        for part in msg["content"] if isinstance(msg["content"], list) else []:
            if part.get("type") == "image_url":
                mm_hash, grid = by_index[i]
                grid = grid[0] if isinstance(grid[0], list) else grid
                part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": grid}, "uuid": mm_hash}
                i += 1
            parts.append(part)
        messages.append(dict(msg, content=parts or msg["content"]))
    if i != len(by_index):
        raise RuntimeError(f"the producer named {len(by_index)} items, the request has {i}: {params}")
    return post(consumer, dict(body, messages=messages))


class Servers:
    """The three vLLM instances, the worker and the proxy: started together, closed together."""

    def __init__(self, tmp: str, args, only_epd: bool = False):
        self.tmp, self.procs, self.worker, self.urls = tmp, [], None, {}
        try:
            self._start(args, only_epd)
        except BaseException:
            self.close()  # what started before the failure
            raise

    def _start(self, args, only_epd: bool) -> None:
        from pipeline.testing.vllm import build_model
        from pipeline.testing.workers import start_worker, worker_config

        tmp, mode, max_seqs = self.tmp, args.worker_mode, max(args.in_flight)
        self.model = build_model(os.path.join(tmp, "model"), max_pixels=448 * 448)
        cfg = worker_config(f"peers_w{os.getpid()}", tmp, tower="qwen2.5-vl", tower_config=self.model,
                            tower_dtype=args.tower_dtype, tower_threads=args.tower_threads,
                            tower_replicas=args.tower_replicas, pixel_arena_bytes=128 << 20,
                            embedding_arena_bytes=64 << 20, arena_cache_bytes=16 << 20, host_cache_bytes=32 << 20)
        self.cfg = cfg
        self.worker = start_worker(mode, cfg)
        store = os.path.join(tmp, "ec_store")
        os.makedirs(store)
        # float32 everywhere: vLLM's own tower then computes as the worker's does, so that
        # every path's answers can be held to the local reference's
        extra = ["--max-num-seqs", str(max_seqs), "--dtype", args.tower_dtype]
        epd = {"ec_connector": "EPDConnector", "ec_connector_module_path": "pipeline.integrations.vllm",
               "ec_role": "ec_consumer", "ec_connector_extra_config": {
                   "workers": [cfg.bootstrap], "dtype": args.tower_dtype, "buffer_bytes": 64 << 20,
                   "shm_prefix": f"peers_vrx{os.getpid()}", "queue_spin_s": args.queue_spin_s}}
        example = lambda role: {"ec_connector": "ECExampleConnector", "ec_role": role,  # noqa: E731
                                "ec_connector_extra_config": {"shared_storage_path": store}}
        for name, ec in (("epd", epd), ("producer", example("ec_producer")), ("consumer", example("ec_consumer"))):
            if name == "epd" or not only_epd:
                self._vllm(name, ec, extra)
        from pipeline.runtime.background import free_port
        from pipeline.testing.vllm import http_status

        port = free_port()
        log = open(os.path.join(tmp, "proxy.log"), "w")
        self.procs.append(("proxy", subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "run.py"), "proxy", "--model", self.model, "--vllm",
             self.urls["epd"], "--listen", f"127.0.0.1:{port}",
             "--worker", f"{cfg.intake},{cfg.bootstrap},{cfg.shm_prefix}"],
            cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), stdout=log, stderr=subprocess.STDOUT)))
        self.urls["proxy"] = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 120
        while http_status(self.urls["proxy"] + "/v1/models") != 200:
            if time.monotonic() > end or self.procs[-1][1].poll() is not None:
                raise RuntimeError("the proxy did not start: " + open(log.name).read()[-2000:])
            time.sleep(0.2)

    def _vllm(self, name: str, ec: dict, extra: list[str]) -> None:
        from pipeline.testing.vllm import start_server, wait_ready

        log = os.path.join(self.tmp, f"{name}.log")
        proc, url = start_server(self.model, ec, log, extra_args=extra)
        self.procs.append((name, proc))
        wait_ready(proc, url, log)  # one at a time: a start takes both cores
        self.urls[name] = url

    def send(self, path: str, body: dict) -> dict:
        if path == "local":
            return post(self.urls["epd"], body)
        if path == "ours":
            return post(self.urls["proxy"], body)
        return own_disagg(self.urls["producer"], self.urls["consumer"], body)

    def cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) so far of each process group: each vLLM instance
        (its server, engine core and model runner), the proxy, each of the worker's stage
        processes, and this process (the client's threads, the worker's supervisor)."""
        import psutil

        def tree(pid: int) -> float:
            try:
                root = psutil.Process(pid)
                return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])
            except psutil.NoSuchProcess:
                return 0.0

        out = {name: tree(proc.pid) for name, proc in self.procs}
        me = psutil.Process()
        for child in me.children():
            try:
                title = child.cmdline()[0] if child.cmdline() else ""
                if title.startswith("epd-worker:"):
                    out["worker " + title.split(":", 1)[1].strip()] = sum(child.cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass
        out["client"] = sum(me.cpu_times()[:2])
        return out

    def close(self) -> None:
        from ipc import shm
        from pipeline.testing.vllm import stop

        for _, proc in reversed(self.procs):
            stop(proc)
        if self.worker is not None:
            self.worker.close()
        shm.sweep(f"peers_vrx{os.getpid()}")  # vLLM kills its engine core before the connector's shutdown


def measure(args, tmp: str) -> dict:
    from pipeline.testing.vllm import chat

    n1 = args.images or (12 if args.quick else 40)
    servers = Servers(tmp, args)
    checker = Checker(PATHS[0])
    body = lambda url: chat(servers.model, {"type": "image_url", "image_url": {"url": url}},  # noqa: E731
                            max_tokens=1, top_logprobs=5)
    result: dict = {"images_one_at_a_time": n1, "worker_mode": args.worker_mode,
                    "tower_threads": args.tower_threads}
    try:
        def one(path: str, key, url: str, record: list | None = None) -> None:
            start = time.perf_counter()
            reply = servers.send(path, body(url))
            took = time.perf_counter() - start
            checker.add(path, key, answer(reply))
            if record is not None:
                record.append(took)

        for key, url in images_of(9_000, 4):  # warm-up: each path's first multimodal requests are slower
            for path in PATHS:
                one(path, key, url)
        ttft = {p: [] for p in PATHS}
        for i, (key, url) in enumerate(images_of(0, n1)):
            order = PATHS[i % 3:] + PATHS[:i % 3]  # each path first, second and third as often
            for path in order:
                time.sleep(QUIET_S)
                one(path, key, url, ttft[path])
        result["ttft_ms"] = {p: pct(v) for p, v in ttft.items()}
        ips, cpu = {}, {}
        for k in args.in_flight:
            images = images_of(100_000 * k, (6 if args.quick else 16) * k)
            ips[k] = {}
            for path in PATHS:  # the reference first: the others are checked against it
                time.sleep(QUIET_S)
                with ThreadPoolExecutor(k) as pool:
                    before, start = servers.cpu(), time.perf_counter()
                    list(pool.map(lambda im: one(path, *im), images))
                    ips[k][path] = len(images) / (time.perf_counter() - start)
                    after = servers.cpu()
                cpu.setdefault(k, {})[path] = {name: (after[name] - before.get(name, 0.0)) * 1e3 / len(images)
                                               for name in after if after[name] - before.get(name, 0.0) > 0}
        result["images_per_s"] = ips
        result["cpu_ms_per_image"] = cpu
        result["worker_stats"] = {k: v for k, v in servers.worker.stats().items()
                                  if isinstance(v, (int, float))}
    finally:
        servers.close()
    result["check"] = checker.summary()
    return result


def main(args) -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="epd-peers-vllm-") as tmp:
        if args.profile:
            from benchmarks.scenarios.peers_profile import profile

            result = profile(args, tmp)
            result["check"] = {"ok": True, "reference": "local", "paths": {}}
        else:
            result = measure(args, tmp)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    return 0 if result["check"]["ok"] else 1


__all__ = ["main", "LOGPROB_TOLERANCE"]
