#!/usr/bin/env bash
# Sets up .venv-tokenspeed: tokenspeed's own prefill side (the tokenspeed 0.1.1 wheel and
# the tokenspeed-mooncake fork its Mooncake engine needs, both without their dependencies),
# which tests/integrations/test_tokenspeed*.py drive in a subprocess against this worker.
#
# The wheel's full dependency set needs CUDA 13 and a GPU build of torch; the prefill side
# needs none of it on a CPU host. So this environment sees the main .venv's packages
# (torch, numpy, pyzmq, requests, ... through a .pth file, after its own) and adds only
# what tokenspeed's prefill imports and the main .venv lacks. Its stand-ins (the modules
# tokenspeed imports at module level for its GPU kernels, and a libcuda.so.1 that answers
# "no device" for tokenspeed-mooncake's engine.so) are in tests/tokenspeed_side/.
# Safe to run again: it skips what is already there. Needs scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."

TOKENSPEED=tokenspeed==0.1.1
MOONCAKE=tokenspeed-mooncake==0.3.13.post20261027
EXTRA=(msgspec==0.23.0 orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0 fastapi==0.165.0 einops==0.8.2
       compressed-tensors==0.20.1 loguru==0.7.3 nvidia-cuda-runtime==13.5.37)

[ -x .venv/bin/python ] || { echo "setup_tokenspeed.sh: run scripts/setup.sh first" >&2; exit 1; }
stamp=.venv-tokenspeed/.installed-$(cat scripts/setup_tokenspeed.sh tests/tokenspeed_side/tokenspeed_standins.py tests/tokenspeed_side/*.c | sha1sum | cut -c1-12)
[ -e "$stamp" ] && exit 0

py=$(readlink -f .venv/bin/python)
rm -rf .venv-tokenspeed
"$py" -m venv --without-pip .venv-tokenspeed
main_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ts_site=$(.venv-tokenspeed/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pip=(.venv/bin/python -m pip install -q --no-deps --target "$ts_site")
"${pip[@]}" "$TOKENSPEED" "$MOONCAKE"
"${pip[@]}" "${EXTRA[@]}"
# The stand-ins, then the main environment's packages after this one's own.
cp tests/tokenspeed_side/tokenspeed_standins.py "$ts_site/"
echo "$main_site" > "$ts_site/zz_main_venv.pth"
echo "import tokenspeed_standins" > "$ts_site/zz_tokenspeed_standins.pth"
cc -shared -fPIC -o .venv-tokenspeed/libcuda.so.1 tests/tokenspeed_side/libcuda_standin.c
touch "$stamp"
