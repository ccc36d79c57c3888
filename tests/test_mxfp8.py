"""MXFP8 quantization against an independent bit-level computation in pure Python."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from dep_ep.comm.mxfp8 import mxfp8_dequantize, mxfp8_quantize
from dep_ep.constants import SCALE_BLOCK

from helpers.mxfp8_blocks import bf16_values, edge_blocks

R448 = struct.unpack("<f", struct.pack("<I", 0x3B124925))[0]


def f32(x: float) -> float:
    """Round a double to the nearest fp32 (C's cast: ties to even, subnormals kept)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


# Every finite non-negative e4m3 value with its code (0x00..0x7E).
E4M3 = []
for code in range(0x7F):
    e, m = code >> 3, code & 7
    E4M3.append(((m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7), code))


def e4m3_code(y: float) -> int:
    """Nearest e4m3 code of y (|y| <= 448), ties to the even code; sign bit for -0 too."""
    if math.isnan(y):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, y) < 0 else 0
    mag = abs(y)
    best = min(E4M3, key=lambda vc: (abs(vc[0] - mag), vc[1] & 1))
    return sign | best[1]


def reference_block(values: list[float]) -> tuple[list[int], int]:
    """The recipe of docs/formats.md, one block of 32 bf16 values (exact Python floats)."""
    amax = max(abs(v) for v in values)
    if math.isnan(amax) or math.isinf(amax) or any(math.isnan(v) for v in values):
        scale = 255
    else:
        bits = f32_bits(f32(amax * R448))
        e, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        if mant != 0 and e != 254 and not (e == 0 and mant <= 0x400000):
            e += 1
        scale = e
    mult = 0.0 if scale in (0, 254, 255) else 2.0 ** (127 - scale)
    codes = []
    for v in values:
        y = v * mult if not (math.isinf(v) and mult == 0.0) else math.nan
        if not math.isnan(y):
            y = max(-448.0, min(448.0, y))
        codes.append(e4m3_code(y))
    return codes, scale


def test_edge_blocks_bit_exact():
    blocks = edge_blocks()
    x = torch.tensor(blocks).to(torch.bfloat16)  # [blocks, 32]: one block per row
    q, sf = mxfp8_quantize(x)
    assert q.dtype == torch.uint8 and sf.dtype == torch.uint8 and sf.shape == (len(blocks), 1)
    for i, block in enumerate(blocks):
        codes, scale = reference_block(block)
        assert int(sf[i, 0]) == scale, f"block {i} (amax {max(map(abs, block))}): scale"
        assert q[i].tolist() == codes, f"block {i} (amax {max(map(abs, block))}): elements"


def test_random_rows_bit_exact_and_scale_layout():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    x = (
        torch.randn(3, 256, generator=gen)
        * torch.exp2(torch.randn(3, 8, 1, generator=gen) * 8).repeat_interleave(32, 1).squeeze(-1)
    ).bfloat16()
    q, sf = mxfp8_quantize(x)
    assert q.shape == (3, 256) and sf.shape == (3, 8)
    for row in range(3):
        for block in range(8):
            codes, scale = reference_block(bf16_values(x[row, block * 32 : (block + 1) * 32]))
            assert int(sf[row, block]) == scale
            assert q[row, block * 32 : (block + 1) * 32].tolist() == codes


def test_dequantize_exact():
    x = torch.tensor(edge_blocks()[:-1]).bfloat16()
    q, sf = mxfp8_quantize(x)
    back = mxfp8_dequantize(q, sf)
    for i in range(x.shape[0]):
        scale = int(sf[i, 0])
        for j in range(32):
            code = int(q[i, j])
            mag = dict((c, v) for v, c in E4M3)[code & 0x7F]
            value = (-mag if code & 0x80 else mag) * 2.0 ** (scale - 127)
            assert float(back[i, j]) == float(torch.tensor(value).bfloat16()), (i, j)


def test_non_finite_block_is_isolated():
    x = torch.randn(2, 64).bfloat16()
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    q, sf = mxfp8_quantize(x)
    assert sf[0].tolist()[0] == 255 and sf[1].tolist()[1] == 255
    ok_q, ok_sf = mxfp8_quantize(x[:, :32].clone().index_fill_(0, torch.tensor([0]), 1.0))
    assert sf[1, 0] == ok_sf[1, 0] and torch.equal(q[1, :32], ok_q[1])  # other blocks untouched
    back = mxfp8_dequantize(q, sf)
    assert back[0, :32].isnan().all() and back[0, 32:].isfinite().all()


@pytest.mark.parametrize("bad", ["dtype", "width"])
def test_bad_input(bad):
    x = torch.randn(2, 64) if bad == "dtype" else torch.randn(2, 48).bfloat16()
    with pytest.raises((TypeError, ValueError), match="mxfp8_quantize"):
        mxfp8_quantize(x)


def test_dequantize_is_exact_for_scale_bytes_3_to_246():
    """Every finite e4m3 code times 2^(byte - 127) is a BF16 value for scale bytes 3..246 (the
    docstring's claim), and not at 2 (the smallest codes under BF16's subnormals) nor 247 (the
    largest overflow)."""
    codes = torch.arange(256, dtype=torch.uint8)
    # every code but the two NaNs, cut to whole blocks (the 30 largest negative codes dropped;
    # the largest and smallest magnitudes stay)
    codes = codes[(codes & 0x7F) != 0x7F][:224].reshape(-1, SCALE_BLOCK)
    exact = {}
    for byte in (2, 3, 127, 246, 247):
        sf = torch.full((codes.shape[0], 1), byte, dtype=torch.uint8)
        want = codes.view(torch.float8_e4m3fn).double() * 2.0 ** (byte - 127)
        exact[byte] = torch.equal(mxfp8_dequantize(codes, sf).double(), want)
    assert exact == {2: False, 3: True, 127: True, 246: True, 247: False}
