"""Constants of the formats and of the kernels, defined once: the torch reference, the CuTeDSL
kernels, the layout and the validation all import them from here."""

SCALE_BLOCK = 32  # MXFP8/MXFP4 elements per E8M0 scale byte (the OCP MX block size)
E4M3_MAX = 448.0  # largest finite e4m3 magnitude
# MXFP8 scale rule: amax times rcp.approx.ftz(448.0), whose fp32 bits are these (docs/formats.md).
RCP_448_BITS = 0x3B124925

# The GPU kernels keep a token's set of destination ranks in a 32-bit mask.
MAX_RANKS = 32
# The dispatch kernel writes a token's ids and weights with one thread per k (128 threads a CTA).
MAX_TOPK = 128

# The combine kernel normalises one token per warp: lane l owns the 8-element (16-byte) chunks
# l, l + 32, ... of the row. The torch reference sums squares in the same order (bitwise equal).
NORM_LANES = 32
NORM_CHUNK = 8
