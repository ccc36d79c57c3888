"""The experts a rank holds in the tests, and the ragged-routing check (dep_ep.testing.compare
holds the comparisons against the references)."""

from __future__ import annotations

import torch

from dep_ep.experts import ReferenceExperts
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
