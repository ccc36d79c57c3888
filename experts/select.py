"""The experts backend a device runs best, built from an ExpertWeights."""

from __future__ import annotations

import warnings

import torch

from dep_ep.experts.base import ExpertsBackend
from dep_ep.experts.hopper.engine import HopperEngine
from dep_ep.experts.hopper.hopper_experts import HopperExperts, default_engine
from dep_ep.experts.hopper.humming_engine import HummingEngine
from dep_ep.experts.hopper.humming_gemm import scale_spread_error
from dep_ep.experts.hopper.triton_engine import TritonEngine
from dep_ep.experts.reference.reference_experts import ReferenceExperts
from dep_ep.experts.trtllm.trtllm_experts import TrtllmExperts
from dep_ep.experts.weights import ExpertWeights, expect_expert_weights


def default_experts_class(device: torch.device | str) -> type[ExpertsBackend]:
    """TrtllmExperts where it runs (SM100/103 with FlashInfer), else HopperExperts where it runs
    (SM90 with triton; its engine is humming when humming-kernels is installed), else
    ReferenceExperts (any device)."""
    device = torch.device(device)
    for backend in (TrtllmExperts, HopperExperts):
        if backend.unsupported_reason(device) is None:
            return backend
    return ReferenceExperts


def default_hopper_engine(weights: ExpertWeights) -> HopperEngine:
    """`default_engine(L, I)`, or TritonEngine (with a warning naming the experts) for weights
    whose scale spread HummingEngine refuses (docs/experts.md)."""
    engine = default_engine(weights.latent, weights.intermediate)
    if not isinstance(engine, HummingEngine):
        return engine
    scales = {"s13": weights.s13, "s2": weights.s2}
    spread = [scale_spread_error("default_experts", name, t) for name, t in scales.items()]
    errors = [e for e in spread if e is not None]
    if not errors:
        return engine
    warnings.warn(f"{'; '.join(errors)}: using HopperExperts(engine=TritonEngine())", stacklevel=3)
    return TritonEngine(tiles=engine.tiles)


def default_experts(weights: ExpertWeights) -> ExpertsBackend:
    """default_experts_class(weights.device) built from `weights` (TrtllmExperts' routing and
    HopperExperts' kernel choice read its num_experts). HopperExperts takes `default_hopper_engine`:
    its default engine, or the triton engine for weights the humming engine refuses."""
    expect_expert_weights("default_experts", weights)
    backend = default_experts_class(weights.device)
    if backend is HopperExperts:
        return HopperExperts(weights, engine=default_hopper_engine(weights))
    return backend(weights)
