"""ipc/media.py against Hugging Face's Qwen2-VL image processor (PIL backend), bit for bit.

The reference is what vLLM does with an image's bytes: its loader
(vllm/multimodal/media/image.py: Pillow open, EXIF orientation, RGB with transparency
pasted on white) and then the processor. The processor alone applies no EXIF
orientation (a PIL image in, its pixels as stored); vLLM's loader does, and so does
ipc/media.py.
"""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest

from ipc import media

Image = pytest.importorskip("PIL.Image")
pil_qwen = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")


def vllm_load(data: bytes):
    """vLLM 0.32's ImageMediaIO.load_bytes with image_mode RGB (what the processor gets)."""
    from PIL import ImageOps

    image = Image.open(io.BytesIO(data))
    try:
        image = ImageOps.exif_transpose(image)
    except Exception:
        pass
    image.load()
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.split()[3])
        return out
    return image.convert("RGB")


def hf(data: bytes, s: media.ImageSettings):
    proc = pil_qwen.Qwen2VLImageProcessorPil(
        patch_size=s.patch, merge_size=s.merge, temporal_patch_size=s.temporal_patch,
        size={"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels},
        image_mean=list(s.mean), image_std=list(s.std))
    out = proc(images=[vllm_load(data)], return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def picture(w: int, h: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    """Smooth gradients plus noise: JPEG keeps detail, and a resize has work to do."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 127 // max(w + h, 1))], -1)
    base = np.concatenate([base, rng.integers(0, 256, (h, w, max(channels - 3, 0)))], -1)[..., :channels]
    noise = rng.integers(-20, 21, base.shape)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def save(image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def with_orientation(image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return save(image, "JPEG", quality=92, exif=exif.tobytes())


def corpus():
    rgb = Image.fromarray(picture(517, 333, 1))
    return {
        "jpeg-rgb": (save(rgb, "JPEG", quality=90), "jpeg"),
        "jpeg-small-upscaled": (save(Image.fromarray(picture(23, 17, 2)), "JPEG"), "jpeg"),
        "jpeg-large-downscaled": (save(Image.fromarray(picture(1288, 1288, 3)), "JPEG", quality=80), "jpeg"),
        "jpeg-tall": (save(Image.fromarray(picture(61, 700, 4)), "JPEG"), "jpeg"),
        "jpeg-exact-grid": (save(Image.fromarray(picture(112, 56, 5)), "JPEG"), "jpeg"),
        "jpeg-exif-rot90": (with_orientation(rgb, 6), "jpeg"),
        "jpeg-exif-rot180": (with_orientation(rgb, 3), "jpeg"),
        "jpeg-exif-transverse": (with_orientation(rgb, 7), "jpeg"),
        "jpeg-gray": (save(Image.fromarray(picture(300, 200, 6)[..., 0]), "JPEG"), "jpeg"),
        "jpeg-cmyk": (save(Image.frombytes("CMYK", (300, 220), picture(300, 220, 7, channels=4).tobytes()), "JPEG"),
                      "jpeg"),
        "jpeg-progressive": (save(rgb, "JPEG", progressive=True, quality=85), "jpeg"),
        "png-rgb": (save(rgb, "PNG"), "png"),
        "png-rgba": (save(Image.fromarray(picture(250, 190, 8, channels=4)), "PNG"), "png"),
        "png-gray": (save(Image.fromarray(picture(150, 149, 9)[..., 0]), "PNG"), "png"),
        "png-gray-alpha": (save(Image.fromarray(np.ascontiguousarray(picture(150, 149, 10, channels=4)[..., 2:])),
                                "PNG"), "png"),
        "png-palette-transparent": (save(rgb.quantize(64), "PNG", transparency=3), "png"),
        "png-16bit-gray": (save(Image.fromarray(picture(120, 90, 11)[..., 0].astype(np.uint16) * 257), "PNG"),
                           "png"),
        "webp-lossy": (save(rgb, "WEBP", quality=80), "webp"),
        "webp-lossless-alpha": (save(Image.fromarray(picture(201, 203, 12, channels=4)), "WEBP",
                                     lossless=True), "webp"),
    }


CORPUS = corpus()
SETTINGS = {
    "qwen2.5-vl": media.ImageSettings(min_pixels=28 * 28, max_pixels=448 * 448),
    "qwen2.5-vl-default": media.ImageSettings(),
    "qwen3-vl": media.ImageSettings(patch=16, min_pixels=32 * 32, max_pixels=512 * 512,
                                    mean=media.HALF, std=media.HALF),
}


@pytest.mark.parametrize("settings", SETTINGS, ids=list(SETTINGS))
@pytest.mark.parametrize("name", CORPUS, ids=list(CORPUS))
def test_pixels_equal_the_hf_processor(name, settings):
    data, fmt = CORPUS[name]
    s = SETTINGS[settings]
    want, want_grid = hf(data, s)
    got, grid = media.preprocess(data, fmt, s)
    assert grid == want_grid
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want), f"{name}: max |diff| {np.abs(got - want).max()}"
    # The gateway's grid, from the header alone, is the grid of the decoded image.
    assert media.image_grid(data, fmt, s) == grid


def test_exif_orientation_is_applied_as_vllm_applies_it():
    data, _ = CORPUS["jpeg-exif-rot90"]
    s = SETTINGS["qwen2.5-vl"]
    _, grid = media.preprocess(data, "jpeg", s)
    _, plain = media.preprocess(CORPUS["jpeg-rgb"][0], "jpeg", s)
    assert grid == (1, plain[2], plain[1])  # 517x333 stored, 333x517 shown


def test_into_a_given_buffer():
    data, fmt = CORPUS["png-rgb"]
    s = SETTINGS["qwen2.5-vl"]
    want, grid = media.preprocess(data, fmt, s)
    out = np.zeros((grid[1] * grid[2], s.patch_dim), dtype=np.float32)
    got, _ = media.preprocess(data, fmt, s, out=out)
    assert got is out and np.array_equal(out, want)


def png_claiming(width: int, height: int) -> bytes:
    """A valid PNG header (CRC right) that claims width x height, and a few bytes of data."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1024))
            + chunk(b"IEND", b""))


HOSTILE = {
    "bomb": (png_claiming(8000, 8000), "png", "decoded"),
    "pillow-bomb": (png_claiming(200000, 200000), "png", "decompression bomb"),
    "truncated-jpeg": (CORPUS["jpeg-rgb"][0][:2000], "jpeg", "does not decode"),
    "truncated-png": (CORPUS["png-rgb"][0][:3000], "png", "does not decode"),
    "garbage": (bytes(range(256)) * 8, "jpeg", "not a jpeg image"),
    "empty": (b"", "png", "not a png image"),
    "wrong-format": (CORPUS["png-rgb"][0], "jpeg", "not a jpeg image"),
    "unknown-format": (CORPUS["png-rgb"][0], "gif", "format must be"),
    "too-thin": (save(Image.fromarray(picture(1000, 3, 13)), "PNG"), "png", "aspect ratio"),
    "short-idat": (png_claiming(64, 64), "png", "does not decode"),
}


@pytest.mark.parametrize("name", HOSTILE, ids=list(HOSTILE))
def test_hostile_media_fail_with_a_reason(name):
    data, fmt, reason = HOSTILE[name]
    s = media.ImageSettings(max_decoded_pixels=16 << 20)
    with pytest.raises(media.MediaError, match=reason):
        media.preprocess(data, fmt, s)


@pytest.mark.parametrize("name", ["jpeg-rgb", "png-rgba", "webp-lossy", "jpeg-exif-rot90", "png-gray-alpha"])
def test_the_proxy_sends_the_file_and_its_grid_and_the_worker_makes_its_pixels(name):
    """run.py proxy --send-compressed: no decode in the proxy, the grid from the header; the
    patches the worker makes from the file are the ones the proxy's processor made."""
    import base64

    from pipeline.integrations import proxy

    data, fmt = CORPUS[name]
    pre = object.__new__(proxy.Preprocessor)
    pre.image_processor = pil_qwen.Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112)
    pre.kwargs, pre.compressed = {}, True
    url = f"data:image/{fmt};base64," + base64.b64encode(data).decode()
    item = pre.image(url)
    assert item.media == fmt and item.pixels.tobytes() == data
    assert (item.min_pixels, item.max_pixels) == (28 * 28, 112 * 112)
    s = media.ImageSettings(min_pixels=item.min_pixels, max_pixels=item.max_pixels)
    want, grid = hf(data, s)  # what vLLM makes of the file
    got, _ = media.preprocess(data, fmt, s)
    assert [list(grid)] == item.grid_thw and np.array_equal(got, want)
    # Sent as pixels, the proxy's are vLLM's too: EXIF orientation applied, transparency
    # pasted on white (old code: convert("RGB") dropped both, and this failed for
    # png-rgba and jpeg-exif-rot90).
    pre.compressed = False
    assert np.array_equal(pre.image(url).pixels, want)
    with pytest.raises(proxy.BadRequest, match="jpeg, png or webp"):
        pre.compressed = True
        pre.image("data:image/gif;base64," + base64.b64encode(save(Image.new("RGB", (30, 30)), "GIF")).decode())
