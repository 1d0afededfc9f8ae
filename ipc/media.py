"""Compressed images to a Qwen vision tower's patches, bit for bit as vLLM gets them.

Pure functions, no stage: the preprocess stage calls `preprocess`, a gateway calls
`image_grid` (the header only, no decode) to learn an item's grid before it sends the
bytes. Pillow is imported when first needed, so that importing this costs a gateway
nothing.

What "as vLLM gets them" means: vLLM's media loader (vllm/multimodal/media/image.py)
opens the bytes with Pillow, applies the EXIF orientation (`ImageOps.exif_transpose`),
and converts to RGB, pasting an image with transparency on white through its alpha;
then Hugging Face's `Qwen2VLImageProcessor` (its PIL backend) resizes (Qwen's smart
resize, bicubic, in Pillow on the uint8 image), rescales (float64 times 1/255, then
float32), normalises (float32) and patchifies. The processor itself applies no EXIF
orientation: the loader does, so this does too.

Rescale and normalise map each uint8 value of each channel to one float32, so they are
a table of 3 x 256 floats computed with the processor's own arithmetic: the patches are
the table looked up, which is exact, and far cheaper than the float64 image the
processor makes.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

FORMATS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}  # protocol name -> Pillow's
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # Qwen2-VL and Qwen2.5-VL
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)  # Qwen3-VL's mean and std
RESCALE = 0.00392156862745098  # 1/255 as the processor configurations write it
MAX_ASPECT = 200  # smart resize refuses images longer than this many times their width


class MediaError(ValueError):
    """The item cannot be preprocessed; the message says why (it fails the item's room)."""


@dataclass(frozen=True)
class ImageSettings:
    """The processor's settings: the tower's patch geometry and the resize bounds.

    min_pixels and max_pixels bound the resized image (the processor's `size`
    shortest_edge and longest_edge); max_decoded_pixels bounds the image as decoded,
    before any resize: a few kilobytes of PNG or JPEG can claim gigapixels (a
    decompression bomb), refused from the header before anything is decoded.

    backend: whose processor the patches equal, bit for bit: "pil" (Hugging Face's PIL
    backend: Pillow's resize) or "torchvision" (its torchvision backend, which
    transformers gives vLLM where torchvision is installed: torch's resize,
    ipc/media_torch.py)."""

    patch: int = 14
    merge: int = 2
    temporal_patch: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    rescale: float = RESCALE
    max_decoded_pixels: int = 64 << 20
    backend: str = "pil"

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch * self.patch * self.patch


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen's smart resize (transformers' qwen2_vl smart_resize, the same arithmetic)."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise MediaError(
            f"absolute aspect ratio must be at most {MAX_ASPECT}, got "
            f"{max(height, width) / min(height, width):.1f} ({width}x{height})"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _open(data: bytes, fmt: str):
    """The image, header read and checked, nothing decoded yet."""
    from PIL import Image

    if fmt not in FORMATS:
        raise MediaError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    try:
        # Only the declared format's decoder: no other of Pillow's plugins sees the bytes.
        image = Image.open(io.BytesIO(data), formats=[FORMATS[fmt]])
    except Image.DecompressionBombError as e:
        raise MediaError(f"decompression bomb: {_short(e)}") from None
    except Exception as e:  # Pillow raises many kinds for bytes it cannot read
        raise MediaError(f"not a {fmt} image: {_short(e)}") from None
    return image


def _oriented_size(image) -> tuple[int, int]:
    """(width, height) once the EXIF orientation is applied (5..8 swap the sides)."""
    w, h = image.size
    try:
        orientation = image.getexif().get(0x0112, 1)
    except Exception:  # vLLM ignores an EXIF block it cannot read
        orientation = 1
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)


def _grid(width: int, height: int, s: ImageSettings) -> tuple[int, int, int, int]:
    if width * height > s.max_decoded_pixels:
        raise MediaError(
            f"image is {width}x{height} = {width * height} pixels decoded; this worker "
            f"decodes at most {s.max_decoded_pixels} per image (max_decoded_pixels)"
        )
    rh, rw = smart_resize(height, width, s.patch * s.merge, s.min_pixels, s.max_pixels)
    return rh, rw, rh // s.patch, rw // s.patch


def image_grid(data: bytes, fmt: str, settings: ImageSettings) -> tuple[int, int, int]:
    """The item's grid_thw, [1, h, w] in patches, from the header alone (no decode)."""
    image = _open(data, fmt)
    w, h = _oriented_size(image)
    _, _, gh, gw = _grid(w, h, settings)
    return (1, gh, gw)


def decode_rgb(data: bytes, fmt: str, settings: ImageSettings):
    """The image as vLLM's loader makes it: oriented by EXIF, RGB (transparency on white)."""
    from PIL import Image, ImageOps

    image = _open(data, fmt)
    _grid(*_oriented_size(image), settings)  # the bounds, before anything is decoded
    try:
        try:
            image = ImageOps.exif_transpose(image)
        except Exception:  # vLLM goes on without the orientation when it cannot apply it
            pass
        image.load()
        if image.mode != "RGB":
            if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
                rgba = image.convert("RGBA")
                image = Image.new("RGB", rgba.size, (255, 255, 255))
                image.paste(rgba, mask=rgba.split()[3])
            else:
                image = image.convert("RGB")
    except MediaError:
        raise
    except Exception as e:  # truncated or malformed data: Pillow's reasons vary by decoder
        raise MediaError(f"{fmt} image does not decode: {_short(e)}") from None
    return image


_TABLES: dict[tuple, np.ndarray] = {}


def _table(s: ImageSettings) -> np.ndarray:
    """[3 * 256] float32 (channel-major): each uint8 value of each channel rescaled and normalised with the
    processor's own arithmetic (float64 rescale cast to float32, then float32 (x - mean) / std)."""
    k = (s.mean, s.std, s.rescale)
    t = _TABLES.get(k)
    if t is None:
        x = (np.arange(256, dtype=np.uint8).astype(np.float64) * s.rescale).astype(np.float32)
        mean, std = np.array(s.mean, dtype=np.float32), np.array(s.std, dtype=np.float32)
        t = _TABLES[k] = np.ascontiguousarray(((x[None, :] - mean[:, None]) / std[:, None]).astype(np.float32)).ravel()
    return t


def preprocess(
    data: bytes, fmt: str, settings: ImageSettings, out: np.ndarray | None = None
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """pixel_values [gh * gw, patch_dim] float32 and grid_thw (1, gh, gw) of one image.

    `out`, if given, is where the patches go (a float32 view of that shape, say an
    arena lease's), so that they are written once. MediaError says why an image fails."""
    image = decode_rgb(data, fmt, settings)
    s = settings
    rh, rw, gh, gw = _grid(image.width, image.height, s)
    from PIL import Image

    try:
        if s.backend == "torchvision":
            from ipc import media_torch

            resized = media_torch.resize(np.asarray(image), rh, rw)
        else:
            # The processor resizes even to the same size (a copy): the same call, the same pixels.
            resized = np.asarray(image.resize((rw, rh), resample=Image.Resampling.BICUBIC))
    except Exception as e:
        raise MediaError(f"{fmt} image does not resize: {_short(e)}") from None
    m, p, tp = s.merge, s.patch, s.temporal_patch
    n = gh * gw
    # (H, W, C) -> (gh/m, gw/m, m, m, C, p, p): the processor's patch order, gathered as
    # uint8 (a quarter of the bytes of the floats it becomes).
    u8 = np.ascontiguousarray(resized.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)).reshape(
        n, 3, p * p
    )
    if out is None:
        out = np.empty((n, s.patch_dim), dtype=np.float32)
    elif out.shape != (n, s.patch_dim) or out.dtype != np.float32:
        raise MediaError(f"output is {out.shape} {out.dtype}, the image needs ({n}, {s.patch_dim}) float32")
    if s.backend == "torchvision":
        from ipc import media_torch

        table = media_torch.table(s.mean, s.std, s.rescale)
    else:
        table = _table(s).reshape(3, 256)
    dst = out.reshape(n, 3, tp, p * p)
    for c in range(3):
        vals = table[c][u8[:, c]]  # [n, p * p] float32
        for k in range(tp):  # the same frame in every temporal slot: an image is one frame repeated
            dst[:, c, k] = vals
    return out, (1, gh, gw)


def _short(e: Exception) -> str:
    text = str(e) or type(e).__name__
    return text[:200]
