"""Values at the edges of what EpRouted and EpMoeLayer accept (CPU ranks, 2-4 under mpiexec):
routing weights past the bound the combine can sum, int64 ids past int32, numpy scalars,
normalised devices, nn.Parameter weights, an x whose router logits overflow. Each is a clear
error on every rank or the correct result.

Each test says in its docstring how it failed on the code before these checks (main at
6f889cd, run once with this file as it is)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from dep_ep.comm.errors import EpPeerError
from dep_ep.config import TINY, EpConfig
from dep_ep.ep import EpMoeLayer, EpRouted
from dep_ep.experts.checkpoint import dense_shapes
from dep_ep.testing import SyntheticLayer, routed_reference
from dep_ep.testing.compare import compare

from helpers.cases import agreed_seed
from helpers.collective import collective_assert, expect_raises
from helpers.recovery import Batches

MAX_TOKENS = 16
T = 6


def build(dep, config=None, **kw) -> EpRouted:
    args = dict(num_experts=TINY.experts, latent=TINY.latent, topk=TINY.topk, max_tokens=MAX_TOKENS)
    args.update(kw)
    max_tokens, device = args.pop("max_tokens"), args.pop("device", "cpu")
    config = config or EpConfig(timeout_s=10.0)
    return EpRouted(dep.cpu_group, max_tokens, device, config=config, **args)


@pytest.fixture
def layer(dep):
    return SyntheticLayer(TINY, agreed_seed(dep.cpu_group, 400))


@pytest.mark.mpi(min_size=2)
def test_routing_weights_past_the_bound_are_refused(dep, layer):
    """Weights scaled by 5e37 (|w| up to ~5e37, past the 2^64 bound): ValueError on the rank that
    passes them naming the bound, EpPeerError on the others. Scaled by 1e18 (inside): finite rows
    equal to the reference. Before: the 5e37 call returned NaN rows and no error."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 410), T)
    failures: list[str] = []
    norm = layer.norm_weight()
    with build(dep) as routed:
        latent, ids, weights = batches.inputs(0)
        out = routed(latent, ids, weights * 1e18, norm, experts=batches.experts)
        ref = batches.reference(0)  # RMSNorm is scale invariant: the weights' scale drops out
        failures += compare(out, ref, "weights x 1e18")
        bad = dep.rank == 0
        scaled = weights * (5e37 if bad else 1.0)
        expected, match = (ValueError, "2\\^64") if bad else (EpPeerError, None)
        expect_raises(
            failures,
            "weights x 5e37",
            expected,
            match,
            lambda: routed(latent, ids, scaled, norm, experts=batches.experts),
        )
        failures += compare(batches.run(routed, 1), batches.reference(1), "the next batch")
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


@pytest.mark.mpi(min_size=2)
def test_int64_ids_past_int32_select_no_expert(dep, layer):
    """With check_values=False (the CUDA default) int64 ids of 2**31, 2**32 + 3 and -2**40 select
    no expert, as -1 does: the output equals the reference with those ids -1. Before: 2**32 + 3
    was truncated to expert 3 by the int32 staging (wrong rows, no error)."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 420), T)
    failures: list[str] = []
    with build(dep, config=EpConfig(timeout_s=10.0, check_values=False)) as routed:
        latent, ids, weights = batches.inputs(0)
        wide = ids.long()
        wide[0, 0], wide[1, 1], wide[2, 2] = 2**31, 2**32 + 3, -(2**40)
        cleared = ids.clone()
        cleared[0, 0] = cleared[1, 1] = cleared[2, 2] = -1
        out = routed(latent, wide, weights, layer.norm_weight(), experts=batches.experts)
        ref = Batches.reference_of(layer, latent, cleared, weights)
        failures += compare(out, ref, "int64 ids past int32")
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


@pytest.mark.mpi(min_size=2)
def test_numpy_scalars_and_device_spellings(dep, layer):
    """numpy integers for max_tokens, topk, num_experts and tokens, a numpy float eps and
    device="cpu:0" are accepted and give the reference's rows; tokens=6.0 is a TypeError naming
    the int it wants. Before: np.int64 tokens read "outside 1..16", np.int64 topk "built for
    topk=6", eps=np.float32 was refused, and "cpu:0" constructed but every call failed."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 430), T)
    failures: list[str] = []
    norm = layer.norm_weight()
    try:
        routed = build(
            dep,
            max_tokens=np.int64(MAX_TOKENS),
            topk=np.int64(TINY.topk),
            num_experts=np.int32(TINY.experts),
            device="cpu:0",
        )
    except Exception as err:  # reported collectively
        failures.append(f"construction: {type(err).__name__}: {err}")
        routed = build(dep)
    with routed:
        latent, ids, weights = batches.inputs(0)
        try:
            out = routed(
                latent,
                ids,
                weights,
                norm,
                experts=batches.experts,
                tokens=np.int64(T),
                eps=np.float32(1e-5),
            )
            failures += compare(out, batches.reference(0), "numpy tokens and eps")
        except Exception as err:
            failures.append(f"numpy tokens and eps: {type(err).__name__}: {err}")
        expect_raises(
            failures,
            "tokens=6.0",
            TypeError,
            "int",
            lambda: routed(latent, ids, weights, norm, experts=batches.experts, tokens=float(T)),
        )
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


def dense_weights(seed: int, parameters: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dense = {}
    for name, (shape, dtype) in dense_shapes(TINY).items():
        t = (torch.randn(shape, generator=gen) / shape[-1] ** 0.5).to(dtype)
        dense[name] = torch.nn.Parameter(t) if parameters else t
    return dense


@pytest.mark.mpi(min_size=2)
def test_layer_takes_parameters_and_names_an_overflowing_x(dep, layer):
    """EpMoeLayer built from nn.Parameter dense weights (as a model holds them) gives the bits of
    the same layer built from plain tensors. A finite x whose projections overflow (a row of
    3.3e38, near BF16's largest) raises ValueError naming x on that rank (EpPeerError on the
    others), not an internal tensor; the next call is finite.
    Before: torch's "out=... don't support automatic differentiation" error, and for the huge x
    "EpRouted.routed: weights[2, 0]=nan is not finite", naming an internal tensor."""
    seed = agreed_seed(dep.cpu_group, 440)
    failures: list[str] = []
    experts = Batches(dep, layer, seed, T).experts
    x = torch.randn(T, TINY.hidden, generator=torch.Generator().manual_seed(seed + dep.rank))
    x = x.to(torch.bfloat16)
    with build(dep) as routed:
        plain = EpMoeLayer(dense_weights(seed), routed, experts, topk=TINY.topk)
        want = plain(x)
        try:
            params = EpMoeLayer(
                dense_weights(seed, parameters=True), routed, experts, topk=TINY.topk
            )
            got = params(x)
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                failures.append("nn.Parameter weights: other bits than plain tensors")
        except Exception as err:
            failures.append(f"nn.Parameter weights: {type(err).__name__}: {err}")
            routed.reset()
        huge = x.clone()
        if dep.rank == 0:
            huge[2] = 3.3e38
        expected, match = (ValueError, "x row 2") if dep.rank == 0 else (EpPeerError, None)
        err = expect_raises(failures, "x of 3.3e38", expected, match, lambda: plain(huge))
        if dep.rank == 0 and err is not None and "weights[" in str(err):
            failures.append(f"the error names an internal tensor: {err}")
        again = plain(x)
        if not again.isfinite().all():
            failures.append("the call after the overflowing x is not finite")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_layer_takes_numpy_scalars_and_refuses_a_float_token_count(dep, layer):
    """EpMoeLayer on an EpRouted built with device="cpu:0", given numpy topk (np.int64), eps
    (np.float32) and layer_index (np.int64), called with tokens=np.int64(T): the bits of the
    same layer built and called with Python scalars. tokens=4.0 on rank 0 (T = 4 elsewhere):
    TypeError there naming tokens and "int", EpPeerError naming rank 0 on the others, within
    1 s; the next call gives the same bits again. (Issue 21, case 14, through the layer: on
    main at 6f889cd EpRouted read numpy tokens as "outside 1..8", refused numpy eps and failed
    every call after device="cpu:0"; this test was written after those fixes.)"""
    seed = agreed_seed(dep.cpu_group, 450)
    failures: list[str] = []
    experts = Batches(dep, layer, seed, T).experts
    x = torch.randn(4, TINY.hidden, generator=torch.Generator().manual_seed(seed + dep.rank))
    x = x.to(torch.bfloat16)
    eps = np.float32(1e-5)
    with build(dep, device="cpu:0") as routed:
        plain = EpMoeLayer(dense_weights(seed), routed, experts, topk=TINY.topk, eps=float(eps))
        want = plain(x, tokens=T)
        numpy_layer = None
        try:
            numpy_layer = EpMoeLayer(
                dense_weights(seed),
                routed,
                experts,
                topk=np.int64(TINY.topk),
                eps=eps,
                layer_index=np.int64(7),
            )
            if numpy_layer.layer_index != 7 or type(numpy_layer.layer_index) is not int:
                failures.append(f"layer_index={numpy_layer.layer_index!r}; expected the int 7")
            got = numpy_layer(x, tokens=np.int64(T))
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                failures.append("numpy topk, eps, layer_index and tokens: other bits")
        except Exception as err:
            failures.append(f"numpy scalars: {type(err).__name__}: {err}")
        if numpy_layer is not None:
            bad = dep.rank == 0
            tokens = 4.0 if bad else 4
            expected, match = (TypeError, "tokens.*int") if bad else (EpPeerError, "rank.*0")
            start = time.monotonic()
            expect_raises(
                failures, "tokens=4.0", expected, match, lambda: numpy_layer(x, tokens=tokens)
            )
            took = time.monotonic() - start
            print(f"TIME-TO-ERROR layer tokens=4.0 on rank 0, rank {dep.rank}: {took:.4f} s")
            if took > 1.0:
                failures.append(f"tokens=4.0: the error took {took:.2f} s")
            again = numpy_layer(x, tokens=np.int64(T))
            if not torch.equal(again.view(torch.int16), want.view(torch.int16)):
                failures.append("the call after tokens=4.0: other bits")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_an_eps_that_rounds_to_0_or_inf_in_fp32_is_refused(dep, layer):
    """eps=1e-46, 1e-300 and 5e-324 (finite and > 0, but 0.0 in fp32, where the norm adds it)
    and 3.5e38 (inf in fp32) on rank 0: ValueError there naming fp32's range, EpPeerError on
    the others, and the next call is good; EpMoeLayer refuses them at construction. The edges
    of the range, 2^-149 and fp32's largest, give the reference's rows, a row with no expert 0.
    Before: those calls returned without an error, the row with no expert NaN (eps 0.0 in
    fp32) or every row 0 (eps inf)."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 460), T)
    failures: list[str] = []
    norm = layer.norm_weight()
    latent, ids, weights = batches.inputs(0)
    ids = ids.clone()
    ids[1] = -1  # a real row routed nowhere (an engine's padding row): its output is 0
    with build(dep) as routed:
        for eps in (1e-46, 1e-300, 5e-324, 3.5e38):
            bad = dep.rank == 0
            mine = eps if bad else 1e-5
            expected, match = (ValueError, "fp32.*2\\^-149") if bad else (EpPeerError, "rank 0")
            expect_raises(
                failures,
                f"eps={eps}",
                expected,
                match,
                lambda: routed(latent, ids, weights, norm, experts=batches.experts, eps=mine),
            )
            expect_raises(
                failures,
                f"EpMoeLayer eps={eps}",
                ValueError,
                "fp32",
                lambda: EpMoeLayer(
                    dense_weights(1), routed, batches.experts, topk=TINY.topk, eps=eps
                ),
            )
            failures += compare(batches.run(routed, 1), batches.reference(1), f"after eps={eps}")
        for eps in (2.0**-149, float(torch.finfo(torch.float32).max)):
            out = routed(latent, ids, weights, norm, experts=batches.experts, eps=eps)
            ref = routed_reference(latent, ids, weights, norm, layer.expert, eps=eps)
            failures += compare(out, ref, f"eps={eps}")
            if not torch.equal(out[1], torch.zeros_like(out[1])):
                failures.append(f"eps={eps}: the row with no expert is {out[1, :4].tolist()}")
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)
