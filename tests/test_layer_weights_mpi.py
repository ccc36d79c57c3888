"""EpMoeLayer's dense weights after construction and the calls it refuses (CPU ranks, 2-4 under
mpiexec): a checkpoint loaded into the tensors after the layer was built, a weight update in
place, layers built on placeholders in other orders on other ranks, an x that needs grad, and a
model compiled around the layer."""

from __future__ import annotations

import pytest
import torch

from dep_ep.comm.errors import EpDesyncError, EpPeerError
from dep_ep.config import TINY, EpConfig
from dep_ep.ep import EpMoeLayer, EpRouted
from dep_ep.experts.checkpoint import DENSE_NAMES, DOWN, SHARED_GATE, SHARED_UP, dense_shapes
from dep_ep.testing import SyntheticLayer

from helpers.cases import agreed_seed
from helpers.collective import collective_assert, expect_raises
from helpers.recovery import Batches

T, MAX_TOKENS = 6, 16


def build(dep) -> EpRouted:
    return EpRouted(
        dep.cpu_group,
        MAX_TOKENS,
        "cpu",
        num_experts=TINY.experts,
        latent=TINY.latent,
        topk=TINY.topk,
        config=EpConfig(timeout_s=10.0),
    )


@pytest.fixture
def layer(dep):
    return SyntheticLayer(TINY, agreed_seed(dep.cpu_group, 900))


def dense_weights(seed: int) -> dict[str, torch.Tensor]:
    """One layer's dense tensors by checkpoint name (rms 1/sqrt(fan_in); norm weight near 1)."""
    gen = torch.Generator().manual_seed(seed)
    dense = {}
    for name, (shape, dtype) in dense_shapes(TINY).items():
        t = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        if name == "routed_expert_norm.weight":
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        dense[name] = t.to(dtype)
    return dense


def placeholders(like: dict[str, torch.Tensor], fused: bool) -> dict[str, torch.Tensor]:
    """Zeros shaped as `like` (a model's parameters before its checkpoint is loaded); `fused`:
    the shared gate, shared up and latent down as consecutive slices of one buffer (the layer
    then reads them in place instead of copying them)."""
    zeros = {name: torch.zeros_like(t) for name, t in like.items()}
    if fused:
        parts = (SHARED_GATE, SHARED_UP, DOWN)
        buffer = torch.zeros(sum(like[n].shape[0] for n in parts), like[DOWN].shape[1]).to(
            torch.bfloat16
        )
        start = 0
        for name in parts:
            rows = like[name].shape[0]
            zeros[name] = buffer[start : start + rows]
            start += rows
    return zeros


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


class Holder(torch.nn.Module):
    """A model's module holding the dense tensors as parameters (names with '.' as '__')."""

    def __init__(self, dense: dict[str, torch.Tensor]):
        super().__init__()
        for name, t in dense.items():
            self.register_parameter(name.replace(".", "__"), torch.nn.Parameter(t))

    def dense(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name.replace(".", "__")) for name in DENSE_NAMES}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fused", [False, True])
def test_a_checkpoint_loaded_after_construction_is_used(dep, layer, fused):
    """A layer built on zero placeholders (separate tensors, which it copies, or one fused
    buffer, which it reads in place), then loaded by copy_ and by a module's load_state_dict,
    gives the bits of a layer built on the loaded weights, with the same fingerprint; then an
    update in place (v1 -> v2) gives the bits of a layer built on v2. Before: the copied
    projections kept the placeholders (relative L2 1.0, no error)."""
    seed = agreed_seed(dep.cpu_group, 910)
    v1, v2 = dense_weights(seed), dense_weights(seed + 1)
    batches = Batches(dep, layer, seed, T)
    experts = batches.experts
    x = torch.randn(T, TINY.hidden, generator=torch.Generator().manual_seed(seed + dep.rank))
    x = x.to(torch.bfloat16)
    failures: list[str] = []
    with build(dep) as routed, torch.no_grad():
        copied = placeholders(v1, fused)
        by_copy = EpMoeLayer(copied, routed, experts, topk=TINY.topk)
        holder = Holder(placeholders(v1, fused))
        by_module = EpMoeLayer(holder.dense(), routed, experts, topk=TINY.topk)
        made_on_v1 = EpMoeLayer(v1, routed, experts, topk=TINY.topk)
        made_on_v2 = EpMoeLayer(v2, routed, experts, topk=TINY.topk)
        for name in DENSE_NAMES:
            copied[name].copy_(v1[name])
        holder.load_state_dict({n.replace(".", "__"): t for n, t in v1.items()})
        want = made_on_v1(x)
        for label, moe in (("copy_", by_copy), ("load_state_dict", by_module)):
            got = moe(x)
            if not torch.equal(bits(got), bits(want)):
                failures.append(f"fused={fused}, loaded by {label}: not the loaded weights' bits")
            if moe.fingerprint != made_on_v1.fingerprint:
                failures.append(f"fused={fused}, loaded by {label}: the placeholders' fingerprint")
        for name in DENSE_NAMES:
            copied[name].copy_(v2[name])
        if not torch.equal(bits(by_copy(x)), bits(made_on_v2(x))):
            failures.append(f"fused={fused}: after the update in place, not v2's bits")
        if by_copy.refresh():
            failures.append("refresh() after a call that read the update says it changed")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_layers_built_on_placeholders_in_other_orders(dep, layer):
    """Layers A and B built on zero placeholders (one fingerprint for both), rank 0 in the order
    A, B and the others B, A, no layer_index=, then loaded, each rank calling its layers in its
    own build order: EpDesyncError on every rank naming layer_index= (the fingerprints are those
    of the loaded weights). Before: every call paired A with B, relative L2 0.8-1.0, no error."""
    seed = agreed_seed(dep.cpu_group, 920)
    weights = {name: dense_weights(seed + i) for i, name in enumerate("AB", 1)}
    experts = Batches(dep, layer, seed, T).experts
    x = torch.randn(T, TINY.hidden, generator=torch.Generator().manual_seed(seed + dep.rank))
    x = x.to(torch.bfloat16)
    failures: list[str] = []
    with build(dep) as routed, torch.no_grad():
        held = {name: placeholders(weights[name], fused=False) for name in "AB"}
        order = "AB" if dep.rank == 0 else "BA"
        built = [EpMoeLayer(held[name], routed, experts, topk=TINY.topk) for name in order]
        for name in "AB":
            for tensor, value in zip(held[name].values(), weights[name].values()):
                tensor.copy_(value)
        expect_raises(failures, "the first call", EpDesyncError, "layer_index", lambda: built[0](x))
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_an_x_that_needs_grad_is_refused_on_every_rank(dep, layer):
    """x with requires_grad under autograd on rank 0: ValueError there saying the layer is
    inference-only, EpPeerError on the others; the same x under no_grad is served."""
    seed = agreed_seed(dep.cpu_group, 930)
    experts = Batches(dep, layer, seed, T).experts
    x = torch.randn(T, TINY.hidden, generator=torch.Generator().manual_seed(seed + dep.rank))
    x = x.to(torch.bfloat16).requires_grad_(dep.rank == 0)
    failures: list[str] = []
    with build(dep) as routed:
        moe = EpMoeLayer(dense_weights(seed), routed, experts, topk=TINY.topk)
        expected, match = (ValueError, "inference-only") if dep.rank == 0 else (EpPeerError, None)
        expect_raises(failures, "x needs grad", expected, match, lambda: moe(x))
        with torch.no_grad():
            out = moe(x)
        if out.shape != x.shape or not out.isfinite().all():
            failures.append("the call under no_grad did not serve x")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_a_model_compiled_around_the_layer_runs_it_eagerly(dep, layer):
    """torch.compile (backend "eager") of a function calling the layer twice gives the bits of
    the eager calls (the layer's forward is not traced). Before: TypeError on every rank."""
    seed = agreed_seed(dep.cpu_group, 940)
    experts = Batches(dep, layer, seed, T).experts
    x = torch.randn(T, TINY.hidden, generator=torch.Generator().manual_seed(seed + dep.rank))
    x = x.to(torch.bfloat16)
    failures: list[str] = []
    with build(dep) as routed, torch.no_grad():
        moe = EpMoeLayer(dense_weights(seed), routed, experts, topk=TINY.topk)

        def model(h: torch.Tensor) -> torch.Tensor:
            return moe(moe(h) * 0.5)

        want = model(x)
        got = torch.compile(model, backend="eager")(x)
        if not torch.equal(bits(got), bits(want)):
            failures.append("the compiled model's bits differ from the eager calls'")
    collective_assert(dep.cpu_group, failures, seeds=seed)
