"""Two CPU ranks, rank 1 skips a dispatch: rank 0 must raise EpTimeoutError naming the rank, the
phase and the peer, within the configured timeout, then closes its EpRouted; rank 1, calling
late, must raise an error naming rank 0 (it gave the dispatch up), never a result.
Prints one RESULT line per rank.

    cd tests && mpiexec -n 2 python -m helpers.timeout_case_cpu
"""

import time

import torch

from dep_ep.comm.errors import EpError
from dep_ep.ep import TINY
from dep_ep.experts import ReferenceExperts
from dep_ep.launch import init_rank_context, new_dep_group
from dep_ep.testing import SyntheticLayer

from helpers.cases import tiny_routed

TIMEOUT_S = 3.0

ctx = init_rank_context("cpu", timeout_s=30.0)
dep = new_dep_group(ctx, ctx.world_size)
layer = SyntheticLayer(TINY, 0)
per_rank = TINY.experts // dep.size
experts = ReferenceExperts(layer.local_weights(dep.rank * per_rank, per_rank))
routed = tiny_routed(dep.cpu_group, 4, "cpu", TIMEOUT_S)
latent = torch.randn(4, TINY.latent).bfloat16()
ids = torch.randint(0, TINY.experts, (4, TINY.topk), dtype=torch.int32)
weights = torch.full((4, TINY.topk), 1.0 / TINY.topk)
if dep.rank == 1:
    time.sleep(2 * TIMEOUT_S)  # skips the first dispatch
start = time.monotonic()
try:
    routed.routed(latent, ids, weights, layer.norm_weight(), experts=experts)
    print(f"RESULT rank {dep.rank}: no error", flush=True)
except EpError as err:
    took = time.monotonic() - start
    print(f"RESULT rank {dep.rank}: {type(err).__name__} after {took:.1f}s: {err}", flush=True)
routed.close()
