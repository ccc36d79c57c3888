#!/bin/bash
# The GPU test suite on a machine with CUDA GPUs, one process per GPU: the experts backends on one
# GPU, the kernel-timeout test on two, and tests/gpu on 2, 4, ... and all GPUs.
#   pip install -e '.[gpu,test]' && bash scripts/gpu_suite.sh OUTDIR
# Logs go to OUTDIR/logs; the exit status is non-zero if any run failed. MPIRUN names the MPI
# launcher of the mpi4py in use (default: mpirun; Open MPI as root needs
# MPIRUN="mpirun --allow-run-as-root").
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=$(command -v python3)
mpirun=${MPIRUN:-mpirun}
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
[ "$gpus" -ge 1 ] || { echo "gpu_suite.sh: no CUDA GPU" >&2; exit 2; }
nvidia-smi topo -m > "$out/logs_topology.txt" 2>&1 || true
status=0
log() { bash scripts/run_logged.sh "$out" "$@" || status=1; }
log experts_gpu 400 "$py" -m pytest -q -rs -p no:cacheprovider tests/test_experts_backends.py \
  tests/test_hopper_experts.py tests/test_experts_pdl.py \
  tests/test_reference_experts.py tests/test_narrow_gemm.py
if [ "$gpus" -ge 2 ]; then
  log gpu_timeout 200 "$py" -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_timeout.py
  for n in $(bash scripts/rank_counts.sh "$gpus"); do
    log "gpu_suite_${n}gpu" 500 $mpirun -n "$n" "$py" -m pytest -q --color=no --with-mpi \
      -p no:cacheprovider tests/gpu
  done
else
  log gpu_suite_1gpu 500 $mpirun -n 1 "$py" -m pytest -q --color=no --with-mpi \
    -p no:cacheprovider tests/gpu
fi
exit "$status"
