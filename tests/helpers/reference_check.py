"""The experts a rank holds in the tests, and the ragged-routing check (dep_ep.testing.compare
holds the comparisons against the references)."""

from __future__ import annotations

import torch

from dep_ep.experts import ExpertsBackend, ReferenceExperts
from dep_ep.testing import SyntheticLayer, compare

from helpers.cases import real_tokens


def make_experts(layer: SyntheticLayer, rank: int, num_ranks: int) -> ReferenceExperts:
    """ReferenceExperts of the experts `rank` owns among `num_ranks` (CPU)."""
    per_rank = layer.geometry.experts // num_ranks
    return ReferenceExperts(layer.local_weights(rank * per_rank, per_rank))


def check_ragged(out: torch.Tensor, ref: torch.Tensor, rank: int, num_ranks: int) -> list[str]:
    """Real rows within tolerance of the reference; padding rows exactly +0.0 (docs/design.md)."""
    tokens = out.shape[0]
    real = real_tokens(tokens, num_ranks)[rank]
    failures = compare(out, ref, f"ragged T={tokens} real={real}")
    padding = out[real:].cpu()
    if not torch.equal(padding.view(torch.int16), torch.zeros_like(padding.view(torch.int16))):
        failures.append(f"ragged: padding rows {real}..{tokens - 1} are not all +0.0")
    return failures


class RowByRowExperts(ExpertsBackend):
    """An experts backend run on one receive row at a time: its rows do not depend on which
    rows share a call (a GEMM over several rows may sum in another order for another row
    count), so a step in pieces, or a call given fewer rows, gives one step's bits."""

    def __init__(self, inner: ExpertsBackend):
        self.inner = inner
        self.first_expert, self.num_local_experts = inner.first_expert, inner.num_local_experts
        self.latent = inner.latent

    def forward(self, x, sf, ids, weights, out):
        for row in range(x.shape[0]):
            s = slice(row, row + 1)
            self.inner.forward(x[s], sf[s], ids[s], weights[s], out[s])
        return out
