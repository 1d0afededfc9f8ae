"""The worker's settings: one dataclass, loaded and validated at start.

Where a value comes from, lowest to highest precedence: the default below, a TOML
file (``--config PATH``, top-level keys named as the fields), an environment
variable ``EPD_<KEY>`` (``EPD_MAX_TOKENS_PER_BATCH=2048``), a flag
(``--max-tokens-per-batch 2048``). An unknown key in the file or an unknown
``EPD_`` variable is an error, so a typo is not silently ignored; every error names
the key and where the bad value came from.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from fractions import Fraction

from ipc import shm
from ipc.fetch import AllowList
from pipeline.ops.exposure import exposure_problem
from stages import registry
from stages.embedding_cache import read_key_file
from stages.towers import TOWER_SETTINGS, TOWERS, SettingError

ENV_PREFIX = "EPD_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")


class ConfigError(ValueError):
    """A setting is invalid; the message names the setting (`key`, where known)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


def setting(default, help: str):
    return field(default=default, metadata={"help": help})


SIZE_FORMS = "bytes, or a number and a unit: 512MiB, 1GiB, 64KiB; units B, KiB, MiB, GiB, TiB, kB, MB, GB, TB"
SIZE_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
              "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*")


def size_setting(default: int, help: str):
    """A setting of bytes: a flag, variable or file may give it with a unit (`parse_size`)."""
    return field(default=default, metadata={"help": help + " (a size: 512MiB, 1GiB or bytes)", "size": True})


def parse_size(text: str) -> int:
    """`text` as bytes: a plain integer, or a number and a unit of SIZE_UNITS (case aside),
    `512MiB`, `1.5GiB`; ValueError, naming the accepted forms, for anything else."""
    m = _SIZE.fullmatch(text.lower())
    if not m or m[2] not in ("", *SIZE_UNITS):
        raise ValueError(f"expected an integer, got {text!r} (a size: {SIZE_FORMS})")
    number = Fraction(m[1]) * SIZE_UNITS.get(m[2], 1)
    if number.denominator != 1:
        raise ValueError(f"expected a whole number of bytes, got {text!r} ({float(number):g} bytes; "
                         f"a size: {SIZE_FORMS})")
    return int(number)


def tower_setting(key: str):
    """A tower's setting, its default and help as the tower declares them (stages/towers)."""
    return setting(TOWER_SETTINGS[key].default, TOWER_SETTINGS[key].help)


def _one_of(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1]


@dataclass
class WorkerConfig:
    shm_prefix: str = setting("epd", "prefix of the worker's shared-memory objects and of the client "
                                     "segments it takes")
    intake: str = setting("", "endpoint the worker receives encode requests on "
                              "(default: ipc://<run_dir>/intake.sock)")
    bootstrap: str = setting("tcp://127.0.0.1:17600", "tcp:// endpoint receivers send register, alloc "
                                                      "and cancel to")
    tokenspeed_grpc: str = setting("", "host:port of the tokenspeed gRPC front: tokenspeed's gateway sends "
                                       "TokenSpeedEncoder/Encode there ('' for none; docs/tokenspeed.md)")
    tokenspeed_bootstrap: str = setting("", "host:port of the tokenspeed HTTP bootstrap front that tokenspeed's "
                                            "prefill asks (its disaggregation bootstrap port); its frame "
                                            "socket is on the next port ('' for none; docs/tokenspeed.md)")
    curve_cert: str = setting("", "the worker's CurveZMQ secret certificate (a zmq.auth .key_secret file): "
                                  "intake, bootstrap and status sockets then use CURVE ('' for none)")
    curve_clients: str = setting("", "a directory of the public certificates (zmq.auth .key files) of the "
                                     "gateways and receivers allowed, with curve_cert")
    allow_insecure_network: bool = setting(False, "bind a listener (intake, bootstrap, the tokenspeed fronts, "
                                                  "metrics) to an address other than loopback or ipc:// "
                                                  "without CurveZMQ (anyone who reaches intake or bootstrap "
                                                  "may send encodes, register and cancel)")
    hostname: str = setting("127.0.0.1", "the Mooncake engine's local address")
    protocol: str = setting("tcp", "Mooncake protocol: tcp, or rdma when configured")
    device: str = setting("", "RDMA device names, when protocol is rdma")
    run_dir: str = setting("", "directory for the worker's sockets (default: /tmp/epd-<shm_prefix>)")
    tower: str = setting("qwen2.5-vl", f"vision tower: {_one_of(list(TOWERS))}")
    # The towers' own settings: each field is one of TOWER_SETTINGS (a test checks all are here).
    tower_config: str = tower_setting("tower_config")
    tower_dtype: str = tower_setting("tower_dtype")
    max_items_per_request: int = setting(64, "a request with more items fails at intake")
    max_pixel_bytes_per_request: int = size_setting(256 << 20, "a request with more pixel bytes fails at intake")
    max_tokens_per_batch: int = setting(4096, "scheduler: output rows per tower batch at most")
    max_items_per_batch: int = setting(16, "scheduler: items per tower batch at most")
    pixel_arena_bytes: int = size_setting(512 << 20, "shared memory for pixels between intake and the tower")
    embedding_arena_bytes: int = size_setting(512 << 20, "shared memory for embeddings, registered with Mooncake")
    arena_cache_bytes: int = size_setting(128 << 20, "the ship-ready cache tier, inside the embedding arena "
                                                     "(at most half of it)")
    host_cache_bytes: int = size_setting(1 << 30, "the host-DRAM cache tier")
    store_master: str = setting("", "host:port of a mooncake_master: its Mooncake Store is a cache tier that "
                                    "the workers pointed at it share, behind host DRAM; they must share "
                                    "cache_key_file too ('' for none: docs/store.md)")
    store_metadata: str = setting("P2PHANDSHAKE", "the store client's metadata server: P2PHANDSHAKE (none), "
                                                  "or http://host:port/metadata of an HTTP metadata server")
    store_segment_bytes: int = size_setting(1 << 30, "the memory this worker lends the store (the shared "
                                                     "tier's size is the sum of its workers')")
    store_buffer_bytes: int = size_setting(64 << 20, "the store client's staging buffer: an item's rows "
                                                     "larger than it are neither put nor fetched")
    store_get_timeout_s: float = setting(0.1, "a store lookup not answered by then is a miss (the item is "
                                              "encoded); while one is stuck past it, the store is not asked")
    trust_client_hash: bool = setting(False, "use the client's content hash instead of hashing the pixels")
    image_min_pixels: int = setting(56 * 56, "compressed images (protocol 1.2): the processor's min_pixels "
                                             "where an item gives none (the checkpoint's preprocessor_config.json "
                                             "size.shortest_edge)")
    image_max_pixels: int = setting(28 * 28 * 1280, "compressed images: the processor's max_pixels where an "
                                                    "item gives none (size.longest_edge)")
    image_backend: str = setting("pil", "compressed images: whose processor the patches equal bit for bit: pil "
                                        "(Hugging Face's PIL backend) or torchvision (its torchvision backend, "
                                        "which transformers gives vLLM where torchvision is installed; the "
                                        "preprocess stage then loads torch)")
    max_decoded_pixels: int = setting(64 << 20, "compressed images: an image larger than this many pixels as "
                                                "decoded fails its room, from its header, before any decode "
                                                "(for videos: each frame)")
    media_url_hosts: str = setting("", "compressed images: the hosts an item's media.url may name over http(s), "
                                       "separated by commas: names (matched exactly), IP addresses or networks "
                                       "(10.0.0.0/8); a name must resolve to global addresses only, unless they "
                                       "are listed too; '' (the default): no URL is fetched")
    media_url_max_bytes: int = size_setting(32 << 20, "compressed images: a URL's image larger than this fails "
                                                      "its room")
    media_url_timeout_s: float = setting(10.0, "compressed images: a URL's fetch (resolve, connect, headers, "
                                               "body) not done by then fails its room")
    video_min_pixels: int = setting(0, "compressed videos (protocol 1.2): the video processor's min_pixels where "
                                       "an item gives none (its size.shortest_edge; Qwen3-VL's bounds all frames "
                                       "together); 0: the tower's processor's default")
    video_max_pixels: int = setting(0, "compressed videos: the video processor's max_pixels where an item gives "
                                       "none (size.longest_edge); 0: the tower's processor's default")
    video_fps: float = setting(2.0, "compressed videos: frames sampled per second where an item gives none "
                                    "(vLLM's loader default; it samples at most 30)")
    max_video_decoded_pixels: int = setting(1 << 34, "compressed videos: a video whose header gives frames "
                                                     "of more pixels than this in all fails its room, before "
                                                     "any decode (this bounds its decode time)")
    cache_key_file: str = setting("", "a file of the key pixels are hashed under for the cache (32 bytes, or 64 "
                                      "hex digits; not readable by every user), to share one key among "
                                      "workers; '' for a random key of each run")
    bootstrap_timeout_s: float = setting(120.0, "a room whose allocs have not all arrived by then fails")
    tombstone_ttl_s: float = setting(600.0, "how long a concluded room is remembered (late allocs, cancels)")
    max_tombstones: int = setting(65536, "concluded rooms remembered at most")
    max_live_rooms: int = setting(4096, "rooms in flight at most; more fail at intake")
    max_held_allocs: int = setting(65536, "allocs held for rooms the sender has not seen yet, at most")
    status_hwm: int = setting(10000, "statuses queued per receiver before further ones are dropped")
    max_status_sockets: int = setting(256, "status sockets the reaper keeps open at most (each costs about 2 "
                                           "open files); the least recently used idle one is closed first")
    status_socket_idle_s: float = setting(60.0, "a status socket unused this long is closed (opened again "
                                                "for the next status)")
    registration_idle_s: float = setting(3600.0, "a receiver registration that owns no room in flight and "
                                                 "sent nothing this long expires (the receiver registers "
                                                 "again); when the table or its key's share is full, the "
                                                 "least recently heard from of its key's gives way at once")
    max_receivers_per_key: int = setting(64, "with CurveZMQ, receiver registrations one client key may hold "
                                             "(a prefill host's ranks, and room to register again): past it a new "
                                             "one takes the place of that key's own least recently heard from "
                                             "that owns no room, never another key's")
    status_ipc_dirs: str = setting("", "directories, separated by commas, that receivers' ipc:// status "
                                       "endpoints may be in (none: a register naming an ipc:// status is "
                                       "refused); a directory every user may write is refused")
    max_deadline_s: float = setting(3600.0, "a request's deadline_ms is capped at this many seconds after it "
                                            "arrives (the room fails then, saying so)")
    ring_bytes: int = size_setting(8 << 20, "pipeline: size of each ring between two stages")
    heartbeat_timeout_s: float = setting(30.0, "pipeline: a stage silent this long is killed and restarted")
    restart_limit: int = setting(5, "pipeline: more than this many restarts within restart_window_s "
                                    "end the run")
    restart_window_s: float = setting(30.0, "pipeline: the window restart_limit counts restarts in")
    drain_timeout_s: float = setting(10.0, "on SIGTERM/SIGINT, how long rooms in flight may finish")
    start_timeout_s: float = setting(300.0, "pipeline: how long a stage may take to become ready, at most "
                                            "(a tower's load, however it progresses)")
    stage_start_timeout_s: float = setting(8.0, "pipeline: a stage that loads nothing (all but the towers) not "
                                                "ready this long after its spawn is killed and restarted; a "
                                                "tower, when its load makes no progress for heartbeat_timeout_s")
    metrics_endpoint: str = setting("", "host:port of the Prometheus endpoint the supervisor serves "
                                        "('' for none)")
    numa: str = setting("auto", "NUMA placement: auto (the node nearest the tower's GPU), off, a node number, "
                                "or per stage: 'tower=1,sender=1,*=0'")
    gpu: int = tower_setting("gpu")
    tower_replicas: int = setting(1, f"tower processes, each on its own GPU (gpus), 1 to "
                                     f"{registry.MAX_TOWER_REPLICAS}; the scheduler feeds them all")
    gpus: str = setting("", "the CUDA device of each tower replica, one per replica, separated by commas "
                            "(default: gpu, gpu+1, ...)")
    tower_threads: int = setting(0, "torch intra-op threads of each tower process; 0: one per CPU the "
                                    "process may run on (its affinity, after any NUMA pinning), not the "
                                    "host's count")
    preprocess_workers: int = setting(1, f"preprocess processes (compressed images decoded into patches), 1 "
                                         f"to {registry.MAX_PREPROCESS_WORKERS}; the cache sends each miss "
                                         f"to the one with the fewest items outstanding")
    log_level: str = setting("WARNING", "DEBUG, INFO, WARNING or ERROR, for the supervisor and every "
                                        "stage process")
    log_format: str = setting("text", "text (one line per event) or json (one JSON object per line: time, "
                                      "level, stage, pid, logger, message), for the supervisor and every "
                                      "stage process")

    def resolved(self) -> "WorkerConfig":
        c = dataclasses.replace(self)
        if not c.run_dir:
            c.run_dir = f"/tmp/epd-{c.shm_prefix}"
        if not c.intake:
            c.intake = f"ipc://{c.run_dir}/intake.sock"
        if not c.gpus and 1 <= c.tower_replicas <= registry.MAX_TOWER_REPLICAS:
            c.gpus = ",".join(str(c.gpu + k) for k in range(c.tower_replicas))
        return c

    def own_endpoints(self) -> list[str]:
        """Every listener of this worker (resolved): a status endpoint may name none of them."""
        out = [self.intake, self.bootstrap, self.tokenspeed_grpc, self.metrics_endpoint]
        if self.tokenspeed_bootstrap:
            host, _, port = self.tokenspeed_bootstrap.rpartition(":")
            out += [self.tokenspeed_bootstrap, f"{host}:{int(port) + 1}"]  # its frame socket
        return [e for e in out if e]

    def _check_media_url_hosts(self) -> None:
        try:
            AllowList(self.media_url_hosts)
        except ValueError as e:
            raise ConfigError(f"media_url_hosts: {e}", "media_url_hosts") from None

    def _check_status_ipc_dirs(self) -> None:
        for d in filter(None, self.status_ipc_dirs.split(",")):
            if not os.path.isabs(d) or not os.path.isdir(d):
                raise ConfigError(f"status_ipc_dirs: {d!r} is not an absolute path of a directory",
                                  "status_ipc_dirs")
            if os.stat(d).st_mode & 0o002:
                # Anyone could put a link there to one of the worker's own sockets.
                raise ConfigError(f"status_ipc_dirs: every user may write {d!r}; name a directory only "
                                  f"the receivers' user may write", "status_ipc_dirs")

    def gpu_list(self) -> list[int]:
        return [int(g) for g in self.gpus.split(",")]

    def replica_config(self, replica: int) -> "WorkerConfig":
        """The configuration tower replica `replica` builds its tower from: its own GPU."""
        return dataclasses.replace(self, gpu=self.gpu_list()[replica])

    def _check_curve(self) -> None:
        if bool(self.curve_cert) != bool(self.curve_clients):
            raise ConfigError("curve_cert and curve_clients go together: set both for CurveZMQ, or neither",
                              "curve_cert" if not self.curve_cert else "curve_clients")
        for name in ("tokenspeed_grpc", "tokenspeed_bootstrap"):
            if self.curve_cert and getattr(self, name):
                # The fronts would pass unauthenticated peers in under one key of their own.
                raise ConfigError(f"{name} cannot be combined with curve_cert: tokenspeed's wire has no "
                                  f"authentication, and with CurveZMQ every peer must have a key of its own. "
                                  f"Serve tokenspeed from a worker without CurveZMQ (loopback, or "
                                  f"allow_insecure_network on a private network)", name)
        if self.curve_cert:
            from pipeline.peers.curve import ServerKeys  # zmq.auth: only where CURVE is asked for

            try:
                ServerKeys.load(self.curve_cert, self.curve_clients)
            except ValueError as e:
                raise ConfigError(str(e), "curve_cert") from None

    def _check_exposure(self) -> None:
        """Sockets off loopback only where their peers are authenticated or the operator
        accepts the risk (pipeline/ops/exposure.py); tokenspeed's wire has no authentication."""
        self._check_curve()
        for name in ("intake", "bootstrap"):
            problem = exposure_problem(getattr(self, name), name, bool(self.curve_cert),
                                       self.allow_insecure_network)
            if problem:
                raise ConfigError(problem, name)
        for name in ("tokenspeed_grpc", "tokenspeed_bootstrap"):
            value = getattr(self, name)
            host, _, port = value.rpartition(":")
            if value and (not host or not port.isdigit() or not 1 <= int(port) <= 65534):
                raise ConfigError(f"{name} must be host:port, got {value!r}", name)
            problem = value and exposure_problem(value, name, authenticated=False,
                                                 allow_insecure=self.allow_insecure_network)
            if problem:
                raise ConfigError(problem, name)
        # No key guards the endpoint, CurveZMQ or not.
        problem = self.metrics_endpoint and exposure_problem(
            self.metrics_endpoint, "metrics_endpoint", authenticated=False,
            allow_insecure=self.allow_insecure_network, remedy="",
            risk="read every counter and hold the endpoint's connections")
        if problem:
            raise ConfigError(problem, "metrics_endpoint")

    def validate(self) -> "WorkerConfig":
        try:
            shm.check_prefix(self.shm_prefix)
        except ValueError as e:
            raise ConfigError(f"shm_prefix: {e}", "shm_prefix") from None
        self._check_numbers()
        if self.tower_threads < 0:
            raise ConfigError(f"tower_threads must be >= 0, got {self.tower_threads}", "tower_threads")
        if not 1 <= self.tower_replicas <= registry.MAX_TOWER_REPLICAS:
            raise ConfigError(f"tower_replicas must be 1 to {registry.MAX_TOWER_REPLICAS}, "
                              f"got {self.tower_replicas}", "tower_replicas")
        if not 1 <= self.preprocess_workers <= registry.MAX_PREPROCESS_WORKERS:
            raise ConfigError(f"preprocess_workers must be 1 to {registry.MAX_PREPROCESS_WORKERS}, "
                              f"got {self.preprocess_workers}", "preprocess_workers")
        gpus = [g.strip() for g in self.gpus.split(",")]
        if not all(g.isdigit() for g in gpus) or len(gpus) != self.tower_replicas:
            raise ConfigError(f"gpus must list {self.tower_replicas} CUDA device numbers (one per tower "
                              f"replica, tower_replicas), got {self.gpus!r}", "gpus")
        if self.arena_cache_bytes > self.embedding_arena_bytes // 2:
            raise ConfigError(
                f"arena_cache_bytes ({self.arena_cache_bytes}) must leave at least half of "
                f"embedding_arena_bytes ({self.embedding_arena_bytes}) for embeddings in flight",
                "arena_cache_bytes")
        choices = {
            "protocol": ("tcp", "rdma"),
            "image_backend": ("pil", "torchvision"),
            **{s.key: s.choices for s in TOWER_SETTINGS.values() if s.choices},
            "tower": tuple(TOWERS),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                shown = ", ".join(repr(a) for a in allowed)
                raise ConfigError(f"{name} must be one of {shown}, got {getattr(self, name)!r}", name)
        try:
            self.tower_settings()
        except SettingError as e:
            raise ConfigError(str(e), e.key) from None
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}",
                              "log_format")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}",
                              "log_level")
        if self.intake and not self.intake.startswith(("ipc://", "tcp://")):
            raise ConfigError(f"intake must be an ipc:// or tcp:// endpoint, got {self.intake!r}", "intake")
        if not self.bootstrap.startswith("tcp://"):
            raise ConfigError(f"bootstrap must be a tcp:// endpoint, got {self.bootstrap!r}", "bootstrap")
        if self.metrics_endpoint:
            host, _, port = self.metrics_endpoint.rpartition(":")
            if not host or not port.isdigit() or int(port) > 65535:
                raise ConfigError(f"metrics_endpoint must be '' or host:port (a port 0-65535), "
                                  f"got {self.metrics_endpoint!r}", "metrics_endpoint")
        self._check_exposure()
        parse_numa(self.numa, self.tower_replicas, self.preprocess_workers)
        self._check_status_ipc_dirs()
        self._validate_shared_cache()
        self._check_media_url_hosts()
        return self

    def _check_numbers(self) -> None:
        """Counts and sizes at least 1, durations above 0, the rest not negative."""
        positive = [
            "max_items_per_request", "max_pixel_bytes_per_request", "max_tokens_per_batch",
            "max_items_per_batch", "pixel_arena_bytes", "embedding_arena_bytes",
            "max_tombstones", "max_live_rooms", "max_held_allocs", "status_hwm", "ring_bytes",
            "max_status_sockets", "max_receivers_per_key",
            "restart_limit", "image_min_pixels", "image_max_pixels", "max_decoded_pixels", "media_url_max_bytes",
            "max_video_decoded_pixels",
        ]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}", name)
        for s in TOWER_SETTINGS.values():
            if s.minimum is not None and getattr(self, s.key) < s.minimum:
                raise ConfigError(f"{s.key} must be >= {s.minimum}, got {getattr(self, s.key)}", s.key)
        for name in ["bootstrap_timeout_s", "tombstone_ttl_s", "heartbeat_timeout_s",
                     "restart_window_s", "start_timeout_s", "stage_start_timeout_s", "status_socket_idle_s",
                     "registration_idle_s", "media_url_timeout_s", "video_fps",
                     "max_deadline_s"]:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}", name)
        for name in ["arena_cache_bytes", "host_cache_bytes", "drain_timeout_s", "video_min_pixels",
                     "video_max_pixels"]:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}", name)

    def _validate_shared_cache(self) -> None:
        if self.cache_key_file:
            try:
                read_key_file(self.cache_key_file)
            except ValueError as e:
                raise ConfigError(f"cache_key_file: {e}", "cache_key_file") from None
        if not self.store_master:
            return
        host, _, port = self.store_master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"store_master must be host:port (a port 1-65535), got {self.store_master!r}",
                              "store_master")
        if not self.cache_key_file:
            raise ConfigError("store_master needs cache_key_file: the workers that share a store must hash "
                              "pixels under one key (the same file on each), or none finds another's "
                              "entries", "cache_key_file")
        if self.store_segment_bytes < 0 or self.store_buffer_bytes < 1:
            raise ConfigError("store_segment_bytes must be >= 0 and store_buffer_bytes >= 1", "store_buffer_bytes")
        if not self.store_get_timeout_s > 0:
            raise ConfigError(f"store_get_timeout_s must be > 0, got {self.store_get_timeout_s}",
                              "store_get_timeout_s")

    def tower_settings(self) -> dict:
        """The keyword arguments of build_tower(self.tower, ...), from the chosen tower's settings."""
        tower = TOWERS[self.tower]
        return tower.tower_kwargs({s.key: getattr(self, s.key) for s in tower.settings})


def parse_numa(text: str, replicas: int = 1, workers: int = 1) -> str | dict[str, int]:
    """`numa` as "auto", "off", or {stage or "*": node}; a bare node number is {"*": node}.
    A stage is one of the run's (with `replicas` towers and `workers` preprocess workers),
    `tower` for every replica, or `preprocess` for every worker."""
    if text in ("auto", "off"):
        return text
    if text.isdigit():
        return {"*": int(text)}
    plan: dict[str, int] = {}
    for part in text.split(","):
        stage, eq, node = (s.strip() for s in part.partition("="))
        if not eq or not node.isdigit():
            raise ConfigError(f"numa must be auto, off, a node number or 'stage=node,...,*=node', "
                              f"got {text!r} (bad part {part.strip()!r})", "numa")
        names = registry.stage_names(replicas, workers)
        if stage not in ("*", registry.TOWER, registry.PREPROCESS, *names):
            raise ConfigError(f"numa names no stage {stage!r}: stages are {', '.join(names)} "
                              f"(or * for the rest)", "numa")
        if stage in plan:
            raise ConfigError(f"numa gives {stage!r} twice in {text!r}", "numa")
        plan[stage] = int(node)
    return plan


# ---------------------------------------------------------------- loading
FIELDS = {f.name: f for f in dataclasses.fields(WorkerConfig)}
_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def _unknown(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _typed(key: str, value, where: str, from_text: bool):
    """`value` as the field's type; `from_text`: parse a string (an environment variable)."""
    kind = FIELDS[key].type
    if FIELDS[key].metadata.get("size") and isinstance(value, str):  # "512MiB" in a file too
        try:
            return parse_size(value)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}", key) from None
    if from_text and isinstance(value, str) and kind != "str":
        text = value.strip()
        try:
            if kind == "bool":
                value = {"true": True, "1": True, "yes": True, "on": True,
                         "false": False, "0": False, "no": False, "off": False}[text.lower()]
            else:
                value = int(text) if kind == "int" else float(text)
        except (KeyError, ValueError):
            raise ConfigError(f"{where}: expected {_KINDS[kind]}, got {value!r}", key) from None
    ok = {"bool": isinstance(value, bool),
          "int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "str": isinstance(value, str)}[kind]
    if not ok:
        raise ConfigError(f"{where}: expected {_KINDS[kind]}, got {value!r}", key)
    return float(value) if kind == "float" else value


def read_toml(path: str) -> dict:
    """The settings in a TOML file, typed and checked against the known keys."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None
    out = {}
    for key, value in data.items():
        if key not in FIELDS:
            raise ConfigError(f"{path}: unknown key {key!r}{_unknown(key, list(FIELDS))}", key)
        out[key] = _typed(key, value, f"{path}: {key}", from_text=False)
    return out


def read_environ(environ) -> dict:
    """The settings in `EPD_<KEY>` environment variables, typed; any other EPD_ name is an error."""
    known = {env_name(k): k for k in FIELDS}
    out = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        if name not in known:
            raise ConfigError(f"{name}: no such setting{_unknown(name, list(known))}; "
                              f"{ENV_PREFIX}* variables name configuration keys", name)
        out[known[name]] = _typed(known[name], value, name, from_text=True)
    return out


def load_config(path: str | None = None, flags: dict | None = None, environ=None,
                defaults: dict | None = None, defaults_source: str = "default"):
    """The effective configuration (resolved and validated) and where each value came from.

    Precedence: `defaults` (labelled `defaults_source`) over the built-in defaults,
    then the TOML file at `path`, then `environ` (os.environ when None), then `flags`.
    Sources are "default", `defaults_source`, the file's path, "EPD_<KEY>" or "--flag";
    run_dir and intake left empty are "derived from ...".
    """
    values: dict = {}
    sources = {key: "default" for key in FIELDS}
    layers = [(defaults or {}, lambda k: defaults_source)]
    if path:
        layers.append((read_toml(path), lambda k: path))
    layers.append((read_environ(os.environ if environ is None else environ), env_name))
    layers.append((flags or {}, flag_name))
    for layer, source in layers:
        for key, value in layer.items():
            values[key] = value
            sources[key] = source(key)
    given = WorkerConfig(**values)
    cfg = given.resolved()
    if not given.run_dir:
        sources["run_dir"] = "derived from shm_prefix"
    if not given.intake:
        sources["intake"] = "derived from run_dir"
    if not given.gpus:
        sources["gpus"] = "derived from gpu and tower_replicas"
    try:
        cfg.validate()
    except ConfigError as e:
        where = sources.get(e.key or "", "default")
        if where == "default" or where.startswith("derived"):
            raise
        raise ConfigError(f"{e} (set by {where})", e.key) from None
    return cfg, sources


def format_config(cfg: WorkerConfig, sources: dict, as_json: bool = False) -> str:
    """One key per line as TOML (`key = value  # source`, loadable with --config), or JSON."""
    values = dataclasses.asdict(cfg)
    if as_json:
        return json.dumps({k: {"value": v, "source": sources[k]} for k, v in values.items()}, indent=2)
    width = max(len(f"{k} = {json.dumps(v)}") for k, v in values.items())
    return "\n".join(f"{f'{k} = {json.dumps(v)}':<{width}}  # {sources[k]}" for k, v in values.items())


# ---------------------------------------------------------------- flags
def add_flags(parser: argparse.ArgumentParser) -> None:
    """`--config PATH` and one flag per setting: --max-tokens-per-batch for max_tokens_per_batch..."""
    parser.add_argument("--config", metavar="PATH",
                        help="a TOML file of settings (top-level keys named as below, with underscores)")
    group = parser.add_argument_group(
        "settings", f"each also {ENV_PREFIX}<KEY> in the environment (EPD_RING_BYTES); "
                    f"precedence: default < --config file < environment < flag")
    for f in dataclasses.fields(WorkerConfig):
        text = f.metadata["help"]
        if "(default:" not in text:
            text += f" (default: {f.default!r})"
        if f.type == "bool":
            group.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                               default=None, help=text)
        elif f.metadata.get("size"):
            group.add_argument(flag_name(f.name), dest=f.name, type=_size_flag, default=None,
                               metavar="SIZE", help=text)
        else:
            conv, metavar = {"int": (int, "N"), "float": (float, "X"), "str": (str, "TEXT")}[f.type]
            group.add_argument(flag_name(f.name), dest=f.name, type=conv, default=None,
                               metavar=metavar, help=text)


def _size_flag(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:  # argparse names the flag: "argument --ring-bytes: expected a size, ..."
        raise argparse.ArgumentTypeError(str(e)) from None


def flags_given(args: argparse.Namespace) -> dict:
    """The settings given as flags (those left out are None)."""
    return {key: getattr(args, key) for key in FIELDS if getattr(args, key, None) is not None}
