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
from dep_ep.experts import ExpertWeights
from dep_ep.experts.checkpoint import (
    BIAS,
    DENSE_NAMES,
    DOWN,
    GATE,
    NORM,
    SHARED_DOWN,
    SHARED_GATE,
    SHARED_UP,
    UP,
)
from dep_ep.testing import SyntheticLayer

from helpers.cases import agreed_seed
from helpers.collective import collective_assert, expect_raises
from helpers.layer_case import make_dense
from helpers.recovery import Batches, run_by_parts

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


def case(dep, layer: SyntheticLayer, base: int) -> tuple[int, object, torch.Tensor]:
    """The test's seed (`base` plus an offset every rank agrees on), this rank's experts of
    `layer` and its x, bf16 [T, H]."""
    seed = agreed_seed(dep.cpu_group, base)
    experts = Batches(dep, layer, seed, T).experts
    x = torch.randn(T, TINY.hidden, generator=torch.Generator().manual_seed(seed + dep.rank))
    return seed, experts, x.to(torch.bfloat16)


def placeholders(like: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Zeros shaped as `like` (a model's parameters before its checkpoint is loaded), the three
    projections the layer packs laid out as `layout`: "separate" tensors (the layer re-points
    them into its packed weight), "fused" (consecutive slices of one buffer in packing order,
    read in place), "merged" (shared gate and up as the two halves of one [2S, H] tensor, as an
    engine's merged gate_up parameter; re-pointed whole), or "sliced" (gate and up slices of a
    buffer with rows to spare, which the layer can only copy)."""
    zeros = {name: torch.zeros_like(t) for name, t in like.items()}
    rows = {name: like[name].shape[0] for name in (SHARED_GATE, SHARED_UP, DOWN)}
    width = like[DOWN].shape[1]
    if layout == "fused":
        buffer = torch.zeros(sum(rows.values()), width, dtype=torch.bfloat16)
        start = 0
        for name in (SHARED_GATE, SHARED_UP, DOWN):
            zeros[name] = buffer[start : start + rows[name]]
            start += rows[name]
    elif layout in ("merged", "sliced"):
        spare = 0 if layout == "merged" else 3
        merged = torch.zeros(rows[SHARED_GATE] + rows[SHARED_UP] + spare, width).to(torch.bfloat16)
        zeros[SHARED_GATE] = merged[: rows[SHARED_GATE]]
        zeros[SHARED_UP] = merged[rows[SHARED_GATE] : rows[SHARED_GATE] + rows[SHARED_UP]]
    return zeros


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def roots(dense: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The distinct tensors whose storage `dense` views (a merged buffer once), as a loader
    writes them."""
    seen: dict[int, torch.Tensor] = {}
    for t in dense.values():
        root = t._base if t._base is not None else t
        seen.setdefault(id(root), root)
    return list(seen.values())


def load(dep, dense: dict[str, torch.Tensor], values: dict[str, torch.Tensor], how: str) -> None:
    """Write `values` into the tensors of `dense` (kept as the caller holds them) by `how`:
    "copy_", ".data.copy_" (vLLM's default weight loader), "load_state_dict" (of a module holding
    them as buffers), or "broadcast" (rank 0 holds the values, the others receive them)."""
    pairs = list(zip(dense.values(), values.values()))
    with torch.no_grad():
        if how == "load_state_dict":
            holder = torch.nn.Module()
            for i, t in enumerate(dense.values()):
                holder.register_buffer(f"t{i}", t, persistent=True)
            holder.load_state_dict({f"t{i}": v for i, (_, v) in enumerate(pairs)})
        for t, v in pairs:
            if how == "copy_":
                t.copy_(v)
            elif how == ".data.copy_":
                t.data.copy_(v)
            elif how == "broadcast":
                t.copy_(v if dep.rank == 0 else torch.full_like(v, 7.0))
        if how == "broadcast":
            for root in roots(dense):
                torch.distributed.broadcast(root, src=0, group=dep.cpu_group)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "layout,how",
    [
        ("separate", "copy_"),
        ("separate", ".data.copy_"),
        ("separate", "load_state_dict"),
        ("separate", "broadcast"),
        ("fused", "copy_"),
        ("merged", ".data.copy_"),
    ],
)
def test_a_checkpoint_loaded_after_construction_is_used(dep, layer, layout, how):
    """A layer built on zero placeholders, then loaded (v1) by `how`, gives the bits and the
    fingerprint of a layer built on v1; then v2 loaded the same way gives the bits of a layer
    built on v2. The caller's projections are re-pointed into the layer (separate, merged) or
    read in place (fused). Before: the layer kept its copies of the placeholders (relative L2
    1.0, no error) and their fingerprint."""
    seed, experts, x = case(dep, layer, 910)
    v1, v2 = make_dense(TINY, seed), make_dense(TINY, seed + 1)
    failures: list[str] = []
    with build(dep) as routed, torch.no_grad():
        held = placeholders(v1, layout)
        moe = EpMoeLayer(held, routed, experts, topk=TINY.topk)
        made_on_v1 = EpMoeLayer(v1, routed, experts, topk=TINY.topk)
        made_on_v2 = EpMoeLayer(v2, routed, experts, topk=TINY.topk)
        load(dep, held, v1, how)
        if not torch.equal(bits(moe(x)), bits(made_on_v1(x))):
            failures.append(f"{layout}, {how}: not the loaded weights' bits")
        if moe.fingerprint != made_on_v1.fingerprint:
            failures.append(f"{layout}, {how}: the placeholders' fingerprint")
        load(dep, held, v2, how)
        if not torch.equal(bits(moe(x)), bits(made_on_v2(x))):
            failures.append(f"{layout}, {how}: after loading v2, not v2's bits")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_refresh_reads_projections_the_layer_could_only_copy(dep, layer):
    """Shared gate and up given as slices of a buffer with rows to spare (the layer copies
    them; their slice objects dropped) and a non-contiguous norm weight: after loading v1 into
    the buffers, refresh() on every rank gives the bits and fingerprint of a layer built on
    v1."""
    seed, experts, x = case(dep, layer, 915)
    v1 = make_dense(TINY, seed)
    failures: list[str] = []
    with build(dep) as routed, torch.no_grad():
        held = placeholders(v1, "sliced")
        strided_norm = torch.zeros(2 * TINY.latent, dtype=torch.bfloat16)
        held[NORM] = strided_norm[::2]
        merged = roots({SHARED_GATE: held[SHARED_GATE]})[0]
        moe = EpMoeLayer(dict(held), routed, experts, topk=TINY.topk)
        made_on_v1 = EpMoeLayer(v1, routed, experts, topk=TINY.topk)
        gate_rows, up_rows = v1[SHARED_GATE].shape[0], v1[SHARED_UP].shape[0]
        del held[SHARED_GATE], held[SHARED_UP]  # the slice objects go; their buffer stays
        merged[:gate_rows].copy_(v1[SHARED_GATE])
        merged[gate_rows : gate_rows + up_rows].copy_(v1[SHARED_UP])
        strided_norm[::2] = v1[NORM]
        for name in (GATE, BIAS, DOWN, UP, SHARED_DOWN):
            held[name].copy_(v1[name])
        moe.refresh()
        if not torch.equal(bits(moe(x)), bits(made_on_v1(x))):
            failures.append("after refresh(), not the loaded weights' bits")
        if moe.fingerprint != made_on_v1.fingerprint:
            failures.append("after refresh(), not the loaded weights' fingerprint")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_a_refresh_missing_on_one_rank_after_any_one_element_changed(dep, layer):
    """A layer that copied its dense tensors (aliases of them kept by the caller): after its
    first call every rank changes one element of one tensor (the same, picked fresh each run)
    in place and only rank 0 calls refresh(). The next call raises EpDesyncError on every rank
    (before: the fingerprint read 64 evenly spaced elements of each tensor, and a change outside
    them left the ranks' fingerprints equal: the last rank computed with its old copy, no error,
    relative L2 up to 0.68; found by a careless-user probe). After reset() and refresh() on every
    rank the call gives the bits of a layer built on the changed weights."""
    seed, experts, x = case(dep, layer, 960)
    failures: list[str] = []
    dense = make_dense(TINY, seed)
    aliases = {name: t.detach() for name, t in dense.items()}
    pick = torch.Generator().manual_seed(seed)
    name = DENSE_NAMES[int(torch.randint(0, len(DENSE_NAMES), (1,), generator=pick))]
    where = int(torch.randint(0, dense[name].numel(), (1,), generator=pick))
    with build(dep) as routed, torch.no_grad():
        moe = EpMoeLayer(aliases, routed, experts, topk=TINY.topk)
        moe(x)
        dense[name].view(-1)[where] += 1.0
        if dep.rank == 0:
            moe.refresh()
        label = f"{name}[{where}] changed, refresh() on rank 0 only: the next call"
        expect_raises(failures, label, EpDesyncError, "refresh", lambda: moe(x))
        routed.reset()
        moe.refresh()
        made_now = EpMoeLayer(
            {n: t.clone() for n, t in dense.items()}, routed, experts, topk=TINY.topk
        )
        if not torch.equal(bits(moe(x)), bits(made_now(x))):
            failures.append(
                f"{name}[{where}] changed, reset() and refresh() everywhere: other bits"
            )
    collective_assert(dep.cpu_group, failures, seeds=seed)


class Model(torch.nn.Module):
    """A model's module holding one layer's dense tensors as its parameters (zeros until
    loaded), named after the checkpoint names with '.' as '__'."""

    def __init__(self, like: dict[str, torch.Tensor]):
        super().__init__()
        for name, t in like.items():
            self.register_parameter(key(name), torch.nn.Parameter(torch.zeros_like(t)))

    def dense(self, how: str) -> dict[str, torch.Tensor]:
        """The parameters as a layer is given them: "parameters" (the objects themselves),
        "state_dict" (its detached aliases), ".data" or "detach" (one alias each)."""
        if how == "state_dict":
            state = self.state_dict()
            return {name: state[key(name)] for name in DENSE_NAMES}
        alias = {"parameters": lambda p: p, ".data": lambda p: p.data, "detach": torch.detach}
        return {name: alias[how](getattr(self, key(name))) for name in DENSE_NAMES}

    def load(self, values: dict[str, torch.Tensor]) -> None:
        self.load_state_dict({key(name): t for name, t in values.items()})


def key(name: str) -> str:
    return name.replace(".", "__")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["parameters", "state_dict", ".data", "detach"])
def test_a_models_parameters_and_their_aliases(dep, layer, how):
    """A layer built from a model's parameters (the objects) re-points them: it holds no copy
    (`copied` empty, the parameters' bytes inside `packed`) and the model's load_state_dict
    reaches it. Built from aliases of them (state_dict(), .data, .detach(): other tensors hold
    the storage too), it re-points nothing and leaves the model's parameters where they were
    and lists the three projections in `copied`: its first call copies them again (a load
    before it is seen), and refresh() after a later load gives its bits. A second layer given
    the same parameters (tied weights) reads them in place in the first layer's packed weight,
    or copies the aliases and refreshes the same way; the fingerprint is read at the first call,
    not before. A third layer on them, run by its parts (front, router, routed_path, ...),
    gives the loaded weights' bits from its first step (before: front read the old copies)."""
    seed, experts, x = case(dep, layer, 950)
    v1, v2 = make_dense(TINY, seed), make_dense(TINY, seed + 1)
    projections = (SHARED_GATE, SHARED_UP, DOWN)
    failures: list[str] = []
    with build(dep) as routed, torch.no_grad():
        model = Model(v1)
        where = {name: getattr(model, key(name)).data_ptr() for name in projections}
        moe = EpMoeLayer(model.dense(how), routed, experts, topk=TINY.topk)
        tied = EpMoeLayer(model.dense(how), routed, experts, topk=TINY.topk)
        by_parts = EpMoeLayer(model.dense(how), routed, experts, topk=TINY.topk)
        made_on_v1 = EpMoeLayer(v1, routed, experts, topk=TINY.topk)
        if moe.fingerprint is not None:
            failures.append(f"{how}: the fingerprint was read before the first call")
        moved = {n: getattr(model, key(n)).data_ptr() != where[n] for n in projections}
        packed = (moe.packed.data_ptr(), moe.packed.data_ptr() + moe.packed.nbytes)
        inside = all(packed[0] <= getattr(model, key(n)).data_ptr() < packed[1] for n in moved)
        if how == "parameters":
            if moe.copied or not inside:
                failures.append(f"{how}: copied {moe.copied}, parameters in packed: {inside}")
        elif any(moved.values()) or set(moe.copied) != set(projections):
            failures.append(f"{how}: moved {moved}, copied {moe.copied}")
        # The tied layer finds the parameters re-pointed into the first layer's packed weight
        # (consecutive, in order) and reads them there; aliases it can only copy.
        shares = tied.packed.data_ptr() == moe.packed.data_ptr()
        if (how == "parameters") != (shares and not tied.copied):
            failures.append(f"{how}: the tied layer copied {tied.copied}, shares packed {shares}")
        if how != "parameters" and set(tied.copied) != set(projections):
            failures.append(f"{how}: the tied layer copied {tied.copied}")
        model.load(v1)  # before the first call, which copies again what the layer copied
        for name, each in (("the layer", moe), ("the tied layer", tied)):
            if not torch.equal(bits(each(x)), bits(made_on_v1(x))):
                failures.append(f"{how}: {name} does not give the loaded weights' bits")
            if each.fingerprint != made_on_v1.fingerprint:
                failures.append(f"{how}: {name}'s fingerprint is not the loaded weights'")
        # Run by its parts, the first step reads the loaded weights too (front() copies again).
        if not torch.equal(bits(run_by_parts(by_parts, x)), bits(made_on_v1(x))):
            failures.append(f"{how}: the layer run by its parts, first step: not the loaded bits")
        model.load(v2)  # after it: what the layer copied needs refresh()
        made_on_v2 = EpMoeLayer(v2, routed, experts, topk=TINY.topk)
        for name, each in (("the layer", moe), ("the tied layer", tied)):
            if each.copied:
                each.refresh()
            if not torch.equal(bits(each(x)), bits(made_on_v2(x))):
                failures.append(f"{how}: {name} does not give v2's bits")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_a_checkpoint_readers_tensors_are_taken_without_a_copy(dep, layer, tmp_path):
    """Tensors read by safetensors' safe_open (each a view of a byte buffer of its own size): the
    layer re-points the three projections (no copy; only a norm weight off a 16-byte boundary is
    copied, which EpRouted could not read in place) and gives v1's bits; v2 written into the
    reader's tensors, then refresh(), gives v2's bits."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    seed, experts, x = case(dep, layer, 970)
    v1, v2 = make_dense(TINY, seed), make_dense(TINY, seed + 1)
    path = str(tmp_path / f"layer-rank{dep.rank}.safetensors")
    save_file(v1, path)
    failures: list[str] = []
    with build(dep) as routed, torch.no_grad(), safe_open(path, framework="pt") as f:
        read = {name: f.get_tensor(name) for name in v1}
        moe = EpMoeLayer(read, routed, experts, topk=TINY.topk)
        if not set(moe.copied) <= {NORM}:
            failures.append(f"copied {moe.copied}: the reader's projections were not re-pointed")
        if not torch.equal(bits(moe(x)), bits(EpMoeLayer(v1, routed, experts, topk=TINY.topk)(x))):
            failures.append("not the checkpoint's bits")
        for name in v2:
            read[name].copy_(v2[name])
        moe.refresh()
        if not torch.equal(bits(moe(x)), bits(EpMoeLayer(v2, routed, experts, topk=TINY.topk)(x))):
            failures.append("after v2 and refresh(), not v2's bits")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_refresh_refuses_a_source_moved_to_other_memory(dep, layer):
    """A projection the layer copied (shared gate and up sliced from a buffer with rows to
    spare) whose buffer is re-bound to other memory afterwards (`set_`): refresh() raises
    RuntimeError naming it, on every rank, and copies nothing (the call after gives the bits of
    before)."""
    seed, experts, x = case(dep, layer, 960)
    v1 = make_dense(TINY, seed)
    failures: list[str] = []
    with build(dep) as routed, torch.no_grad():
        held = placeholders(v1, "sliced")
        merged = roots({SHARED_GATE: held[SHARED_GATE]})[0]
        for name in DENSE_NAMES:
            held[name].copy_(v1[name])
        moe = EpMoeLayer(held, routed, experts, topk=TINY.topk)
        before = moe(x)
        merged.set_(torch.full_like(merged, 5.0))
        expect_raises(
            failures, "a moved source", RuntimeError, "moved to other memory", moe.refresh
        )
        if not torch.equal(bits(moe(x)), bits(before)):
            failures.append("the refused refresh changed the layer's weights")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_layers_built_on_placeholders_in_other_orders(dep, layer):
    """Layers A and B built on zero placeholders (one fingerprint for both), rank 0 in the order
    A, B and the others B, A, no layer_index=, then loaded, each rank calling its layers in its
    own build order: EpDesyncError on every rank naming layer_index= (the fingerprints are those
    of the loaded weights). Before: every call paired A with B, relative L2 0.8-1.0, no error."""
    seed, experts, x = case(dep, layer, 920)
    weights = {name: make_dense(TINY, seed + i) for i, name in enumerate("AB", 1)}
    failures: list[str] = []
    with build(dep) as routed, torch.no_grad():
        held = {name: placeholders(weights[name], "separate") for name in "AB"}
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
    seed, experts, x = case(dep, layer, 930)
    x = x.requires_grad_(dep.rank == 0)
    failures: list[str] = []
    with build(dep) as routed:
        moe = EpMoeLayer(make_dense(TINY, seed), routed, experts, topk=TINY.topk)
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
    seed, experts, x = case(dep, layer, 940)
    failures: list[str] = []
    with build(dep) as routed, torch.no_grad():
        moe = EpMoeLayer(make_dense(TINY, seed), routed, experts, topk=TINY.topk)

        def model(h: torch.Tensor) -> torch.Tensor:
            return moe(moe(h) * 0.5)

        want = model(x)
        got = torch.compile(model, backend="eager")(x)
        if not torch.equal(bits(got), bits(want)):
            failures.append("the compiled model's bits differ from the eager calls'")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("raised", [RuntimeError, KeyboardInterrupt])
def test_a_first_call_whose_reads_fail_fails_on_every_rank(dep, layer, monkeypatch, raised):
    """The first call reads the fingerprint; when that read raises on rank 0 (an error, or a
    Ctrl-C), rank 0 raises it and every other rank EpPeerError, in that call (no rank waits for
    rank 0), and the next call is served on every rank.
    Before, for the Ctrl-C: rank 0 raised it without taking part in the step, its peers waited
    in the call, and rank 0's next call paired with that one (or, calling another layer,
    desynced every rank)."""
    import dep_ep.ep.layer as layer_module

    seed, experts, x = case(dep, layer, 980)
    failures: list[str] = []
    with build(dep) as routed, torch.no_grad():
        moe = EpMoeLayer(make_dense(TINY, seed), routed, experts, topk=TINY.topk)
        if dep.rank == 0:
            read = layer_module.dense_fingerprint

            def fails_once(dense):
                monkeypatch.setattr(layer_module, "dense_fingerprint", read)
                raise raised("the fingerprint's read failed")

            monkeypatch.setattr(layer_module, "dense_fingerprint", fails_once)
        expected, match = (
            (raised, "fingerprint's read failed") if dep.rank == 0 else (EpPeerError, None)
        )
        expect_raises(failures, "the first call", expected, match, lambda: moe(x))
        out = moe(x)
        if out.shape != x.shape or not out.isfinite().all() or moe.fingerprint is None:
            failures.append("the next call was not served")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("given", ["tuple", "ExpertWeights", ".data views", "buffer slices"])
def test_expert_tensors_written_after_construction_are_refused_on_every_rank(dep, layer, given):
    """A layer built on zero placeholders of this rank's expert tensors, then loaded by copy_:
    its backend (ReferenceExperts) computes with its copy of the placeholders, so the first call
    raises on every rank (RuntimeError naming the tensors on the loading rank; only rank 0
    loads, so the others raise EpPeerError), and so does refresh() on that rank. Given as the
    tuple, an ExpertWeights, `.data` views of parameters or slices of buffers (the view objects
    gone, the storage alive). A layer built after loading computes the loaded experts. Before,
    the layer returned the shared experts alone (the routed part from zero experts), with no
    error."""
    seed, experts, x = case(dep, layer, 930)
    v1 = make_dense(TINY, seed)
    per_rank = TINY.experts // dep.size
    first = dep.rank * per_rank
    loaded = layer.local(first, per_rank)
    failures: list[str] = []
    with build(dep) as routed, torch.no_grad():
        held = [torch.nn.Parameter(torch.zeros_like(t), requires_grad=False) for t in loaded]
        buffers = [torch.zeros(2 * t.numel(), dtype=t.dtype) for t in loaded]
        if given == "tuple":
            tensors = tuple(held)
        elif given == "ExpertWeights":
            tensors = ExpertWeights(*held, first_expert=first, num_experts=TINY.experts)
        elif given == ".data views":
            tensors = tuple(p.data for p in held)
        else:
            tensors = tuple(b[t.numel() :].view(t.shape) for b, t in zip(buffers, loaded))
        moe = EpMoeLayer(v1, routed, tensors, topk=TINY.topk, layer_index=0)
        del tensors
        if dep.rank == 0:
            for p, b, value in zip(held, buffers, loaded):
                p.copy_(value)
                b[value.numel() :].copy_(value.reshape(-1))
        message = "the experts' tensors \\['w13', 's13', 'w2', 's2'\\] were written since"
        if dep.rank == 0:
            expect_raises(failures, f"{given}: call", RuntimeError, message, lambda: moe(x))
            expect_raises(failures, f"{given}: refresh()", RuntimeError, message, moe.refresh)
        else:
            expect_raises(failures, f"{given}: call", EpPeerError, "rank 0", lambda: moe(x))
        after = ExpertWeights(*loaded, first_expert=first, num_experts=TINY.experts)
        built_after = EpMoeLayer(v1, routed, after, topk=TINY.topk, layer_index=1)
        made_on_loaded = EpMoeLayer(v1, routed, experts, topk=TINY.topk, layer_index=2)
        if not torch.equal(bits(built_after(x)), bits(made_on_loaded(x))):
            failures.append(f"{given}: a layer built after loading is not the loaded experts")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_refresh_neither_waives_nor_forgets_a_stale_experts_check(dep, layer):
    """refresh() before the first call, then a load into the expert tensors: the first call
    still refuses them on every rank (refresh() does not mark them checked). After a good first
    call, a write on rank 1 alone: refresh() raises there, and every later call refuses on every
    rank (rank 1 RuntimeError, the others EpPeerError) instead of computing with rank 1's stale
    experts (before, refresh() left the layer callable)."""
    seed, experts, x = case(dep, layer, 940)
    v1 = make_dense(TINY, seed)
    per_rank = TINY.experts // dep.size
    loaded = layer.local(dep.rank * per_rank, per_rank)
    failures: list[str] = []
    written = "were written since"
    with build(dep) as routed, torch.no_grad():
        held = tuple(torch.zeros_like(t) for t in loaded)
        moe = EpMoeLayer(v1, routed, held, topk=TINY.topk, layer_index=0)
        moe.refresh()
        for placeholder, value in zip(held, loaded):
            placeholder.copy_(value)
        expect_raises(failures, "after refresh()", RuntimeError, written, lambda: moe(x))
        ready = tuple(t.clone() for t in loaded)
        good = EpMoeLayer(v1, routed, ready, topk=TINY.topk, layer_index=1)
        good(x)
        if dep.rank == 1:
            ready[0][0, 0, 0] ^= 1
            expect_raises(failures, "refresh()", RuntimeError, written, good.refresh)
        for call in range(2):
            if dep.rank == 1:
                expect_raises(failures, f"call {call}", RuntimeError, written, lambda: good(x))
            else:
                expect_raises(failures, f"call {call}", EpPeerError, "rank 1", lambda: good(x))
    collective_assert(dep.cpu_group, failures, seeds=seed)
