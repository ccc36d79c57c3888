"""GPU recovery (2 or more processes, which may share one GPU): a SIGINT inside one rank's
wait, then reset() on every rank, which ends the kernels still waiting (no timeout waited out)
and makes the next steps equal to the reference; reset() on one rank while the others' kernels
wait for it, which their peer watch turns into EpDesyncError within 1 s; a kernel error under
CUDA-graph replay (graphs captured with tags or token counts that differ across ranks), which
poll() raises on every rank naming the call, the phase, the rank and the peer while the
replay's rows are NaN; a step in pieces whose experts fail in one piece on one rank, which
every rank still runs to the end; and (test_gpu_dead_peer.py) a peer that dies.

Before the abort request and poll() (main at 6f889cd): a reset() after the interrupt waited for
the stuck combine kernel's 20 s timeout, and a replayed step with differing tags raised nothing
(EpRouted had no poll(); check() ran only inside an eager dispatch)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dep_ep.comm import EpDesyncError, EpPeerError, EpTimeoutError
from dep_ep.comm.device_transport import DeviceTransport
from dep_ep.config import TINY, EpConfig
from dep_ep.cuda_graphs import capture_graph, held_collector
from dep_ep.ep import EpRouted
from dep_ep.experts import DenseExperts, ExpertsBackend
from dep_ep.testing import SyntheticLayer, allgather_reference
from dep_ep.testing.compare import compare

from helpers.cases import agreed_seed, make_case
from helpers.collective import collective_assert, expect_raises

MAX_TOKENS = 16
T = 8
TIMEOUT_S = 20.0  # a kernel that waited this out would fail the reset's bound below
# reset() on every rank (after a host barrier) while a peer's kernels are stuck: the abort
# request ends them at once. The CPU analogue (tests/test_recovery_mpi.py, N2: a peer's reset
# once every rank is there) took 0.0003-0.16 s on 2-4 ranks; on GPU 0.002-0.069 s was measured
# (docs/reliability.md, G7).
RESET_S = 1.0
SIGNAL_S = 0.5  # from a SIGINT to its KeyboardInterrupt (synchronize() polls every 0.2 ms)
LATE_S = 1.0  # the other ranks call this late, so that rank 0's kernels wait for them
SHORT_TIMEOUT_S = 2.0  # rank 0's dispatch times out after this ...
LATE_TIMEOUT_S = 1.0  # ... and the other ranks dispatch this much later still


def build(dep, timeout_s: float = TIMEOUT_S) -> EpRouted:
    return EpRouted(
        dep.cpu_group,
        MAX_TOKENS,
        "cuda",
        num_experts=TINY.experts,
        latent=TINY.latent,
        topk=TINY.topk,
        config=EpConfig(timeout_s=timeout_s),
    )


def dense_experts(layer, rank, n):
    per_rank = TINY.experts // n
    return DenseExperts(layer.local_weights(rank * per_rank, per_rank).to("cuda"))


def good_step(dep, routed, layer, experts, seed, label) -> list[str]:
    """A step on fresh rows (every rank in step) against the all-gather reference."""
    case = make_case(TINY, dep.size, T, seed)
    r = dep.rank
    args = [t.cuda() for t in (case.latent[r], case.ids[r], case.weights[r])]
    out = routed(*args, layer.norm_weight().cuda(), experts=experts)
    routed.synchronize()
    ref = allgather_reference(
        dep.cpu_group,
        case.latent[r],
        case.ids[r],
        case.weights[r],
        layer.norm_weight(),
        layer.expert,
    )
    return compare(out.cpu(), ref, label)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("where", ["synchronize", "before-launch"])
def test_interrupt_in_dispatch_then_reset(gpu_dep, monkeypatch, where):
    """A real SIGINT (os.kill from a timer thread, as Ctrl-C delivers it) reaches rank 0 while it
    waits: in synchronize() after its step was launched (its kernels wait for the other ranks,
    which call LATE_S later), or inside its dispatch before the kernel launch (a patched
    DeviceTransport.dispatch holds there in a sleep, which the signal ends; the other ranks'
    kernels then wait for rank 0's flags). KeyboardInterrupt within SIGNAL_S of the signal, and
    rank 0 refuses calls until reset(). Then, after a host barrier (the times measure the reset
    alone), reset() on every rank returns within RESET_S (the kernels still waiting are ended by
    the abort request, not timed out), and three fresh steps match the reference.
    The earlier form of this test raised the KeyboardInterrupt from a patched dispatch, no
    signal, and bounded each rank's reset() by 3 s from its own call; this form passed on one
    H200 with 2 processes (2026-12-02)."""
    seed = agreed_seed(gpu_dep.cpu_group, 500)
    layer = SyntheticLayer(TINY, seed)
    experts = dense_experts(layer, gpu_dep.rank, gpu_dep.size)
    failures: list[str] = []
    routed = build(gpu_dep)
    try:
        failures += good_step(gpu_dep, routed, layer, experts, seed + 1, "before")
        case = make_case(TINY, gpu_dep.size, T, seed + 2)
        r = gpu_dep.rank
        args = [t.cuda() for t in (case.latent[r], case.ids[r], case.weights[r])]
        norm = layer.norm_weight().cuda()
        dist.barrier(group=gpu_dep.cpu_group)
        if r == 0:
            if where == "before-launch":
                real = DeviceTransport.dispatch

                def held(self, *a, **kw):
                    time.sleep(10 * SIGNAL_S)  # the signal ends this sleep
                    return real(self, *a, **kw)

                monkeypatch.setattr(DeviceTransport, "dispatch", held)

                def call():
                    routed(*args, norm, experts=experts)

            else:
                routed(*args, norm, experts=experts)  # its kernels wait for the late ranks
                call = routed.synchronize
            timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            start = time.monotonic()
            try:
                call()
                err = None
            except BaseException as caught:
                err = caught
            took = time.monotonic() - start - 0.2
            timer.join()
            monkeypatch.undo()
            print(f"TIME-TO-ERROR SIGINT in {where}: {took:.4f} s after the signal")
            if not isinstance(err, KeyboardInterrupt):
                failures.append(f"SIGINT in {where}: {type(err).__name__}: {err}")
            elif took > SIGNAL_S:
                failures.append(f"SIGINT in {where}: KeyboardInterrupt {took:.2f} s after it")
            expect_raises(failures, "poll after the SIGINT", RuntimeError, "reset", routed.poll)
        else:
            if where == "synchronize":
                time.sleep(LATE_S)
            routed(*args, norm, experts=experts)  # before-launch: its kernels wait for rank 0
        dist.barrier(group=gpu_dep.cpu_group)
        start = time.monotonic()
        try:
            routed.reset()
        except Exception as err:  # reported collectively
            failures.append(f"reset(): {type(err).__name__}: {err}")
        took = time.monotonic() - start
        print(f"TIME-TO-RESET rank {r} (SIGINT in {where}): {took:.3f} s")
        if took > RESET_S:
            failures.append(f"reset() took {took:.2f} s (a kernel waited out its timeout)")
        for i in range(3):
            failures += good_step(gpu_dep, routed, layer, experts, seed + 10 + i, f"after {i}")
    finally:
        routed.close()
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_reset_reaches_a_peer_whose_kernels_wait(gpu_dep):
    """Rank 0 calls reset() instead of its step while the other ranks' step waits for rank 0's
    dispatch flags, which never come: their peer watch sees rank 0's reset round (within
    peer_watch_s, 0.1 s) and ends their kernels, so their synchronize() (or the call, when the
    watch was first) raises EpDesyncError naming rank 0 and saying to reset() within 1 s of the
    call; they reset(), rank 0's reset() returns within 2 s, and three fresh steps match the
    reference.
    Passed on one H200 with 2 processes (2026-12-02). Before (read from the code, not run):
    their kernels waited
    for rank 0 until timeout_s (20 s) and synchronize() raised EpTimeoutError then, by which time
    rank 0's reset() had waited its own 20 s for them."""
    seed = agreed_seed(gpu_dep.cpu_group, 520)
    layer = SyntheticLayer(TINY, seed)
    r = gpu_dep.rank
    experts = dense_experts(layer, r, gpu_dep.size)
    failures: list[str] = []
    routed = build(gpu_dep)
    try:
        failures += good_step(gpu_dep, routed, layer, experts, seed + 1, "before")
        case = make_case(TINY, gpu_dep.size, T, seed + 2)
        args = [t.cuda() for t in (case.latent[r], case.ids[r], case.weights[r])]
        norm = layer.norm_weight().cuda()
        dist.barrier(group=gpu_dep.cpu_group)
        start = time.monotonic()
        if r == 0:
            try:
                routed.reset()
            except Exception as err:
                failures.append(f"rank 0's reset(): {type(err).__name__}: {err}")
            took = time.monotonic() - start
            print(f"TIME-TO-RESET rank 0, the others' kernels waiting: {took:.3f} s")
            if took > 2 * RESET_S:
                failures.append(f"rank 0's reset() took {took:.2f} s")
        else:

            def step_and_wait():
                # Its kernels wait for rank 0's flags; synchronize() raises once the watch ends
                # them (or the call itself does, when the watch saw rank 0's reset first).
                routed(*args, norm, experts=experts)
                routed.synchronize()

            err = expect_raises(
                failures,
                "a step while rank 0 resets",
                EpDesyncError,
                r"rank 0(, rank \d+)* called reset\(\).*reset\(\)",  # others may reset too
                step_and_wait,
            )
            took = time.monotonic() - start
            print(f"TIME-TO-ERROR rank {r}, rank 0 in reset(): {took:.3f} s")
            if took > 1.0:
                failures.append(f"the error came {took:.2f} s after the call")
            if err is not None and getattr(err, "recovery", None) != "reset":
                failures.append(f"the error's recovery is {getattr(err, 'recovery', None)!r}")
            expect_raises(failures, "poll before reset()", RuntimeError, "reset", routed.poll)
            try:
                routed.reset()
            except Exception as err:
                failures.append(f"rank {r}'s reset(): {type(err).__name__}: {err}")
        for i in range(3):
            failures += good_step(gpu_dep, routed, layer, experts, seed + 10 + i, f"after {i}")
    finally:
        routed.close()
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


def capture(routed, args, norm, experts, tag, warm_args):
    """routed(...) captured in a CUDA graph after one eager warm-up on a side stream with
    `warm_args` (the same on every rank, so the warm-up itself is in step); returns (graph, its
    output tensor)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        routed(*warm_args, norm, experts=experts, tag=0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    routed.poll()
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        out = routed(*args, norm, experts=experts, tag=tag)
    return graph, out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("differs", ["tag", "tokens"])
def test_poll_raises_a_kernel_error_under_graph_replay(gpu_dep, differs):
    """Graphs captured with a tag (or T) that differs on the last rank: a replay's rows are NaN
    on every rank and poll() (after a plain CUDA sync, no call of ours in between) raises on
    every rank, naming the call, the phase, the rank and a peer (the last rank on the others,
    another rank on the last); then (after the reset() a desync asks for) poll() is clean, and a
    graph captured in step replays rows bit-equal to eager calls. poll() inside a capture is a
    RuntimeError."""
    seed = agreed_seed(gpu_dep.cpu_group, 510)
    layer = SyntheticLayer(TINY, seed)
    n, r = gpu_dep.size, gpu_dep.rank
    experts = dense_experts(layer, r, n)
    norm = layer.norm_weight().cuda()
    odd = r == n - 1
    failures: list[str] = []
    routed = build(gpu_dep)
    try:
        tokens = T + 1 if (odd and differs == "tokens") else T
        case = make_case(TINY, n, T + 1, seed + 1)
        args = [t[:tokens].cuda() for t in (case.latent[r], case.ids[r], case.weights[r])]
        same = [t[:T].cuda() for t in (case.latent[r], case.ids[r], case.weights[r])]
        tag = 7 + (1 if odd and differs == "tag" else 0)
        graph, out = capture(routed, args, norm, experts, tag, same)
        dist.barrier(gpu_dep.cpu_group)
        graph.replay()
        torch.cuda.synchronize()
        if not out.isnan().all():
            failures.append("the failed replay's rows are not all NaN")
        expected = EpDesyncError if differs == "tag" else ValueError
        err = expect_raises(failures, "poll after the replay", expected, "call", routed.poll)
        if err is not None and not all(w in str(err) for w in ("dispatch", f"rank {r}")):
            failures.append(f"poll's error lacks the phase or the rank: {err}")
        if err is not None:
            # The last rank's peers see it differ; it sees any of them (the first it checked).
            peer = named_peer(str(err))
            allowed = range(n - 1) if odd else [n - 1]
            if peer not in allowed:
                failures.append(
                    f"poll's error names peer {peer}, not one of {list(allowed)}: {err}"
                )
        if differs == "tag":
            routed.reset()  # what the desync says: the ranks' calls no longer pair
        expect_raises(
            failures,
            "poll inside a capture",
            RuntimeError,
            "captured",
            lambda: _poll_in_capture(routed),
        )
        routed.poll()  # cleared
        dist.barrier(gpu_dep.cpu_group)
        graph2, out2 = capture(routed, same, norm, experts, 9, same)
        dist.barrier(gpu_dep.cpu_group)
        for _ in range(3):
            graph2.replay()
        torch.cuda.synchronize()
        routed.poll()
        replayed = out2.clone()
        eager = routed(*same, norm, experts=experts, tag=11)
        routed.synchronize()
        if not torch.equal(replayed.view(torch.int16), eager.view(torch.int16)):
            failures.append("the in-step replay differs from an eager call")
    except Exception as err:  # reported collectively
        failures.append(f"{type(err).__name__}: {err}")
    finally:
        routed.close()
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


def named_peer(message: str) -> int | None:
    """The peer a kernel error's message names: "rank P ran <tag>" (differing tags) or "(rank P:
    <T>, this rank: ...)" (differing token counts); None when it names none."""
    found = re.search(r"\brank (\d+) ran |\(rank (\d+): ", message)
    return None if found is None else int(found.group(1) or found.group(2))


def _poll_in_capture(routed):
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with held_collector(), torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            routed.poll()
        finally:
            graph.capture_end()


class FailOnCall(ExpertsBackend):
    """Experts that raise KeyError on their `fail_at`-th call (0-based), else run `inner`."""

    def __init__(self, inner: ExpertsBackend, fail_at: int | None):
        self.inner, self.fail_at, self.calls = inner, fail_at, 0
        self.first_expert, self.num_local_experts = inner.first_expert, inner.num_local_experts
        self.latent = inner.latent

    def forward(self, x, sf, ids, weights, out):
        call, self.calls = self.calls, self.calls + 1
        if call == self.fail_at:
            raise KeyError("experts failed in piece 1")
        return self.inner.forward(x, sf, ids, weights, out)


@pytest.mark.mpi(min_size=2)
def test_a_piece_that_fails_keeps_the_pieces_paired(gpu_dep):
    """A step of 3 pieces (T = 40, max_tokens 16) whose experts fail in piece 1 on rank 0: rank
    0 takes part in pieces 1 and 2 without payload and raises its KeyError after them; the other
    ranks run every piece and return (the rows of pieces 1 and 2 NaN), and their poll() raises
    EpPeerError naming rank 0; no rank waits out the timeout, and the next step matches the
    reference."""
    seed = agreed_seed(gpu_dep.cpu_group, 540)
    layer = SyntheticLayer(TINY, seed)
    failures: list[str] = []
    total, r = 40, gpu_dep.rank
    case = make_case(TINY, gpu_dep.size, total, seed)
    args = [t.cuda() for t in (case.latent[r], case.ids[r], case.weights[r])]
    norm = layer.norm_weight().cuda()
    with build(gpu_dep) as routed:
        experts = dense_experts(layer, r, gpu_dep.size)
        failing = FailOnCall(experts, 1 if r == 0 else None)
        start = time.monotonic()
        if r == 0:
            expect_raises(
                failures,
                "the failing rank",
                KeyError,
                "piece 1",
                lambda: routed(*args, norm, experts=failing, tokens=total),
            )
            torch.cuda.synchronize()
        else:
            out = routed(*args, norm, experts=failing, tokens=total)
            torch.cuda.synchronize()
            if out[:MAX_TOKENS].isnan().any() or not out[MAX_TOKENS:].isnan().all():
                failures.append("a peer's rows: piece 0 not finite or pieces 1-2 not all NaN")
            expect_raises(failures, "the peer's poll", EpPeerError, "rank 0", routed.poll)
        took = time.monotonic() - start
        if took > TIMEOUT_S / 2:
            failures.append(f"the failed step took {took:.1f} s: a wait ran out")
        dist.barrier(group=gpu_dep.cpu_group)
        failures += good_step(gpu_dep, routed, layer, experts, seed + 1, "the next step")
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_a_dispatch_that_timed_out_poisons_the_step_on_every_rank(gpu_dep):
    """Rank 0's dispatch times out waiting for the other ranks, which call LATE_TIMEOUT_S later
    than rank 0's timeout: rank 0's experts and combine still run (stream-ordered) on receive
    rows the late ranks had not written yet. Its combine's ready flag says so (STATUS_UNUSABLE),
    so the late ranks, whose own dispatch saw nothing wrong, output NaN and raise EpPeerError
    naming rank 0 at synchronize(); rank 0 raises EpTimeoutError. After reset() on every rank
    three fresh steps match the reference. Before (read from the code, not run): the late ranks
    summed rank 0's rows and returned them with no error. Written, not run on a GPU yet."""
    seed = agreed_seed(gpu_dep.cpu_group, 540)
    layer = SyntheticLayer(TINY, seed)
    r = gpu_dep.rank
    experts = dense_experts(layer, r, gpu_dep.size)
    failures: list[str] = []
    routed = build(gpu_dep, SHORT_TIMEOUT_S)
    try:
        case = make_case(TINY, gpu_dep.size, T, seed + 1)
        args = [t.cuda() for t in (case.latent[r], case.ids[r], case.weights[r])]
        norm = layer.norm_weight().cuda()
        dist.barrier(group=gpu_dep.cpu_group)
        if r != 0:
            time.sleep(SHORT_TIMEOUT_S + LATE_TIMEOUT_S)
        out = routed(*args, norm, experts=experts)
        if r == 0:
            expect_raises(failures, "rank 0", EpTimeoutError, "dispatch", routed.synchronize)
        else:
            expect_raises(
                failures, f"rank {r}", EpPeerError, "rank 0 had failed", routed.synchronize
            )
            if not bool(out.isnan().all()):
                failures.append(f"rank {r}: rows of the poisoned step are not all NaN")
        dist.barrier(group=gpu_dep.cpu_group)
        routed.reset()
        for i in range(3):
            failures += good_step(gpu_dep, routed, layer, experts, seed + 2 + i, f"after {i}")
    finally:
        routed.close()
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=2)
def test_a_stale_split_dispatch_is_aborted_on_every_rank_and_reset_recovers(gpu_dep):
    """An engine's split hooks on the device transport: every rank dispatches a step with an
    owner (`dispatch(..., owner=)`) and runs its experts; the engine then raises on rank 0
    between dispatch and combine, so rank 0's next dispatch by that owner calls
    `abort_stale_step`: RuntimeError naming the stale step's tag and asking for reset() on every
    rank; its next call is refused until then. The other ranks' combine returns NaN rows and
    their poll() raises EpPeerError naming rank 0, within TIMEOUT_S / 2 (no wait runs out).
    After reset() on every rank three fresh steps match the reference."""
    seed = agreed_seed(gpu_dep.cpu_group, 560)
    layer = SyntheticLayer(TINY, seed)
    r = gpu_dep.rank
    experts = dense_experts(layer, r, gpu_dep.size)
    failures: list[str] = []
    routed = build(gpu_dep)
    try:
        failures += good_step(gpu_dep, routed, layer, experts, seed + 1, "before")
        case = make_case(TINY, gpu_dep.size, T, seed + 2)
        args = [t.cuda() for t in (case.latent[r], case.ids[r], case.weights[r])]
        norm = layer.norm_weight().cuda()
        start = time.monotonic()
        routed.dispatch(*args, tag=7, owner="hook")
        rows = routed.receive()
        experts.forward(rows.x, rows.sf, rows.ids, rows.weights, rows.out)
        if r == 0:
            expect_raises(
                failures,
                "rank 0's stale step",
                RuntimeError,
                "tag 7 was never combined.*reset\\(\\) on every rank",
                lambda: routed.abort_stale_step("f", "hook"),
            )
            expect_raises(failures, "rank 0's next call", RuntimeError, "reset", routed.poll)
            torch.cuda.synchronize()
        else:
            out = routed.combine(norm)
            torch.cuda.synchronize()
            if not bool(out.isnan().all()):
                failures.append(f"rank {r}: rows of the aborted step are not all NaN")
            expect_raises(failures, f"rank {r}'s poll", EpPeerError, "rank 0", routed.poll)
        took = time.monotonic() - start
        if took > TIMEOUT_S / 2:
            failures.append(f"the aborted step took {took:.1f} s: a wait ran out")
        if routed.pending:
            failures.append("pending is True after the aborted step")
        dist.barrier(group=gpu_dep.cpu_group)
        routed.reset()
        for i in range(3):
            failures += good_step(gpu_dep, routed, layer, experts, seed + 10 + i, f"after {i}")
    finally:
        routed.close()
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)
