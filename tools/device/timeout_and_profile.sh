#!/bin/bash
# Device call: the kernel-timeout test on this machine's GPUs (two ranks), then a profile of
# ReferenceExperts at K3 geometry. Needs /tmp/site/env.sh.
. /tmp/site/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
log=tools/device/run_logged.sh
bash $log "gpu_timeout_${gpus}gpu" 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_timeout.py
bash $log profile_experts 200 python3 bench/profile_experts.py --local 56 --tokens 1 256
