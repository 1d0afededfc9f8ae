#!/usr/bin/env bash
# Sets up a virtual environment in .venv with everything the worker and its tests need;
# with --engines, also the tokenspeed and vLLM environments (.venv-tokenspeed, .venv-vllm).
# Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3

# System libraries the Mooncake transfer engine links against.
need=()
for pkg in libibverbs1 libnuma1; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
# A C compiler and the Python headers: the install builds ipc._ordering (ipc/ordering.c).
command -v cc >/dev/null 2>&1 || need+=(gcc)
"$py" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || need+=("$(basename "$(readlink -f "$(command -v "$py")")")-dev")
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
fi

[ -x .venv/bin/python ] || "$py" -m venv .venv

# The Mooncake build (pyproject's extras) by the CUDA version the NVIDIA driver reports:
# 13 -> cuda13, 12 -> cuda12; none (or an older one, for which no wheel is built) -> cpu.
mooncake=cpu
if command -v nvidia-smi >/dev/null 2>&1 && cuda=$(nvidia-smi 2>/dev/null); then
  case "$(grep -o 'CUDA Version: *[0-9]*' <<<"$cuda" | grep -o '[0-9]*$' || true)" in
    13) mooncake=cuda13 ;;
    12) mooncake=cuda12 ;;
    *) echo "setup.sh: no Mooncake build for this driver's CUDA version; using the non-CUDA one" >&2 ;;
  esac
fi
stamp=.venv/.installed-$(cat pyproject.toml scripts/setup.sh ipc/ordering.c | sha1sum | cut -c1-12)-$mooncake
if [ ! -e "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch pinned first, so that [tower]'s range is already met and nothing pulls a CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0
  # The three builds share the import name mooncake: keep only the one chosen.
  others=()
  for build in cpu:mooncake-transfer-engine-non-cuda cuda12:mooncake-transfer-engine \
               cuda13:mooncake-transfer-engine-cuda13; do
    [ "${build%%:*}" = "$mooncake" ] || others+=("${build#*:}")
  done
  .venv/bin/python -m pip uninstall -q -y "${others[@]}" 2>/dev/null || true
  .venv/bin/python -m pip install -q -e ".[$mooncake,tower,tokenspeed,test]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi

# --engines: also the environments of the serving engines the tests run against
# (tokenspeed's prefill side, vLLM's CPU build), each apart from .venv.
if [ "${1:-}" = "--engines" ]; then
  scripts/setup_tokenspeed.sh
  scripts/setup_vllm.sh
fi
