"""Device code: MXFP8 quantization of one block of 32 BF16 values, bit-exact with
comm/mxfp8.py (docs/formats.md)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int64, Uint32

from dep_ep.comm.kernels.ptx import bits_f32, e4m3x2, f32_bits, mul_rn
from dep_ep.constants import RCP_448_BITS

BLOCK_WORDS_IN = 16  # 32 bf16 = 16 u32 = 64 bytes
BLOCK_WORDS_OUT = 8  # 32 e4m3 = 8 u32 = 32 bytes


def gmem_words(addr: Int64, words: int) -> cute.Tensor:
    """A gmem tensor of `words` u32 at a 16-byte aligned address: vector loads and stores."""
    ptr = cute.make_ptr(Uint32, addr, cute.AddressSpace.gmem, assumed_align=16)
    return cute.make_tensor(ptr, cute.make_layout(words))


@cute.jit
def quantize_block(src_addr: Int64, rOut: cute.Tensor) -> Uint32:
    """Quantize the 32 BF16 values at `src_addr` (64 bytes, 16-byte aligned) into rOut (rmem,
    8 u32 = 32 e4m3 bytes in element order) and return the E8M0 scale byte.

    amax is taken on the integer bit patterns of |x| (monotonic for non-negative floats), so a NaN
    in the block makes amax a NaN and the scale 255, as torch.amax does on the reference side.
    """
    rIn = cute.make_rmem_tensor(cute.make_layout(BLOCK_WORDS_IN), Uint32)
    cute.autovec_copy(gmem_words(src_addr, BLOCK_WORDS_IN), rIn)
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
    scale = cutlass.min(scale, Uint32(255))
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
