"""ReferenceExperts and DenseExperts: determinism, untouched rows, argument errors, hardware
declarations."""

from __future__ import annotations

import pytest
import torch

from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.config import TINY
from dep_ep.experts import DenseExperts, ReferenceExperts
from dep_ep.testing.synthetic import SyntheticLayer

FIRST, COUNT = 12, 12  # rank 1 of 4 under TINY


def rows_case(seed: int, num_rows: int = 40):
    gen = torch.Generator().manual_seed(seed)
    q, sf = mxfp8_quantize(torch.randn(num_rows, TINY.latent, generator=gen).bfloat16())
    ids = torch.randint(-1, TINY.experts, (num_rows, TINY.topk), generator=gen, dtype=torch.int32)
    ids[::5] = -1  # rows for another rank only
    ids[1::5, :2] = torch.tensor([FIRST, FIRST + COUNT - 1], dtype=torch.int32)  # range ends
    weights = torch.rand(num_rows, TINY.topk, generator=gen)
    return q, sf, ids, weights


def run_backend(kind, seed: int):
    """(out, again, written): `kind` twice on the same fresh rows of `seed`, outputs poisoned
    with NaN before each call; written marks the rows with a local id."""
    layer = SyntheticLayer(TINY, seed=seed)
    backend = kind(*layer.local(FIRST, COUNT), first_expert=FIRST)
    inputs = rows_case(seed)
    out = torch.full((inputs[0].shape[0], TINY.latent), float("nan"), dtype=torch.bfloat16)
    again = out.clone()
    backend.forward(*inputs, out)
    backend.forward(*inputs, again)
    ids = inputs[2]
    written = ((ids >= FIRST) & (ids < FIRST + COUNT)).any(dim=1)
    return out, again, written


@pytest.mark.parametrize("kind", [ReferenceExperts, DenseExperts])
def test_deterministic(kind):
    """Accuracy against the all-gather reference: tests/test_experts_backends.py."""
    seed = int(torch.randint(0, 2**31, (1,)))
    out, again, written = run_backend(kind, seed)
    assert written.sum() > 10 and (~written).sum() >= 8
    assert not out[written].isnan().any(), f"seed {seed}"
    assert torch.equal(again[written], out[written]), f"{kind.__name__} seed {seed}"


def test_reference_leaves_rows_without_local_ids():
    out, _, written = run_backend(ReferenceExperts, int(torch.randint(0, 2**31, (1,))))
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
    from dep_ep.experts.base import ExpertsBackend

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
