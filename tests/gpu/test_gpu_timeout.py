"""A skipped dispatch on CUDA ranks times out, names rank, phase and peer, and the rebuilt buffers
work: helpers/timeout_case_gpu.py on two fresh ranks of its own (torchrun), launched by group
rank 0 while the other ranks of the suite wait in the collective assertion. Not marked `mpi`: it
runs in the GPU suite under mpirun (every rank takes part; rank 0 launches) and alone, without
mpirun, as one rank (python -m pytest tests/gpu/test_gpu_timeout.py)."""

import os
import re
import subprocess
import sys

import torch.distributed as dist

from helpers.collective import collective_assert

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The child ranks are torchrun's: launcher variables of the MPI job around this one stay out.
LAUNCHER_VARIABLES = (
    "OMPI_",
    "PMI_",
    "PMIX_",
    "MPI_",
    "HYDRA_",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def timeout_case_failures() -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "helpers.timeout_case_gpu",
    ]
    try:
        proc = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as err:
        return [f"the timeout case ran over {err.timeout}s"]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    if len(lines) != 2:
        return [f"{len(lines)} RESULT lines: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"]
    failures = []
    if "RESULT rank 0: EpTimeoutError" not in lines[0]:
        failures.append(f"rank 0 did not time out: {lines[0]}")
    elif "rank 0: timed out in phase 'dispatch' waiting for rank 1" not in lines[0]:
        failures.append(f"rank 0's error lacks rank, phase or peer: {lines[0]}")
    else:
        took = float(re.search(r"after ([\d.]+)s", lines[0]).group(1))
        if not 1.5 < took < 10:
            failures.append(f"rank 0 waited {took}s with a 2 s timeout")
    for line in lines:
        if not line.endswith("rebuilt: ok"):
            failures.append(f"after the rebuild: {line}")
    return failures


def test_skipped_dispatch_times_out_then_rebuild_works(gpu_dep):
    failures = timeout_case_failures() if dist.get_rank(gpu_dep.cpu_group) == 0 else []
    collective_assert(gpu_dep.cpu_group, failures, seeds={"case": 1, "layer": 0})
