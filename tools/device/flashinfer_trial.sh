#!/bin/bash
# Device call after install_flashinfer.sh: FlashInfer's scale interleave against our layout model
# (JIT-compiles FlashInfer's SM90 FP4 quantization module), then the bounded build trial of the
# SM90 cutlass_fused_moe module (bench/try_cutlass_sm90.py).
. /tmp/site/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
export FLASHINFER_CUDA_ARCH_LIST="9.0a" MAX_JOBS=$(nproc)
log=tools/device/run_logged.sh
bash $log trtllm_helpers_gpu 200 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/test_trtllm_experts.py tests/test_experts_backends.py -k "trtllm or interleave"
bash $log cutlass_sm90_build "${TRIAL_S:-380}" python3 bench/try_cutlass_sm90.py \
  --deadline "${DEADLINE_S:-330}" --out "$OUT/runs/cutlass_sm90_build.json"
