"""The float64 reference of a whole MoE layer on synthetic weights, for the examples: the layer's
formula (docs/formats.md) evaluated in float64 on the layer's own routing, its routed part from
the all-gather reference (collective), and the synthetic dense tensors such a layer is built from.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from dep_ep.experts.checkpoint import (
    BIAS,
    DOWN,
    GATE,
    NORM,
    SHARED_DOWN,
    SHARED_GATE,
    SHARED_UP,
    UP,
    dense_shapes,
)
from dep_ep.testing.allgather_reference import SITU_BETA, SITU_LINEAR_BETA, allgather_reference
from dep_ep.testing.synthetic import SyntheticLayer


def synthetic_dense(geometry, layer: SyntheticLayer, seed: int, device) -> dict:
    """The layer's dense tensors by checkpoint name: the synthetic router and norm weights, and
    projections with rms 1/sqrt(fan_in) from a generator seeded with `seed` (the same on every
    rank of a DEP group)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    gate, bias = layer.router()
    dense = {GATE: gate, BIAS: bias, NORM: layer.norm_weight()}
    for name, (shape, dtype) in dense_shapes(geometry).items():
        if name not in dense:
            w = torch.randn(shape, generator=gen, device=device) / shape[1] ** 0.5
            dense[name] = w.to(dtype)
    return dense


def _situ(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """float64 SiTU with K3's constants (written here, not imported from the library)."""
    act = SITU_BETA * torch.tanh(gate / SITU_BETA) / (1 + torch.exp(-gate))
    return act * SITU_LINEAR_BETA * torch.tanh(up / SITU_LINEAR_BETA)


def layer_reference(
    group: dist.ProcessGroup,
    moe,
    expert_weights: Callable[[int], tuple[torch.Tensor, ...]],
    x: torch.Tensor,
    tokens: int,
) -> torch.Tensor:
    """float64 [n, H]: what the EpMoeLayer `moe` should return for x bf16 [n, H] in a step of
    `tokens` tokens (n <= tokens), with the layer's routing (`moe.router`, the function the call
    runs, so near-tied experts cannot make the two pick differently); the routed part from the
    all-gather reference on this rank's rows padded to `tokens` with -1 ids. Collective over
    `group` (every rank of the layer's DEP group, the same `tokens`).

    expert_weights(e) -> (w13, s13, w2, s2) of global expert e in checkpoint layout (a
    SyntheticLayer's `expert`)."""
    d = {name: t.double() for name, t in moe.dense.items()}
    n, L, K = x.shape[0], moe.latent, moe.topk
    ids, weights = moe.router(x)
    latent = torch.zeros(tokens, L, dtype=torch.bfloat16, device=x.device)
    latent[:n] = (x.double() @ d[DOWN].T).to(torch.bfloat16)
    padded_ids = torch.full((tokens, K), -1, dtype=torch.int32, device=x.device)
    padded_ids[:n] = ids
    padded_weights = torch.zeros(tokens, K, device=x.device)
    padded_weights[:n] = weights
    normed = allgather_reference(
        group, latent, padded_ids, padded_weights, moe.norm_weight, expert_weights, eps=moe.eps
    )[:n]
    x64 = x.double()
    act = _situ(x64 @ d[SHARED_GATE].T, x64 @ d[SHARED_UP].T)
    return normed @ d[UP].T + act @ d[SHARED_DOWN].T
