"""EpRouted with the backend SM90 users get (`default_experts`: HopperExperts, the humming engine
where humming-kernels is installed) against the all-gather reference at K3's widths: dispatch,
the experts and combine with RMSNorm end to end, eager and in graph replay. Skips, naming the
reason, where HopperExperts cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dep_ep.experts import default_experts
from dep_ep.experts.hopper import HopperExperts
from dep_ep.testing import SyntheticLayer, allgather_reference
from dep_ep.testing.compare import compare_rel_l2

from helpers.cases import agreed_seed, make_case
from helpers.collective import collective_assert
from helpers.k3_32 import K3_32, MAX_TOKENS, bound_of, build_routed


def hopper_gap() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    return HopperExperts.unsupported_reason(torch.device("cuda"))


pytestmark = pytest.mark.skipif(hopper_gap() is not None, reason=f"HopperExperts: {hopper_gap()}")


@pytest.fixture(scope="module")
def routed_k3(gpu_dep):
    routed = build_routed(gpu_dep)
    yield routed
    routed.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "tokens,routing", [(1, "random"), (MAX_TOKENS, "random"), (9, "padded"), (10, "nan")]
)
def test_routed_with_default_experts_matches_allgather_reference(
    gpu_dep, routed_k3, tokens, routing
):
    n, rank = gpu_dep.size, gpu_dep.rank
    seed = agreed_seed(gpu_dep.cpu_group, 31)
    layer = SyntheticLayer(K3_32, seed)
    per_rank = K3_32.experts // n
    experts = default_experts(layer.local_weights(rank * per_rank, per_rank).to("cuda"))
    failures = []
    if type(experts) is not HopperExperts:
        failures.append(f"default_experts gave {type(experts).__name__} on SM90")
    case = make_case(K3_32, n, tokens, seed, routing)
    latent, ids, probs = (t.cuda() for t in (case.latent[rank], case.ids[rank], case.weights[rank]))
    norm = layer.norm_weight().cuda()
    out = routed_k3.routed(latent, ids, probs, norm, experts=experts)
    routed_k3.synchronize()
    eager = out.cpu()  # out may live in EpRouted's buffers, which the next call reuses
    ref = allgather_reference(gpu_dep.cpu_group, latent, ids, probs, norm, layer.expert).cpu()
    label = f"T={tokens} {routing} {type(experts).__name__} {getattr(experts, 'engine', '')}"
    failures += compare_rel_l2(eager, ref, bound_of(experts), label)
    # The same call captured in a CUDA graph (after a warm-up on the capture's stream) and
    # replayed: within the bound too, and bit for bit the eager output where the backend
    # promises reruns bitwise equal (humming's default may use stream-K).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        routed_k3.routed(latent, ids, probs, norm, experts=experts)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier(gpu_dep.cpu_group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = routed_k3.routed(latent, ids, probs, norm, experts=experts)
    graph.replay()
    routed_k3.synchronize()
    replayed = captured.cpu()
    failures += compare_rel_l2(replayed, ref, bound_of(experts), f"{label}, graph replay")
    nan = eager.isnan()
    same = torch.equal(nan, replayed.isnan()) and torch.equal(
        eager.view(torch.int16)[~nan], replayed.view(torch.int16)[~nan]
    )
    if getattr(experts, "deterministic", True) and not same:
        failures.append(f"{label}: graph replay differs from the eager call")
    collective_assert(gpu_dep.cpu_group, failures, seeds={"layer and case": seed})
