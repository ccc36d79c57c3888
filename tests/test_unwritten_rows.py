"""check_expert_rows' check (ep/unwritten_rows.py): the GPU kernel in Triton's CPU interpreter
against the torch form on fresh random rows, the torch form itself, and the failure record's
error. The check end to end on CPU ranks: tests/test_reliability_mpi.py::test_split_api_misuse;
on GPU: tests/gpu/test_gpu_reliability.py::test_unwritten_rows_fail_every_rank_eager_and_replayed.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from dep_ep.comm import EpPairBudgetError, EpUnwrittenRowsError
from dep_ep.comm.failure import (
    FAILURE_PAIR_BUDGET,
    FAILURE_UNWRITTEN_ROWS,
    StepFailure,
    failure_error,
)
from dep_ep.constants import KIND_EXPERTS
from dep_ep.ep.unwritten_rows import UNWRITTEN_ROW_MARK, UnwrittenRows, count_unwritten, mark_rows

from helpers.interpreter import HAVE_TRITON, NO_TRITON, run_in_interpreter


def test_mark_is_a_nan_no_arithmetic_gives() -> None:
    """The mark is bf16 NaN 0xFFA5, none of the NaNs arithmetic gives on CPU (0x7FC0, 0xFFC0,
    after rounding to bf16) nor the GPU's canonical 0x7FFF; mark_rows writes it into element 0
    of every row and nowhere else."""
    bits = UNWRITTEN_ROW_MARK & 0xFFFF
    assert bits == 0xFFA5
    mark = torch.tensor(UNWRITTEN_ROW_MARK, dtype=torch.int16).view(torch.bfloat16)
    assert mark.isnan()
    made = torch.stack(
        [
            torch.tensor(float("inf")) - torch.tensor(float("inf")),
            torch.tensor(0.0) / torch.tensor(0.0),
            -(torch.tensor(0.0) / torch.tensor(0.0)),
            torch.tensor(float("nan")) * torch.tensor(3.0),
        ]
    ).to(torch.bfloat16)
    assert not (made.view(torch.int16) == UNWRITTEN_ROW_MARK).any(), made.view(torch.int16)
    out = torch.randn(5, 8).to(torch.bfloat16)
    before = out.clone()
    mark_rows(out)
    assert (out[:, 0].view(torch.int16) == UNWRITTEN_ROW_MARK).all()
    assert torch.equal(out[:, 1:].view(torch.int16), before[:, 1:].view(torch.int16))


def test_cpu_check_counts_and_keeps_the_first_failure() -> None:
    """The torch form: rows with a local id and the mark count, marked rows without one do not;
    the status and record are stored only when a row is missing, and a record already holding a
    failure stays as it is."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    out = torch.randn(40, 16, generator=gen).to(torch.bfloat16)
    ids = torch.full((40, 4), -1, dtype=torch.int32)
    ids[::3, 1] = 7  # rows 0, 3, ... hold a local id
    mark_rows(out)
    out[::2, 0] = 1.0  # the even rows were written
    want = len([r for r in range(40) if r % 3 == 0 and r % 2 == 1])
    assert int(count_unwritten(out, ids)) == want
    check = UnwrittenRows(torch.device("cpu"))
    status, record = torch.zeros(1, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)
    check.fail_step(out, ids, StepFailure(status, record, tag=-3))
    assert int(status[0]) == KIND_EXPERTS
    assert record.tolist() == [FAILURE_UNWRITTEN_ROWS, want, 40, -3, 0]  # no call index
    earlier = [FAILURE_PAIR_BUDGET, 9, 8, 1, 0]
    status.zero_()
    record.copy_(torch.tensor(earlier))
    check.fail_step(out, ids, StepFailure(status, record, tag=5))
    assert int(status[0]) == KIND_EXPERTS and record.tolist() == earlier
    # With the transport's calls done (6: this is call 7) the record holds call 7; a record
    # already there stays, whatever its call.
    calls_done = torch.tensor([6])
    record.zero_()
    check.fail_step(out, ids, StepFailure(status, record, 5, calls_done))
    assert record.tolist() == [FAILURE_UNWRITTEN_ROWS, want, 40, 5, 7]
    for held in (7, 3):
        record.copy_(torch.tensor([FAILURE_PAIR_BUDGET, 9, 8, 1, held]))
        check.fail_step(out, ids, StepFailure(status, record, 5, calls_done))
        assert record.tolist() == [FAILURE_PAIR_BUDGET, 9, 8, 1, held]
    out[:, 0] = 0.0  # every row written: nothing stored
    status.zero_()
    record.zero_()
    check.fail_step(out, ids, StepFailure(status, record, tag=5))
    assert int(status[0]) == 0 and record.tolist() == [0, 0, 0, 0, 0]


def test_cpu_check_refuses_rows_of_other_counts() -> None:
    """The torch form refuses out and ids of different row counts, as the kernel's launch does
    (torch broadcast one row of ids over every row of out: 4 rows counted missing of 1 checked,
    found by a careless-user probe)."""
    out = torch.zeros(4, 16, dtype=torch.bfloat16)
    mark_rows(out)
    ids = torch.zeros(1, 4, dtype=torch.int32)
    status, record = torch.zeros(1, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)
    check = UnwrittenRows(torch.device("cpu"))
    for a, b in ((out, ids), (out[:1], ids.expand(4, 4))):
        with pytest.raises(ValueError, match="expected as many rows"):
            check.fail_step(a, b, StepFailure(status, record, 0))
    assert not status.any() and not record.any()


def test_a_stale_record_raises_nothing() -> None:
    """failure_error drops (zeroes, returns None for) the failure of another call than the one
    being raised, the GPU transport's double-fault case (a failed step's kernel storing its
    record after check() cleared it, read at a later peer rejection)."""
    held = torch.tensor([FAILURE_PAIR_BUDGET, 9, 8, 1, 4])
    stale = held.clone()
    assert failure_error(stale, "where", "outcome", call=5) is None
    assert stale.tolist() == [0, 0, 0, 0, 0]
    current = held.clone()
    assert isinstance(failure_error(current, "where", "outcome", call=4), EpPairBudgetError)
    assert current.tolist() == [0, 0, 0, 0, 0]
    unknown = held.clone()  # call 0: the host transport, which reads its record in the call
    assert isinstance(failure_error(unknown, "where", "outcome"), EpPairBudgetError)


def test_record_reads_as_unwritten_rows_error() -> None:
    """failure_error turns the record into EpUnwrittenRowsError (a ValueError) with the counts
    and the tag, zeroing the record; an unknown code is a RuntimeError."""
    record = torch.tensor([FAILURE_UNWRITTEN_ROWS, 3, 64, 12, 4], dtype=torch.int64)
    err = failure_error(record, "EpRouted (rank 1): call 4 (combine)", "the outcome", call=4)
    assert isinstance(err, EpUnwrittenRowsError) and isinstance(err, ValueError)
    assert (err.rows, err.checked, err.tag, err.recovery) == (3, 64, 12, "none")
    assert "3 of this rank's 64 receive row(s)" in str(err) and "tag 12" in str(err)
    assert "the outcome" in str(err)
    assert record.tolist() == [0, 0, 0, 0, 0]
    with pytest.raises(RuntimeError, match="unknown experts failure code 9"):
        failure_error(torch.tensor([9, 1, 2, 3, 0]), "where", "outcome")


@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
def test_kernel_compiles_for_sm90_with_and_without_a_call_index() -> None:
    """unwritten_rows_kernel compiles for SM90 here (no GPU) as both launches compile it: with a
    count of calls done (a transport's StepFailure, HAS_CALL) and without (a StepFailure built
    without one); the call index costs one more 8-byte global load, of the calls-done word, and
    the record's five words are stored in both."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton's interpreter compiles nothing")
    from dep_ep.ep.unwritten_rows_kernel import unwritten_rows_kernel

    from helpers.ptx import sm90_ptx

    signature = {
        "marks_ptr": "*i16",
        "ids_ptr": "*i32",
        "scratch_ptr": "*i64",
        "status_ptr": "*i64",
        "record_ptr": "*i64",
        "calls_done_ptr": "*i64",
        "rows": "i32",
        "tag_high": "i32",
        "tag_low": "i32",
    }
    constants = dict(MARK=-91, OUT_STRIDE=64, IDS_STRIDE=16, TOPK=16, TOPK_POW2=16, BLOCK=256)
    loads, stores = {}, {}
    for has_call in (True, False):
        code = sm90_ptx(unwritten_rows_kernel, signature, {**constants, "HAS_CALL": has_call})
        loads[has_call] = len(re.findall(r"ld\.global[\w.]*\.[bu]64", code))
        stores[has_call] = len(re.findall(r"st\.global[\w.]*\.[bu]64", code))
    assert loads[True] == loads[False] + 1, loads
    assert stores[True] == stores[False] == 5 + 1, stores  # the record, and the status word


@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
def test_kernel_in_interpreter_equals_torch() -> None:
    """unwritten_rows_kernel against the torch form (tests/helpers/unwritten_rows_case.py)."""
    seed = int(torch.randint(0, 2**31, (1,)))
    run_in_interpreter("helpers.unwritten_rows_case", str(seed), expect=f"ok seed {seed}")
