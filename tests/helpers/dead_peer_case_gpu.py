"""Whole processes on CUDA (they may share one GPU): rank 1 dies (SIGKILL) while rank 0's kernels
of a step wait for it. Rank 0's synchronize() must raise EpPeerLostError naming rank 1 within 1 s
of the death (the peer watch ends the kernels' waits; the timeout is 20 s), and poll() after it
too. Run by tests/gpu/test_gpu_dead_peer.py with torchrun-style variables and no launcher:

    python -m helpers.dead_peer_case_gpu
"""

import os
import signal
import time

import torch
import torch.distributed as dist

from dep_ep.config import TINY
from dep_ep.experts import DenseExperts
from dep_ep.launch import init_rank_context, new_dep_group
from dep_ep.testing import SyntheticLayer

from helpers.cases import make_case, tiny_routed

TIMEOUT_S = 20.0
DIES_AFTER_S = 0.5

ctx = init_rank_context("cuda", timeout_s=60.0)
dep = new_dep_group(ctx, ctx.world_size)
rank, n = dep.rank, dep.size
layer = SyntheticLayer(TINY, 3)
per_rank = TINY.experts // n
experts = DenseExperts(layer.local_weights(rank * per_rank, per_rank).to("cuda"))
routed = tiny_routed(dep.cpu_group, 8, "cuda", TIMEOUT_S)
case = make_case(TINY, n, 8, 5)
args = [t.cuda() for t in (case.latent[rank], case.ids[rank], case.weights[rank])]
norm = layer.norm_weight().cuda()
routed(*args, norm, experts=experts)
routed.synchronize()
dist.barrier(dep.cpu_group)
print(f"READY rank {rank}", flush=True)
if rank == 1:
    time.sleep(DIES_AFTER_S)
    os.kill(os.getpid(), signal.SIGKILL)
died = time.monotonic() + DIES_AFTER_S
routed(*args, norm, experts=experts)  # its kernels wait for rank 1, which is about to die
for label, call in (("synchronize", routed.synchronize), ("poll", routed.poll)):
    try:
        call()
        print(f"RESULT rank {rank} {label}: no error", flush=True)
    except BaseException as err:  # the test reads the type
        took = time.monotonic() - died
        message = str(err).replace("\n", " ")
        print(
            f"RESULT rank {rank} {label}: {type(err).__name__} after {took:.3f} s: {message}",
            flush=True,
        )
torch.cuda.synchronize()
os._exit(0)  # a group with a dead member cannot be torn down collectively
