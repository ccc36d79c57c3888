"""The weights' layout of the narrow GEMM (experts/hopper/narrow_gemm.py), and its torch model.

The narrow GEMM computes out[j, n] = sum_k W[e, n, k] * x[row(j), k] for tiles of a few pairs
j of one expert e (NARROW_PAIRS, or one of NARROW_TILE_PAIRS with wgmma), with the MXFP4
weights on the MMA's M side (16 output columns a warp) and the pairs on its N side (mma.sync
m16n8k32 a warp or wgmma m64nPk32 a warpgroup, whose A registers take the same layout; e4m3
inputs, fp32 partials).
Each warp streams its 16 weight rows from global memory once, 128 of K at a time, and expands
every E2M1 code to an e4m3 byte in registers by moving its bits:

    code s e1 e0 m (sign, exponent, mantissa; value 2^(e - 1) * 1.m, or 0.5 m for e = 0)
    byte s 0 0 e1 e0 m 0 0 (e4m3: the exponent field e, the mantissa's top bit m)

which is the code's value times 2^-6 for every code (the subnormal 0.5 lands on e4m3's
subnormal 2^-7), so the expansion is exact and the 2^6 goes into the scale byte
(E2M1_TO_E4M3_EXPONENT). Per byte of the layout: low nibble -> one register, high nibble ->
another (`e4m3_from_low` / `e4m3_from_high` below, the kernel's), shifts and masks, no table.

Layout (`narrow_weights`), for W uint8 [E, N, K/2] (checkpoint codes, low nibble first) and its
scales uint8 [E, N, K/32]:
    words  int32 [E, N/16, K/128, 32, 8]  block (e, c, q): rows 16c..16c+15, k 128q..128q+127;
           lane l = 4g + t of the warp holds word 2s + r = the codes of row 16c + g + 8r at
           k = 128q + 32s + 8t + i (low nibble of byte i) and + 4 + i (high nibble), i = 0..3
    scales int32 [E, N/16, K/128, 8, 2]   word r of g: the scale bytes (+ 6) of row
           16c + g + 8r for the four k32 blocks s = 0..3 of chunk q, byte s
A lane's eight words are 32 contiguous bytes and a warp's 1 KiB is contiguous. Inside each
32-block of K the MMA's k order is permuted (its k 4t + i and 16 + 4t + i are the layout's
8t + i and 8t + 4 + i): the activations are read (mma.sync) or staged (wgmma) in the same
order, so that a lane's activation bytes of one step are 8 contiguous bytes, and a dot product
does not depend on the order.
"""

from __future__ import annotations

import torch

from dep_ep.constants import SCALE_BLOCK

# The MMA (mma.sync.m16n8k32 e4m3): 16 weight rows, 8 pairs, 32 of K (one scale block) a step.
NARROW_ROWS = 16
NARROW_PAIRS = 8
# A tile's pairs in the wgmma form (wgmma.m64nPk32, P a multiple of 8): up to 32, whose staged
# rows take 32 * K bytes of shared memory (112 KiB at K3's K = 3584).
NARROW_TILE_PAIRS = (8, 16, 24, 32)
NARROW_STEPS = 4  # k32 steps a chunk: a lane's 32 bytes
NARROW_CHUNK_K = NARROW_STEPS * SCALE_BLOCK  # 128
WORDS_PER_LANE = 8
# E2M1 code -> e4m3 byte by moving bits: the byte's value is the code's times 2^-6.
E2M1_TO_E4M3_EXPONENT = 6
# The largest scale byte the layout takes: byte + 6 must stay a finite E8M0 scale (<= 254).
NARROW_MAX_SCALE_BYTE = 254 - E2M1_TO_E4M3_EXPONENT
SIGN_BITS = 0x80808080  # bit 7 of each byte
MAGNITUDE_BITS = 0x1C1C1C1C  # bits 2..4 of each byte: e1 e0 m


def narrow_fits(n: int, k: int) -> bool:
    """Whether an [N, K] weight matrix fits the layout: N a multiple of 16, K of 128."""
    return n % NARROW_ROWS == 0 and k % NARROW_CHUNK_K == 0


def narrow_weights(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w uint8 [E, N, K/2] MXFP4 codes, s uint8 [E, N, K/32] E8M0 bytes) -> (words int32
    [E, N/16, K/128, 32, 8], scales int32 [E, N/16, K/128, 8, 2]) on w's device, one expert at
    a time (the transient codes take N * K bytes). ValueError when N, K do not fit
    (`narrow_fits`) or a scale byte is above NARROW_MAX_SCALE_BYTE (naming the expert)."""
    num, n, half_k = w.shape
    k = 2 * half_k
    if not narrow_fits(n, k) or s.shape != (num, n, k // SCALE_BLOCK):
        raise ValueError(
            f"narrow_weights: w {tuple(w.shape)}, s {tuple(s.shape)}; need N % {NARROW_ROWS}"
            f" == 0, K % {NARROW_CHUNK_K} == 0 and s [E, N, K/{SCALE_BLOCK}]"
        )
    over = (s > NARROW_MAX_SCALE_BYTE).flatten(1).any(1)
    if bool(over.any()):
        experts = over.nonzero().flatten().tolist()[:8]
        raise ValueError(
            f"narrow_weights: scale bytes above {NARROW_MAX_SCALE_BYTE} (2^"
            f"{NARROW_MAX_SCALE_BYTE - 127}) in local experts {experts}: the expansion to e4m3"
            f" adds {E2M1_TO_E4M3_EXPONENT} to each"
        )
    blocks, chunks = n // NARROW_ROWS, k // NARROW_CHUNK_K
    words = torch.empty(num, blocks, chunks, 32, WORDS_PER_LANE, dtype=torch.int32, device=w.device)
    for e in range(num):
        codes = torch.stack((w[e] & 0xF, w[e] >> 4), dim=-1).view(n, k)
        # n = 16c + 8r + g; k = 128q + 32s + 8t + 4h + i
        codes = codes.view(blocks, 2, 8, chunks, NARROW_STEPS, 4, 2, 4)
        # -> [c, q, g, t, s, r, i, h]
        codes = codes.permute(0, 3, 2, 5, 4, 1, 7, 6)
        packed = codes[..., 0] | (codes[..., 1] << 4)  # byte i: low nibble h=0, high h=1
        words[e] = packed.contiguous().view(torch.int32).view(blocks, chunks, 32, WORDS_PER_LANE)
    shifted = (s.int() + E2M1_TO_E4M3_EXPONENT).to(torch.uint8)
    # n = 16c + 8r + g; k32 block = 4q + s -> [e, c, q, g, r, s]
    shifted = shifted.view(num, blocks, 2, 8, chunks, NARROW_STEPS).permute(0, 1, 4, 3, 2, 5)
    scales = shifted.contiguous().view(torch.int32).view(num, blocks, chunks, 8, 2)
    return words, scales


def e4m3_from_low(word: torch.Tensor) -> torch.Tensor:
    """The kernel's expansion of the four low nibbles of an int64 tensor of 32-bit words: four
    e4m3 bytes in a word (byte i from the low nibble of byte i)."""
    return ((word << 4) & SIGN_BITS) | ((word << 2) & MAGNITUDE_BITS)


def e4m3_from_high(word: torch.Tensor) -> torch.Tensor:
    """The kernel's expansion of the four high nibbles: byte i from the high nibble of byte i."""
    return (word & SIGN_BITS) | ((word >> 2) & MAGNITUDE_BITS)


def e4m3_bytes_to_float(word: torch.Tensor) -> torch.Tensor:
    """int64 words of four e4m3 bytes -> float64 [..., 4] (byte i at index i)."""
    shifts = torch.arange(0, 32, 8, device=word.device)
    b = ((word.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)
    return b.view(torch.float8_e4m3fn).double()


def narrow_dequantize(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The layout read back as the kernel reads it: float64 [E, N, K], each element the e4m3
    byte the kernel makes times 2^(scale byte - 127) of `scales` (which hold the + 6). Equal
    to the checkpoint's values (mxfp4_dequantize) when the layout and the expansion are right."""
    num, blocks, chunks = words.shape[:3]
    w = words.long() & 0xFFFFFFFF  # [e, c, q, lane, 2s + r]
    low = e4m3_bytes_to_float(e4m3_from_low(w))  # [e, c, q, lane, 2s + r, i]: h = 0
    high = e4m3_bytes_to_float(e4m3_from_high(w))  # h = 1
    v = torch.stack((low, high), dim=-2)  # [e, c, q, lane, 2s + r, h, i]
    v = v.view(num, blocks, chunks, 8, 4, NARROW_STEPS, 2, 2, 4)  # [e, c, q, g, t, s, r, h, i]
    v = v.permute(0, 1, 6, 3, 2, 5, 4, 7, 8)  # [e, c, r, g, q, s, t, h, i]
    n, k = blocks * NARROW_ROWS, chunks * NARROW_CHUNK_K
    v = v.reshape(num, n, k)
    b = (scales.long() & 0xFFFFFFFF).unsqueeze(-1) >> torch.arange(0, 32, 8, device=words.device)
    b = (b & 0xFF).view(num, blocks, chunks, 8, 2, NARROW_STEPS)  # [e, c, q, g, r, s]
    b = b.permute(0, 1, 4, 3, 2, 5).reshape(num, n, k // SCALE_BLOCK)
    scale = torch.pow(2.0, (b - 127).double())
    return (v.view(num, n, k // SCALE_BLOCK, SCALE_BLOCK) * scale.unsqueeze(-1)).view(num, n, k)


def narrow_gemm_reference(
    w: torch.Tensor,
    s: torch.Tensor,
    x: torch.Tensor,
    x_scales: torch.Tensor,
    pair_rows: torch.Tensor,
    pair_experts: torch.Tensor,
) -> torch.Tensor:
    """The narrow GEMM's exact result in float64 [P, N]: pair j is row pair_rows[j] of x (e4m3
    [rows, K], its fp32 scales [rows, K/32]) times local expert pair_experts[j]'s weights (w uint8
    [E, N, K/2] codes, s uint8 [E, N, K/32]). The kernel sums each k32 block in the MMA and the
    blocks in fp32 and rounds once to BF16: within 2^-8 of this relative, plus the fp32 sums'."""
    from dep_ep.experts.mxfp4 import mxfp4_dequantize

    k = x.shape[1]
    rows = x[pair_rows.long()].double().view(-1, k // SCALE_BLOCK, SCALE_BLOCK)
    rows = (rows * x_scales[pair_rows.long()].double().unsqueeze(-1)).view(-1, k)
    out = torch.empty(pair_rows.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    for e in pair_experts.unique().tolist():
        sel = pair_experts == e
        weights = mxfp4_dequantize(w[e], s[e], torch.float64)
        out[sel] = rows[sel] @ weights.T
    return out
