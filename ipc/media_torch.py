"""The resize and normalisation of Hugging Face's torchvision backend for Qwen's image
processor (what transformers gives vLLM where torchvision is installed), done with
torch's own kernels, so that the patches are those that processor makes, bit for bit.

torchvision resizes a uint8 image with torch's native uint8 bicubic antialiased
kernel on CPU; the processor then casts to float32 and normalises with mean and std
scaled by 1 / rescale_factor (its fused rescale and normalise). Torch is imported
only when this backend is chosen: the PIL backend's process never loads it.
"""

from __future__ import annotations

import numpy as np

_TABLES: dict[tuple, np.ndarray] = {}


def resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """An (H, W, 3) uint8 image resized to (height, width) as torchvision's resize_image
    does it on CPU for uint8 bicubic with antialias (the kernel, and the memory layout
    it hands the kernel: a channels-last batch of one)."""
    import torch
    import torch.nn.functional as F

    if rgb.shape[:2] == (height, width):
        return rgb  # torchvision returns the image itself
    chw = torch.from_numpy(np.array(rgb, copy=True)).permute(2, 0, 1)  # tvF.pil_to_tensor's layout
    image = chw.unsqueeze(0)  # the processor's batch of one on CPU (no grouping)
    c, h, w = chw.shape
    strides = list(image.stride())
    if image.is_contiguous(memory_format=torch.channels_last) and strides[0] != image.numel():
        strides[0] = image.numel()  # torchvision's restride, so the output stays channels-last
        image = image.as_strided((1, c, h, w), strides)
    out = F.interpolate(image, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return out[0].permute(1, 2, 0).numpy()


def table(mean: tuple, std: tuple, rescale: float) -> np.ndarray:
    """[3, 256] float32: each uint8 value of each channel as the torchvision backend
    normalises it: float32(v) - mean / rescale, divided by std / rescale, in float32."""
    key = (mean, std, rescale)
    t = _TABLES.get(key)
    if t is None:
        import torch

        m = torch.tensor(mean) * (1.0 / rescale)
        s = torch.tensor(std) * (1.0 / rescale)
        values = torch.arange(256, dtype=torch.float32).expand(3, 256)
        t = _TABLES[key] = values.sub(m.view(3, 1)).div_(s.view(3, 1)).numpy().copy()
    return t
