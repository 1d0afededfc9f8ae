"""Compressed videos to a Qwen vision tower's patches, bit for bit as vLLM 0.32 gets them.

Pure functions, no stage: the preprocess stage calls `preprocess`, a gateway calls
`video_grid` (the container's header, no frame decoded but one at the stream's end) to
learn an item's grid before it sends the bytes. OpenCV (opencv-python-headless, the
library vLLM's own loader decodes with) is imported when first needed; torch too, and
only by `preprocess`.

What "as vLLM gets them" means, for Qwen2-VL and Qwen2.5-VL (whose video processor is
Qwen2VLVideoProcessor, so vLLM picks its `qwen2_vl` loader, vllm/multimodal/video.py):
  - the bytes open in OpenCV's stream-buffered FFmpeg backend; the frame count is the
    container's, checked by a seek to the stream's end (an mp4 edit list can hide frames);
  - n = frames / source fps * min(fps, 30), clamped to [min_frames, max_frames] (max_frames
    at most 768 and the frame count, floored to a multiple of temporal_patch), then floored
    to a multiple of temporal_patch; the indices are torch.arange(0, frames, frames / n),
    truncated and clamped, taken once each (vLLM reads them as a set);
  - the frames are grabbed in order up to the last index, the sampled ones retrieved and
    converted BGR to RGB;
  - vLLM hands them to the processor without asking it to sample again, and the processor
    (torch only: transformers' video processors have no PIL backend) resizes all frames to
    one smart-resized size (torch's uint8 bicubic antialiased kernel on channels-first
    frames), rescales and normalises fused in float32, pads to a multiple of
    temporal_patch by repeating the last frame, and patchifies.

For Qwen3-VL (Qwen3VLVideoProcessor, vLLM's `qwen3_vl` loader) the same, but n =
int(frames / source fps * min(fps, 30)) clamped to [min_frames, max_frames] and the frame
count, at numpy's rounded linspace indices, and the frames resized to Qwen3's smart
resize, whose bounds are on all the frames together.

Where vLLM goes on with fewer frames than it sampled (a frame that does not decode), this
fails the item instead: the gateway declared its grid from the header, and the rows the
prefill rank expects are that many.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ipc.media import CLIP_MEAN, CLIP_STD, MAX_ASPECT, RESCALE, MediaError, smart_resize

FORMATS = ("mp4", "webm")
MAX_FPS = 30  # vLLM's Qwen loaders sample at most this many frames a second
MAX_FRAMES = 768  # and at most this many frames
MIN_FRAMES = 4  # and, by default, at least this many
# Each family's video processor's size (shortest_edge, longest_edge) by default: Qwen2's
# bounds each frame, Qwen3's all the frames together.
DEFAULT_PIXELS = {"qwen2": (128 * 28 * 28, 28 * 28 * 768), "qwen3": (128 * 32 * 32, 32 * 32 * 768)}


@dataclass(frozen=True)
class VideoSettings:
    """The processor's settings for a video: the tower's patch geometry, the resize
    bounds (Qwen2's on each frame, Qwen3's on all the frames together), the sampling (fps,
    min_frames, max_frames), whose loader and processor (`family`), and this worker's bounds.

    max_decoded_pixels bounds one frame as decoded (vLLM's VLLM_MAX_IMAGE_PIXELS check);
    max_stream_pixels bounds the frames decoded for one item (every frame up to the last
    sampled one is decoded, sampled or not), which bounds its decode time; both are
    checked from the container's header before any frame is decoded. The frames kept are
    at most max_frames, each resized as it is read, so what one item holds decoded is one
    frame at a time."""

    patch: int = 14
    merge: int = 2
    temporal_patch: int = 2
    min_pixels: int = 128 * 28 * 28  # Qwen2VLVideoProcessor's size.shortest_edge
    max_pixels: int = 28 * 28 * 768  # and size.longest_edge
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    rescale: float = RESCALE
    fps: float = 2.0
    min_frames: int = MIN_FRAMES
    max_frames: int = MAX_FRAMES
    max_decoded_pixels: int = 64 << 20
    max_stream_pixels: int = 1 << 34
    family: str = "qwen2"  # whose loader and processor: "qwen2" (Qwen2-VL, Qwen2.5-VL) or "qwen3" (Qwen3-VL)

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch * self.patch * self.patch


@dataclass(frozen=True)
class Header:
    """What the container says: frame count (as vLLM's loader counts it), source fps, size."""

    frames: int
    fps: float
    width: int
    height: int


def family_of(tower: str) -> str:
    """The video loader and processor family of a tower (pipeline/cli/config.py's names)."""
    return "qwen3" if tower.startswith("qwen3") else "qwen2"


def default_pixels(tower: str, min_pixels: int = 0, max_pixels: int = 0) -> tuple[int, int]:
    """min_pixels and max_pixels, each the tower's video processor's default where 0."""
    lo, hi = DEFAULT_PIXELS[family_of(tower)]
    return min_pixels or lo, max_pixels or hi


def _check_magic(data: bytes, fmt: str) -> None:
    """Only the declared container reaches FFmpeg, whose probe would take any of its formats."""
    if fmt not in FORMATS:
        raise MediaError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    head = bytes(data[:64])
    if fmt == "mp4" and head[4:8] != b"ftyp":
        raise MediaError("not an mp4 file (no ftyp box first)")
    if fmt == "webm" and (head[:4] != b"\x1a\x45\xdf\xa3" or b"webm" not in head):
        raise MediaError("not a webm file (no EBML header with doctype webm)")


def _capture(data: bytes, fmt: str):
    """The video opened as vLLM's loader opens it (the first stream-buffered backend).

    Never `release()`d: on a capture over a stream, OpenCV's release and then its
    destructor both free the stream (a crash); dropping the capture frees it once."""
    _check_magic(data, fmt)
    try:
        import cv2
        import cv2.videoio_registry as vr
    except ImportError:
        raise MediaError("this worker has no OpenCV (opencv-python-headless) to decode video with") from None
    api = None
    for backend in vr.getStreamBufferedBackends():
        if not vr.hasBackend(backend):
            continue
        if not vr.isBackendBuiltIn(backend):
            _, abi, version = vr.getStreamBufferedBackendPluginVersion(backend)
            if abi < 1 or (abi == 1 and version < 2):
                continue
        api = backend
        break
    if api is None:
        raise MediaError("this worker's OpenCV has no backend that reads a video from memory")
    source: Any = io.BytesIO(data)  # a stream reader to OpenCV, which its stubs do not say
    try:
        cap = cv2.VideoCapture(source, api, [])
        opened = cap.isOpened()
    except Exception as e:  # OpenCV raises cv2.error for a stream it cannot open
        raise MediaError(f"{fmt} video does not open: {_short(e)}") from None
    if not opened:
        raise MediaError(f"{fmt} video does not open")
    return cap


def _header(cap, s: VideoSettings | None = None) -> Header:
    """vLLM's get_video_metadata, the same calls: the frame count, checked by a seek to
    the end against an edit list that hides frames. With settings, the bounds are
    checked first on the header's own count and size: the seek decodes a frame (and
    those before it since a keyframe)."""
    import cv2

    total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    fps = cap.get(cv2.CAP_PROP_FPS)
    width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
    if s is not None:
        _bounds(Header(total, fps, width, height), s, total - 1)
    if total > 0 and cap.set(cv2.CAP_PROP_POS_AVI_RATIO, 1.0):
        visible = int(cap.get(cv2.CAP_PROP_POS_FRAMES))
        at_end = not cap.grab()
        cap.set(cv2.CAP_PROP_POS_FRAMES, 0)
        if at_end and 0 < visible < total - 1:
            total = visible
    return Header(total, fps, width, height)


def frames_to_sample(h: Header, s: VideoSettings) -> tuple[int, int]:
    """(n, count): the loader's n, and how many frames it reads for it. qwen2: vLLM's
    qwen2_vl loader, whose torch.arange gives ceil(frames / (frames / n)) indices (in
    float64: n, or once in a while n + 1). qwen3: its qwen3_vl loader (a source of unknown
    frame rate taken as 24 a second, as Hugging Face's processor takes it), n frames;
    where those are all the frames vLLM has the processor sample again, with the same
    arithmetic, which gives them all again."""
    if h.frames <= 0:
        raise MediaError("the video's container gives no frame count")
    if s.family == "qwen3":
        source_fps = h.fps if h.fps > 0 else 24.0
        n = int(h.frames / source_fps * min(s.fps, MAX_FPS))
        n = min(max(n, s.min_frames), min(s.max_frames, MAX_FRAMES), h.frames)
        if n < s.temporal_patch:  # the processor's smart resize refuses fewer
            raise MediaError(f"the video samples {n} frame(s): fewer than one temporal patch ({s.temporal_patch})")
        return n, n
    if not h.fps > 0 or not math.isfinite(h.fps):
        raise MediaError("the video has no known frame rate (vLLM's Qwen2-VL sampling needs one)")
    tp = s.temporal_patch
    max_frames = math.floor(min(min(s.max_frames, MAX_FRAMES), h.frames) / tp) * tp
    wanted = h.frames / h.fps * min(s.fps, MAX_FPS)
    n = math.floor(min(max(wanted, s.min_frames), max_frames, h.frames) / tp) * tp
    if n <= 0:
        raise MediaError(f"the video has {h.frames} frame(s): fewer than one temporal patch ({tp}) to sample")
    return n, math.ceil(h.frames / (h.frames / n))


def _bounds(h: Header, s: VideoSettings, last_frame: int) -> None:
    pixels = h.width * h.height
    if h.width <= 0 or h.height <= 0:
        raise MediaError(f"the video's header gives no frame size ({h.width}x{h.height})")
    if pixels > s.max_decoded_pixels:
        raise MediaError(
            f"video frames are {h.width}x{h.height} = {pixels} pixels decoded; this worker decodes at "
            f"most {s.max_decoded_pixels} per frame (max_decoded_pixels)"
        )
    if (last_frame + 1) * pixels > s.max_stream_pixels:
        raise MediaError(
            f"the video's header gives {last_frame + 1} frames of {h.width}x{h.height} to decode; this worker "
            f"decodes at most {s.max_stream_pixels} pixels per video (max_stream_pixels)"
        )


def _grid(h: Header, s: VideoSettings, count: int) -> tuple[int, int, int, int, int]:
    """(resized height, resized width, grid t, grid h, grid w)."""
    _bounds(h, s, h.frames - 1)
    if s.family == "qwen3":
        rh, rw = smart_resize_qwen3(
            count, h.height, h.width, s.temporal_patch, s.patch * s.merge, s.min_pixels, s.max_pixels
        )
    else:
        rh, rw = smart_resize(h.height, h.width, s.patch * s.merge, s.min_pixels, s.max_pixels)
    return rh, rw, -(-count // s.temporal_patch), rh // s.patch, rw // s.patch


def smart_resize_qwen3(
    frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen3-VL's video smart resize (transformers' qwen3_vl video processor, the same
    arithmetic): its bounds are on all the frames together."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise MediaError(f"absolute aspect ratio must be at most {MAX_ASPECT} ({width}x{height})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_grid(data: bytes, fmt: str, settings: VideoSettings) -> tuple[int, int, int]:
    """The item's grid_thw, [t, h, w] in patches, from the container alone (no frame
    decoded but the one a seek to the end reads). MediaError if it breaks a bound."""
    h = _header(_capture(data, fmt), settings)  # dropped, never released: see _capture
    _, count = frames_to_sample(h, settings)
    _, _, gt, gh, gw = _grid(h, settings, count)
    return (gt, gh, gw)


def sample_indices(h: Header, s: VideoSettings) -> list[int]:
    """The frames vLLM's loader reads, in order, each once. qwen2: its torch.arange call
    itself (torch's float arange rounds by the CPU's vector width, so no other arithmetic
    is sure to agree with it on every machine); qwen3: numpy's linspace, rounded."""
    n, _ = frames_to_sample(h, s)
    if s.family == "qwen3":
        return sorted(set(np.linspace(0, h.frames - 1, n).round().astype(int).tolist()))
    import torch

    indices = torch.clamp(torch.arange(0, h.frames, h.frames / n).int(), max=h.frames - 1).tolist()
    return sorted(set(indices))


def _read(cap, h: Header, indices: list[int], fmt: str, resize, progress) -> list[np.ndarray]:
    """The sampled frames, each resized as it is read: vLLM's read without recovery, but a
    sampled frame that does not decode fails the item (the grid was declared from the header)."""
    import cv2

    wanted = set(indices)
    frames = []
    for idx in range(indices[-1] + 1):
        ok = cap.grab()
        if progress is not None:
            progress()
        if idx not in wanted:
            continue
        frame = cap.retrieve()[1] if ok else None
        if frame is None:
            raise MediaError(f"{fmt} video: frame {idx} of {h.frames} does not decode")
        if frame.shape != (h.height, h.width, 3):
            raise MediaError(f"{fmt} video: frame {idx} is {frame.shape}, the header says {h.width}x{h.height}")
        frames.append(resize(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)))
    return frames


def _resizer(rh: int, rw: int):
    """A frame (H, W, 3) uint8 to (rh, rw, 3) as the video processor resizes: torchvision's
    resize of the channels-first frames (contiguous, as the processor makes them), which
    is torch's uint8 bicubic antialiased kernel, or the frame itself at the same size."""
    import torch
    import torch.nn.functional as F

    def resize(rgb: np.ndarray) -> np.ndarray:
        if rgb.shape[:2] == (rh, rw):
            return rgb
        chw = torch.from_numpy(rgb).permute(2, 0, 1).contiguous().unsqueeze(0)
        out = F.interpolate(chw, size=[rh, rw], mode="bicubic", align_corners=False, antialias=True)
        return out[0].permute(1, 2, 0).numpy()

    return resize


def preprocess(
    data: bytes,
    fmt: str,
    settings: VideoSettings,
    out: np.ndarray | None = None,
    progress: Callable[[], None] | None = None,
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """pixel_values [gt * gh * gw, patch_dim] float32 and grid_thw (gt, gh, gw) of one video.

    `out`, if given, is where the patches go (a float32 view of that shape). `progress`,
    if given, is called at each frame decoded: a long video is not a hung decoder, one
    frame that never ends is. MediaError says why a video fails."""
    try:
        import torch  # noqa: F401  (the sampling, resize and normalisation below are torch's)
    except ImportError:
        raise MediaError("this worker has no torch (the video processor resizes with it)") from None
    from ipc import media_torch

    s = settings
    cap = _capture(data, fmt)
    h = _header(cap, s)
    n, count = frames_to_sample(h, s)
    rh, rw, gt, gh, gw = _grid(h, s, count)
    indices = sample_indices(h, s)
    if len(indices) != count:  # a clamp made two indices one: vLLM reads one frame fewer
        raise MediaError(f"sampling {n} of {h.frames} frames reads {len(indices)}, not {count}")
    try:
        frames = _read(cap, h, indices, fmt, _resizer(rh, rw), progress)
    except MediaError:
        raise
    except Exception as e:  # OpenCV and torch raise their own kinds on data they cannot take
        raise MediaError(f"{fmt} video does not decode: {_short(e)}") from None
    del cap
    tp, m, p = s.temporal_patch, s.merge, s.patch
    frames += [frames[-1]] * (gt * tp - len(frames))  # the processor pads with the last frame
    rows = gt * gh * gw
    if out is None:
        out = np.empty((rows, s.patch_dim), dtype=np.float32)
    elif out.shape != (rows, s.patch_dim) or out.dtype != np.float32:
        raise MediaError(f"output is {out.shape} {out.dtype}, the video needs ({rows}, {s.patch_dim}) float32")
    table = media_torch.table(s.mean, s.std, s.rescale)
    # Rows in (t, gh/m, gw/m, m, m) order, columns (channel, temporal slot, p, p): the
    # processor's patch order, gathered as uint8 before the table lookup.
    dst = out.reshape(gt, gh * gw, 3, tp, p * p)
    for i, frame in enumerate(frames):
        u8 = frame.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5).reshape(gh * gw, 3, p * p)
        for c in range(3):
            dst[i // tp, :, c, i % tp] = table[c][u8[:, c]]
    return out, (gt, gh, gw)


def _short(e: Exception) -> str:
    text = str(e) or type(e).__name__
    return text[:200]
