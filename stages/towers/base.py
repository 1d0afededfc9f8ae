"""The tower contract: pixels of a batch of items -> (main, deepstack) embedding rows.

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

A tower class declares its settings (``Tower.settings``: the worker configuration's
keys for it, with defaults and help) and how their values become its keyword
arguments (``Tower.tower_kwargs``).

Dtypes are named ``"float32"``, ``"float16"``, ``"bfloat16"``. numpy has no
bfloat16, so bfloat16 arrays (pixels and outs) are ``np.uint16`` arrays holding the
raw bfloat16 bits (``torch.from_numpy(a).view(torch.bfloat16)`` reads them).
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

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


class SettingError(ValueError):
    """A tower setting's value is one the tower cannot take; ``key`` names the setting."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Setting:
    """One of a tower's settings, as the worker's configuration has it.

    key: the configuration key (also the flag ``--key`` and ``EPD_KEY``); its type
    is the default's. minimum, choices: what the configuration accepts, checked
    whichever tower is chosen.
    """

    key: str
    default: Any
    help: str
    minimum: int | None = None
    choices: tuple | None = None


# Every tower's checkpoint, one declaration for all (towers that share a key share it).
TOWER_CONFIG = Setting("tower_config", "tiny", "the tower's checkpoint: 'tiny' (none: the qwen towers' seeded "
                                               "weights, the sim tower's defaults), a qwen checkpoint directory, or "
                                               "the sim tower's settings file (TOML, or JSON; docs/configuration.md)")


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


class DoneJob(TowerJob):
    """A job that finished (or failed) inside ``start``."""

    def __init__(self, error: BaseException | None = None):
        self._error = error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> None:
        if self._error is not None:
            raise self._error


class TimedJob(TowerJob):
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


def grids(grid_thw: Any) -> list[tuple[int, int, int]]:
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
    """Base class. Subclasses set ``spec`` and implement ``_start``; a tower with
    settings declares them in ``settings`` and, unless their keys are its keyword
    arguments, overrides ``tower_kwargs``."""

    spec: TowerSpec
    settings: tuple[Setting, ...] = ()

    @classmethod
    def tower_kwargs(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments that build this tower from its settings' values
        (``{key: value}``); ``SettingError`` for a value it cannot take."""
        return dict(values)

    def span(self, grid_thw: Sequence[Sequence[int]]) -> int:
        """Rows of an item's embedding: ``sum(t*h*w) // merge**2``.

        ``ValueError`` if the grid is empty, has a value < 1 or a non-integer, or
        an ``h`` or ``w`` not divisible by the merge size.
        """
        m = self.spec.merge
        total = 0
        for t, h, w in grids(grid_thw):
            if h % m or w % m:
                raise ValueError(
                    f"grid_thw entry {(t, h, w)}: h and w must be divisible by the merge size {m}"
                )
            total += t * h * w
        return total // (m * m)

    def n_patches(self, grid_thw: Sequence[Sequence[int]]) -> int:
        """Pixel rows of an item: ``sum(t*h*w)``."""
        return sum(t * h * w for t, h, w in grids(grid_thw))

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

