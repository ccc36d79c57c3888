"""The Kimi K3 router, defined once: `route_into` holds the formula and writes into given
outputs (EpMoeLayer calls it every step); `route` checks its arguments and allocates them."""

from __future__ import annotations

import torch

from dep_ep.config import DEFAULT_ROUTED_SCALING_FACTOR

# torch.mm(..., out_dtype=) (BF16 inputs, fp32 output) exists on CUDA from torch 2.8.
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def route_into(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    routed_scaling_factor: float = DEFAULT_ROUTED_SCALING_FACTOR,
    bf16_gemm: bool = False,
) -> None:
    """The router of bf16 hidden [T, H] with gate_weight bf16 [E, H] and bias fp32 [E], written
    into ids int32 [T, K] and weights fp32 [T, K] (K = ids.shape[1]); no checks (`route` has them).

    fp32 logits; scores = sigmoid(logits); the bias shifts the selection only (top-K of
    scores + bias); weights are the unbiased scores of the chosen experts, renormalised
    w / (sum(w) + 1e-20), times routed_scaling_factor (skipped at 1.0).

    bf16_gemm: on CUDA (torch >= 2.8) the logits come from one BF16 GEMM with fp32 output instead
    of an fp32 GEMM of widened copies, so no fp32 copy of the gate is made. BF16 products are
    exact in fp32: the two differ only in the order of the sums. Elsewhere it changes nothing.
    """
    if bf16_gemm and hidden.is_cuda and _MM_OUT_DTYPE:
        logits = torch.mm(hidden, gate_weight.t(), out_dtype=torch.float32)
    else:
        logits = hidden.float() @ gate_weight.float().t()
    scores = logits.sigmoid_()
    chosen = torch.topk(scores + bias.float(), ids.shape[1], dim=-1).indices
    picked = scores.gather(1, chosen)
    torch.div(picked, picked.sum(dim=-1, keepdim=True) + 1e-20, out=weights)
    if routed_scaling_factor != 1.0:
        weights.mul_(routed_scaling_factor)
    ids.copy_(chosen)


def route(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    topk: int,
    *,
    routed_scaling_factor: float = DEFAULT_ROUTED_SCALING_FACTOR,
    bf16_gemm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden bf16 [T, H], gate_weight bf16 [E, H], bias fp32 [E] -> (ids int32 [T, K], weights
    fp32 [T, K]) on hidden's device: `route_into`'s formula and options, after checking the
    shapes and topk (ValueError)."""
    if hidden.dim() != 2 or gate_weight.dim() != 2 or hidden.shape[1] != gate_weight.shape[1]:
        raise ValueError(
            f"route: hidden {tuple(hidden.shape)} and gate_weight {tuple(gate_weight.shape)}"
            " must be [T, H] and [E, H]"
        )
    if bias.shape != (gate_weight.shape[0],):
        raise ValueError(
            f"route: bias shape {tuple(bias.shape)}; expected ({gate_weight.shape[0]},)"
        )
    if not 1 <= topk <= gate_weight.shape[0]:
        raise ValueError(f"route: topk={topk} outside 1..{gate_weight.shape[0]}")
    on = dict(device=hidden.device)
    ids = torch.empty(hidden.shape[0], topk, dtype=torch.int32, **on)
    weights = torch.empty(hidden.shape[0], topk, dtype=torch.float32, **on)
    factor, bf16 = routed_scaling_factor, bf16_gemm
    route_into(
        hidden, gate_weight, bias, ids, weights, routed_scaling_factor=factor, bf16_gemm=bf16
    )
    return ids, weights
