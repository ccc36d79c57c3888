"""unwritten_rows_kernel: EpConfig.check_expert_rows' check on the GPU (ep/unwritten_rows.py
launches it), in Triton; tests/helpers/unwritten_rows_case.py runs it in Triton's CPU interpreter
against the torch form (`unwritten_rows.count_unwritten`).

Grid (ceil(R / BLOCK),). Program p reads element 0 of its BLOCK expert output rows (the int16
view of bf16 out [R, L], one 2-byte load a row), and the ids of the rows that still hold the
mark (int32 [R, K]; the other rows' ids are not loaded). A row is missing when it holds the mark
and a local id (>= 0). A program that finds any adds its count into scratch word 0 and stores
KIND_EXPERTS into the step status word; every program then counts itself done in scratch word 1.
The last program done reads the total and zeroes both scratch words (so a CUDA graph replays the
launch from zero), and when the total is nonzero and the record's code word is 0 (the first failure
since the host read it wins) stores [FAILURE_UNWRITTEN_ROWS, total, R, tag, call] into the record,
the code last (comm/failure_kernel.py's store_failure). The atomics are acquire-release at GPU
scope: a program's count is added before its done count, so the last program reads every count.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dep_ep.comm.failure import FAILURE_UNWRITTEN_ROWS
from dep_ep.comm.failure_kernel import store_failure
from dep_ep.constants import KIND_EXPERTS

KIND_EXPERTS_C = tl.constexpr(KIND_EXPERTS)
FAILURE_UNWRITTEN_ROWS_C = tl.constexpr(FAILURE_UNWRITTEN_ROWS)
# The pointers read or written one word at a time: not specialised on 16-byte alignment (the
# status word lies 8 bytes into the device transport's state, where a warm-up's is a fresh
# allocation; a specialisation would compile the kernel again for the capture after a warm-up).
SCALAR_POINTERS = ("scratch_ptr", "status_ptr", "record_ptr", "calls_done_ptr")


# rows follows T and the tag's halves vary per step: specialising on them (the value 1, or
# divisibility by 16) would compile again for a new T or tag, mid-serving or inside a capture.
@triton.jit(
    do_not_specialize=["rows", "tag_high", "tag_low"],
    do_not_specialize_on_alignment=SCALAR_POINTERS,
)
def unwritten_rows_kernel(
    marks_ptr,
    ids_ptr,
    scratch_ptr,
    status_ptr,
    record_ptr,
    calls_done_ptr,
    rows,
    tag_high,
    tag_low,
    HAS_CALL: tl.constexpr,
    MARK: tl.constexpr,
    OUT_STRIDE: tl.constexpr,
    IDS_STRIDE: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_POW2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """marks int16 [R, L] (out's bits, rows OUT_STRIDE apart), ids int32 [R, TOPK] (rows
    IDS_STRIDE apart), scratch int64 [2] (zero before the launch, zero after it), status int64
    [1], record int64 [FAILURE_WORDS], calls_done int64 [1] (read with HAS_CALL); the module
    docstring."""
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = row < rows
    mark = tl.load(marks_ptr + row.to(tl.int64) * OUT_STRIDE, mask=inside, other=0)
    marked = inside & (mark == MARK)
    k = tl.arange(0, TOPK_POW2)
    ids = tl.load(
        ids_ptr + row.to(tl.int64)[:, None] * IDS_STRIDE + k[None, :],
        mask=marked[:, None] & (k[None, :] < TOPK),
        other=-1,
    )
    missing = tl.sum((tl.max(ids, axis=1) >= 0).to(tl.int64), axis=0)
    if missing > 0:
        tl.atomic_add(scratch_ptr, missing, sem="acq_rel", scope="gpu")
        tl.store(status_ptr, KIND_EXPERTS_C)
    done = tl.atomic_add(scratch_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        total = tl.atomic_xchg(scratch_ptr, 0, sem="acq_rel", scope="gpu")
        tl.atomic_xchg(scratch_ptr + 1, 0, sem="acq_rel", scope="gpu")
        if total > 0:
            store_failure(
                record_ptr,
                FAILURE_UNWRITTEN_ROWS_C,
                total,
                rows,
                tag_high,
                tag_low,
                calls_done_ptr,
                HAS_CALL,
            )
