"""ReferenceExperts on receive rows against a float64 row-by-row computation."""

from __future__ import annotations

import pytest
import torch

from comm.mxfp8 import mxfp8_dequantize, mxfp8_quantize
from ep.geometry import TINY
from ep.synthetic import SyntheticLayer
from experts import ReferenceExperts, mxfp4_dequantize

FIRST, COUNT = 12, 12  # rank 1 of 4 under TINY


def rows_case(seed: int, num_rows: int = 40):
    gen = torch.Generator().manual_seed(seed)
    q, sf = mxfp8_quantize(torch.randn(num_rows, TINY.latent, generator=gen).bfloat16())
    ids = torch.randint(-1, TINY.experts, (num_rows, TINY.topk), generator=gen, dtype=torch.int32)
    ids[::5] = -1  # rows for another rank only
    ids[1::5, :2] = torch.tensor([FIRST, FIRST + COUNT - 1], dtype=torch.int32)  # range ends
    weights = torch.rand(num_rows, TINY.topk, generator=gen)
    return q, sf, ids, weights


def expected(layer, q, sf, ids, weights):
    x = mxfp8_dequantize(q, sf).double()
    out = torch.full((q.shape[0], TINY.latent), float("nan"), dtype=torch.float64)
    for r in range(q.shape[0]):
        acc, hit = torch.zeros(TINY.latent, dtype=torch.float64), False
        for k in range(TINY.topk):
            e = int(ids[r, k])
            if not FIRST <= e < FIRST + COUNT:
                continue
            hit = True
            w13, s13, w2, s2 = layer.expert(e)
            w13, w2 = mxfp4_dequantize(w13, s13).double(), mxfp4_dequantize(w2, s2).double()
            gu = w13 @ x[r]
            g, u = gu[: TINY.intermediate], gu[TINY.intermediate :]
            act = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
            acc += float(weights[r, k]) * (w2 @ act)
        if hit:
            out[r] = acc
    return out


def test_matches_float64_rows_and_leaves_other_rows():
    seed = int(torch.randint(0, 2**31, (1,)))
    layer = SyntheticLayer(TINY, seed=seed)
    experts = ReferenceExperts(*layer.local(FIRST, COUNT), first_expert=FIRST)
    q, sf, ids, weights = rows_case(seed)
    out = torch.full((q.shape[0], TINY.latent), float("nan"), dtype=torch.bfloat16)
    experts.forward(q, sf, ids, weights, out)
    want = expected(layer, q, sf, ids, weights)
    written = ~want[:, 0].isnan()
    assert written.sum() > 10 and (~written).sum() >= 8
    assert out[~written].isnan().all(), "rows without a local id must not be written"
    got = out[written].double()
    err = (got - want[written]).norm() / want[written].norm()
    assert err < 8e-3, f"seed {seed}: relative L2 error {err}"
    again = torch.full_like(out, float("nan"))
    experts.forward(q, sf, ids, weights, again)
    assert torch.equal(again[written], out[written])  # deterministic


def test_rejects_bad_weights():
    layer = SyntheticLayer(TINY, seed=1)
    w13, s13, w2, s2 = layer.local(0, 2)
    with pytest.raises(ValueError, match="s13 shape"):
        ReferenceExperts(w13, s13[:, :, :-1], w2, s2, first_expert=0)
    with pytest.raises(TypeError, match="w2 dtype"):
        ReferenceExperts(w13, s13, w2.int(), s2, first_expert=0)
    with pytest.raises(ValueError, match="first_expert"):
        ReferenceExperts(w13, s13, w2, s2, first_expert=-1)


def test_dense_experts_match_float64_rows():
    from experts import DenseExperts

    seed = int(torch.randint(0, 2**31, (1,)))
    layer = SyntheticLayer(TINY, seed=seed)
    dense = DenseExperts(*layer.local(FIRST, COUNT), first_expert=FIRST)
    q, sf, ids, weights = rows_case(seed)
    out = torch.full((q.shape[0], TINY.latent), float("nan"), dtype=torch.bfloat16)
    dense.forward(q, sf, ids, weights, out)
    want = expected(layer, q, sf, ids, weights)
    written = ~want[:, 0].isnan()
    err = (out[written].double() - want[written]).norm() / want[written].norm()
    assert err < 8e-3, f"seed {seed}: relative L2 error {err}"


def test_backends_declare_their_hardware():
    from experts.base import ExpertsBackend

    class NeedsBlackwell(ExpertsBackend):
        requires = "an NVIDIA GPU of compute capability 10.x"

        @classmethod
        def unsupported_reason(cls, device):
            return None if device.type == "cuda" else f"{device.type} is not a CUDA device"

        def forward(self, x, sf, ids, weights, out):
            return out

    ReferenceExperts.check_device(torch.device("cpu"))  # any device
    with pytest.raises(
        RuntimeError, match="NeedsBlackwell cannot run on cpu.*compute capability 10"
    ):
        NeedsBlackwell.check_device(torch.device("cpu"))
