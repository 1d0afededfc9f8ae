"""The worker's settings: one dataclass, validated at start, exposed as flags."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from ipc import shm


class ConfigError(ValueError):
    """A setting is invalid; the message names the setting."""


@dataclass
class WorkerConfig:
    shm_prefix: str = "epd"
    intake: str = ""            # default: ipc://<run dir>/intake.sock
    bootstrap: str = "tcp://127.0.0.1:17600"
    hostname: str = "127.0.0.1"  # the Mooncake engine's local address
    protocol: str = "tcp"        # Mooncake protocol: tcp, or rdma when configured
    device: str = ""             # RDMA device names, when protocol is rdma
    run_dir: str = ""            # default: /tmp/epd-<prefix>
    tower: str = "qwen2.5-vl"
    tower_config: str = "tiny"   # qwen towers: "tiny" or a checkpoint directory
    tower_dtype: str = ""        # qwen towers: float32 on CPU, bfloat16 on CUDA by default
    sim_hidden: int = 3584
    sim_deepstack_width: int = 0
    sim_dtype: str = "bfloat16"
    sim_merge: int = 2
    sim_patch: int = 14
    sim_temporal_patch: int = 2
    sim_time_per_row_s: float = 2e-6
    sim_fail_batches: int = 0  # fault injection: the sim tower fails its first N batches
    max_items_per_request: int = 64
    max_pixel_bytes_per_request: int = 256 << 20
    max_tokens_per_batch: int = 4096
    max_items_per_batch: int = 16
    pixel_arena_bytes: int = 512 << 20
    embedding_arena_bytes: int = 512 << 20
    arena_cache_bytes: int = 128 << 20   # the ship-ready tier, inside the embedding arena
    host_cache_bytes: int = 1 << 30      # the host-DRAM tier
    trust_client_hash: bool = False
    bootstrap_timeout_s: float = 120.0
    tombstone_ttl_s: float = 600.0
    max_tombstones: int = 65536
    max_live_rooms: int = 4096
    max_held_allocs: int = 65536
    write_timeout_s: float = 30.0
    status_hwm: int = 10000
    # the multi-process pipeline
    ring_bytes: int = 8 << 20
    heartbeat_timeout_s: float = 30.0
    restart_limit: int = 5          # more than this many restarts ...
    restart_window_s: float = 30.0  # ... within this window ends the run
    drain_timeout_s: float = 10.0
    start_timeout_s: float = 300.0
    # operations
    metrics_endpoint: str = ""      # host:port of the Prometheus endpoint the supervisor serves; "" for none
    numa: str = "auto"              # auto: the node nearest the tower's GPU (unpinned on one node); off;
                                    # a node number for every stage; or per stage: "tower=1,sender=1,*=0"
    gpu: int = 0                    # the CUDA device the tower uses (qwen towers on a CUDA machine)

    def resolved(self) -> "WorkerConfig":
        c = dataclasses.replace(self)
        if not c.run_dir:
            c.run_dir = f"/tmp/epd-{c.shm_prefix}"
        if not c.intake:
            c.intake = f"ipc://{c.run_dir}/intake.sock"
        return c

    def validate(self) -> "WorkerConfig":
        try:
            shm.check_prefix(self.shm_prefix)
        except ValueError as e:
            raise ConfigError(f"shm_prefix: {e}") from None
        positive = [
            "max_items_per_request", "max_pixel_bytes_per_request", "max_tokens_per_batch",
            "max_items_per_batch", "pixel_arena_bytes", "embedding_arena_bytes",
            "max_tombstones", "max_live_rooms", "max_held_allocs", "sim_hidden", "sim_merge",
            "sim_patch", "sim_temporal_patch", "status_hwm", "ring_bytes", "restart_limit",
        ]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ["bootstrap_timeout_s", "tombstone_ttl_s", "write_timeout_s", "heartbeat_timeout_s",
                     "restart_window_s", "start_timeout_s"]:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ["arena_cache_bytes", "host_cache_bytes", "sim_deepstack_width", "sim_time_per_row_s",
                     "drain_timeout_s", "sim_fail_batches"]:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.arena_cache_bytes > self.embedding_arena_bytes // 2:
            raise ConfigError(
                f"arena_cache_bytes ({self.arena_cache_bytes}) must leave at least half of "
                f"embedding_arena_bytes ({self.embedding_arena_bytes}) for embeddings in flight"
            )
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.sim_dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"sim_dtype must be float32, float16 or bfloat16, got {self.sim_dtype!r}")
        if self.tower_dtype not in ("", "float32", "float16", "bfloat16"):
            raise ConfigError(f"tower_dtype must be float32, float16 or bfloat16, got {self.tower_dtype!r}")
        if self.tower not in ("sim", "qwen2.5-vl", "qwen3-vl"):
            raise ConfigError(f"tower must be sim, qwen2.5-vl or qwen3-vl, got {self.tower!r}")
        for name in ["intake", "bootstrap"]:
            ep = getattr(self, name)
            if ep and not ep.startswith(("ipc://", "tcp://")):
                raise ConfigError(f"{name} must be an ipc:// or tcp:// endpoint, got {ep!r}")
        if not self.bootstrap.startswith("tcp://"):
            raise ConfigError(f"bootstrap must be a tcp:// endpoint, got {self.bootstrap!r}")
        return self

    def tower_settings(self) -> dict:
        if self.tower == "sim":
            return dict(
                hidden=self.sim_hidden, deepstack_width=self.sim_deepstack_width,
                dtype=self.sim_dtype, merge=self.sim_merge, patch=self.sim_patch,
                temporal_patch=self.sim_temporal_patch, time_per_row_s=self.sim_time_per_row_s,
                fail_batches=self.sim_fail_batches,
            )
        settings = {}
        if os.path.isdir(self.tower_config):
            settings["checkpoint"] = self.tower_config
        else:
            settings["config"] = self.tower_config
        if self.tower_dtype:
            settings["dtype"] = self.tower_dtype
        return settings


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting: --max-tokens-per-batch for max_tokens_per_batch, and so on."""
    for f in dataclasses.fields(WorkerConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            conv = {"int": int, "float": float, "str": str}[f.type]
            parser.add_argument(flag, dest=f.name, type=conv, default=None,
                                help=f"(default: {f.default!r})")


def from_args(args: argparse.Namespace, **overrides) -> WorkerConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(WorkerConfig)
              if getattr(args, f.name, None) is not None}
    values.update(overrides)
    return WorkerConfig(**values).resolved().validate()
