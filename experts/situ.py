"""SiTU, the Kimi K3 expert activation."""

from __future__ import annotations

import torch

SITU_BETA = 4.0
SITU_LINEAR_BETA = 25.0


def situ(
    gate: torch.Tensor,
    up: torch.Tensor,
    beta: float = SITU_BETA,
    linear_beta: float = SITU_LINEAR_BETA,
) -> torch.Tensor:
    """fp32 [beta*tanh(g/beta)*sigmoid(g)] * [linear_beta*tanh(u/linear_beta)]; g = w1 (gate) out,
    u = w3 (up) out, both fp32 [..., I]. The caller casts the result to BF16 once."""
    gated = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    return gated * (linear_beta * torch.tanh(up / linear_beta))
