"""comm/peer_watch.py on CPU with stand-in channels: the thread sees a gone peer and writes the
abort request; period None starts no thread, stops cleanly and still looks when asked; a peer's
reset round (in a real in-process store) ends the waits with ABORT_PEER_RESET, but never a round
this rank has reset past; DeviceTransport.check() (built without a GPU) raises it as an
EpDesyncError that says to reset(); a launch queued after a reset nested in its call refuses
every call until the next reset()."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dep_ep.comm.device_transport import DeviceTransport
from dep_ep.comm.errors import (
    RECOVERY_RESET,
    EpDesyncError,
    EpPairBudgetError,
    EpPeerError,
    EpTokenCountError,
    EpUnwrittenRowsError,
)
from dep_ep.comm.failure import (
    FAILURE_PAIR_BUDGET,
    FAILURE_UNWRITTEN_ROWS,
    StepFailure,
    failure_error,
    new_record,
)
from dep_ep.comm.host_channel import ObjectBarriers
from dep_ep.comm.peer_watch import PeerWatch
from dep_ep.constants import (
    ABORT_PEER_LOST,
    ABORT_PEER_RESET,
    ERROR_ABORT,
    ERROR_CALL,
    ERROR_COMPLETE,
    ERROR_KERNEL_WORDS,
    ERROR_KIND,
    ERROR_MINE,
    ERROR_PEER,
    ERROR_PHASE,
    ERROR_STATUS,
    ERROR_THEIRS,
    ERROR_WORDS,
    KIND_ABORTED,
    KIND_REJECTED,
    KIND_TOKENS,
    PHASE_COMBINE,
    STATUS_FAILED,
    STATUS_REJECTED,
    STATUS_UNUSABLE,
)


class Channel:
    """The part of GroupChannel PeerWatch reads: rank 1 is watchable and gone once `dead`."""

    size = 2
    checkable = [False, True]

    def __init__(self) -> None:
        self.dead = False

    def gone(self, ranks) -> list[int]:
        return [1] if self.dead and 1 in ranks else []


def record() -> torch.Tensor:
    return torch.zeros(ERROR_ABORT + 1, dtype=torch.int64)


def test_the_thread_sees_a_gone_peer():
    channel, error = Channel(), record()
    watch = PeerWatch(channel, error, 0.01)
    channel.dead = True
    deadline = time.monotonic() + 5
    while not watch.lost and time.monotonic() < deadline:
        time.sleep(0.005)
    watch.stop()
    assert watch.lost == [1] and int(error[ERROR_ABORT]) == ABORT_PEER_LOST


def test_period_none_starts_no_thread_and_stops():
    before = {t.name for t in threading.enumerate()}
    channel, error = Channel(), record()
    watch = PeerWatch(channel, error, None)
    assert "dep-ep-peer-watch" not in {t.name for t in threading.enumerate()} - before
    watch.stop()  # before: 2 * None in the join's timeout raised TypeError (and close() with it)
    channel.dead = True
    assert int(error[ERROR_ABORT]) == 0
    assert watch.check_now() == [1] and int(error[ERROR_ABORT]) == ABORT_PEER_LOST


class StoreChannel:
    """The part of GroupChannel that PeerWatch and ObjectBarriers.peer_rounds read, over a real
    in-process store: this process is rank 0 of `size`, no peer is watchable on /proc."""

    def __init__(self, size: int = 3) -> None:
        self.size, self.rank = size, 0
        self.checkable = [False] * size
        self.store = dist.HashStore()
        self.objects: dict = {}
        self.closed: dict = {}

    def gone(self, ranks) -> list[int]:
        return []

    def key(self, *parts) -> str:
        return "test/" + "/".join(str(p) for p in parts)


def enter_reset(channel: StoreChannel, barriers: ObjectBarriers, rank: int) -> None:
    """What ObjectBarriers.reset does first on `rank`: raise its reset round by one."""
    channel.store.add(channel.key(barriers.obj, "reset", rank), 1)


def wait_for(condition, seconds: float = 2.0) -> float:
    start = time.monotonic()
    while not condition() and time.monotonic() - start < seconds:
        time.sleep(0.002)
    return time.monotonic() - start


def test_the_thread_sees_a_peer_reset_and_not_one_this_rank_has_passed():
    """Rank 2 enters reset(): within a few periods the watch writes ABORT_PEER_RESET and names
    rank 2 (the thread starts for this alone: no peer is watchable on /proc). After this rank's
    own reset (its round raised, the record cleared under the lock, as DeviceTransport.reset
    does) no abort comes back; a later reset of rank 1 is seen again. Before: PeerWatch took no
    object barriers or store (TypeError here) and read /proc only."""
    channel, error = StoreChannel(), record()
    barriers = ObjectBarriers(channel, "obj", "the test's object")
    watch = PeerWatch(channel, error, 0.01, barriers, channel.store)
    try:
        time.sleep(0.05)
        assert int(error[ERROR_ABORT]) == 0 and watch.resetting == []
        enter_reset(channel, barriers, 2)
        took = wait_for(lambda: int(error[ERROR_ABORT]) != 0)
        assert int(error[ERROR_ABORT]) == ABORT_PEER_RESET and watch.resetting == [2], took
        assert took < 0.5, took
        enter_reset(channel, barriers, 0)  # this rank's reset: every round at 1
        enter_reset(channel, barriers, 1)
        barriers.reset_round = 1
        with watch.lock:
            error.zero_()
            watch.cleared()
        time.sleep(0.1)  # ten looks
        assert int(error[ERROR_ABORT]) == 0 and watch.resetting == []
        enter_reset(channel, barriers, 1)
        wait_for(lambda: int(error[ERROR_ABORT]) != 0)
        assert int(error[ERROR_ABORT]) == ABORT_PEER_RESET and watch.resetting == [1]
    finally:
        watch.stop()


def test_a_peer_reset_keeps_an_earlier_reason_and_is_seen_without_a_thread():
    """With period None, check_now() looks for resets on the channel's store (poll() and
    synchronize() call it); a lost peer's ABORT_PEER_LOST already written stays. Before: as
    above (TypeError)."""
    channel, error = StoreChannel(2), record()
    barriers = ObjectBarriers(channel, "obj", "the test's object")
    watch = PeerWatch(channel, error, None, barriers, channel.store)
    enter_reset(channel, barriers, 1)
    error[ERROR_ABORT] = ABORT_PEER_LOST
    watch.check_now()
    assert watch.resetting == [1] and int(error[ERROR_ABORT]) == ABORT_PEER_LOST
    error[ERROR_ABORT] = 0
    with watch.lock:
        watch.cleared()
    watch.check_now()
    assert int(error[ERROR_ABORT]) == ABORT_PEER_RESET


def transport_with(error: torch.Tensor, resetting: list[int]) -> DeviceTransport:
    """A DeviceTransport without a GPU: only what check() reads (rank 0, its watch, the record)."""
    transport = DeviceTransport.__new__(DeviceTransport)
    transport.rank, transport.error = 0, error
    transport.failure_record = new_record(pinned=False)
    transport.watch = PeerWatch(StoreChannel(2), error, None)
    transport.watch.resetting = resetting
    return transport


def test_check_raises_a_peer_reset_as_a_desync_to_reset():
    """The abort request ABORT_PEER_RESET alone (no wait ended yet), or a wait the kernels ended
    for it (KIND_ABORTED with that reason): check() raises EpDesyncError naming the peer that
    reset and saying to reset() here, recovery "reset", and keeps raising it until reset().
    Before: the request alone raised nothing (the next call launched kernels that the request
    ended)."""
    error = torch.zeros(ERROR_WORDS, dtype=torch.int64)
    error[ERROR_ABORT] = ABORT_PEER_RESET
    transport = transport_with(error, [1])
    for _ in range(2):
        with pytest.raises(EpDesyncError, match=r"rank 1 called reset\(\).*reset\(\)") as info:
            transport.check()
        assert info.value.recovery == RECOVERY_RESET
    error[ERROR_STATUS], error[ERROR_KIND] = ERROR_COMPLETE, KIND_ABORTED
    error[ERROR_PHASE], error[ERROR_PEER], error[ERROR_THEIRS] = PHASE_COMBINE, 1, ABORT_PEER_RESET
    for _ in range(2):
        with pytest.raises(EpDesyncError, match=r"rank 1 called reset\(\).*combine for rank 1"):
            transport.check()


@pytest.mark.parametrize(
    "status,cause",
    [
        (STATUS_REJECTED, "rejected its input"),
        (STATUS_FAILED, "failed in its experts"),
        (STATUS_UNUSABLE, "had failed this step before its combine"),
    ],
)
def test_check_names_why_a_peer_s_combine_flag_failed(status, cause):
    """A peer's combine flag carries its status: check() raises EpPeerError naming the peer and
    the cause, STATUS_UNUSABLE included (a rank whose dispatch of the step had failed, whose
    rows its peers must not use). Then the next call is in step: the record is cleared."""
    error = torch.zeros(ERROR_WORDS, dtype=torch.int64)
    error[ERROR_STATUS], error[ERROR_KIND] = ERROR_COMPLETE, KIND_REJECTED
    error[ERROR_PHASE], error[ERROR_PEER], error[ERROR_THEIRS] = PHASE_COMBINE, 1, status
    transport = transport_with(error, [])
    with pytest.raises(EpPeerError, match=f"rank 1 {cause}"):
        transport.check()
    transport.check()


@pytest.mark.parametrize(
    "peer,status", [(0, STATUS_UNUSABLE), (1, STATUS_UNUSABLE), (1, STATUS_REJECTED)]
)
def test_check_raises_this_rank_s_pair_budget_failure_first(peer, status):
    """A step whose experts stored a pair-budget failure (comm/failure.py) on this rank: its
    combine recorded its own STATUS_UNUSABLE flag (peer 0 = this rank), or a peer's failure came
    first in the record. check() raises EpPairBudgetError naming the call, the tag, the pair
    count, the budget and the fix, recovery "none", and clears both records: the next check is
    clean. Without the failure record the same error record raises EpPeerError (the peer's, or
    this rank's own flag: "had failed this step before its combine")."""
    error = torch.zeros(ERROR_WORDS, dtype=torch.int64)
    transport = transport_with(error, [])
    tag = -(1 << 62) + 5
    transport.failure_record[:] = torch.tensor([FAILURE_PAIR_BUDGET, 96, 32, tag, 7])
    for with_record in (True, False):
        error[ERROR_STATUS], error[ERROR_KIND] = ERROR_COMPLETE, KIND_REJECTED
        error[ERROR_PHASE], error[ERROR_PEER], error[ERROR_THEIRS] = PHASE_COMBINE, peer, status
        error[ERROR_CALL] = 7
        if with_record:
            with pytest.raises(EpPairBudgetError) as info:
                transport.check()
            text = str(info.value)
            for part in (
                "rank 0",
                "call 7",
                "layer 5",
                "96 (row, local expert) pairs",
                "budget of 32 pairs",
                "Raise pair_skew",
                "NaN",
            ):
                assert part in text, (part, text)
            assert (info.value.pairs, info.value.budget, info.value.tag) == (96, 32, tag)
            assert info.value.recovery == "none"
            assert not transport.failure_record.any()
        else:
            with pytest.raises(EpPeerError, match=f"rank {peer} "):
                transport.check()
        transport.check()


def test_check_raises_unwritten_rows_and_clears_a_record_it_does_not_raise():
    """check_expert_rows' failure (comm/failure.py, FAILURE_UNWRITTEN_ROWS) under this rank's
    own STATUS_UNUSABLE flag: check() raises EpUnwrittenRowsError (a ValueError) with the
    counts and the tag, and clears both records. A failure record left by a step whose first
    error is of another kind (T differs, found by a peer's combine) is cleared with that error,
    which is raised: a later rejection then reads as the peer's EpPeerError, not as this stale
    record (found by a careless-user probe, reading the code)."""
    error = torch.zeros(ERROR_WORDS, dtype=torch.int64)
    transport = transport_with(error, [])
    transport.failure_record[:] = torch.tensor([FAILURE_UNWRITTEN_ROWS, 3, 64, 9, 4])
    error[ERROR_STATUS], error[ERROR_KIND] = ERROR_COMPLETE, KIND_REJECTED
    error[ERROR_PHASE], error[ERROR_PEER], error[ERROR_THEIRS] = PHASE_COMBINE, 0, STATUS_UNUSABLE
    error[ERROR_CALL] = 4
    with pytest.raises(
        EpUnwrittenRowsError, match="tag 9: 3 of this rank's 64 receive row"
    ) as info:
        transport.check()
    assert isinstance(info.value, ValueError)
    assert (info.value.rows, info.value.checked, info.value.tag) == (3, 64, 9)
    assert not transport.failure_record.any() and not error.any()
    transport.failure_record[:] = torch.tensor([FAILURE_UNWRITTEN_ROWS, 3, 64, 9, 5])
    error[ERROR_STATUS], error[ERROR_KIND] = ERROR_COMPLETE, KIND_TOKENS
    error[ERROR_PHASE], error[ERROR_PEER] = PHASE_COMBINE, 1
    error[ERROR_THEIRS], error[ERROR_MINE] = 5, 4
    with pytest.raises(EpTokenCountError):
        transport.check()
    assert not transport.failure_record.any()
    error[ERROR_STATUS], error[ERROR_KIND] = ERROR_COMPLETE, KIND_REJECTED
    error[ERROR_PHASE], error[ERROR_PEER], error[ERROR_THEIRS] = PHASE_COMBINE, 1, STATUS_REJECTED
    with pytest.raises(EpPeerError, match="rank 1 rejected its input"):
        transport.check()


@pytest.mark.parametrize("code", [FAILURE_PAIR_BUDGET, FAILURE_UNWRITTEN_ROWS])
def test_check_drops_a_failure_record_stored_after_it_was_cleared(code):
    """The double fault of docs/reliability.md: step 5's first error is of another kind (T
    differs), which check() raises at call 6, clearing the failure record; step 5's experts
    kernels, still queued then, store their failure after it. A peer's rejection of call 9 then
    reads that record: it holds call 5, not 9, so check() drops it and raises the peer's
    EpPeerError (before the call index, it raised this rank's failure of step 5 as step 9's). A
    record of call 9 itself is raised as this rank's failure."""
    error = torch.zeros(ERROR_WORDS, dtype=torch.int64)
    transport = transport_with(error, [])
    error[ERROR_STATUS], error[ERROR_KIND] = ERROR_COMPLETE, KIND_TOKENS
    error[ERROR_PHASE], error[ERROR_PEER], error[ERROR_CALL] = PHASE_COMBINE, 1, 5
    error[ERROR_THEIRS], error[ERROR_MINE] = 5, 4
    with pytest.raises(EpTokenCountError):
        transport.check()
    transport.failure_record[:] = torch.tensor([code, 96, 32, 11, 5])  # the late store
    error[ERROR_STATUS], error[ERROR_KIND] = ERROR_COMPLETE, KIND_REJECTED
    error[ERROR_PHASE], error[ERROR_PEER], error[ERROR_THEIRS] = PHASE_COMBINE, 1, STATUS_REJECTED
    error[ERROR_CALL] = 9
    with pytest.raises(EpPeerError, match="call 9 .*rank 1 rejected its input"):
        transport.check()
    assert not transport.failure_record.any() and not error[:ERROR_KERNEL_WORDS].any()
    own = EpPairBudgetError if code == FAILURE_PAIR_BUDGET else EpUnwrittenRowsError
    for recorded, raised in ((9, own), (8, EpPeerError)):  # only call 9's record is call 9's
        transport.failure_record[:] = torch.tensor([code, 96, 32, 11, recorded])
        error[ERROR_STATUS], error[ERROR_KIND] = ERROR_COMPLETE, KIND_REJECTED
        error[ERROR_PHASE], error[ERROR_PEER] = PHASE_COMBINE, 0
        error[ERROR_THEIRS], error[ERROR_CALL] = STATUS_UNUSABLE, 9
        with pytest.raises(raised, match="call 9 "):
            transport.check()
        assert not transport.failure_record.any()


@pytest.mark.parametrize("code", [FAILURE_PAIR_BUDGET, FAILURE_UNWRITTEN_ROWS])
def test_drop_abandoned_failure_waits_for_the_queued_kernels_then_clears(code, monkeypatch):
    """A call a reset() overtook (a signal handler's, nested in its experts) queued its
    finalize after the reset; that kernel reads calls done 0 and stores a record naming call 1,
    the next call's index. drop_abandoned_failure() waits for it (the store lands during the
    wait, as the queued kernel's would) and then zeroes the record, so a peer's rejection of
    the next call 1 raises EpPeerError naming the peer, not this rank's abandoned failure.
    Zeroing before the wait fails this (the store comes after the zeroing); without the drop,
    call 1's check raises this rank's EpPairBudgetError or EpUnwrittenRowsError."""
    error = torch.zeros(ERROR_WORDS, dtype=torch.int64)
    transport = transport_with(error, [])
    monkeypatch.setattr(transport, "capturing", lambda: False)
    waits: list[int] = []

    def the_queued_finalize_completes() -> None:
        waits.append(1)
        transport.failure_record[:] = torch.tensor([code, 96, 32, 11, 1])

    monkeypatch.setattr(transport, "_wait_stream", the_queued_finalize_completes)
    transport.drop_abandoned_failure()
    assert waits == [1] and not transport.failure_record.any()
    error[ERROR_STATUS], error[ERROR_KIND] = ERROR_COMPLETE, KIND_REJECTED
    error[ERROR_PHASE], error[ERROR_PEER], error[ERROR_THEIRS] = PHASE_COMBINE, 1, STATUS_REJECTED
    error[ERROR_CALL] = 1
    with pytest.raises(EpPeerError, match="call 1 .*rank 1 rejected its input"):
        transport.check()
    monkeypatch.setattr(transport, "capturing", lambda: True)
    transport.failure_record[:] = torch.tensor([code, 96, 32, 11, 1])
    transport.drop_abandoned_failure()  # inside a capture nothing queued has run: left alone
    assert waits == [1] and transport.failure_record.any()


LAUNCHES = {
    "dispatch": ("dispatch_launch", lambda t: t.dispatch(*STEP, tokens=1, rejected=None)),
    "combine": ("combine_launch", lambda t: t.combine(STEP[1], None, 1e-6, rejected=None)),
    "reject_dispatch": (
        "reject_launches",
        lambda t: t.dispatch(*STEP, tokens=1, rejected=ValueError("this rank's input")),
    ),
}
STEP = (torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32), None)


def launching_transport(monkeypatch) -> DeviceTransport:
    """transport_with, plus what dispatch, combine and reset() touch: the barriers of a
    one-rank group (its reset() completes alone), zeroable flags and state, no CUDA."""
    transport = transport_with(torch.zeros(ERROR_WORDS, dtype=torch.int64), [])
    transport.barriers = ObjectBarriers(StoreChannel(1), "obj", "the test's object")
    transport.buffers = SimpleNamespace(
        flags=torch.ones(4), layout=SimpleNamespace(latent=STEP[0].shape[1])
    )
    transport.state, transport.device, transport.timeout_s = torch.ones(4), "cpu", 1.0
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(transport, "_stream_handle", lambda: 0)
    return transport


@pytest.mark.parametrize("phase", list(LAUNCHES))
def test_a_launch_queued_after_a_nested_reset_refuses_calls_until_the_next_reset(
    phase, monkeypatch
):
    """A signal handler's reset() that runs after a call's last check (refuse_reset_in_call)
    and before its kernel is queued: that kernel reads the new epoch's zeroed state, so the
    peers' next call pairs with it (a dispatch with the abandoned call's rows; a combine whose
    "ready" flag points them at expert outputs not yet written). The call raises EpDesyncError
    (recovery "reset") naming the phase, and check() raises it at every later call until the
    next reset(). A launch in a call with no reset, and one outside any call, raise nothing.
    Before: the call went on as if launched in its own epoch (EpRouted then raised
    EpResetDuringCallError, recovery "none"), and this rank's next dispatch, reading the same
    zeroed call index, paired with the peers' call that had taken the stale launch for this
    rank's (read from the kernels' protocol; not run on a GPU)."""
    transport = launching_transport(monkeypatch)
    barriers = transport.barriers
    name, call = LAUNCHES[phase]
    launched: list[str] = []

    def launch(*args) -> None:
        launched.append("old epoch" if not barriers.reset_in_call() else "new epoch")

    def reset_then_launch(*args) -> None:
        transport.reset()  # the handler's, nested in the call
        launch()

    def launcher(run):
        return {"reject_dispatch": run} if name == "reject_launches" else run

    setattr(transport, name, launcher(launch))
    barriers.call.began = (barriers.epoch, barriers.reset_round)
    if phase == "reject_dispatch":
        with pytest.raises(ValueError, match="this rank's input"):
            call(transport)
    else:
        call(transport)  # no reset in the call: launched, nothing raised
    barriers.call.began = None
    setattr(transport, name, launcher(reset_then_launch))
    with pytest.raises(EpDesyncError, match=f"before its {phase} kernel was queued") as info:
        barriers.call.began = (barriers.epoch, barriers.reset_round)
        try:
            call(transport)
        finally:
            barriers.call.began = None
    assert info.value.recovery == RECOVERY_RESET
    if phase == "reject_dispatch":  # the caller's rejection, which the kernel carried
        assert isinstance(info.value.__cause__, ValueError)
    assert launched == ["old epoch", "new epoch"]
    for _ in range(2):
        with pytest.raises(EpDesyncError, match=f"before its {phase} kernel was queued"):
            transport.check()
    transport.reset()
    transport.check()
    assert transport.launched_after_reset is None
    setattr(transport, name, launcher(reset_then_launch))
    if phase == "reject_dispatch":  # outside a call a reset abandons nothing
        with pytest.raises(ValueError, match="this rank's input"):
            call(transport)
    else:
        call(transport)
    assert transport.launched_after_reset is None


def test_step_failure_tag_halves_rebuild_the_tag():
    """StepFailure.tag_halves: two int32 values whose (high << 32) | (low & 0xFFFFFFFF) is the
    tag, for the extremes of int64 and the library's tag kinds."""
    for tag in (0, 1, -1, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63), -(1 << 62) + 12345):
        status, record = torch.zeros(1, dtype=torch.int64), new_record(pinned=False)
        high, low = StepFailure(status, record, tag).tag_halves()
        assert -(2**31) <= high < 2**31 and -(2**31) <= low < 2**31
        assert (high << 32) | (low & 0xFFFFFFFF) == tag


def test_step_failure_refuses_words_the_kernels_cannot_use():
    """The kernels store FAILURE_WORDS words into the record and read one of status and
    calls_done whatever they are given: a 4-word record (the format before the call word) had
    the word after it overwritten, an empty calls_done was read out of bounds (a careless-user
    probe). StepFailure refuses them, and a tag that is not an int64, naming the field."""
    status, record = torch.zeros(1, dtype=torch.int64), new_record(pinned=False)
    calls = torch.zeros(1, dtype=torch.int64)
    assert StepFailure(status, record, np.int64(-5), calls).tag == -5
    bad = [
        ((status, record[:4], 0), ValueError, r"record shape \(4,\); expected \[5\]"),
        ((status, torch.zeros(10, dtype=torch.int64)[::2], 0), ValueError, "not contiguous"),
        ((status, record.int(), 0), TypeError, "record is torch.int32; expected an int64 tensor"),
        ((status.view(1, 1), record, 0), ValueError, r"status shape \(1, 1\)"),
        ((None, record, 0), TypeError, "status is NoneType"),
        ((status, record, 0, torch.zeros(0, dtype=torch.int64)), ValueError, "calls_done shape"),
        ((status, record, 0, 6), TypeError, "calls_done is int; expected an int64 tensor"),
        ((status, record, 2**63), ValueError, "tag=9223372036854775808; expected an int64"),
        ((status, record, 1.5), TypeError, "StepFailure: tag=1.5; expected an int"),
    ]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            StepFailure(*args)


def test_failure_error_reads_call_zero_as_any_and_refuses_unknown_codes_of_any_call():
    """A record stored without a call index (0) is taken as the rejected call's, and a code no
    kernel stores raises whatever call it names (a stale-looking stray write is not hidden)."""
    record = torch.tensor([FAILURE_PAIR_BUDGET, 9, 8, 3, 0])
    assert isinstance(failure_error(record, "where", "outcome", call=7), EpPairBudgetError)
    for recorded in (1, 2):
        with pytest.raises(RuntimeError, match="unknown experts failure code 9"):
            failure_error(torch.tensor([9, 9, 8, 1, recorded]), "where", "outcome", call=2)
