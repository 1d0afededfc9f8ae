"""The worker's configuration mapped onto each stage's own settings (stages/settings.py).

The one place that knows both sides: a stage reads only its settings type, the
command line only WorkerConfig. A setting a stage comes to need is a field of its
type and a line in its function here.
"""
from __future__ import annotations

from pipeline.cli.config import WorkerConfig
from stages import registry
from stages.settings import (CacheSettings, IntakeSettings, PreprocessSettings, ReaperSettings,
                             SchedulerSettings, SenderSettings)
from stages.store_tier import StoreSettings


def intake_settings(cfg: WorkerConfig) -> IntakeSettings:
    return IntakeSettings(endpoint=cfg.intake, shm_prefix=cfg.shm_prefix, cache_key_file=cfg.cache_key_file,
                          max_items_per_request=cfg.max_items_per_request,
                          max_pixel_bytes_per_request=cfg.max_pixel_bytes_per_request,
                          max_live_rooms=cfg.max_live_rooms, trust_client_hash=cfg.trust_client_hash,
                          image_min_pixels=cfg.image_min_pixels, image_max_pixels=cfg.image_max_pixels,
                          image_backend=cfg.image_backend, media_url_hosts=cfg.media_url_hosts, tower=cfg.tower,
                          video_min_pixels=cfg.video_min_pixels, video_max_pixels=cfg.video_max_pixels,
                          video_fps=cfg.video_fps)


def store_settings(cfg: WorkerConfig) -> StoreSettings | None:
    if not cfg.store_master:
        return None
    return StoreSettings(cfg.store_master, cfg.store_metadata, cfg.store_segment_bytes, cfg.store_buffer_bytes,
                         cfg.protocol, cfg.device, cfg.hostname, cfg.store_get_timeout_s)


def cache_settings(cfg: WorkerConfig) -> CacheSettings:
    return CacheSettings(shm_prefix=cfg.shm_prefix, cache_key_file=cfg.cache_key_file,
                         arena_cache_bytes=cfg.arena_cache_bytes, host_cache_bytes=cfg.host_cache_bytes,
                         trust_client_hash=cfg.trust_client_hash, preprocess_workers=cfg.preprocess_workers,
                         tower=cfg.tower, tower_config=cfg.tower_config, run_dir=cfg.run_dir,
                         store=store_settings(cfg))


def preprocess_settings(cfg: WorkerConfig) -> PreprocessSettings:
    return PreprocessSettings(tower=cfg.tower, tower_config=cfg.tower_config,
                              image_min_pixels=cfg.image_min_pixels, image_max_pixels=cfg.image_max_pixels,
                              max_decoded_pixels=cfg.max_decoded_pixels, image_backend=cfg.image_backend,
                              shm_prefix=cfg.shm_prefix, cache_key_file=cfg.cache_key_file,
                              media_url_hosts=cfg.media_url_hosts, media_url_max_bytes=cfg.media_url_max_bytes,
                              media_url_timeout_s=cfg.media_url_timeout_s, video_min_pixels=cfg.video_min_pixels,
                              video_max_pixels=cfg.video_max_pixels, video_fps=cfg.video_fps,
                              max_video_decoded_pixels=cfg.max_video_decoded_pixels)


def scheduler_settings(cfg: WorkerConfig) -> SchedulerSettings:
    return SchedulerSettings(max_tokens_per_batch=cfg.max_tokens_per_batch,
                             max_items_per_batch=cfg.max_items_per_batch, tower_replicas=cfg.tower_replicas)


def sender_settings(cfg: WorkerConfig) -> SenderSettings:
    return SenderSettings(endpoint=cfg.bootstrap, bootstrap_timeout_s=cfg.bootstrap_timeout_s,
                          max_held_allocs=cfg.max_held_allocs, registration_idle_s=cfg.registration_idle_s,
                          max_receivers_per_key=cfg.max_receivers_per_key,
                          own_endpoints=tuple(cfg.own_endpoints()),
                          status_ipc_dirs=tuple(cfg.status_ipc_dirs.split(",")))


def reaper_settings(cfg: WorkerConfig) -> ReaperSettings:
    return ReaperSettings(status_hwm=cfg.status_hwm, max_status_sockets=cfg.max_status_sockets,
                          status_socket_idle_s=cfg.status_socket_idle_s, tombstone_ttl_s=cfg.tombstone_ttl_s,
                          max_tombstones=cfg.max_tombstones, bootstrap_timeout_s=cfg.bootstrap_timeout_s,
                          heartbeat_timeout_s=cfg.heartbeat_timeout_s, max_deadline_s=cfg.max_deadline_s)


# By stage kind (stages/registry.py). The tower stage has none of its own: the runtime
# builds its tower (loop.py's Env.tower).
MAPPINGS = {registry.INTAKE: intake_settings, registry.CACHE: cache_settings,
            registry.PREPROCESS: preprocess_settings, registry.SCHEDULER: scheduler_settings,
            registry.SENDER: sender_settings, registry.REAPER: reaper_settings,
            registry.TOWER: lambda cfg: None}


def settings_of(name: str, cfg: WorkerConfig):
    """The settings stage `name` (any replica or worker of its kind) is built with."""
    return MAPPINGS[registry.kind_of(name)](cfg)
