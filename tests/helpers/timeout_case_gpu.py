"""Two CUDA ranks, rank 1 skips a dispatch. Rank 0's dispatch kernel must stop after the timeout
and `synchronize()` must raise EpTimeoutError naming rank 0, phase 'dispatch' and rank 1. Then
both ranks close and rebuild the buffers, and a correct call matches the reference. Prints one
RESULT line per rank.

    cd tests && python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m helpers.timeout_case_gpu
"""

import time

from dep_ep.comm import EpTimeoutError
from dep_ep.ep import TINY
from dep_ep.experts import ReferenceExperts
from dep_ep.launch import init_rank_context, new_dep_group, teardown
from dep_ep.testing import SyntheticLayer, allgather_reference
from dep_ep.testing.compare import compare

from helpers.cases import make_case, tiny_routed

TIMEOUT_S = 2.0

ctx = init_rank_context("cuda", timeout_s=120.0)
dep = new_dep_group(ctx, ctx.world_size)
rank, n = dep.rank, dep.size
layer = SyntheticLayer(TINY, 0)
per_rank = TINY.experts // n
experts = ReferenceExperts(layer.local_weights(rank * per_rank, per_rank).to("cuda"))
case = make_case(TINY, n, 8, 1)
inputs = [t.cuda() for t in (case.latent[rank], case.ids[rank], case.weights[rank])]


def build():
    return tiny_routed(dep.cpu_group, 8, "cuda", TIMEOUT_S)


routed = build()
outcome = "no error"
if rank == 1:
    time.sleep(3 * TIMEOUT_S)  # skips the dispatch
else:
    start = time.monotonic()
    routed.dispatch(*inputs)
    try:
        routed.synchronize()
    except EpTimeoutError as err:
        outcome = f"EpTimeoutError after {time.monotonic() - start:.1f}s: {err}"
routed.close()  # collective: both ranks arrive here
routed = build()
out = routed.routed(*inputs, layer.norm_weight().cuda(), experts=experts)
routed.synchronize()
ref = allgather_reference(
    dep.cpu_group,
    case.latent[rank],
    case.ids[rank],
    case.weights[rank],
    layer.norm_weight(),
    layer.expert,
)
after = compare(out.cpu(), ref, "after rebuild") or ["ok"]
print(f"RESULT rank {rank}: {outcome}; rebuilt: {'; '.join(after)}", flush=True)
routed.close()
teardown(ctx)
