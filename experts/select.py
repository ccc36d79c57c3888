"""The experts backend a device runs best, built from the checkpoint-layout weights."""

from __future__ import annotations

import warnings

import torch

from dep_ep.experts.base import ExpertsBackend
from dep_ep.experts.hopper.hopper_experts import HopperExperts, default_engine
from dep_ep.experts.hopper.humming_engine import HummingEngine
from dep_ep.experts.hopper.humming_gemm import scale_spread_error
from dep_ep.experts.hopper.triton_engine import TritonEngine
from dep_ep.experts.reference.reference_experts import ReferenceExperts
from dep_ep.experts.trtllm.trtllm_experts import TrtllmExperts
from dep_ep.experts.weights import ExpertWeights, check_expert_weights, check_num_experts


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
    choice use. HopperExperts takes its default engine, or the triton engine (with a warning
    naming the experts) for weights whose scale spread the humming engine refuses."""
    geometry = check_expert_weights("default_experts", w13, s13, w2, s2, first_expert)
    check_num_experts("default_experts", num_experts, first_expert + geometry.num_local)
    backend = default_experts_class(geometry.device)
    if backend is ReferenceExperts:
        return ReferenceExperts(w13, s13, w2, s2, first_expert=first_expert)
    if backend is TrtllmExperts:
        return TrtllmExperts(w13, s13, w2, s2, first_expert=first_expert, num_experts=num_experts)
    weights = ExpertWeights(w13, s13, w2, s2, first_expert=first_expert, num_experts=num_experts)
    engine = default_engine(geometry.latent, geometry.intermediate)
    if isinstance(engine, HummingEngine):
        spread = [
            scale_spread_error("default_experts", n, t) for n, t in (("s13", s13), ("s2", s2))
        ]
        errors = [e for e in spread if e is not None]
        if errors:
            warnings.warn(
                f"{'; '.join(errors)}: using HopperExperts(engine=TritonEngine())", stacklevel=2
            )
            engine = TritonEngine(tiles=engine.tiles)
    return HopperExperts(weights, engine=engine)
