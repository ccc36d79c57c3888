"""ReferenceExperts on receive rows against a float64 row-by-row computation."""

from __future__ import annotations

import pytest
import torch

from comm.mxfp8 import mxfp8_dequantize, mxfp8_quantize
from ep.geometry import TINY
from ep.synthetic import SyntheticLayer
from experts import DenseExperts, ReferenceExperts, mxfp4_dequantize

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


def run_backend(kind, seed: int):
    """(backend, out, want, written, inputs): `kind` on fresh rows of `seed`, output poisoned with
    NaN before the call; want is the float64 row-by-row result, written its rows with a local id."""
    layer = SyntheticLayer(TINY, seed=seed)
    backend = kind(*layer.local(FIRST, COUNT), first_expert=FIRST)
    inputs = rows_case(seed)
    out = torch.full((inputs[0].shape[0], TINY.latent), float("nan"), dtype=torch.bfloat16)
    backend.forward(*inputs, out)
    want = expected(layer, *inputs)
    return backend, out, want, ~want[:, 0].isnan(), inputs


@pytest.mark.parametrize("kind", [ReferenceExperts, DenseExperts])
def test_matches_float64_rows(kind):
    seed = int(torch.randint(0, 2**31, (1,)))
    backend, out, want, written, inputs = run_backend(kind, seed)
    assert written.sum() > 10 and (~written).sum() >= 8
    err = (out[written].double() - want[written]).norm() / want[written].norm()
    assert err < 8e-3, f"{kind.__name__} seed {seed}: relative L2 error {err}"
    again = torch.full_like(out, float("nan"))
    backend.forward(*inputs, again)
    assert torch.equal(again[written], out[written])  # deterministic


def test_reference_leaves_rows_without_local_ids():
    _, out, _, written, _ = run_backend(ReferenceExperts, int(torch.randint(0, 2**31, (1,))))
    assert out[~written].isnan().all(), "rows without a local id must not be written"


def test_rejects_bad_weights():
    layer = SyntheticLayer(TINY, seed=1)
    w13, s13, w2, s2 = layer.local(0, 2)
    with pytest.raises(ValueError, match="s13 shape"):
        ReferenceExperts(w13, s13[:, :, :-1], w2, s2, first_expert=0)
    with pytest.raises(TypeError, match="w2 dtype"):
        ReferenceExperts(w13, s13, w2.int(), s2, first_expert=0)
    with pytest.raises(ValueError, match="first_expert"):
        ReferenceExperts(w13, s13, w2, s2, first_expert=-1)


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
