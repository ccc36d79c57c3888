"""EpMoeLayer on 2-4 CPU ranks against a float64 reference of the K3 formula (docs/formats.md),
written without the layer's code; the un-normed combine bitwise; expert counts; the
workspace size; a layer loaded from a checkpoint in the K3 naming; bad inputs on every rank.

The reference, the input drawing and the error model of the comparison (derived in its
docstring; docs/layer.md restates it) are tests/helpers/layer_case.py's.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from dep_ep.comm.errors import EpDesyncError, EpPeerError
from dep_ep.config import EpConfig
from dep_ep.ep import TINY, EpMoeLayer, EpRouted, route
from dep_ep.experts import ReferenceExperts
from dep_ep.experts.checkpoint import (
    BIAS,
    DOWN,
    GATE,
    NORM,
    SHARED_DOWN,
    SHARED_GATE,
    SHARED_UP,
    UP,
    layer_prefix,
    load_moe_layer,
)
from dep_ep.testing import SyntheticLayer, internals

from helpers.cases import agreed_seed, make_case, real_tokens
from helpers.collective import collective_assert, expect_raises
from helpers.layer_case import (
    compare_layer,
    draw_hidden,
    layer_reference,
    layer_tolerance,
    make_dense,
    reference_router,
    unequal_counts,
)
from helpers.reference_check import make_experts

MAX_TOKENS = 12


# ---------------------------------------------------------------------------------- fixtures
@dataclass
class Rank:
    dep: object
    routed: EpRouted
    synthetic: SyntheticLayer
    experts: ReferenceExperts
    seed: int  # of the synthetic experts


@pytest.fixture(scope="module")
def rank(dep):
    seed = agreed_seed(dep.cpu_group, 300)
    routed = EpRouted(
        dep.cpu_group,
        MAX_TOKENS,
        "cpu",
        num_experts=TINY.experts,
        latent=TINY.latent,
        topk=TINY.topk,
        config=EpConfig(count_experts=True),
    )
    synthetic = SyntheticLayer(TINY, seed)
    yield Rank(dep, routed, synthetic, make_experts(synthetic, dep.rank, dep.size), seed)
    routed.close()


def good_call(rank: Rank, layer: EpMoeLayer, dense: dict, seed: int, label: str) -> list[str]:
    """One call (with a step tag) on fresh unequal rows, one rank idle, against the reference."""
    counts = unequal_counts(7, rank.dep.size)
    x = draw_hidden(TINY, dense, counts, seed)[rank.dep.rank]
    out = layer(x, tokens=max(counts), tag=seed)  # the same tag on every rank
    ref = layer_reference(x, dense, rank.synthetic.expert, TINY.topk)
    return compare_layer(out, ref, label)[0]


# ---------------------------------------------------------------------------------- tests
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tokens,factor", [(MAX_TOKENS, 1.0), (5, 2.5), (1, 1.0)])
def test_layer_matches_reference(dep, rank, tokens, factor):
    """Unequal rows per rank (the last rank none) padded to T = the most rows; both schedules
    give the same bits (on CPU both run the serial order); the second layer is built from the
    first one's dense views and shares its packed weight."""
    seeds = {
        "experts": rank.seed,
        "dense": agreed_seed(dep.cpu_group, 1),
        "x": agreed_seed(dep.cpu_group, 2),
    }
    dense = make_dense(TINY, seeds["dense"])
    counts = unequal_counts(tokens, dep.size)
    x = draw_hidden(TINY, dense, counts, seeds["x"])[dep.rank]
    overlap = EpMoeLayer(
        dense, rank.routed, rank.experts, topk=TINY.topk, routed_scaling_factor=factor
    )
    serial = EpMoeLayer(
        overlap.dense,
        rank.routed,
        rank.experts,
        topk=TINY.topk,
        routed_scaling_factor=factor,
        schedule="serial",
    )
    out = overlap(x, tokens=tokens)
    again = serial(x, tokens=tokens)
    ref = layer_reference(x, dense, rank.synthetic.expert, TINY.topk, factor=factor)
    failures, rel = compare_layer(out, ref, f"T={tokens} n={counts[dep.rank]} factor={factor}")
    if not torch.equal(out.view(torch.int16), again.view(torch.int16)):
        failures.append("schedule='serial' gave other bits than schedule='overlap'")
    if serial.packed.data_ptr() != overlap.packed.data_ptr():
        failures.append("a layer built from another layer's dense copied the packed weight")
    print(
        f"rank {dep.rank}: n={counts[dep.rank]} rel L2 {rel:.3e}"
        f" bound {layer_tolerance(ref) if ref.out.numel() else 0:.3e}"
    )
    collective_assert(dep.cpu_group, failures, seeds=seeds)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("factor", [1.0, 2.5])
def test_layer_routes_with_route(dep, rank, factor):
    """The layer's routing, by router() and inside its call, is ep/router.py's `route` bit for bit
    with the layer's gate, bias and routed_scaling_factor; `bf16_gemm` (the layer's GEMM on CUDA)
    changes nothing on CPU."""
    seed = agreed_seed(dep.cpu_group, 30)
    dense = make_dense(TINY, seed)
    layer = EpMoeLayer(
        dense, rank.routed, rank.experts, topk=TINY.topk, routed_scaling_factor=factor
    )
    gen = torch.Generator().manual_seed(seed + dep.rank)
    x = torch.randn(MAX_TOKENS, TINY.hidden, generator=gen).to(torch.bfloat16)
    seen = []
    routed_step = layer._routed_step

    def recording(latent, ids, weights, *args):
        seen.append((ids.clone(), weights.clone()))
        return routed_step(latent, ids, weights, *args)

    layer._routed_step = recording
    layer(x)
    failures, gate, bias = [], dense[GATE], dense[BIAS]
    for bf16_gemm in (False, True):
        want = route(x, gate, bias, TINY.topk, routed_scaling_factor=factor, bf16_gemm=bf16_gemm)
        for where, (ids, weights) in (("router()", layer.router(x)), ("the call", seen[0])):
            same = torch.equal(ids, want[0]) and ids.dtype == want[0].dtype == torch.int32
            same &= torch.equal(weights.view(torch.int32), want[1].view(torch.int32))
            if not same:
                failures.append(f"factor {factor}, bf16_gemm={bf16_gemm}: {where} != route()")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_packed_weight_holds_the_dense_views(dep, rank):
    seed = agreed_seed(dep.cpu_group, 3)
    dense = make_dense(TINY, seed)
    layer = EpMoeLayer(dense, rank.routed, rank.experts, topk=TINY.topk)
    S, L, H = 2 * TINY.intermediate, TINY.latent, TINY.hidden
    failures = []
    if tuple(layer.packed.shape) != (2 * S + L, H):
        failures.append(f"packed shape {tuple(layer.packed.shape)}; expected {(2 * S + L, H)}")
    base = layer.packed.untyped_storage().data_ptr()
    for name in (SHARED_GATE, SHARED_UP, DOWN):
        view = layer.dense[name]
        if view.untyped_storage().data_ptr() != base or not torch.equal(view, dense[name]):
            failures.append(f"dense[{name!r}] is not an equal view of the packed weight")
    for name in (GATE, BIAS, NORM, UP, SHARED_DOWN):
        if layer.dense[name] is not dense[name]:
            failures.append(f"dense[{name!r}] was copied")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_unnormed_combine_bitwise(dep, rank):
    """routed(..., norm_weight=None) with unequal real rows (tokens = T) equals BF16 of the fp32
    sum, in rank order, of the expert sums the owning ranks left in their receive rows."""
    n, r, tokens = dep.size, dep.rank, 9
    seed = agreed_seed(dep.cpu_group, 4)
    case = make_case(TINY, n, tokens, seed, "ragged")
    real = real_tokens(tokens, n)[r]
    before = rank.routed.receive(tokens)
    before.out.fill_(float("nan"))
    summed = rank.routed.routed(
        case.latent[r][:real],
        case.ids[r][:real],
        case.weights[r][:real],
        None,
        experts=rank.experts,
        tokens=tokens,
    )
    stride = rank.routed.prepare(tokens)
    mine = rank.routed.receive(tokens).out.float()  # exact; gloo has no bf16
    outs = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(outs, mine, group=dep.cpu_group)
    per_rank = TINY.experts // n
    want = torch.zeros(real, TINY.latent)
    for d in range(n):  # rank order, fp32
        owns = ((case.ids[r][:real].long() // per_rank) == d) & (case.ids[r][:real] >= 0)
        hit = owns.any(dim=1)
        rows = outs[d][r * stride : r * stride + real]
        want[hit] += rows[hit]
    want = want.to(torch.bfloat16)
    failures = []
    if tuple(summed.shape) != (real, TINY.latent):
        failures.append(f"output shape {tuple(summed.shape)}; expected {(real, TINY.latent)}")
    elif not torch.equal(summed.view(torch.int16), want.view(torch.int16)):
        differ = int((summed.view(torch.int16) != want.view(torch.int16)).sum())
        failures.append(f"un-normed combine differs from the rank-ordered sum in {differ} elements")
    collective_assert(dep.cpu_group, failures, seeds={"experts": rank.seed, "case": seed})


@pytest.mark.mpi(min_size=2)
def test_default_layer_indices_do_not_depend_on_the_garbage_collector(dep, rank):
    """A layer dropped and freed on rank 0 but still alive on the others (a reference cycle the
    collector has not reached there): the next layer gets the same default index on every rank,
    and a call of it works. Before: rank 0 reused the freed layer's index, and its calls raised
    EpDesyncError on every rank (found by the vLLM integration's tests)."""
    dense = make_dense(TINY, agreed_seed(dep.cpu_group, 7))
    dropped = EpMoeLayer(dense, rank.routed, rank.experts, topk=TINY.topk)
    kept = dropped if dep.rank != 0 else None
    del dropped
    gc.collect()
    layer = EpMoeLayer(dense, rank.routed, rank.experts, topk=TINY.topk)
    indices = [None] * dep.size
    torch.distributed.all_gather_object(indices, layer.layer_index, group=dep.cpu_group)
    failures = [] if len(set(indices)) == 1 else [f"default indices differ: {indices}"]
    failures += good_call(rank, layer, dense, agreed_seed(dep.cpu_group, 8), "the new layer")
    del kept
    collective_assert(dep.cpu_group, failures, seeds=None)


@pytest.mark.mpi(min_size=2)
def test_expert_counts_after_a_layer_call(dep, rank):
    """expert_counts() after the layer's call = bincount of every rank's reference ids (every
    rank draws every rank's rows), restricted to this rank's experts."""
    seeds = {"dense": agreed_seed(dep.cpu_group, 5), "x": agreed_seed(dep.cpu_group, 6)}
    dense = make_dense(TINY, seeds["dense"])
    counts = unequal_counts(10, dep.size)
    xs = draw_hidden(TINY, dense, counts, seeds["x"])
    layer = EpMoeLayer(dense, rank.routed, rank.experts, topk=TINY.topk)
    layer(xs[dep.rank], tokens=max(counts))
    got = rank.routed.expert_counts()
    ids = torch.cat([reference_router(x, dense, TINY.topk)[0] for x in xs]).flatten()
    first, local = rank.routed.first_expert, rank.routed.experts_per_rank
    want = torch.bincount(ids, minlength=TINY.experts)[first : first + local].int()
    failures = [] if torch.equal(got, want) else [f"counts {got.tolist()} != {want.tolist()}"]
    collective_assert(dep.cpu_group, failures, seeds=seeds)


@pytest.mark.mpi(min_size=2)
def test_workspace_bytes_is_what_an_eprouted_holds(dep, rank):
    """workspace_bytes = the symmetric segment (EpLayout.total_bytes; its last region ends inside
    it, and it holds the expert output rows) + every tensor the EpRouted object holds (the
    staged ids and weights)."""
    routed = rank.routed
    buffers = internals.buffers(routed)
    layout = buffers.layout
    # The expert counts (E_local int32, EpConfig.count_experts) and the padding rows' id (one
    # int32) are control words, as the state.
    held = sum(
        t.nbytes
        for name, t in vars(routed).items()
        if isinstance(t, torch.Tensor) and name not in ("_counts", "_no_expert")
    )
    flags = buffers.flags
    segment_end = flags.data_ptr() + flags.nbytes - buffers.base_address
    want = EpRouted.workspace_bytes(dep.size, MAX_TOKENS, latent=TINY.latent, topk=TINY.topk)
    failures = []
    if want != layout.total_bytes + held:
        failures.append(f"workspace_bytes {want} != segment {layout.total_bytes} + held {held}")
    if not 0 < segment_end <= layout.total_bytes:
        failures.append(f"the segment's views end at {segment_end} of {layout.total_bytes} bytes")
    rows = routed.receive(MAX_TOKENS).out
    if rows.nbytes != layout.max_rows * TINY.latent * 2:
        failures.append(f"expert output rows hold {rows.nbytes} bytes at T = max_tokens")
    collective_assert(dep.cpu_group, failures, seeds=None)


@pytest.mark.mpi(min_size=2)
def test_layer_from_k3_named_checkpoint(dep, rank, tmp_path):
    """A TINY checkpoint in the K3 naming (each rank writes its own file): load_moe_layer's
    experts and dense tensors make a layer that matches the reference of the written weights."""
    layer_index, g = 5, TINY
    seeds = {
        "experts": rank.seed,
        "dense": agreed_seed(dep.cpu_group, 7),
        "x": agreed_seed(dep.cpu_group, 8),
    }
    from safetensors.torch import save_file

    dense, prefix, inter = make_dense(g, seeds["dense"]), layer_prefix(layer_index), g.intermediate
    tensors = {prefix + name: t for name, t in dense.items()}
    for e in range(g.experts):
        w13, s13, w2, s2 = rank.synthetic.expert(e)
        for w, rows in (("w1", slice(0, inter)), ("w3", slice(inter, None))):
            tensors[f"{prefix}experts.{e}.{w}.weight_packed"] = w13[rows].contiguous()
            tensors[f"{prefix}experts.{e}.{w}.weight_scale"] = s13[rows].contiguous()
        tensors[f"{prefix}experts.{e}.w2.weight_packed"] = w2
        tensors[f"{prefix}experts.{e}.w2.weight_scale"] = s2
    save_file(tensors, str(tmp_path / "model.safetensors"))
    first, local = rank.routed.first_expert, rank.routed.experts_per_rank
    loaded = load_moe_layer(tmp_path, layer_index, g, first_expert=first, num_local_experts=local)
    # The weights as loaded, as the tuple (w13, s13, w2, s2): the layer builds the device's
    # default backend from them (the reference on CPU).
    layer = EpMoeLayer(loaded.dense, rank.routed, loaded.experts.tensors, topk=g.topk)
    counts = unequal_counts(MAX_TOKENS, dep.size)
    x = draw_hidden(g, dense, counts, seeds["x"])[dep.rank]
    out = layer(x, tokens=MAX_TOKENS)
    ref = layer_reference(x, dense, rank.synthetic.expert, g.topk)
    failures = compare_layer(out, ref, "from checkpoint")[0]
    if type(layer.experts) is not ReferenceExperts or layer.experts.first_expert != first:
        built = f"{type(layer.experts).__name__} from {layer.experts.first_expert}"
        failures.append(f"the layer built {built}; expected ReferenceExperts from {first}")
    collective_assert(dep.cpu_group, failures, seeds=seeds)


@pytest.mark.mpi(min_size=2)
def test_bad_construction_names_the_tensor(dep, rank):
    """Local errors, the same on every rank: ValueError (never KeyError) naming a missing tensor;
    a misshapen tensor named with its shape and the expected one; dtype, device, topk, experts."""
    seed = agreed_seed(dep.cpu_group, 9)
    dense = make_dense(TINY, seed)
    routed, experts, K = rank.routed, rank.experts, TINY.topk
    failures: list[str] = []

    def build(label, bad, error, match, **kw):
        expect_raises(
            failures,
            label,
            error,
            match,
            lambda: EpMoeLayer(bad, routed, kw.get("experts", experts), topk=kw.get("topk", K)),
        )

    missing = {k: v for k, v in dense.items() if k not in (SHARED_UP, NORM)}
    build("missing", missing, ValueError, r"routed_expert_norm\.weight.*shared_experts\.up_proj")
    S, H = 2 * TINY.intermediate, TINY.hidden
    misshapen = {**dense, SHARED_UP: dense[SHARED_UP][:, :-1]}
    build(
        "misshapen",
        misshapen,
        ValueError,
        rf"shared_experts\.up_proj\.weight.*\({S}, {H - 1}\).*expected \({S}, {H}\)",
    )
    short = {**dense, UP: dense[UP][:-2]}
    build(
        "misshapen up",
        short,
        ValueError,
        rf"routed_expert_up_proj\.weight.*\({H - 2}, {TINY.latent}\).*\({H}, {TINY.latent}\)",
    )
    build(
        "dtype",
        {**dense, BIAS: dense[BIAS].bfloat16()},
        TypeError,
        r"gate\.e_score_correction_bias.*torch\.bfloat16.*expected torch\.float32",
    )
    build("device", {**dense, GATE: dense[GATE].to("meta")}, ValueError, r"gate\.weight.*meta")
    build("not a tensor", {**dense, NORM: [1.0]}, TypeError, r"routed_expert_norm\.weight")
    build("topk", dense, ValueError, rf"topk={K + 1}.*topk={K}", topk=K + 1)
    other = make_experts(rank.synthetic, (dep.rank + 1) % dep.size, dep.size)
    build("experts of another rank", dense, ValueError, "first_expert", experts=other)
    per_rank = TINY.experts // dep.size
    mine = rank.synthetic.local_weights(dep.rank * per_rank, per_rank)
    bigger = dataclasses.replace(mine, num_experts=2 * TINY.experts)
    message = "num_experts=96; the EpRouted was built for num_experts=48"
    build("weights of another model", dense, ValueError, message, experts=bigger)
    for label, kw in (
        ("eps", dict(eps=0.0)),
        ("factor", dict(routed_scaling_factor=math.nan)),
        ("schedule", dict(schedule="parallel")),
    ):
        expect_raises(
            failures,
            label,
            ValueError,
            label if label != "factor" else "routed_scal",
            lambda kw=kw: EpMoeLayer(dense, routed, experts, topk=K, **kw),
        )
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_bad_calls_raise_on_every_rank_then_work(dep, rank):
    """n > tokens on one rank, tokens above max_tokens on one rank (its step runs in pieces,
    whose first tag carries T), tokens=2**31 (past a step's bound), ranks that disagree on
    tokens, a float T, a wrong dtype, non-finite x and a bad tag= on one rank, ranks giving the
    layer different tags: every rank raises in the same call (the bad rank its
    ValueError/TypeError, the others EpPeerError, or the same error where every rank sees the
    fault); after each (and the reset() a desync asks for), a good call matches the
    reference. Non-finite x in a row `padding`
    marks is no error."""
    seeds = {
        "experts": rank.seed,
        "dense": agreed_seed(dep.cpu_group, 10),
        "x": agreed_seed(dep.cpu_group, 11),
    }
    dense = make_dense(TINY, seeds["dense"])
    layer = EpMoeLayer(dense, rank.routed, rank.experts, topk=TINY.topk)
    r, last, T = dep.rank, dep.size - 1, 6
    x = draw_hidden(TINY, dense, [T + 1], seeds["x"])[0]
    nan_x = x[:T].clone()
    nan_x[2, 7] = float("nan")
    cases = [
        # (label, the bad rank or None for every rank, its call, its error, its message)
        ("n > tokens", 0, lambda: layer(x, tokens=T), ValueError, f"{T + 1} rows.*tokens={T}"),
        # Above max_tokens the step runs in pieces, whose first tag carries T: a ValueError
        # naming every rank's T (EpTokenCountError) in the first piece.
        ("tokens > max_tokens on one rank", None,
         lambda: layer(x[:T], tokens=MAX_TOKENS + 1 if r == last else T), ValueError,
         f"token counts.*T={T}\\b.*T={MAX_TOKENS + 1}\\b"),
        ("tokens=2**31", 0, lambda: layer(x[:T], tokens=2**31), ValueError, "2\\^31"),
        ("tokens=6.0", 0, lambda: layer(x[:T], tokens=float(T)), TypeError, "expected an int"),
        ("ranks disagree on tokens", None, lambda: layer(x[:T], tokens=T + r),
         ValueError, "token counts"),
        ("dtype", last, lambda: layer(x[:T].float(), tokens=T), TypeError, "float32"),
        ("0 rows, tokens=None", 0, lambda: layer(x[:0]), ValueError, "0 rows and tokens=None"),
        ("non-finite x", 0, lambda: layer(nan_x, tokens=T), ValueError, "non-finite.*row 2"),
        # A bad tag= on one rank: that rank rejects the step (its peers gave none).
        ("tag=1.5", 0, lambda: layer(x[:T], tokens=T, tag=1.5), ValueError, "tag=1.5"),
        ("tag=2**64", last, lambda: layer(x[:T], tokens=T, tag=2**64), ValueError,
         "tag=18446744073709551616"),
        # Every rank gives the layer a tag, and they differ: a desync naming the layer.
        ("ranks give the layer different tags", None, lambda: layer(x[:T], tokens=T, tag=5 + r),
         EpDesyncError, "gave layer \\d+ different tag= or hold different dense weights"),
    ]  # fmt: skip
    failures: list[str] = []
    for step, (label, bad, call, error, match) in enumerate(cases):
        if bad is None or bad == r:
            err = expect_raises(failures, label, error, match, call)
        else:
            err = expect_raises(
                failures, f"{label} (peer)", EpPeerError, None, lambda: layer(x[:T], tokens=T)
            )
        if isinstance(err, EpDesyncError):
            rank.routed.reset()  # what a desync says: the ranks' calls no longer pair
        seeds[f"good call {step}"] = agreed_seed(dep.cpu_group, 20 + step)
        failures += good_call(rank, layer, dense, seeds[f"good call {step}"], f"after {label}")
    # A padding row is not read: non-finite values there are no error, and the other rows are
    # those of the same call with that row zeroed.
    padding = torch.zeros(T, dtype=torch.bool)
    padding[2] = True
    zeroed = nan_x.clone()
    zeroed[2] = 0
    try:
        got = layer(nan_x, tokens=T, padding=padding)
        want = layer(zeroed, tokens=T, padding=padding)
        keep = ~padding
        if not torch.equal(got[keep].view(torch.int16), want[keep].view(torch.int16)):
            failures.append("non-finite x in a padding row: the other rows changed")
    except Exception as err:
        failures.append(f"non-finite x in a padding row: {type(err).__name__}: {err}")
    collective_assert(dep.cpu_group, failures, seeds=seeds)


@pytest.mark.mpi(min_size=2)
def test_a_refused_call_given_no_tokens_rejects_every_piece(dep, rank, monkeypatch):
    """A call given no tokens on MAX_TOKENS + 2 rows (a step in pieces), a float32 x on rank 0:
    rank 0 rejects the step as one of T = its rows, every piece the peers run (before: as one
    of no T, one piece), raises TypeError, the others EpPeerError; a good call follows."""
    seed = agreed_seed(dep.cpu_group, 30)
    dense = make_dense(TINY, seed)
    layer = EpMoeLayer(dense, rank.routed, rank.experts, topk=TINY.topk)
    rows = MAX_TOKENS + 2
    x = draw_hidden(TINY, dense, [rows], agreed_seed(dep.cpu_group, 31))[0]
    asked: list[object] = []
    reject = rank.routed.reject_step

    def spy(error, *, tag=None, tokens=None):
        asked.append(tokens)
        return reject(error, tag=tag, tokens=tokens)

    monkeypatch.setattr(rank.routed, "reject_step", spy)
    bad = dep.rank == 0
    failures: list[str] = []
    expected = (TypeError, "float32") if bad else (EpPeerError, None)
    expect_raises(failures, "float32 x", *expected, lambda: layer(x.float() if bad else x))
    want = [rows] if bad else []
    if asked != want:
        failures.append(f"reject_step was asked for tokens {asked}; expected {want}")
    monkeypatch.undo()
    failures += good_call(rank, layer, dense, agreed_seed(dep.cpu_group, 32), "after it")
    collective_assert(dep.cpu_group, failures, seeds=seed)
