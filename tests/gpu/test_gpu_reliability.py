"""GPU: a bad input, a failing expert, differing tags or token counts on one rank raise on every
rank at its next call or synchronize() (well under timeout_s), and the next good step is correct;
the overflow-free norm, the plain (un-normed) combine and the server-shaped calls (tokens=,
expert_counts) against the torch reference."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from dep_ep.comm import EpDesyncError, EpPeerError, EpUnwrittenRowsError
from dep_ep.comm.failure import FAILURE_PAIR_BUDGET
from dep_ep.comm.reference import owner_ranks, rms_norm
from dep_ep.config import EpConfig
from dep_ep.cuda_graphs import capture_graph
from dep_ep.ep import TINY, EpRouted
from dep_ep.ep.unwritten_rows import UNWRITTEN_ROW_MARK
from dep_ep.experts import DenseExperts, ExpertsBackend
from dep_ep.testing import SyntheticLayer, allgather_reference
from dep_ep.testing.allgather_reference import NORM_EPS
from dep_ep.testing.compare import compare

from helpers.cases import agreed_seed, make_case
from helpers.collective import collective_assert, expect_raises
from helpers.recovery import timed

MAX_TOKENS = 32
TIMEOUT_S = 20.0  # a waited-out timeout would show as a failure of the 1 s bound below
FAST_S = 1.0


def build_routed(gpu_dep, config: EpConfig) -> EpRouted:
    """An EpRouted of the TINY geometry on this rank's GPU."""
    return EpRouted(
        gpu_dep.cpu_group,
        MAX_TOKENS,
        torch.device("cuda"),
        num_experts=TINY.experts,
        latent=TINY.latent,
        topk=TINY.topk,
        config=config,
    )


@pytest.fixture(scope="module")
def routed(gpu_dep):
    r = build_routed(gpu_dep, EpConfig(timeout_s=TIMEOUT_S, count_experts=True))
    yield r
    r.close()


@pytest.fixture(scope="module")
def layer(gpu_dep):
    return SyntheticLayer(TINY, agreed_seed(gpu_dep.cpu_group, 50))


@pytest.fixture(scope="module")
def experts(gpu_dep, layer):
    per_rank = TINY.experts // gpu_dep.size
    first = gpu_dep.rank * per_rank
    return DenseExperts(layer.local_weights(first, per_rank).to("cuda"))


class FailingExperts(ExpertsBackend):
    def __init__(self, inner: ExpertsBackend):
        self.first_expert, self.num_local_experts = inner.first_expert, inner.num_local_experts
        self.latent = inner.latent

    def forward(self, x, sf, ids, weights, out):
        raise RuntimeError("expert failure injected by the test")


def step_inputs(gpu_dep, base: int, tokens: int = 8):
    seed = agreed_seed(gpu_dep.cpu_group, base)
    case = make_case(TINY, gpu_dep.size, tokens, seed)
    r = gpu_dep.rank
    return seed, case, case.latent[r].cuda(), case.ids[r].cuda(), case.weights[r].cuda()


def good_step(gpu_dep, routed, layer, experts, base: int, label: str) -> list[str]:
    """A step that must match the all-gather reference, and equal itself bit for bit when run
    again on the same inputs (deterministic)."""
    seed, case, latent, ids, weights = step_inputs(gpu_dep, base)
    norm = layer.norm_weight().cuda()
    try:
        first = routed(latent, ids, weights, norm, experts=experts, tag=base)
        again = routed(latent, ids, weights, norm, experts=experts, tag=base + 1)
        routed.synchronize()
    except Exception as err:  # reported collectively
        return [f"{label} (seed {seed}): {type(err).__name__}: {err}"]
    r = gpu_dep.rank
    ref = allgather_reference(
        gpu_dep.cpu_group,
        case.latent[r],
        case.ids[r],
        case.weights[r],
        layer.norm_weight(),
        layer.expert,
    )
    failures = compare(first.cpu(), ref, f"{label} (seed {seed})")
    if not torch.equal(first.view(torch.int16), again.view(torch.int16)):
        failures.append(f"{label} (seed {seed}): a rerun differs")
    return failures


def fails_fast(failures, label, expected, match, routed, call, bad: bool) -> None:
    """expected, match: (on the bad rank, on the others). On the bad rank `call()` raises
    expected[0] at once; on the others it returns an all-NaN output and synchronize() raises
    expected[1]; either within FAST_S."""
    start = time.monotonic()
    if bad:
        expect_raises(failures, f"{label} (bad rank)", expected[0], match[0], call)
        try:
            routed.synchronize()
        except Exception as err:
            failures.append(f"{label}: synchronize on the bad rank raised {err}")
    else:
        out = call()
        expect_raises(failures, f"{label} (peer)", expected[1], match[1], routed.synchronize)
        if not out.isnan().all():
            failures.append(f"{label}: the peer's output of the failed call is not all NaN")
    took = time.monotonic() - start
    print(f"TIME-TO-ERROR {label} rank {routed.rank} ({'bad' if bad else 'peer'}): {took:.4f} s")
    if took > FAST_S:
        failures.append(f"{label}: {took:.2f} s to the error (bound {FAST_S} s)")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("which", ["one", "all"])
def test_bad_input_fails_every_rank_fast(gpu_dep, routed, layer, experts, which):
    failures: list[str] = []
    seed, _, latent, ids, weights = step_inputs(gpu_dep, 1)
    bad = which == "all" or gpu_dep.rank == 0
    given = latent.float() if bad else latent

    def call():
        return routed(given, ids, weights, layer.norm_weight().cuda(), experts=experts)

    if which == "all":
        expect_raises(failures, "all bad", TypeError, "latent dtype", call)
        try:
            routed.synchronize()
        except Exception as err:
            failures.append(f"all bad: synchronize raised {err}")
    else:
        fails_fast(
            failures,
            "bad latent",
            (TypeError, EpPeerError),
            ("latent dtype", "rank 0 rejected its input"),
            routed,
            call,
            bad,
        )
    failures += good_step(gpu_dep, routed, layer, experts, 100, "next good step")
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_failing_experts_fail_every_rank_fast(gpu_dep, routed, layer, experts):
    failures: list[str] = []
    seed, _, latent, ids, weights = step_inputs(gpu_dep, 2)
    bad = gpu_dep.rank == gpu_dep.size - 1
    used = FailingExperts(experts) if bad else experts

    def call():
        return routed(latent, ids, weights, layer.norm_weight().cuda(), experts=used)

    fails_fast(
        failures,
        "expert failure",
        (RuntimeError, EpPeerError),
        ("injected", f"rank {gpu_dep.size - 1} failed in its experts"),
        routed,
        call,
        bad,
    )
    failures += good_step(gpu_dep, routed, layer, experts, 200, "next good step")
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mismatch", ["tag", "tokens"])
def test_ranks_out_of_step_raise_on_every_rank(gpu_dep, routed, layer, experts, mismatch):
    """Differing tags (a skipped step) give EpDesyncError, differing T a ValueError, on every
    rank at synchronize(); the outputs of that call are NaN; after differing tags every call is
    refused until reset() on every rank; then (and after differing T at once) the next step is
    correct."""
    failures: list[str] = []
    odd = gpu_dep.rank == gpu_dep.size - 1
    tokens = 9 if (odd and mismatch == "tokens") else 8
    seed, _, latent, ids, weights = step_inputs(gpu_dep, 3, tokens)
    tag = 7 if (odd and mismatch == "tag") else 6
    expected, match = {
        "tag": (EpDesyncError, "out of step"),
        "tokens": (ValueError, "different token counts"),
    }[mismatch]

    def call():
        return routed(latent, ids, weights, layer.norm_weight().cuda(), experts=experts, tag=tag)

    # No rank rejects anything: every rank finds the mismatch, as a peer does.
    fails_fast(
        failures, f"{mismatch} mismatch", (None, expected), (None, match), routed, call, bad=False
    )
    if mismatch == "tag":
        refused = expect_raises(failures, "a call before reset()", RuntimeError, "reset", call)
        if isinstance(refused, EpDesyncError):
            failures.append(f"the call before reset() was not refused: {refused}")
        routed.reset()
    failures += good_step(gpu_dep, routed, layer, experts, 300, "next good step")
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


def combine_bitwise(gpu_dep, routed, tokens: int, scale: float, normed: bool, base: int):
    """Expert outputs drawn on every rank (times `scale`); the combine must equal the torch
    reference bit for bit: rms_norm of the rank-ordered fp32 sum, or its BF16 rounding."""
    n, rank, L = gpu_dep.size, gpu_dep.rank, TINY.latent
    seed = agreed_seed(gpu_dep.cpu_group, base)
    case = make_case(TINY, n, tokens, seed)
    gens = [torch.Generator().manual_seed(seed + d) for d in range(n)]
    outs = [(torch.randn(n * tokens, L, generator=g) * scale).to(torch.bfloat16) for g in gens]
    norm = (1 + 0.1 * torch.randn(L, generator=torch.Generator().manual_seed(seed))).bfloat16()
    dist.barrier(gpu_dep.cpu_group)
    rows = routed.dispatch(
        case.latent[rank].cuda(), case.ids[rank].cuda(), case.weights[rank].cuda()
    )
    hit = (rows.ids >= 0).any(dim=1)
    rows.out.copy_(torch.where(hit.unsqueeze(1), outs[rank].cuda(), float("nan")))
    got = routed.combine(norm.cuda() if normed else None)
    routed.synchronize()
    owners = owner_ranks(case.ids[rank], TINY.experts // n)
    total = torch.zeros(tokens, L)
    for d in range(n):
        mine = (owners == d).any(dim=1).nonzero().squeeze(1)
        total[mine] += outs[d][rank * tokens + mine].float()
    want = rms_norm(total, norm, NORM_EPS) if normed else total.to(torch.bfloat16)
    label = f"T={tokens} scale={scale:g} normed={normed} (seed {seed})"
    failures = []
    if not torch.equal(got.cpu().view(torch.int16), want.view(torch.int16)):
        differ = int((got.cpu().view(torch.int16) != want.view(torch.int16)).sum())
        failures.append(f"{label}: differs from the torch reference in {differ} elements")
    if normed and not torch.isfinite(got).all():
        failures.append(f"{label}: non-finite normed output")
    return failures, seed


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("scale,normed", [(1.0, False), (1e20, True), (1e35, True), (1.0, True)])
def test_combine_bitwise_plain_and_huge(gpu_dep, routed, scale, normed):
    failures, seed = combine_bitwise(gpu_dep, routed, 11, scale, normed, 4)
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=1)
def test_tokens_padding_idle_rank_and_expert_counts(gpu_dep, routed, layer, experts):
    """Ranks pass n_r real rows (the last rank none) with tokens = max n_r; outputs [n_r, L]
    match the reference; expert_counts() equals a bincount of every rank's ids."""
    n, rank = gpu_dep.size, gpu_dep.rank
    seed = agreed_seed(gpu_dep.cpu_group, 5)
    tokens = 12
    case = make_case(TINY, n, tokens, seed)
    real = [tokens - 3 * s for s in range(n)]
    if n > 1:
        real[-1] = 0
    r = real[rank]
    latent, ids, weights = (
        t[:r].cuda() for t in (case.latent[rank], case.ids[rank], case.weights[rank])
    )
    out = routed(
        latent, ids, weights, layer.norm_weight().cuda(), experts=experts, tokens=max(real)
    )
    counts = routed.expert_counts()
    routed.synchronize()
    failures = []
    if tuple(out.shape) != (r, TINY.latent):
        failures.append(f"output shape {tuple(out.shape)}; expected {(r, TINY.latent)}")
    padded_ids = case.ids[rank].clone()
    padded_ids[r:] = -1  # the reference takes every rank's T rows; padding rows have no expert
    ref = allgather_reference(
        gpu_dep.cpu_group,
        case.latent[rank],
        padded_ids,
        case.weights[rank],
        layer.norm_weight(),
        layer.expert,
    )[:r]
    failures += compare(out.cpu(), ref, f"real rows {real}")
    per_rank = TINY.experts // n
    all_ids = torch.cat([case.ids[s][: real[s]].flatten() for s in range(n)]).long()
    mine = all_ids[(all_ids // per_rank) == rank] - rank * per_rank
    want = torch.bincount(mine, minlength=per_rank).int()
    if not torch.equal(counts.cpu(), want):
        failures.append(f"expert_counts {counts.cpu().tolist()} != {want.tolist()}")
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_reject_step_fails_every_rank_fast(gpu_dep, routed, layer, experts):
    """A rank that cannot even dispatch (its caller failed first) takes part by reject_step."""
    failures: list[str] = []
    seed, _, latent, ids, weights = step_inputs(gpu_dep, 6)
    bad = gpu_dep.rank == 0
    error = RuntimeError("the caller failed before its dispatch")

    def call():
        if bad:
            return routed.reject_step(error, tag=9)
        return routed(latent, ids, weights, layer.norm_weight().cuda(), experts=experts, tag=9)

    fails_fast(
        failures,
        "reject_step",
        (RuntimeError, EpPeerError),
        ("before its dispatch", "rank 0 rejected its input"),
        routed,
        call,
        bad,
    )
    failures += good_step(gpu_dep, routed, layer, experts, 400, "next good step")
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


class SkippingExperts(ExpertsBackend):
    """`inner`'s rows, then the mark put back on the last row with a local id (a backend that
    skipped it); on the device, so that a CUDA graph captures it."""

    def __init__(self, inner: ExpertsBackend):
        self.first_expert, self.num_local_experts = inner.first_expert, inner.num_local_experts
        self.latent, self.device, self.inner = inner.latent, inner.device, inner

    def forward(self, x, sf, ids, weights, out):
        self.inner.forward(x, sf, ids, weights, out)
        local = (ids >= 0).any(dim=1)
        order = torch.arange(1, local.shape[0] + 1, device=ids.device)
        last = (local * order).argmax()  # 0 when no row is local: row 0 then has no local id
        # A fill with a Python scalar: no host-to-device copy, so a graph captures it.
        out[:, 0].view(torch.int16).index_fill_(0, last.unsqueeze(0), UNWRITTEN_ROW_MARK)


@pytest.mark.mpi(min_size=2)
def test_unwritten_rows_fail_every_rank_eager_and_replayed(gpu_dep, layer, experts):
    """check_expert_rows on CUDA: a step whose experts leave one row with a local id unwritten on
    the last rank fails on every rank with no host sync, eager and in a CUDA graph replay (the
    check is captured): every rank's output of it is all NaN; at synchronize() (eager) or the
    next call (replay) the last rank raises EpUnwrittenRowsError counting 1 row of N * T and
    naming the tag, the others EpPeerError; the good steps around it are bit for bit equal to
    the first (and to the all-gather reference), and a replayed good step equals the eager one."""
    failures: list[str] = []
    seed, case, latent, ids, weights = step_inputs(gpu_dep, 9)
    n, rank, tokens, tag = gpu_dep.size, gpu_dep.rank, latent.shape[0], 77
    bad = rank == n - 1
    used = SkippingExperts(experts) if bad else experts
    norm = layer.norm_weight().cuda()
    routed = build_routed(gpu_dep, EpConfig(timeout_s=TIMEOUT_S, check_expert_rows=True))

    def expect_step_error(label, call):
        if bad:
            expected = EpUnwrittenRowsError
            match = rf"tag {tag}: 1 of this rank's {n * tokens} receive row\(s\).*did not write"
        else:
            expected, match = EpPeerError, f"rank {n - 1} had failed this step before its combine"
        err = expect_raises(failures, label, expected, match, call)
        if isinstance(err, EpUnwrittenRowsError) and (err.rows, err.checked) != (1, n * tokens):
            failures.append(f"{label}: counts {err.rows}, {err.checked}")

    try:
        first = routed(latent, ids, weights, norm, experts=experts, tag=tag)
        routed.synchronize()
        ref = allgather_reference(
            gpu_dep.cpu_group,
            case.latent[rank],
            case.ids[rank],
            case.weights[rank],
            layer.norm_weight(),
            layer.expert,
        )
        failures += compare(first.cpu(), ref, "good step")

        def good_again(label):
            try:
                again = routed(latent, ids, weights, norm, experts=experts, tag=tag)
                routed.synchronize()
                if not torch.equal(again.view(torch.int16), first.view(torch.int16)):
                    failures.append(f"{label}: the good step is not bit for bit the first one")
            except Exception as err:
                failures.append(f"{label}: {type(err).__name__}: {err}")

        out = routed(latent, ids, weights, norm, experts=used, tag=tag)
        torch.cuda.synchronize()
        if not out.isnan().all():
            failures.append("eager: an output element is not NaN")
        expect_step_error("eager, synchronize()", routed.synchronize)
        good_again("after the eager step")

        routed.warmup(tokens, used)
        for label, backend in (("good", experts), ("unwritten", used)):
            dist.barrier(gpu_dep.cpu_group)
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph):
                captured = routed(latent, ids, weights, norm, experts=backend, tag=tag)
            graph.replay()
            torch.cuda.synchronize()
            if label == "good":
                routed.synchronize()
                if not torch.equal(captured.view(torch.int16), first.view(torch.int16)):
                    failures.append("a replayed good step differs from the eager one")
                continue
            if not captured.isnan().all():
                failures.append("replay: an output element is not NaN")
            expect_step_error(
                "replay, the next call",
                lambda: routed(latent, ids, weights, norm, experts=experts, tag=tag),
            )
            good_again("after the replay")
    finally:
        routed.close()
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


class ResetThenFailingKernels(ExpertsBackend):
    """Experts whose forward runs a reset() first on every rank (as a signal handler nested in
    it would), then queues what HopperExperts' finalize over its budget does after it: a kernel
    that takes 20 ms (so the host reaches its next statement first), then the failure record's
    store, naming call 1 (the new epoch's calls done 0, plus one) and the status word."""

    device_failures = True

    def __init__(self, inner: ExpertsBackend, routed: EpRouted):
        self.inner, self.routed = inner, routed
        self.first_expert, self.num_local_experts = inner.first_expert, inner.num_local_experts
        self.latent = inner.latent

    def forward(self, x, sf, ids, weights, out, *, failure=None):
        self.inner.forward(x, sf, ids, weights, out)
        self.routed.reset()
        torch.cuda._sleep(40_000_000)  # about 20 ms at 2 GHz
        stored = torch.tensor([FAILURE_PAIR_BUDGET, 96, 32, 0, 1], device="cuda")
        failure.record.copy_(stored, non_blocking=True)
        failure.status.fill_(1)


@pytest.mark.mpi(min_size=1)
def test_a_reset_inside_the_experts_drops_the_record_their_kernels_store_after_it(
    gpu_dep, layer, experts
):
    """The call a nested reset() overtook raises EpResetDuringCallError on every rank, after its
    queued kernels completed and the failure record they stored (naming call 1, the next call)
    was zeroed: the record is zero when the call returns, and the next steps match the
    reference, their synchronize() passing. Before: the record still held the abandoned call's
    EpPairBudgetError for call 1 (zeroed before the store, or never)."""
    from dep_ep.comm import EpResetDuringCallError

    failures: list[str] = []
    routed = build_routed(gpu_dep, EpConfig(timeout_s=TIMEOUT_S))
    try:
        failures += good_step(gpu_dep, routed, layer, experts, 960, "before")
        _, _, latent, ids, weights = step_inputs(gpu_dep, 961)
        norm = layer.norm_weight().cuda()
        resetting = ResetThenFailingKernels(experts, routed)
        expect_raises(
            failures,
            "the overtaken call",
            EpResetDuringCallError,
            "reset",
            lambda: routed(latent, ids, weights, norm, experts=resetting),
        )
        record = routed._transport.failure_record.tolist()
        if any(record):
            failures.append(f"the record after the abandoned call: {record}, expected zeros")
        failures += good_step(gpu_dep, routed, layer, experts, 962, "after")
    finally:
        routed.close()
    collective_assert(
        gpu_dep.cpu_group, failures, seeds={"before": 960, "overtaken": 961, "after": 962}
    )


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("who", ["every rank", "rank 0"])
@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_a_launch_queued_after_a_nested_reset_refuses_calls_until_the_next_reset(
    gpu_dep, layer, experts, phase, who
):
    """A reset() runs between a call's last check and its dispatch's (or combine's) launch, as
    a signal handler's could (nested in the launcher): the kernel then runs in the new epoch.
    That rank's call raises EpDesyncError (recovery "reset") saying its kernel was queued
    after the reset, and its next call is refused (RuntimeError) until its reset(). "every
    rank": every rank's reset is nested so (their stale launches pair with each other), then
    every rank resets. "rank 0": only rank 0's is; its peers' step raises EpDesyncError at the
    call or its synchronize() (rank 0 called reset()), they reset, meeting rank 0's nested
    reset; their next step, which pairs with rank 0's stale launch, raises EpDesyncError too
    (rank 0's second reset), and they reset again. Then two steps match the reference on every
    rank, bit-equal on a rerun. Before: the call went on as if launched in its own epoch
    (EpRouted raised EpResetDuringCallError, recovery "none"), and this rank's next dispatch
    read the same call index as the stale launch."""
    from dep_ep.comm.errors import RECOVERY_RESET

    failures: list[str] = []
    routed = build_routed(gpu_dep, EpConfig(timeout_s=TIMEOUT_S))
    transport = routed._transport
    name = f"{phase}_launch"
    launch = getattr(transport, name)
    nested = who == "every rank" or gpu_dep.rank == 0

    def reset_then_launch(*args):
        setattr(transport, name, launch)  # once
        routed.reset()
        launch(*args)

    def recovery_is_reset(err, label: str) -> None:
        if err is not None and getattr(err, "recovery", None) != RECOVERY_RESET:
            failures.append(f"{label}: recovery {getattr(err, 'recovery', None)!r}")

    try:
        failures += good_step(gpu_dep, routed, layer, experts, 970, "before")
        _, _, latent, ids, weights = step_inputs(gpu_dep, 971)
        norm = layer.norm_weight().cuda()

        def step_and_wait():
            routed(latent, ids, weights, norm, experts=experts)
            routed.synchronize()

        if nested:
            setattr(transport, name, reset_then_launch)
            err = expect_raises(
                failures,
                f"the call whose {phase} was queued after the reset",
                EpDesyncError,
                f"before its {phase} kernel was queued",
                lambda: routed(latent, ids, weights, norm, experts=experts),
            )
            recovery_is_reset(err, "the stale launch's error")
            refused, _ = timed(lambda: routed(latent, ids, weights, norm, experts=experts))
            if type(refused) is not RuntimeError or "kernel was queued" not in str(refused):
                failures.append(f"the next call: {type(refused).__name__}: {refused}")
        else:
            label = "a step during rank 0's nested reset"
            err = expect_raises(failures, label, EpDesyncError, None, step_and_wait)
            recovery_is_reset(err, label)
            routed.reset()
        # Every rank done with the nested reset before rank 0's next one: a peer still polling
        # in it would otherwise join that one too, and its next step would find no reset.
        dist.barrier(group=gpu_dep.cpu_group)
        if not nested:
            label = "a step during rank 0's second reset"
            err = expect_raises(failures, label, EpDesyncError, None, step_and_wait)
            recovery_is_reset(err, label)
        routed.reset()
        failures += good_step(gpu_dep, routed, layer, experts, 972, "after")
        failures += good_step(gpu_dep, routed, layer, experts, 974, "after, again")
    finally:
        routed.close()
    collective_assert(
        gpu_dep.cpu_group,
        failures,
        seeds={"before": 970, "the call": 971, "after": 972, "after, again": 974},
    )
