"""A torch model of the 128x4 scale-factor layout of trtllm-gen / CUTLASS block-scaled GEMMs,
written from the layout's definition, to check FlashInfer's interleave and our row order.

Scale (m, k) of an [M, K] matrix (M padded to 128, K to 4) lives at flat offset
  (m // 128) * (K / 4) * 512 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4.
"""

from __future__ import annotations

import torch


def interleave_128x4(sf: torch.Tensor) -> torch.Tensor:
    """uint8 [M, K] with M % 128 == 0 and K % 4 == 0 -> flat uint8 [M * K] in the 128x4 layout."""
    rows, cols = sf.shape
    assert rows % 128 == 0 and cols % 4 == 0, (rows, cols)
    m = torch.arange(rows).unsqueeze(1)
    k = torch.arange(cols).unsqueeze(0)
    offset = (
        (m // 128) * (cols // 4) * 512
        + (k // 4) * 512
        + (m % 32) * 16
        + ((m % 128) // 32) * 4
        + k % 4
    )
    out = torch.empty(rows * cols, dtype=sf.dtype, device=sf.device)
    out[offset.flatten().to(sf.device)] = sf.flatten()
    return out


def deinterleave_128x4(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of interleave_128x4: flat [rows * cols] -> [rows, cols]."""
    probe = interleave_128x4(torch.arange(rows * cols).reshape(rows, cols))
    out = torch.empty_like(flat)
    out[probe.to(flat.device)] = flat
    return out.reshape(rows, cols)
