"""Pixels for the sim tower, and its rows computed from its documented formula, written
out again here on purpose (not the tower's code): a check that shares the tower's code
would share its bugs."""
from __future__ import annotations

import functools

import numpy as np
import xxhash

PATCH_DIM = 3 * 2 * 14 * 14
PATTERN_SEED = 0x5EED7043
PATTERN_MOD = 1_000_003


@functools.lru_cache(maxsize=None)
def sim_pattern(dtype: str) -> np.ndarray:
    """The sim tower's row pattern in `dtype` (bfloat16 as its uint16 bits); read-only,
    built once per process (it takes a while: a few million normal draws)."""
    f32 = np.random.default_rng(PATTERN_SEED).standard_normal(PATTERN_MOD + (1 << 22), dtype=np.float32)
    if dtype == "float32":
        pattern = f32
    elif dtype == "float16":
        pattern = f32.astype(np.float16)
    else:
        pattern = (f32.view(np.uint32) >> 16).astype(np.uint16)
    pattern.flags.writeable = False
    return pattern


def expected_sim_rows(pixels: np.ndarray, modality: str, span: int, hidden: int, ds_width: int,
                      dtype: str):
    """(main rows, deepstack rows or None) the sim tower writes for these pixels."""
    pattern = sim_pattern(dtype)
    seed = xxhash.xxh3_64_intdigest(np.ascontiguousarray(pixels).tobytes(),
                                    seed={"image": 0, "video": 1}[modality])

    def idx(off: int, n: int) -> np.ndarray:
        return pattern[(off + np.arange(n)) % pattern.size]

    main = idx(seed % PATTERN_MOD, span * hidden).reshape(span, hidden)
    deep = None
    if ds_width:
        deep = idx((seed // PATTERN_MOD) % PATTERN_MOD, span * ds_width).reshape(span, ds_width)
    return main, deep


def pixels(seed: int, grid, dtype=np.float32) -> np.ndarray:
    """Patches of a (t, h, w) grid, drawn from `seed`."""
    t, h, w = grid
    px = np.random.default_rng(seed).standard_normal((t * h * w, PATCH_DIM), dtype=np.float32)
    return px if dtype == np.float32 else px.astype(dtype)


def image(seed: int, grid=(1, 4, 4), dtype=np.float32) -> tuple[list, np.ndarray]:
    """An image item's grid list and pixels."""
    return [list(grid)], pixels(seed, grid, dtype)
