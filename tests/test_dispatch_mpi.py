"""Dispatch rows, bitwise, against an independent computation of the row contract (2-4 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cases import agreed_seed, collective_assert, make_case

from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.ep import TINY, EpRouted

MAX_TOKENS = 24
POISON_ID = -7  # no dispatch ever writes this id


def provenance_weights(source: int, tokens: int) -> torch.Tensor:
    """fp32 [T, K] = source*1000 + t + k/16: a misplaced row says where it came from."""
    t = torch.arange(tokens, dtype=torch.float32).unsqueeze(1)
    k = torch.arange(TINY.topk, dtype=torch.float32).unsqueeze(0)
    return source * 1000 + t + k / 16


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tokens,routing", [
    (1, "random"), (7, "random"), (MAX_TOKENS, "random"), (13, "skewed"), (12, "padded"),
    (5, "same"),
])  # fmt: skip
def test_dispatch_rows_bitwise(dep, tokens, routing):
    group, rank, num_ranks = dep.cpu_group, dep.rank, dep.size
    seed = agreed_seed(group, 1000 * tokens + ROUTING_SEED[routing])
    case = make_case(TINY, num_ranks, tokens, seed, routing)
    weights = [provenance_weights(s, tokens) for s in range(num_ranks)]
    routed = EpRouted(group, MAX_TOKENS, "cpu", num_experts=TINY.experts, latent=TINY.latent,
                      topk=TINY.topk)  # fmt: skip
    try:
        b = routed.buffers
        b.ids(b.layout.max_rows).fill_(POISON_ID)
        b.x(b.layout.max_rows).fill_(0xFF)
        dist.barrier(group)  # every rank poisoned its rows before anyone writes
        rows = routed.dispatch(case.latent[rank], case.ids[rank], weights[rank])
        failures = check_rows(rows, case, weights, rank, num_ranks, tokens)
        routed.receive(tokens).out.fill_(0)
        routed.combine(torch.ones(TINY.latent, dtype=torch.bfloat16))
    finally:
        routed.close()
    collective_assert(group, failures)


ROUTING_SEED = {"random": 1, "skewed": 2, "padded": 3, "same": 4}


def check_rows(rows, case, weights, rank, num_ranks, tokens) -> list[str]:
    per_rank = TINY.experts // num_ranks
    failures = []
    assert rows.ids.shape == (num_ranks * tokens, TINY.topk)
    for source in range(num_ranks):
        q, sf = mxfp8_quantize(case.latent[source])
        ids = case.ids[source].long()
        local = (ids >= rank * per_rank) & (ids < (rank + 1) * per_rank)
        want_ids = torch.where(local, ids, -1).int()
        for t in range(tokens):
            row = source * tokens + t
            where = f"row {row} (source {source}, token {t})"
            if not torch.equal(rows.ids[row], want_ids[t]):
                failures.append(f"{where}: ids {rows.ids[row].tolist()} != {want_ids[t].tolist()}")
                continue
            if not local[t].any():
                continue
            if not torch.equal(rows.x[row], q[t]):
                failures.append(f"{where}: x bytes differ")
            if not torch.equal(rows.sf[row], sf[t]):
                failures.append(f"{where}: scale bytes differ")
            if not torch.equal(rows.weights[row], weights[source][t]):
                got = float(rows.weights[row, 0])
                failures.append(f"{where}: weights came from source {int(got // 1000)}, token"
                                f" {int(got % 1000)}")  # fmt: skip
    return failures
