"""vLLM with the encode worker as its encoder: EPDConnector (pipeline/integrations/vllm.py)
and the proxy (pipeline/integrations/proxy.py) against a real vLLM engine on a tiny
random-weight Qwen2.5-VL built here (no download).

It runs in .venv-vllm, the environment scripts/setup_vllm.sh builds; tests/integrations/test_vllm.py
runs it there, serially (one engine takes both cores while it starts). In the project's
own environment vLLM is not importable and this module is skipped: test_vllm.py fails
instead when .venv-vllm is missing.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm", reason="runs in .venv-vllm, driven by tests/integrations/test_vllm.py")

import torch  # noqa: E402

from ipc import shm  # noqa: E402
from pipeline.runtime.background import free_port  # noqa: E402
from pipeline.peers.client import Client, Item, routing_key  # noqa: E402
from pipeline.integrations import proxy as proxy_mod  # noqa: E402
from pipeline.integrations.vllm import EPDConnector, EPDConnectorMetadata  # noqa: E402
from pipeline.testing.sim import expected_sim_rows, image  # noqa: E402
from pipeline.testing.vllm import build_model, chat, http_status, picture, start_server, stop, wait_ready  # noqa: E402
from pipeline.testing.workers import sim_config, start_worker, with_sim_tower, worker_config  # noqa: E402
from vllm.config import ECTransferConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.multimodal.inputs import PlaceholderRange  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOKEN = os.environ.get("TEST_SHM_TOKEN", "vllm")
LOGPROB_TOLERANCE = 0.01  # vLLM's own bfloat16 tower against the worker's float32 rows cast to bfloat16


def wait_for(cond, timeout: float, what: str, step=None):
    end = time.monotonic() + timeout
    while True:
        if step is not None:
            step()
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ---------------------------------------------------------------- the connector alone
def fake_config(bootstrap: str, prefix: str, **extra):
    ec = ECTransferConfig(ec_connector="EPDConnector", ec_role="ec_consumer", ec_connector_extra_config={
        "workers": [bootstrap], "buffer_bytes": 4 << 20, "shm_prefix": prefix, "hidden": 64,
        "deepstack_width": 32, **extra})
    hf = SimpleNamespace(vision_config=SimpleNamespace(out_hidden_size=64))
    return SimpleNamespace(ec_transfer_config=ec, model_config=SimpleNamespace(hf_config=hf, dtype=torch.bfloat16))


def fake_request(rid: str, room: int, worker: str, uuids: list[str], span: int = 4, offset: int = 3):
    feats = [SimpleNamespace(identifier=u, modality="image", mm_position=PlaceholderRange(offset + 10 * i, span))
             for i, u in enumerate(uuids)]
    return SimpleNamespace(request_id=rid, mm_features=feats,
                           ec_transfer_params={"room": room, "worker": worker,
                                               "items": {u: i for i, u in enumerate(dict.fromkeys(uuids))}})


@pytest.fixture
def sim(tmp_path, request):
    """A sim worker (in process unless the test asks for a mode) and a prefix for the connector's segment."""
    prefix = f"t{TOKEN}_{os.getpid()}_vsim"
    w = start_worker(getattr(request, "param", "inprocess"), sim_config(prefix, tmp_path))
    conn_prefix = f"t{TOKEN}_{os.getpid()}_vrx"
    yield w, conn_prefix
    w.close()
    assert not shm.list_objects(prefix) and not shm.list_objects(conn_prefix)


def concluded(w, state: str, reason: str) -> bool:
    return w.stats()["rooms_concluded"].get((state, reason), 0) > 0


@pytest.mark.parametrize("sim", ["inprocess", "pipeline"], indirect=True)
def test_rows_reach_the_encoder_cache_as_main_then_deepstack(sim):
    w, prefix = sim
    cfg = fake_config(w.cfg.bootstrap, prefix)
    sched = EPDConnector(cfg, ECConnectorRole.SCHEDULER)
    worker_side = EPDConnector(cfg, ECConnectorRole.WORKER)
    try:
        grid, px = image(1)
        Client(w.cfg.intake, w.cfg.shm_prefix).encode(11, "r11", [Item("image", grid, px)])
        req = fake_request("a", 11, w.cfg.bootstrap, ["u1"])
        wait_for(lambda: sched.ensure_cache_available(req, 0), 30, "room 11's rows")
        assert sched.has_cache_item("u1") and not sched.has_cache_item("u2")
        sched.update_state_after_alloc(req, 0)
        worker_side.bind_connector_metadata(sched.build_connector_meta(None))
        cache: dict = {}
        worker_side.start_load_caches(cache)
        main, deep = expected_sim_rows(px, "image", 4, 64, 32, "bfloat16")
        got = cache["u1"].view(torch.uint16).numpy()
        assert got.shape == (4, 96) and cache["u1"].dtype == torch.bfloat16
        assert np.array_equal(got[:, :64], main) and np.array_equal(got[:, 64:], deep)
        assert sched.request_finished(req) == (False, None)
        assert not sched.has_cache_item("u1")
        # A step scheduled before the request finished may still copy its rows: the
        # buffer is freed two steps on.
        sched.build_connector_meta(None)
        assert sched.connector_scheduler.receiver.shards
        sched.build_connector_meta(None)
        assert not sched.connector_scheduler.receiver.shards
    finally:
        worker_side.shutdown()
        sched.shutdown()


def test_queue_spin_s_quiets_vllms_queue_readers_at_the_first_step(sim):
    """With queue_spin_s, the first step of each side sets every reader of vLLM's
    shared-memory queues in its process to spin that long after a read (vLLM's own: a
    second), and leaves writers alone; without it, nothing is touched."""
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    w, prefix = sim
    ctx = zmq.Context()
    address = f"ipc://{w.cfg.run_dir}/spin-notify"
    writer = SpinCondition(is_reader=False, context=ctx, notify_address=address)
    reader = SpinCondition(is_reader=True, context=ctx, notify_address=address)
    try:
        assert reader.busy_loop_s == 1
        plain = EPDConnector(fake_config(w.cfg.bootstrap, prefix), ECConnectorRole.WORKER)
        plain.bind_connector_metadata(EPDConnectorMetadata())
        plain.start_load_caches({})
        assert reader.busy_loop_s == 1, "a connector without queue_spin_s changed vLLM's spin"
        cfg = fake_config(w.cfg.bootstrap, prefix, queue_spin_s=0)
        sched = EPDConnector(cfg, ECConnectorRole.SCHEDULER)
        try:
            assert reader.busy_loop_s == 1  # not before a step: the queues may not exist yet
            sched.build_connector_meta(None)
            assert reader.busy_loop_s == 0 and writer.busy_loop_s == 0
            reader.busy_loop_s = 1
            sched.build_connector_meta(None)
            assert reader.busy_loop_s == 1, "set again at a later step"
        finally:
            sched.shutdown()
        worker_side = EPDConnector(cfg, ECConnectorRole.WORKER)
        worker_side.bind_connector_metadata(EPDConnectorMetadata())
        worker_side.start_load_caches({})
        assert reader.busy_loop_s == 0
    finally:
        for sock in (reader.local_notify_socket, reader.write_cancel_socket, reader.read_cancel_socket,
                     writer.local_notify_socket):
            sock.close(0)
        ctx.term()


def test_the_connector_speaks_curve_to_a_worker_that_requires_it(tmp_path):
    import zmq.auth

    for name in ("worker", "engine"):
        zmq.auth.create_certificates(str(tmp_path), name)
    clients = tmp_path / "clients"
    clients.mkdir()
    os.link(tmp_path / "engine.key", clients / "engine.key")
    prefix, conn_prefix = f"t{TOKEN}_{os.getpid()}_vcw", f"t{TOKEN}_{os.getpid()}_vcx"
    w = start_worker("inprocess", sim_config(prefix, tmp_path, curve_cert=str(tmp_path / "worker.key_secret"),
                                             curve_clients=str(clients)))
    certs = dict(curve_cert=str(tmp_path / "engine.key_secret"), worker_cert=str(tmp_path / "worker.key"))
    sched = EPDConnector(fake_config(w.cfg.bootstrap, conn_prefix, **certs), ECConnectorRole.SCHEDULER)
    try:
        grid, px = image(6)
        Client(w.cfg.intake, w.cfg.shm_prefix, **certs).encode(17, "r17", [Item("image", grid, px)])
        req = fake_request("g", 17, w.cfg.bootstrap, ["u7"])
        wait_for(lambda: sched.ensure_cache_available(req, 0), 30, "room 17's rows over CURVE")
        sched.request_finished(req)
    finally:
        sched.shutdown()
        w.close()
    assert not shm.list_objects(prefix) and not shm.list_objects(conn_prefix)


def test_a_room_the_worker_fails_makes_the_request_unavailable(sim):
    w, prefix = sim
    sched = EPDConnector(fake_config(w.cfg.bootstrap, prefix), ECConnectorRole.SCHEDULER)
    try:
        grid, px = image(2)  # 16 patches: 4 rows, where vLLM counts 9
        Client(w.cfg.intake, w.cfg.shm_prefix).encode(12, "r12", [Item("image", grid, px)])
        req = fake_request("b", 12, w.cfg.bootstrap, ["u2"], span=9)
        wait_for(lambda: "b" in sched.connector_scheduler.unavailable, 30, "room 12's failure",
                 step=lambda: sched.ensure_cache_available(req, 0))
        assert "span" in sched.connector_scheduler.unavailable["b"]
        assert sched.take_unavailable_requests() == {"b"} and not sched.ensure_cache_available(req, 0)
        sched.request_finished(req)
        assert not sched.connector_scheduler.receiver.shards
        # Params naming a worker this engine was not given are refused, never followed.
        bad = fake_request("c", 13, "tcp://10.9.9.9:1", ["u3"])
        assert not sched.ensure_cache_available(bad, 0) and "not one of" in sched.connector_scheduler.unavailable["c"]
    finally:
        sched.shutdown()


def test_aborted_request_and_deadline_cancel_their_rooms(sim):
    w, prefix = sim
    sched = EPDConnector(fake_config(w.cfg.bootstrap, prefix, deadline_s=0.5), ECConnectorRole.SCHEDULER)
    try:
        # No encode ever comes for these rooms: the worker holds their allocs.
        aborted = fake_request("d", 14, w.cfg.bootstrap, ["u4"])
        assert not sched.ensure_cache_available(aborted, 0)
        sched.request_finished(aborted)  # vLLM aborts it: the connector cancels its room
        wait_for(lambda: concluded(w, "failed", "canceled"), 30, "the worker to cancel room 14")
        side = sched.connector_scheduler
        wait_for(lambda: not side.draining, 30, "room 14's buffer to be released", step=side.poll)
        assert not sched.connector_scheduler.receiver.shards
        late = fake_request("e", 15, w.cfg.bootstrap, ["u5"])
        wait_for(lambda: "e" in sched.connector_scheduler.unavailable, 30, "room 15's deadline",
                 step=lambda: sched.ensure_cache_available(late, 0))
        assert "deadline_s" in sched.connector_scheduler.unavailable["e"]
        sched.request_finished(late)
        side = sched.connector_scheduler
        wait_for(lambda: not side.draining and not side.receiver.shards, 30, "room 15's release",
                 step=sched.connector_scheduler.poll)
        # A request whose media vLLM's prefix cache already covers needs no room.
        cached = fake_request("f", 16, w.cfg.bootstrap, ["u6"])
        assert sched.ensure_cache_available(cached, 100) and "f" not in sched.connector_scheduler.rooms
        assert sched.ensure_cache_available(cached, 100), "asked again, the request must not fail"
    finally:
        sched.shutdown()


def test_a_hit_in_vllms_encoder_cache_cancels_the_room(sim):
    w, prefix = sim
    sched = EPDConnector(fake_config(w.cfg.bootstrap, prefix), ECConnectorRole.SCHEDULER)
    vllm_cache = {"u7": set(), "u8": set()}  # vLLM's encoder cache manager's `cached`
    sched.connector_scheduler.scheduler = SimpleNamespace(encoder_cache_manager=SimpleNamespace(cached=vllm_cache))
    client = Client(w.cfg.intake, w.cfg.shm_prefix)
    try:
        hit = fake_request("g", 18, w.cfg.bootstrap, ["u7"])
        # vLLM holds u7: the request goes ahead at once, and no alloc is sent.
        assert sched.ensure_cache_available(hit, 0) and not sched.connector_scheduler.receiver.shards
        # Its placeholders computed from vLLM's own cache, the room is canceled, even
        # before the worker has seen the room's encode.
        assert sched.ensure_cache_available(hit, 100)
        client.encode(18, "r18", [Item("image", *image(7))])
        wait_for(lambda: concluded(w, "failed", "canceled"), 30, "the worker to cancel room 18")
        side = sched.connector_scheduler
        wait_for(lambda: not side.draining, 30, "the worker's answer", step=side.poll)
        assert sched.ensure_cache_available(hit, 100) and not sched.connector_scheduler.receiver.shards
        # Preempted, it recomputes its prompt: from vLLM's cache while u7 is there, else
        # it fails with the reason (its room is gone).
        assert sched.ensure_cache_available(hit, 0)
        del vllm_cache["u7"]
        assert not sched.ensure_cache_available(hit, 0) and "preempted" in sched.connector_scheduler.unavailable["g"]
        sched.request_finished(hit)
        # vLLM evicts u8 before it schedules the request: its room is allocated after all.
        client.encode(19, "r19", [Item("image", *image(8))])
        evicted = fake_request("h", 19, w.cfg.bootstrap, ["u8"])
        assert sched.ensure_cache_available(evicted, 0) and not sched.connector_scheduler.receiver.shards
        del vllm_cache["u8"]
        wait_for(lambda: sched.ensure_cache_available(evicted, 0), 30, "room 19's rows")
        assert sched.has_cache_item("u8")
        sched.request_finished(evicted)
        sched.build_connector_meta(None)
        sched.build_connector_meta(None)
        side = sched.connector_scheduler
        wait_for(lambda: not side.draining and not side.receiver.shards, 30, "the rooms' release", step=side.poll)
    finally:
        client.close()
        sched.shutdown()


def test_a_dead_engines_segment_is_swept_at_start(sim):
    w, prefix = sim
    dead = subprocess.run([sys.executable, "-c", (
        "import os; from ipc import shm\n"
        f"lock = shm.RunLock({prefix!r}); shm.Segment.create(shm.object_name({prefix!r}, lock.run_id, 'rx'), 4096)\n"
        "os._exit(0)")], cwd=ROOT, capture_output=True, text=True)
    assert dead.returncode == 0, dead.stderr
    left = shm.list_objects(prefix)
    assert len(left) == 2
    sched = EPDConnector(fake_config(w.cfg.bootstrap, prefix), ECConnectorRole.SCHEDULER)
    try:
        assert not set(left) & set(shm.list_objects(prefix))
    finally:
        sched.shutdown()


def serve_sim(prefix: str, where: Path, bootstrap: str) -> subprocess.Popen:
    """`run.py serve` (in process, the sim tower) in a session of its own, once it serves."""
    args = with_sim_tower(where, dict(
        shm_prefix=prefix, run_dir=str(where), intake=f"ipc://{where}/intake.sock", bootstrap=bootstrap,
        tower="sim", sim_hidden=64, sim_deepstack_width=32, pixel_arena_bytes=16 << 20,
        embedding_arena_bytes=16 << 20, arena_cache_bytes=4 << 20, max_tombstones=1024, max_live_rooms=256))
    cmd = [sys.executable, "run.py", "serve", "--mode", "inprocess"]
    for key, value in args.items():
        cmd += ["--" + key.replace("_", "-"), str(value)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    line = proc.stdout.readline()  # printed once it serves
    if not line.startswith("serving"):
        proc.kill()
        proc.wait()
        pytest.fail(f"run.py serve did not start: {line!r}")
    return proc


def test_requests_right_after_a_worker_restart_succeed(tmp_path):
    """A worker SIGKILLed with a room in flight and started again: it has no
    registrations, yet each request sent once it serves gets its rows (the allocs
    register the engine themselves), far within register_every_s; the room the dead
    worker held fails soon, with the reason (a query after query_after_s), not at
    deadline_s."""
    prefix, conn_prefix = f"t{TOKEN}_{os.getpid()}_vrw", f"t{TOKEN}_{os.getpid()}_vrx"
    bootstrap = f"tcp://127.0.0.1:{free_port()}"
    proc = serve_sim(prefix, tmp_path, bootstrap)
    sched = EPDConnector(fake_config(bootstrap, conn_prefix, query_after_s=1.0), ECConnectorRole.SCHEDULER)
    client = Client(f"ipc://{tmp_path}/intake.sock", prefix)
    try:
        client.encode(21, "r21", [Item("image", *image(21))])
        served = fake_request("a", 21, bootstrap, ["u21"])
        wait_for(lambda: sched.ensure_cache_available(served, 0), 30, "room 21's rows")
        sched.request_finished(served)
        inflight = fake_request("b", 22, bootstrap, ["u22"])  # allocated; its encode never comes
        assert not sched.ensure_cache_available(inflight, 0)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc = serve_sim(prefix, tmp_path, bootstrap)
        for room in (23, 24, 25):
            client.encode(room, f"r{room}", [Item("image", *image(room))])
            req = fake_request(f"n{room}", room, bootstrap, [f"u{room}"])
            wait_for(lambda: sched.ensure_cache_available(req, 0), 15, f"room {room}'s rows after the restart")
            sched.request_finished(req)
        wait_for(lambda: "b" in sched.connector_scheduler.unavailable, 30, "the dead worker's room to fail",
                 step=lambda: sched.ensure_cache_available(inflight, 0))
        assert "unknown room" in sched.connector_scheduler.unavailable["b"], sched.connector_scheduler.unavailable["b"]
        sched.request_finished(inflight)
    finally:
        client.close()
        sched.shutdown()
        proc.terminate()
        proc.wait(60)
    assert not shm.list_objects(prefix) and not shm.list_objects(conn_prefix)


def test_the_proxy_leaves_no_pixels_of_a_dead_worker(tmp_path):
    """A worker SIGKILLed, the proxy's encodes go unread, and vLLM (a stand-in that
    fails every request, as vLLM does a room whose worker is gone) answers 500: the
    proxy tries once more in a new room, then answers the error, and neither room's
    pixel segment is left in /dev/shm."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    prefix = f"t{TOKEN}_{os.getpid()}_vpx"
    bootstrap = f"tcp://127.0.0.1:{free_port()}"
    worker = serve_sim(prefix, tmp_path, bootstrap)
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    seen: list[dict] = []

    class Failing(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            data = b'{"error": {"message": "Internal server error", "code": 500}}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            return None

    vllm = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=vllm.serve_forever, daemon=True).start()
    proxy = proxy_mod.Proxy(proxy_mod.Preprocessor(build_model(str(tmp_path / "model"))),
                            [proxy_mod.WorkerAddress(f"ipc://{tmp_path}/intake.sock", bootstrap, prefix)],
                            f"http://127.0.0.1:{vllm.server_address[1]}")
    front = proxy_mod.serve(proxy, "127.0.0.1", 0)
    threading.Thread(target=front.serve_forever, daemon=True).start()
    try:
        status, _ = post(f"http://127.0.0.1:{front.server_address[1]}",
                         chat("m", {"type": "image_url", "image_url": {"url": picture(9)}}))
        assert status == 500 and len(seen) == 2
        assert seen[0]["ec_transfer_params"]["room"] != seen[1]["ec_transfer_params"]["room"]
        left = [n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix + ".px.")]
        assert not left, f"pixel segments no worker will take: {left}"
    finally:
        front.shutdown()
        front.server_close()
        vllm.shutdown()
        vllm.server_close()
        proxy.close()
        shm.sweep(prefix)
    assert not shm.list_objects(prefix)


def test_proxy_replaces_each_image_by_its_grid_and_uuid(tmp_path):
    """Identical images of a request are one item, text and other parts pass unchanged,
    and only data: URLs are taken."""
    pre = proxy_mod.Preprocessor(build_model(str(tmp_path / "model")))
    a, b = picture(1), picture(2, (28, 56))
    body = {"model": "m", "max_tokens": 3, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": a}}, {"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": {"url": b}},
                                     {"type": "image_url", "image_url": {"url": a}}]}]}
    out, items, index = pre.rewrite(body)
    parts = out["messages"][1]["content"]
    assert out["messages"][0] == body["messages"][0] and parts[1] == {"type": "text", "text": "and"}
    assert [p["type"] for p in parts] == ["image_embeds", "text", "image_embeds", "image_embeds"]
    assert parts[0]["uuid"] == parts[3]["uuid"] != parts[2]["uuid"]
    assert index == {parts[0]["uuid"]: 0, parts[2]["uuid"]: 1} and len(items) == 2
    assert [parts[i]["image_embeds"]["image_grid_thw"] for i in (0, 2, 3)] == [[1, 4, 6], [1, 2, 4], [1, 4, 6]]
    assert items[0].grid_thw == [[1, 4, 6]] and items[1].grid_thw == [[1, 2, 4]]
    assert items[0].pixels.shape == (24, 1176) and items[1].pixels.shape == (8, 1176)
    assert body["messages"][1]["content"][0]["type"] == "image_url"  # the caller's body is not changed
    with pytest.raises(proxy_mod.BadRequest, match="data: URLs"):
        pre.rewrite({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]})


# ---------------------------------------------------------------- a real engine
class RecordingConnector(EPDConnector):
    """EPDConnector that also saves what it puts into vLLM's encoder cache (record_dir)."""

    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        super().start_load_caches(encoder_cache, **kwargs)
        record = self._vllm_config.ec_transfer_config.ec_connector_extra_config["record_dir"]
        for load in self._get_connector_metadata().loads:
            torch.save(encoder_cache[load.identifier].cpu(), os.path.join(record, f"{load.identifier}.pt"))


@contextlib.contextmanager
def engine(kind: str, tmp: Path, shutdown_timeout: int = 0):
    """The tiny model of `kind`, a worker with its tower (float32 rows), and vLLM's OpenAI
    server on the model with the (recording) connector, stopped (SIGTERM) at the end with
    `--shutdown-timeout` (vLLM's default, 0, unless given)."""
    model = build_model(str(tmp / "model"), kind=kind)
    prefix = f"t{TOKEN}_{os.getpid()}_{kind.replace('.', '').replace('-', '')}"
    cfg = worker_config(f"{prefix}w", tmp, tower=kind, tower_config=model, tower_dtype="float32",
                        pixel_arena_bytes=64 << 20, embedding_arena_bytes=32 << 20,
                        arena_cache_bytes=8 << 20, host_cache_bytes=16 << 20)
    worker = start_worker("inprocess", cfg)
    record = tmp / "record"
    record.mkdir()
    ec = {"ec_connector": "RecordingConnector", "ec_connector_module_path": "test_vllm_engine",
          "ec_role": "ec_consumer", "ec_connector_extra_config": {
              "workers": [cfg.bootstrap], "dtype": "float32", "buffer_bytes": 32 << 20,
              "shm_prefix": f"{prefix}x", "record_dir": str(record)}}
    log = tmp / "server.log"
    extra = ["--shutdown-timeout", str(shutdown_timeout)] if shutdown_timeout else []
    try:
        proc, url = start_server(model, ec, str(log), pythonpath=[str(ROOT / "tests" / "integrations")],
                                 extra_args=extra)
        try:
            wait_ready(proc, url, str(log))
            yield SimpleNamespace(kind=kind, model=model, worker=worker, url=url, record=record, log=log,
                                  proc=proc)
        finally:
            stop(proc)
        left = shm.list_objects(f"{prefix}x")
        if shutdown_timeout:
            # The engine core had time to run the connector's shutdown.
            assert not left, f"vLLM stopped with --shutdown-timeout {shutdown_timeout} left {left}"
        else:
            # vLLM kills its engine core at once, before the connector's shutdown: its
            # segment and lock are a dead run's, which the next engine's connector removes
            # as it starts.
            print(f"{kind}: vLLM stopped with its default --shutdown-timeout left {left}")
            EPDConnector(fake_config(cfg.bootstrap, f"{prefix}x"), ECConnectorRole.SCHEDULER).shutdown()
            assert not shm.list_objects(f"{prefix}x"), "the next start left a stopped engine's segment"
    finally:
        worker.close()
    assert not shm.list_objects(f"{prefix}w")


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    with engine("qwen2.5-vl", tmp_path_factory.mktemp("qwen25")) as e:
        yield e


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    with engine("qwen3-vl", tmp_path_factory.mktemp("qwen3"), shutdown_timeout=10) as e:
        yield e


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def logprobs(reply: dict) -> np.ndarray:
    return np.array([t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]])


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at each |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126))) - 7)


@pytest.mark.parametrize("name", ["qwen25", "qwen3"])
def test_vllm_serves_the_workers_rows(name, request):
    from stages.towers.qwen import Qwen3VLTower, Qwen25VLTower

    e = request.getfixturevalue(name)
    pre = proxy_mod.Preprocessor(e.model)
    url = picture(1)
    item = pre.image(url)
    uuid = f"{routing_key([item]):016x}"
    client = Client(e.worker.cfg.intake, e.worker.cfg.shm_prefix)
    bootstrap = e.worker.cfg.bootstrap
    status, local = post(e.url, chat(e.model, {"type": "image_url", "image_url": {"url": url}}))
    assert status == 200, local
    # Metadata only: vLLM gets no pixels, so the rows can only have come from the worker.
    client.encode(101, "meta", [item])
    status, meta = post(e.url, chat(
        e.model, {"type": "image_embeds", "image_embeds": {"image_grid_thw": item.grid_thw[0]}, "uuid": uuid},
        ec_transfer_params={"room": 101, "worker": bootstrap, "items": {uuid: 0}}))
    assert status == 200, meta
    # The same image with its pixels too, under another identifier: vLLM still loads the worker's rows.
    client.encode(102, "pixels", [item])
    status, with_pixels = post(e.url, chat(
        e.model, {"type": "image_url", "image_url": {"url": url}, "uuid": uuid + "-px"},
        ec_transfer_params={"room": 102, "worker": bootstrap, "items": {uuid + "-px": 0}}))
    assert status == 200, with_pixels
    client.close()
    assert np.array_equal(logprobs(meta), logprobs(with_pixels))
    diff = np.abs(logprobs(meta) - logprobs(local)).max()
    print(f"{e.kind}: max |logprob(worker) - logprob(vLLM's own encoder)| = {diff:.4g}")
    assert diff <= LOGPROB_TOLERANCE
    received = torch.load(e.record / f"{uuid}.pt")
    tower = (Qwen3VLTower if e.kind == "qwen3-vl" else Qwen25VLTower)(checkpoint=e.model, dtype="float32")
    with torch.inference_mode():
        main, deep = tower.forward(torch.from_numpy(item.pixels), torch.tensor(item.grid_thw))
    hf = main if deep is None else torch.cat([main, deep], dim=1)  # [main | deepstack], as vLLM's Qwen3-VL
    assert received.dtype == torch.bfloat16 and received.shape == hf.shape
    assert bool((torch.abs(received.float() - hf) <= bf16_step(hf)).all())


@pytest.mark.parametrize("name", ["qwen25", "qwen3"])
def test_vllm_serves_the_workers_rows_of_compressed_images(name, request):
    """Protocol 1.2 through the proxy's --send-compressed: the worker gets the file and
    decodes it itself; vLLM's log-probabilities are its own encoder's within the tolerance."""
    e = request.getfixturevalue(name)
    pre = proxy_mod.Preprocessor(e.model, compressed=True)
    url = picture(3)
    item = pre.image(url)
    assert item.media is not None  # the file, not pixels
    uuid = f"{routing_key([item]):016x}"
    client = Client(e.worker.cfg.intake, e.worker.cfg.shm_prefix)
    status, local = post(e.url, chat(e.model, {"type": "image_url", "image_url": {"url": url}}))
    assert status == 200, local
    client.encode(111, "compressed", [item])
    status, meta = post(e.url, chat(
        e.model, {"type": "image_embeds", "image_embeds": {"image_grid_thw": item.grid_thw[0]}, "uuid": uuid},
        ec_transfer_params={"room": 111, "worker": e.worker.cfg.bootstrap, "items": {uuid: 0}}))
    assert status == 200, meta
    # The same image as the proxy's pixels (vLLM's own processor), for scale.
    px = proxy_mod.Preprocessor(e.model).image(url)
    client.encode(112, "pixels", [px])
    status, as_pixels = post(e.url, chat(
        e.model, {"type": "image_embeds", "image_embeds": {"image_grid_thw": px.grid_thw[0]}, "uuid": uuid + "-px"},
        ec_transfer_params={"room": 112, "worker": e.worker.cfg.bootstrap, "items": {uuid + "-px": 0}}))
    client.close()
    assert status == 200, as_pixels
    diff = np.abs(logprobs(meta) - logprobs(local)).max()
    px_diff = np.abs(logprobs(as_pixels) - logprobs(local)).max()
    print(f"{e.kind}, compressed: max |logprob(worker) - logprob(vLLM's own encoder)| = {diff:.4g} "
          f"(the same image as pixels: {px_diff:.4g}; compressed against pixels: "
          f"{np.abs(logprobs(meta) - logprobs(as_pixels)).max():.4g})")
    assert diff <= LOGPROB_TOLERANCE


def test_a_video_is_served_from_the_workers_rows(qwen25):
    from stages.towers.qwen import Qwen25VLTower

    e = qwen25
    item = Item("video", [[2, 4, 6]], np.random.default_rng(4).standard_normal((48, 1176), dtype=np.float32))
    uuid = f"video-{routing_key([item]):016x}"
    Client(e.worker.cfg.intake, e.worker.cfg.shm_prefix).encode(105, "video", [item])
    status, reply = post(e.url, chat(
        e.model, {"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 6]}, "uuid": uuid},
        ec_transfer_params={"room": 105, "worker": e.worker.cfg.bootstrap, "items": {uuid: 0}}))
    assert status == 200, reply
    received = torch.load(e.record / f"{uuid}.pt")
    with torch.inference_mode():
        hf, _ = Qwen25VLTower(checkpoint=e.model, dtype="float32").forward(
            torch.from_numpy(item.pixels), torch.tensor(item.grid_thw))
    assert received.shape == hf.shape == (12, 128)
    assert bool((torch.abs(received.float() - hf) <= bf16_step(hf)).all())


def test_a_room_the_worker_fails_is_an_error_at_vllms_client(qwen25):
    server, qwen_worker, model_dir = qwen25, qwen25.worker, qwen25.model
    pre = proxy_mod.Preprocessor(model_dir)
    item = pre.image(picture(2))  # a 4 x 6 grid: 6 rows for vLLM
    wrong = Item("image", [[1, 4, 4]], item.pixels[:16])  # 4 rows at the worker: the alloc check fails it
    uuid = f"{routing_key([item]):016x}"
    Client(qwen_worker.cfg.intake, qwen_worker.cfg.shm_prefix).encode(103, "wrong", [wrong])
    start = time.monotonic()
    status, reply = post(server.url, chat(
        model_dir, {"type": "image_embeds", "image_embeds": {"image_grid_thw": item.grid_thw[0]}, "uuid": uuid},
        ec_transfer_params={"room": 103, "worker": qwen_worker.cfg.bootstrap, "items": {uuid: 0}}))
    took = time.monotonic() - start
    print(f"failed room answered in {took:.3f} s: {status} {reply}")
    assert status >= 400 or reply["choices"][0]["finish_reason"] == "error", reply
    assert "span" in server.log.read_text()
    assert took < 60, "the error came from the connector's deadline, not from the room's failure"


def test_an_aborted_request_frees_its_room(qwen25):
    server, qwen_worker, model_dir = qwen25, qwen25.worker, qwen25.model
    # No encode comes for room 104: the request waits until its client gives up.
    body = chat(model_dir, {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": "abort"},
                ec_transfer_params={"room": 104, "worker": qwen_worker.cfg.bootstrap, "items": {"abort": 0}})
    with pytest.raises((TimeoutError, urllib.error.URLError, OSError)):
        post(server.url, body, timeout=2)
    wait_for(lambda: concluded(qwen_worker, "failed", "canceled"), 60, "the worker to cancel room 104")


def test_vllm_idles_while_a_request_waits_on_its_room(qwen25):
    """While the only request waits for its room's rows, vLLM's processes (API server,
    engine core, model runner) together use little CPU; then its rows come and it is
    served."""
    import psutil

    e = qwen25
    item = proxy_mod.Preprocessor(e.model).image(picture(5))
    uuid = f"{routing_key([item]):016x}"
    body = chat(e.model, {"type": "image_embeds", "image_embeds": {"image_grid_thw": item.grid_thw[0]},
                          "uuid": uuid},
                ec_transfer_params={"room": 108, "worker": e.worker.cfg.bootstrap, "items": {uuid: 0}})
    reply: dict = {}
    sender = threading.Thread(target=lambda: reply.update(zip(("status", "body"), post(e.url, body))))
    held = e.worker.stats().get("sender_held_allocs", 0)
    sender.start()
    wait_for(lambda: e.worker.stats().get("sender_held_allocs", 0) > held, 30, "room 108's alloc at the worker")
    server = psutil.Process(e.proc.pid)
    procs = [server, *server.children(recursive=True)]

    def cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    # vLLM's model runner busy-polls its queue for a second after each step it reads:
    # the window starts once it has stopped (or after 5 s of it not stopping).
    end = time.monotonic() + 5
    while time.monotonic() < end:
        before = cpu()
        time.sleep(0.25)
        if cpu() - before < 0.05:
            break
    before, start = cpu(), time.monotonic()
    time.sleep(3)  # the window the CPU is measured over, the request waiting throughout
    cores = (cpu() - before) / (time.monotonic() - start)
    print(f"vLLM's processes while a request waits on its room: {cores:.3f} cores")
    client = Client(e.worker.cfg.intake, e.worker.cfg.shm_prefix)
    client.encode(108, "idle", [item])
    client.close()
    sender.join(60)
    assert reply.get("status") == 200, reply
    assert cores < 0.3, f"vLLM used {cores:.2f} cores while its only request waited on the connector"


def test_a_hit_in_vllms_encoder_cache_cancels_the_room_at_the_worker(qwen25):
    e = qwen25
    item = proxy_mod.Preprocessor(e.model).image(picture(4))
    uuid = f"{routing_key([item]):016x}"
    part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": item.grid_thw[0]}, "uuid": uuid}
    client = Client(e.worker.cfg.intake, e.worker.cfg.shm_prefix)
    canceled = e.worker.stats()["rooms_concluded"].get(("failed", "canceled"), 0)
    for room, system in ((106, "Look."), (107, "Look again.")):
        # Another system prompt: vLLM's prefix cache misses the image, its encoder cache holds it.
        client.encode(room, f"again{room}", [item])
        body = chat(e.model, part, ec_transfer_params={"room": room, "worker": e.worker.cfg.bootstrap,
                                                       "items": {uuid: 0}})
        body["messages"].insert(0, {"role": "system", "content": system})
        status, reply = post(e.url, body)
        assert status == 200, reply
    client.close()
    wait_for(lambda: e.worker.stats()["rooms_concluded"].get(("failed", "canceled"), 0) > canceled, 30,
             "the worker to cancel room 107")


def test_a_request_through_the_proxy_command(qwen25):
    server, qwen_worker, model_dir = qwen25, qwen25.worker, qwen25.model
    port = free_port()
    w = qwen_worker.cfg
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), "proxy", "--model", model_dir,
                             "--vllm", server.url, "--listen", f"127.0.0.1:{port}",
                             "--worker", f"{w.intake},{w.bootstrap},{w.shm_prefix}"],
                            cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        front = f"http://127.0.0.1:{port}"
        wait_for(lambda: proc.poll() is not None or http_status(front + "/v1/models") == 200, 60, "the proxy")
        url = picture(3)
        status, via_proxy = post(front, chat(model_dir, {"type": "image_url", "image_url": {"url": url}}))
        assert status == 200, via_proxy
        status, local = post(server.url, chat(model_dir, {"type": "image_url", "image_url": {"url": url}}))
        assert status == 200, local
        assert np.abs(logprobs(via_proxy) - logprobs(local)).max() <= LOGPROB_TOLERANCE
        status, bad = post(front, chat(model_dir, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}))
        assert status == 400 and "data: URL" in bad["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(30)
