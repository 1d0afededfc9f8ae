"""tokenspeed's prefill side, spoken to by a thin translator: its HTTP bootstrap API and
its frames (docs/tokenspeed.md).

A tokenspeed prefill rank asks `GET /route` once for the encode side's layout and the
address of its frame socket, caches both for its life, and PUSHes frames there: a
6-part registration once per process, a 13-part pre-alloc per room. Each frame becomes
the native `register` or self-describing `alloc` it means and goes to the worker's own
bootstrap socket, so the sender keeps the one copy of the room logic; the rank's status
endpoint is registered under wire.TOKENSPEED_STATUS, so the reaper answers it in
tokenspeed's three-part status frames.

The frame socket is on the bootstrap port + 1, in the worker's main process: it stays
the same across stage restarts and worker restarts, as a prefill's cache needs.
"""
from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import zmq

from ipc import wire
from pipeline.runtime import wiring
from pipeline.ops.exposure import HTTP_IDLE_TIMEOUT_S, BoundedHTTP

log = logging.getLogger("epd.tokenspeed")

MAX_FRAME_BYTES = 4096  # a pre-alloc is some 150 bytes: a peer sending more is cut off
MAX_STATUS_SOCKETS = 16  # ranks' status endpoints the frame front answers refusals on, the latest
STATUS_LINGER_S = 1.0    # a refusal still leaving when its socket is closed; no socket closes sooner after use
DTYPES = {f"torch.{name}": name for name in wire.DTYPES}


class FrameError(ValueError):
    """A frame that is not one of tokenspeed's two kinds; str(e) says why."""


def split_host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


def _ascii_int(part: bytes, what: str, low: int = 0, high: int = wire.U64_MAX) -> int:
    try:
        text = part.decode("ascii")
    except UnicodeDecodeError:
        raise FrameError(f"{what} is not ASCII") from None
    if not text.isdigit() or len(text) > 20 or not low <= int(text) <= high:
        raise FrameError(f"{what} must be an integer in {low}..{high}, got {text[:40]!r}")
    return int(text)


def _text(part: bytes, what: str) -> str:
    try:
        text = part.decode("ascii")
    except UnicodeDecodeError:
        raise FrameError(f"{what} is not ASCII") from None
    if not 1 <= len(text) <= wire.MAX_ID_CHARS:
        raise FrameError(f"{what} must be 1..{wire.MAX_ID_CHARS} characters")
    return text


def _pointer(part: bytes, what: str) -> int:
    if len(part) != 8:
        raise FrameError(f"{what} must be 8 bytes (u64, little-endian), got {len(part)}")
    return struct.unpack("<Q", part)[0]


def _receiver(parts: list[bytes]) -> dict:
    """The receiver a frame describes: one prefill rank, named by its status endpoint."""
    host = _text(parts[1], "status_ip")
    port = _ascii_int(parts[2], "status_port", 1, 65535)
    endpoint = f"tcp://{host}:{port}"
    return {"receiver": f"tokenspeed {host}:{port}", "session": _text(parts[3], "mooncake_session"),
            "status": wire.TOKENSPEED_STATUS + endpoint}


def refused_room(parts: list[bytes]) -> tuple[int, str] | None:
    """The room and status endpoint (as the sender would take it) of a pre-alloc that
    translate refused, where both can be read: its rank is answered "0" there."""
    if len(parts) != 13:
        return None
    try:
        room = _ascii_int(parts[0], "room")
        receiver = wire.parse_bootstrap({"v": wire.VERSION, "type": "register", **_receiver(parts)})
    except (FrameError, wire.ProtocolError):
        return None
    return room, receiver.status.removeprefix(wire.TOKENSPEED_STATUS)


def translate(parts: list[bytes], deepstack_width: int) -> dict:
    """One tokenspeed frame as the native bootstrap message it means; FrameError if it is
    neither a registration nor a pre-alloc."""
    if len(parts) == 6 and parts[0] == b"None":
        _pointer(parts[4], "base_ptr")
        _pointer(parts[5], "base_deep_ptr")
        return {"v": wire.VERSION, "type": "register", **_receiver(parts)}
    if len(parts) != 13:
        raise FrameError(f"a frame of {len(parts)} parts: tokenspeed sends 6 (registration) or 13 (pre-alloc)")
    dtype = parts[8].decode("ascii", "replace")
    if dtype not in DTYPES:
        raise FrameError(f"dtype {dtype[:40]!r} is none of {', '.join(DTYPES)}")
    deepstack = parts[9]
    if deepstack not in (b"0", b"1"):
        raise FrameError("has_deepstack must be '0' or '1'")
    return {"v": wire.VERSION, "type": "alloc", **_receiver(parts),
            "room": _ascii_int(parts[0], "room"), "item": 0,
            "dst": _pointer(parts[4], "dst_ptr"), "dst_deepstack": _pointer(parts[5], "dst_deep_ptr"),
            "n_rows": _ascii_int(parts[6], "n_tokens", 0, 1 << 40),
            "hidden": _ascii_int(parts[7], "hidden", 0, 1 << 40), "dtype": DTYPES[dtype],
            # tokenspeed says only whether there is deepstack; the width is the tower's
            "deepstack_width": deepstack_width if deepstack == b"1" else 0,
            "fanout": _ascii_int(parts[10], "required_dst_info_num", 1, 1024),
            "row_start": _ascii_int(parts[11], "row_start", 0, 1 << 40),
            "span": _ascii_int(parts[12], "span", 0, 1 << 40)}


class FrameFront:
    """The frame socket: tokenspeed frames in, native bootstrap messages out, in a thread.
    Bounded as the worker's own sockets are: SOCKET_QUEUE_FRAMES per peer queue, and the
    thread blocks on a sender that is not reading, which pushes back on the prefills."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, bootstrap: str, deepstack_width: int):
        self.deepstack_width = deepstack_width
        self.dropped = Counter()
        self.forwarded = 0
        self.answered = 0  # refused pre-allocs answered "0"
        self._logged: set[str] = set()
        self.ctx = ctx
        # endpoint -> (socket, when last used), least recently used first
        self.status: OrderedDict[str, tuple[zmq.Socket, float]] = OrderedDict()
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, wiring.SOCKET_QUEUE_FRAMES)
        self.pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.pull.setsockopt(zmq.LINGER, 0)
        wiring.bound_listener(self.pull)
        try:
            self.pull.bind(f"tcp://{_bracket(host)}:{port}")
        except zmq.ZMQError:
            self.pull.close()  # else the context's term() waits for it
            raise
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, wiring.SOCKET_QUEUE_FRAMES)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(bootstrap)
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="tokenspeed-frames", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while not self.stopping:
            if not poller.poll(100):
                continue
            parts = self.pull.recv_multipart(zmq.NOBLOCK)
            try:
                msg = translate(parts, self.deepstack_width)
            except FrameError as e:
                self._drop(str(e))
                self._answer_refused(parts)
                continue
            while not self.stopping:  # the sender not reading: wait, and so push back
                try:
                    self.push.send(wire.encode(msg), zmq.NOBLOCK)
                    self.forwarded += 1
                    break
                except zmq.Again:
                    self.push.poll(100, zmq.POLLOUT)

    def _answer_refused(self, parts: list[bytes]) -> None:
        """A refused pre-alloc's rank hears "0" now rather than at its own timeout (no room
        of ours names it: the worker never saw this pre-alloc)."""
        got = refused_room(parts)
        if got is None:
            return
        room, endpoint = got
        sock, _ = self.status.pop(endpoint, (None, 0.0))
        now = time.monotonic()
        if sock is None:
            if len(self.status) >= MAX_STATUS_SOCKETS:
                if now - next(iter(self.status.values()))[1] < STATUS_LINGER_S:
                    return  # closed ones still lingering would pile up: this rank waits for its timeout
                self.status.popitem(last=False)[1][0].close()
            try:
                sock = self.ctx.socket(zmq.PUSH)
            except zmq.ZMQError:  # out of sockets: the rank waits for its own timeout
                return
            sock.setsockopt(zmq.SNDHWM, wiring.SOCKET_QUEUE_FRAMES)
            sock.setsockopt(zmq.LINGER, int(STATUS_LINGER_S * 1000))
            try:
                sock.connect(endpoint)
            except zmq.ZMQError:
                sock.close(0)
                return
        self.status[endpoint] = (sock, now)
        try:
            sock.send_multipart([str(room).encode(), b"0", b"0"], zmq.NOBLOCK)
            self.answered += 1
        except zmq.Again:  # a rank that does not read: it waits for its own timeout
            pass

    def _drop(self, reason: str) -> None:
        wire.count_reason(self.dropped, reason)
        if reason not in self._logged and len(self._logged) < 1000:
            self._logged.add(reason)
            log.warning("tokenspeed frame dropped: %s", reason)

    def close(self) -> None:
        self.stopping = True
        self.thread.join(5)
        self.pull.close()
        self.push.close()
        for sock, _ in self.status.values():
            sock.close()


class _Handler(BaseHTTPRequestHandler):
    """tokenspeed's bootstrap API (pd/base/bootstrap.py) for one encode rank."""

    timeout = HTTP_IDLE_TIMEOUT_S
    server: "BootstrapServer"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlsplit(self.path)
        if url.path == "/health":
            return self._reply(200, "OK", "text/plain")
        if url.path != "/route":
            return self._reply(404, "not found", "text/plain")
        query = parse_qs(url.query)
        rank, group = query.get("engine_rank", ["?"])[0], query.get("target_dp_group", ["?"])[0]
        if rank == "-1" and group == "-1":
            # tokenspeed names the encode side's layout prefill_*: one rank, tp 1, dp 1, pp 1
            return self._json({"prefill_tp_size": 1, "prefill_dp_size": 1, "prefill_pp_size": 1})
        if rank == "0" and group == "0":
            return self._json({"rank_ip": self.server.rank_ip, "rank_port": self.server.frame_port})
        return self._reply(404, f"no encode rank {rank[:20]!r} in dp group {group[:20]!r}: this worker is "
                                f"one encode rank (tp 1, dp 1)", "text/plain")

    def do_PUT(self) -> None:  # noqa: N802
        self._reply(405, "this worker is its only encode rank: nothing registers with it", "text/plain")

    def _json(self, body: dict) -> None:
        self._reply(200, json.dumps(body), "application/json")

    def _reply(self, code: int, body: str, kind: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args) -> None:  # noqa: A002 (http.server's name)
        log.debug("bootstrap http: " + format, *args)


class BootstrapServer(BoundedHTTP, ThreadingHTTPServer):
    """/route requests: bounded as every HTTP listener is (pipeline/ops/exposure.py)."""

    def __init__(self, host: str, port: int, rank_ip: str, frame_port: int):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.rank_ip, self.frame_port = rank_ip, frame_port
        super().__init__((host, port), _Handler)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def reachable_ip(host: str, fallback: str) -> str:
    """The address a prefill reaches a socket bound to `host` at: `host`, or for a wildcard
    the worker's own address (the Mooncake hostname), as tokenspeed would advertise."""
    return fallback if host in ("", "0.0.0.0", "::", "*") else host


class BootstrapFront:
    """The HTTP bootstrap server and the frame socket beside it, serving in threads."""

    def __init__(self, ctx: zmq.Context, endpoint: str, bootstrap: str, hostname: str, deepstack_width: int):
        host, port = split_host_port(endpoint)
        try:
            self.frames = FrameFront(ctx, host, port + 1, bootstrap, deepstack_width)
        except zmq.ZMQError as e:
            raise OSError(f"tokenspeed_bootstrap {endpoint!r}: its frame socket cannot listen on port "
                          f"{port + 1} ({e})") from None
        try:
            self.http = BootstrapServer(host, port, reachable_ip(host, hostname), port + 1)
        except OSError as e:
            self.frames.close()
            raise OSError(f"tokenspeed_bootstrap {endpoint!r}: cannot listen there ({e.strerror or e})") from None
        except BaseException:
            self.frames.close()
            raise
        self.thread = threading.Thread(target=self.http.serve_forever, args=(0.1,), name="tokenspeed-bootstrap",
                                       daemon=True)
        self.thread.start()

    def stats(self) -> dict:
        return {"tokenspeed_frames_forwarded": self.frames.forwarded,
                "tokenspeed_frames_dropped": dict(self.frames.dropped),
                "tokenspeed_pre_allocs_answered_failed": self.frames.answered}

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.frames.close()


class Fronts:
    """The tokenspeed fronts a configuration asks for, started once the stages serve (so
    that /route answers completely from its first answer) and closed before them."""

    def __init__(self, cfg, spec, run_id: str, draining=lambda: False):
        self.ctx = zmq.Context()
        self.bootstrap = self.grpc = None
        try:
            if cfg.tokenspeed_bootstrap:
                self.bootstrap = BootstrapFront(self.ctx, cfg.tokenspeed_bootstrap, cfg.bootstrap, cfg.hostname,
                                                spec.deepstack_width)
            if cfg.tokenspeed_grpc:
                try:
                    from pipeline.integrations.tokenspeed_grpc import GrpcFront
                    from stages.embedding_cache import cache_key
                except ImportError as e:
                    raise RuntimeError(f"tokenspeed_grpc needs grpcio and tokenspeed's proto package ({e}): "
                                       f"pip install 'epd-encode-worker[tokenspeed]'") from None
                # Intake's key: a room the front refuses fails there with the front's reason.
                key = cache_key(cfg.cache_key_file, cfg.shm_prefix, run_id)
                self.grpc = GrpcFront(self.ctx, cfg, spec, draining, key)
        except BaseException:
            self.close()
            raise

    def stats(self) -> dict:
        out = {}
        for front in (self.bootstrap, self.grpc):
            if front is not None:
                out.update(front.stats())
        return out

    def close(self) -> None:
        for front in (self.grpc, self.bootstrap):
            if front is not None:
                front.close()
        self.bootstrap = self.grpc = None
        self.ctx.term()


def start_fronts(cfg, spec, run_id: str, draining=lambda: False) -> Fronts | None:
    """The fronts `cfg` asks for, serving; None when it asks for none."""
    if not (cfg.tokenspeed_bootstrap or cfg.tokenspeed_grpc):
        return None
    return Fronts(cfg, spec, run_id, draining)
