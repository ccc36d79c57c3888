"""MXFP8 (e4m3 elements, one E8M0 scale per 32) quantization, bit-exact with FlashInfer's
`mxfp8_quantize` in the linear scale layout (the recipe of docs/formats.md), and the
exact dequantization. Runs on any device torch supports.

Non-finite input (not covered by FlashInfer's checked contract; ours, by the same formula):
a block whose amax is Inf or NaN gets scale byte 255 and multiplier 0, so its finite elements
become +-0 and its NaN/Inf elements become the canonical e4m3 NaN 0x7F (what the GPU's
cvt.rn.satfinite produces); dequantized, the whole block is NaN. Other blocks and other tokens are
untouched.
"""

from __future__ import annotations

import torch

from dep_ep.constants import E4M3_MAX, RCP_448, SCALE_BLOCK


def _check_latent(fn: str, x: torch.Tensor) -> None:
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{fn}: x dtype {x.dtype}; expected torch.bfloat16")
    if x.dim() < 1 or x.shape[-1] % SCALE_BLOCK:
        raise ValueError(
            f"{fn}: x shape {tuple(x.shape)}; the last dim must be a multiple of {SCALE_BLOCK}"
        )


def mxfp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize BF16 `x` [..., L] to (q uint8 [..., L] e4m3 bytes, sf uint8 [..., L/32] E8M0 bytes).

    Per block of 32: amax in fp32; v = amax * fp32(0x3B124925) (round to nearest); the scale byte
    is v's biased exponent rounded toward +inf (saturating at 254 for finite v, 255 for Inf/NaN,
    and not raised for a subnormal v whose mantissa is <= 0x400000); elements are multiplied by
    2^(127 - scale) (0 for scale bytes 0, 254 and 255), clamped to +-448 and rounded to e4m3
    (nearest, ties to even).
    """
    _check_latent("mxfp8_quantize", x)
    shape = x.shape
    blocks = x.float().reshape(*shape[:-1], shape[-1] // SCALE_BLOCK, SCALE_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # RCP_448: rcp.approx.ftz(448.0) as an exact Python float (a scalar keeps the op capturable
    # in a CUDA graph; torch multiplies a float32 tensor by it in float32).
    v_bits = (amax * RCP_448).view(torch.int32)
    exponent = (v_bits >> 23) & 0xFF
    mantissa = v_bits & 0x7FFFFF
    round_up = (mantissa != 0) & (exponent != 254) & ~((exponent == 0) & (mantissa <= 0x400000))
    scale = (exponent + round_up.to(torch.int32)).clamp(max=255)
    usable = (scale > 0) & (scale < 254)
    inv = torch.where(usable, (254 - scale) << 23, torch.zeros_like(scale)).view(torch.float32)
    scaled = (blocks * inv.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    q = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(scaled.isnan(), torch.full_like(q, 0x7F), q).reshape(shape)
    return q, scale.to(torch.uint8)


def e8m0_to_fp32(sf: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(byte - 127); byte 0 is 2^-127 (subnormal), byte 255 is NaN."""
    bits = sf.to(torch.int32) << 23
    bits = torch.where(sf == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(sf == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def mxfp8_dequantize(q: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """(q uint8 [..., L], sf uint8 [..., L/32]) -> BF16 [..., L]. Exact for scale bytes 3..246
    (every e4m3 value times 2^(byte - 127) is a BF16 value there); below 3 e4m3's smallest
    values fall under BF16's subnormals (2^-133), above 246 its largest overflow to inf; 255 is
    NaN."""
    if q.dtype != torch.uint8 or sf.dtype != torch.uint8:
        raise TypeError(f"mxfp8_dequantize: q {q.dtype}, sf {sf.dtype}; expected torch.uint8 both")
    if q.shape[:-1] != sf.shape[:-1] or q.shape[-1] != sf.shape[-1] * SCALE_BLOCK:
        raise ValueError(
            f"mxfp8_dequantize: q {tuple(q.shape)} and sf {tuple(sf.shape)} do not match"
            f" (sf last dim must be q's / {SCALE_BLOCK})"
        )
    values = q.view(torch.float8_e4m3fn).float()
    values = values.reshape(*sf.shape, SCALE_BLOCK) * e8m0_to_fp32(sf).unsqueeze(-1)
    return values.reshape(q.shape).to(torch.bfloat16)
