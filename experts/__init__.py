"""Routed-expert backends behind one interface (experts/base.py) and MXFP4 weight formats."""

from experts.base import ExpertsBackend
from experts.dense import DenseExperts
from experts.mxfp4 import mxfp4_dequantize, mxfp4_pack, mxfp4_unpack
from experts.reference import ReferenceExperts
from experts.situ import situ
from experts.trtllm import TrtllmExperts

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
