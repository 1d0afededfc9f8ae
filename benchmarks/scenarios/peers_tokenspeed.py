"""benchmarks/peers.py's tokenspeed side (runs in .venv-tokenspeed): the same images,
through the same Qwen2.5-VL tower (float32, the same torch threads), encoded by
(d) tokenspeed's own encode worker (benchmarks/scenarios/peers_ts_encode.py) and
(e) the worker behind its tokenspeed fronts (`run.py serve --tokenspeed-grpc ...
--tokenspeed-bootstrap ...`, in .venv), each received by tokenspeed's own prefill code
(its Mooncake embedding manager and receiver, one rank per path, in this process).

A gateway stub sends each image as tokenspeed's gateway and servicer would: pixels
(the model's image processor, run before the clock) published to a shared-memory
segment, then, for (d), an `EncodeRequest` with tokenspeed's content hash on the
ZeroMQ channel its encode loop drains, and, for (e), a gRPC `Encode` on smg's stubs.
The prefill rank pre-allocates each room first. Encode latency: the gateway's send ->
Success at the prefill rank. Every room's rows are checked against the tower run here
on the same pixels.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks.scenarios.peers_common import images_of, pct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HIDDEN = 128          # the tiny tower's out_hidden_size
MAX_ROWS = 256        # a 448 x 448 image
SLOTS = 64
ROWS_TOLERANCE = 1e-3  # float32 rows; the two encoders may batch the same image differently
PATHS = ("theirs", "ours")
_rooms = itertools.count(1 << 32)


def _import_grpc():
    """grpc and smg's stubs: the gRPC front's extra, which tokenspeed's environment
    reaches in the project's (its zz_main_venv.pth)."""
    import grpc
    from smg_grpc_proto.generated import common_pb2, tokenspeed_encoder_pb2, tokenspeed_encoder_pb2_grpc
    from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as sched
    return grpc, common_pb2, tokenspeed_encoder_pb2, tokenspeed_encoder_pb2_grpc, sched


class Rank:
    """One tokenspeed prefill rank (tp 1) with SLOTS slots of receive memory."""

    def __init__(self):
        from tokenspeed.runtime.epd.entities import EmbeddingArgs, EmbeddingManagerArgs
        from tokenspeed.runtime.epd.mooncake.prefill import MooncakeEmbeddingManagerPrefill

        self.memory = np.zeros((SLOTS * MAX_ROWS, HIDDEN), dtype=np.float32)
        self.mgr = MooncakeEmbeddingManagerPrefill(
            EmbeddingManagerArgs(bootstrap_port=0, tp_size=1),
            EmbeddingArgs(engine_rank=0, gpu_id=0, ib_device=None, embedding_data_ptr=self.memory.ctypes.data,
                          embedding_data_len=self.memory.nbytes))

    def pre_alloc(self, bootstrap: str, room: int, span: int, slot: int):
        from tokenspeed.runtime.epd.mooncake.receiver import MooncakeEmbeddingReceiver

        rx = MooncakeEmbeddingReceiver(self.mgr, bootstrap, room)
        self.memory[slot * MAX_ROWS:slot * MAX_ROWS + span] = np.nan
        rx.pre_alloc(dst_embedding_ptr=self.memory.ctypes.data + slot * MAX_ROWS * HIDDEN * 4, n_tokens=span,
                     hidden=HIDDEN, dtype="torch.float32", row_start=0, span=span)
        return rx

    def rows(self, slot: int, span: int) -> np.ndarray:
        return self.memory[slot * MAX_ROWS:slot * MAX_ROWS + span].copy()


class Gateways:
    """The two encoders (started here), a prefill rank for each, and the gateway stubs."""

    def __init__(self, tmp: str, model: str, args):
        self.procs, self.channel, self.ctx = [], None, None
        try:
            self._start(tmp, model, args)
        except BaseException:
            self.close()  # what started before the failure
            raise

    def _start(self, tmp: str, model: str, args) -> None:
        from pipeline.runtime.background import free_port

        mode, threads = args.worker_mode, args.tower_threads
        # the same tower threads on both sides: tokenspeed's one tower gets the replicas'
        their_threads = (threads or os.cpu_count()) * args.ts_tower_replicas
        grpc, self.common_pb2, self.enc_pb2, enc_grpc, self.sched = _import_grpc()
        self.ts_bootstrap = free_port()
        self.ts_endpoint = f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ, MC_FORCE_TCP="1")
        self.procs.append(subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "benchmarks", "scenarios", "peers_ts_encode.py"), model,
             self.ts_endpoint, str(self.ts_bootstrap), str(their_threads)],
            stdout=subprocess.PIPE, stderr=open(os.path.join(tmp, "ts_encode.log"), "w"), env=env, text=True,
            cwd=ROOT))
        grpc_port, self.ours_bootstrap = free_port(), f"127.0.0.1:{free_port()}"
        run_dir = os.path.join(tmp, "worker")
        os.makedirs(run_dir)
        self.procs.append(subprocess.Popen(
            [os.path.join(ROOT, ".venv", "bin", "python"), os.path.join(ROOT, "run.py"), "serve", "--mode", mode,
             "--tower", "qwen2.5-vl", "--tower-config", model, "--tower-dtype", "float32",
             "--tower-threads", str(threads), "--tower-replicas", str(args.ts_tower_replicas),
             "--shm-prefix", f"peers_ts{os.getpid()}", "--run-dir", run_dir,
             "--intake", f"ipc://{run_dir}/intake.sock", "--bootstrap", f"tcp://127.0.0.1:{free_port()}",
             "--tokenspeed-grpc", f"127.0.0.1:{grpc_port}", "--tokenspeed-bootstrap", self.ours_bootstrap],
            stdout=open(os.path.join(tmp, "worker.log"), "w"), stderr=subprocess.STDOUT, cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT)))
        line = self.procs[0].stdout.readline()
        if "ready" not in line:
            raise RuntimeError("tokenspeed's encode worker did not start: "
                               + open(os.path.join(tmp, "ts_encode.log")).read()[-3000:])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}",
                                             options=[("grpc.max_send_message_length", 64 << 20)])
        grpc.channel_ready_future(self.channel).result(timeout=180)
        self.stub = enc_grpc.TokenSpeedEncoderStub(self.channel)
        import zmq

        from tokenspeed.runtime.engine.io_struct import IpcSender

        self.ctx = zmq.Context()
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(self.ts_endpoint)
        self.ts_sender = IpcSender(sock)
        self.ranks = {"theirs": Rank(), "ours": Rank()}
        self.bootstraps = {"theirs": f"127.0.0.1:{self.ts_bootstrap}", "ours": self.ours_bootstrap}

    def send(self, path: str, room: int, pixels: np.ndarray, grid: list, span: int) -> None:
        """What tokenspeed's gateway (and, for its own encoder, its servicer) does per image."""
        from multiprocessing import resource_tracker

        if path == "theirs":
            import torch

            from tokenspeed.runtime.epd.encode_worker import EncodeRequest
            from tokenspeed.runtime.multimodal.hash import hash_feature
            from tokenspeed.runtime.multimodal.inputs import Modality, MultimodalDataItem
            from tokenspeed.runtime.multimodal.shm_transport import ShmTensorHandle

            feature = torch.from_numpy(pixels)
            handle = ShmTensorHandle.publish(feature)
            resource_tracker.unregister("/" + handle.shm_name, "shared_memory")  # its encode side unlinks it
            item = MultimodalDataItem(modality=Modality.IMAGE, hash=hash_feature(feature), offsets=[(5, 4 + span)],
                                      feature_shm=handle,
                                      model_specific_data={"image_grid_thw": torch.tensor(grid, dtype=torch.int64)})
            self.ts_sender.send_pyobj(EncodeRequest(
                request_id=f"ts-{room}", bootstrap_host="127.0.0.1", bootstrap_port=self.ts_bootstrap,
                bootstrap_room=room, items=[item]))
            return
        from multiprocessing.shared_memory import SharedMemory

        seg = SharedMemory(create=True, size=pixels.nbytes)
        seg.buf[:pixels.nbytes] = pixels.tobytes()
        name = seg.name
        seg.close()
        resource_tracker.unregister("/" + name, "shared_memory")  # the worker unlinks it
        px = self.sched.TensorData(shape=list(pixels.shape), dtype="float32")
        px.shm.CopyFrom(self.common_pb2.ShmHandle(name=name, offset=0, nbytes=pixels.nbytes, owner_id="gw"))
        item = self.sched.MultimodalItem(modality=self.common_pb2.IMAGE, encoder_input=px, placeholders=[
            self.sched.PlaceholderRange(offset=5, length=span)])
        item.model_specific_tensors["image_grid_thw"].CopyFrom(self.sched.TensorData(
            shape=[1, 3], dtype="int64", inline=np.array(grid, dtype="<i8").tobytes()))
        accepted = self.stub.Encode(self.enc_pb2.EncodeRequest(
            request_id=f"ts-{room}", mm_inputs=self.sched.MultimodalInputs(items=[item]),
            items=[self.enc_pb2.EncodeItemAssignment(bootstrap_room=room)]), timeout=30).accepted
        if not accepted:
            raise RuntimeError(f"the worker's gRPC front did not accept room {room}")

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.channel is not None:
            self.channel.close()
        if self.ctx is not None:
            self.ctx.destroy(0)


def run(gw: Gateways, path: str, images: list, k: int, ref: dict, check: dict, lat: list | None = None) -> float:
    """images through `path`, k rooms in flight; images/s. Every room's rows checked."""
    from tokenspeed.runtime.pd.base.status import TransferPoll

    rank, free, live = gw.ranks[path], list(range(min(k, SLOTS))), {}
    todo, start = list(images), time.perf_counter()
    while todo or live:
        while todo and free:
            key, pixels, grid = todo.pop(0)
            span, slot, room = grid[0][1] * grid[0][2] // 4, free.pop(), next(_rooms)
            rx = rank.pre_alloc(gw.bootstraps[path], room, span, slot)
            live[room] = (rx, slot, span, key, time.perf_counter())
            gw.send(path, room, pixels, grid, span)
        for room, (rx, slot, span, key, sent) in list(live.items()):
            status = rx.poll()
            if status not in (TransferPoll.Success, TransferPoll.Failed):
                continue
            if lat is not None:
                lat.append(time.perf_counter() - sent)
            c = check.setdefault(path, {"rooms": 0, "wrong": 0, "failed": 0, "rows_max_abs_diff": 0.0})
            c["rooms"] += 1
            if status == TransferPoll.Failed:
                c["failed"] += 1
            else:
                rows = rank.rows(slot, span)
                d = float("inf") if np.isnan(rows).any() else float(np.abs(rows - ref[key]).max())
                c["rows_max_abs_diff"] = max(c["rows_max_abs_diff"], d)
                c["wrong"] += d > ROWS_TOLERANCE
            del live[room]
            free.append(slot)
        time.sleep(0.0002)
    return len(images) / (time.perf_counter() - start)


def reference(model: str, images: list, threads: int) -> dict:
    import torch

    from stages.towers.qwen import Qwen25VLTower

    torch.set_num_threads(threads or os.cpu_count())
    tower = Qwen25VLTower(checkpoint=model, dtype="float32")
    out = {}
    with torch.inference_mode():
        for key, pixels, grid in images:
            if key not in out:
                out[key] = tower.forward(torch.from_numpy(pixels), torch.tensor(grid))[0].numpy()
    return out


def build_model(path: str) -> str:
    """The vLLM side's checkpoint (the same seed): built in .venv-vllm, whose
    transformers has the torchvision its video processor asks for."""
    python = os.path.join(ROOT, ".venv-vllm", "bin", "python")
    subprocess.run([python if os.path.exists(python) else sys.executable, "-c",
                    "import sys; sys.path.insert(0, sys.argv[2]); from pipeline.testing.vllm import build_model; "
                    "build_model(sys.argv[1], max_pixels=448 * 448)", path, ROOT],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def measure(args, tmp: str) -> dict:
    import base64
    import io

    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    model = build_model(os.path.join(tmp, "model"))
    processor = Qwen2VLImageProcessor.from_pretrained(model)  # the proxy's, as vLLM runs it

    def prepared(base: int, n: int) -> list:
        out = []
        for key, url in images_of(base, n):
            image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
            px = processor(images=[image], return_tensors="np")
            out.append((key, np.ascontiguousarray(px["pixel_values"], dtype=np.float32),
                        [[int(v) for v in px["image_grid_thw"][0]]]))
        return out

    n1 = args.images or (12 if args.quick else 40)
    warm, one = prepared(9_000, 4), prepared(0, n1)
    loads = {k: prepared(100_000 * k, (6 if args.quick else 16) * k) for k in args.in_flight}
    ref = reference(model, warm + one + [im for v in loads.values() for im in v], args.tower_threads)
    gw = Gateways(tmp, model, args)
    check: dict = {}
    result: dict = {"images_one_at_a_time": n1, "worker_mode": args.worker_mode,
                    "tower_threads": args.tower_threads, "tower_replicas": args.ts_tower_replicas}
    try:
        for path in PATHS:
            run(gw, path, warm, 1, ref, check)
        lat = {p: [] for p in PATHS}
        for i, im in enumerate(one):
            for path in (PATHS if i % 2 == 0 else PATHS[::-1]):
                run(gw, path, [im], 1, ref, check, lat[path])
        result["latency_ms"] = {p: pct(v) for p, v in lat.items()}
        result["images_per_s"] = {k: {p: run(gw, p, v, k, ref, check) for p in PATHS} for k, v in loads.items()}
    finally:
        gw.close()
    ok = all(c["wrong"] == 0 and c["failed"] == 0 for c in check.values()) and len(check) == 2
    result["check"] = {"reference": "tower", "tolerance": ROWS_TOLERANCE, "rooms": check, "ok": ok}
    return result


def main(args) -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="epd-peers-ts-") as tmp:
        result = measure(args, tmp)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    return 0 if result["check"]["ok"] else 1
