"""Symmetric buffers, MXFP8 quantization, and dispatch/combine (torch reference; GPU kernels)."""

from dep_ep.comm.buffers import EpBuffers, RankRegions
from dep_ep.comm.errors import (
    EpDesyncError,
    EpError,
    EpPairBudgetError,
    EpPeerError,
    EpPeerLostError,
    EpPeerTimeoutError,
    EpResetDuringCallError,
    EpTimeoutError,
    EpTokenCountError,
    EpUnwrittenRowsError,
)
from dep_ep.comm.layout import EpLayout
from dep_ep.comm.mxfp8 import mxfp8_dequantize, mxfp8_quantize

__all__ = [
    "EpBuffers",
    "EpLayout",
    "EpDesyncError",
    "EpError",
    "EpPairBudgetError",
    "EpPeerError",
    "EpPeerLostError",
    "EpPeerTimeoutError",
    "EpResetDuringCallError",
    "EpTimeoutError",
    "EpTokenCountError",
    "EpUnwrittenRowsError",
    "RankRegions",
    "mxfp8_dequantize",
    "mxfp8_quantize",
]
