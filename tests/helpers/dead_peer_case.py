"""Whole processes: one rank dies (SIGKILL) while the others use EpRouted. Run by
tests/test_recovery_processes.py with torchrun-style variables (RANK, WORLD_SIZE, MASTER_PORT)
set per process and no launcher, so nothing else reacts to the death:

    python -m helpers.dead_peer_case VICTIM WHEN     (WHEN: idle | waiting)

idle: the victim dies between two steps and the others call 0.5 s later; waiting: the others
are already inside the next step's dispatch when the victim dies (0.5 s after they called).
Each survivor prints one RESULT line per call: the error's type, the seconds from the cause (the
death, or the call when the victim was dead already) to the error, and its message.
"""

import os
import signal
import sys
import time

import torch.distributed as dist

from dep_ep.config import TINY
from dep_ep.launch import init_rank_context, new_dep_group
from dep_ep.testing import SyntheticLayer

from helpers.cases import tiny_routed
from helpers.recovery import Batches

TIMEOUT_S = 20.0  # far above the 1 s the survivors must take: their error is not a timeout
DIES_AFTER_S = 0.5

victim, when = int(sys.argv[1]), sys.argv[2]
ctx = init_rank_context("cpu", timeout_s=30.0)
dep = new_dep_group(ctx, ctx.world_size)
layer = SyntheticLayer(TINY, 7)
batches = Batches(dep, layer, 11, 4)
routed = tiny_routed(dep.cpu_group, 4, "cpu", TIMEOUT_S)
batches.run(routed, 0)
dist.barrier(dep.cpu_group)  # every rank is past step 0 before the victim dies
print(f"READY rank {dep.rank}", flush=True)
if dep.rank == victim:
    if when == "waiting":
        time.sleep(DIES_AFTER_S)
    os.kill(os.getpid(), signal.SIGKILL)
# The cause: the victim's death (waiting), or this rank's call after it (idle).
cause = time.monotonic() + DIES_AFTER_S
if when == "idle":
    time.sleep(DIES_AFTER_S)
for call in (1, 2):
    if when == "idle" or call == 2:
        cause = time.monotonic()
    try:
        batches.run(routed, call)
        print(f"RESULT rank {dep.rank} call {call}: no error", flush=True)
    except BaseException as err:  # the test reads the type
        took = time.monotonic() - cause
        message = str(err).replace("\n", " ")
        print(
            f"RESULT rank {dep.rank} call {call}: {type(err).__name__} after {took:.3f} s:"
            f" {message}",
            flush=True,
        )
os._exit(0)  # a group with a dead member cannot be torn down collectively
