"""Pluggable vision towers, by name (the contract is in ``stages.towers.base``).

Towers (``build_tower(name, **settings)``):

* ``"sim"`` -- no model (``stages.towers.sim``), for benchmarks of the pipeline itself.
* ``"qwen2.5-vl"``, ``"qwen3-vl"`` -- transformers' vision towers (``stages.towers.qwen``).

A new tower is a module with its ``Tower`` subclass, which declares its settings,
and a line in ``TOWERS``; the worker's configuration takes the tower names and the
settings from here. Importing this package imports neither torch nor transformers.
"""
from __future__ import annotations

from typing import Any

from stages.towers.base import (
    DTYPES,
    Setting,
    SettingError,
    Tower,
    TowerError,
    TowerInputError,
    TowerItem,
    TowerJob,
    TowerSpec,
    numpy_dtype,
)
from stages.towers.qwen import Qwen3VLTower, Qwen25VLTower
from stages.towers.sim import SimTower

__all__ = [
    "DTYPES",
    "Setting",
    "SettingError",
    "TOWERS",
    "TOWER_SETTINGS",
    "Tower",
    "TowerError",
    "TowerInputError",
    "TowerItem",
    "TowerJob",
    "TowerSpec",
    "build_tower",
    "numpy_dtype",
]

TOWERS: dict[str, type[Tower]] = {"sim": SimTower, "qwen2.5-vl": Qwen25VLTower, "qwen3-vl": Qwen3VLTower}

# Every tower's settings by key; towers that share a key (the qwen towers) share its declaration.
TOWER_SETTINGS: dict[str, Setting] = {s.key: s for tower in TOWERS.values() for s in tower.settings}


def build_tower(name: str, **settings: Any) -> Tower:
    """A tower by name.

    ``"sim"``: the keyword arguments of ``SimTower`` (its settings, defaults there).

    ``"qwen2.5-vl"`` / ``"qwen3-vl"``: exactly one of ``config="tiny"`` (or a dict of
    vision-config fields; weights random, seeded by ``seed=0``) or
    ``checkpoint=PATH`` (a local HF checkpoint directory: ``config.json``'s
    ``vision_config`` and the safetensors keys under ``model.visual.`` or
    ``visual.``); ``dtype`` (default bfloat16 on CUDA, float32 on CPU); ``device``
    (default ``cuda:{gpu}`` when CUDA is available, else CPU; ``gpu`` default 0);
    ``attn_implementation`` (default the config's, i.e. sdpa).
    """
    try:
        cls = TOWERS[name]
    except KeyError:
        raise ValueError(f"unknown tower {name!r}; choose one of {sorted(TOWERS)}") from None
    return cls(**settings)
