"""tokenspeed 0.1.1's own encode worker on the CPU, for benchmarks/peers.py (run in
.venv-tokenspeed by benchmarks/scenarios/peers_tokenspeed.py):

    python peers_ts_encode.py MODEL_DIR PULL_ENDPOINT BOOTSTRAP_PORT THREADS

The assembly of tokenspeed's `epd/encode_loop.py` (`_build_encode_worker`,
`run_encode_loop`) with its own parts: the Mooncake encode manager and bootstrap
server, `DisaggEncodeExecutor` (its bounce ring, its sender), `EncodeScheduler`,
`EmbeddingCache` and `EncodeWorker`, draining `EncodeRequest`s (msgpack, tokenspeed's
`IpcReceiver`) from a ZeroMQ PULL socket as its loop does. Two things differ, both
because this machine has no GPU: the model is the same Qwen2.5-VL vision tower the
worker runs (stages/towers/qwen.py, float32, THREADS torch threads) behind the
`get_multimodal_encoder_specs` interface tokenspeed's executor calls, instead of
tokenspeed's CUDA model runner; and a pixel segment is copied into ordinary memory,
where tokenspeed copies it into pinned memory (which needs an accelerator).
Prints one JSON line when ready; serves until killed.
"""
from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# this folder's tokenspeed.py and vllm.py would shadow those packages
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") not in (HERE, ROOT)]


class TowerModel:
    """What DisaggEncodeExecutor asks of a model: the image encoder's fn over a batch
    of items, rows of all of them in order; no deepstack."""

    num_deepstack_embeddings = 0

    def __init__(self, tower):
        self.tower = tower

    def get_multimodal_encoder_specs(self):
        from tokenspeed.runtime.multimodal.inputs import Modality

        return {Modality.IMAGE: SimpleNamespace(fn=self.images)}

    def images(self, items):
        import torch

        pixels = torch.cat([it.feature for it in items])
        grid = torch.cat([it.model_specific_data["image_grid_thw"].reshape(-1, 3) for it in items])
        main, _ = self.tower.forward(pixels, grid)
        return main


def _unpinned(handle):
    import torch

    dst = torch.empty(handle.shape, dtype=handle.dtype)
    dst.copy_(torch.frombuffer(handle._segment.buf, dtype=handle.dtype).reshape(handle.shape))
    return dst


def build(model_dir: str, bootstrap_port: int):
    from tokenspeed.runtime.cache.embedding_cache import EmbeddingCache
    from tokenspeed.runtime.epd.encode_executor import DisaggEncodeExecutor
    from tokenspeed.runtime.epd.encode_scheduler import EncodeScheduler
    from tokenspeed.runtime.epd.encode_worker import EncodeWorker
    from tokenspeed.runtime.epd.entities import EmbeddingArgs, EmbeddingManagerArgs
    from tokenspeed.runtime.epd.mooncake.conn import MooncakeEmbeddingBootstrapServer
    from tokenspeed.runtime.epd.mooncake.encode import MooncakeEmbeddingManagerEncode
    from tokenspeed.runtime.multimodal import shm_transport

    from stages.towers.qwen import Qwen25VLTower

    shm_transport.ShmTensorHandle._copy_to_pinned = _unpinned
    tower = Qwen25VLTower(checkpoint=model_dir, dtype="float32")
    MooncakeEmbeddingBootstrapServer(bootstrap_port)
    manager = MooncakeEmbeddingManagerEncode(
        EmbeddingManagerArgs(bootstrap_port=bootstrap_port, tp_size=1, bootstrap_host="127.0.0.1"),
        EmbeddingArgs(engine_rank=0, gpu_id=0, ib_device=None, embedding_data_ptr=0, embedding_data_len=0))
    # tokenspeed's defaults: a 64-slot ring, a batch budget of 8192 tokens; slots sized
    # to the tiny tower's largest item, the cache to tokenspeed's default capacity.
    executor = DisaggEncodeExecutor(manager, TowerModel(tower), "cpu", ring_slots=64, ring_bytes=1 << 20)
    scheduler = EncodeScheduler(max_tokens_per_batch=8192, max_items_per_batch=16)
    return EncodeWorker(executor, scheduler, EmbeddingCache(4096 << 20))


def serve(worker, endpoint: str) -> None:
    """tokenspeed's run_encode_loop at TP 1."""
    import zmq

    from tokenspeed.runtime.engine.io_struct import IpcReceiver
    from tokenspeed.runtime.epd.encode_worker import EncodeRequest

    ctx = zmq.Context(2)
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    recv = IpcReceiver(sock)
    print(json.dumps({"ready": endpoint}), flush=True)
    while True:
        new = []
        while True:
            try:
                new.append(recv.recv_pyobj(flags=zmq.NOBLOCK))
            except zmq.Again:
                break
        for request in new:
            if isinstance(request, EncodeRequest):
                worker.submit(request)
        did = worker.step()
        if (not new and did == 0 and not worker.has_pending()) or worker.has_deferred():
            time.sleep(0.0005)


def main() -> None:
    import torch

    model_dir, endpoint, port, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(threads or os.cpu_count())
    serve(build(model_dir, port), endpoint)


if __name__ == "__main__":
    main()
