"""Device code: MXFP8 quantization of one block of 32 BF16 values, bit-exact with comm/mxfp8.py
(docs/formats.md)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Uint32

from dep_ep.comm.kernels.ptx import bits_f32, e4m3x2, f32_bits, mul_rn
from dep_ep.comm.kernels.tensors import BF16_PER_WORD, E4M3_PER_WORD
from dep_ep.constants import RCP_448_BITS, SCALE_BLOCK

BLOCK_WORDS_IN = SCALE_BLOCK // BF16_PER_WORD  # 32 bf16 = 16 words = 64 bytes
BLOCK_WORDS_OUT = SCALE_BLOCK // E4M3_PER_WORD  # 32 e4m3 = 8 words = 32 bytes
E8M0_NAN = 255  # the scale byte of a block holding a NaN (and the top of the saturation)


@cute.jit
def quantize_block(rIn: cute.Tensor, rOut: cute.Tensor) -> Uint32:
    """Quantize one block: rIn (rmem, BLOCK_WORDS_IN words = 32 BF16 in element order, the low
    half of each word first) into rOut (rmem, BLOCK_WORDS_OUT words = 32 e4m3 bytes in element
    order); returns the E8M0 scale byte.

    amax is taken on the integer bit patterns of |x| (monotonic for non-negative floats), so a NaN
    in the block makes amax a NaN and the scale 255, as torch.amax does on the reference side.
    """
    amax_bits = Uint32(0)
    for i in cutlass.range_constexpr(BLOCK_WORDS_IN):
        lo = (rIn[i] << 16) & Uint32(0x7FFFFFFF)
        hi = rIn[i] & Uint32(0x7FFF0000)
        amax_bits = cutlass.max(amax_bits, cutlass.max(lo, hi))
    v = f32_bits(mul_rn(bits_f32(amax_bits), bits_f32(Uint32(RCP_448_BITS))))
    exponent = (v >> 23) & Uint32(0xFF)
    mantissa = v & Uint32(0x7FFFFF)
    scale = exponent
    if mantissa != 0 and exponent != 254 and not (exponent == 0 and mantissa <= 0x400000):
        scale = exponent + 1
    scale = cutlass.min(scale, Uint32(E8M0_NAN))
    inv_bits = Uint32(0)
    if scale > 0 and scale < 254:
        inv_bits = (Uint32(254) - scale) << 23
    inv = bits_f32(inv_bits)
    for j in cutlass.range_constexpr(BLOCK_WORDS_OUT):
        w0, w1 = rIn[2 * j], rIn[2 * j + 1]
        q01 = e4m3x2(
            mul_rn(bits_f32(w0 & Uint32(0xFFFF0000)), inv), mul_rn(bits_f32(w0 << 16), inv)
        )
        q23 = e4m3x2(
            mul_rn(bits_f32(w1 & Uint32(0xFFFF0000)), inv), mul_rn(bits_f32(w1 << 16), inv)
        )
        rOut[j] = q01 | (q23 << 16)
    return scale
