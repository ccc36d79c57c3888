"""Whole processes under torchrun: SIGTERM arrives while an EpRouted is being built, after rank
0 created its shared-memory file and before rank 1 created its own. Rank 1 is held there (its
os.open of a dep-ep file sleeps). tests/test_recovery_processes.py sends the SIGTERM to torchrun
(which forwards it) and then looks for files left in /dev/shm.

    torchrun --nproc-per-node 2 -m helpers.sigterm_case
"""

import os
import time

from dep_ep.comm.shm import SHM_PREFIX
from dep_ep.launch import init_rank_context, new_dep_group

from helpers.cases import tiny_routed

ctx = init_rank_context("cpu", timeout_s=60.0)
dep = new_dep_group(ctx, ctx.world_size)
if dep.rank == 1:
    real_open = os.open

    def held_open(path, *args, **kwargs):
        if SHM_PREFIX in os.fspath(path):
            time.sleep(60.0)
        return real_open(path, *args, **kwargs)

    os.open = held_open
print(f"BUILDING rank {dep.rank}", flush=True)
tiny_routed(dep.cpu_group, 4, "cpu", 60.0)
print(f"BUILT rank {dep.rank}", flush=True)
