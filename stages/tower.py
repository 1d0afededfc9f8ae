"""Pluggable vision towers: pixels of a batch of items -> (main, deepstack) embedding rows.

A tower knows how many rows an item's embedding has (``span``, from its ``grid_thw``)
and runs a batch of items as one job that writes each item's rows into buffers the
caller hands it (numpy views, usually into shared memory):

    tower = build_tower("qwen3-vl", config="tiny")
    job = tower.start(items, outs)       # outs[i] = (main [span, hidden], deepstack or None)
    ...                                  # the caller may do other work meanwhile
    job.result()                         # raises TowerError if the batch failed

``outs`` are undefined until ``result()`` has returned without raising: an async
tower may finish its copies inside ``result()``. A failure concerns the whole batch
(the caller fails exactly that batch's rooms). Errors can surface in two places:
``start`` raises for what it finds at launch (malformed items or outs, and on the
synchronous CPU path a forward that raises or returns the wrong row count), and
``result`` raises for what is found at completion. Both raise ``TowerError``;
malformed input raises ``TowerInputError``, which is both a ``TowerError`` and a
``ValueError``.

Towers (``build_tower(name, **settings)``):

* ``"sim"`` -- no model: an asynchronous "device" that takes ``time_per_row_s`` per
  output row, one batch at a time, and whose rows are a cheap deterministic function
  of the pixels (``sim_rows``). For benchmarks of the pipeline itself.
* ``"qwen2.5-vl"`` -- ``Qwen2_5_VisionTransformerPretrainedModel`` from transformers.
* ``"qwen3-vl"`` -- ``Qwen3VLVisionModel`` from transformers, with deepstack rows.

Dtypes are named ``"float32"``, ``"float16"``, ``"bfloat16"``. numpy has no
bfloat16, so bfloat16 arrays (pixels and outs) are ``np.uint16`` arrays holding the
raw bfloat16 bits (``torch.from_numpy(a).view(torch.bfloat16)`` reads them).
"""
from __future__ import annotations

import functools
import json
import logging
import operator
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from stages.base import Stage

import numpy as np
import xxhash

from ipc.stats import Histogram

__all__ = [
    "DTYPES",
    "SIM_PATTERN_LEN",
    "SIM_PATTERN_SEED",
    "SIM_PERIOD",
    "SIM_WINDOW",
    "Tower",
    "TowerError",
    "TowerInputError",
    "TowerItem",
    "TowerJob",
    "TowerSpec",
    "build_tower",
    "numpy_dtype",
    "sim_rows",
]

log = logging.getLogger("epd.tower")

DTYPES = ("float32", "float16", "bfloat16")
_NP_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
              "bfloat16": np.dtype(np.uint16)}
_PIXEL_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                      np.dtype(np.uint16): "bfloat16"}
MODALITIES = ("image", "video")


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype that holds arrays of the named dtype (``uint16`` for bfloat16)."""
    try:
        return _NP_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}") from None


# ----------------------------------------------------------------------------- API


@dataclass(frozen=True)
class TowerSpec:
    """What a tower produces and expects.

    hidden: columns of the main half. deepstack_width: columns of the deepstack half
    (0 when the model has none). dtype: of the output rows. merge: spatial merge size
    (an item has ``sum(t*h*w) // merge**2`` rows). patch_dim: columns of the pixel
    input (``in_channels * temporal_patch * patch**2``).
    """

    name: str
    hidden: int
    deepstack_width: int
    dtype: str
    merge: int
    patch_dim: int
    temporal_patch: int
    patch: int

    def __post_init__(self) -> None:
        numpy_dtype(self.dtype)
        for field in ("hidden", "merge", "patch_dim", "temporal_patch", "patch"):
            if getattr(self, field) < 1:
                raise ValueError(f"TowerSpec.{field} must be >= 1, got {getattr(self, field)}")
        if self.deepstack_width < 0:
            raise ValueError(f"TowerSpec.deepstack_width must be >= 0, got {self.deepstack_width}")

    @property
    def np_dtype(self) -> np.dtype:
        return numpy_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one row, main and deepstack halves together."""
        return (self.hidden + self.deepstack_width) * self.itemsize


class TowerError(RuntimeError):
    """A batch failed in the tower; every item of that batch failed with it."""


class TowerInputError(TowerError, ValueError):
    """An item or out buffer handed to ``start`` is malformed (nothing was run)."""


@dataclass
class TowerItem:
    """One vision item of a batch.

    modality: ``"image"`` or ``"video"``.
    grid_thw: the item's patch grids ``[(t, h, w), ...]`` before merging.
    pixels: ``[n_patches, patch_dim]`` C-contiguous, ``n_patches = sum(t*h*w)``;
        dtype ``np.float32``, ``np.float16``, or ``np.uint16`` for **bfloat16**
        (numpy has no bfloat16: pass the raw bfloat16 bits as a uint16 view; the
        tower reinterprets them with ``torch.from_numpy(p).view(torch.bfloat16)``).
        The pixel dtype is the request's and need not equal the tower's dtype.
    """

    modality: str
    grid_thw: list[tuple[int, int, int]]
    pixels: np.ndarray

    @property
    def pixel_dtype(self) -> str:
        """The dtype name of ``pixels`` (``"bfloat16"`` for a uint16 array)."""
        try:
            return _PIXEL_DTYPE_NAMES[np.dtype(self.pixels.dtype)]
        except KeyError:
            raise TowerInputError(
                f"pixels dtype {self.pixels.dtype} is not float32, float16 or uint16 (bfloat16 bits)"
            ) from None


class TowerJob:
    """One batch in flight. ``result()`` waits for it, raising ``TowerError`` on failure
    (and ``TimeoutError`` if ``timeout`` seconds pass first; the job keeps running)."""

    def done(self) -> bool:
        raise NotImplementedError

    def result(self, timeout: float | None = None) -> None:
        raise NotImplementedError


class _DoneJob(TowerJob):
    """A job that finished (or failed) inside ``start``."""

    def __init__(self, error: BaseException | None = None):
        self._error = error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> None:
        if self._error is not None:
            raise self._error


class _TimedJob(TowerJob):
    """Done at ``ready_at`` (time.monotonic); waiting sleeps, using no CPU."""

    def __init__(self, ready_at: float):
        self.ready_at = ready_at

    def done(self) -> bool:
        return time.monotonic() >= self.ready_at

    def result(self, timeout: float | None = None) -> None:
        remaining = self.ready_at - time.monotonic()
        if remaining <= 0:
            return
        if timeout is not None and remaining > timeout:
            time.sleep(max(timeout, 0.0))
            raise TimeoutError(f"tower job not done within {timeout} s")
        time.sleep(remaining)
        # sleep may wake a hair early on some clocks; finish the wait exactly.
        while time.monotonic() < self.ready_at:
            time.sleep(max(self.ready_at - time.monotonic(), 0.0))


def _as_int(v: Any, what: str) -> int:
    if isinstance(v, bool):
        raise ValueError(f"{what} must be an integer, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {v!r}") from None


def _grids(grid_thw: Any) -> list[tuple[int, int, int]]:
    """``grid_thw`` as a list of int triples; a single flat ``(t, h, w)`` is accepted too."""
    try:
        seq = list(grid_thw)
    except TypeError:
        raise ValueError(f"grid_thw must be a list of [t, h, w], got {grid_thw!r}") from None
    if len(seq) == 3 and all(not isinstance(v, (list, tuple, np.ndarray)) for v in seq):
        seq = [seq]
    if not seq:
        raise ValueError("grid_thw is empty")
    out = []
    for g in seq:
        try:
            g = list(g)
        except TypeError:
            raise ValueError(f"grid_thw entry {g!r} is not a [t, h, w] triple") from None
        if len(g) != 3:
            raise ValueError(f"grid_thw entry {g!r} is not a [t, h, w] triple")
        t, h, w = (_as_int(v, "grid_thw value") for v in g)
        if t < 1 or h < 1 or w < 1:
            raise ValueError(f"grid_thw entry {(t, h, w)} has a value < 1")
        out.append((t, h, w))
    return out


class Tower:
    """Base class. Subclasses set ``spec`` and implement ``_start``."""

    spec: TowerSpec

    def span(self, grid_thw: Sequence[Sequence[int]]) -> int:
        """Rows of an item's embedding: ``sum(t*h*w) // merge**2``.

        ``ValueError`` if the grid is empty, has a value < 1 or a non-integer, or
        an ``h`` or ``w`` not divisible by the merge size.
        """
        m = self.spec.merge
        total = 0
        for t, h, w in _grids(grid_thw):
            if h % m or w % m:
                raise ValueError(
                    f"grid_thw entry {(t, h, w)}: h and w must be divisible by the merge size {m}"
                )
            total += t * h * w
        return total // (m * m)

    def n_patches(self, grid_thw: Sequence[Sequence[int]]) -> int:
        """Pixel rows of an item: ``sum(t*h*w)``."""
        return sum(t * h * w for t, h, w in _grids(grid_thw))

    def start(
        self,
        items: list[TowerItem],
        outs: list[tuple[np.ndarray, np.ndarray | None]],
    ) -> TowerJob:
        """Run ``items`` as one batch, writing item i's rows into ``outs[i]``.

        ``outs[i] = (main, deepstack)``: ``main`` is ``[span_i, hidden]`` and
        ``deepstack`` ``[span_i, deepstack_width]`` (``None`` when the tower has no
        deepstack), both C-contiguous, writable, of ``numpy_dtype(spec.dtype)``.
        Images and videos go through the model separately but in this one job.
        Raises ``TowerInputError`` for malformed items/outs before running anything,
        ``TowerError`` when the batch fails at launch; the job's ``result()`` raises
        ``TowerError`` when it fails later.
        """
        spans = self._check(items, outs)
        return self._start(items, outs, spans)

    def _start(self, items, outs, spans) -> TowerJob:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the tower holds (models, device memory)."""

    # -- validation

    def _check(self, items, outs) -> list[int]:
        spec = self.spec
        if len(items) != len(outs):
            raise TowerInputError(f"{len(items)} items but {len(outs)} outs")
        if not items:
            raise TowerInputError("empty batch")
        spans = []
        for i, (item, out) in enumerate(zip(items, outs)):
            if item.modality not in MODALITIES:
                raise TowerInputError(f"item {i}: modality {item.modality!r} is not one of {MODALITIES}")
            try:
                span = self.span(item.grid_thw)
                n_patches = self.n_patches(item.grid_thw)
            except ValueError as e:
                raise TowerInputError(f"item {i}: {e}") from None
            px = item.pixels
            if not isinstance(px, np.ndarray):
                raise TowerInputError(f"item {i}: pixels must be a numpy array, got {type(px).__name__}")
            item.pixel_dtype  # raises TowerInputError for an unknown dtype
            if px.shape != (n_patches, spec.patch_dim):
                raise TowerInputError(
                    f"item {i}: pixels shape {tuple(px.shape)} != ({n_patches}, {spec.patch_dim}) "
                    f"for grid_thw {item.grid_thw}"
                )
            if not px.flags.c_contiguous:
                raise TowerInputError(f"item {i}: pixels must be C-contiguous")
            try:
                main, deep = out
            except (TypeError, ValueError):
                raise TowerInputError(f"outs[{i}] must be a (main, deepstack) pair") from None
            self._check_out(i, "main", main, (span, spec.hidden))
            if spec.deepstack_width:
                self._check_out(i, "deepstack", deep, (span, spec.deepstack_width))
            elif deep is not None:
                raise TowerInputError(f"outs[{i}]: tower {spec.name!r} has no deepstack; pass None")
            spans.append(span)
        return spans

    def _check_out(self, i: int, half: str, a: Any, shape: tuple[int, int]) -> None:
        if not isinstance(a, np.ndarray):
            raise TowerInputError(f"outs[{i}] {half}: expected a numpy array, got {type(a).__name__}")
        if a.shape != shape or a.dtype != self.spec.np_dtype:
            raise TowerInputError(
                f"outs[{i}] {half}: shape {tuple(a.shape)} dtype {a.dtype}, expected {shape} "
                f"{self.spec.np_dtype} ({self.spec.dtype})"
            )
        if not a.flags.c_contiguous or not a.flags.writeable:
            raise TowerInputError(f"outs[{i}] {half}: must be C-contiguous and writable")


# ----------------------------------------------------------------------------- sim

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
    """

    def __init__(self, *, hidden: int = 3584, deepstack_width: int = 0, dtype: str = "bfloat16",
                 merge: int = 2, patch: int = 14, temporal_patch: int = 2, in_channels: int = 3,
                 time_per_row_s: float = 2e-6, name: str = "sim", fail_batches: int = 0):
        if time_per_row_s < 0:
            raise ValueError(f"time_per_row_s must be >= 0, got {time_per_row_s}")
        self.spec = TowerSpec(
            name=name, hidden=int(hidden), deepstack_width=int(deepstack_width), dtype=dtype,
            merge=int(merge), patch_dim=int(in_channels) * int(temporal_patch) * int(patch) ** 2,
            temporal_patch=int(temporal_patch), patch=int(patch),
        )
        self.time_per_row_s = float(time_per_row_s)
        self.device_free_at = 0.0  # time.monotonic() at which the device is idle
        self.fail_next = int(fail_batches)
        self._lock = threading.Lock()
        self._pattern = _sim_pattern(dtype)

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
        return _TimedJob(ready_at)


class _FailingTimedJob(_TimedJob):
    def __init__(self, ready_at: float, error: TowerError):
        super().__init__(ready_at)
        self._error = error

    def result(self, timeout: float | None = None) -> None:
        super().result(timeout)
        raise self._error


# ----------------------------------------------------------------------------- torch towers

_TINY_QWEN25 = dict(
    depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
    in_channels=3, patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
    # windows of 2x2 merged tokens, so that small test grids still have several
    # windows; layer 0 windowed, layer 1 full attention.
    window_size=56, fullatt_block_indexes=[1],
)
_TINY_QWEN3 = dict(
    depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
    in_channels=3, patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
    num_position_embeddings=64, deepstack_visual_indexes=[0, 1],
)

# Key prefixes of the vision tower in HF checkpoints: Qwen2.5-VL checkpoints as
# published use "visual."; transformers >= 4.52 saves "model.visual.".
_VISUAL_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")


def _torch_dtype(name: str):
    import torch

    numpy_dtype(name)
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def _to_torch(a: np.ndarray):
    """A numpy array as a torch tensor sharing its memory (uint16 -> bfloat16 view)."""
    import torch

    t = torch.from_numpy(a)
    if a.dtype == np.uint16:
        t = t.view(torch.bfloat16)
    return t


def _load_visual_state_dict(path: str) -> dict:
    """The vision tower's tensors of a local HF checkpoint directory, prefix stripped."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({v for k, v in weight_map.items() if k.startswith(_VISUAL_PREFIXES)})
    if not files:
        raise TowerError(f"no vision-tower safetensors found in checkpoint {path!r}")
    state: dict = {}
    for fname in files:
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            for key in f.keys():
                for prefix in _VISUAL_PREFIXES:
                    if key.startswith(prefix):
                        state[key[len(prefix):]] = f.get_tensor(key)
                        break
    if not state:
        raise TowerError(
            f"checkpoint {path!r} holds no keys under any of the prefixes {_VISUAL_PREFIXES}"
        )
    return state


class _TorchJob(TowerJob):
    """A CUDA batch: rows are copied to pinned host memory without blocking; ``result``
    waits on the event, then copies each item's rows into its outs (one memcpy each)."""

    def __init__(self, event, finish: Callable[[], None]):
        self._event = event
        self._finish = finish
        self._finished = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        try:
            return self._finished or bool(self._event.query())
        except Exception:
            return True  # a sticky CUDA error: result() reports it

    def result(self, timeout: float | None = None) -> None:
        if timeout is not None:
            deadline = time.monotonic() + timeout
            while not self.done():
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"tower job not done within {timeout} s")
                time.sleep(0.0005)
        with self._lock:
            if not self._finished:
                try:
                    self._event.synchronize()
                    self._finish()
                except TowerError as e:
                    self._error = e
                except Exception as e:
                    self._error = TowerError(f"tower batch failed on the device: {e!r}")
                    self._error.__cause__ = e
                self._finished = True
        if self._error is not None:
            raise self._error


class _QwenTower(Tower):
    """A transformers vision tower. ``self.model`` is the HF module itself."""

    kind: str  # "qwen2.5-vl" | "qwen3-vl"

    def __init__(self, *, config: Any = None, checkpoint: str | None = None,
                 dtype: str | None = None, device: str | None = None, gpu: int = 0, seed: int = 0,
                 attn_implementation: str | None = None):
        import torch

        if (config is None) == (checkpoint is None):
            raise ValueError(f"{self.kind}: give exactly one of config='tiny' (or a dict) or checkpoint=PATH")
        self.device = torch.device(device or (f"cuda:{gpu}" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is not None:
            # events, synchronize() and cudaHostRegister act on the current device
            torch.cuda.set_device(self.device)
        if dtype is None:
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        tdtype = _torch_dtype(dtype)
        if checkpoint is not None:
            vcfg = self._checkpoint_config(checkpoint)
        else:
            vcfg = self._config_class()(**self._config_dict(config))
        if attn_implementation is not None:
            vcfg._attn_implementation = attn_implementation
        model_cls = self._model_class()
        if checkpoint is not None:
            state = _load_visual_state_dict(checkpoint)
            try:
                from transformers.initialization import no_init_weights
            except ImportError:  # pragma: no cover - older transformers
                from contextlib import nullcontext as no_init_weights
            with no_init_weights():
                model = model_cls(vcfg)
            missing, unexpected = model.load_state_dict(state, strict=False)
            if missing or unexpected:
                raise TowerError(
                    f"{self.kind}: checkpoint {checkpoint!r} does not match the vision tower: "
                    f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
                )
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = model_cls(vcfg)
        self.model = model.to(device=self.device, dtype=tdtype).eval().requires_grad_(False)
        self.config = vcfg
        merge = int(vcfg.spatial_merge_size)
        patch = int(vcfg.patch_size)
        tp = int(vcfg.temporal_patch_size)
        self.spec = TowerSpec(
            name=self.kind, hidden=int(vcfg.out_hidden_size),
            deepstack_width=self._deepstack_layers(vcfg) * int(vcfg.out_hidden_size),
            dtype=dtype, merge=merge, patch_dim=int(vcfg.in_channels) * tp * patch * patch,
            temporal_patch=tp, patch=patch,
        )
        self._torch_dtype = tdtype
        self._registered: list[tuple[int, int]] = []  # host ranges page-locked for CUDA
        self._lock = threading.Lock()

    # -- per-model hooks

    def _config_class(self):
        raise NotImplementedError

    def _model_class(self):
        raise NotImplementedError

    def _tiny(self) -> dict:
        raise NotImplementedError

    def _deepstack_layers(self, vcfg) -> int:
        return 0

    def _config_dict(self, config: Any) -> dict:
        if config == "tiny":
            return dict(self._tiny())
        if isinstance(config, dict):
            return dict(config)
        raise ValueError(f"{self.kind}: config must be 'tiny' or a dict of vision-config fields, got {config!r}")

    def _checkpoint_config(self, path: str):
        if not os.path.isdir(path):
            raise ValueError(f"{self.kind}: checkpoint {path!r} is not a directory")
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        vision = raw.get("vision_config", raw)
        vision = {k: v for k, v in vision.items() if k not in ("architectures",)}
        if "in_chans" in vision and "in_channels" not in vision:  # Qwen2.5-VL's published configs
            vision["in_channels"] = vision["in_chans"]
        return self._config_class().from_dict(vision)

    def forward(self, pixels, grid):
        """The model on one modality's concatenated pixels: (main [N, hidden],
        deepstack [N, deepstack_width] or None). Tests monkeypatch this."""
        raise NotImplementedError

    # -- batch

    def _start(self, items, outs, spans) -> TowerJob:
        import torch

        groups: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(item.modality, []).append(i)
        cuda = self.device.type == "cuda"
        staged = []  # (indices, main, deepstack) with rows on host (pinned on CUDA)
        with self._lock, torch.inference_mode():
            for modality, idx in groups.items():
                try:
                    pixels = torch.cat([
                        _to_torch(items[i].pixels).to(self.device, self._torch_dtype, non_blocking=False)
                        for i in idx
                    ])
                    grid = torch.tensor(
                        [g for i in idx for g in _grids(items[i].grid_thw)], dtype=torch.long,
                        device=self.device,
                    )
                    main, deep = self.forward(pixels, grid)
                except TowerError:
                    raise
                except Exception as e:
                    raise TowerError(f"{self.kind} forward failed on a batch of "
                                     f"{len(idx)} {modality} item(s): {e!r}") from e
                expected = sum(spans[i] for i in idx)
                self._check_rows(modality, "main", main, expected, self.spec.hidden)
                if self.spec.deepstack_width:
                    self._check_rows(modality, "deepstack", deep, expected, self.spec.deepstack_width)
                main = main.to(self._torch_dtype)
                deep = deep.to(self._torch_dtype) if deep is not None else None
                if cuda and self._all_registered(outs, idx):
                    # Straight from the device into the (CUDA-registered) arena.
                    self._scatter([(idx, main, deep)], outs, spans, non_blocking=True)
                    continue
                if cuda:
                    main = self._to_pinned(main)
                    deep = self._to_pinned(deep) if deep is not None else None
                staged.append((idx, main, deep))
            if not cuda:
                self._scatter(staged, outs, spans)
                return _DoneJob()
            event = torch.cuda.Event(blocking=True)  # waiting sleeps instead of spinning
            event.record()
        return _TorchJob(event, lambda: self._scatter(staged, outs, spans))

    @staticmethod
    def _to_pinned(t):
        import torch

        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def _check_rows(self, modality, half, rows, expected, width) -> None:
        if rows is None:
            raise TowerError(f"{self.kind}: {modality} batch returned no {half} rows")
        if rows.dim() != 2 or rows.shape[0] != expected or rows.shape[1] != width:
            raise TowerError(
                f"{self.kind}: {modality} batch {half} rows: expected {expected} rows of {width}, "
                f"got shape {tuple(rows.shape)}"
            )

    @staticmethod
    def _scatter(staged, outs, spans, non_blocking: bool = False) -> None:
        for idx, main, deep in staged:
            row = 0
            for i in idx:
                n = spans[i]
                _to_torch(outs[i][0]).copy_(main[row:row + n], non_blocking=non_blocking)
                if deep is not None:
                    _to_torch(outs[i][1]).copy_(deep[row:row + n], non_blocking=non_blocking)
                row += n

    def register_host_memory(self, address: int, size: int) -> bool:
        """Page-lock [address, address + size) for CUDA (the embedding arena), so rows are
        copied from the device straight into it, asynchronously. False when not on CUDA."""
        if self.device.type != "cuda":
            return False
        import torch

        rc = torch.cuda.cudart().cudaHostRegister(address, size, 0)
        if int(rc) != 0:
            raise TowerError(f"cudaHostRegister of {size} bytes at {address:#x} failed ({rc})")
        self._registered.append((address, size))
        return True

    def _all_registered(self, outs, idx) -> bool:
        def inside(a) -> bool:
            if a is None:
                return True
            p = a.__array_interface__["data"][0]
            return any(b <= p and p + a.nbytes <= b + n for b, n in self._registered)

        return bool(self._registered) and all(inside(outs[i][0]) and inside(outs[i][1]) for i in idx)

    def close(self) -> None:
        self.model = None
        try:
            import torch

            if self.device.type == "cuda":
                torch.cuda.synchronize()
                for address, _ in self._registered:
                    torch.cuda.cudart().cudaHostUnregister(address)
                self._registered = []
                torch.cuda.empty_cache()
        except Exception:
            pass


class Qwen25VLTower(_QwenTower):
    """Qwen2.5-VL's vision tower (``Qwen2_5_VisionTransformerPretrainedModel``): window
    attention, a 2x2 patch merger, no deepstack."""

    kind = "qwen2.5-vl"

    def _config_class(self):
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

        return Qwen2_5_VLVisionConfig

    def _model_class(self):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        return Qwen2_5_VisionTransformerPretrainedModel

    def _tiny(self) -> dict:
        return _TINY_QWEN25

    def forward(self, pixels, grid):
        out = self.model(hidden_states=pixels, grid_thw=grid, return_dict=True)
        return out.pooler_output, None


class Qwen3VLTower(_QwenTower):
    """Qwen3-VL's vision tower (``Qwen3VLVisionModel``). Its deepstack features (one
    ``[N, out_hidden]`` tensor per ``deepstack_visual_indexes`` layer) are
    concatenated along the hidden dim into the deepstack half, layer by layer."""

    kind = "qwen3-vl"

    def _config_class(self):
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

        return Qwen3VLVisionConfig

    def _model_class(self):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel

    def _tiny(self) -> dict:
        return _TINY_QWEN3

    def _deepstack_layers(self, vcfg) -> int:
        return len(vcfg.deepstack_visual_indexes)

    def forward(self, pixels, grid):
        import torch

        out = self.model(hidden_states=pixels, grid_thw=grid, return_dict=True)
        feats = list(out.deepstack_features or [])
        if len(feats) != self._deepstack_layers(self.config):
            raise TowerError(
                f"qwen3-vl: expected {self._deepstack_layers(self.config)} deepstack features, got {len(feats)}"
            )
        deep = torch.cat(feats, dim=1) if feats else None
        return out.pooler_output, deep


# ----------------------------------------------------------------------------- factory

_TOWERS = {"sim": SimTower, "qwen2.5-vl": Qwen25VLTower, "qwen3-vl": Qwen3VLTower}


def build_tower(name: str, **settings: Any) -> Tower:
    """A tower by name.

    ``"sim"``: hidden=3584, deepstack_width=0, dtype="bfloat16", merge=2, patch=14,
    temporal_patch=2, in_channels=3, time_per_row_s=2e-6.

    ``"qwen2.5-vl"`` / ``"qwen3-vl"``: exactly one of ``config="tiny"`` (or a dict of
    vision-config fields; weights random, seeded by ``seed=0``) or
    ``checkpoint=PATH`` (a local HF checkpoint directory: ``config.json``'s
    ``vision_config`` and the safetensors keys under ``model.visual.`` or
    ``visual.``); ``dtype`` (default bfloat16 on CUDA, float32 on CPU); ``device``
    (default ``cuda:{gpu}`` when CUDA is available, else CPU; ``gpu`` default 0);
    ``attn_implementation`` (default the
    config's, i.e. sdpa).
    """
    try:
        cls = _TOWERS[name]
    except KeyError:
        raise ValueError(f"unknown tower {name!r}; choose one of {sorted(_TOWERS)}") from None
    return cls(**settings)


# ----------------------------------------------------------------------------- the stage


class TowerStage(Stage):
    """Batches from the scheduler in; each item's rows to the sender and the cache, a credit back.

    Jobs start as batches arrive (an asynchronous device queues them); results go
    out in order as jobs finish. Pixels are dropped once the batch is done; the
    item's output lease travels on to the sender and the cache, which take it over.
    """

    name = "tower"

    def __init__(self, emit, tower: Tower, *, pixel_arena, emb_arena, rooms, owner: int,
                 prev_owner: int, custody=None):
        from stages.base import Custody

        self.emit = emit
        self.tower = tower
        self.pixel_arena = pixel_arena
        self.emb_arena = emb_arena
        self.rooms = rooms
        self.owner = owner
        self.prev_owner = prev_owner
        self.custody = custody or Custody()
        self.jobs: list[tuple[TowerJob, list]] = []
        self.job_started: list[float] = []  # time.monotonic() each job started, in self.jobs' order
        self.batches = 0
        self.items = 0
        self.rows = 0
        self.batch_seconds = Histogram()
        register = getattr(tower, "register_host_memory", None)
        if register is not None:
            register(emb_arena.address, emb_arena.size)

    def handle(self, source: str, batch) -> None:
        from ipc.arena import StaleLease
        from ipc.rooms import RoomState
        from stages.records import RoomFailure

        if source != "scheduler":
            raise ValueError(f"tower: unexpected source {source!r}")
        spec = self.tower.spec
        live, items, outs = [], [], []
        for w in batch:
            self.custody.hold(w.slot, w.room)
            try:
                self.pixel_arena.transfer(w.pixels, self.prev_owner, self.owner)
                self.emb_arena.transfer(w.out, self.prev_owner, self.owner)
                px = np.frombuffer(self.pixel_arena.view(w.pixels), dtype=numpy_dtype(w.pixel_dtype))
                flat = np.frombuffer(self.emb_arena.view(w.out), dtype=spec.np_dtype)
            except StaleLease:
                self._drop(w)
                self.emit("reaper", RoomFailure(w.slot, w.room, "pixels or output space lost (scheduler died)"))
                self.custody.release(w.slot, w.room)
                continue
            items.append(TowerItem(w.modality, [tuple(g) for g in w.grid_thw],
                                   px.reshape(w.n_patches, w.patch_dim)))
            main = flat[: w.span * spec.hidden].reshape(w.span, spec.hidden)
            deep = (flat[w.span * spec.hidden:].reshape(w.span, spec.deepstack_width)
                    if spec.deepstack_width else None)
            outs.append((main, deep))
            live.append(w)
            self.rooms.advance(w.slot, w.room, RoomState.ENCODING)
        if not live:
            self.emit("scheduler", ("credit",))
            return
        self.batches += 1
        self.items += len(live)
        self.rows += sum(w.span for w in live)
        try:
            job = self.tower.start(items, outs)
        except TowerError as e:
            job = _DoneJob(e)
        self.jobs.append((job, live))
        self.job_started.append(time.monotonic())

    def tick(self, now: float) -> None:
        from stages.records import ReadyItem

        while self.jobs and self.jobs[0][0].done():
            job, batch = self.jobs.pop(0)
            self.batch_seconds.observe(time.monotonic() - self.job_started.pop(0))
            try:
                job.result()
                error = None
            except TowerError as e:
                error = f"tower failed: {e}"
            rooms = {w.room for w in batch}
            if error is not None:
                log.warning("tower batch of %d items failed: room=%s: %s", len(batch),
                            ",".join(map(str, sorted(rooms))), error)
            for w in batch:
                self.pixel_arena.drop(w.pixels, self.owner)
                w.pixels = None
                if error is None:
                    # Straight to the sender (the critical path), and to the cache, which
                    # shares the rows with identical items waiting and caches them: each
                    # gets a reference of ours and takes it over on receipt.
                    self.emb_arena.addref(w.out, self.owner)
                    self.emit("sender", ReadyItem(w.slot, w.room, w.item, w.span, w.out))
                    self.emit("cache", ("encoded", w))
                else:
                    self.emb_arena.drop(w.out, self.owner)
                    w.out = None
                    self.emit("cache", ("failed", w, error, rooms))
                self.custody.release(w.slot, w.room)
            self.emit("scheduler", ("credit",))

    def busy(self) -> bool:
        return bool(self.jobs)

    def stats(self) -> dict:
        return {"tower_batches": self.batches, "tower_items": self.items, "tower_rows": self.rows,
                "tower_batch_seconds": self.batch_seconds.snapshot()}

    def next_done_in(self) -> float | None:
        """Seconds until the oldest job may be done, when the tower can tell (sim)."""
        if self.jobs and isinstance(self.jobs[0][0], _TimedJob):
            return max(0.0, self.jobs[0][0].ready_at - time.monotonic())
        return None

    def _drop(self, w) -> None:
        from ipc.arena import StaleLease

        for arena, lease in ((self.pixel_arena, w.pixels), (self.emb_arena, w.out)):
            for owner in (self.owner, self.prev_owner):
                try:
                    arena.drop(lease, owner)
                    break
                except StaleLease:
                    continue

    def close(self) -> None:
        for job, _ in self.jobs:
            try:
                job.result(timeout=10)
            except Exception:
                pass
        self.tower.close()
