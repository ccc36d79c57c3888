#!/bin/bash
# Stages flashinfer-python (and the pure-Python / small deps its import and JIT need) for the lent
# H200 (Python 3.12) in two git-ignored folders, .stage/fi1 and .stage/fi2, each under the 64 MiB
# one device call may carry. Run it after ../shared/device/stage.sh (which empties .stage/); on
# the device, after that script's two calls, on the same warm machine:
#   run carry=[.stage/fi1] 'mkdir -p /tmp/stage_fi && cp .stage/fi1/* /tmp/stage_fi/'
#   run carry=[.stage/fi2] 'bash .stage/fi2/install_flashinfer.sh && . /tmp/site/env.sh && ...'
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
version=${FLASHINFER:-0.7.4}
cache=${STAGE_CACHE:-$HOME/.cache/ep-stage}
mkdir -p "$cache"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$cache" "flashinfer-python==$version" \
  apache-tvm-ffi==0.1.15.post2 einops tabulate click ninja nvidia-ml-py 2>&1 \
  | grep -v '^WARNING: Location' || true
wheel=$(ls "$cache"/flashinfer_python-"$version"-*.whl)
rm -rf .stage/fi1 .stage/fi2 && mkdir -p .stage/fi1 .stage/fi2
split -b 52000000 "$wheel" .stage/fi1/part.
mv .stage/fi1/part.ab .stage/fi2/
basename "$wheel" > .stage/fi2/big.name
for w in apache_tvm_ffi einops tabulate click ninja nvidia_ml_py; do cp "$cache"/$w-*.whl .stage/fi2/; done
cp tools/device/install_flashinfer.sh .stage/fi2/
du -sh .stage/fi1 .stage/fi2
