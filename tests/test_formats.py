"""MXFP4 formats, EpLayout geometry and sizes, SiTU, the router."""

from __future__ import annotations

import pytest
import torch

from dep_ep.comm.layout import ALIGN_BYTES, EpLayout
from dep_ep.config import K3, TINY, MoeGeometry
from dep_ep.ep.router import route
from dep_ep.experts.mxfp4 import E2M1_VALUES, mxfp4_dequantize, mxfp4_pack, mxfp4_unpack
from dep_ep.experts.situ import situ


def test_mxfp4_nibble_order_and_values():
    packed = torch.tensor([[0x21, 0xF9]], dtype=torch.uint8)  # codes 1,2 then 9,15
    assert mxfp4_unpack(packed).tolist() == [[1, 2, 9, 15]]
    scales = torch.tensor([[128]], dtype=torch.uint8)  # one scale covers 32: pad to 16 bytes
    packed16 = torch.zeros(1, 16, dtype=torch.uint8)
    packed16[0, :2] = packed[0]
    values = mxfp4_dequantize(packed16, scales, torch.float32)
    assert values[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0]


def test_mxfp4_pack_roundtrip_random():
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    assert torch.equal(mxfp4_unpack(mxfp4_pack(codes)), codes)
    scales = torch.randint(100, 140, (3, 5, 2), dtype=torch.uint8)
    got = mxfp4_dequantize(mxfp4_pack(codes), scales, torch.float32)
    table = torch.tensor(E2M1_VALUES)
    want = table[codes.long()] * torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert torch.equal(got, want)
    assert torch.equal(mxfp4_dequantize(mxfp4_pack(codes), scales).float(), want)  # bf16 exact
    with pytest.raises(ValueError, match="mxfp4_pack"):
        mxfp4_pack(torch.full((1, 2), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="mxfp4_dequantize"):
        mxfp4_dequantize(mxfp4_pack(codes), scales[..., :1])


def test_mxfp4_helpers_name_what_is_wrong():
    """A K that is not a multiple of 32 (whose scales' shape then matched) and a wrong dtype
    are refused by name; before, mxfp4_dequantize raised torch's reshape error, and mxfp4_pack
    a ValueError where mxfp4_unpack raised a TypeError for the same dtype."""
    with pytest.raises(ValueError, match="K=40 elements a row; K must be a positive multiple"):
        mxfp4_dequantize(
            torch.zeros(4, 20, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8)
        )
    with pytest.raises(ValueError, match="K=16 elements a row"):
        mxfp4_dequantize(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 0, dtype=torch.uint8))
    for fn in (mxfp4_pack, mxfp4_unpack):
        with pytest.raises(TypeError, match=f"{fn.__name__}: .* dtype torch.int64; expected"):
            fn(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="mxfp4_dequantize: scales dtype torch.int8"):
        mxfp4_dequantize(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.int8))
    with pytest.raises(TypeError, match="mxfp4_dequantize: packed dtype torch.int8"):
        mxfp4_dequantize(torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="mxfp4_pack: codes shape \\(2, 3\\); need K"):
        mxfp4_pack(torch.zeros(2, 3, dtype=torch.uint8))


def test_layout_regions_aligned_disjoint():
    layout = EpLayout(num_ranks=3, max_tokens=37, latent=256, topk=6)
    regions = sorted(layout.regions.values(), key=lambda r: r.offset)
    for a, b in zip(regions, regions[1:]):
        assert a.offset % ALIGN_BYTES == 0 and a.offset + a.nbytes <= b.offset
    assert regions[-1].offset + regions[-1].nbytes <= layout.total_bytes
    assert layout.stride(5) == 5 and layout.rows(5) == 15
    for bad in (0, 38):
        with pytest.raises(ValueError, match="outside 1..37"):
            layout.stride(bad)
    with pytest.raises(ValueError, match="latent"):
        EpLayout(2, 4, 100, 4)


def test_k3_memory_budget():
    """Symmetric memory per rank at K3, 16 ranks, 256 max tokens: at most 64 MiB."""
    layout = EpLayout(16, 256, K3.latent, K3.topk)
    assert layout.total_bytes <= 64 * 2**20, layout.total_bytes / 2**20


def test_situ_matches_formula():
    g, u = torch.randn(100) * 8, torch.randn(100) * 40
    want = (
        4
        * torch.tanh(g.double() / 4)
        * torch.sigmoid(g.double())
        * 25
        * torch.tanh(u.double() / 25)
    )
    assert torch.allclose(situ(g, u).double(), want, rtol=1e-5, atol=1e-6)


def test_router_bias_selects_only():
    torch.manual_seed(3)
    hidden = torch.randn(9, 64).bfloat16()
    gate = torch.randn(16, 64).bfloat16()
    bias = torch.zeros(16)
    bias[5] = 100.0  # forces expert 5 into every top-k
    ids, weights = route(hidden, gate, bias, 4)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert (ids == 5).any(dim=1).all()
    scores = torch.sigmoid(hidden.float() @ gate.float().T)
    unbiased = scores.gather(1, ids.long())
    assert torch.allclose(weights, unbiased / unbiased.sum(1, keepdim=True), rtol=1e-6)
    assert torch.allclose(weights.sum(1), torch.ones(9))


def test_geometry_validation():
    assert K3.latent == 3584 and K3.experts == 896 and TINY.experts % 12 == 0
    with pytest.raises(ValueError, match="multiple of 32"):
        MoeGeometry("bad", 64, 48, 8, 2, 64)
    with pytest.raises(ValueError, match="topk"):
        MoeGeometry("bad", 64, 64, 4, 8, 64)
