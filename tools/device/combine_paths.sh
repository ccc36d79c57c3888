#!/bin/bash
# Device call (>= 2 GPUs): the GPU suite (both combine paths), then the combine crossover: EP=1
# and EP=<GPUs> benchmarks with the combine forced to one launch and to two launches.
. /tmp/site/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
py=$(which python3)
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
log=tools/device/run_logged.sh
mkdir -p "$OUT/docs"
bash $log "gpu_suite_${gpus}gpu" 300 /usr/bin/mpirun --allow-run-as-root --oversubscribe -n "$gpus" \
  "$py" -m pytest -q --color=no --with-mpi -p no:cacheprovider tests/gpu/test_gpu_kernels.py
tokens="16 64 256 512 1024 2048 4096"
for force in 0 1073741824; do
  CUDA_VISIBLE_DEVICES=0 bash $log "bench_ep1_split$force" 150 python3 bench/bench_ep.py \
    --out "$OUT/docs" --tokens $tokens --combine-split-min-tokens $force
  bash $log "bench_dep${gpus}_split$force" 150 python3 -m torch.distributed.run \
    --nproc-per-node "$gpus" bench/bench_dep.py --out "$OUT/docs" --tokens $tokens \
    --combine-split-min-tokens $force
done
