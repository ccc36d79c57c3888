"""EpRouted with the backend SM90 users get (`default_experts`: HopperExperts, the humming engine
where humming-kernels is installed) against the all-gather reference at K3's widths: dispatch,
the experts and combine with RMSNorm end to end, eager and in graph replay. Skips, naming the
reason, where HopperExperts cannot run."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from dep_ep.cuda_graphs import capture_graph
from dep_ep.experts import default_experts
from dep_ep.experts.hopper import HopperExperts
from dep_ep.testing import SyntheticLayer, allgather_reference
from dep_ep.testing.compare import compare_rel_l2

from helpers.cases import agreed_seed, make_case
from helpers.collective import collective_assert, expect_raises
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
    with capture_graph(graph):
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


def budget_routing(n: int, rank: int, tokens: int, seed: int, over: bool):
    """ids int32 [T, K] and weights fp32 [T, K] of this rank over K3_32. Token t takes the experts
    of m = ceil(K / E_local) consecutive ranks from rank a (K of them): a = (t + rank) % n, so
    every rank receives T * K pairs (a pair budget of skew 1.0 exactly); with `over`, a = n - 1
    for every token, so ranks n - 1, ... (m of them) receive every token's pairs, over it."""
    per_rank, topk = K3_32.experts // n, K3_32.topk
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    m = -(-topk // per_rank)
    ids = torch.empty(tokens, topk, dtype=torch.int32)
    for t in range(tokens):
        a = n - 1 if over else (t + rank) % n
        row = [
            ((a + j) % n) * per_rank + int(e)
            for j in range(m)
            for e in torch.randperm(per_rank, generator=gen)
        ]
        ids[t] = torch.tensor(row[:topk], dtype=torch.int32)
    return ids, torch.rand(tokens, topk, generator=gen), {(n - 1 + j) % n for j in range(m)}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("engine_name", ["triton", "humming-chunks"])
def test_pair_budget_overflow_fails_every_rank_eager_and_replayed(
    gpu_dep, monkeypatch, engine_name
):
    """HopperExperts (the triton engine; the humming engine in chunks of 64 pairs, deterministic,
    whose budget rounds up to whole chunks: the same here) with a pair budget of skew 1.0 (its
    floor off) inside
    EpRouted: a step whose routing puts more pairs on a rank than its budget fails on every rank,
    eager and in a CUDA graph replay: every rank's output of it is all NaN; at the documented
    point (poll() after the eager step, the next call after the replay) the overflowing ranks
    raise EpPairBudgetError naming the pairs, the budget and the tag, the others EpPeerError;
    the good steps around it are bit for bit equal (and within the bound of the all-gather
    reference). One rank holds every expert (its budget is its capacity): min_size 2."""
    from dep_ep.comm import EpPairBudgetError, EpPeerError
    from dep_ep.experts.hopper import HummingEngine, TritonEngine
    from dep_ep.experts.hopper import engine as engine_module

    if engine_name == "triton":
        engine = TritonEngine()
    elif importlib.util.find_spec("humming") is None:
        pytest.skip("the humming engine needs humming-kernels: pip install -e '.[gpu]'")
    else:
        engine = HummingEngine(chunk_pairs=64, deterministic=True)

    monkeypatch.setattr(engine_module, "PAIR_BUDGET_LEAST", 1)
    n, rank = gpu_dep.size, gpu_dep.rank
    if K3_32.experts % n:
        pytest.skip(f"{K3_32.experts} experts do not split over {n} ranks")
    seed = agreed_seed(gpu_dep.cpu_group, 61)
    layer = SyntheticLayer(K3_32, seed)
    per_rank, T, tag = K3_32.experts // n, MAX_TOKENS, 4321
    weights = layer.local_weights(rank * per_rank, per_rank).to("cuda")
    experts = HopperExperts(weights, engine=engine, pair_skew=1.0)
    budget = T * K3_32.topk  # a multiple of 64: whole chunks
    failures: list[str] = []
    if experts.max_pairs(n * T, K3_32.topk) != budget:
        failures.append(f"budget {experts.max_pairs(n * T, K3_32.topk)} != {budget}")
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    latent = torch.randn(T, K3_32.latent, generator=gen).to("cuda", torch.bfloat16)
    norm = layer.norm_weight().cuda()
    good_ids, good_probs, _ = budget_routing(n, rank, T, seed, over=False)
    over_ids, over_probs, overflowing = budget_routing(n, rank, T, seed + 1, over=True)
    good_ids, good_probs = good_ids.cuda(), good_probs.cuda()
    over_ids, over_probs = over_ids.cuda(), over_probs.cuda()

    def expect_step_error(label, call):
        if rank in overflowing:
            expected, match = (
                EpPairBudgetError,
                rf"tag {tag}: .*more than their pair budget of {budget} pairs.*Raise pair_skew",
            )
        else:
            expected, match = EpPeerError, r"had failed this step before its combine"
        expect_raises(failures, label, expected, match, call)

    with build_routed(gpu_dep) as routed:
        first = routed.routed(latent, good_ids, good_probs, norm, experts=experts, tag=tag)
        routed.synchronize()
        first = first.cpu()
        ref = allgather_reference(
            gpu_dep.cpu_group, latent, good_ids, good_probs, norm, layer.expert
        ).cpu()
        failures += compare_rel_l2(first, ref, bound_of(experts), "good step")

        def good_again(label):
            try:
                again = routed.routed(latent, good_ids, good_probs, norm, experts=experts, tag=tag)
                routed.synchronize()
                if not torch.equal(again.cpu().view(torch.int16), first.view(torch.int16)):
                    failures.append(f"{label}: the good step is not bit for bit the first one")
            except Exception as err:
                failures.append(f"{label}: {type(err).__name__}: {err}")

        # Eager: the step returns (stream-ordered); poll() after the stream raises.
        out = routed.routed(latent, over_ids, over_probs, norm, experts=experts, tag=tag)
        torch.cuda.synchronize()
        if not out.isnan().all():
            failures.append("eager overflow: an output element is not NaN")
        expect_step_error("eager overflow, poll()", routed.poll)
        good_again("after the eager overflow")
        # Graph: the warm-up (an overflow too) raises at synchronize(); the replay at the next call.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            routed.routed(latent, over_ids, over_probs, norm, experts=experts, tag=tag)
        torch.cuda.current_stream().wait_stream(side)
        expect_step_error("warm-up overflow, synchronize()", routed.synchronize)
        dist.barrier(gpu_dep.cpu_group)
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph):
            captured = routed.routed(latent, over_ids, over_probs, norm, experts=experts, tag=tag)
        for replay in range(2):
            graph.replay()
            torch.cuda.synchronize()
            if not captured.isnan().all():
                failures.append(f"replay {replay}: an output element is not NaN")
            expect_step_error(
                f"replay {replay}, the next call",
                lambda: routed.routed(latent, good_ids, good_probs, norm, experts=experts, tag=tag),
            )
            good_again(f"after replay {replay}")
    collective_assert(gpu_dep.cpu_group, failures, seeds={"layer and routing": seed})
