"""ipc/media.py with backend "torchvision" against Hugging Face's Qwen2-VL image
processor with its torchvision backend, bit for bit: the processor vLLM 0.32 gets from
transformers where torchvision is installed. torchvision lives in .venv-vllm only, so
the reference runs there (tests/ipc/test_media.py's corpus and settings, the same
loader), and the worker's side runs there too, on the same torch."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

CHECK = """
import sys
from dataclasses import replace
sys.path[:0] = [".", "tests/ipc"]
import numpy as np
import test_media as tm
from ipc import media
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

equal, differ = 0, []
for name, (data, fmt) in tm.CORPUS.items():
    for label, s in tm.SETTINGS.items():
        s = replace(s, backend="torchvision")
        proc = Qwen2VLImageProcessor(
            patch_size=s.patch, merge_size=s.merge, temporal_patch_size=s.temporal_patch,
            size={"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels},
            image_mean=list(s.mean), image_std=list(s.std))
        ref = proc(images=[tm.vllm_load(data)], return_tensors="np")
        got, grid = media.preprocess(data, fmt, s)
        if (got.shape == ref["pixel_values"].shape and np.array_equal(got, ref["pixel_values"])
                and list(grid) == ref["image_grid_thw"][0].tolist()):
            equal += 1
        else:
            differ.append(f"{name}/{label}")
print("equal", equal, "differ", differ)
sys.exit(1 if differ or not equal else 0)
"""


@pytest.mark.long
def test_pixels_equal_the_torchvision_backend():
    assert VLLM_PYTHON.exists(), (
        f"{VLLM_PYTHON} is missing: the reference runs in vLLM's environment, which has torchvision; "
        f"build it with scripts/setup_vllm.sh")
    proc = subprocess.run([str(VLLM_PYTHON), "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "differ []" in proc.stdout, proc.stdout


def test_the_backend_is_in_the_cache_key():
    from ipc import hashing

    image = ("jpeg", 0, 56 * 56, 28 * 28 * 1280)
    assert hashing.media_kind(image, "pil") != hashing.media_kind(image, "torchvision")
