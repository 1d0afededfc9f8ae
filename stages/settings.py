"""What each stage needs of the worker's configuration: one small frozen type per stage.

A stage's `build(env, settings, name, emit, custody)` takes its own type from here
and reads nothing else of the configuration, so a stage is built and tested without
the command line's settings (pipeline/cli/config.py). The runtime maps the worker's
configuration onto these types in one place (pipeline/runtime/stage_settings.py); a
new setting a stage needs is a field here and a line there.

The tower stage has none: the runtime builds its tower (pipeline/runtime/loop.py's
Env.tower) from the tower's own settings (stages/towers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the store tier's modules load only where a cache stage is built
    from stages.store_tier import StoreSettings


@dataclass(frozen=True)
class IntakeSettings:
    endpoint: str  # the PULL socket encode requests arrive on
    shm_prefix: str  # of the worker's objects and of the client segments it takes
    cache_key_file: str  # '' for the run's own key
    max_items_per_request: int
    max_pixel_bytes_per_request: int
    max_live_rooms: int
    trust_client_hash: bool
    image_min_pixels: int
    image_max_pixels: int
    image_backend: str
    media_url_hosts: str  # the http(s) hosts a media.url may name ('' for none: URLs refused)
    tower: str  # whose video processor's resize bounds apply where video_*_pixels are 0
    video_min_pixels: int
    video_max_pixels: int
    video_fps: float


@dataclass(frozen=True)
class CacheSettings:
    shm_prefix: str
    cache_key_file: str
    arena_cache_bytes: int
    host_cache_bytes: int
    trust_client_hash: bool
    preprocess_workers: int
    tower: str  # the tower's name and checkpoint: part of the store's entry names
    tower_config: str
    run_dir: str  # where the checkpoint's digests are kept
    store: StoreSettings | None  # None: no shared store tier


@dataclass(frozen=True)
class PreprocessSettings:
    tower: str  # the family whose processor's mean and std apply
    tower_config: str  # a checkpoint directory whose processor configuration is read, if any
    image_min_pixels: int
    image_max_pixels: int
    max_decoded_pixels: int
    image_backend: str
    shm_prefix: str  # with cache_key_file, the run's cache key: a fetched image's bytes are hashed here
    cache_key_file: str
    media_url_hosts: str
    media_url_max_bytes: int
    media_url_timeout_s: float
    video_min_pixels: int
    video_max_pixels: int
    video_fps: float
    max_video_decoded_pixels: int


@dataclass(frozen=True)
class SchedulerSettings:
    max_tokens_per_batch: int
    max_items_per_batch: int
    tower_replicas: int


@dataclass(frozen=True)
class SenderSettings:
    endpoint: str  # the bootstrap PULL socket receivers send register, alloc and cancel to
    bootstrap_timeout_s: float
    max_held_allocs: int
    registration_idle_s: float
    max_receivers_per_key: int
    own_endpoints: tuple[str, ...]  # every listener of the worker: no status endpoint may name one
    status_ipc_dirs: tuple[str, ...]


@dataclass(frozen=True)
class ReaperSettings:
    status_hwm: int
    max_status_sockets: int
    status_socket_idle_s: float
    tombstone_ttl_s: float
    max_tombstones: int
    bootstrap_timeout_s: float
    heartbeat_timeout_s: float
    max_deadline_s: float
