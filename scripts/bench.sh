#!/bin/bash
# The benchmarks on a machine with CUDA GPUs, one process per GPU, each run from the repository
# root as the module bench.<name>; each writes its results page (bench/report.py: tables, a plot)
# into OUTDIR (docs/results holds the published pages: OUTDIR=docs/results rewrites them):
#   pip install -e '.[gpu,test]' && bash scripts/bench.sh OUTDIR
# bench_ep (EP=1 on GPU 0), bench_experts, bench_narrow_gemm (the narrow GEMM against humming's),
# bench_construction, bench_layer and bench_integration
# (what the vLLM / SGLang integrations and the custom op add per layer call; GPU 0), and with
# >= 2 GPUs the store + flag ping-pong, the NVLink write ceiling, bench_dep (three routings),
# bench_layer and bench_routed_experts (the routed path with real experts) on 2, 4, ... and all
# GPUs, the K3 example on all GPUs.
# Logs go to OUTDIR/logs; the exit status is non-zero if any run failed.
set -uo pipefail
out=${1:?usage: bench.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=$(command -v python3)
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
[ "$gpus" -ge 1 ] || { echo "bench.sh: no CUDA GPU" >&2; exit 2; }
status=0
log() { bash scripts/run_logged.sh "$out" "$@" || status=1; }
CUDA_VISIBLE_DEVICES=0 log bench_ep1 300 "$py" -m bench.bench_ep --out "$out"
CUDA_VISIBLE_DEVICES=0 log bench_experts 600 "$py" -m bench.bench_experts --out "$out"
CUDA_VISIBLE_DEVICES=0 log bench_narrow_gemm 200 "$py" -m bench.bench_narrow_gemm --out "$out"
one="$py -m torch.distributed.run --nproc-per-node 1"
CUDA_VISIBLE_DEVICES=0 log bench_construction 200 $one -m bench.bench_construction --out "$out"
CUDA_VISIBLE_DEVICES=0 log bench_layer1 300 $one -m bench.bench_layer --out "$out"
CUDA_VISIBLE_DEVICES=0 log bench_integration 600 $one -m bench.bench_integration --out "$out"
if [ "$gpus" -ge 2 ]; then
  run="$py -m torch.distributed.run"
  log pingpong 120 $run --nproc-per-node 2 -m bench.pingpong --out "$out"
  log nvlink_ceiling 200 $run --nproc-per-node 2 -m bench.nvlink_ceiling --out "$out"
  for n in $(bash scripts/rank_counts.sh "$gpus"); do
    log "bench_dep${n}" 600 $run --nproc-per-node "$n" -m bench.bench_dep --out "$out"
    log "bench_layer${n}" 300 $run --nproc-per-node "$n" -m bench.bench_layer --out "$out/layer$n"
    log "bench_routed_experts${n}" 400 $run --nproc-per-node "$n" -m bench.bench_routed_experts \
      --out "$out"
  done
  log "example_k3_${gpus}gpu" 200 $run --nproc-per-node "$gpus" examples/dep_layer.py --steps 3
fi
exit "$status"
