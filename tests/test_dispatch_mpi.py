"""Dispatch rows, bitwise, against an independent computation of the row contract (2-4 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dep_ep.ep import TINY, EpRouted
from dep_ep.testing import internals

from helpers.cases import agreed_seed, make_case
from helpers.collective import collective_assert
from helpers.dispatch_rows import check_rows, provenance_weights

MAX_TOKENS = 24
POISON_ID = -7  # no dispatch ever writes this id


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "tokens,routing",
    [
        (1, "random"),
        (7, "random"),
        (MAX_TOKENS, "random"),
        (13, "skewed"),
        (12, "padded"),
        (5, "same"),
    ],
)
def test_dispatch_rows_bitwise(dep, tokens, routing):
    group, rank, num_ranks = dep.cpu_group, dep.rank, dep.size
    seed = agreed_seed(group, 1000 * tokens + ROUTING_SEED[routing])
    case = make_case(TINY, num_ranks, tokens, seed, routing)
    weights = [provenance_weights(s, tokens) for s in range(num_ranks)]
    routed = EpRouted(
        group, MAX_TOKENS, "cpu", num_experts=TINY.experts, latent=TINY.latent, topk=TINY.topk
    )
    try:
        b = internals.buffers(routed)
        b.ids(b.layout.max_rows).fill_(POISON_ID)
        b.x(b.layout.max_rows).fill_(0xFF)
        dist.barrier(group)  # every rank poisoned its rows before anyone writes
        rows = routed.dispatch(case.latent[rank], case.ids[rank], weights[rank])
        failures = check_rows(rows, case, weights, rank, num_ranks, tokens)
        routed.receive(tokens).out.fill_(0)
        routed.combine(torch.ones(TINY.latent, dtype=torch.bfloat16))
    finally:
        routed.close()
    collective_assert(group, failures, seeds=seed)


ROUTING_SEED = {"random": 1, "skewed": 2, "padded": 3, "same": 4}
