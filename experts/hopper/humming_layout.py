"""humming-kernels 0.1.19's prepared MXFP4 weights, read back to values: the index map of the
tensors `HummingGemm.prepare` keeps (e4m3 inputs with per-32 scales, SM90), so a kernel of ours
can read an expert's weights where humming's GEMMs read them, with no copy of its own.

Read from humming's sources (its fused-scale transform, its repack and its FP4 -> FP8 decode)
and checked against humming's own preparation on a GPU (tests/test_hopper_experts.py). For
expert e, output row n < N and k < K (N and K multiples of 64):
- `weight`: int32 [E, K/32, 4N]; word W(n, k) of expert e holds 8 elements (4 bits each): with
  g = k // 32, kk = k % 32, h = kk // 16, q = (kk % 16) // 4, j = kk % 4, a = (n % 64) // 8,
  b = n % 8: W = 4N g + 256 (n // 64) + 128 (a // 4) + 4 (4 b + q) + a % 4. Element (n, k)'s
  E2M1 magnitude (3 bits) is the low 3 bits of the word's nibble 4 h + j, and its sign the top
  bit of nibble 2 j + h. So a 64-row block of a k32 group is 1 KiB of contiguous words
  (HUMMING_BLOCK_ROWS rows), the groups 16 N bytes apart.
- `weight_scale`: E8M0-typed bytes [E, K/32, N], column 64 (n // 64) + 8 b + a of group g: a
  small exponent s' (1..12), not the checkpoint's scale byte s.
- `weight_scale_2`: fp32 [E], 2^(mn - 128), mn the expert's largest scale byte less its
  spread, at most FUSED_SCALE_SPREAD (11).
- The value: (-1)^sign * E2M1[magnitude] * 2^s' * weight_scale_2[e], which is the checkpoint's
  value E2M1 * 2^(s - 127) exactly where s >= mn (every block of an expert within the spread,
  the only experts the humming engine takes: humming_gemm.scale_spread_error). humming's GEMM
  expands (magnitude, s') to the e4m3 byte of E2M1 * 2^(s' - 6) and scales its output by
  2^6 * weight_scale_2.
"""

from __future__ import annotations

import torch

from dep_ep.constants import SCALE_BLOCK
from dep_ep.experts.mxfp4 import E2M1_VALUES

# Rows of one contiguous block of a k32 group (1 KiB: 64 rows x 32 elements x 4 bits).
HUMMING_BLOCK_ROWS = 64


def prepared_index(rows: int, k: int, device=None) -> dict[str, torch.Tensor]:
    """The index map of one expert's prepared weights, int64 [rows, k] each (scale: [rows,
    k / 32]): "word" (the int32 word of the expert's K/32 x 4 rows words), "magnitude" and
    "sign" (the nibble, 0..7, holding the magnitude's 3 bits and the sign in its top bit),
    "scale" (the flat index of the element's s' in the expert's [K/32, rows] scale bytes).
    ValueError unless rows and k are positive multiples of 64."""
    for name, size in (("rows", rows), ("k", k)):
        if not isinstance(size, int) or size <= 0 or size % HUMMING_BLOCK_ROWS:
            raise ValueError(f"prepared_index: {name}={size!r}; expected a multiple of 64 > 0")
    n = torch.arange(rows, device=device).unsqueeze(1)
    kk = torch.arange(k, device=device).unsqueeze(0)
    group, in_group = kk // SCALE_BLOCK, kk % SCALE_BLOCK
    half, quad, j = in_group // 16, (in_group % 16) // 4, in_group % 4
    a, b = (n % HUMMING_BLOCK_ROWS) // 8, n % 8
    word = (
        4 * rows * group
        + 256 * (n // HUMMING_BLOCK_ROWS)
        + 128 * (a // 4)
        + 4 * (4 * b + quad)
        + a % 4
    )
    column = HUMMING_BLOCK_ROWS * (n // HUMMING_BLOCK_ROWS) + 8 * b + a
    groups = torch.arange(k // SCALE_BLOCK, device=device).unsqueeze(0)
    return {
        "word": word,
        "magnitude": (4 * half + j).expand(rows, k),
        "sign": (2 * j + half).expand(rows, k),
        "scale": groups * rows + column,
    }


def prepared_values(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """fp32 [E, N, K]: the values humming's prepared tensors hold (module docstring), from
    `weight` int32 [E, K/32, 4N], `weight_scale` [E, K/32, N] (E8M0-typed or uint8 bytes) and
    `weight_scale_2` fp32 [E]."""
    if weight.dtype != torch.int32 or weight.dim() != 3:
        raise ValueError(f"prepared_values: weight {weight.dtype} {tuple(weight.shape)}")
    experts, groups, words = weight.shape
    rows, k = words // 4, groups * SCALE_BLOCK
    if tuple(weight_scale.shape) != (experts, groups, rows) or weight_scale.element_size() != 1:
        raise ValueError(
            f"prepared_values: weight_scale {weight_scale.dtype} {tuple(weight_scale.shape)};"
            f" expected 1-byte [{experts}, {groups}, {rows}]"
        )
    if tuple(weight_scale_2.shape) != (experts,):
        raise ValueError(f"prepared_values: weight_scale_2 {tuple(weight_scale_2.shape)}")
    index = prepared_index(rows, k, weight.device)
    table = torch.tensor(E2M1_VALUES[:8], device=weight.device)  # the magnitudes
    out = torch.empty(experts, rows, k, device=weight.device)
    for e in range(experts):
        held = weight[e].reshape(-1)[index["word"]]
        magnitude = (held >> (4 * index["magnitude"])) & 7
        negative = ((held >> (4 * index["sign"] + 3)) & 1).bool()
        exponent = weight_scale[e].view(torch.uint8).reshape(-1)[index["scale"]].float()
        scale = torch.exp2(exponent).repeat_interleave(SCALE_BLOCK, dim=1)
        value = table[magnitude] * scale * weight_scale_2[e].float()
        out[e] = torch.where(negative, -value, value)
    return out
