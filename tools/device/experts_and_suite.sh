#!/bin/bash
# Device call: experts backends on the GPU, their benchmark, and the GPU suite with one process per
# GPU on 2, 4, ... and all GPUs of the machine. Needs /tmp/site/env.sh (../shared/device/README.md).
. /tmp/site/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
py=$(which python3)
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
log=tools/device/run_logged.sh
bash $log experts_backends_gpu 240 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/test_experts_backends.py tests/test_reference_experts.py
mkdir -p "$OUT/docs"
bash $log bench_experts 300 python3 bench/bench_experts.py --out "$OUT/docs"
for n in $(bash tools/device/rank_counts.sh "$gpus"); do
  bash $log "gpu_suite_${n}gpu" 300 /usr/bin/mpirun --allow-run-as-root --oversubscribe -n "$n" \
    "$py" -m pytest -q --color=no --with-mpi -p no:cacheprovider tests/gpu/test_gpu_kernels.py
done
