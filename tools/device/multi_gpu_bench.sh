#!/bin/bash
# Device call on a machine with >= 2 GPUs: ping-pong latency floor, the DEP benchmark against the
# NCCL baselines on 2, 4, ... and all GPUs, the K3 example on all, one process per GPU. Needs
# /tmp/site/env.sh.
. /tmp/site/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
log=tools/device/run_logged.sh
mkdir -p "$OUT/docs"
bash $log pingpong 120 python3 -m torch.distributed.run --nproc-per-node 2 bench/pingpong.py \
  --out "$OUT/docs/pingpong.md"
for n in $(bash tools/device/rank_counts.sh "$gpus"); do
  bash $log "bench_dep${n}" 150 python3 -m torch.distributed.run --nproc-per-node "$n" \
    bench/bench_dep.py --out "$OUT/docs"
done
bash $log "example_k3_${gpus}gpu" 150 python3 -m torch.distributed.run --nproc-per-node "$gpus" \
  examples/dep_layer.py --steps 3
