"""The calls a server needs (CPU ranks, 2-4 under mpiexec): combine into the caller's buffer,
latents that are a column slice of a wider GEMM output, steps above max_tokens run in pieces
(equal to one large step), the non-collective warm-up, expert counts into a recorder buffer,
the torch.library operator under torch.compile, the SiTU check, and the engine-free integration
helpers (dep_ep.integrations.common)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dep_ep.comm.errors import EpDesyncError, EpPeerError, EpTokenCountError
from dep_ep.comm.tags import first_piece
from dep_ep.config import TINY, EpConfig
from dep_ep.constants import NO_TAG
from dep_ep.ep import EpRouted, register_routed, routed_op
from dep_ep.ep.custom_op import unregister_routed
from dep_ep.experts import ExpertsBackend
from dep_ep.integrations import common
from dep_ep.testing import SyntheticLayer
from dep_ep.testing.compare import compare

from helpers.cases import agreed_seed, make_case, real_tokens
from helpers.collective import collective_assert, expect_raises
from helpers.recovery import Batches
from helpers.reference_check import RowByRowExperts


def build(dep, max_tokens: int = 16, **config) -> EpRouted:
    return EpRouted(
        dep.cpu_group,
        max_tokens,
        "cpu",
        num_experts=TINY.experts,
        latent=TINY.latent,
        topk=TINY.topk,
        config=EpConfig(timeout_s=10.0, **config),
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.fixture
def layer(dep):
    return SyntheticLayer(TINY, agreed_seed(dep.cpu_group, 600))


@pytest.mark.mpi(min_size=2)
def test_combine_into_the_callers_buffer(dep, layer):
    """routed(..., out=) returns `out` holding the bits routed() returns, with n = T (written in
    place) and n < T (copied); a misshapen `out` on one rank is a ValueError there and
    EpPeerError on the others, and so are an out that is no tensor (a list), a leaf out that
    requires grad and an inference tensor outside inference mode (routed and combine); the next
    call is good. The experts run row by row: the n < T call
    hands them fewer rows, and a GEMM over another row count may sum in another order."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 610), 8)
    norm, experts = layer.norm_weight(), RowByRowExperts(batches.experts)
    failures: list[str] = []
    with build(dep) as routed:
        latent, ids, weights = batches.inputs(0)
        want = routed(latent, ids, weights, norm, experts=experts)
        for n, tokens in ((8, None), (5, 8)):
            buf = torch.full((n, TINY.latent), float("nan"), dtype=torch.bfloat16)
            got = routed(
                latent[:n], ids[:n], weights[:n], norm, experts=experts, tokens=tokens, out=buf
            )
            if got is not buf or not torch.equal(bits(buf), bits(want[:n])):
                failures.append(f"out= with n={n}, T={tokens}: not routed()'s bits in place")
        bad = dep.rank == 0
        buf = torch.empty(7 if bad else 8, TINY.latent, dtype=torch.bfloat16)
        expected, match = (ValueError, "out shape") if bad else (EpPeerError, None)
        expect_raises(
            failures,
            "misshapen out",
            expected,
            match,
            lambda: routed(latent, ids, weights, norm, experts=experts, out=buf),
        )
        # An out that is no tensor on one rank: its TypeError there, the peers' EpPeerError.
        good = torch.empty(8, TINY.latent, dtype=torch.bfloat16)
        expected = TypeError if bad else EpPeerError
        expect_raises(
            failures,
            "out a list",
            expected,
            None,
            lambda: routed(latent, ids, weights, norm, experts=experts, out=[] if bad else good),
        )
        # An out torch refuses to write on one rank, in place (n = T): a leaf requiring grad,
        # an inference tensor outside inference mode (before: the copy failed inside the
        # transport after the exchange, on that rank alone, whose next call then waited out
        # timeout_s on its peers; found by a careless-user probe).
        with torch.inference_mode():
            inference = torch.empty(8, TINY.latent, dtype=torch.bfloat16)
        needs_grad = torch.empty(8, TINY.latent, dtype=torch.bfloat16, requires_grad=True)
        for label, unwritable in (("requires grad", needs_grad), ("inference tensor", inference)):
            for call in ("routed", "combine"):
                expected, match = (ValueError, label) if bad else (EpPeerError, None)
                out = unwritable if bad else good

                def run(out=out, call=call):
                    if call == "routed":
                        return routed(latent, ids, weights, norm, experts=experts, out=out)
                    rows = routed.dispatch(latent, ids, weights)
                    experts.forward(rows.x, rows.sf, rows.ids, rows.weights, rows.out)
                    return routed.combine(norm, out=out)

                expect_raises(failures, f"out {label} ({call})", expected, match, run)
        failures += compare(batches.run(routed, 1), batches.reference(1), "the next call")
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("total", [6, 40])
def test_a_norm_weight_inside_out(dep, layer, total):
    """A norm weight that is a row of `out` (its first or its last) gives the bits of a separate
    norm weight, in one step (T = 6) and in pieces (T = 40 over max_tokens 16): no piece and no
    combine reads a norm weight that an output row has overwritten. The transport's combine is
    handed such an `out` to write in place never (the GPU kernel's CTAs read the norm weight as
    others write rows; the CPU transport writes after its reads, so the bits alone cannot show
    it), and a full contiguous `out` apart from the norm weight always."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 665), total)
    norm, experts = layer.norm_weight(), batches.experts
    failures: list[str] = []
    with build(dep) as routed:
        handed: list[torch.Tensor | None] = []
        combine = routed._transport.combine

        def spy(*args, **kwargs):
            handed.append(kwargs.get("out"))
            return combine(*args, **kwargs)

        routed._transport.combine = spy
        latent, ids, weights = batches.inputs(0)
        n = latent.shape[0]
        want = routed(latent, ids, weights, norm, experts=experts, tokens=total)
        for row in sorted({0, max(n - 1, 0)}):
            buf = torch.full((max(n, 1), TINY.latent), float("nan"), dtype=torch.bfloat16)
            buf[row] = norm
            handed.clear()
            got = routed(latent, ids, weights, buf[row], experts=experts, tokens=total, out=buf[:n])
            if not torch.equal(bits(got), bits(want)):
                failures.append(f"T={total}, norm weight in out row {row}: other bits")
            if any(out is not None and out.data_ptr() == buf.data_ptr() for out in handed):
                failures.append(f"T={total}: out holding the norm weight was written in place")
        if n == total <= routed.max_tokens:  # one step, a full out apart from the norm: in place
            apart = torch.empty(n, TINY.latent, dtype=torch.bfloat16)
            handed.clear()
            routed(latent, ids, weights, norm, experts=experts, tokens=total, out=apart)
            if [out is apart for out in handed] != [True]:
                failures.append(f"T={total}: a separate out was not written in place")
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


class BlockingExperts(ExpertsBackend):
    """The inner experts, once `entered` is set and `release` is set (within 30 s, else
    RuntimeError): holds a call inside its experts while the test acts from another thread."""

    def __init__(self, inner: ExpertsBackend):
        self.inner = inner
        self.first_expert, self.num_local_experts = inner.first_expert, inner.num_local_experts
        self.latent = inner.latent
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, x, sf, ids, weights, out):
        self.entered.set()
        if not self.release.wait(30):
            raise RuntimeError("BlockingExperts: not released within 30 s")
        return self.inner.forward(x, sf, ids, weights, out)


@pytest.mark.mpi(min_size=2)
def test_a_call_from_a_second_thread_is_refused(dep, layer):
    """While a thread is inside routed (its experts held), routed, combine, reset and close from
    another thread raise RuntimeError naming both threads, on every rank, and change nothing
    (poll, local, is not refused): the held call returns the reference's rows and the next call
    is good; a thread whose experts raise leaves the object free for the next caller."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 670), 6)
    norm, experts = layer.norm_weight(), batches.experts
    held = BlockingExperts(experts)
    failures: list[str] = []
    with build(dep) as routed:
        latent, ids, weights = batches.inputs(0)
        result: dict[str, object] = {}

        def first() -> None:
            try:
                result["out"] = routed(latent, ids, weights, norm, experts=held)
            except BaseException as err:  # reported below, on this rank
                result["error"] = err

        thread = threading.Thread(target=first, name="first-caller")
        thread.start()
        if held.entered.wait(30):
            for label, call in (
                ("routed", lambda: routed(latent, ids, weights, norm, experts=experts)),
                ("combine", lambda: routed.combine(norm)),
                ("reset", routed.reset),
                ("close", routed.close),
            ):
                expect_raises(
                    failures,
                    f"{label} from a second thread",
                    RuntimeError,
                    "'MainThread' called while thread 'first-caller' is in EpRouted.routed",
                    call,
                )
            try:
                routed.poll()
            except Exception as err:
                failures.append(f"poll from a second thread: {type(err).__name__}: {err}")
        else:
            failures.append("the first thread's call never reached its experts")
        held.release.set()
        thread.join(60)
        if thread.is_alive() or "out" not in result:
            failures.append(f"the held call did not return: {result.get('error')!r}")
        else:
            failures += compare(result["out"], batches.reference(0), "the held call")
        failures += compare(batches.run(routed, 1), batches.reference(1), "the next call")
        # A thread whose experts raise (every rank's): its error, then the main thread's call.
        failing = BlockingExperts(experts)
        failing.release.set()
        failing.forward = lambda *rows: (_ for _ in ()).throw(KeyboardInterrupt("in the experts"))
        raised: list[BaseException] = []

        def second() -> None:
            try:
                routed(latent, ids, weights, norm, experts=failing)
            except BaseException as err:
                raised.append(err)

        thread = threading.Thread(target=second, name="failing-caller")
        thread.start()
        thread.join(60)
        if not (raised and isinstance(raised[0], (KeyboardInterrupt, EpPeerError))):
            failures.append(f"the failing thread's call gave {raised!r}")
        failures += compare(batches.run(routed, 2), batches.reference(2), "after the failed thread")
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


@pytest.mark.mpi(min_size=2)
def test_latent_as_a_column_slice(dep, layer):
    """A latent that is columns [S, S + L) of a wider tensor (a packed GEMM's output, rows of
    S + L + 16 elements) gives the bits of its contiguous copy; a slice whose rows do not start
    on 16-byte boundaries is refused naming the stride, on every rank."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 620), 7)
    norm, experts = layer.norm_weight(), batches.experts
    failures: list[str] = []
    latent, ids, weights = batches.inputs(0)
    S, L = 40, TINY.latent
    wide = torch.randn(latent.shape[0], S + L + 16).to(torch.bfloat16)
    wide[:, S : S + L] = latent
    with build(dep) as routed:
        want = routed(latent, ids, weights, norm, experts=experts)
        got = routed(wide[:, S : S + L], ids, weights, norm, experts=experts)
        if not torch.equal(bits(got), bits(want)):
            failures.append("the column slice gives other bits than its copy")
        odd = torch.zeros(latent.shape[0], L + 3, dtype=torch.bfloat16)[:, :L]
        expect_raises(
            failures,
            "rows 6 bytes apart from alignment",
            ValueError,
            "row stride",
            lambda: routed(odd, ids, weights, norm, experts=experts),
        )
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("total", [11, 16])
def test_a_step_above_max_tokens_runs_in_pieces(dep, layer, total):
    """tokens=T above max_tokens = 4 (ranks with unequal real rows, the last one none at 3+
    ranks): with experts computed row by row the result equals one step of T on an EpRouted of
    max_tokens 16 bit for bit (the pieces change nothing but which rows share a call), and with
    ReferenceExperts the reference within tolerance; ranks whose T differ (T and T + 1) raise
    EpTokenCountError (a ValueError) on every rank naming both T, and the next call is good."""
    seed = agreed_seed(dep.cpu_group, 630)
    case = make_case(TINY, dep.size, total, seed, "ragged")
    r = dep.rank
    n = real_tokens(total, dep.size)[r]
    latent, ids, weights = case.latent[r][:n], case.ids[r][:n], case.weights[r][:n]
    experts = Batches(dep, layer, seed, total).experts
    row_by_row = RowByRowExperts(experts)
    norm = layer.norm_weight()
    failures: list[str] = []
    with build(dep, 16) as large:
        want = large(latent, ids, weights, norm, experts=row_by_row, tokens=total)
    with build(dep, 4) as small:
        got = small(latent, ids, weights, norm, experts=row_by_row, tokens=total)
        if tuple(got.shape) != (n, TINY.latent):
            failures.append(f"pieces: shape {tuple(got.shape)}")
        elif not torch.equal(bits(got), bits(want)):
            failures.append("pieces: other bits than one large step")
        pieces = small(latent, ids, weights, norm, experts=experts, tokens=total)
        failures += compare(pieces, Batches.reference_of(layer, latent, ids, weights), "pieces")
        other = total + (1 if r == dep.size - 1 else 0)
        expect_raises(
            failures,
            "T differs",
            EpTokenCountError,
            f"token counts.*T={total}\\b.*T={total + 1}\\b",
            lambda: small(latent, ids, weights, norm, experts=experts, tokens=other),
        )
        # The split API stays bounded: a dispatch of T above max_tokens is the caller's mistake.
        bad = r == 0
        expected, match = (ValueError, "outside 1..4") if bad else (EpPeerError, None)
        expect_raises(
            failures,
            "dispatch above max_tokens",
            expected,
            match,
            lambda: small.dispatch(latent, ids, weights, tokens=total if bad else 4)
            if bad or n <= 4
            else small.dispatch(latent[:4], ids[:4], weights[:4], tokens=4),
        )
        again = small(latent, ids, weights, norm, experts=row_by_row, tokens=total)
        if not torch.equal(bits(again), bits(want)):
            failures.append("pieces after the desync: other bits")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_a_step_in_pieces_into_a_buffer_sharing_the_latents_memory(dep, layer):
    """A step of T = 20 in pieces of 8 whose `out` shares memory with the latent: rows [1, 21)
    and [0, 20) of one buffer (out one row ahead: before, each piece's output overwrote the first
    latent row of the next piece before it was read, on every rank, silently), one row behind,
    and the latent itself: every one the bits of the same step into a fresh tensor."""
    seed = agreed_seed(dep.cpu_group, 640)
    total = 20
    batches = Batches(dep, layer, seed, total)
    latent, ids, weights = batches.inputs(0)
    experts = batches.experts
    norm = layer.norm_weight()
    failures: list[str] = []
    with build(dep, 8) as routed:
        want = routed(latent, ids, weights, norm, experts=experts, tokens=total).clone()
        for label, lat_rows, out_rows in (
            ("out one row ahead", slice(0, total), slice(1, total + 1)),
            ("out one row behind", slice(1, total + 1), slice(0, total)),
            ("out is the latent", slice(0, total), slice(0, total)),
        ):
            store = torch.empty(total + 1, TINY.latent, dtype=torch.bfloat16)
            store[lat_rows] = latent
            got = routed(
                store[lat_rows],
                ids,
                weights,
                norm,
                experts=experts,
                tokens=total,
                out=store[out_rows],
            )
            if got.data_ptr() != store[out_rows].data_ptr():
                failures.append(f"{label}: the result is not the caller's buffer")
            if not torch.equal(bits(store[out_rows]), bits(want)):
                failures.append(f"{label}: other bits than the step into a fresh tensor")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_a_step_in_pieces_refuses_bad_arguments_on_every_rank(dep, layer):
    """Above max_tokens the whole call's arguments are checked before they are cut, on the bad
    rank (its error) and in the same call on the others (EpPeerError), within a second: a latent
    of more rows than T (before: rows past T came back uninitialised), ids of more rows than the
    latent (before: the extra rows were dropped), ids that are not a tensor (before: a TypeError
    on that rank alone while the others waited out the timeout), a misshapen out= (named as
    such); reject_step(tokens=T) on one rank against routed(tokens=T) on the others; the next
    call gives the bits of a good call."""
    seed = agreed_seed(dep.cpu_group, 660)
    total, r = 10, dep.rank
    batches = Batches(dep, layer, seed, total)
    latent, ids, weights = batches.inputs(0)
    experts = RowByRowExperts(batches.experts)
    norm = layer.norm_weight()
    failures: list[str] = []
    bad = r == dep.size - 1
    wide = torch.cat([latent, latent[:2]])
    wrong_out = torch.empty(total - 1, TINY.latent, dtype=torch.bfloat16)
    cases = [
        ("rows past T", dict(latent=wide), ValueError, "12 rows, more than tokens=10"),
        ("ids rows", dict(ids=torch.cat([ids, ids[:2]])), ValueError, "ids shape"),
        ("ids None", dict(ids=None), (TypeError, ValueError), "ids"),
        ("misshapen out", dict(out=wrong_out), ValueError, "out shape"),
    ]
    with build(dep, 4) as routed:
        want = routed(latent, ids, weights, norm, experts=experts, tokens=total)
        for label, change, error, match in cases:
            args = dict(latent=latent, ids=ids, weights=weights, out=None)
            if bad:
                args.update(change)
            expected, text = (error, match) if bad else (EpPeerError, f"rank {dep.size - 1}")
            start = time.monotonic()
            expect_raises(
                failures,
                label,
                expected,
                text,
                lambda: routed(
                    args["latent"],
                    args["ids"],
                    args["weights"],
                    norm,
                    experts=experts,
                    tokens=total,
                    out=args["out"],
                ),
            )
            if time.monotonic() - start > 1.0:
                failures.append(f"{label}: took {time.monotonic() - start:.1f} s")
        if bad:
            expect_raises(
                failures,
                "reject_step in pieces",
                KeyError,
                None,
                lambda: routed.reject_step(KeyError("caller"), tokens=total),
            )
        else:
            expect_raises(
                failures,
                "a peer's reject_step in pieces",
                EpPeerError,
                "called reject_step",
                lambda: routed(latent, ids, weights, norm, experts=experts, tokens=total),
            )
        again = routed(latent, ids, weights, norm, experts=experts, tokens=total)
        if not torch.equal(bits(again), bits(want)):
            failures.append("the call after the refusals: other bits")
    collective_assert(dep.cpu_group, failures, seeds=seed)


class CountingExperts(ExpertsBackend):
    """Another backend's rows, counting its calls."""

    def __init__(self, inner: ExpertsBackend):
        self.inner, self.calls = inner, 0
        self.first_expert, self.num_local_experts = inner.first_expert, inner.num_local_experts
        self.latent = inner.latent

    def forward(self, x, sf, ids, weights, out):
        self.calls += 1
        return self.inner.forward(x, sf, ids, weights, out)


@pytest.mark.mpi(min_size=2)
def test_a_step_in_pieces_names_the_ranks_T_and_its_piece(dep, layer, monkeypatch):
    """max_tokens 4. Ranks passing different T to a step run in pieces (10 and 9: the same piece
    count; 12 and 5; 17 and 4: one rank in pieces, the other one step) raise EpTokenCountError
    on every rank in the first piece (no experts ran), naming every rank's T, and the next call
    is good. Tags that differ in a step in pieces: EpDesyncError saying "in piece 1 of 3 of a
    step of T=10". tokens=2**70 (or 2**31) on one rank: ValueError naming 2^31 there,
    EpPeerError on the others, and on every rank: ValueError everywhere, each within 1 s.
    reject_step(tokens=torch.tensor(10)) rejects the peers' pieces: its first piece carries
    T = 10 in its tag, as the peers' does.
    Before: 10 against 9 ran the pieces and raised in the last one, "different token counts
    [2, 1]" (piece sizes the caller never passed), with the experts run twice; 12 against 5
    named hashed tags; tokens=2**70 gave a desync of hashed tags, and on every rank would have
    run ~3e20 pieces; reject_step(tokens=torch.tensor(10)) ran one step with no piece tag."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 675), 10)
    latent, ids, weights = batches.inputs(0)
    counting = CountingExperts(batches.experts)
    norm = layer.norm_weight()
    r, last = dep.rank, dep.size - 1
    failures: list[str] = []

    def call(routed, tokens, tag=None):
        n = min(tokens, latent.shape[0])
        return routed(
            latent[:n], ids[:n], weights[:n], norm, experts=counting, tokens=tokens, tag=tag
        )

    with build(dep, 4) as small:
        for mine, theirs in ((10, 9), (12, 5), (17, 4)):
            counting.calls = 0
            tokens = theirs if r == last else mine
            match = f"token counts.*T={mine}\\b.*T={theirs}\\b"
            expect_raises(
                failures,
                f"T {mine} / {theirs}",
                EpTokenCountError,
                match,
                lambda: call(small, tokens),
            )
            if counting.calls:
                failures.append(f"T {mine} / {theirs}: the experts ran {counting.calls} time(s)")
            failures += compare(call(small, 10), batches.reference(0), f"after T {mine} / {theirs}")
        expect_raises(
            failures,
            "tags differ in pieces",
            EpDesyncError,
            "in piece 1 of 3 of a step of T=10, max_tokens 4",
            lambda: call(small, 10, tag=6 if r == last else 5),
        )
        small.reset()  # what the desync says
        for huge in (2**70, 2**31):
            bad = r == 0
            expected, match = (ValueError, "2\\^31") if bad else (EpPeerError, "rank 0")
            for label, tokens, error, text in (
                (f"tokens={huge} on rank 0", huge if bad else 10, expected, match),
                (f"tokens={huge} everywhere", huge, ValueError, "2\\^31"),
            ):
                start = time.monotonic()
                expect_raises(failures, label, error, text, lambda: call(small, tokens))
                if time.monotonic() - start > 1.0:
                    failures.append(f"{label}: the error took {time.monotonic() - start:.2f} s")
        seen = []
        if r == 0:
            reject_piece = EpRouted._reject_piece

            def recording(self, fn, error, cause, tag, checked):
                seen.append(tag)
                return reject_piece(self, fn, error, cause, tag, checked)

            monkeypatch.setattr(EpRouted, "_reject_piece", recording)
            expect_raises(
                failures,
                "reject_step(tokens=tensor(10))",
                RuntimeError,
                "no input",
                lambda: small.reject_step(RuntimeError("no input"), tokens=torch.tensor(10)),
            )
            monkeypatch.undo()
            piece = first_piece(seen[0]) if seen and seen[0] is not None else None
            if piece is None or piece[0] != 10:
                failures.append(f"reject_step's first piece carried tag {seen[:1]}; expected T=10")
        else:
            expect_raises(
                failures, "a peer's reject_step", EpPeerError, "rank 0", lambda: call(small, 10)
            )
        failures += compare(call(small, 10), batches.reference(0), "the last call")
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


@pytest.mark.mpi(min_size=2)
def test_pieces_keep_tags_apart_and_count_every_piece(dep, layer):
    """In a step run in pieces, tag 0 on one rank and no tag on the others raise EpDesyncError on
    every rank (before: their pieces' tags were equal and the step returned rows of mixed
    layers), as do tags t and t + 2^62 (2^62 apart: the old hash also paired t and t + 2^63,
    which are not both valid tags); expert_counts() after the step is the sum over its pieces,
    equal to one step of T on a larger EpRouted (before: the last piece's)."""
    seed = agreed_seed(dep.cpu_group, 665)
    total, r = 10, dep.rank
    batches = Batches(dep, layer, seed, total)
    latent, ids, weights = batches.inputs(0)
    experts = batches.experts
    norm = layer.norm_weight()
    failures: list[str] = []
    with build(dep, 16, count_experts=True) as large:
        large(latent, ids, weights, norm, experts=experts, tokens=total)
        want = large.expert_counts().clone()
    with build(dep, 4, count_experts=True) as small:
        for label, mine, theirs in (("0 / none", 0, None), ("t / t + 2^62", 5, 5 + 2**62)):
            tag = mine if r == 0 else theirs
            expect_raises(
                failures,
                f"tags {label}",
                EpDesyncError,
                "out of step",
                lambda: small(latent, ids, weights, norm, experts=experts, tokens=total, tag=tag),
            )
            small.reset()  # what the desync says
        small(latent, ids, weights, norm, experts=experts, tokens=total)
        got = small.expert_counts()
        if not torch.equal(got, want):
            failures.append(f"counts over the pieces {got.tolist()} != one step's {want.tolist()}")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_a_step_in_pieces_keeps_off_its_own_buffers(dep, layer):
    """A step of T = 4 N over max_tokens 4 (pieces) whose `out` lies in the object's own receive
    rows (receive(4).out): the bits of the same step into a fresh tensor (the result is taken
    by one copy at the end). Its latent copied into those rows on rank 0: ValueError there
    naming the latent, EpPeerError on the others, in that call; the next step is good.
    Before (a careless-user probe): both returned rows without an error on every rank,
    relative L2 0.7-1.0 (each piece's experts rewrote the rows a later piece read or the
    result an earlier piece wrote)."""
    seed = agreed_seed(dep.cpu_group, 667)
    total = 4 * dep.size  # the receive rows of max_tokens 4 hold a rank's n <= T rows
    batches = Batches(dep, layer, seed, total)
    latent, ids, weights = batches.inputs(0)
    experts, norm = batches.experts, layer.norm_weight()
    n = latent.shape[0]
    failures: list[str] = []
    with build(dep, 4) as small:
        want = small(latent, ids, weights, norm, experts=experts, tokens=total)
        rows = small.receive(4).out[:n]
        got = small(latent, ids, weights, norm, experts=experts, tokens=total, out=rows)
        if not torch.equal(bits(got), bits(want)):
            failures.append("out in the receive rows: other bits")
        mine = latent
        if dep.rank == 0:
            mine = rows
            mine.copy_(latent)
        expected, match = (ValueError, "latent lies in") if dep.rank == 0 else (EpPeerError, None)
        expect_raises(
            failures,
            "latent in the receive rows",
            expected,
            match,
            lambda: small(mine, ids, weights, norm, experts=experts, tokens=total),
        )
        got = small(latent, ids, weights, norm, experts=experts, tokens=total)
        if not torch.equal(bits(got), bits(want)):
            failures.append("the step after: other bits")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_a_single_step_keeps_off_its_own_buffers(dep, layer):
    """A step of T <= max_tokens whose `out` lies in the object's own receive().out rows gets
    the bits of the same step into a fresh tensor, the transport given no `out` (the peers read
    those rows until the combine completes; the rows are copied after). An `out` in the other
    receive rows (x) on rank 0, one step or in pieces, and an input in the receive rows on rank
    0 (the latent, ids, weights, padding mask through routed, the norm weight through combine;
    each copied there): ValueError there naming it, EpPeerError on the others, in that call;
    the next step is good. Before (careless-user probes): the ids or weights in the receive rows
    returned rows on every rank without an error, relative L2 0.55-1.3 on the ranks whose peers'
    dispatch rewrote them first; an out in the x rows returned good rows, and the next call's
    rows were NaN or off by relative L2 up to 1.4 on some ranks (its copy landed after a peer's
    next dispatch had written there); an out in receive().out was written in place (on CPU the
    host transport copied it after its last barrier, so only the GPU raced)."""
    seed = agreed_seed(dep.cpu_group, 668)
    batches = Batches(dep, layer, seed, 8)
    latent, ids, weights = batches.inputs(0)
    experts, norm = batches.experts, layer.norm_weight()
    n = latent.shape[0]
    failures: list[str] = []
    with build(dep, 8) as routed:
        want = routed(latent, ids, weights, norm, experts=experts)
        # The combine must not write receive().out in place (the peers read it until the combine
        # completes): the transport is asked for its own rows, copied after.
        transport_combine, given = routed._transport.combine, []

        def combine(*args, **kwargs):
            given.append(kwargs.get("out"))
            return transport_combine(*args, **kwargs)

        routed._transport.combine = combine
        try:
            got = routed(latent, ids, weights, norm, experts=experts, out=routed.receive(8).out[:n])
        finally:
            routed._transport.combine = transport_combine
        if not torch.equal(bits(got), bits(want)):
            failures.append("out in the receive rows: other bits")
        if given != [None]:
            failures.append(f"out in the receive rows: the combine was given {given}")
        rows = routed.receive(8)
        # An out in the x rows (bf16 over their bytes) on rank 0, one step and in pieces: the
        # peers' next dispatch writes there as soon as the combine completes.
        in_x = rows.x.reshape(-1)[: n * routed.latent * 2].view(torch.bfloat16).view(n, -1)
        for tokens in (None, 2 * 8):
            out = in_x if dep.rank == 0 else torch.empty_like(want)
            expected = (ValueError, "out lies in") if dep.rank == 0 else (EpPeerError, None)
            expect_raises(
                failures,
                f"out in the x rows, tokens={tokens}",
                *expected,
                lambda out=out, tokens=tokens: routed(
                    latent, ids, weights, norm, experts=experts, tokens=tokens, out=out
                ),
            )
            got = routed(latent, ids, weights, norm, experts=experts)
            if not torch.equal(bits(got), bits(want)):
                failures.append(f"the step after out in the x rows (tokens={tokens}): other bits")
        mask = torch.zeros(n, dtype=torch.bool)
        placed = {
            "latent": (rows.out[:n], latent),
            "ids": (rows.ids[:n], ids.int()),
            "weights": (rows.weights[:n], weights),
            "padding": (rows.x.reshape(-1)[:n].view(torch.bool), mask),
            "norm_weight": (rows.out[0], norm),
        }
        for name, (there, value) in placed.items():
            args = {"latent": latent, "ids": ids, "weights": weights, "norm_weight": norm}
            if name == "padding":
                args["padding"] = mask
            if dep.rank == 0:
                there.copy_(value)
                args[name] = there
            expected = (ValueError, f"{name} lies in") if dep.rank == 0 else (EpPeerError, None)
            if name == "norm_weight":

                def call(args=args):
                    routed.dispatch(args["latent"], args["ids"], args["weights"])
                    rows = routed.receive()
                    experts.forward(rows.x, rows.sf, rows.ids, rows.weights, rows.out)
                    return routed.combine(args["norm_weight"])
            else:

                def call(args=args):
                    padding = args.pop("padding", None)
                    return routed(*args.values(), experts=experts, padding=padding)

            expect_raises(failures, f"{name} in the receive rows", *expected, call)
            got = routed(latent, ids, weights, norm, experts=experts)
            if not torch.equal(bits(got), bits(want)):
                failures.append(f"the step after {name} in the receive rows: other bits")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_padding_mask_sends_its_rows_to_no_expert(dep, layer):
    """padding= (bool [m >= n], rows mid-batch, different on every rank) gives the bits of the
    same call with those rows' ids -1, whatever the padding rows' ids and weights hold (valid
    ids, NaN weights: never read, not even by the value checks), through routed, dispatch
    + combine, the custom op, EpMoeLayer-style calls with n < T, and a step in pieces; a
    malformed mask on one rank (int dtype, too short, 2-D, on another device, not a tensor) is
    that rank's error and EpPeerError on the others, and the next call is good."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 660), 8)
    norm, experts = layer.norm_weight(), batches.experts
    gen = torch.Generator().manual_seed(batches.seed + 17 * dep.rank)
    failures: list[str] = []
    with build(dep) as routed:
        latent, ids, weights = batches.inputs(0)
        mask = torch.rand(12, generator=gen) < 0.4  # longer than n, as an engine's buffer is
        mask[3] = True  # at least one padding row mid-batch on every rank
        clean = torch.where(mask[:8, None], -1, ids)
        want = routed(latent, clean, weights, norm, experts=experts)
        # Padding rows hold other rows' (valid) ids and NaN weights: read, they would change the
        # output (ids past the experts would not: those select no rank anyway).
        dirty_ids = torch.where(mask[:8, None], ids.flip(0), ids)
        dirty_weights = torch.where(mask[:8, None], float("nan"), weights)
        got = routed(latent, dirty_ids, dirty_weights, norm, experts=experts, padding=mask)
        if not torch.equal(bits(got), bits(want)):
            failures.append("routed(padding=): other bits than the ids set to -1")
        rows = routed.dispatch(latent, dirty_ids, dirty_weights, padding=mask)
        experts.forward(rows.x, rows.sf, rows.ids, rows.weights, rows.out)
        got = routed.combine(norm)
        if not torch.equal(bits(got), bits(want)):
            failures.append("dispatch(padding=) + combine: other bits")
        handle = register_routed(routed, experts)
        got = routed_op(latent, dirty_ids, dirty_weights, norm, handle, padding=mask)
        if not torch.equal(bits(got), bits(want)):
            failures.append("routed_op(padding=): other bits")
        # n = 5 < T = 8: rows 5..7 are padding by count, rows the mask marks among 0..4 by mask.
        want5 = routed(latent[:5], clean[:5], weights[:5], norm, experts=experts, tokens=8)
        got5 = routed(
            latent[:5],
            dirty_ids[:5],
            dirty_weights[:5],
            norm,
            experts=experts,
            tokens=8,
            padding=mask,
        )
        if not torch.equal(bits(got5), bits(want5)):
            failures.append("padding= with n < T: other bits")
        bad = dep.rank == 0
        cases = (
            ("int mask", mask.int(), TypeError, "padding dtype"),
            ("short mask", mask[:7], ValueError, "padding shape"),
            ("2-D mask", mask[:8, None], ValueError, "padding shape"),
            ("meta mask", mask.to("meta"), ValueError, "padding on meta"),
            ("list mask", mask.tolist(), TypeError, "padding is list"),
        )
        for label, malformed, error, match in cases:
            expected, text = (error, match) if bad else (EpPeerError, "rank 0")
            given = malformed if bad else mask
            expect_raises(
                failures,
                label,
                expected,
                text,
                lambda: routed(latent, ids, weights, norm, experts=experts, padding=given),
            )
        expected, text = (TypeError, "padding is list") if bad else (EpPeerError, "rank 0")
        expect_raises(
            failures,
            "op: list mask",
            expected,
            text,
            lambda: routed_op(
                latent, ids, weights, norm, handle, padding=mask.tolist() if bad else mask
            ),
        )
        got = routed(latent, dirty_ids, dirty_weights, norm, experts=experts, padding=mask)
        if not torch.equal(bits(got), bits(want)):
            failures.append("the call after the refusals: other bits")
    with build(dep, 3) as small:  # T = 8 in 3 pieces, the mask cut along them
        got = small(latent, dirty_ids, dirty_weights, norm, experts=experts, padding=mask)
        failures += compare(
            got, Batches.reference_of(layer, latent, clean, weights), "pieces with padding="
        )
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check_values", [False, True])
def test_padding_mask_with_int64_ids(dep, layer, check_values):
    """int64 ids (SGLang's and vLLM's top-k may hand them so) with padding= give the bits of the
    int32 ids with the padding rows -1, the padding rows holding ids past int32 (2**32 + 3
    would wrap to expert 3); on a rank with padding= where its peers pass none (an idle SGLang
    rank gets no mask), through routed, dispatch and a step in pieces. Before: the staging's
    torch.where wrote int64 into the int32 staged ids and raised RuntimeError on the ranks with
    a mask alone, before the exchange: their peers' calls then paired with their next ones."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 665), 8)
    norm, experts = layer.norm_weight(), batches.experts
    failures: list[str] = []
    latent, ids, weights = batches.inputs(0)
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[1, 4 + dep.rank]] = True
    clean = torch.where(mask[:8, None], -1, ids)
    wide = torch.where(mask[:8, None], 2**32 + 3, ids.long())
    with build(dep, check_values=check_values) as routed:
        want = routed(latent, clean, weights, norm, experts=experts)
        got = routed(latent, wide, weights, norm, experts=experts, padding=mask)
        if not torch.equal(bits(got), bits(want)):
            failures.append("routed(int64 ids, padding=): other bits than the ids set to -1")
        rows = routed.dispatch(latent, wide, weights, padding=mask)
        experts.forward(rows.x, rows.sf, rows.ids, rows.weights, rows.out)
        if not torch.equal(bits(routed.combine(norm)), bits(want)):
            failures.append("dispatch(int64 ids, padding=) + combine: other bits")
        # Only rank 0 passes a mask (the others their clean ids): the step is the same one.
        given = (wide, mask) if dep.rank == 0 else (clean, None)
        got = routed(latent, given[0], weights, norm, experts=experts, padding=given[1])
        if not torch.equal(bits(got), bits(want)):
            failures.append("padding= on rank 0 alone: other bits")
        if not torch.equal(bits(routed(latent, clean, weights, norm, experts=experts)), bits(want)):
            failures.append("the next call: other bits")
    with build(dep, 3, check_values=check_values) as small:  # T = 8 in 3 pieces
        got = small(latent, wide, weights, norm, experts=experts, padding=mask)
        failures += compare(
            got, Batches.reference_of(layer, latent, clean, weights), "pieces, int64 ids"
        )
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


@pytest.mark.mpi(min_size=2)
def test_custom_op_refuses_bad_tokens_on_every_rank(dep, layer):
    """routed_op with tokens=0 or tokens=6.0, or an eps EpRouted.routed refuses (True, "0.5",
    None, 0.0, 2**1024), on one rank: that rank raises (ValueError, TypeError) naming routed_op
    and the argument, the others EpPeerError, in the same call; an unknown handle is a
    ValueError on its rank before any exchange; the next call is good."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 670), 6)
    norm = layer.norm_weight()
    failures: list[str] = []
    with build(dep) as routed:
        handle = register_routed(routed, batches.experts)
        latent, ids, weights = batches.inputs(0)
        want = routed(latent, ids, weights, norm, experts=batches.experts)
        bad = dep.rank == 0
        for tokens, error, match in ((0, ValueError, "tokens=0"), (6.0, TypeError, "tokens")):
            expected, text = (error, match) if bad else (EpPeerError, "rank 0")
            expect_raises(
                failures,
                f"tokens={tokens!r}",
                expected,
                text,
                lambda: routed_op(latent, ids, weights, norm, handle, tokens=tokens if bad else 6),
            )
        # eps as EpRouted.routed takes it (before: float(eps), so True ran as eps 1.0 and "0.5"
        # as 0.5, silently; None failed in float() with a message naming neither).
        for eps, error in (
            (True, TypeError),
            ("0.5", TypeError),
            (None, TypeError),
            (0.0, ValueError),
            (2**1024, ValueError),  # past the float range: OverflowError escaped on one rank
        ):
            expected, text = (error, "routed_op: eps=") if bad else (EpPeerError, "rank 0")
            expect_raises(
                failures,
                f"eps={eps!r}",
                expected,
                text,
                lambda: routed_op(latent, ids, weights, norm, handle, eps=eps if bad else 1e-6),
            )
        expect_raises(
            failures,
            "unknown handle",
            ValueError,
            "not registered",
            lambda: routed_op(latent, ids, weights, norm, 10**9),
        )
        got = routed_op(latent, ids, weights, norm, handle)
        if not torch.equal(bits(got), bits(want)):
            failures.append("the call after the refusals: other bits")
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["routed_op", "operator"])
@pytest.mark.parametrize("total", [6, 10])
def test_a_handle_unregistered_on_one_rank_fails_the_step_on_every_rank(dep, layer, path, total):
    """Two handles on one EpRouted (two layers' calls), untagged, max_tokens 4 (T = 10 runs in
    three pieces): the last rank unregisters the first handle and calls with it, through
    routed_op or the operator torch dispatches to (a compiled model's path). It raises
    ValueError saying the handle was unregistered, the others EpPeerError, in the same call;
    then the second handle's call gives the reference bits on every rank with no reset.
    Before: that rank raised alone, before any exchange, and its call with the second handle
    paired with its peers' waiting call with the first: rows of the other call on the peers,
    no error (relative L2 1.04; found by a careless-user probe), then a timeout."""
    seed = agreed_seed(dep.cpu_group, 678)
    batches = Batches(dep, layer, seed, total)
    latent, ids, weights = batches.inputs(0)
    norm = layer.norm_weight()
    failures: list[str] = []
    with build(dep, 4) as routed:
        first = register_routed(routed, batches.experts)
        second = register_routed(routed, batches.experts)
        want = routed(latent, ids, weights, norm, experts=batches.experts).clone()
        gone = dep.rank == dep.size - 1
        if gone:
            unregister_routed(first)
        if path == "routed_op":
            call = lambda: routed_op(latent, ids, weights, norm, first)  # noqa: E731
        else:
            operator = torch.ops.dep_ep.routed.default
            call = lambda: operator(latent, ids, weights, norm, first, None, NO_TAG, 1e-6, None)  # noqa: E731
        last = dep.size - 1
        expected = (ValueError, "was unregistered") if gone else (EpPeerError, f"rank {last}")
        expect_raises(failures, f"the call with handle {first}", *expected, call)
        got = routed_op(latent, ids, weights, norm, second)
        if not torch.equal(bits(got), bits(want)):
            failures.append("the next call (the second handle): other bits")
        unregister_routed(second)
        if not gone:
            unregister_routed(first)
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_custom_op_rejects_every_piece_of_a_step_given_no_tokens(dep, layer, monkeypatch):
    """routed_op given no tokens on a latent of 10 rows over max_tokens 4, eps=True on rank 0:
    rank 0 rejects the step as one of T = 10 (before: of no T, one piece, where the peers run
    three: paired on CPU, where every rank stops in the first piece, out of step on GPU), raises
    TypeError, the others EpPeerError; the next call is good."""
    seed = agreed_seed(dep.cpu_group, 675)
    total, r = 10, dep.rank
    batches = Batches(dep, layer, seed, total)
    latent, ids, weights = batches.inputs(0)
    experts = batches.experts
    norm = layer.norm_weight()
    failures: list[str] = []
    with build(dep, 4) as routed:
        handle = register_routed(routed, experts)
        want = routed(latent, ids, weights, norm, experts=experts).clone()
        asked: list[object] = []
        reject = routed.reject_step

        def spy(error, *, tag=None, tokens=None):
            asked.append(tokens)
            return reject(error, tag=tag, tokens=tokens)

        monkeypatch.setattr(routed, "reject_step", spy)
        bad = r == 0
        expected = (TypeError, "routed_op: eps=True") if bad else (EpPeerError, "rank 0")
        expect_raises(
            failures,
            "eps=True",
            *expected,
            lambda: routed_op(latent, ids, weights, norm, handle, eps=True if bad else 1e-6),
        )
        want_asked = [total] if bad else []
        if asked != want_asked:
            failures.append(f"reject_step was asked for tokens {asked}; expected {want_asked}")
        got = routed_op(latent, ids, weights, norm, handle)
        if not torch.equal(bits(got), bits(want)):
            failures.append("the call after the refusal: other bits")
    collective_assert(dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_warmup_is_local_and_counts_accumulate(dep, layer):
    """warmup(T, experts) on rank 0 alone returns (no collective), and a bad T (0, 2^31: no step
    has it) is a ValueError;
    expert_counts(out=, accumulate=True) over three steps is the sum of their counts, and without
    accumulate the last step's."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 640), 6)
    failures: list[str] = []
    with build(dep, count_experts=True) as routed:
        if dep.rank == 0:
            try:
                routed.warmup(6, batches.experts)
                routed.warmup(40, batches.experts)  # above max_tokens: its pieces' sizes
            except Exception as err:
                failures.append(f"warmup: {type(err).__name__}: {err}")
            expect_raises(
                failures,
                "warmup(0)",
                ValueError,
                "tokens=0",
                lambda: routed.warmup(0, batches.experts),
            )
            # A T no step may have (before: accepted; found by a careless-user probe).
            expect_raises(
                failures,
                "warmup(2**31)",
                ValueError,
                "tokens=2147483648; expected 1..2147483647",
                lambda: routed.warmup(2**31, batches.experts),
            )
        total = torch.zeros(routed.experts_per_rank, dtype=torch.int64)
        want = torch.zeros_like(total)
        for i in range(3):
            batches.run(routed, i)
            routed.expert_counts(total, accumulate=True)
            want += routed.expert_counts().long()
        if not torch.equal(total, want):
            failures.append(f"accumulated {total.tolist()} != {want.tolist()}")
        last = torch.full((routed.experts_per_rank,), 99, dtype=torch.int32)
        routed.expert_counts(last)
        if not torch.equal(last, routed.expert_counts()):
            failures.append("out= without accumulate is not the last step's counts")
        expect_raises(
            failures,
            "float out",
            TypeError,
            "dtype",
            lambda: routed.expert_counts(torch.zeros(routed.experts_per_rank)),
        )
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


@pytest.mark.mpi(min_size=2)
def test_custom_op_under_torch_compile(dep, layer):
    """torch.ops.dep_ep.routed inside torch.compile(fullgraph=True) (aot_eager: the op is
    opaque, its fake impl gives the shape) returns the bits of EpRouted.routed, and the graph
    dynamo traces holds the operator as one node (routed_op calls the kernel directly only
    when nothing traces it)."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 650), 6)
    norm = layer.norm_weight()
    failures: list[str] = []
    with build(dep) as routed:
        handle = register_routed(routed, batches.experts)
        latent, ids, weights = batches.inputs(0)
        want = routed(latent, ids, weights, norm, experts=batches.experts, tag=3)

        def layer_call(latent, ids, weights, norm):
            return routed_op(latent, ids, weights, norm, handle, tag=3) * 1

        traced: list[object] = []

        def backend(graph_module, example_inputs):
            traced.extend(node.target for node in graph_module.graph.nodes)
            return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)

        compiled = torch.compile(layer_call, backend=backend, fullgraph=True)
        got = compiled(latent, ids, weights, norm)
        if not torch.equal(bits(got), bits(want)):
            failures.append("the compiled op gives other bits than routed()")
        if traced.count(torch.ops.dep_ep.routed.default) != 1:
            failures.append(f"the traced graph does not hold the operator once: {traced}")
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


@pytest.mark.mpi(min_size=2)
def test_custom_op_under_make_fx_and_jit_trace(dep, layer):
    """Tracers that see plain torch.Tensors (make_fx's real mode, a dispatch mode; torch.jit.trace,
    a tracing state) record the operator as one node, and the recorded graph's replay gives the
    bits of EpRouted.routed: routed_op calls the kernel directly only when nothing traces it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 660), 6)
    norm = layer.norm_weight()
    failures: list[str] = []
    with build(dep) as routed:
        handle = register_routed(routed, batches.experts)
        latent, ids, weights = batches.inputs(0)
        want = routed(latent, ids, weights, norm, experts=batches.experts, tag=3)

        def layer_call(latent, ids, weights, norm):
            return routed_op(latent, ids, weights, norm, handle, tag=3)

        args = (latent, ids, weights, norm)
        for name, trace, holds in (
            (
                "make_fx",
                lambda: make_fx(layer_call)(*args),
                lambda g: torch.ops.dep_ep.routed.default in [n.target for n in g.graph.nodes],
            ),
            (
                "jit.trace",
                lambda: torch.jit.trace(layer_call, args, check_trace=False),
                lambda g: "dep_ep::routed" in str(g.graph),
            ),
        ):
            try:
                graph = trace()
                if not holds(graph):
                    failures.append(f"{name}: the recorded graph lacks the operator")
                elif not torch.equal(bits(graph(*args)), bits(want)):
                    failures.append(f"{name}: the replayed graph gives other bits than routed()")
            except Exception as err:
                failures.append(f"{name}: {type(err).__name__}: {str(err)[:200]}")
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)


@pytest.mark.mpi(min_size=2)
def test_situ_check_and_integration_helpers(dep, layer):
    """A backend accepts Kimi K3's SiTU constants and refuses others; common_tokens, the padding
    mask, the shared EpRouted (one per group and geometry) and poll_all."""
    experts = Batches(dep, layer, 0, 4).experts
    failures: list[str] = []
    experts.check_situ("t", 4.0, 25.0)
    expect_raises(
        failures,
        "other SiTU",
        ValueError,
        "linear_beta=25.0",
        lambda: experts.check_situ("t", 4.0, 1.0),
    )
    cases = [(([3, 7, 0, 5], 1), 7), (([3, 7, 0, 5], 2), 4), (([0, 0], 1), 1), (([9], 4), 3)]
    for (counts, sp), want in cases:
        if common.common_tokens(counts, sp) != want:
            failures.append(f"common_tokens({counts}, {sp}) != {want}")
    # An iterator is read once (before: the fast path's type scan consumed it, then min() of
    # nothing raised ValueError).
    if common.common_tokens(iter([3, 7, 0, 5]), 2) != 4:
        failures.append("common_tokens(an iterator, 2) != 4")
    kw = dict(num_experts=TINY.experts, latent=TINY.latent, topk=TINY.topk, max_tokens=8)
    first = common.shared_routed(dep.cpu_group, "cpu", **kw)
    second = common.shared_routed(dep.cpu_group, "cpu", **kw)
    if first is not second:
        failures.append("shared_routed built a second EpRouted for the same geometry")
    if common.shared_routed(dep.cpu_group, "cpu:0", **kw) is not first:
        failures.append('shared_routed("cpu:0") is not the EpRouted of "cpu"')
    # Integers of any kind (before: a 0-dim tensor hashed by identity, and each call built a new
    # EpRouted; found by a careless-user probe).
    spelled = dict(kw, max_tokens=torch.tensor(8), topk=np.int64(TINY.topk))
    if common.shared_routed(dep.cpu_group, "cpu", **spelled) is not first:
        failures.append("shared_routed(max_tokens=torch.tensor(8)) is not the same EpRouted")
    expect_raises(
        failures,
        "shared_routed with another config",
        ValueError,
        "built with",
        lambda: common.shared_routed(
            dep.cpu_group, "cpu", **kw, config=EpConfig(timeout_s=first.config.timeout_s + 1)
        ),
    )
    common.poll_all()
    common.close_shared()
    if not first.closed:
        failures.append("close_shared left the EpRouted open")
    collective_assert(dep.cpu_group, failures, seeds=None)


@pytest.mark.mpi(min_size=2)
def test_abort_stale_step_aborts_only_its_owners_pending_step(dep, layer):
    """abort_stale_step: nothing with no dispatch pending or with another owner's pending (and
    `pending` says so), TypeError for owner=None; with its owner's (an equal str that is another
    object: before, compared by identity, it did nothing and the peers timed out), rank 0 aborts
    that step (RuntimeError naming the stale step's tag, 7, not the caller's layer) while the
    others, in its combine, raise EpPeerError;
    the next step is good. Inside a CUDA-graph capture (forced on every rank) nothing is
    launched and calls are refused until reset()."""
    batches = Batches(dep, layer, agreed_seed(dep.cpu_group, 680), 6)
    norm = layer.norm_weight()
    failures: list[str] = []
    with build(dep) as routed:
        latent, ids, weights = batches.inputs(0)
        want = routed(latent, ids, weights, norm, experts=batches.experts)
        routed.abort_stale_step("f", "hook")  # nothing pending: nothing happens
        routed.dispatch(latent, ids, weights, tag=7, owner="hook")
        if not routed.pending:
            failures.append("pending is False after a dispatch")
        rows = routed.receive()
        batches.experts.forward(rows.x, rows.sf, rows.ids, rows.weights, rows.out)
        if dep.rank == 0:
            routed.abort_stale_step("f", "another hook")  # not its step: nothing happens
            if not routed.pending:
                failures.append("another owner's call aborted the pending step")
            expect_raises(
                failures,
                "owner None",
                TypeError,
                "owner=None",
                lambda: (routed.abort_stale_step("f", None)),
            )
            # An equal owner that is another object (a name formatted again at the next hook).
            again = "".join(["ho", "ok"])
            assert again is not "hook"  # noqa: F632
            expect_raises(
                failures,
                "stale",
                RuntimeError,
                "f: this rank's dispatch of tag 7 was never combined",
                lambda: routed.abort_stale_step("f", again),
            )
        else:
            expect_raises(
                failures, "peer's stale", EpPeerError, "rank 0", lambda: routed.combine(norm)
            )
        if routed.pending:
            failures.append("pending is True after the step")
        got = routed(latent, ids, weights, norm, experts=batches.experts)
        if not torch.equal(bits(got), bits(want)):
            failures.append("the step after the aborted one: other bits")
        # While a CUDA-graph capture runs (the transport's capturing(), forced here on every
        # rank): nothing is launched, the step is left to reset(), and calls are refused until
        # then.
        routed.dispatch(latent, ids, weights, tag=8, owner="hook")
        routed._transport.capturing = lambda: True
        try:
            expect_raises(
                failures,
                "stale in a capture",
                RuntimeError,
                "tag 8 was never combined.*inside a CUDA-graph capture; call reset",
                lambda: routed.abort_stale_step("f", "hook"),
            )
        finally:
            del routed._transport.capturing
        expect_raises(
            failures,
            "after the capture's refusal",
            RuntimeError,
            "reset",
            lambda: routed(latent, ids, weights, norm, experts=batches.experts),
        )
        routed.reset()
        got = routed(latent, ids, weights, norm, experts=batches.experts)
        if not torch.equal(bits(got), bits(want)):
            failures.append("the step after reset: other bits")
    collective_assert(dep.cpu_group, failures, seeds=batches.seed)
