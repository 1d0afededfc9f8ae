#!/usr/bin/env bash
# Sets up a virtual environment in .venv with everything the worker and its tests need.
# Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

# System libraries the Mooncake transfer engine links against.
need=()
for pkg in libibverbs1 libnuma1; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
fi

py=${PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3
[ -x .venv/bin/python ] || "$py" -m venv .venv

# The non-CUDA Mooncake wheel unless an NVIDIA driver is present.
mooncake=mooncake-transfer-engine-non-cuda
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  mooncake=mooncake-transfer-engine
fi
stamp=.venv/.installed-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)-$mooncake
if [ ! -e "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch pinned first so that nothing pulls a CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q "$mooncake" -e '.[test]'
  touch "$stamp"
fi
