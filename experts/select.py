"""The experts backend a device runs best, built from the checkpoint-layout weights."""

from __future__ import annotations

import torch

from dep_ep.experts.base import ExpertsBackend
from dep_ep.experts.hopper import HopperExperts
from dep_ep.experts.reference import ReferenceExperts
from dep_ep.experts.trtllm import TrtllmExperts


def default_experts_class(device: torch.device | str) -> type[ExpertsBackend]:
    """TrtllmExperts where it runs (SM100/103 with FlashInfer), else HopperExperts where it runs
    (SM90 with triton; its engine is humming when humming-kernels is installed), else
    ReferenceExperts (any device)."""
    device = torch.device(device)
    for backend in (TrtllmExperts, HopperExperts):
        if backend.unsupported_reason(device) is None:
            return backend
    return ReferenceExperts


def default_experts(
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    *,
    first_expert: int,
    num_experts: int,
) -> ExpertsBackend:
    """default_experts_class(w13.device) built from the checkpoint layout (experts/weights.py);
    num_experts: the model's total (E), which TrtllmExperts' routing and HopperExperts' kernel
    choice use."""
    backend = default_experts_class(w13.device)
    if backend is ReferenceExperts:
        return ReferenceExperts(w13, s13, w2, s2, first_expert=first_expert)
    return backend(w13, s13, w2, s2, first_expert=first_expert, num_experts=num_experts)
