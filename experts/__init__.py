"""Routed-expert backends behind one interface (experts/base.py), all built from one
ExpertWeights (experts/weights.py), and the MXFP4 weight format.

Subpackages by engine: reference/ (ReferenceExperts, DenseExperts: torch, any device), hopper/
(HopperExperts on SM90 with HummingEngine or TritonEngine), trtllm/ (TrtllmExperts: FlashInfer,
SM100/103). Beside them: base.py (the contract), weights.py, mxfp4.py, situ.py, select.py
(default_experts: the device's best backend) and checkpoint.py (load_moe_layer).
"""

from dep_ep.experts.base import ExpertsBackend
from dep_ep.experts.hopper import (
    Grouping,
    HopperEngine,
    HopperExperts,
    HopperTiles,
    HummingEngine,
    TritonEngine,
)
from dep_ep.experts.mxfp4 import mxfp4_dequantize, mxfp4_pack, mxfp4_unpack
from dep_ep.experts.reference import DenseExperts, ReferenceExperts
from dep_ep.experts.select import default_experts, default_experts_class
from dep_ep.experts.situ import situ
from dep_ep.experts.trtllm import TrtllmExperts
from dep_ep.experts.weights import ExpertWeights

__all__ = [
    "DenseExperts",
    "ExpertWeights",
    "ExpertsBackend",
    "Grouping",
    "HopperEngine",
    "HopperExperts",
    "HopperTiles",
    "HummingEngine",
    "ReferenceExperts",
    "TritonEngine",
    "TrtllmExperts",
    "default_experts",
    "default_experts_class",
    "mxfp4_dequantize",
    "mxfp4_pack",
    "mxfp4_unpack",
    "situ",
]
