"""A front for vLLM's OpenAI server that has the encode workers encode the images.

    run.py proxy --model DIR --vllm http://127.0.0.1:8000 --listen 127.0.0.1:8100 \\
        --worker ipc:///tmp/epd-epd/intake.sock,tcp://127.0.0.1:17600,epd

For each chat request with images it runs the model's image processor with vLLM's
settings (the checkpoint's processor configuration and the same `mm_processor_kwargs`),
sends the pixels to a worker (`RoutedClient`: by content hash, over several workers),
and forwards the request to vLLM with each image replaced by its metadata
(`image_grid_thw`, no pixels), a `uuid` equal to its content hash, and
`ec_transfer_params` naming the room and the worker, which vLLM's `EPDConnector`
(pipeline/integrations/vllm.py) follows. Images come as `data:` URLs. Other requests
pass through unchanged.
"""
from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import secrets
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from pipeline.peers.client import Item, RoutedClient, WorkerAddress, image_item, routing_key


class BadRequest(ValueError):
    """The client's request cannot be served; the message says why."""


class Preprocessor:
    """The model's image processor, as vLLM runs it, and the request rewrite."""

    def __init__(self, model: str, mm_processor_kwargs: dict | None = None, compressed: bool = False):
        from transformers import AutoProcessor

        self.image_processor = AutoProcessor.from_pretrained(model).image_processor
        self.kwargs = dict(mm_processor_kwargs or {})
        self.compressed = compressed  # send the image file (protocol 1.2): the worker decodes it

    def bounds(self) -> tuple[int, int]:
        """The processor's min_pixels and max_pixels, as vLLM runs it (mm_processor_kwargs over the checkpoint's)."""
        size = self.kwargs.get("size") or getattr(self.image_processor, "size", None) or {}
        get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
        lo = self.kwargs.get("min_pixels") or get("shortest_edge") or get("min_pixels")
        hi = self.kwargs.get("max_pixels") or get("longest_edge") or get("max_pixels")
        return int(lo), int(hi)

    def settings(self, raw: bytes):
        """The file's format (from its header) and the processor's settings, as ipc.media takes them."""
        from PIL import Image

        from ipc import media

        try:
            fmt = (Image.open(io.BytesIO(raw)).format or "").lower()
        except Exception as e:
            raise BadRequest(f"an image does not decode: {e}") from None
        if fmt not in media.FORMATS:
            raise BadRequest(f"images are jpeg, png or webp, not {fmt or 'unknown'}")
        lo, hi = self.bounds()
        return fmt, media.ImageSettings(patch=self.image_processor.patch_size, merge=self.image_processor.merge_size,
                                        min_pixels=lo, max_pixels=hi)

    def compressed_image(self, raw: bytes) -> Item:
        """The image's bytes and its grid from the header: no decode here."""
        from ipc import media

        fmt, s = self.settings(raw)
        try:
            return image_item(raw, fmt, min_pixels=s.min_pixels, max_pixels=s.max_pixels, patch=s.patch,
                              merge=s.merge)
        except media.MediaError as e:
            raise BadRequest(f"an image is refused: {e}") from None

    def image(self, url: str) -> Item:
        """One image's pixels (or, compressed, its bytes) and patch grid."""
        if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
            raise BadRequest("images must be data: URLs (data:image/png;base64,...)")
        try:
            raw = base64.b64decode(url.split(",", 1)[1], validate=True)
        except Exception as e:
            raise BadRequest(f"an image does not decode: {e}") from None
        if self.compressed:
            return self.compressed_image(raw)
        from ipc import media

        fmt, s = self.settings(raw)
        try:
            # As vLLM's loader decodes it: EXIF orientation applied, transparency on white.
            image = media.decode_rgb(raw, fmt, s)
        except media.MediaError as e:
            raise BadRequest(f"an image does not decode: {e}") from None
        out = self.image_processor(images=[image], return_tensors="np", **self.kwargs)
        grid = [int(v) for v in out["image_grid_thw"][0]]
        return Item("image", [grid], np.ascontiguousarray(out["pixel_values"], dtype=np.float32))

    def rewrite(self, body: dict) -> tuple[dict, list[Item], dict[str, int]]:
        """The body with every image replaced by its metadata and uuid; the distinct
        items, in order; each uuid's item index."""
        items: list[Item] = []
        index: dict[str, int] = {}
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("messages must be a list")
        out = dict(body, messages=[])
        for msg in messages:
            content = msg.get("content") if isinstance(msg, dict) else None
            if not isinstance(content, list):
                out["messages"].append(msg)
                continue
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    url = part.get("image_url")
                    item = self.image(url.get("url") if isinstance(url, dict) else url)
                    uuid = f"{routing_key([item]):016x}"
                    if uuid not in index:
                        index[uuid] = len(items)
                        items.append(item)
                    part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": item.grid_thw[0]},
                            "uuid": uuid}
                parts.append(part)
            out["messages"].append(dict(msg, content=parts))
        return out, items, index


class Proxy:
    """Rewrites chat requests with images and forwards everything to vLLM."""

    def __init__(self, preprocessor: Preprocessor, workers: list[WorkerAddress], vllm: str,
                 deadline_ms: int | None = None, curve_cert: str | None = None, worker_cert: str | None = None):
        self.pre = preprocessor
        self.client = RoutedClient(workers, curve_cert=curve_cert, worker_cert=worker_cert)
        self.lock = threading.Lock()  # the client's sockets are used by one thread at a time
        self.vllm = urllib.parse.urlsplit(vllm)
        self.deadline_ms = deadline_ms
        self.retries = 0  # requests sent again in a new room after vLLM answered an error

    def prepare(self, body: dict, request_id: str) -> dict:
        """The body to forward: encodes its images first (sends the room to a worker)."""
        body, items, index = self.pre.rewrite(body)
        if not items:
            return body
        room = secrets.randbits(63) + 1
        with self.lock:
            worker = self.client.encode(room, request_id, items, deadline_ms=self.deadline_ms)
        return dict(body, ec_transfer_params={"room": room, "worker": worker, "items": index})

    def conclude(self, body: dict) -> None:
        """vLLM has answered the prepared `body`: its room is over, and a pixel segment
        the worker never took (the worker died, or never read the encode) is unlinked."""
        params = body.get("ec_transfer_params")
        if isinstance(params, dict):
            with self.lock:
                self.client.conclude(params["room"])

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.vllm.hostname, self.vllm.port or 80, timeout=600)

    def close(self) -> None:
        with self.lock:
            self.client.close(abandon=True)


class Handler(BaseHTTPRequestHandler):
    proxy: Proxy  # set on the server's handler class
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.forward(None)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        retry = None
        self.sent: list[dict] = []  # the bodies with a room this request sent to vLLM
        if self.path.rstrip("/").endswith("/chat/completions"):
            try:
                body = json.loads(raw)
                raw, encoded = self.prepared(body)
            except ValueError as e:  # BadRequest, bad JSON, an image its processor refuses
                return self.reply(400, {"error": {"message": str(e), "type": "BadRequestError", "code": 400}})
            except Exception as e:  # the worker unreachable, ...: this request fails, the proxy serves on
                return self.reply(500, {"error": {"message": f"proxy: {e!r}", "type": "InternalServerError",
                                                  "code": 500}})
            if encoded:
                # vLLM answers a room that failed (its worker restarted and lost it, a
                # deadline passed) with a bare 500: the request is tried once more in a
                # new room. vLLM's own errors are answered before any token, so nothing
                # reached the client yet.
                retry = lambda: self.prepared(body)[0]  # noqa: E731
        try:
            self.forward(raw, retry)
        finally:
            for sent in self.sent:
                self.proxy.conclude(sent)

    def prepared(self, body: dict) -> tuple[bytes, bool]:
        """The body to forward, and whether it has a room (kept, to conclude it)."""
        out = self.proxy.prepare(body, f"proxy-{secrets.token_hex(6)}")
        if "ec_transfer_params" in out and "ec_transfer_params" not in body:
            self.sent.append(out)
            return json.dumps(out).encode(), True
        return json.dumps(out).encode(), False

    def forward(self, raw: bytes | None, retry=None) -> None:
        conn = self.proxy.connection()
        try:
            headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
            conn.request(self.command, self.path, body=raw, headers=headers)
            resp = conn.getresponse()
            if resp.status >= 500 and retry is not None:
                resp.read()
                conn.close()
                self.proxy.retries += 1
                return self.forward(retry())
            self.send_response(resp.status)
            for key in ("Content-Type",):
                if resp.getheader(key):
                    self.send_header(key, resp.getheader(key))
            self.send_header("Connection", "close")
            self.end_headers()
            while chunk := resp.read1(65536):  # streamed responses go on as they come
                self.wfile.write(chunk)
                self.wfile.flush()
        except OSError as e:
            self.reply(502, {"error": {"message": f"vLLM at {self.proxy.vllm.geturl()}: {e}", "code": 502}})
        finally:
            conn.close()
        self.close_connection = True

    def reply(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt: str, *args) -> None:
        return None


def serve(proxy: Proxy, host: str, port: int) -> ThreadingHTTPServer:
    """A started server (serve_forever it, or run that in a thread; shutdown() to stop)."""
    handler = type("ProxyHandler", (Handler,), {"proxy": proxy})
    return ThreadingHTTPServer((host, port), handler)


def parse_worker(text: str) -> WorkerAddress:
    parts = text.split(",")
    if len(parts) not in (2, 3) or not all(parts[:2]):
        raise argparse.ArgumentTypeError(f"--worker {text!r}: INTAKE,BOOTSTRAP[,SHM_PREFIX]")
    return WorkerAddress(parts[0], parts[1], parts[2] if len(parts) == 3 and parts[2] else None)


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[2].strip())
    p.add_argument("--model", required=True, help="the checkpoint directory vLLM serves (its processor settings)")
    p.add_argument("--vllm", required=True, help="vLLM's OpenAI server, e.g. http://127.0.0.1:8000")
    p.add_argument("--worker", action="append", type=parse_worker, required=True,
                   help="INTAKE,BOOTSTRAP[,SHM_PREFIX] of a worker (repeat for several); SHM_PREFIX when "
                        "it shares this host's /dev/shm, else pixels go inline")
    p.add_argument("--listen", default="127.0.0.1:8100", help="HOST:PORT this proxy serves on")
    p.add_argument("--mm-processor-kwargs", type=json.loads, default=None,
                   help="JSON: the same --mm-processor-kwargs vLLM runs with")
    p.add_argument("--deadline-ms", type=int, default=None, help="each room's deadline at the worker")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads of the image processor (default %(default)s; 0: torch's default, "
                        "one per CPU); requests already run in threads of their own")
    p.add_argument("--send-compressed", action="store_true",
                   help="send each image's file (protocol 1.2; the workers decode it, with the checkpoint's "
                        "processor settings) instead of its pixels")
    p.add_argument("--curve-cert", help="CurveZMQ: this proxy's .key_secret certificate (workers with curve_cert)")
    p.add_argument("--worker-cert", help="CurveZMQ: the workers' public certificate")
    return p


def main(argv: list[str], prog: str = "run.py proxy") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.threads < 0:
        build_parser(prog).error(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        import torch

        # The processor's steps are a few passes over one image each: more threads per
        # pass buy little and, beside other requests' threads, spin for the cores.
        torch.set_num_threads(args.threads)
    host, _, port = args.listen.rpartition(":")
    proxy = Proxy(Preprocessor(args.model, args.mm_processor_kwargs, args.send_compressed), args.worker, args.vllm,
                  args.deadline_ms, args.curve_cert, args.worker_cert)
    server = serve(proxy, host or "127.0.0.1", int(port))
    print(f"proxy on http://{args.listen} -> {args.vllm}, {len(args.worker)} worker(s)", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        proxy.close()
    return 0
