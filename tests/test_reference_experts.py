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
    backend = kind(layer.local_weights(FIRST, COUNT))
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


@pytest.mark.parametrize("kind", [ReferenceExperts, DenseExperts])
def test_takes_expert_weights_only(kind):
    """The weights' checks are ExpertWeights' (tests/test_expert_weights.py); the backend takes
    its geometry and refuses the four tensors."""
    weights = SyntheticLayer(TINY, seed=1).local_weights(FIRST, COUNT)
    backend = kind(weights)
    assert (backend.first_expert, backend.num_local_experts) == (FIRST, COUNT)
    assert (backend.num_experts, backend.latent, backend.intermediate) == (48, 256, 128)
    with pytest.raises(TypeError, match=f"{kind.__name__}: weights is tuple; expected an Expert"):
        kind(weights.tensors)


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
