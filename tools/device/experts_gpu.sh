#!/bin/bash
# Device call: the experts backends on the GPU against the all-gather reference, their benchmark
# and profile. Needs /tmp/site/env.sh.
. /tmp/site/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
log=tools/device/run_logged.sh
mkdir -p "$OUT/docs"
bash $log experts_backends_gpu 240 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/test_experts_backends.py tests/test_reference_experts.py
bash $log bench_experts 300 python3 bench/bench_experts.py --out "$OUT/docs"
bash $log profile_experts 200 python3 bench/profile_experts.py --local 56 --tokens 1 256
