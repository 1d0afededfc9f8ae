"""What the vLLM connector's tests and benchmark share (they run in .venv-vllm): a tiny
random-weight Qwen2.5-VL checkpoint with a locally trained tokenizer, which vLLM serves
in seconds on a CPU and which is built without a download (its vision tower is what the
worker loads with `--tower qwen2.5-vl --tower-config DIR`, so both sides hold the same
weights), and vLLM's OpenAI server started on it."""
from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np

from pipeline.runtime.background import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]

VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
              in_channels=3, patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
              window_size=56, fullatt_block_indexes=[1])

# Qwen2-VL's chat template (Qwen3-VL's tokens are the same), less its tool and system-prompt branches.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "What is in this picture? Describe the image in a few words.",
    "A cat sits on a red mat next to a small green plant.",
    "The quick brown fox jumps over the lazy dog, twice.",
    "Count the objects in the image and name their colours.",
    "user assistant system: answer briefly and precisely.",
]


QWEN3_VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                    in_channels=3, patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
                    num_position_embeddings=64, deepstack_visual_indexes=[0, 1])


def build_model(path: str, *, kind: str = "qwen2.5-vl", seed: int = 0, max_pixels: int = 112 * 112) -> str:
    """Write the checkpoint of `kind` ("qwen2.5-vl" or "qwen3-vl") into directory `path`
    (created) and return it."""
    import torch
    from transformers import Qwen2VLImageProcessor

    os.makedirs(path, exist_ok=True)
    tokenizer, ids = _tokenizer()
    image_processor = Qwen2VLImageProcessor(patch_size=14, temporal_patch_size=2, merge_size=2,
                                            min_pixels=28 * 28, max_pixels=max_pixels)
    text = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                pad_token_id=ids["<|endoftext|>"])
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=True)
    video = dict(patch_size=14, temporal_patch_size=2, merge_size=2)
    if kind == "qwen2.5-vl":
        from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                                  Qwen2VLVideoProcessor)

        cfg = Qwen2_5_VLConfig(text_config=dict(text, rope_parameters={
            "rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]), vision_config=VISION, **tokens)
        model_cls = Qwen2_5_VLForConditionalGeneration
        processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                        video_processor=Qwen2VLVideoProcessor(**video), chat_template=CHAT_TEMPLATE)
    elif kind == "qwen3-vl":
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor, Qwen3VLVideoProcessor

        cfg = Qwen3VLConfig(text_config=dict(text, head_dim=32, rope_parameters={
            "rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 6, 6], "mrope_interleaved": True}),
            vision_config=QWEN3_VISION, **tokens)
        model_cls = Qwen3VLForConditionalGeneration
        processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     video_processor=Qwen3VLVideoProcessor(**video), chat_template=CHAT_TEMPLATE)
    else:
        raise ValueError(f"kind must be qwen2.5-vl or qwen3-vl, not {kind!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _tokenizer():
    """A byte-level BPE tokenizer trained on CORPUS, with the Qwen special tokens; and their ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=SPECIAL[1:])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer, {t: tok.token_to_id(t) for t in SPECIAL}


def start_server(model_dir: str, ec_transfer_config: dict, log_path: str, *, python: str | None = None,
                 port: int | None = None, pythonpath: list[str] = (),
                 extra_args: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server on the tiny model, with this EC transfer configuration, its
    output in `log_path`: (process, URL). Wait for it with `wait_ready`."""
    port = port or free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join([*pythonpath, ROOT]))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
             "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "2048",
             "--enforce-eager", "--max-num-seqs", "4", "--seed", "0",
             "--limit-mm-per-prompt", json.dumps({"image": 2, "video": 1}),
             "--ec-transfer-config", json.dumps(ec_transfer_config), *extra_args],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return proc, f"http://127.0.0.1:{port}"


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except OSError:
        return 0


def wait_ready(proc: subprocess.Popen, url: str, log_path: str, timeout: float = 240) -> None:
    """Until the server answers /health; RuntimeError with its log's tail if it exits or never does."""
    end = time.monotonic() + timeout
    while http_status(url + "/health") != 200:
        if proc.poll() is not None or time.monotonic() > end:
            with open(log_path) as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"vLLM's server at {url} did not start:\n{tail}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def picture(seed: int, size=(56, 84)) -> str:
    """A random RGB image of `size` (height, width) as a PNG data: URL."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(model: str, part: dict, **extra) -> dict:
    """A chat request of one image part and a question: four tokens, greedy, with logprobs."""
    return {"model": model, "max_tokens": 4, "temperature": 0, "logprobs": True,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is in this picture?"}]}],
            **extra}
