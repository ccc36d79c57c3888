"""A step over one rank's pair budget fails on every rank (CPU ranks, the host transport): the
triton engine's kernels run in Triton's CPU interpreter on each rank, behind EpRouted. The rank
whose experts received more (row, local expert) pairs than their budget raises
EpPairBudgetError naming the pairs, the budget, the tag and the fix, every other rank
EpPeerError naming it, in the same call; the next step, within the budget, is correct.
docs/reliability.md lists the case."""

from __future__ import annotations

import os

import pytest
import torch

from dep_ep.comm import EpPairBudgetError, EpPeerError
from dep_ep.config import EpConfig, MoeGeometry
from dep_ep.ep import EpRouted
from dep_ep.experts import ExpertsBackend
from dep_ep.experts.hopper import TritonEngine
from dep_ep.experts.hopper import engine as engine_module
from dep_ep.testing import SyntheticLayer, allgather_reference
from dep_ep.testing.compare import compare

from helpers.cases import agreed_seed
from helpers.collective import collective_assert, expect_raises
from helpers.hopper_interpreter_case import TILES  # small blocks, fp32 math

# Triton chooses its interpreter when a kernel is decorated, at the first import of its module,
# and its own helpers (tl.*) must be interpreted alike: the whole process needs TRITON_INTERPRET=1
# from its start. tests/run_all.sh runs this file alone so; the multi-rank run of every other
# file, whose kernels compile for a GPU, skips it.
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs TRITON_INTERPRET=1 for the whole process: TRITON_INTERPRET=1 mpiexec -n 2"
    " python -m pytest --with-mpi -m mpi tests/test_pair_budget_mpi.py (tests/run_all.sh does)",
)

PER_RANK, TOPK, T, TAG = 4, 4, 8, 1234


def geometry(num_ranks: int) -> MoeGeometry:
    return MoeGeometry(
        "budget", hidden=256, latent=128, experts=PER_RANK * num_ranks, topk=TOPK, intermediate=64
    )


class InterpretedTritonExperts(ExpertsBackend):
    """The triton engine's prepared call (TritonPrepared: grouping, FC1, FC2, finalize) on CPU
    tensors, as HopperExperts runs it on a GPU, with a pair budget of `skew`: HopperExperts
    itself refuses a CPU device."""

    device_failures = True

    def __init__(self, weights, skew: float):
        self._take_weights(weights)
        self.prepared = TritonEngine(tiles=TILES).prepare("test", weights, 1, skew)

    def forward(self, x, sf, ids, weights, out, failure=None):
        return self.prepared(x, sf, ids, weights, out, failure=failure)


def step_inputs(layer, rank: int, num_ranks: int, seed: int, over: int | None):
    """latent bf16 [T, L], ids int32 [T, K], weights fp32 [T, K] of this rank. over=None: token t
    takes the K experts of rank (t + rank) % N, so every rank receives T tokens, T * K pairs (its
    budget exactly); over=d: every token of every rank takes rank d's experts (N * T * K pairs
    there, none elsewhere)."""
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    latent = torch.randn(T, layer.geometry.latent, generator=gen).to(torch.bfloat16)
    owner = torch.full((T,), over) if over is not None else (torch.arange(T) + rank) % num_ranks
    order = torch.stack([torch.randperm(PER_RANK, generator=gen)[:TOPK] for _ in range(T)])
    ids = (owner[:, None] * PER_RANK + order).int()
    weights = torch.rand(T, TOPK, generator=gen)
    return latent, ids, weights


@pytest.mark.mpi(min_size=2)
def test_pair_budget_overflow_fails_the_step_on_every_rank(dep, monkeypatch):
    from dep_ep.experts.hopper import kernels

    compiled = [n for n, v in vars(kernels).items() if type(v).__name__ == "JITFunction"]
    assert not compiled, f"the triton kernels {compiled} were decorated for a GPU, not interpreted"
    # The budget's floor off: a budget of skew * mean pairs, 32 here (T * K * N * 4 / (4 * N)).
    monkeypatch.setattr(engine_module, "PAIR_BUDGET_LEAST", 1)
    n, rank = dep.size, dep.rank
    seed = agreed_seed(dep.cpu_group, 77)
    layer = SyntheticLayer(geometry(n), seed)
    experts = InterpretedTritonExperts(layer.local_weights(rank * PER_RANK, PER_RANK), 1.0)
    budget = T * TOPK
    assert experts.prepared.max_pairs(n * T, TOPK) == budget
    hot = n - 1  # the rank whose experts every token takes
    failures: list[str] = []
    args = dict(num_experts=PER_RANK * n, latent=layer.geometry.latent, topk=TOPK)
    with EpRouted(dep.cpu_group, T, "cpu", config=EpConfig(timeout_s=60.0), **args) as routed:
        norm = layer.norm_weight()
        for attempt in range(2):  # the overflow, twice: the record was zeroed in between
            latent, ids, weights = step_inputs(layer, rank, n, seed + attempt, hot)
            if rank == hot:
                match = (
                    rf"rank {hot}\), tag {TAG}: this rank's experts received {n * budget} \(row,"
                    rf" local expert\) pairs, more than their pair budget of {budget} pairs.*"
                    r"Raise pair_skew"
                )
                err = expect_raises(
                    failures,
                    f"overflow {attempt}",
                    EpPairBudgetError,
                    match,
                    lambda: routed(latent, ids, weights, norm, experts=experts, tag=TAG),
                )
                if isinstance(err, EpPairBudgetError) and (err.pairs, err.budget) != (
                    n * budget,
                    budget,
                ):
                    failures.append(f"overflow {attempt}: {err.pairs}, {err.budget}")
            else:
                expect_raises(
                    failures,
                    f"overflow {attempt} (peer)",
                    EpPeerError,
                    rf"rank {hot} failed in its experts: EpPairBudgetError: .*{budget} pairs",
                    lambda: routed(latent, ids, weights, norm, experts=experts, tag=TAG),
                )
        for attempt in range(2):  # the next steps, within the budget on every rank: correct
            latent, ids, weights = step_inputs(layer, rank, n, seed + 10 + attempt, None)
            try:
                out = routed(latent, ids, weights, norm, experts=experts, tag=TAG + 1)
                ref = allgather_reference(dep.cpu_group, latent, ids, weights, norm, layer.expert)
                failures += compare(out, ref, f"good step {attempt} after the overflow")
            except Exception as err:
                failures.append(f"good step {attempt}: {type(err).__name__}: {err}")
    collective_assert(dep.cpu_group, failures, seeds=seed)
