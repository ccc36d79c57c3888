"""Symmetric buffers, MXFP8 quantization, and dispatch/combine (torch reference; GPU kernels)."""

from comm.buffers import EpBuffers, RankRegions
from comm.errors import EpPeerError, EpTimeoutError
from comm.layout import EpLayout
from comm.mxfp8 import mxfp8_dequantize, mxfp8_quantize

__all__ = [
    "EpBuffers",
    "EpLayout",
    "EpPeerError",
    "EpTimeoutError",
    "RankRegions",
    "mxfp8_dequantize",
    "mxfp8_quantize",
]
