"""The Qwen vision towers, transformers' own modules:

* ``"qwen2.5-vl"`` -- ``Qwen2_5_VisionTransformerPretrainedModel``.
* ``"qwen3-vl"`` -- ``Qwen3VLVisionModel``, with deepstack rows.

torch, transformers and safetensors are imported inside the methods that use them:
only the tower process loads them, while every process may import this module (the
registry and the configuration read these classes' settings).
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable

import numpy as np

from stages import progress
from stages.towers.base import (
    DTYPES, TOWER_CONFIG, DoneJob, Setting, SettingError, Tower, TowerError, TowerJob, TowerSpec, grids, numpy_dtype,
)

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
                        progress.report()  # a hung filesystem stops these: the start is given up
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

    settings = (
        TOWER_CONFIG,
        Setting("tower_dtype", "", "qwen towers: float32, float16 or bfloat16 "
                                   "(default: float32 on CPU, bfloat16 on CUDA)", choices=("",) + DTYPES),
        Setting("gpu", 0, "the CUDA device the tower uses (qwen towers on a CUDA machine)", minimum=0),
    )

    @classmethod
    def tower_kwargs(cls, values: dict[str, Any]) -> dict[str, Any]:
        path = values["tower_config"]
        if os.path.isdir(path):
            kwargs = {"checkpoint": path}
        elif path == "tiny":
            kwargs = {"config": path}
        else:
            raise SettingError(f"tower_config must be 'tiny' or a checkpoint directory; {path!r} "
                               f"is not a directory", "tower_config")
        if values["tower_dtype"]:
            kwargs["dtype"] = values["tower_dtype"]
        kwargs["gpu"] = values["gpu"]
        return kwargs

    def __init__(self, *, config: Any = None, checkpoint: str | None = None,
                 dtype: str | None = None, device: str | None = None, gpu: int = 0, seed: int = 0,
                 attn_implementation: str | None = None):
        import torch

        progress.report()  # torch imported: it may take a while on a cold cache
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
            progress.report()
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
        progress.report()
        self.model = model.to(device=self.device, dtype=tdtype).eval().requires_grad_(False)
        progress.report()
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
                        [g for i in idx for g in grids(items[i].grid_thw)], dtype=torch.long,
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
                return DoneJob()
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

