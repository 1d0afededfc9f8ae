"""The sim tower: no model, for benchmarks of the pipeline itself.

An asynchronous "device" that takes ``time_per_row_s`` per output row, one batch at
a time, and whose rows are a cheap deterministic function of the pixels
(``sim_rows``).

Configured like a real tower, by its checkpoint (``tower_config``): with
``--tower sim``, ``tower_config`` names a TOML file (JSON where it ends ``.json``)
of the settings in ``SIM_SETTINGS``, and a ``[faults]`` table of those in
``SIM_FAULTS``, the fault injection the tests use; ``tiny`` (the default) or ''
names none: every setting at its default. They are no flags of the worker's.
"""
from __future__ import annotations

import functools
import json
import os
import threading
import time
import tomllib
from typing import Any

import numpy as np
import xxhash

from stages import progress
from stages.towers.base import (
    DTYPES, MODALITIES, TOWER_CONFIG, SettingError, TimedJob, Tower, TowerError, TowerJob, TowerSpec, numpy_dtype,
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


# The sim tower's settings: (default, what it means), in its settings file (module docstring).
SIM_SETTINGS: dict[str, tuple[Any, str]] = {
    "hidden": (3584, "hidden size of an embedding row"),
    "deepstack_width": (0, "width of the deepstack rows (0: none)"),
    "dtype": ("bfloat16", "float32, float16 or bfloat16"),
    "merge": (2, "spatial merge factor (patches per row side)"),
    "patch": (14, "patch side in pixels"),
    "temporal_patch": (2, "frames per temporal patch"),
    "time_per_row_s": (2e-6, "simulated device time per output row, seconds"),
}
# Fault injection, for the tests: its settings file's [faults] table.
SIM_FAULTS: dict[str, tuple[Any, str]] = {
    "fail_batches": (0, "the tower fails its first N batches"),
    "load_s": (0.0, "seconds its start spends loading, reporting progress as a real tower's load does"),
    "load_stall_file": ("", "while this file exists, the load makes no progress (a load that hangs)"),
}
_SIM_MINIMUM = {"hidden": 1, "deepstack_width": 0, "merge": 1, "patch": 1, "temporal_patch": 1,
                "time_per_row_s": 0, "fail_batches": 0, "load_s": 0}


def read_sim_file(path: str) -> dict[str, Any]:
    """The sim tower's keyword arguments from its settings file; SettingError (key
    ``tower_config``) naming the file and the setting for anything it cannot take."""
    def bad(what: str) -> SettingError:
        return SettingError(f"tower_config {path!r} (the sim tower's settings): {what}", "tower_config")

    try:
        with open(path, "rb") as f:
            data = json.load(f) if path.endswith(".json") else tomllib.load(f)
    except OSError as e:
        raise bad(f"cannot read it: {e.strerror}") from None
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise bad(f"not valid {'JSON' if path.endswith('.json') else 'TOML'}: {e}") from None
    faults = data.pop("faults", {}) if isinstance(data, dict) else None
    if not isinstance(faults, dict):
        raise bad("expected a table of settings and a [faults] table")
    out = {}
    for table, known in ((data, SIM_SETTINGS), (faults, SIM_FAULTS)):
        for key, value in table.items():
            if key not in known:
                raise bad(f"unknown setting {key!r}; known: {', '.join(known)}"
                          + ("" if known is SIM_FAULTS else ", and the [faults] table"))
            out[key] = _sim_value(key, value, known[key][0], bad)
    return out


def _sim_value(key: str, value: Any, default: Any, bad) -> Any:
    kind = type(default)
    ok = isinstance(value, kind) and not isinstance(value, bool) or (
        kind is float and isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise bad(f"{key} must be {kind.__name__}, got {value!r}")
    if key in _SIM_MINIMUM and value < _SIM_MINIMUM[key]:
        raise bad(f"{key} must be >= {_SIM_MINIMUM[key]}, got {value!r}")
    if key == "dtype" and value not in DTYPES:
        raise bad(f"dtype must be one of {', '.join(DTYPES)}, got {value!r}")
    return float(value) if kind is float else value


class SimTower(Tower):
    """A simulated asynchronous device (think CUDA stream).

    ``start`` computes the rows on the caller's thread (a hash of the pixels and one
    memcpy per half per item, standing in for the host-to-device copy and launch)
    and returns at once; the job is done ``rows * time_per_row_s`` after the device
    becomes free. The device runs one batch at a time: a batch starts when the
    previous one ends (``device_free_at``). Waiting in ``result()`` sleeps.
    ``fail_next`` (a test hook): the next ``n`` started batches fail in ``result()``.

    Its keyword arguments are the keys of SIM_SETTINGS and SIM_FAULTS, and
    ``in_channels`` and ``name``.
    """

    settings = (TOWER_CONFIG,)

    @classmethod
    def tower_kwargs(cls, values: dict[str, Any]) -> dict[str, Any]:
        path = values["tower_config"]
        return {} if path in ("", "tiny") else read_sim_file(path)

    def __init__(self, *, in_channels: int = 3, name: str = "sim", **settings: Any):
        defaults = {key: default for key, (default, _) in (SIM_SETTINGS | SIM_FAULTS).items()}
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

