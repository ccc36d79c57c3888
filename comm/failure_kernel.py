"""store_failure: the Triton store of a step's failure into its failure record (comm/failure.py),
shared by the kernels that fail a step on the device: HopperExperts' finalize_kernel
(experts/hopper/kernels.py) and check_expert_rows' unwritten_rows_kernel
(ep/unwritten_rows_kernel.py). Only those kernel modules import it (Triton is not a core
dependency)."""

from __future__ import annotations

import triton
import triton.language as tl

from dep_ep.comm.failure import (
    FAILURE_CALL,
    FAILURE_CODE,
    FAILURE_COUNT,
    FAILURE_LIMIT,
    FAILURE_TAG,
)

FAILURE_CODE_C = tl.constexpr(FAILURE_CODE)
FAILURE_COUNT_C = tl.constexpr(FAILURE_COUNT)
FAILURE_LIMIT_C = tl.constexpr(FAILURE_LIMIT)
FAILURE_TAG_C = tl.constexpr(FAILURE_TAG)
FAILURE_CALL_C = tl.constexpr(FAILURE_CALL)


@triton.jit
def store_failure(
    record_ptr, code, count, limit, tag_high, tag_low, calls_done_ptr, HAS_CALL: tl.constexpr
):
    """record int64 [FAILURE_WORDS] := [code, count, limit, tag, call] when its code word is 0
    (the first failure since the host read it wins: a record is never rewritten, so the code
    stored last keeps a host read from seeing a part-written one). tag = (tag_high << 32) |
    (tag_low & 0xFFFFFFFF) from StepFailure.tag_halves; call = calls_done[0] + 1 with HAS_CALL
    (the transport's calls done, int64 [1]), else 0. One program stores it (no atomics: the
    callers elect it)."""
    if tl.load(record_ptr + FAILURE_CODE_C) == 0:
        if HAS_CALL:
            call = tl.load(calls_done_ptr) + 1
        else:
            call = tl.zeros([], dtype=tl.int64)
        tag = (tag_high.to(tl.int64) << 32) | (tag_low.to(tl.int64) & 0xFFFFFFFF)
        tl.store(record_ptr + FAILURE_COUNT_C, count.to(tl.int64))
        tl.store(record_ptr + FAILURE_LIMIT_C, limit.to(tl.int64))
        tl.store(record_ptr + FAILURE_TAG_C, tag)
        tl.store(record_ptr + FAILURE_CALL_C, call)
        tl.store(record_ptr + FAILURE_CODE_C, code)
