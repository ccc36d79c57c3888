"""Every experts backend against the plain all-gather reference (testing/allgather_reference.py,
float64) on the same receive rows, fresh random data each run, output poisoned with NaN.

CPU cases run everywhere; CUDA cases run where a GPU is (single process:
`python -m pytest -q tests/test_experts_backends.py`), TrtllmExperts only on SM100/103 and
HopperExperts only on SM90: elsewhere their cases are reported as skipped with the reason."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dep_ep.comm.failure import FAILURE_WORDS, StepFailure
from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.config import K3, TINY, MoeGeometry
from dep_ep.experts import DenseExperts, ExpertWeights, ReferenceExperts
from dep_ep.experts.hopper import HopperExperts, HummingEngine, TritonEngine
from dep_ep.experts.trtllm import TrtllmExperts
from dep_ep.testing.allgather_reference import expert_sums
from dep_ep.testing.synthetic import SyntheticLayer
from dep_ep.testing.tolerance import EXPERTS_REL_L2, HUMMING_REL_L2, TRTLLM_REL_L2

K3_WIDTHS = MoeGeometry(
    "k3-widths",
    hidden=K3.hidden,
    latent=K3.latent,
    experts=64,
    topk=K3.topk,
    intermediate=K3.intermediate,
)


def reference_per_expert(weights: ExpertWeights) -> ReferenceExperts:
    """ReferenceExperts with FC1 forced to one GEMM per expert (CUDA otherwise batches it)."""
    backend = ReferenceExperts(weights)
    backend.batched_fc1_max_padding = 0.0
    return backend


# Each builds its backend from the ExpertWeights of the case (the geometry's E experts).
BACKENDS = {
    "reference": ReferenceExperts,
    "reference-per-expert": reference_per_expert,
    "dense": DenseExperts,
    "trtllm": TrtllmExperts,
    "hopper-humming": lambda weights: HopperExperts(weights, engine=HummingEngine()),
    "hopper-triton": lambda weights: HopperExperts(weights, engine=TritonEngine()),
}
# Backends with hardware needs: their CUDA cases skip elsewhere, naming the reason.
NEEDS = {"trtllm": TrtllmExperts, **{name: HopperExperts for name in BACKENDS if "hopper" in name}}
CASES = [
    ("reference", "cpu", TINY),
    ("dense", "cpu", TINY),
    ("reference", "cuda", TINY),
    ("dense", "cuda", TINY),
    ("reference", "cuda", K3_WIDTHS),
    ("reference-per-expert", "cuda", K3_WIDTHS),
    ("trtllm", "cuda", TINY),
    ("trtllm", "cuda", K3_WIDTHS),
    ("hopper-humming", "cuda", K3_WIDTHS),
    ("hopper-triton", "cuda", TINY),
    ("hopper-triton", "cuda", K3_WIDTHS),
]
# Relative L2 bounds from the error model of the backends' roundings (testing/tolerance.py).
TOLERANCE = {"trtllm": TRTLLM_REL_L2, "hopper-humming": HUMMING_REL_L2}  # FC2 input in MXFP8


def receive_rows(g: MoeGeometry, first: int, count: int, rows: int, gen: torch.Generator):
    """(latent bf16 [R, L], ids int32 [R, K], weights fp32 [R, K]): distinct ids per row, about
    half of them local; every fourth row has no local id, every fifth a few -1 slots."""
    ids = torch.empty(rows, g.topk, dtype=torch.int32)
    others = [e for e in range(g.experts) if not first <= e < first + count]
    for r in range(rows):
        local = (
            0 if r % 4 == 0 else int(torch.randint(1, min(count, g.topk) + 1, (1,), generator=gen))
        )
        pick_local = first + torch.randperm(count, generator=gen)[:local]
        pick_other = torch.tensor(others)[
            torch.randperm(len(others), generator=gen)[: g.topk - local]
        ]
        row = torch.cat((pick_local, pick_other))
        ids[r] = row[torch.randperm(g.topk, generator=gen)]
    ids[::5, -2:] = -1
    latent = torch.randn(rows, g.latent, generator=gen).to(torch.bfloat16)
    weights = torch.rand(rows, g.topk, generator=gen)
    return latent, ids, weights


@pytest.mark.parametrize(
    "name,device,geometry", CASES, ids=[f"{n}-{d}-{g.name}" for n, d, g in CASES]
)
def test_backend_matches_allgather_reference(name, device, geometry):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    if name in NEEDS:
        backend_type = NEEDS[name]
        reason = backend_type.unsupported_reason(torch.device(device))
        if reason is not None:
            pytest.skip(f"{backend_type.__name__} needs {backend_type.requires}: {reason}")
    if name == "hopper-humming" and importlib.util.find_spec("humming") is None:
        pytest.skip(
            "HopperExperts(engine=HummingEngine()) needs humming-kernels: pip install -e '.[gpu]'"
        )
    seed = int(torch.randint(0, 2**31, (1,)))
    gen = torch.Generator().manual_seed(seed)
    first, count = 8, 8
    layer = SyntheticLayer(geometry, seed)
    backend = BACKENDS[name](layer.local_weights(first, count).to(device))
    latent, ids, weights = (t.to(device) for t in receive_rows(geometry, first, count, 64, gen))
    x, sf = mxfp8_quantize(latent)
    out = torch.full((64, geometry.latent), float("nan"), dtype=torch.bfloat16, device=device)
    backend.forward(x, sf, ids, weights, out)

    local = (ids >= first) & (ids < first + count)
    want = expert_sums(latent, torch.where(local, ids, -1), weights, layer.expert)
    written = local.any(dim=1)
    assert written.sum() >= 40 and (~written).sum() >= 10
    got = out[written].double()
    assert not got.isnan().any(), f"{name} seed {seed}: NaN in rows with a local id"
    err = (got - want[written]).norm() / want[written].norm()
    bound = TOLERANCE.get(name, EXPERTS_REL_L2)
    assert err < bound, f"{name} on {device} seed {seed}: relative L2 error {err:.2e} > {bound:.2e}"


class _FailureRecorder(ReferenceExperts):
    """ReferenceExperts that takes forward's `failure=` (device_failures True, as HopperExperts)
    and keeps what each call got."""

    device_failures = True

    def forward(self, x, sf, ids, weights, out, failure=None):
        self.failures.append(failure)
        self.pairs.append(int((ids >= 0).sum()))
        return super().forward(x, sf, ids, weights, out)

    def max_pairs(self, rows, topk):
        return self.budget


def test_warmup_calls_a_device_failures_backend_with_a_step_failure():
    """warmup runs forward as EpRouted does: with a StepFailure for a backend whose
    device_failures is True (so HopperExperts' finalize kernel with FAIL_STEP is compiled
    before a capture; before, the capture compiled it at T = 1 on one H200), and without one
    for the others."""
    layer = SyntheticLayer(TINY, int(torch.randint(0, 2**31, (1,))))
    recorder = _FailureRecorder(layer.local_weights(0, TINY.experts))
    recorder.failures, recorder.pairs, recorder.budget = [], [], 48
    recorder.warmup(3, TINY.topk)
    assert len(recorder.failures) == 1 and recorder.pairs == [3]
    failure = recorder.failures[0]
    assert isinstance(failure, StepFailure)
    assert failure.status.shape == (1,) and failure.status.dtype == torch.int64
    assert failure.record.shape == (FAILURE_WORDS,) and failure.record.dtype == torch.int64
    # With a count of calls done, as the device transport's StepFailure: the kernels compile the
    # variant a step runs (HAS_CALL), not one the capture would compile again.
    assert failure.calls_done is not None and failure.calls_done.shape == (1,)
    assert failure.calls_done.dtype == torch.int64
    plain = ReferenceExperts(layer.local_weights(0, TINY.experts))
    calls = []
    plain.forward = lambda *args, **kwargs: calls.append(kwargs)
    plain.warmup(3, TINY.topk)
    assert calls == [{}]


def test_warmup_holds_no_more_pairs_than_the_backends_budget():
    """warmup's scratch rows hold one local id each up to max_pairs(rows, topk), and none past
    it: a warm-up over a pair budget would set HopperExperts' sticky over-budget record (a later
    check_pair_budget() raised for a call that never ran) and, with a StepFailure, write the
    scratch record after warmup returned."""
    layer = SyntheticLayer(TINY, int(torch.randint(0, 2**31, (1,))))
    recorder = _FailureRecorder(layer.local_weights(0, TINY.experts))
    recorder.failures, recorder.pairs = [], []
    for rows, budget, want in ((40, 7, 7), (5, 100, 5), (9, 0, 0)):
        recorder.budget = budget
        recorder.warmup(rows, TINY.topk)
        assert recorder.pairs[-1] == want, (rows, budget, recorder.pairs)
    assert ReferenceExperts(layer.local_weights(0, 4)).max_pairs(6, TINY.topk) == 6 * TINY.topk


def test_warmup_refuses_what_no_call_has():
    """warmup's rows and topk: ints, rows >= 0 (0 does nothing), topk >= 1; before, topk 0
    raised an IndexError from torch, rows -3 did nothing and rows 8.0 raised torch's TypeError
    from zeros()."""
    backend = ReferenceExperts(SyntheticLayer(TINY, seed=2).local_weights(0, 4))
    with pytest.raises(ValueError, match=r"ReferenceExperts.warmup: rows=8, topk=0; expected"):
        backend.warmup(8, 0)
    with pytest.raises(ValueError, match=r"rows=-3, topk=6; expected rows >= 0"):
        backend.warmup(-3, 6)
    with pytest.raises(TypeError, match=r"ReferenceExperts.warmup: rows=8.0; expected an int"):
        backend.warmup(8.0, 6)
    backend.warmup(0, 6)
    backend.warmup(torch.tensor(2), 6)  # an integer of any kind
