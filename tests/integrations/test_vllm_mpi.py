"""dep_ep.integrations.vllm on 2-4 CPU ranks against the vLLM 0.33.0 stand-ins
(standins/vllm_standin.py): the Kimi K3 model built through the adapter's model class (its MoE
layers' experts replaced), loaded through vLLM's expert loop, finished by
process_weights_after_loading, then stepped as vLLM steps it (KimiMoE's mega sequence: experts,
the engine's RMSNorm, the up projection added into the shared output) under a ForwardContext.

Every step's experts output is compared bit for bit with EpRouted.routed called directly on the
same rows (ids of padding rows -1, T from the DP counts, the layer index as tag), and the
layer's output with the float64 reference (dep_ep.testing) within the error model below.

Error model of the layer's output: the routed part r = up(norm(routed sum)) carries the routed
path's six BF16 roundings (dep_ep.testing.tolerance.ROUTED_ROUNDINGS: the engine's norm rounds
y and z as combine's fused norm does), relative rms e_r = 4.06e-3; the shared output s is an
exact input; the addmm into it rounds r + s once (BF16). So e^2 = |r|^2 e_r^2 / |r + s|^2 +
BF16^2, and the bound is SAFETY (2) times e (test_layer_mpi.py derives the same form).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import pytest
import torch
from standins import vllm_standin as vs

from dep_ep.comm.errors import EpDesyncError, EpPeerError
from dep_ep.config import TINY
from dep_ep.experts import ExpertsBackend
from dep_ep.experts.checkpoint import layer_prefix
from dep_ep.integrations import common
from dep_ep.integrations.vllm import engine as vllm_engine
from dep_ep.integrations.vllm.kimi_k3 import DepEpKimiExperts, dep_ep_layers, model_class
from dep_ep.integrations.vllm.prepare_finalize import make_prepare_finalize
from dep_ep.testing import SyntheticLayer, compare, routed_reference, synthetic_ids
from dep_ep.testing.compare import compare_rel_l2
from dep_ep.testing.tolerance import BF16, ROUTED_RMS, SAFETY

from helpers.cases import agreed_seed
from helpers.collective import collective_assert, expect_raises
from helpers.reference_check import RowByRowExperts

LAYERS = 2
TEXT = vs.KimiK3TextConfig(
    hidden_size=TINY.hidden,
    routed_expert_hidden_size=TINY.latent,
    moe_intermediate_size=TINY.intermediate,
    num_experts=TINY.experts,
    num_experts_per_token=TINY.topk,
    num_hidden_layers=LAYERS,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def checkpoint_tensors(seed: int, experts=range(TINY.experts)):
    """(name, tensor) of every routed expert of every layer in Kimi K3's checkpoint naming
    (experts.checkpoint: layer_prefix + experts.{e}.{w1,w2,w3}.{weight_packed,weight_scale}),
    from SyntheticLayer(TINY, seed + layer)."""
    inter = TINY.intermediate
    for index in range(LAYERS):
        layer = SyntheticLayer(TINY, seed + index)
        for e in experts:
            w13, s13, w2, s2 = layer.expert(e)
            base = f"{layer_prefix(index)}experts.{e}."
            for shard, packed, scale in (
                ("w1", w13[:inter], s13[:inter]),
                ("w3", w13[inter:], s13[inter:]),
                ("w2", w2, s2),
            ):
                yield base + f"{shard}.weight_packed", packed.clone()
                yield base + f"{shard}.weight_scale", scale.clone()


@dataclass
class Served:
    """A model built and loaded through the adapter on this rank, its synthetic layers (one per
    MoE layer: experts, norm weight) and up-projection weights."""

    model: object
    layers: list[SyntheticLayer]
    ups: list[torch.Tensor]

    @property
    def moes(self):
        return dep_ep_layers(self.model)


def serve(standin, seed: int, *, load: bool = True, **config) -> Served:
    """Build the adapter's model with `config` (vllm_standin.vllm_config's keywords), load every
    expert through vLLM's loop, set the dense weights, and (load=True) finish loading."""
    cfg = vs.vllm_config(TEXT, **config)
    model = model_class()(vllm_config=cfg)
    model.load_weights(checkpoint_tensors(seed))
    layers = [SyntheticLayer(TINY, seed + i) for i in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    ups = []
    for moe, layer in zip(model.moe_layers(), layers):
        up = torch.randn(TINY.hidden, TINY.latent, generator=gen) / TINY.latent**0.5
        moe.routed_expert_up_proj.weight.data = up.to(torch.bfloat16)
        moe.routed_expert_norm.weight.data = layer.norm_weight()
        ups.append(moe.routed_expert_up_proj.weight.data)
    if load:
        model.process_weights_after_loading()
    return Served(model, layers, ups)


@pytest.fixture
def standin(dep):
    """The engine seam over the stand-ins for this test (the shared EpRouteds closed after)."""
    seam = vs.VllmStandin(dep.cpu_group)
    with vllm_engine.replaced(seam):
        yield seam
    common.close_shared()
    seam.close()


def draw(seed: int, rows: int):
    """latent bf16 [rows, L], ids int32 [rows, K] (distinct), weights fp32 [rows, K] (sum 1) and
    the shared output bf16 [rows, H], from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(rows, TINY.latent, generator=gen).to(torch.bfloat16)
    ids = synthetic_ids(rows, TINY.experts, TINY.topk, "uniform", gen)
    weights = torch.rand(rows, TINY.topk, generator=gen) + 0.05
    weights = weights / weights.sum(dim=1, keepdim=True)
    shared = torch.randn(rows, TINY.hidden, generator=gen).to(torch.bfloat16)
    return latent, ids, weights, shared


def step_context(counts, is_padding):
    dp = None if counts is None else vs.DPMetadata(torch.tensor(counts, dtype=torch.int32))
    return vs.override_forward_context(vs.ForwardContext(dp_metadata=dp, is_padding=is_padding))


def masked_ids(ids, padding):
    """ids [n, K] with the rows `padding` (bool [>= n] or None) marks set to -1: what the
    adapters' padding= must amount to."""
    masked = ids.clone()
    if padding is not None:
        masked[padding[: ids.shape[0]]] = -1
    return masked


def layer_reference(layer, up, latent, ids, weights, shared, padding):
    """float64 [n, H]: shared + up(RMSNorm(routed sum)) with padding rows' ids -1, and the
    bound of the layer's relative L2 error (module docstring)."""
    masked = masked_ids(ids, padding)
    normed = routed_reference(latent, masked, weights, layer.norm_weight(), layer.expert)
    routed = normed @ up.double().T
    out = shared.double() + routed
    e2 = (routed.norm() ** 2 * ROUTED_RMS**2) / out.norm().clamp(min=1e-30) ** 2 + BF16**2
    return normed, out, SAFETY * float(e2.sqrt())


def step_and_check(served, seed, counts, rows, padding, failures, label, tokens, tp=1):
    """One engine step of every MoE layer on this rank's `rows` tokens: the experts' output
    against EpRouted.routed bit for bit, the layer's output against the reference, the
    engine's norm run exactly once per layer."""
    for index, (moe, layer, up) in enumerate(zip(served.moes, served.layers, served.ups)):
        latent, ids, weights, shared = draw(seed + 100 * index, rows)
        with step_context(counts, padding):
            got = moe.experts(latent, weights, ids)
            calls = moe.routed_expert_norm.calls
            out = moe.forward_after_router(latent, weights, ids, shared.clone())
            ran = moe.routed_expert_norm.calls - calls
        masked = masked_ids(ids, padding)
        want = moe.experts.routed.routed(
            latent,
            masked,
            weights,
            None,
            experts=moe.experts.backend,
            tokens=tokens,
            tag=moe.experts.layer_index,
        )
        where = f"{label} layer {index}"
        if not torch.equal(bits(got), bits(want)):
            failures.append(f"{where}: experts output differs from EpRouted.routed's bits")
        if ran != 1:
            failures.append(f"{where}: the engine's RMSNorm ran {ran} times; expected once")
        normed, ref, bound = layer_reference(layer, up, latent, ids, weights, shared, padding)
        failures += compare(moe.routed_expert_norm(got), normed, f"{where} normed")
        failures += compare_rel_l2(out, ref, bound, f"{where} output")


def unequal_counts(size: int) -> tuple[list[int], int]:
    """Each DP rank's token count and the idle rank (one dummy row, all padding)."""
    counts = [7, 1] if size == 2 else [7, 3, 1, 5][:size]
    return counts, counts.index(1)


@pytest.mark.mpi(min_size=2)
def test_unequal_counts_idle_rank_and_padding_mid_batch(dep, standin):
    """DP = EP size, TP = 1: unequal counts (T = 7 from the DP metadata), an idle rank running
    one all-padding row, rank 0's rows 2 and 4 marked padding mid-batch."""
    seed = agreed_seed(dep.cpu_group, 700)
    served = serve(standin, seed, data_parallel_size=dep.size)
    counts, idle = unequal_counts(dep.size)
    rows = counts[dep.rank]
    padding = torch.zeros(rows + 3, dtype=torch.bool)  # vLLM's buffer is longer than the step
    if dep.rank == idle:
        padding[:] = True
    elif dep.rank == 0:
        padding[[2, 4]] = True
    failures: list[str] = []
    step_and_check(served, seed + 1, counts, rows, padding, failures, "unequal", max(counts))
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_sequence_parallel_shards(dep, standin):
    """TP = 2 (3 ranks: TP = 3, DP = 1, so no DP metadata): each DP rank's tokens sharded as
    sp_shard does, the mask resharded as sp_padding_mask does (the shard's pad rows padding),
    T = max ceil(n / TP) over the DP counts."""
    seed = agreed_seed(dep.cpu_group, 710)
    tp = 2 if dep.size % 2 == 0 else dep.size
    dp = dep.size // tp
    served = serve(standin, seed, tensor_parallel_size=tp, data_parallel_size=dp)
    counts = [9, 4][:dp]
    dp_rank, tp_rank = divmod(dep.rank, tp)
    full = counts[dp_rank]
    mask = torch.zeros(full, dtype=torch.bool)
    mask[1] = True  # a padding row before the shards
    padding = vs.sp_padding_mask(mask, full, tp, tp_rank)
    rows = -(-full // tp)
    failures: list[str] = []
    if any(m.experts.sequence_parallel != tp for m in served.moes):
        failures.append(f"the experts' sequence-parallel size is not TP={tp}")
    metadata = counts if dp > 1 else None
    tokens = max(-(-c // tp) for c in counts)
    step_and_check(served, seed + 1, metadata, rows, padding, failures, "sp", tokens)
    collective_assert(dep.cpu_group, failures, seeds=seed)


class Doubled(torch.nn.Module):
    """A shared MLP stand-in: 2 x its input."""

    def forward(self, x):
        return 2 * x


@pytest.mark.mpi(min_size=2)
def test_fused_norm_applies_the_norm_once_in_combine(dep, standin):
    """additional_config {"dep_ep": {"fused_norm": true}}: the model's norm leaves the output
    transform (it never runs) and combine applies it: the experts output is EpRouted.routed's
    with the norm weight, bit for bit, and the layer output is the reference's; a shared MLP
    passed to the experts (as DeepGemmMegaMoEExperts takes one) is added to their output."""
    seed = agreed_seed(dep.cpu_group, 720)
    options = {"dep_ep": {"fused_norm": True}}
    served = serve(standin, seed, data_parallel_size=dep.size, additional_config=options)
    counts = [5 + r for r in range(dep.size)]
    rows = counts[dep.rank]
    failures: list[str] = []
    for index, (moe, layer, up) in enumerate(zip(served.moes, served.layers, served.ups)):
        latent, ids, weights, shared = draw(seed + 100 * index, rows)
        if moe.routed_output_transform.norm is not None:
            failures.append(f"layer {index}: the output transform still holds the norm")
        with step_context(counts, None):
            got = moe.experts(latent, weights, ids)
            out = moe.forward_after_router(latent, weights, ids, shared.clone())
        norm = moe.routed_expert_norm
        want = moe.experts.routed.routed(
            latent,
            ids,
            weights,
            norm.weight,
            experts=moe.experts.backend,
            eps=norm.variance_epsilon,
            tokens=max(counts),
            tag=index,
        )
        if not torch.equal(bits(got), bits(want)):
            failures.append(f"layer {index}: fused-norm output differs from EpRouted.routed's")
        with step_context(counts, None):
            summed = moe.experts(latent, weights, ids, shared_experts=Doubled())
        if not torch.equal(bits(summed), bits(want + 2 * latent)):
            failures.append(f"layer {index}: shared_experts' output not added to the routed one")
        if norm.calls:
            failures.append(f"layer {index}: the engine's norm ran {norm.calls} times; expected 0")
        normed, ref, bound = layer_reference(layer, up, latent, ids, weights, shared, None)
        failures += compare(got, normed, f"layer {index} fused norm")
        failures += compare_rel_l2(out, ref, bound, f"layer {index} output")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_chunked_steps_equal_one_step(dep, standin):
    """max_tokens 4 (the option) with T = 11 from the DP counts: the layer runs 3 pieces whose
    bits, with a row-by-row backend, are those of one step of an EpRouted of max_tokens 64; with
    the default backend the output is the reference's."""
    seed = agreed_seed(dep.cpu_group, 730)
    small = serve(
        standin,
        seed,
        data_parallel_size=dep.size,
        additional_config={"dep_ep": {"max_tokens": 4}},
    )
    large = serve(standin, seed, data_parallel_size=dep.size)
    counts = [11] + [11 - 3 * r for r in range(1, dep.size)]
    rows = counts[dep.rank]
    failures: list[str] = []
    for moe in small.moes:
        if moe.experts.routed.max_tokens != 4:
            failures.append(f"max_tokens option: EpRouted has {moe.experts.routed.max_tokens}")
    for index in range(LAYERS):
        latent, ids, weights, shared = draw(seed + 100 * index, rows)
        outs = []
        for served in (small, large):
            moe = served.moes[index]
            default = moe.experts.backend
            with step_context(counts, None):
                pieces = moe.experts(latent, weights, ids)
                moe.experts.backend = RowByRowExperts(default)
                outs.append(moe.experts(latent, weights, ids))
                moe.experts.backend = default
            normed = routed_reference(
                latent,
                ids,
                weights,
                served.layers[index].norm_weight(),
                served.layers[index].expert,
            )
            failures += compare(moe.routed_expert_norm(pieces), normed, f"layer {index} pieces")
        if not torch.equal(bits(outs[0]), bits(outs[1])):
            failures.append(f"layer {index}: 3 pieces of 4 differ from one step of 11")
    collective_assert(dep.cpu_group, failures, seeds=seed)


def expected_parameters(layer: SyntheticLayer, first: int, count: int, logical: int):
    """The four checkpoint-layout tensors of physical experts [first, first + count), physical
    expert p holding logical expert p % logical."""
    parts = [layer.expert(p % logical) for p in range(first, first + count)]
    return [torch.stack(ts) for ts in zip(*parts)]


@pytest.mark.mpi(min_size=2)
def test_weight_loader_matches_the_checkpoint_layout(dep, standin):
    """Checkpoint-named shards through vLLM's expert loop land bit for bit as
    SyntheticLayer.local_weights(first, E_local) (experts.checkpoint's layout); with redundant
    experts (2E physical over E logical) every slot holds its logical expert; a misshapen shard
    is a ValueError naming the expert, a bf16 one a TypeError; return_success says whether the
    rank holds the expert."""
    seed = agreed_seed(dep.cpu_group, 740)
    served = serve(standin, seed, load=False, data_parallel_size=dep.size)
    per_rank = TINY.experts // dep.size
    first = dep.rank * per_rank
    failures: list[str] = []
    names = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
    for index, (moe, layer) in enumerate(zip(served.moes, served.layers)):
        want = layer.local_weights(first, per_rank).tensors
        for name, expected in zip(names, want):
            if not torch.equal(getattr(moe.experts, name).data, expected):
                failures.append(f"layer {index} {name}: not the checkpoint's bytes")
    physical, logical = 2 * TINY.experts, TINY.experts
    local = physical // dep.size
    cfg = vs.vllm_config(TEXT, data_parallel_size=dep.size)
    redundant = DepEpKimiExperts(
        cfg,
        num_experts=physical,
        num_local_experts=local,
        experts_start_idx=dep.rank * local,
        top_k=TINY.topk,
        hidden_size=TINY.latent,
        intermediate_size=TINY.intermediate,
        activation=vs.MegaMoEActivation("situ", alpha=4.0, beta=25.0),
        weight_format=vs.MEGA_MOE_MXFP4,
        num_logical_experts=logical,
        prefix="language_model.model.layers.9.block_sparse_moe.experts",
    )
    mapping = vs.make_kimi_k3_mega_moe_expert_params_mapping(logical)
    params = dict(redundant.named_parameters())
    held = 0
    for name, tensor in checkpoint_tensors(seed, range(logical)):
        if not name.startswith(layer_prefix(0)):
            continue
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name in name:
                param = params[param_name.removeprefix("experts.")]
                held += bool(
                    param.weight_loader(
                        param, tensor, param_name, shard_id, expert_id, return_success=True
                    )
                )
                break
    want = expected_parameters(served.layers[0], dep.rank * local, local, logical)
    for name, expected in zip(names, want):
        if not torch.equal(params[name].data, expected):
            failures.append(f"redundant experts {name}: a slot does not hold p % E's bytes")
    if held != 6 * len({p % logical for p in range(dep.rank * local, (dep.rank + 1) * local)}):
        failures.append(f"return_success counted {held} held tensors")
    param = params["w2_weight"]
    mine = (dep.rank * local) % logical  # a logical expert this rank holds
    expect_raises(
        failures,
        "misshapen shard",
        ValueError,
        f"expert {mine} shard w2 shape",
        lambda: param.weight_loader(
            param, torch.zeros(3, 4, dtype=torch.uint8), "experts.w2_weight", "w2", mine
        ),
    )
    expect_raises(
        failures,
        "bf16 shard",
        TypeError,
        "one-byte",
        lambda: param.weight_loader(
            param, torch.zeros(3, 4, dtype=torch.bfloat16), "experts.w2_weight", "w2", mine
        ),
    )
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_a_peers_failure_raises_on_every_rank(dep, standin):
    """Rank 0's bf16 routing weights: TypeError there, EpPeerError on the others; the last
    rank's experts fail: its error there, EpPeerError elsewhere; ranks whose DP metadata differ
    (T 6 and 7): an error on every rank; the prepare/finalize refusing apply_router_weight_on_
    input on rank 0: ValueError there, EpPeerError elsewhere. The next step is good each time."""
    seed = agreed_seed(dep.cpu_group, 750)
    served = serve(standin, seed, data_parallel_size=dep.size)
    moe = served.moes[0]
    counts = [6] * dep.size
    latent, ids, weights, shared = draw(seed, 6)
    failures: list[str] = []
    last = dep.rank == dep.size - 1

    def good_step(label):
        with step_context(counts, None):
            got = moe.experts(latent, weights, ids)
        ref = routed_reference(
            latent, ids, weights, served.layers[0].norm_weight(), served.layers[0].expert
        )
        failures.extend(compare(moe.routed_expert_norm(got), ref, f"after {label}"))

    bad = weights.to(torch.bfloat16) if dep.rank == 0 else weights
    expected = (TypeError, "weights") if dep.rank == 0 else (EpPeerError, None)
    with step_context(counts, None):
        expect_raises(failures, "bf16 weights", *expected, lambda: moe.experts(latent, bad, ids))
    good_step("bf16 weights")

    class Failing(ExpertsBackend):
        def __init__(self, inner):
            self.first_expert, self.num_local_experts = inner.first_expert, inner.num_local_experts
            self.latent = inner.latent

        def forward(self, *args):
            raise RuntimeError("experts failed on purpose")

    default = moe.experts.backend
    if last:
        moe.experts.backend = Failing(default)
    expected = (RuntimeError, "on purpose") if last else (EpPeerError, "experts")
    with step_context(counts, None):
        expect_raises(
            failures, "failing experts", *expected, lambda: moe.experts(latent, weights, ids)
        )
    moe.experts.backend = default
    good_step("failing experts")

    other = [6] * (dep.size - 1) + [7]
    with step_context(other if last else counts, None):
        expect_raises(
            failures,
            "T differs",
            (EpDesyncError, ValueError),
            "out of step|token counts",
            lambda: moe.experts(latent, weights, ids),
        )
    good_step("T differs")

    pf = make_prepare_finalize(moe.experts.routed)
    refuse = dep.rank == 0
    expected = (ValueError, "apply_router_weight_on_input") if refuse else (EpPeerError, None)
    with step_context(counts, None):
        expect_raises(
            failures,
            "prepare refuses",
            *expected,
            lambda: pf.prepare(latent, weights, ids, TINY.experts, None, refuse, None, False),
        )
    good_step("prepare refuses")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_prepare_finalize_is_routed(dep, standin):
    """The modular prepare/finalize: prepare's receive rows run through the layer's backend into
    the buffer allocate_fused_expert_output gave (the receive rows' own out), finalize combines
    into the engine's output: the bits of EpRouted.routed without a norm, padding rows and T
    from the forward context as in the K3 path."""
    seed = agreed_seed(dep.cpu_group, 760)
    served = serve(standin, seed, data_parallel_size=dep.size)
    moe = served.moes[1]
    counts, idle = unequal_counts(dep.size)
    rows = counts[dep.rank]
    padding = torch.zeros(rows, dtype=torch.bool)
    padding[rows // 2] = True
    latent, ids, weights, _ = draw(seed, rows)
    pf = make_prepare_finalize(moe.experts.routed)
    failures: list[str] = []
    for name in vs.FusedMoEPrepareAndFinalizeModular.ABSTRACT:
        if getattr(type(pf), name) is getattr(vs.FusedMoEPrepareAndFinalizeModular, name):
            failures.append(f"prepare/finalize does not implement {name}")
    output = torch.full((rows, TINY.latent), float("nan"), dtype=torch.bfloat16)
    with step_context(counts, padding):
        x, sf, meta, recv_ids, recv_weights = pf.prepare(
            latent, weights, ids, TINY.experts, None, False, None, False
        )
        R = x.shape[0]
        buf = pf.allocate_fused_expert_output(
            (R, TINY.latent), torch.bfloat16, torch.device("cpu"), None
        )
        if buf is None or buf.data_ptr() != moe.experts.routed.receive().out.data_ptr():
            failures.append("allocate_fused_expert_output is not the receive rows' out")
        if x.dtype != torch.float8_e4m3fn or meta is not None:
            failures.append(f"prepare returned x {x.dtype}, metadata {meta!r}")
        moe.experts.backend.forward(x.view(torch.uint8), sf, recv_ids, recv_weights, buf)
        pf.finalize(output, buf, weights, ids, False, None)
    masked = masked_ids(ids, padding)
    want = moe.experts.routed.routed(
        latent, masked, weights, None, experts=moe.experts.backend, tokens=max(counts)
    )
    if not torch.equal(bits(output), bits(want)):
        failures.append("prepare/experts/finalize differ from EpRouted.routed's bits")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_a_context_or_layer_a_rank_alone_gets_wrong_raises_on_every_rank(dep, standin):
    """What one rank alone gets wrong before the routed call fails the step on every rank:
    - a malformed forward context (a DP count of -1) on the last rank in the K3 adapter's
      forward and in the modular prepare: ValueError naming the layer and the context there,
      EpPeerError elsewhere (before: that rank raised alone, and its peers' call paired with
      its next one);
    - two layers' prepare/finalize on one EpRouted, each tagged with its layer index: the last
      rank abandons a forward between them, so its next call is layer 0's where its peers call
      layer 1's: EpDesyncError on every rank (before: untagged calls paired, and every later
      step returned rows computed with the other layer's experts, silently).
    - vLLM raising between prepare and finalize on the last rank: its next prepare aborts that
      step (RuntimeError there, EpPeerError on the peers waiting in its combine).
    The next step is good each time (after reset() for the desync)."""
    seed = agreed_seed(dep.cpu_group, 770)
    served = serve(standin, seed, data_parallel_size=dep.size)
    moe = served.moes[0]
    counts = [6] * dep.size
    latent, ids, weights, _ = draw(seed, 6)
    failures: list[str] = []
    last = dep.rank == dep.size - 1
    routed = moe.experts.routed
    want = routed.routed(
        latent, ids, weights, None, experts=moe.experts.backend, tokens=6, tag=0
    ).clone()
    bad_counts = counts[:-1] + [-1] if last else counts
    expected = (ValueError, "layer 0: the forward context") if last else (EpPeerError, None)
    with step_context(bad_counts, None):
        expect_raises(
            failures, "K3 bad context", *expected, lambda: moe.experts(latent, weights, ids)
        )
    with step_context(counts, None):
        if not torch.equal(bits(moe.experts(latent, weights, ids)), bits(want)):
            failures.append("K3 after the bad context: other bits")

    backends = [m.experts.backend for m in served.moes]
    pfs = [make_prepare_finalize(routed, layer_index=100 + i) for i in range(2)]

    def modular(i: int) -> torch.Tensor:
        output = torch.empty(6, TINY.latent, dtype=torch.bfloat16)
        x, sf, _, recv_ids, recv_weights = pfs[i].prepare(
            latent, weights, ids, TINY.experts, None, False, None, False
        )
        buf = pfs[i].allocate_fused_expert_output(
            (x.shape[0], TINY.latent), torch.bfloat16, torch.device("cpu"), None
        )
        backends[i].forward(x.view(torch.uint8), sf, recv_ids, recv_weights, buf)
        pfs[i].finalize(output, buf, weights, ids, False, None)
        return output

    with step_context(counts, None):
        clean = [modular(0).clone(), modular(1).clone()]
        if torch.equal(bits(clean[0]), bits(clean[1])):
            failures.append("the two layers' outputs are equal: the desync case tests nothing")
        modular(0)
        # The last rank abandons the forward here; its next call is the next forward's layer 0.
        expect_raises(
            failures,
            "layers out of step",
            EpDesyncError,
            "out of step",
            lambda: modular(0 if last else 1),
        )
        routed.reset()
        if not torch.equal(bits(modular(0)), bits(clean[0])):
            failures.append("layer 0 after reset: other bits")
    expected = (ValueError, "layer 101: the forward context") if last else (EpPeerError, None)
    with step_context(bad_counts, None):
        expect_raises(failures, "modular bad context", *expected, lambda: modular(1))
    with step_context(counts, None):
        if not torch.equal(bits(modular(1)), bits(clean[1])):
            failures.append("layer 1 after the bad context: other bits")
        # vLLM raises between prepare and finalize on the last rank: its next prepare aborts
        # that step, so its peers, waiting in finalize's combine, raise EpPeerError then
        # (before: they waited out their timeout, and the last rank's every later prepare was
        # refused as "not combined yet").
        if last:
            pfs[0].prepare(latent, weights, ids, TINY.experts, None, False, None, False)
            expect_raises(failures, "stale", RuntimeError, "never combined", lambda: modular(0))
        else:
            expect_raises(failures, "peer's stale", EpPeerError, None, lambda: modular(0))
        if not torch.equal(bits(modular(0)), bits(clean[0])):
            failures.append("layer 0 after the stale prepare: other bits")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_prepare_finalize_layer_indices(dep, standin):
    """make_prepare_finalize's layer_index: -1, 70000 (ValueError) and True (TypeError)
    refused; None numbers in construction order (the same on every rank); an index taken by
    a live instance refused. A rank whose prepare rejected a step (a malformed context on the
    last rank) keeps no reference to the instance: once dropped, its index is free on every
    rank (before: the error kept on the rejecting rank held it there alone). register_layer
    refuses what reset() could not restart or must not keep alive, before numbering it."""
    seed = agreed_seed(dep.cpu_group, 780)
    served = serve(standin, seed, data_parallel_size=dep.size)
    routed = served.moes[0].experts.routed
    failures: list[str] = []
    for bad, error in ((-1, ValueError), (70000, ValueError), (True, TypeError)):
        expect_raises(
            failures,
            f"layer_index={bad!r}",
            error,
            "layer_index",
            lambda: make_prepare_finalize(routed, layer_index=bad),
        )
    first, second = make_prepare_finalize(routed), make_prepare_finalize(routed)
    if second.layer_index != first.layer_index + 1:
        failures.append(f"default indices {first.layer_index}, {second.layer_index}")
    expect_raises(
        failures,
        "index taken",
        ValueError,
        "is taken",
        lambda: make_prepare_finalize(routed, layer_index=first.layer_index),
    )

    class NoRestart:
        pass

    for made, match in ((NoRestart(), "restart_steps"), (object(), "restart_steps")):
        expect_raises(
            failures, type(made).__name__, TypeError, match, lambda: routed.register_layer(made)
        )
    third = make_prepare_finalize(routed)
    if third.layer_index != second.layer_index + 1:
        failures.append(f"a refused registration took an index: {third.layer_index}")

    latent, ids, weights, _ = draw(seed, 6)
    counts = [6] * dep.size
    last = dep.rank == dep.size - 1

    def reject_once() -> None:  # the instance lives in this frame only
        rejecting = make_prepare_finalize(routed, layer_index=300)
        expected = (ValueError, "layer 300") if last else (EpPeerError, None)
        with step_context(counts[:-1] + [-1] if last else counts, None):
            expect_raises(
                failures,
                "bad context",
                *expected,
                lambda: rejecting.prepare(
                    latent, weights, ids, TINY.experts, None, False, None, False
                ),
            )

    reject_once()
    gc.collect()
    try:
        make_prepare_finalize(routed, layer_index=300)
    except ValueError as err:
        failures.append(f"index 300 still taken after its instance was dropped: {err}")
    collective_assert(dep.cpu_group, failures, seeds=seed)
