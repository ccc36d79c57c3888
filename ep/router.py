"""The Kimi K3 router as a function."""

from __future__ import annotations

import torch


def route(
    hidden: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden bf16 [T, H], gate_weight bf16 [E, H], bias fp32 [E] -> (ids int32 [T, K], weights
    fp32 [T, K]).

    fp32 logits; scores = sigmoid(logits); the bias shifts the selection only (top-K of
    scores + bias); weights are the unbiased scores of the chosen experts, renormalised
    w / (sum(w) + 1e-20).
    """
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
    scores = torch.sigmoid(hidden.float() @ gate_weight.float().T)
    ids = torch.topk(scores + bias.float(), topk, dim=-1).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), weights
