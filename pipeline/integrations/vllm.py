"""vLLM's encoder-cache (EC) connector for this worker: vLLM, as an EC consumer, takes
each image's (or video's) rows from an encode worker instead of running its own tower.

    python -m vllm.entrypoints.openai.api_server --model M --ec-transfer-config '{
      "ec_connector": "EPDConnector", "ec_connector_module_path": "pipeline.integrations.vllm",
      "ec_role": "ec_consumer",
      "ec_connector_extra_config": {"workers": ["tcp://10.0.0.5:17600"]}}'

A request names its room in `ec_transfer_params`, as `pipeline/integrations/proxy.py`
writes it: `{"room": R, "worker": BOOTSTRAP, "items": {identifier: item index}}`, the
identifier being the `uuid` vLLM gives the item. A request without them is encoded by
vLLM itself, as without the connector. This module and its scheduler side
(`vllm_scheduler.py`) are the only ones of the project that import vLLM.

Scheduler side (vLLM's engine core, `ConnectorScheduler`): allocs, the wait on
statuses, the release of the receive buffer. Worker side (the model runner,
`ConnectorWorker`): copies each item's rows out of the receive segment into vLLM's
encoder cache, `[main | deepstack]` side by side as Qwen3-VL expects.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ipc import shm, wire
from pipeline.integrations.vllm_scheduler import (  # noqa: F401 (EPDConnectorMetadata: the tests take it here)
    ConnectorScheduler, EPDConnectorMetadata, Load, Settings,
)
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole

log = logging.getLogger("epd.vllm")


def quiet_queue_readers(seconds: float) -> int:
    """Make every reader of vLLM's shared-memory message queues in this process spin
    `seconds` after each message it reads before it sleeps on the queue's notification
    socket; the number of readers set.

    vLLM's readers (the model runner on its step queue, the engine core on the model
    runner's replies) spin with sched_yield for a second after each read
    (`distributed/device_communicators/shm_broadcast.py`, SpinCondition). With the tower
    elsewhere, requests wait on their rooms while the worker's processes need the CPU:
    on a host of few cores the spinning takes its share of it from them. The writer
    notifies on every message, so a reader that sleeps wakes for the next one."""
    import gc

    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM: its readers as they are
        return 0
    # type(), not isinstance(): the latter asks some of the heap's objects (deprecated
    # torch aliases) for __class__, which warns
    readers = [o for o in gc.get_objects() if issubclass(type(o), SpinCondition) and o.is_reader]
    for reader in readers:
        reader.busy_loop_s = seconds
    return len(readers)


class ConnectorWorker:
    """The worker side (vLLM's model runner): rows copied from the receive segment into
    vLLM's encoder cache."""

    def __init__(self, model_dtype):
        self.model_dtype = model_dtype
        self.segments: dict[str, shm.Segment] = {}  # receive segments mapped

    def load(self, meta, encoder_cache) -> None:
        for load in getattr(meta, "loads", ()):
            if load.identifier not in encoder_cache:
                encoder_cache[load.identifier] = self._rows(load)

    def _rows(self, load: Load):
        import torch
        from vllm.platforms import current_platform

        seg = self.segments.get(load.segment)
        if seg is None:
            seg = self.segments[load.segment] = shm.Segment.attach(load.segment, readonly=True)
        isz = wire.DTYPES[load.dtype]
        tdtype = getattr(torch, load.dtype)

        def half(offset: int, width: int):
            raw = np.frombuffer(seg.buf, dtype=np.uint8, count=load.rows * width * isz, offset=offset)
            return torch.from_numpy(raw.copy()).view(tdtype).reshape(load.rows, width)

        rows = half(load.offset, load.hidden)
        if load.deepstack_width:
            rows = torch.cat([rows, half(load.ds_offset, load.deepstack_width)], dim=1)
        device = current_platform.device_type
        if current_platform.is_cuda_alike():
            device = f"{device}:{current_platform.current_device()}"
        return rows.to(device=device, dtype=self.model_dtype)

    def shutdown(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments = {}


class EPDConnector(ECConnectorBase):
    """vLLM's EC connector (consumer) over the encode worker's protocol: vLLM builds one
    per role, and each holds that role's side alone, as vLLM's own connectors do."""

    def __init__(self, vllm_config, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        if self.is_producer:
            raise ValueError("EPDConnector is a consumer: the encode worker produces; set ec_role "
                             "to ec_consumer")
        self.settings = Settings.of(vllm_config)
        # queue_spin_s is applied once the process's queues exist: at its first step here
        self.spin_set = self.settings.queue_spin_s is None
        self.connector_scheduler: ConnectorScheduler | None = None
        self.connector_worker: ConnectorWorker | None = None
        if role == ECConnectorRole.SCHEDULER:
            self.connector_scheduler = ConnectorScheduler(self.settings, vllm_config)
        else:
            self.connector_worker = ConnectorWorker(vllm_config.model_config.dtype)

    def _quiet(self) -> None:
        if not self.spin_set:
            self.spin_set = True
            n = quiet_queue_readers(self.settings.queue_spin_s)
            log.info("EPDConnector: %d message queue readers spin %.3f s after a read", n,
                     self.settings.queue_spin_s)

    # ------------------------------------------------------------ scheduler side
    def has_cache_item(self, identifier: str) -> bool:
        return self.connector_scheduler.has_cache_item(identifier)

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        return self.connector_scheduler.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request, index: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, index)

    def take_unavailable_requests(self) -> set[str]:
        return self.connector_scheduler.take_unavailable_requests()

    def build_connector_meta(self, scheduler_output) -> EPDConnectorMetadata:
        self._quiet()
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request)

    # ------------------------------------------------------------ worker side
    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        self._quiet()
        self.connector_worker.load(self._get_connector_metadata(), encoder_cache)

    def save_caches(self, encoder_cache, mm_hash, **kwargs) -> None:
        return None

    def shutdown(self) -> None:
        for side in (self.connector_scheduler, self.connector_worker):
            if side is not None:
                side.shutdown()
