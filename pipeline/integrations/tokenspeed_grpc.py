"""tokenspeed's gateway, spoken to by a thin translator: `TokenSpeedEncoder/Encode`, the
discovery calls of `TokenSpeedScheduler` and `grpc.health.v1` (docs/tokenspeed.md).

One Encode carries one item and one room. It becomes the native `encode` it means and
goes to the worker's own intake socket, which checks it again and owns the room from
there: the front only reads what it must to translate (and refuses up front what the
native rules refuse, so the gateway hears why). Pixels inline go inline; pixels in a
gateway's shared-memory segment are taken only under the names tokenspeed's gateways
make (`psm_` and 8 hex digits, `smg-mm-...`, `smg-tokenspeed-...`), only from a regular
file of the worker's user of the size the call says: hard-linked (exactly the tensor)
or copied into a segment under the worker's prefix. The gateway's name is unlinked only
once the call is accepted, as tokenspeed's own encode side does after its read; a
refused call leaves every file as it found it, so a name in a call can never make the
worker delete or move a file it was not handed.
"""
from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import zmq
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import (common_pb2, tokenspeed_encoder_pb2, tokenspeed_encoder_pb2_grpc,
                                      tokenspeed_scheduler_pb2, tokenspeed_scheduler_pb2_grpc)

from ipc import hashing, shm, wire
from pipeline.runtime import wiring
from pipeline.peers.client import unlink_segment

log = logging.getLogger("epd.tokenspeed")

ENCODER = "tokenspeed.grpc.encoder.TokenSpeedEncoder"
SCHEDULER = "tokenspeed.grpc.scheduler.TokenSpeedScheduler"
MAX_MESSAGE_BYTES = 256 << 20  # tokenspeed's own server's limit: gRPC's default refuses one 448x448 image
HANDLER_THREADS = 8
MAX_CONCURRENT_RPCS = 64  # beyond, gRPC answers RESOURCE_EXHAUSTED: a flood pushes back
SEND_TIMEOUT_S = 10.0     # an intake that takes nothing this long: UNAVAILABLE
MODALITIES = {common_pb2.IMAGE: "image", common_pb2.VIDEO: "video"}
GRIDS = ("image_grid_thw", "video_grid_thw")
ROOM_MAX = 2**63 - 1  # tokenspeed's rooms are int64


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, reason: str):
        super().__init__(reason)
        self.code = code


# What tokenspeed's gateways name their segments: Python's SharedMemory(create=True)
# ("psm_" and 4 random bytes in hex) and smg's gateway ("smg-mm-...", and the older
# "smg-tokenspeed-..." its servicer still accepts). Nothing else in /dev/shm is a
# gateway's, so nothing else is opened, linked or unlinked on a call's word.
GATEWAY_NAME = re.compile(r"psm_[0-9a-f]{8}|smg-(?:mm|tokenspeed)-[A-Za-z0-9._-]{1,200}")


def foreign_segment(name: str, prefix: str) -> str:
    """The /dev/shm path of a gateway's segment, or Refused: only under tokenspeed's own
    names (a leading '/' allowed, as smg's servicer allows it), never one of ours."""
    bare = name[1:] if name.startswith("/") else name
    if not GATEWAY_NAME.fullmatch(bare) or bare.startswith(prefix) or bare in (".", ".."):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"shm name {name[:80]!r} is not a tokenspeed gateway's segment name "
                      "(psm_<8 hex>, smg-mm-..., smg-tokenspeed-...)")
    return os.path.join(shm.SHM_DIR, bare)


def take_segment(path: str, offset: int, nbytes: int, dest_name: str) -> os.stat_result:
    """`nbytes` at `offset` of the segment at `path` into a new segment `dest_name`: only a
    regular file (never through a link) of the worker's user, large enough. One that is
    exactly the tensor is hard-linked, not copied; the gateway's name is left in place
    (the caller unlinks it once the call is accepted), and intake checks what it finds
    under ours again, as it checks any client's. What the gateway's name was found to be."""
    dest = os.path.join(shm.SHM_DIR, dest_name[1:])
    st = _regular(os.lstat, path, offset, nbytes)
    if offset == 0 and st.st_size == nbytes:
        try:
            os.link(path, dest, follow_symlinks=False)
        except OSError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"shm segment cannot be taken: {e.strerror}") from None
        if _same(os.lstat(dest), st):
            return st
        unlink_segment(dest_name)  # swapped under us between the two looks: not what we checked
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "shm segment changed while it was taken")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"shm segment cannot be opened: {e.strerror}") from None
    try:
        if not _same(_regular(os.fstat, fd, offset, nbytes), st):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "shm segment changed while it was taken")
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            done = 0
            while done < nbytes:
                sent = os.sendfile(out, fd, offset + done, nbytes - done)
                if not sent:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "shm segment shrank while it was read")
                done += sent
        except BaseException:
            unlink_segment(dest_name)
            raise
        finally:
            os.close(out)
        return st
    finally:
        os.close(fd)


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _regular(stat_of, what, offset: int, nbytes: int) -> os.stat_result:
    try:
        st = stat_of(what)
    except OSError as e:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"shm segment cannot be opened: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "shm segment is not a regular file")
    if st.st_uid != os.geteuid():
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "shm segment is not the worker's user's")
    if offset + nbytes > st.st_size:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"shm segment holds {st.st_size} bytes; offset {offset} + nbytes {nbytes} runs past it")
    return st


def unlink_taken(path: str, st: os.stat_result) -> None:
    """The gateway's name, once its call is accepted: only if it still names the file
    that was taken."""
    try:
        if _same(os.lstat(path), st):
            os.unlink(path)
    except OSError:
        pass


def shm_namespace_id() -> str:
    """Which /dev/shm this process sees, as smg's servicer names it (boot id and the
    tmpfs's device): the gateway compares it with its own. Empty if unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f"{f.read().strip()}:{os.stat(shm.SHM_DIR).st_dev}"
    except OSError:
        return ""


def _tensor_bytes(t, what: str) -> bytes:
    if t.WhichOneof("payload") != "inline":
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what} must be inline")
    return t.inline


def grid_of(item) -> list[list[int]]:
    for key in GRIDS:
        if key in item.model_specific_tensors:
            t = item.model_specific_tensors[key]
            data = _tensor_bytes(t, key)
            if t.dtype != "int64" or len(t.shape) != 2 or t.shape[1] != 3 or len(data) != t.shape[0] * 24:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{key} must be int64 [n, 3], inline")
            return np.frombuffer(data, dtype="<i8").reshape(-1, 3).tolist()
    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"the item has none of {', '.join(GRIDS)}")


class EncoderServicer(tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderServicer):
    def __init__(self, front: "GrpcFront"):
        self.front = front

    def Encode(self, request, context):  # noqa: N802 (gRPC's name)
        try:
            self.front.encode(request)
        except Refused as e:
            context.abort(e.code, str(e))
        return tokenspeed_encoder_pb2.EncodeResponse(accepted=True)


class DiscoveryServicer(tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerServicer):
    """What tokenspeed's gateway asks a backend to register it; Generate is not ours."""

    def __init__(self, front: "GrpcFront"):
        self.front = front

    def GetModelInfo(self, request, context):  # noqa: N802
        spec = self.front.spec
        return tokenspeed_scheduler_pb2.GetModelInfoResponse(
            model_path=self.front.model, served_model_name=self.front.model, supports_vision=True,
            supports_multimodal=True, supported_modalities=list(MODALITIES), multimodal_encoder_dtype=spec.dtype)

    def GetServerInfo(self, request, context):  # noqa: N802
        """What tokenspeed's encode server tells the gateway: its role and bootstrap port
        in server_args, and which /dev/shm it sees (the gateway sends pixels in shared
        memory only to a worker that shares its own)."""
        front = self.front
        host, _, port = front.cfg.tokenspeed_grpc.rpartition(":")
        bootstrap = front.cfg.tokenspeed_bootstrap.rpartition(":")[2]
        args, info = Struct(), Struct()
        args.update({"disaggregation_mode": "encode", "disaggregation_bootstrap_port": int(bootstrap or 0),
                     "host": host.strip("[]"), "port": int(port), "model_path": front.model,
                     "served_model_name": front.model})
        info.update({"shm_namespace_id": shm_namespace_id()})
        return tokenspeed_scheduler_pb2.GetServerInfoResponse(
            server_args=args, scheduler_info=info, uptime_seconds=time.monotonic() - front.started,
            tokenspeed_version="epd-encode-worker", is_paused=front.draining())

    def HealthCheck(self, request, context):  # noqa: N802
        draining = self.front.draining()
        return tokenspeed_scheduler_pb2.HealthCheckResponse(healthy=not draining,
                                                            message="draining" if draining else "serving")

    def Generate(self, request, context):  # noqa: N802
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this is an encode worker: it serves Encode only")


class HealthServicer(health.HealthServicer):
    """grpc.health.v1, NOT_SERVING while the worker drains: the gateway stops sending."""

    def __init__(self, draining):
        super().__init__()
        self.draining = draining

    def Check(self, request, context):  # noqa: N802
        if self.draining():
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return super().Check(request, context)


class GrpcFront:
    def __init__(self, ctx: zmq.Context, cfg, spec, draining, refusal_key: bytes):
        self.cfg, self.spec, self.draining = cfg, spec, draining
        self.refusal_key = refusal_key
        self.model = f"{cfg.tower}:{cfg.tower_config}" if cfg.tower_config else cfg.tower
        self.prefix = cfg.shm_prefix
        self.started = time.monotonic()
        self.accepted = 0
        self.refused = 0
        self._names = iter(range(1 << 62))
        self.lock = threading.Lock()
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, wiring.SOCKET_QUEUE_FRAMES)
        self.push.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(cfg.intake)
        self.server = grpc.server(futures.ThreadPoolExecutor(HANDLER_THREADS, thread_name_prefix="tokenspeed-grpc"),
                                  maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
                                  options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                           ("grpc.max_send_message_length", 1 << 20),
                                           ("grpc.so_reuseport", 0)])
        tokenspeed_encoder_pb2_grpc.add_TokenSpeedEncoderServicer_to_server(EncoderServicer(self), self.server)
        tokenspeed_scheduler_pb2_grpc.add_TokenSpeedSchedulerServicer_to_server(DiscoveryServicer(self), self.server)
        self.health = HealthServicer(draining)
        for service in ("", ENCODER, SCHEDULER):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if not self.server.add_insecure_port(cfg.tokenspeed_grpc):
            self.push.close()
            raise OSError(f"tokenspeed_grpc {cfg.tokenspeed_grpc!r}: cannot listen there")
        self.server.start()

    # ------------------------------------------------------------ Encode
    def encode(self, request) -> None:
        try:
            self._encode(request)
            self.accepted += 1
        except Refused as e:
            self.refused += 1
            if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                for a in request.items:
                    if 0 <= a.bootstrap_room <= ROOM_MAX:
                        self._fail_room(a.bootstrap_room, request.request_id, str(e))
            raise

    def _encode(self, request) -> None:
        """Sends the native encode; then, and only then, the gateway's segment name goes."""
        if self.draining():
            raise Refused(grpc.StatusCode.UNAVAILABLE, "worker shutting down")
        if len(request.items) != 1 or len(request.mm_inputs.items) != 1:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"an Encode carries exactly one item and one room, got {len(request.mm_inputs.items)} "
                          f"items and {len(request.items)} rooms")
        room = request.items[0].bootstrap_room
        if not 0 <= room <= ROOM_MAX:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"bootstrap_room {room} is negative")
        item = request.mm_inputs.items[0]
        px = item.encoder_input
        modality = MODALITIES.get(item.modality)
        if modality is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "modality must be IMAGE or VIDEO")
        kind = px.WhichOneof("payload")
        if kind not in ("inline", "shm"):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          "pixels must be inline or in shared memory: remote (NIXL) pixels are not supported")
        pixels = {"shape": list(px.shape), "dtype": px.dtype}
        pixels.update({"data": px.inline} if kind == "inline" else {"shm": "/" + self.prefix + ".ts"})
        msg = {"v": wire.VERSION, "type": "encode", "request_id": request.request_id[:wire.MAX_REQUEST_ID]
               or f"tokenspeed-{room}", "room": room,
               "items": [{"modality": modality, "grid_thw": grid_of(item), "pixels": pixels}]}
        try:  # the native rules, up front, so that the gateway hears why
            parsed = wire.parse_encode(msg, 1).items[0]
            span = wire.check_item_against_tower(0, parsed, self.spec.patch_dim, self.spec.merge)
        except wire.ProtocolError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        rows = sum(p.length for p in item.placeholders)
        if item.placeholders and rows != span:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the placeholders take {rows} rows; the grid makes {span} (span)")
        if kind == "shm":
            if px.shm.nbytes != parsed.pixels.nbytes:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"shm nbytes is {px.shm.nbytes}; shape and dtype need {parsed.pixels.nbytes}")
            name = f"/{self.prefix}.ts.{os.getpid()}.{next(self._names)}"
            theirs = foreign_segment(px.shm.name, self.prefix)
            taken = take_segment(theirs, px.shm.offset, px.shm.nbytes, name)
            pixels["shm"] = name
            self._send(msg, name)
            unlink_taken(theirs, taken)
        else:
            self._send(msg, None)

    def _send(self, msg: dict, our_segment: str | None) -> None:
        try:
            with self.lock:
                # not copied into ZeroMQ again: with inline pixels it is megabytes
                self.push.send(wire.encode(msg), copy=False)
        except zmq.Again:
            if our_segment:
                unlink_segment(our_segment)
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"worker busy: its intake took nothing for "
                                                       f"{SEND_TIMEOUT_S:g} s") from None

    def _fail_room(self, room: int, request_id: str, reason: str) -> None:
        """A room refused here fails there too, with this reason, so that its prefill ranks
        hear "0" now rather than at their own timeout (intake logs and counts it)."""
        msg = hashing.refusal(self.refusal_key, room, request_id[:wire.MAX_REQUEST_ID] or "tokenspeed", reason)
        try:
            self._send(msg, None)
        except Refused:
            pass

    def stats(self) -> dict:
        return {"tokenspeed_encodes_accepted": self.accepted, "tokenspeed_encodes_refused": self.refused}

    def close(self) -> None:
        for service in ("", ENCODER, SCHEDULER):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.stop(grace=1.0).wait(5)
        self.push.close()
