"""ipc/media_video.py: compressed videos to a Qwen vision tower's patches (Qwen2.5-VL's and Qwen3-VL's).

The videos are made here with OpenCV's own writer (its wheel's FFmpeg writes mp4 with
mp4v, and webm with VP8 and VP9). The reference, vLLM 0.32's qwen2_vl and qwen3_vl
loaders and Hugging Face's Qwen2VLVideoProcessor and Qwen3VLVideoProcessor, runs in
.venv-vllm (as tests/ipc/test_media_torch.py does); the other tests need OpenCV and
torch here, as the worker does."""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ipc import hashing
from ipc import media_video as mv
from ipc.media import HALF, MediaError

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SMALL = mv.VideoSettings(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)


def make_video(fmt: str = "mp4", fourcc: str = "mp4v", frames: int = 10, width: int = 64, height: int = 48,
               fps: float = 10.0, seed: int = 0) -> bytes:
    """A short video of noise moving sideways, as OpenCV's writer makes it."""
    cv2 = pytest.importorskip("cv2")
    fd, path = tempfile.mkstemp(suffix="." + fmt)
    os.close(fd)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*fourcc), fps, (width, height))
        assert writer.isOpened(), f"OpenCV writes no {fmt} with {fourcc} here"
        base = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
        for i in range(frames):
            writer.write(np.roll(base, 3 * i, axis=1))
        writer.release()
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def claiming_huge_frames(width: int = 16000, height: int = 16000) -> bytes:
    """A webm of small frames whose header claims frames of width x height: its
    PixelWidth and PixelHeight (2-byte EBML integers at 320x272) rewritten in place."""
    data = bytearray(make_video("webm", "VP80", 4, 320, 272, 10.0))
    for element, claimed in ((b"\xb0\x82\x01\x40", width), (b"\xba\x82\x01\x10", height)):
        at = data.find(element)
        assert at > 0, "the writer's header is not as this expects"
        data[at + 2 : at + 4] = claimed.to_bytes(2, "big")
    return bytes(data)


def claiming_many_frames(frames: int = 100_000_000) -> bytes:
    """An mp4 of 10 frames whose sample table (its stts box's one entry) claims `frames`."""
    data = bytearray(make_video())
    at = data.find(b"stts")
    assert at > 0 and data[at + 8 : at + 12] == (1).to_bytes(4, "big"), "the writer's header is not as expected"
    data[at + 12 : at + 16] = frames.to_bytes(4, "big")
    return bytes(data)


# (format, fourcc, frames, width, height, source fps, settings): counts that sample every
# frame, some, an odd count, a count padded to the temporal patch, frames not resized.
CASES = {
    "mp4-some": ("mp4", "mp4v", 30, 96, 72, 10.0, replace(SMALL, min_pixels=56 * 56, max_pixels=112 * 112)),
    "mp4-all": ("mp4", "mp4v", 9, 64, 48, 24.0, mv.VideoSettings()),
    "mp4-same-size": ("mp4", "mp4v", 12, 56, 56, 6.0, replace(SMALL, min_pixels=56 * 56, max_pixels=56 * 56)),
    "mp4-fps": ("mp4", "mp4v", 31, 70, 40, 30.0, replace(SMALL, fps=7.5, min_frames=2, max_frames=6)),
    # 14 frames asked, 15 indices from torch's arange (its size rounds up), padded to 16.
    "mp4-one-more": ("mp4", "mp4v", 17, 64, 48, 10.0, replace(SMALL, fps=8.5)),
    "webm-vp8": ("webm", "VP80", 20, 80, 60, 5.0, replace(SMALL, fps=1.0)),
    "webm-vp9": ("webm", "VP90", 17, 100, 50, 8.0, replace(SMALL, fps=4.0)),
}

Q3 = mv.VideoSettings(patch=16, mean=HALF, std=HALF, family="qwen3", min_pixels=mv.DEFAULT_PIXELS["qwen3"][0],
                      max_pixels=mv.DEFAULT_PIXELS["qwen3"][1])
# Qwen3-VL's: some frames, an odd count (padded), frames narrower than a merged patch
# (scaled up first), and every frame (where vLLM has the processor sample again).
CASES_QWEN3 = {
    "mp4-some": ("mp4", "mp4v", 30, 96, 72, 10.0, Q3),
    "mp4-odd": ("mp4", "mp4v", 31, 70, 40, 30.0,
                replace(Q3, fps=7.5, min_frames=2, max_frames=7, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 40)),
    "webm-narrow": ("webm", "VP90", 17, 20, 50, 8.0, replace(Q3, fps=4.0, min_pixels=32 * 32 * 2,
                                                               max_pixels=32 * 32 * 64)),
    "mp4-every-frame": ("mp4", "mp4v", 3, 64, 48, 24.0, Q3),
    "webm-every-frame": ("webm", "VP90", 12, 48, 40, 4.0, replace(Q3, fps=4.0)),
    "webm-vp8": ("webm", "VP80", 20, 80, 60, 5.0, replace(Q3, fps=1.0)),
}

CHECK_QWEN3 = """
import sys
sys.path[:0] = [".", "tests/ipc"]
import numpy as np
import test_media_video as tv
from ipc import media_video as mv
from vllm.multimodal.media.image import ImageMediaIO
from vllm.multimodal.media.video import VideoMediaIO
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

equal, differ = [], []
for name, (fmt, fourcc, n, w, h, fps, s) in tv.CASES_QWEN3.items():
    data = tv.make_video(fmt, fourcc, n, w, h, fps)
    # What vLLM does for a Qwen3-VL video: its loader for Qwen3VLVideoProcessor, and the
    # processor told to sample again where the loader took every frame
    # (Qwen3VLMultiModalProcessor), with the same fps and frame bounds.
    io = VideoMediaIO(ImageMediaIO(), video_backend="qwen3_vl", fps=s.fps, min_frames=s.min_frames,
                      max_frames=s.max_frames)
    frames, meta = io.load_bytes(data).media
    again = meta["do_sample_frames"]
    meta = VideoMetadata(**{k: v for k, v in meta.items() if k != "do_sample_frames"})
    proc = Qwen3VLVideoProcessor(patch_size=s.patch, merge_size=s.merge, temporal_patch_size=s.temporal_patch,
                                 size={"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels},
                                 image_mean=list(s.mean), image_std=list(s.std), fps=s.fps,
                                 min_frames=s.min_frames, max_frames=s.max_frames)
    ref = proc(videos=[frames], video_metadata=[meta], do_sample_frames=again, return_tensors="pt")
    pixels, grid = ref["pixel_values_videos"].numpy(), ref["video_grid_thw"][0].tolist()
    got, got_grid = mv.preprocess(data, fmt, s)
    header_grid = mv.video_grid(data, fmt, s)
    ok = got.shape == pixels.shape and np.array_equal(got, pixels) and list(got_grid) == grid == list(header_grid)
    (equal if ok else differ).append(f"{name} {again} {grid} {list(got_grid)} {list(header_grid)}")
print("equal", equal)
print("differ", differ)
sys.exit(1 if differ or not equal else 0)
"""

CHECK = """
import sys, json
sys.path[:0] = [".", "tests/ipc"]
import numpy as np
import test_media_video as tv
from ipc import media_video as mv
from vllm.multimodal.media.image import ImageMediaIO
from vllm.multimodal.media.video import VideoMediaIO
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.video_utils import VideoMetadata

equal, differ = [], []
for name, (fmt, fourcc, n, w, h, fps, s) in tv.CASES.items():
    data = tv.make_video(fmt, fourcc, n, w, h, fps)
    # What vLLM does for a Qwen2.5-VL video: its loader for Qwen2VLVideoProcessor, the
    # metadata without do_sample_frames (Qwen2_5_VLMultiModalProcessor), the processor.
    io = VideoMediaIO(ImageMediaIO(), video_backend="qwen2_vl", fps=s.fps, min_frames=s.min_frames,
                      max_frames=s.max_frames)
    frames, meta = io.load_bytes(data).media
    meta = VideoMetadata(**{k: v for k, v in meta.items() if k != "do_sample_frames"})
    proc = Qwen2VLVideoProcessor(patch_size=s.patch, merge_size=s.merge, temporal_patch_size=s.temporal_patch,
                                 min_pixels=s.min_pixels, max_pixels=s.max_pixels, image_mean=list(s.mean),
                                 image_std=list(s.std), cap_pixels_per_frame=None)
    ref = proc(videos=[frames], video_metadata=[meta], return_tensors="pt")
    pixels, grid = ref["pixel_values_videos"].numpy(), ref["video_grid_thw"][0].tolist()
    got, got_grid = mv.preprocess(data, fmt, s)
    header_grid = mv.video_grid(data, fmt, s)
    ok = got.shape == pixels.shape and np.array_equal(got, pixels) and list(got_grid) == grid == list(header_grid)
    (equal if ok else differ).append(f"{name} {grid} {list(got_grid)} {list(header_grid)}")
print("equal", equal)
print("differ", differ)
sys.exit(1 if differ or not equal else 0)
"""


@pytest.mark.long
def test_pixels_equal_vllm_and_the_qwen2_vl_video_processor():
    """Each case's patches and grid_thw, and the grid from the header alone, are those
    vLLM 0.32 gets from its loader and Hugging Face's video processor, exactly."""
    assert VLLM_PYTHON.exists(), (
        f"{VLLM_PYTHON} is missing: the reference runs in vLLM's environment; build it with scripts/setup_vllm.sh"
    )
    proc = subprocess.run([str(VLLM_PYTHON), "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "differ []" in proc.stdout, proc.stdout


@pytest.mark.long
def test_pixels_equal_vllm_and_the_qwen3_vl_video_processor():
    """The same for Qwen3-VL: its loader's sampling, its processor's resize."""
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} is missing: build it with scripts/setup_vllm.sh"
    proc = subprocess.run([str(VLLM_PYTHON), "-c", CHECK_QWEN3], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "differ []" in proc.stdout, proc.stdout


@pytest.mark.parametrize("name", ["mp4-some", "webm-vp9"])
def test_the_header_grid_is_the_decoded_grid(name):
    pytest.importorskip("torch")
    fmt, fourcc, n, w, h, fps, s = CASES[name]
    data = make_video(fmt, fourcc, n, w, h, fps)
    pixels, grid = mv.preprocess(data, fmt, s)
    assert mv.video_grid(data, fmt, s) == grid
    assert pixels.shape == (grid[0] * grid[1] * grid[2], s.patch_dim)
    out = np.full_like(pixels, np.nan)
    assert mv.preprocess(data, fmt, s, out=out)[0] is out and np.array_equal(out, pixels)


def test_qwen3_frames_sampled_as_its_loader_counts_them():
    for frames, src, fps, lo, hi in [(300, 30.0, 2.0, 4, 768), (3, 24.0, 2.0, 4, 768), (90, 0.0, 2.0, 4, 768),
                                     (5000, 25.0, 30.0, 4, 768), (40, 10.0, 1.0, 8, 12)]:
        s = replace(Q3, fps=fps, min_frames=lo, max_frames=hi)
        n, count = mv.frames_to_sample(mv.Header(frames, src, 64, 48), s)
        want = min(max(int(frames / (src or 24.0) * min(fps, 30)), lo), hi, frames)
        assert n == count == want
        assert len(mv.sample_indices(mv.Header(frames, src, 64, 48), s)) == n
    with pytest.raises(MediaError, match="fewer than one temporal patch"):
        mv.frames_to_sample(mv.Header(1, 24.0, 64, 48), Q3)


def test_progress_is_told_at_each_frame_decoded():
    """The preprocess stage moves its heartbeat on at each: a long video is not a hang."""
    pytest.importorskip("torch")
    data = make_video(frames=30, fps=10.0)
    calls = []
    mv.preprocess(data, "mp4", SMALL, progress=lambda: calls.append(1))
    h = mv._header(mv._capture(data, "mp4"))
    assert len(calls) == mv.sample_indices(h, SMALL)[-1] + 1 > 1


def test_frames_sampled_as_the_processor_counts_them():
    """n: Hugging Face's Qwen2VLVideoProcessor.sample_frames arithmetic (fps mode), which
    vLLM's loader ports; the grid's t is that over the temporal patch."""
    for frames, src, fps, lo, hi in [(300, 30.0, 2.0, 4, 768), (9, 24.0, 2.0, 4, 768), (3, 1.0, 2.0, 4, 768),
                                     (5000, 25.0, 30.0, 4, 768), (451, 29.97, 2.0, 4, 768), (40, 10.0, 1.0, 8, 12)]:
        n, count = mv.frames_to_sample(mv.Header(frames, src, 64, 48), replace(SMALL, fps=fps, min_frames=lo,
                                                                                max_frames=hi))
        max_frames = (min(hi, 768, frames) // 2) * 2
        want = min(max(frames / src * min(fps, 30), lo), max_frames, frames) // 2 * 2
        assert n == want and count in (n, n + 1)
    assert mv.frames_to_sample(mv.Header(17, 10.0, 64, 48), replace(SMALL, fps=8.5)) == (14, 15)


def test_bounds_refuse_from_the_header():
    data = make_video(frames=10, width=64, height=48)
    with pytest.raises(MediaError, match="max_decoded_pixels"):
        mv.video_grid(data, "mp4", replace(SMALL, max_decoded_pixels=64 * 48 - 1))
    with pytest.raises(MediaError, match="max_stream_pixels"):
        mv.video_grid(data, "mp4", replace(SMALL, max_stream_pixels=64 * 48 * 9))
    with pytest.raises(MediaError, match="max_stream_pixels"):
        mv.preprocess(data, "mp4", replace(SMALL, max_stream_pixels=64 * 48 * 9))
    mv.video_grid(data, "mp4", replace(SMALL, max_stream_pixels=64 * 48 * 10))


def test_a_header_claiming_huge_frames_is_refused_before_any_decode():
    data = claiming_huge_frames()
    h = mv._header(mv._capture(data, "webm"))
    assert (h.width, h.height) == (16000, 16000)
    for call in (mv.video_grid, mv.preprocess):
        with pytest.raises(MediaError, match="16000x16000 = 256000000 pixels decoded"):
            call(data, "webm", SMALL)


def test_a_header_claiming_many_frames_is_refused_before_any_decode():
    """Refused on the header's count, before the seek to the end (which would decode)."""
    for call in (mv.video_grid, mv.preprocess):
        with pytest.raises(MediaError, match="100000000 frames of 64x48"):
            call(claiming_many_frames(), "mp4", SMALL)


def test_hostile_videos_fail_with_a_reason():
    pytest.importorskip("torch")
    mp4, webm = make_video(), make_video("webm", "VP80")
    one_frame = make_video(frames=1)
    cases = {
        "empty": (b"", "mp4"),
        "an image as mp4": (b"\x89PNG\r\n\x1a\n" + bytes(64), "mp4"),
        "webm as mp4": (webm, "mp4"),
        "mp4 as webm": (mp4, "webm"),
        "truncated mp4": (mp4[: len(mp4) // 2], "mp4"),
        "truncated webm": (webm[: len(webm) // 2], "webm"),
        "header only": (mp4[:64], "mp4"),
        "one frame": (one_frame, "mp4"),
        "avi": (mp4, "avi"),
    }
    for name, (data, fmt) in cases.items():
        with pytest.raises(MediaError) as e:
            mv.preprocess(data, fmt, SMALL)
        assert str(e.value), name
    # Bytes of the frames scrambled (the header intact): a reason, or frames the decoder
    # concealed; never anything but a MediaError.
    rng = np.random.default_rng(1)
    for _ in range(4):
        bad = bytearray(mp4)
        at = bad.find(b"mdat") + 8
        bad[at : at + 400] = rng.integers(0, 256, 400, dtype=np.uint8).tobytes()
        try:
            pixels, grid = mv.preprocess(bytes(bad), "mp4", SMALL)
        except MediaError:
            continue
        assert pixels.shape[0] == grid[0] * grid[1] * grid[2]


def test_settings_that_change_the_pixels_change_the_key():
    # The cache key's settings part (hashing.media_kind of WorkItem.media); the tower's
    # family, patch, mean and std are the tower's, which the cache key names besides.
    def kind(s):
        return hashing.media_kind(("mp4", 0, s.min_pixels, s.max_pixels, s.fps, s.min_frames, s.max_frames), "pil")

    keys = {kind(s) for s in [SMALL, replace(SMALL, fps=1.0), replace(SMALL, min_frames=2),
                              replace(SMALL, max_frames=8), replace(SMALL, max_pixels=28 * 28 * 32)]}
    assert len(keys) == 5
    assert kind(replace(SMALL, max_stream_pixels=1)) == kind(SMALL)  # a bound, not the pixels
