"""Routed-expert backends behind one interface (experts/base.py) and MXFP4 weight formats."""

from dep_ep.experts.base import ExpertsBackend
from dep_ep.experts.hopper import HopperExperts, HopperTiles
from dep_ep.experts.mxfp4 import mxfp4_dequantize, mxfp4_pack, mxfp4_unpack
from dep_ep.experts.reference import ReferenceExperts
from dep_ep.experts.reference.dense_experts import DenseExperts
from dep_ep.experts.select import default_experts, default_experts_class
from dep_ep.experts.situ import situ
from dep_ep.experts.trtllm import TrtllmExperts
from dep_ep.experts.weights import ExpertWeights

__all__ = [
    "DenseExperts",
    "ExpertWeights",
    "ExpertsBackend",
    "HopperExperts",
    "HopperTiles",
    "ReferenceExperts",
    "TrtllmExperts",
    "default_experts",
    "default_experts_class",
    "mxfp4_dequantize",
    "mxfp4_pack",
    "mxfp4_unpack",
    "situ",
]
