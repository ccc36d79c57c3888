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
- `expanded_e4m3_words`: that expansion word by word, as the narrow GEMM's humming form
  (experts/hopper/narrow_gemm.py, `NarrowTuning(weights="humming")`) runs it on these words for
  wgmma's A operand from registers (two byte permutes over a table of s' per word of 8
  elements, the signs moved in from their nibbles), in torch: the specification that kernel is
  tested against.
- `prepared_weights`: checkpoint MXFP4 weights packed into these three tensors in torch (the
  same values as humming's preparation, for tests and benchmarks without humming-kernels).
"""

from __future__ import annotations

import torch

from dep_ep.constants import SCALE_BLOCK
from dep_ep.experts.hopper.humming_gemm import FUSED_SCALE_SPREAD
from dep_ep.experts.mxfp4 import E2M1_VALUES

# Rows of one contiguous block of a k32 group (1 KiB: 64 rows x 32 elements x 4 bits).
HUMMING_BLOCK_ROWS = 64
# The e4m3 bytes of E2M1 magnitudes 0..7 times 2^(s' - 6), as two little-endian words for a
# byte permute (magnitude m selects byte m): byte m is 0 for m = 0, else (e + s') << 3 | frac
# << 2 with (e, frac) = (0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1) for m = 1..7
# (E2M1's 0.5 is e4m3's 2^(s' - 7), a normal number for s' >= 1). Each word is its s' = 0
# bytes plus s' times its exponent step (8 in every byte but the zero's).
E4M3_TABLE_LOW = 0x0C080000
E4M3_TABLE_HIGH = 0x1C181410
E4M3_TABLE_LOW_STEP = 0x08080800
E4M3_TABLE_HIGH_STEP = 0x08080808
SIGN_NIBBLE_BITS = 0x88888888
MAGNITUDE_NIBBLE_BITS = 0x77777777
# The small exponents s' humming's fused scales take (the e4m3 bytes stay finite and normal).
SMALL_EXPONENTS = range(1, 13)


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


def prepared_tensors(tensors: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HummingGemm.prepare's `tensors` as prepared_weights returns them (and the narrow GEMM's
    humming form takes them): (weight int32 [E, K/32, 4N], weight_scale [E, K/32, N],
    weight_scale_2 as a contiguous fp32 [E], whatever dtype and shape humming keeps it in)."""
    scale_2 = tensors["weight_scale_2"].float().reshape(-1).contiguous()
    return tensors["weight"], tensors["weight_scale"], scale_2


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


def e4m3_table(exponent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table words (int64, each holding 4 bytes) of small exponents s' (int tensor,
    1..12): the e4m3 bytes of E2M1 magnitudes 0..3 and 4..7 times 2^(s' - 6)."""
    exponent = exponent.long()
    return (
        E4M3_TABLE_LOW + exponent * E4M3_TABLE_LOW_STEP,
        E4M3_TABLE_HIGH + exponent * E4M3_TABLE_HIGH_STEP,
    )


def permute_bytes(low: torch.Tensor, high: torch.Tensor, selectors: torch.Tensor) -> torch.Tensor:
    """PTX `prmt.b32` in its default mode, selector nibbles 0..7 only (bit 3 clear): byte i of
    the result (int64 holding 4 bytes) is byte selectors[4i:4i+4] of the 8 bytes (high, low)."""
    out = torch.zeros_like(low)
    for i in range(4):
        pick = (selectors >> (4 * i)) & 7
        byte = torch.where(pick < 4, low >> (8 * pick), high >> (8 * (pick - 4))) & 0xFF
        out |= byte << (8 * i)
    return out


def expanded_e4m3_words(word: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """A prepared word's 8 elements as two words of e4m3 bytes (int64 [..., 2], each holding 4
    bytes), as a kernel expands them for wgmma from registers: word 0 holds elements k % 16 =
    0..3 of the word's k16 half 0 (nibbles 0..3: j = 0..3, h = 0), word 1 those of half 1
    (nibbles 4..7), each the e4m3 byte of E2M1 * 2^(s' - 6). Per word: two byte permutes over
    the table of s' (`e4m3_table`: two integer multiply-adds a row and k32 group) of the
    magnitude nibbles, and each byte's sign moved in from its sign nibble (element (j, h)'s sign
    is the top bit of nibble 2 j + h: bit 8 j + 3 for h = 0, 8 j + 7 for h = 1). `word`: int
    tensor of the 32-bit words (any sign), `exponent`: s' of each word's row and group, same
    shape."""
    bits = word.long() & 0xFFFFFFFF
    low, high = e4m3_table(exponent)
    magnitudes = bits & MAGNITUDE_NIBBLE_BITS
    signs = bits & SIGN_NIBBLE_BITS
    half0 = permute_bytes(low, high, magnitudes) | ((signs << 4) & 0x80808080)
    half1 = permute_bytes(low, high, magnitudes >> 16) | (signs & 0x80808080)
    return torch.stack((half0, half1), dim=-1)


def prepared_weights(
    w: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checkpoint MXFP4 weights in the prepared tensors' layout (module docstring), in torch on
    w's device: (weight int32 [E, K/32, 4N], weight_scale uint8 [E, K/32, N], weight_scale_2
    fp32 [E]) from w uint8 [E, N, K/2] (codes, low nibble first) and s uint8 [E, N, K/32] (E8M0
    bytes). Each expert's mn is its largest scale byte less FUSED_SCALE_SPREAD, so s' = s - mn
    + 1 is in 1..12 and `prepared_values` gives the checkpoint's values exactly. ValueError unless
    both are uint8 on one device, E >= 1 and N and K positive multiples of 64, when a scale byte
    is 255 (E8M0's NaN), or when an expert's scale bytes spread over more than
    FUSED_SCALE_SPREAD binades (naming the experts)."""
    if w.dim() != 3 or s.dim() != 3 or w.dtype != torch.uint8 or s.dtype != torch.uint8:
        raise ValueError(
            f"prepared_weights: w {w.dtype} {tuple(w.shape)}, s {s.dtype} {tuple(s.shape)};"
            f" expected uint8 [E, N, K/2] codes and uint8 [E, N, K/{SCALE_BLOCK}] scale bytes"
        )
    experts, rows, half_k = w.shape
    k = 2 * half_k
    fits = experts >= 1 and rows % HUMMING_BLOCK_ROWS == 0 and k % HUMMING_BLOCK_ROWS == 0
    if not fits or rows == 0 or k == 0 or tuple(s.shape) != (experts, rows, k // SCALE_BLOCK):
        raise ValueError(
            f"prepared_weights: w {tuple(w.shape)}, s {tuple(s.shape)}; expected [E, N, K/2]"
            f" and [E, N, K/{SCALE_BLOCK}] with E >= 1 and N, K positive multiples of"
            f" {HUMMING_BLOCK_ROWS}"
        )
    if w.device != s.device:
        raise ValueError(f"prepared_weights: w on {w.device}, s on {s.device}; expected one device")
    if bool((s == 255).any()):
        raise ValueError("prepared_weights: a scale byte is 255, E8M0's NaN")
    flat = s.reshape(experts, -1).int()
    top = flat.amax(dim=1)
    wide = (top - flat.amin(dim=1) > FUSED_SCALE_SPREAD).nonzero().flatten().tolist()
    if wide:
        raise ValueError(
            f"prepared_weights: the scale bytes of experts {wide[:8]} spread over more than"
            f" {FUSED_SCALE_SPREAD} binades"
        )
    index = prepared_index(rows, k, w.device)
    low = torch.arange(k, device=w.device) % 2 == 0
    weight = torch.zeros(experts, k // SCALE_BLOCK * 4 * rows, dtype=torch.int64, device=w.device)
    for e in range(experts):
        code = w[e].long().repeat_interleave(2, dim=1)
        code = torch.where(low, code & 0xF, code >> 4)  # [rows, k]: each element's 4 bits
        for part, bits in (("magnitude", code & 7), ("sign", code & 8)):
            shifted = bits << (4 * index[part])
            weight[e].index_add_(0, index["word"].reshape(-1), shifted.reshape(-1))
    weight = (weight - (weight >= 2**31).long() * 2**32).int()
    mn = top - FUSED_SCALE_SPREAD
    small = (s.int() - mn.view(-1, 1, 1) + 1).to(torch.uint8)  # s' [E, N, K/32]
    scale_bytes = torch.empty(experts, k // SCALE_BLOCK * rows, dtype=torch.uint8, device=w.device)
    scale_bytes[:, index["scale"].reshape(-1)] = small.reshape(experts, -1)
    scale_2 = torch.exp2((mn - 128).float())
    return (
        weight.view(experts, k // SCALE_BLOCK, 4 * rows),
        scale_bytes.view(experts, k // SCALE_BLOCK, rows),
        scale_2,
    )
