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
    # On a mismatch, how far apart: last-bit differences in a few rows point at a GEMM's sum
    # order (BLAS threads), NaN or large ones at memory the call did not write.
    differ = again[written] != out[written]
    gap = (again[written].float() - out[written].float())[differ].abs().max() if differ.any() else 0
    assert not differ.any(), (
        f"{kind.__name__} seed {seed}: {int(differ.any(1).sum())} of {int(written.sum())} rows"
        f" differ, largest |difference| {float(gap):.3g}, {torch.get_num_threads()} threads"
    )


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


@pytest.mark.parametrize("kind", [ReferenceExperts, DenseExperts])
def test_a_non_finite_expert_reaches_only_the_rows_that_chose_it(kind):
    """Local expert 0's weights hold a NaN scale byte (255); rows that never chose it stay
    finite and equal to the backend on the same weights with that byte finite, rows that did
    are NaN. DenseExperts computed every expert on every row and multiplied the clamped expert's
    output by a zero weight: 0 * NaN made every row NaN."""
    seed = int(torch.randint(0, 2**31, (1,)))
    layer = SyntheticLayer(TINY, seed=seed)
    clean = layer.local_weights(FIRST, COUNT)
    w13, s13, w2, s2 = (t.clone() for t in clean.tensors)
    s2[0, 3, 1] = 255  # one block of expert FIRST's down projection: NaN
    poisoned = type(clean)(w13, s13, w2, s2, first_expert=FIRST, num_experts=TINY.experts)
    q, sf, ids, weights = rows_case(seed)
    ids[ids == FIRST] = FIRST + 1
    ids[:4, 0] = FIRST  # four rows chose the poisoned expert
    chose = (ids == FIRST).any(dim=1)
    written = ((ids >= FIRST) & (ids < FIRST + COUNT)).any(dim=1)
    want = torch.full((ids.shape[0], TINY.latent), float("nan"), dtype=torch.bfloat16)
    kind(clean).forward(q, sf, ids, weights, want)
    got = torch.full_like(want, float("nan"))
    kind(poisoned).forward(q, sf, ids, weights, got)
    others = written & ~chose
    assert others.sum() > 10, f"seed {seed}"
    assert torch.equal(got[others], want[others]), f"{kind.__name__} seed {seed}"
    assert got[chose].isnan().any(dim=1).all(), f"{kind.__name__} seed {seed}"


@pytest.mark.parametrize("kind", [ReferenceExperts, DenseExperts])
@pytest.mark.parametrize("name", ["x", "sf", "ids", "weights"])
def test_forward_refuses_an_out_sharing_memory_with_an_input(kind, name):
    """An input stored inside `out`'s bytes is refused (experts.base.check_receive_rows, which
    every backend calls; before, HopperExperts' finalize wrote rows of out over weights it still
    read: rows up to 4.9 off at outputs of about 5, no error; found by a careless-user probe).
    The inputs and out are left as they were."""
    backend = kind(SyntheticLayer(TINY, seed=1).local_weights(FIRST, COUNT))
    args = dict(zip(("x", "sf", "ids", "weights"), rows_case(3)))
    out = torch.full((args["x"].shape[0], TINY.latent), float("nan"), dtype=torch.bfloat16)
    inside = out.view(-1).view(args[name].dtype)[: args[name].numel()].view(args[name].shape)
    inside.copy_(args[name])
    args[name] = inside
    before = out.clone()
    with pytest.raises(ValueError, match=f"{kind.__name__}.forward: out shares memory with {name}"):
        backend.forward(args["x"], args["sf"], args["ids"], args["weights"], out)
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))
    # Apart, the same values are taken (the refusal is about the memory, not the values).
    apart = {key: value.clone() for key, value in args.items()}
    backend.forward(apart["x"], apart["sf"], apart["ids"], apart["weights"], out)


@pytest.mark.parametrize("kind", [ReferenceExperts, DenseExperts])
def test_forward_refuses_rows_off_the_row_contract(kind):
    """forward checks the row contract as the GPU backends do (experts.base.check_receive_rows):
    before, float ids were truncated (12.9 read as expert 12), ids for fewer rows than x left
    rows unwritten, and extra weight columns were ignored, all with no error."""
    backend = kind(SyntheticLayer(TINY, seed=1).local_weights(FIRST, COUNT))
    q, sf, ids, weights = rows_case(2)
    out = torch.empty(q.shape[0], TINY.latent, dtype=torch.bfloat16)
    name = kind.__name__
    with pytest.raises(TypeError, match=f"{name}.forward: ids dtype torch.float32"):
        backend.forward(q, sf, ids.float() + 0.9, weights, out)
    with pytest.raises(ValueError, match=f"{name}.forward: ids shape"):
        backend.forward(q, sf, ids[:4], weights[:4], out)
    with pytest.raises(ValueError, match=f"{name}.forward: weights shape"):
        backend.forward(q, sf, ids, torch.cat([weights, weights], 1), out)
    with pytest.raises(ValueError, match=f"{name}.forward: x shape"):
        backend.forward(torch.cat([q, q], 1), torch.cat([sf, sf], 1), ids, weights, out)
    with pytest.raises(TypeError, match=f"{name}.forward: out dtype torch.float32"):
        backend.forward(q, sf, ids, weights, out.float())
    # Found by a careless-user probe: a NumPy x raised AttributeError ('dim'), ids of no column
    # an error naming an internal function (HopperExperts), and a strided out was told to call
    # .contiguous(), whose copy the result would not reach.
    with pytest.raises(TypeError, match=f"{name}.forward: x is ndarray; expected a torch.Tensor"):
        backend.forward(q.numpy(), sf, ids, weights, out)
    with pytest.raises(TypeError, match=f"{name}.forward: ids is NoneType; expected a torch"):
        backend.forward(q, sf, None, weights, out)
    with pytest.raises(ValueError, match=rf"{name}.forward: ids shape \(\d+, 0\); expected topk"):
        backend.forward(q, sf, ids[:, :0].contiguous(), weights[:, :0].contiguous(), out)
    # 1-D ids or x were told to have shape (R, -1) or (-1, L).
    with pytest.raises(
        ValueError, match=rf"{name}.forward: ids shape \(\d+,\); expected a 2-D \[R, K\]"
    ):
        backend.forward(q, sf, ids[:, 0].contiguous(), weights, out)
    with pytest.raises(
        ValueError, match=rf"{name}.forward: x shape \(\d+,\); expected a 2-D \[R, L\]"
    ):
        backend.forward(q.view(-1), sf, ids, weights, out)
    wide = torch.empty(q.shape[0], 2 * TINY.latent, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"{name}.forward: out must be contiguous.*pass a contig"):
        backend.forward(q, sf, ids, weights, wide[:, : TINY.latent])
