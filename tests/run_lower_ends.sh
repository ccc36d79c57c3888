#!/usr/bin/env bash
# The tests that import CuTeDSL or FlashInfer, again with the lowest releases pyproject.toml's
# ranges admit, which the engines pin: nvidia-cutlass-dsl 4.8.0 (the `gpu` extra's >=4.8.0,<4.9;
# vLLM 0.33.0 and SGLang 0.5.23 pin it), and flashinfer-python 0.7.2.post1 (vLLM 0.33.0's pin)
# then 0.7.2 (SGLang 0.5.23's, the `trtllm` extra's >=0.7.2,<0.8). The `test` extra's pins (the
# upper ends: 4.8.1, 0.7.4) are what tests/run_all.sh runs with.
#
# Run it in the test environment after `pip install torch==2.13.0 -e '.[test]'` (.ci/run does,
# after tests/run_all.sh): it installs those releases into that environment, runs the tests, and
# installs the test extra's pins back at the end (also when a step fails).
set -euo pipefail
cd "$(dirname "$0")/.."
CUTLASS_LOWEST=4.8.0
FLASHINFER_LOWEST=(0.7.2.post1 0.7.2)
# What imports CuTeDSL (the kernels compiled for sm_90a and sm_100a) or FlashInfer (TrtllmExperts'
# weight preparation and call against FlashInfer's signature, on CPU).
TESTS=(
  tests/test_kernels_compile.py
  tests/test_trtllm_experts.py
  tests/test_checkpoint.py
  tests/test_expert_weights.py
  tests/test_experts_backends.py
)
pip_quiet() { python -m pip install -q "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }
restore() { pip_quiet torch==2.13.0 -e '.[test]'; }
trap restore EXIT
for flashinfer in "${FLASHINFER_LOWEST[@]}"; do
  echo "== nvidia-cutlass-dsl $CUTLASS_LOWEST, flashinfer-python $flashinfer"
  pip_quiet torch==2.13.0 "nvidia-cutlass-dsl[cu13]==$CUTLASS_LOWEST" "flashinfer-python==$flashinfer"
  python - "$CUTLASS_LOWEST" "$flashinfer" <<'EOF'
import sys
from importlib.metadata import version

want = {"nvidia-cutlass-dsl": sys.argv[1], "flashinfer-python": sys.argv[2], "torch": "2.13.0"}
found = {name: version(name).split("+")[0] for name in want}
if found != want:
    sys.exit(f"run_lower_ends.sh: installed {found}, expected {want}")
EOF
  python -m pytest -q -p no:cacheprovider "${TESTS[@]}"
done
echo "== the lowest releases passed"
