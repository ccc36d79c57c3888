"""MXFP4 (E2M1 codes, one E8M0 scale per 32) weights in the checkpoint's byte layout.

Two codes per byte along K: the low nibble is element 2j, the high nibble element 2j+1.
Code c in 0..15 means E2M1_VALUES[c]; an element is E2M1_VALUES[c] * 2^(scale_byte - 127).
"""

from __future__ import annotations

import torch

from dep_ep.comm.mxfp8 import e8m0_to_fp32
from dep_ep.constants import SCALE_BLOCK

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip


def mxfp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (each 0..15, K even) -> packed uint8 [..., K/2]. TypeError for
    another dtype, ValueError for an odd K or a code above 15."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"mxfp4_pack: codes dtype {codes.dtype}; expected torch.uint8")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"mxfp4_pack: codes shape {tuple(codes.shape)}; need K (last) even")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("mxfp4_pack: codes must be in 0..15")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def mxfp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., K/2] -> codes uint8 [..., K]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"mxfp4_unpack: packed dtype {packed.dtype}; expected torch.uint8")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def mxfp4_dequantize(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(packed uint8 [..., K/2], scales uint8 [..., K/32]) -> `dtype` [..., K].

    Exact in bf16 and fp32 (a 2-bit mantissa times a power of two) for scale bytes whose
    products stay in the dtype's range. TypeError for a packed or scales dtype other than
    uint8, ValueError for a K that is not a positive multiple of 32 or scales of another
    shape."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"mxfp4_dequantize: packed dtype {packed.dtype}; expected torch.uint8")
    k = packed.shape[-1] * 2 if packed.dim() else 0
    if k % SCALE_BLOCK or not k:
        raise ValueError(
            f"mxfp4_dequantize: packed {tuple(packed.shape)} holds K={k} elements a row; K must"
            f" be a positive multiple of {SCALE_BLOCK} (one scale per {SCALE_BLOCK})"
        )
    if scales.dtype != torch.uint8:
        raise TypeError(f"mxfp4_dequantize: scales dtype {scales.dtype}; expected torch.uint8")
    if scales.shape != (*packed.shape[:-1], k // SCALE_BLOCK):
        raise ValueError(
            f"mxfp4_dequantize: scales shape {tuple(scales.shape)}; expected"
            f" {(*packed.shape[:-1], k // SCALE_BLOCK)} for packed {tuple(packed.shape)}"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[mxfp4_unpack(packed).long()].reshape(*scales.shape, SCALE_BLOCK)
    return (values * e8m0_to_fp32(scales).unsqueeze(-1)).reshape(*packed.shape[:-1], k).to(dtype)
