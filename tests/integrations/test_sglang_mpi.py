"""dep_ep.integrations.sglang on 2-4 CPU ranks against the SGLang 0.5.23 stand-ins
(standins/sglang_standin.py): the plugin registers its hooks with the stand-in HookRegistry,
which applies them to the stand-in KimiK3MoE, Mxfp4MoEMethod, create_moe_dispatcher and
Scheduler; K3 layers are built, loaded expert by expert through FusedMoE's weight loader and
finished by process_weights_after_loading, then stepped as SGLang 0.5.23 steps them
(`_forward_unfused`'s latent tail: `_forward_mega_experts`, then `_reduce_latent`'s RMSNorm,
skipped for an idle rank's 0 rows).

Every step's output is compared bit for bit with EpRouted.routed called directly on the same
rows (norm_weight None, T by SGLang's rule, padding rows -1, the layer index as tag) followed by
the stand-in norm, and with the float64 reference (dep_ep.testing.routed_reference, normed)
within dep_ep.testing.compare's bound: the hook's path rounds to BF16 at most as often as the
library's fused norm does (the sum, then the norm's one output rounding), so the library's
six-rounding bound covers it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from standins import sglang_standin as ss

from dep_ep.comm.errors import EpPeerError
from dep_ep.config import TINY, EpConfig
from dep_ep.ep import EpRouted
from dep_ep.experts import ExpertsBackend, ReferenceExperts
from dep_ep.integrations import common
from dep_ep.integrations.sglang import engine as sglang_engine
from dep_ep.integrations.sglang import kimi_k3, plugin
from dep_ep.integrations.sglang.dispatcher import DepEpDispatch
from dep_ep.testing import SyntheticLayer, compare, routed_reference

from helpers.cases import agreed_seed, make_case
from helpers.collective import collective_assert, expect_raises
from helpers.reference_check import RowByRowExperts

GEOMETRY = TINY
E, K, L, INTER = GEOMETRY.experts, GEOMETRY.topk, GEOMETRY.latent, GEOMETRY.intermediate
NORM_EPS = 1e-5  # k3_config's rms_norm_eps


# ---------------------------------------------------------------------------------- serving
@contextlib.contextmanager
def serving(dep, monkeypatch, factory=None, **standin):
    """A stand-in SGLang process with dep_ep's plugin loaded as SGLang loads it (register()
    under DEP_EP_SGLANG=1, then the registry applies the hooks); yields (sglang, engine).
    Closes the shared EpRouted on exit (every rank: the tests never leave a rank behind)."""
    sglang = ss.SglangStandin(dep.cpu_group, **standin)
    engine = ss.StandinEngine(sglang, factory)
    previous = sglang_engine.use_engine(engine)
    monkeypatch.setenv("DEP_EP_SGLANG", "1")
    try:
        plugin.register()
        sglang.registry.apply_hooks()
        yield sglang, engine
    finally:
        sglang_engine.use_engine(previous)
        common.close_shared()


def load_checkpoint(layer, synthetic: SyntheticLayer) -> None:
    """Every checkpoint expert through the layer's weight loader, as SGLang feeds K3's MXFP4
    experts: w1 and w3 (with their scales) separately into w13, w2 whole; the loader skips the
    experts another rank owns."""
    for e in range(E):
        w13, s13, w2, s2 = synthetic.expert(e)
        for shard, rows in (("w1", slice(0, INTER)), ("w3", slice(INTER, 2 * INTER))):
            layer.weight_loader(layer.w13_weight, w13[rows], "w13_weight", shard, e)
            layer.weight_loader(layer.w13_weight_scale, s13[rows], "w13_weight_scale", shard, e)
        layer.weight_loader(layer.w2_weight, w2, "w2_weight", "w2", e)
        layer.weight_loader(layer.w2_weight_scale, s2, "w2_weight_scale", "w2", e)


def k3_layer(sglang, synthetic: SyntheticLayer, layer_idx: int, **config):
    """A KimiK3MoE built, loaded and finished (process_weights_after_loading) as SGLang does."""
    moe = sglang.KimiK3MoE(
        ss.k3_config(GEOMETRY, **config),
        prefix=f"model.layers.{layer_idx}.mlp",
        layer_idx=layer_idx,
    )
    load_checkpoint(moe.experts, synthetic)
    moe.routed_expert_norm.weight.data.copy_(synthetic.norm_weight())
    moe.experts.quant_method.process_weights_after_loading(moe.experts)
    return moe


def layer_norm(synthetic: SyntheticLayer) -> ss.RMSNorm:
    """The stand-in engine norm with the layer's weight (for the expected outputs)."""
    norm = ss.RMSNorm(L, eps=NORM_EPS)
    norm.weight.data.copy_(synthetic.norm_weight())
    return norm


def step_inputs(seed: int, counts: list[int]):
    """Every rank's (latent bf16 [c, L], ids int32 [c, K], weights fp32 [c, K]), c = counts[r],
    from one seed (every rank builds all of them)."""
    case = make_case(GEOMETRY, len(counts), max(max(counts), 1), seed)
    return [
        (case.latent[r][:c], case.ids[r][:c], case.weights[r][:c]) for r, c in enumerate(counts)
    ]


def draw_counts(seed: int, size: int, low: int, high: int, idle_last: bool = True) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    counts = [int(c) for c in torch.randint(low, high + 1, (size,), generator=gen)]
    if idle_last:
        counts[-1] = 0  # an idle data-parallel rank: SGLang enters with a [0, L] latent
    return counts


@contextlib.contextmanager
def spying(routed: EpRouted):
    """Record the keyword arguments (and norm_weight) of every routed() call the hooks make."""
    calls: list[dict] = []
    original = routed.routed

    def spy(latent, ids, weights, norm_weight, **kwargs):
        calls.append(dict(kwargs, norm_weight=norm_weight))
        return original(latent, ids, weights, norm_weight, **kwargs)

    routed.routed = spy
    try:
        yield calls
    finally:
        del routed.routed


def expected(routed, experts, norm, latent, ids, weights, tokens, tag):
    """EpRouted.routed called directly (no norm), then the engine's norm unless no rows."""
    plain = routed.routed(latent, ids, weights, None, experts=experts, tokens=tokens, tag=tag)
    return plain if plain.shape[0] == 0 else norm(plain)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def check_output(out, want, latent, ids, weights, synthetic, label) -> list[str]:
    """Bits of the direct call, and the float64 reference within tolerance."""
    if tuple(out.shape) != tuple(want.shape) or out.dtype != torch.bfloat16:
        return [f"{label}: output {out.dtype} {tuple(out.shape)}; expected {tuple(want.shape)}"]
    failures = []
    if not torch.equal(bits(out), bits(want)):
        failures.append(f"{label}: other bits than EpRouted.routed + the engine's norm")
    if out.shape[0]:
        ref = routed_reference(latent, ids, weights, synthetic.norm_weight(), synthetic.expert)
        failures += compare(out, ref, label)
    return failures


class FlakyExperts(ExpertsBackend):
    """ReferenceExperts that raise while `fail` is set."""

    def __init__(self, inner: ExpertsBackend):
        self.inner, self.fail = inner, False
        self.first_expert, self.num_local_experts = inner.first_expert, inner.num_local_experts
        self.latent = inner.latent

    def forward(self, x, sf, ids, weights, out):
        if self.fail:
            raise RuntimeError("these experts fail on purpose")
        return self.inner.forward(x, sf, ids, weights, out)


# ---------------------------------------------------------------------------------- K3 steps
@pytest.mark.mpi(min_size=2)
def test_unequal_counts_an_idle_rank_and_the_norm_once(dep, monkeypatch):
    """Two K3 layers (other weights each), two steps of unequal DP counts with the last rank
    idle ([0, L] latent): every rank runs T = max(counts) with no norm (norm_weight None) and
    the layer index as tag; the model's norm runs once per step on ranks with rows and not on
    the idle one; outputs are the direct call's bits and within the reference's tolerance."""
    seed = agreed_seed(dep.cpu_group, 700)
    failures: list[str] = []
    with serving(dep, monkeypatch) as (sglang, _):
        synthetic = {i: SyntheticLayer(GEOMETRY, seed + 97 * i) for i in (0, 3)}
        layers = {i: k3_layer(sglang, synthetic[i], i) for i in synthetic}
        routed = layers[0].experts._dep_ep_routed
        for step in range(2):
            counts = draw_counts(seed + 10 + step, dep.size, 1, 9)
            latent, ids, weights = step_inputs(seed + step, counts)[dep.rank]
            for index, moe in layers.items():
                label = f"step {step} layer {index} counts {counts}"
                before = moe.routed_expert_norm.calls
                with sglang.step(counts), spying(routed) as calls:
                    out = moe.forward_routed(latent, ss.StandardTopKOutput(weights, ids, None))
                want_calls = [(max(counts), None, index)]
                got_calls = [(c["tokens"], c["norm_weight"], c["tag"]) for c in calls]
                if got_calls != want_calls:
                    failures.append(f"{label}: routed calls {got_calls}; expected {want_calls}")
                norms = moe.routed_expert_norm.calls - before
                if norms != (1 if latent.shape[0] else 0):
                    failures.append(f"{label}: the engine's norm ran {norms} times")
                experts = moe.experts._dep_ep_experts
                norm = layer_norm(synthetic[index])
                want = expected(routed, experts, norm, latent, ids, weights, max(counts), index)
                failures += check_output(out, want, latent, ids, weights, synthetic[index], label)
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_attention_tp_shards(dep, monkeypatch):
    """Sequence-parallel MoE: attention TP of 2 (of every rank where the rank count is odd),
    each DP rank's tokens split over its attention-TP ranks as SGLang splits them; T =
    ceil(max(DP counts) / attn_tp_size) on every rank (with one DP rank, whose shards SGLang
    pads equal, the rank's rows), and the outputs of the direct call and the reference."""
    seed = agreed_seed(dep.cpu_group, 710)
    attn_tp = 2 if dep.size % 2 == 0 else dep.size
    groups = dep.size // attn_tp
    if groups > 1:
        dp_counts = draw_counts(seed, groups, 0, 13, idle_last=False)
        dp_counts[0] = max(dp_counts[0], 3)  # shards of one DP rank differ (3 = 2 + 1)
    else:
        dp_counts = [attn_tp * draw_counts(seed, 1, 1, 5, idle_last=False)[0]]
    shards = ss.scattered_source_token_counts(dp_counts, attn_tp)
    tokens = -(-max(dp_counts) // attn_tp)
    failures: list[str] = []
    with serving(dep, monkeypatch, attn_tp_size=attn_tp) as (sglang, _):
        synthetic = SyntheticLayer(GEOMETRY, seed)
        moe = k3_layer(sglang, synthetic, 1)
        routed, experts = moe.experts._dep_ep_routed, moe.experts._dep_ep_experts
        latent, ids, weights = step_inputs(seed + 1, shards)[dep.rank]
        label = f"DP counts {dp_counts} over attention TP {attn_tp} (shards {shards})"
        with sglang.step(dp_counts), spying(routed) as calls:
            out = moe.forward_routed(latent, ss.StandardTopKOutput(weights, ids, None))
        if [c["tokens"] for c in calls] != [tokens]:
            failures.append(f"{label}: T {[c['tokens'] for c in calls]}; expected [{tokens}]")
        want = expected(routed, experts, layer_norm(synthetic), latent, ids, weights, tokens, 1)
        failures += check_output(out, want, latent, ids, weights, synthetic, label)
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_padding_rows_mid_batch(dep, monkeypatch):
    """The forward's real-row bound cuts the batch (7 rows, bound 5 on even ranks, none past
    it on odd ones) and falls inside the second piece of a step run in pieces of 4: the ids of
    the rows past it, real expert ids as SGLang's fused K3 front hands them, select nothing, so
    those rows come out +0.0, and every row has the bits of the direct call with -1 ids."""
    seed = agreed_seed(dep.cpu_group, 720)
    rows, bound = 7, 5 if dep.rank % 2 == 0 else 7
    counts = [rows] * dep.size
    failures: list[str] = []
    with serving(dep, monkeypatch, mega_max_tokens=4) as (sglang, _):
        synthetic = SyntheticLayer(GEOMETRY, seed)
        moe = k3_layer(sglang, synthetic, 2)
        routed, experts = moe.experts._dep_ep_routed, moe.experts._dep_ep_experts
        latent, ids, weights = step_inputs(seed + 1, counts)[dep.rank]
        with sglang.step(counts, torch.tensor([bound], dtype=torch.int32)):
            out = moe.forward_routed(latent, ss.StandardTopKOutput(weights, ids, None))
        masked = ids.clone()
        masked[bound:] = -1
        want = expected(routed, experts, layer_norm(synthetic), latent, masked, weights, rows, 2)
        label = f"bound {bound} of {rows} rows"
        if bits(out[bound:]).any():
            failures.append(f"{label}: padding rows are not +0.0")
        failures += check_output(out, want, latent, masked, weights, synthetic, label)
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_a_step_in_pieces_equals_one_step(dep, monkeypatch):
    """Under a megamoe token budget of 4 a step of T = max(counts) > 4 runs in pieces; with
    experts computed row by row its output has the bits of one step of T on an EpRouted of 16
    (then the engine's norm)."""
    seed = agreed_seed(dep.cpu_group, 730)
    counts = draw_counts(seed, dep.size, 5, 11)
    failures: list[str] = []

    def row_by_row(weights):
        return RowByRowExperts(ReferenceExperts(weights))

    synthetic = SyntheticLayer(GEOMETRY, seed)
    latent, ids, weights = step_inputs(seed + 1, counts)[dep.rank]
    tokens = max(counts)
    with serving(dep, monkeypatch, factory=row_by_row, mega_max_tokens=4) as (sglang, _):
        moe = k3_layer(sglang, synthetic, 0)
        with sglang.step(counts):
            out = moe.forward_routed(latent, ss.StandardTopKOutput(weights, ids, None))
        first = moe.experts._dep_ep_routed.first_expert
    config = EpConfig(timeout_s=10.0)
    kw = dict(num_experts=E, latent=L, topk=K, config=config)
    with EpRouted(dep.cpu_group, 16, "cpu", **kw) as large:
        experts = row_by_row(synthetic.local_weights(first, E // dep.size))
        want = expected(large, experts, layer_norm(synthetic), latent, ids, weights, tokens, 0)
    failures += check_output(out, want, latent, ids, weights, synthetic, f"T={tokens} by 4")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fused", [False, True])
def test_routed_scaling_factor_as_the_original_applies_it(dep, monkeypatch, fused):
    """routed_scaling_factor 2.5: multiplied into the bf16 sum (before the engine's norm) when
    the runner does not fuse it into the top-k weights, left out when it does."""
    seed = agreed_seed(dep.cpu_group, 735)
    counts = draw_counts(seed, dep.size, 1, 6)
    failures: list[str] = []
    with serving(dep, monkeypatch) as (sglang, _):
        synthetic = SyntheticLayer(GEOMETRY, seed)
        moe = k3_layer(sglang, synthetic, 0, routed_scaling_factor=2.5)
        moe.experts.should_fuse_routed_scaling_factor_in_topk = fused
        routed, experts = moe.experts._dep_ep_routed, moe.experts._dep_ep_experts
        latent, ids, weights = step_inputs(seed + 1, counts)[dep.rank]
        with sglang.step(counts):
            out = moe.forward_routed(latent, ss.StandardTopKOutput(weights, ids, None))
        plain = routed.routed(
            latent, ids, weights, None, experts=experts, tokens=max(counts), tag=0
        )
        want = plain if fused else plain * 2.5
        if want.shape[0]:
            want = layer_norm(synthetic)(want)
        if not torch.equal(bits(out), bits(want)):
            failures.append(
                f"fused={fused}: not the bits of the sum {'' if fused else 'x 2.5 '}normed"
            )
    collective_assert(dep.cpu_group, failures, seeds=seed)


# ---------------------------------------------------------------------------------- weights
@pytest.mark.mpi(min_size=2)
def test_weights_taken_before_the_deepgemm_conversion(dep, monkeypatch):
    """A K3 layer's experts backend is built from its four parameters exactly as loaded: bit
    equal to SyntheticLayer.local_weights (the checkpoint layout: uint8, rows [w1; w3]), this
    rank's experts of E; the conversion did not run and the parameters are released. Another
    model's MXFP4 layer under megamoe (not K3's) gets SGLang's conversion and no dep_ep experts;
    so does K3 under another backend. K3 with other SiTU constants is refused on every rank."""
    seed = agreed_seed(dep.cpu_group, 740)
    synthetic = SyntheticLayer(GEOMETRY, seed)
    count = E // dep.size
    first = dep.rank * count
    failures: list[str] = []
    with serving(dep, monkeypatch) as (sglang, engine):
        moe = k3_layer(sglang, synthetic, 2)
        want = synthetic.local_weights(first, count)
        if len(engine.built) != 1:
            failures.append(f"{len(engine.built)} backends built for one K3 layer")
        else:
            got = engine.built[0]
            for name in ("w13", "s13", "w2", "s2"):
                mine, theirs = getattr(got, name), getattr(want, name)
                if mine.dtype != torch.uint8 or not torch.equal(mine, theirs):
                    failures.append(f"{name}: not the checkpoint layout's {theirs.dtype} bytes")
            if (got.first_expert, got.num_experts) != (first, E):
                failures.append(f"experts {got.first_expert} of {got.num_experts}")
        layer = moe.experts
        if getattr(layer, "_mega_moe_weights_built", False):
            failures.append("the K3 layer's weights were converted for DeepGEMM")
        if any(getattr(layer, n).numel() for n in kimi_k3.CHECKPOINT_PARAMETERS):
            failures.append("the K3 layer's checkpoint-layout parameters were kept")
        other = sglang.FusedMoE(E, L, INTER, 9, top_k=K, prefix="model.layers.9.mlp.experts")
        load_checkpoint(other, synthetic)
        other.quant_method.process_weights_after_loading(other)
        if not other._mega_moe_weights_built or hasattr(other, kimi_k3.EXPERTS):
            failures.append("another model's layer did not get SGLang's conversion alone")
        expect_raises(
            failures,
            "other SiTU constants",
            ValueError,
            "SiTU beta=4.0, linear_beta=1.0",
            lambda: k3_layer(sglang, synthetic, 3, situ=(4.0, 1.0)),
        )
    with serving(dep, monkeypatch, a2a="flashinfer", dispatch_max_tokens=16) as (sglang, engine):
        moe = k3_layer(sglang, synthetic, 2)
        if engine.built or not moe.experts._mega_moe_weights_built:
            failures.append("K3 under --moe-a2a-backend flashinfer: weights not left to SGLang")
    collective_assert(dep.cpu_group, failures, seeds=seed)


# ---------------------------------------------------------------------------------- errors
@pytest.mark.mpi(min_size=2)
def test_a_peers_failure_raises_on_every_rank(dep, monkeypatch):
    """Rank 0's malformed top-k output (no ids), its ids of K - 1 columns, a real-row bound of
    two elements (a torch RuntimeError in its mask's comparison), its failing experts: its own
    error there, EpPeerError on every other rank; DP counts that differ between ranks:
    ValueError on every rank; each time the next step is good."""
    seed = agreed_seed(dep.cpu_group, 750)
    counts = [5] * dep.size
    failures: list[str] = []
    with serving(dep, monkeypatch, factory=lambda w: FlakyExperts(ReferenceExperts(w))) as (
        sglang,
        _,
    ):
        synthetic = SyntheticLayer(GEOMETRY, seed)
        moe = k3_layer(sglang, synthetic, 1)
        experts = moe.experts._dep_ep_experts
        latent, ids, weights = step_inputs(seed + 1, counts)[dep.rank]
        good = ss.StandardTopKOutput(weights, ids, None)
        bad = dep.rank == 0

        def forward(topk, step_counts=counts, bound=None):
            with sglang.step(step_counts, bound):
                return moe.forward_routed(latent, topk)

        two = torch.tensor([5, 5], dtype=torch.int32)  # a bound [2]: no broadcast against [5]
        cases = [
            ("no ids", ss.StandardTopKOutput(weights, None, None), "top-k output", None),
            ("K - 1 ids", ss.StandardTopKOutput(weights, ids[:, 1:], None), "ids shape", None),
            ("bound [2]", good, "the top-k output or the step's counts", two),
            ("failing experts", good, "fail on purpose", None),
        ]
        for label, topk, match, bound in cases:
            experts.fail = bad and label == "failing experts"
            expected_error, pattern = (ValueError, match) if bad else (EpPeerError, "rank 0")
            if experts.fail:
                expected_error = RuntimeError
            mine = topk if bad else good
            my_bound = bound if bad else None
            expect_raises(
                failures,
                label,
                expected_error,
                pattern,
                lambda: forward(mine, bound=my_bound),
            )
            experts.fail = False
            again = forward(good)
            ref = routed_reference(latent, ids, weights, synthetic.norm_weight(), synthetic.expert)
            failures += compare(again, ref, f"the step after {label}")
        other = [6] + counts[1:] if bad else counts
        expect_raises(
            failures,
            "DP counts differ",
            ValueError,
            "token counts",
            lambda: forward(good, other),
        )
        failures += compare(forward(good), ref, "the step after differing counts")
    collective_assert(dep.cpu_group, failures, seeds=seed)


# ---------------------------------------------------------------------------------- dispatcher
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "runner_backend, in_place", [(None, False), (ss.MoeRunnerBackend.DEEP_GEMM, True)]
)
def test_dispatcher_for_other_models(dep, monkeypatch, runner_backend, in_place):
    """Another model's FusedMoE under --moe-a2a-backend flashinfer gets dep_ep's dispatcher:
    dispatch gives the receive rows as FlashInfer's dispatch output (e4m3 rows [N T, H], E8M0
    scales, ids with the runner's "no expert" id: -1 for DeepGEMM, E otherwise), a runner
    writes its row sums (into moe_output, or a tensor of its own that combine copies), and
    combine returns EpRouted.routed's bits (no norm) for unequal counts with an idle rank, also
    through BaseDispatcher's pre-dispatch hook (the keyword call). Without the dispatch token
    budget the construction is refused on every rank."""
    seed = agreed_seed(dep.cpu_group, 760)
    synthetic = SyntheticLayer(GEOMETRY, seed)
    count = E // dep.size
    experts = ReferenceExperts(synthetic.local_weights(dep.rank * count, count))
    counts = draw_counts(seed, dep.size, 1, 9)
    latent, ids, weights = step_inputs(seed + 1, counts)[dep.rank]
    tokens, invalid = max(counts), (-1 if runner_backend is not None else E)
    failures: list[str] = []
    seen: list[object] = []

    def runner(dispatch_output):
        """The quant method's apply: the rank's experts on the receive rows."""
        seen.append(dispatch_output)
        topk = dispatch_output.topk_output
        local = torch.where(topk.topk_ids == invalid, -1, topk.topk_ids)
        out = dispatch_output.moe_output
        if not in_place:
            out = torch.empty_like(out)
        x = dispatch_output.hidden_states.view(torch.uint8)
        experts.forward(x, dispatch_output.hidden_states_scale, local, topk.topk_weights, out)
        return ss.FlashinferCombineInput(out)

    backend = dict(a2a="flashinfer", dispatch_max_tokens=16, runner_backend=runner_backend)
    with serving(dep, monkeypatch, **backend) as (sglang, _):
        layer = sglang.FusedMoE(E, L, INTER, 5, top_k=K, prefix="model.layers.5.mlp.experts")
        layer.runner = runner
        if not isinstance(layer.dispatcher, DepEpDispatch):
            failures.append(f"the layer's dispatcher is {type(layer.dispatcher).__name__}")
        routed = layer.dispatcher.routed
        for hooked in (False, True):
            label = f"hooked={hooked} counts {counts}"
            if hooked:
                layer.dispatcher.register_pre_dispatch_hook(lambda d, h, t: None)
            with sglang.step(counts):
                got = layer(latent, ss.StandardTopKOutput(weights, ids, None))
            want = routed.routed(latent, ids, weights, None, experts=experts, tokens=tokens, tag=5)
            if not torch.equal(bits(got), bits(want)):
                failures.append(f"{label}: other bits than EpRouted.routed")
            x, ids_seen = seen[-1].hidden_states, seen[-1].topk_output.topk_ids
            if x.dtype != torch.float8_e4m3fn or tuple(x.shape) != (dep.size * tokens, L):
                failures.append(f"{label}: receive rows {x.dtype} {tuple(x.shape)}")
            sentinels = set(ids_seen.unique().tolist()) - set(range(E))
            if sentinels != {invalid}:
                failures.append(f"{label}: no-expert ids {sorted(sentinels)}; expected {invalid}")
        # Rank 0's top-k output without ids: its ValueError, EpPeerError on the others (not a
        # wait); the next step is good.
        bad = dep.rank == 0
        topk = ss.StandardTopKOutput(weights, None if bad else ids, None)
        expected, match = (
            (ValueError, "the top-k output or the step's counts")
            if bad
            else (
                EpPeerError,
                "rank 0",
            )
        )
        with sglang.step(counts):
            expect_raises(failures, "no ids", expected, match, lambda: layer(latent, topk))
        with sglang.step(counts):
            got = layer(latent, ss.StandardTopKOutput(weights, ids, None))
        if not torch.equal(bits(got), bits(want)):
            failures.append("the step after rank 0's malformed top-k output: other bits")
        # Rank 0's runner raises between dispatch and combine (SGLang's code, outside dep_ep):
        # its next dispatch aborts that step, so the peers waiting in its combine raise
        # EpPeerError then (before: they waited out their timeout, and rank 0's every later
        # dispatch was refused as "not combined yet"); the step after is good.
        topk = ss.StandardTopKOutput(weights, ids, None)
        good_runner = layer.runner

        def failing_runner(dispatch_output):
            raise RuntimeError("the runner failed on purpose")

        if bad:
            layer.runner = failing_runner
            with sglang.step(counts):
                expect_raises(
                    failures, "runner", RuntimeError, "on purpose", lambda: layer(latent, topk)
                )
            layer.runner = good_runner
            with sglang.step(counts):
                expect_raises(
                    failures, "stale", RuntimeError, "never combined", lambda: layer(latent, topk)
                )
        else:
            with sglang.step(counts):
                expect_raises(
                    failures, "peer's runner", EpPeerError, "rank 0", lambda: layer(latent, topk)
                )
        with sglang.step(counts):
            got = layer(latent, topk)
        if not torch.equal(bits(got), bits(want)):
            failures.append("the step after rank 0's runner failed: other bits")
        # Rank 0's runner hands back what combine cannot take: not a tensor, or its rows
        # shifted one row inside moe_output (torch refuses that copy). Its error, EpPeerError
        # on the others, in that call (before: rank 0 raised alone, and the peers waited in
        # the combine until rank 0's next dispatch or their timeout); the next step is good.
        # Then a runner that writes fp16 into moe_output viewed as fp16 and returns that view:
        # converted to bf16 (before: read as bf16 bits, relative L2 0.65-0.70 on every rank).

        def output_runner(make):
            def run(dispatch_output):
                rows = runner(dispatch_output).hidden_states.clone()  # moe_output when in place
                return ss.FlashinferCombineInput(make(rows, dispatch_output.moe_output))

            return run

        def shifted(rows, moe_output):
            # moe_output's memory one row on (the receive rows hold more rows than this step's).
            offset = moe_output.storage_offset() + moe_output.stride(0)
            view = moe_output.as_strided(moe_output.shape, moe_output.stride(), offset)
            return view.copy_(rows)

        cases = [
            ("no tensor", lambda rows, moe_output: None, ValueError, "the runner's output is"),
            ("shifted rows", shifted, RuntimeError, "unsupported operation"),
        ]
        for name, make, error, match in cases:
            layer.runner = output_runner(make) if bad else good_runner
            expected = (error, match) if bad else (EpPeerError, "rank 0")
            with sglang.step(counts):
                expect_raises(failures, name, *expected, lambda: layer(latent, topk))
            layer.runner = good_runner
            with sglang.step(counts):
                got = layer(latent, topk)
            if not torch.equal(bits(got), bits(want)):
                failures.append(f"the step after rank 0's runner output ({name}): other bits")

        def as_fp16(rows, moe_output):
            view = moe_output.view(torch.float16)
            return view.copy_(rows)

        layer.runner = output_runner(as_fp16)
        with sglang.step(counts):
            got = layer(latent, topk)
        layer.runner = good_runner
        if got.shape[0]:
            failures += compare(got, want.double(), "fp16 view of moe_output")
    with serving(dep, monkeypatch, a2a="flashinfer") as (sglang, _):
        expect_raises(
            failures,
            "no dispatch token budget",
            ValueError,
            "SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK is not set",
            lambda: sglang.FusedMoE(E, L, INTER, 5, top_k=K),
        )
    collective_assert(dep.cpu_group, failures, seeds=seed)


# ---------------------------------------------------------------------------------- EPLB
@pytest.mark.mpi(min_size=2)
def test_expert_load_to_the_recorder(dep, monkeypatch):
    """With SGLang's expert-distribution recorder on, each step's received pairs per local
    expert reach its per-rank counts hook for the current layer: over four steps, the last one
    run in pieces (T above the megamoe budget of 8), the sums of every rank's (token, k) pairs
    on this rank's experts, nothing under the other layers."""
    seed = agreed_seed(dep.cpu_group, 770)
    synthetic = SyntheticLayer(GEOMETRY, seed)
    count = E // dep.size
    first = dep.rank * count
    failures: list[str] = []
    with serving(dep, monkeypatch, recording=True, mega_max_tokens=8) as (sglang, _):
        moe = k3_layer(sglang, synthetic, 1)
        recorder = sglang.start_recorder(count)
        want = torch.zeros(count, dtype=torch.int32)
        for step, high in enumerate((8, 8, 8, 12)):
            counts = draw_counts(seed + step, dep.size, high - 7, high)
            every = step_inputs(seed + 10 + step, counts)
            for _, ids, _ in every:
                local = ids[(ids >= first) & (ids < first + count)].long() - first
                want += torch.bincount(local, minlength=count).int()
            latent, ids, weights = every[dep.rank]
            with sglang.step(counts), recorder.with_current_layer(1):
                moe.forward_routed(latent, ss.StandardTopKOutput(weights, ids, None))
            if not torch.equal(recorder.data[1], want):
                got = recorder.data[1].tolist()
                failures.append(
                    f"after step {step} (T={max(counts)}): {got}; expected {want.tolist()}"
                )
        if recorder.data[[0, 2, 3]].any():
            failures.append("counts recorded under another layer")
    collective_assert(dep.cpu_group, failures, seeds=seed)
