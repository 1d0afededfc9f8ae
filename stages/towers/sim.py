"""The sim tower: no model, for benchmarks of the pipeline itself.

An asynchronous "device" that takes ``time_per_row_s`` per output row, one batch at
a time, and whose rows are a cheap deterministic function of the pixels
(``sim_rows``).
"""
from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

import numpy as np
import xxhash

from stages import progress
from stages.towers.base import (
    DTYPES, MODALITIES, Setting, TimedJob, Tower, TowerError, TowerJob, TowerSpec, numpy_dtype,
)

SIM_PATTERN_SEED = 0x5EED_7043
SIM_PERIOD = 1_000_003  # a prime: the start offsets into the pattern
SIM_WINDOW = 1 << 22  # elements an item can take without wrapping around the pattern
SIM_PATTERN_LEN = SIM_PERIOD + SIM_WINDOW
_SIM_MODALITY_SEED = {"image": 0, "video": 1}


@functools.lru_cache(maxsize=None)
def _sim_pattern(dtype: str) -> np.ndarray:
    vals = np.random.default_rng(SIM_PATTERN_SEED).standard_normal(SIM_PATTERN_LEN, dtype=np.float32)
    if dtype == "float32":
        out = vals
    elif dtype == "float16":
        out = vals.astype(np.float16)
    elif dtype == "bfloat16":
        out = (vals.view(np.uint32) >> 16).astype(np.uint16)
    else:
        numpy_dtype(dtype)
        raise AssertionError(dtype)
    out.flags.writeable = False
    return out


def _sim_offsets(pixels_bytes: Any, modality: str) -> tuple[int, int]:
    seed = xxhash.xxh3_64_intdigest(pixels_bytes, seed=_SIM_MODALITY_SEED[modality])
    return seed % SIM_PERIOD, (seed // SIM_PERIOD) % SIM_PERIOD


def _sim_fill(dst_flat: np.ndarray, pattern: np.ndarray, offset: int) -> None:
    """dst_flat[k] = pattern[(offset + k) % len(pattern)]: one memcpy unless it wraps."""
    n = dst_flat.size
    L = pattern.size
    done = 0
    pos = offset
    while done < n:
        take = min(n - done, L - pos)
        dst_flat[done:done + take] = pattern[pos:pos + take]
        done += take
        pos = 0


def sim_rows(spec: TowerSpec, pixels_bytes: Any, modality: str, span: int
             ) -> tuple[np.ndarray, np.ndarray | None]:
    """The rows the sim tower gives an item (a pure function; returns new arrays).

    Exactly::

        seed    = xxhash.xxh3_64_intdigest(pixels_bytes, seed={"image": 0, "video": 1}[modality])
        off     = seed % SIM_PERIOD                     # SIM_PERIOD = 1_000_003
        off_ds  = (seed // SIM_PERIOD) % SIM_PERIOD
        f32     = np.random.default_rng(SIM_PATTERN_SEED).standard_normal(
                      SIM_PATTERN_LEN, dtype=np.float32)  # SIM_PATTERN_SEED = 0x5EED7043,
                                                          # SIM_PATTERN_LEN = 1_000_003 + 2**22
        pattern = f32                                   if dtype == "float32"
                  f32.astype(np.float16)                if dtype == "float16"
                  (f32.view(np.uint32) >> 16).astype(np.uint16)   if dtype == "bfloat16"
                                                        # (bfloat16 bits by truncation)
        main.flat[k] = pattern[(off + k) % SIM_PATTERN_LEN]     for k < span * hidden
        deep.flat[k] = pattern[(off_ds + k) % SIM_PATTERN_LEN]  for k < span * deepstack_width

    ``main`` is ``[span, hidden]``, ``deep`` ``[span, deepstack_width]`` or ``None``
    when ``deepstack_width == 0``; ``pixels_bytes`` is the item's pixel buffer in C
    order (any bytes-like object). The grid enters only through ``span``.
    """
    if modality not in _SIM_MODALITY_SEED:
        raise ValueError(f"modality {modality!r} is not one of {MODALITIES}")
    pattern = _sim_pattern(spec.dtype)
    off, off_ds = _sim_offsets(pixels_bytes, modality)
    main = np.empty((span, spec.hidden), spec.np_dtype)
    _sim_fill(main.reshape(-1), pattern, off)
    deep = None
    if spec.deepstack_width:
        deep = np.empty((span, spec.deepstack_width), spec.np_dtype)
        _sim_fill(deep.reshape(-1), pattern, off_ds)
    return main, deep


class SimTower(Tower):
    """A simulated asynchronous device (think CUDA stream).

    ``start`` computes the rows on the caller's thread (a hash of the pixels and one
    memcpy per half per item, standing in for the host-to-device copy and launch)
    and returns at once; the job is done ``rows * time_per_row_s`` after the device
    becomes free. The device runs one batch at a time: a batch starts when the
    previous one ends (``device_free_at``). Waiting in ``result()`` sleeps.
    ``fail_next`` (a test hook): the next ``n`` started batches fail in ``result()``.

    Its keyword arguments are its settings' keys without the ``sim_`` prefix, and
    ``in_channels`` and ``name``.
    """

    settings = (
        Setting("sim_hidden", 3584, "sim tower: hidden size of an embedding row", minimum=1),
        Setting("sim_deepstack_width", 0, "sim tower: width of the deepstack rows (0: none)", minimum=0),
        Setting("sim_dtype", "bfloat16", "sim tower: float32, float16 or bfloat16", choices=DTYPES),
        Setting("sim_merge", 2, "sim tower: spatial merge factor (patches per row side)", minimum=1),
        Setting("sim_patch", 14, "sim tower: patch side in pixels", minimum=1),
        Setting("sim_temporal_patch", 2, "sim tower: frames per temporal patch", minimum=1),
        Setting("sim_time_per_row_s", 2e-6, "sim tower: simulated device time per output row, seconds",
                minimum=0),
        Setting("sim_fail_batches", 0, "fault injection: the sim tower fails its first N batches", minimum=0),
        Setting("sim_load_s", 0.0, "sim tower: seconds its start spends loading, reporting progress as a real "
                                   "tower's load does", minimum=0),
        Setting("sim_load_stall_file", "", "fault injection: while this file exists, the sim tower's load makes "
                                           "no progress (a load that hangs)"),
    )

    @classmethod
    def tower_kwargs(cls, values: dict[str, Any]) -> dict[str, Any]:
        return {key.removeprefix("sim_"): value for key, value in values.items()}

    def __init__(self, *, in_channels: int = 3, name: str = "sim", **settings: Any):
        defaults = self.tower_kwargs({setting.key: setting.default for setting in self.settings})
        unknown = settings.keys() - defaults.keys()
        if unknown:
            raise TypeError(f"SimTower: unknown settings {sorted(unknown)}")
        s = defaults | settings
        if s["time_per_row_s"] < 0:
            raise ValueError(f"time_per_row_s must be >= 0, got {s['time_per_row_s']}")
        patch, temporal_patch = int(s["patch"]), int(s["temporal_patch"])
        self.spec = TowerSpec(
            name=name, hidden=int(s["hidden"]), deepstack_width=int(s["deepstack_width"]), dtype=s["dtype"],
            merge=int(s["merge"]), patch_dim=int(in_channels) * temporal_patch * patch ** 2,
            temporal_patch=temporal_patch, patch=patch,
        )
        self.time_per_row_s = float(s["time_per_row_s"])
        self.device_free_at = 0.0  # time.monotonic() at which the device is idle
        self.fail_next = int(s["fail_batches"])
        self._lock = threading.Lock()
        self._pattern = _sim_pattern(s["dtype"])
        _simulate_load(float(s["load_s"]), s["load_stall_file"])

    def _start(self, items, outs, spans) -> TowerJob:
        for item, (main, deep), span in zip(items, outs, spans):
            off, off_ds = _sim_offsets(item.pixels.reshape(-1).view(np.uint8), item.modality)
            _sim_fill(main.reshape(-1), self._pattern, off)
            if deep is not None:
                _sim_fill(deep.reshape(-1), self._pattern, off_ds)
        busy = sum(spans) * self.time_per_row_s
        with self._lock:
            begin = max(time.monotonic(), self.device_free_at)
            self.device_free_at = begin + busy
            ready_at = self.device_free_at
            fail = self.fail_next > 0
            if fail:
                self.fail_next -= 1
        if fail:
            return _FailingTimedJob(ready_at, TowerError("sim: injected failure"))
        return TimedJob(ready_at)


def _simulate_load(load_s: float, stall_file: str) -> None:
    """A load of `load_s` seconds in steps, each reported as progress; while `stall_file`
    exists it waits and reports nothing, as a read from a hung filesystem would."""
    end = time.monotonic() + load_s
    while True:
        while stall_file and os.path.exists(stall_file):
            time.sleep(0.05)
        if time.monotonic() >= end:
            return
        time.sleep(min(0.1, max(0.0, end - time.monotonic())))
        progress.report()


class _FailingTimedJob(TimedJob):
    def __init__(self, ready_at: float, error: TowerError):
        super().__init__(ready_at)
        self._error = error

    def result(self, timeout: float | None = None) -> None:
        super().result(timeout)
        raise self._error

