"""unwritten_rows_kernel (ep/unwritten_rows_kernel.py) in Triton's CPU interpreter against the
torch form (ep/unwritten_rows.count_unwritten and UnwrittenRows' CPU path), in its own process:

    TRITON_INTERPRET=1 python -m helpers.unwritten_rows_case SEED   (from tests/)

Per case, fresh random rows: bf16 outputs of random values with NaNs of the payloads arithmetic
gives (0x7FC0, 0xFFC0, 0x7FFF) among them, ids with -1 where the row's expert is not this rank's
(rows with none included), the mark on a random subset of rows, with and without a local id,
and guard rows past the end (marked, with local ids). Row counts below, at and past the
kernel's block (several programs and a part block), top-k 8, 16 and 6 (not a power of two),
rows wider apart than the latent (a strided view), tags of either sign and past 32 bits.
Checked: the status word and the record against the torch form (the status starts as a poison word
the kernel must leave alone when no row is missing) with the step's call index from the transport's
calls done, a record already holding another failure (of the call or an earlier one) left as it is
while the status is still set, two launches on the same scratch words (as two replays of a graph)
giving the same record and leaving the scratch zero, and marks only on rows without a local id
counted as nothing. Prints "ok ..." or raises naming the seed and the case.
"""

from __future__ import annotations

import os
import sys

import torch

from dep_ep.comm.failure import (
    FAILURE_PAIR_BUDGET,
    FAILURE_UNWRITTEN_ROWS,
    FAILURE_WORDS,
    StepFailure,
)
from dep_ep.constants import KIND_EXPERTS
from dep_ep.ep.unwritten_rows import (
    SCRATCH_WORDS,
    UNWRITTEN_ROW_MARK,
    UnwrittenRows,
    count_unwritten,
    launch_check,
)

# Arithmetic's NaNs (GPU, CPU and its negative): never taken for the mark.
ARITHMETIC_NANS = (0x7FC0, 0xFFC0 - 0x10000, 0x7FFF)
BLOCK = 64  # rows a program here: several programs at these row counts
POISON = -12345  # the status word's value before a launch that must not store into it


def case_rows(gen, rows: int, latent: int, stride: int, topk: int):
    """(out bf16 [rows, latent] with rows `stride` apart, ids int32 [rows, topk]), each the
    first rows of a tensor whose BLOCK rows past them are marked and hold local ids (guard rows
    a kernel reading past the rows would count)."""
    storage = torch.randn(rows + BLOCK, stride, generator=gen).to(torch.bfloat16)
    storage[rows:, 0] = torch.tensor(UNWRITTEN_ROW_MARK, dtype=torch.int16).view(torch.bfloat16)
    all_ids = torch.zeros(rows + BLOCK, topk, dtype=torch.int32)
    out, ids = storage[:rows, :latent], all_ids[:rows]
    bits = out.view(torch.int16)
    nans = torch.randint(0, len(ARITHMETIC_NANS), (rows,), generator=gen)
    some = torch.rand(rows, generator=gen) < 0.2
    bits[some, 0] = torch.tensor(ARITHMETIC_NANS, dtype=torch.int16)[nans[some]]
    ids.copy_(torch.randint(0, 896, (rows, topk), dtype=torch.int32, generator=gen))
    ids[torch.rand(rows, topk, generator=gen) < 0.8] = -1
    ids[torch.rand(rows, generator=gen) < 0.3] = -1  # rows with no local id
    marked = torch.rand(rows, generator=gen) < 0.25
    bits[marked, 0] = UNWRITTEN_ROW_MARK
    return out, ids


# The transport's calls done in these cases: the step is call CALLS_DONE + 1.
CALLS_DONE = 41


def run(out, ids, tag: int, record_before: list[int], status_before: int):
    """The kernel's (status, record, scratch) from the given starting words, fresh scratch, the
    step's call CALLS_DONE + 1."""
    status = torch.tensor([status_before], dtype=torch.int64)
    record = torch.tensor(record_before, dtype=torch.int64)
    scratch = torch.zeros(SCRATCH_WORDS, dtype=torch.int64)
    calls_done = torch.tensor([CALLS_DONE])
    launch_check(out, ids, scratch, StepFailure(status, record, tag, calls_done), block=BLOCK)
    return int(status[0]), record.tolist(), scratch.tolist()


def check_case(seed, gen, rows, latent, stride, topk, tag) -> int:
    where = f"seed {seed}, rows {rows}, latent {latent}, stride {stride}, topk {topk}, tag {tag}"
    out, ids = case_rows(gen, rows, latent, stride, topk)
    missing = int(count_unwritten(out, ids))
    # The torch form of the same case, as the CPU transport runs it.
    cpu_status = torch.zeros(1, dtype=torch.int64)
    cpu_record = torch.zeros(FAILURE_WORDS, dtype=torch.int64)
    calls_done = torch.tensor([CALLS_DONE])
    cpu_failure = StepFailure(cpu_status, cpu_record, tag, calls_done)
    UnwrittenRows(torch.device("cpu")).fail_step(out, ids, cpu_failure)
    call = CALLS_DONE + 1
    if missing:
        want_status = KIND_EXPERTS
        want_record = [FAILURE_UNWRITTEN_ROWS, missing, rows, tag, call]
    else:
        want_status, want_record = 0, [0] * FAILURE_WORDS
    assert (int(cpu_status[0]), cpu_record.tolist()) == (want_status, want_record), where
    # Two launches on the same words, as two replays of a graph, the host reading (zeroing) the
    # record and the dispatch zeroing the status in between: the same result each time.
    scratch = torch.zeros(SCRATCH_WORDS, dtype=torch.int64)
    status, record = (
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(FAILURE_WORDS, dtype=torch.int64),
    )
    for replay in range(2):
        status.fill_(POISON)
        record.zero_()
        launch_check(out, ids, scratch, StepFailure(status, record, tag, calls_done), block=BLOCK)
        got = (int(status[0]), record.tolist(), scratch.tolist())
        want = (KIND_EXPERTS if missing else POISON, want_record, [0] * SCRATCH_WORDS)
        assert got == want, f"{where}, launch {replay}: (status, record, scratch) {got} != {want}"
    # Another failure recorded first (the pair budget, of this call or an earlier one) stays;
    # the status is still set.
    for held in (call, call - 3):
        other = [FAILURE_PAIR_BUDGET, 77, 66, 5, held]
        status, record, _ = run(out, ids, tag, other, 0)
        assert record == other, f"{where}: an earlier record was overwritten: {record}"
        assert status == (KIND_EXPERTS if missing else 0), f"{where}: status {status}"
    return missing


def main(seed: int) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(seed)
    cases = [
        (1, 32, 32, 8, 3),
        (BLOCK, 64, 64, 16, -1),
        (BLOCK + 1, 32, 48, 6, (7 << 40) + 123),
        (5 * BLOCK - 3, 128, 128, 16, -(1 << 33) - 9),
        (300, 64, 96, 16, 2**31 + 5),
    ]
    missing = [check_case(seed, gen, *case) for case in cases]
    assert any(missing), f"seed {seed}: no case had a missing row"
    # A case with marks only on rows without a local id, and one with no mark: nothing stored.
    out, ids = case_rows(gen, 200, 64, 64, 16)
    ids[out[:, 0].view(torch.int16) == UNWRITTEN_ROW_MARK] = -1
    status, record, _ = run(out, ids, 9, [0] * FAILURE_WORDS, POISON)
    assert (status, record) == (POISON, [0] * FAILURE_WORDS), f"seed {seed}: marks without ids"
    print(f"ok seed {seed}: missing rows {missing}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
