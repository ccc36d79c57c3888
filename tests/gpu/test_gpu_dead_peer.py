"""A CUDA rank that dies while its peer's kernels wait for it: the survivor's synchronize() and
poll() raise EpPeerLostError naming it within 1 s of the death (helpers/dead_peer_case_gpu.py,
two processes of their own started without a launcher). Not marked `mpi`: group rank 0 of the
suite runs the case while the other ranks wait in the collective assertion; alone, without
mpirun, it runs as one rank (python -m pytest tests/gpu/test_gpu_dead_peer.py).

Before the peer watch (main at 6f889cd): the survivor's kernels waited out the 20 s timeout and
synchronize() then raised EpTimeoutError."""

import os
import re
import socket
import subprocess
import sys

import torch.distributed as dist

from helpers.collective import collective_assert

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def dead_peer_failures() -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    procs = []
    for rank in range(2):
        env = {
            **base,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "helpers.dead_peer_case_gpu"],
                cwd=TESTS,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return ["the dead-peer case ran over 240 s"]
    lines = [line for out in outputs for line in out.splitlines() if line.startswith("RESULT")]
    failures = []
    for label in ("synchronize", "poll"):
        found = [line for line in lines if line.startswith(f"RESULT rank 0 {label}:")]
        if len(found) != 1:
            failures.append(f"{label}: {lines} {outputs[0][-2000:]}")
            continue
        line = found[0]
        if "EpPeerLostError" not in line or "rank 1" not in line.split(":", 1)[1]:
            failures.append(f"{label}: {line}")
        took = float(re.search(r"after (-?[\d.]+) s", line).group(1))
        print(f"TIME-TO-ERROR dead peer, rank 0 {label}: {took:.3f} s after the death")
        if took > 1.0:
            failures.append(f"{label}: {took:.2f} s from the death to the error: {line}")
    return failures


def test_dead_peer_ends_the_waits_and_is_named(gpu_dep):
    failures = dead_peer_failures() if dist.get_rank(gpu_dep.cpu_group) == 0 else []
    collective_assert(gpu_dep.cpu_group, failures, seeds=None)
