#!/usr/bin/env bash
# Every CPU test: single-process ones (including the example under torchrun on 2-4 ranks, the
# serving loop on 2 and 4, the timeout cases under mpiexec, the README's example and the wheel),
# then the multi-rank suite under mpiexec with 2, 3 and 4 ranks.
# tests/gpu needs a CUDA device: see docs/gpu.md for its command.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(dirname "$(command -v python)")
mpiexec=$(command -v "$bin/mpiexec" || command -v mpiexec || true)
[ -n "$mpiexec" ] || { echo "run_all.sh: mpiexec not found; pip install -e '.[test]'" >&2; exit 2; }
# The grouping kernel's CPU check runs in Triton's interpreter: here it must run, not skip (Triton
# 3.6's interpreter cannot, under NumPy >= 2.4; the test extra's newest Triton can).
export DEP_EP_REQUIRE_INTERPRETER_LOOPS=1
echo "== single-process tests"
python -m pytest -q -m "not mpi" --ignore=tests/gpu tests
for n in 2 3 4; do
  echo "== multi-rank tests on $n ranks"
  "$mpiexec" -n "$n" python -m pytest -q -p no:cacheprovider --with-mpi -m mpi --ignore=tests/gpu \
    --ignore=tests/test_pair_budget_mpi.py tests
  # The triton engine's kernels in Triton's CPU interpreter on every rank: chosen at the
  # process's start, so these run alone.
  TRITON_INTERPRET=1 "$mpiexec" -n "$n" python -m pytest -q -p no:cacheprovider --with-mpi -m mpi \
    tests/test_pair_budget_mpi.py
done
echo "== all test runs passed"
