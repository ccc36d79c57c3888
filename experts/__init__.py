"""Routed-expert backends behind one interface (experts/base.py) and MXFP4 weight formats."""

from dep_ep.experts.base import ExpertsBackend
from dep_ep.experts.dense import DenseExperts
from dep_ep.experts.mxfp4 import mxfp4_dequantize, mxfp4_pack, mxfp4_unpack
from dep_ep.experts.reference import ReferenceExperts
from dep_ep.experts.situ import situ
from dep_ep.experts.trtllm import TrtllmExperts

__all__ = [
    "DenseExperts",
    "ExpertsBackend",
    "ReferenceExperts",
    "TrtllmExperts",
    "mxfp4_dequantize",
    "mxfp4_pack",
    "mxfp4_unpack",
    "situ",
]
