"""benchmarks/peers.py's pieces, without the engines: the workload, the check of every
answer against the local reference, vLLM's own disaggregation as the benchmark drives it
(against stand-in producer and consumer servers), and the figures written."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks import peers
from benchmarks.scenarios import peers_common, peers_vllm


def test_the_images_have_several_sizes_and_repeats():
    seeds = peers_common.image_seeds(0, 12)
    assert {size for _, size in seeds} == set(peers_common.SIZES)
    assert len(set(seeds)) == 10 and seeds[4] == seeds[2] and seeds[9] == seeds[7]
    assert all(h * w <= 448 * 448 and h % 28 == 0 and w % 28 == 0 for h, w in peers_common.SIZES)
    assert peers_common.image_seeds(0, 12) == seeds  # the same images for every path


def test_the_checker_fails_a_wrong_token_or_a_far_logprob():
    c = peers_common.Checker("local")
    ref = ("a", {"a": -0.5, "b": -1.0})
    for key in ("x", "y", "z"):
        c.add("local", key, ref)
    c.add("ours", "x", ("a", {"a": -0.505, "b": -1.0}))
    assert c.summary()["ok"]
    c.add("ours", "y", ("b", {"a": -0.5, "b": -1.0}))  # another token
    c.add("theirs", "z", ("a", {"a": -0.52, "b": -1.0}))  # 0.02 away
    c.add("theirs", "w", ref)  # no reference answer for it
    s = c.summary()
    assert not s["ok"]
    assert s["paths"]["ours"]["wrong"] == 1 and s["paths"]["theirs"]["wrong"] == 1
    assert s["paths"]["ours"]["other_token"] == 1 and s["paths"]["theirs"]["other_token"] == 0
    assert s["paths"]["theirs"]["without_reference"] == 1
    assert s["paths"]["theirs"]["logprob_max_abs_diff"] == pytest.approx(0.02)


class _Stub(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.server.server_port, body))
        if self.server.role == "producer":
            reply = {"ec_transfer_params": {"h0": {"item_indices": [0], "metadata": {"image_grid_thw": [[1, 4, 6]]}},
                                            "h1": {"item_indices": [1], "metadata": {"image_grid_thw": [1, 8, 8]}}}}
        else:
            reply = {"choices": [{"logprobs": {"content": [{"token": "t", "top_logprobs": []}]}}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_own_disaggregation_sends_each_image_as_its_hash_and_grid():
    """The producer gets the request as it is; the consumer gets each image as the
    producer's mm_hash and grid, in order, and no pixels."""
    servers = []
    for role in ("producer", "consumer"):
        s = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
        s.role = role
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
    try:
        url = lambda s: f"http://127.0.0.1:{s.server_port}"  # noqa: E731
        image = lambda u: {"type": "image_url", "image_url": {"url": u}}  # noqa: E731
        body = {"model": "m", "max_tokens": 1, "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [image("data:a"), {"type": "text", "text": "and"}, image("data:b")]}]}
        reply = peers_vllm.own_disagg(url(servers[0]), url(servers[1]), body)
        assert peers_vllm.answer(reply) == ("t", {})
        (p_port, to_producer), (c_port, to_consumer) = _Stub.seen
        assert p_port == servers[0].server_port and c_port == servers[1].server_port
        assert to_producer == body
        assert to_consumer["messages"][0] == body["messages"][0]
        assert to_consumer["messages"][1]["content"] == [
            {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 6]}, "uuid": "h0"},
            {"type": "text", "text": "and"},
            {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 8, 8]}, "uuid": "h1"}]
        assert "data:" not in json.dumps(to_consumer)
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def test_the_ratios_and_their_targets_are_printed_and_kept(capsys):
    lat = lambda p50: {"p50": p50, "p99": p50 * 2, "n": 3}  # noqa: E731
    results: dict = {}
    peers.report_vllm({"ttft_ms": {"local": lat(60.0), "ours": lat(80.0), "theirs": lat(200.0)},
                       "images_per_s": {"4": {"local": 10.0, "ours": 12.0, "theirs": 4.0},
                                        "16": {"local": 10.0, "ours": 5.0, "theirs": 4.0}}}, results)
    peers.report_tokenspeed({"latency_ms": {"theirs": lat(50.0), "ours": lat(45.0)},
                             "images_per_s": {"4": {"theirs": 10.0, "ours": 13.0}}}, results)
    out = capsys.readouterr().out
    assert results["peers_vllm_ttft_vs_own_disagg"] == pytest.approx(0.4)
    assert results["peers_vllm_ttft_vs_local"] == pytest.approx(80 / 60)
    assert results["peers_vllm_throughput_vs_own_disagg"] == pytest.approx(3.0)
    assert results["peers_vllm_throughput_vs_own_disagg_16"] == pytest.approx(1.25)
    assert results["peers_tokenspeed_throughput_vs_own"] == pytest.approx(1.3)
    assert results["peers_tokenspeed_latency_vs_own"] == pytest.approx(0.9)
    assert "peers_vllm_ttft_vs_own_disagg = 80.00 ms / 200.00 ms = 0.40  (target <= 0.5: met)" in out
    assert "peers_vllm_throughput_vs_own_disagg_16 = 5.00 images/s / 4.00 images/s = 1.25  (target >= 1.5: MISSED)" \
        in out
    assert "peers_tokenspeed_latency_vs_own = 45.00 ms / 50.00 ms = 0.90  (target <= 0.8: MISSED)" in out
    assert "peers_vllm_ttft_vs_local = 80.00 ms / 60.00 ms = 1.33  (no target)" in out


def test_a_part_that_fails_is_a_failed_run(tmp_path, monkeypatch, capsys):
    """A side that cannot run (its environment missing) makes the exit status 1, and every
    figure's key is still in the JSON, None."""
    monkeypatch.setitem(peers.PYTHONS, "tokenspeed", str(tmp_path / "missing" / "python"))
    out = tmp_path / "peers.json"
    assert peers.main(["--only", "tokenspeed", "--json", str(out)]) == 1
    r = json.loads(out.read_text())
    assert r["failures"] and "missing" in r["failures"][0]
    assert set(peers_common.TARGETS) <= set(r) and r["peers_tokenspeed_throughput_vs_own"] is None
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.long
def test_the_tokenspeed_side_runs_at_its_smallest(tmp_path):
    """benchmarks/peers.py --only tokenspeed at its smallest: tokenspeed's own encode
    worker and the worker behind its fronts both serve tokenspeed's prefill code, every
    room's rows are the tower's, and the figures are written."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for venv in (".venv-tokenspeed", ".venv-vllm"):
        assert os.path.exists(os.path.join(root, venv, "bin", "python")), (
            f"{venv} is missing: build it with scripts/setup_{venv[6:]}.sh")
    out = tmp_path / "peers.json"
    p = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "peers.py"), "--only", "tokenspeed",
                        "--quick", "--images", "2", "--in-flight", "2", "--json", str(out)],
                       cwd=root, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    ts = r["tokenspeed"]
    assert ts["check"]["ok"] and set(ts["check"]["rooms"]) == {"theirs", "ours"}
    assert all(c["rooms"] >= 9 and c["rows_max_abs_diff"] <= 1e-3 for c in ts["check"]["rooms"].values())
    assert all(ts["images_per_s"]["2"][path] > 0 for path in ("theirs", "ours"))
    assert r["peers_tokenspeed_latency_vs_own"] > 0
    assert "peers_tokenspeed_latency_vs_own = " in p.stdout
