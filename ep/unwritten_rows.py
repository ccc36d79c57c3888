"""EpConfig.check_expert_rows: find receive rows the experts left unwritten, and fail the step on
every rank before its combine sums them, with no host synchronisation.

The row contract (docs/design.md) has the experts write `out` for every receive row with a local
id; a backend that skips a row, or a split-API caller who combines without running the experts,
would otherwise have the combine sum whatever the row held (the previous step's values). So:
- the dispatch marks every expert output row of the step (`mark_rows`): UNWRITTEN_ROW_MARK in
  element 0, the bf16 bits 0xFFA5, a NaN whose payload no arithmetic produces (GPU arithmetic
  gives 0x7FFF, CPU arithmetic 0x7FC0 or 0xFFC0);
- the experts overwrite the rows they own (a row counts as written once its element 0 changed: a
  backend that fills `out` first, with zeros say, and then skips rows, or writes element 0
  alone, is not caught);
- before the combine, `UnwrittenRows.fail_step` counts the rows that hold a local id (>= 0) and
  still hold the mark, and when there are any fails the step through its StepFailure
  (comm/failure.py), as an experts backend fails a step it cannot compute: KIND_EXPERTS into the
  step status word, [FAILURE_UNWRITTEN_ROWS, rows missing, rows checked, tag, call] into the
  failure record when its code is 0. The combine then fails the step on every rank: on CPU in
  the call (this rank EpUnwrittenRowsError, the peers EpPeerError naming it); on GPU every rank's
  output of the step is NaN and the errors come at the next call, poll() or synchronize().
On CPU the count is a few torch operations on the rows; on GPU one launch of
unwritten_rows_kernel (ep/unwritten_rows_kernel.py) on the rows' device and its current stream,
built to be captured in a CUDA graph (fixed addresses, the tag a launch argument; eager and
replayed in tests/gpu/test_gpu_reliability.py, run on one H200 shared by 2 processes).
"""

from __future__ import annotations

import contextlib

import torch

from dep_ep.comm.failure import (
    FAILURE_CODE,
    FAILURE_UNWRITTEN_ROWS,
    StepFailure,
    warmup_failure,
)
from dep_ep.constants import KIND_EXPERTS

# bf16 bits 0xFFA5 as int16: element 0 of every expert output row at dispatch.
UNWRITTEN_ROW_MARK = -91
# Rows a program of unwritten_rows_kernel checks (one 2-byte load each).
CHECK_BLOCK = 256
# The kernel's scratch words: the missing rows counted, the programs done.
SCRATCH_WORDS = 2


def mark_rows(out: torch.Tensor) -> None:
    """Store UNWRITTEN_ROW_MARK into element 0 of every row of `out` (bf16 [R, L])."""
    out[:, 0].view(torch.int16).fill_(UNWRITTEN_ROW_MARK)


def count_unwritten(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The rows of `out` (bf16 [R, L]) that hold a local id in `ids` (int32 [R, K], -1 = not this
    rank's) and still hold the mark: int64 [] on out's device (no host read)."""
    marked = out[:, 0].view(torch.int16) == UNWRITTEN_ROW_MARK
    return ((ids >= 0).any(dim=1) & marked).sum()


class UnwrittenRows:
    """The check of one EpRouted (module docstring). `device` is the rows' device; on CUDA it
    holds the kernel's scratch words (int64 [SCRATCH_WORDS], zero between launches)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.scratch = None
        if device.type == "cuda":
            kernel_module()  # a missing Triton fails the construction, not a step
            self.scratch = torch.zeros(SCRATCH_WORDS, dtype=torch.int64, device=device)

    def fail_step(self, out: torch.Tensor, ids: torch.Tensor, failure: StepFailure) -> None:
        """Fail the step through `failure` when rows of `out` (bf16 [R, L]) with a local id in
        `ids` (int32 [R, K]) still hold the mark; stream-ordered before the combine on GPU."""
        if self.scratch is None:
            if out.shape[0] != ids.shape[0]:  # torch would broadcast one row of ids over out
                raise ValueError(
                    f"UnwrittenRows.fail_step: out {tuple(out.shape)} and ids {tuple(ids.shape)};"
                    " expected as many rows"
                )
            missing = int(count_unwritten(out, ids))
            if missing:
                failure.status.fill_(KIND_EXPERTS)
                if int(failure.record[FAILURE_CODE]) == 0:
                    call = 0 if failure.calls_done is None else int(failure.calls_done[0]) + 1
                    words = [missing, out.shape[0], failure.tag, call]
                    failure.record[1:] = torch.tensor(words)
                    failure.record[0] = FAILURE_UNWRITTEN_ROWS
            return
        launch_check(out, ids, self.scratch, failure)

    def warmup(self, out: torch.Tensor, ids: torch.Tensor) -> None:
        """On CUDA, compile the check (once per object: T is a runtime argument) by one launch
        over these rows that stores into words of its own only (not this object's scratch,
        which a step on another stream may be using), so that a CUDA-graph capture compiles
        nothing; the rows are read, not changed. Nothing on CPU."""
        if self.scratch is None:
            return
        scratch = torch.zeros(SCRATCH_WORDS, dtype=torch.int64, device=self.device)
        launch_check(out, ids, scratch, warmup_failure(self.device))


def launch_check(
    out: torch.Tensor,
    ids: torch.Tensor,
    scratch: torch.Tensor,
    failure: StepFailure,
    block: int = CHECK_BLOCK,
) -> None:
    """One launch of unwritten_rows_kernel over the rows of `out` (bf16 [R, L]) and `ids` (int32
    [R, K]), `block` rows a program, `scratch` int64 [SCRATCH_WORDS] zero (and zero again after
    it): on the rows' GPU and its current stream, or in Triton's CPU interpreter on CPU
    tensors."""
    rows, topk = ids.shape
    if out.shape[0] != rows or out.stride(1) != 1 or ids.stride(1) != 1:
        raise ValueError(
            f"launch_check: out {tuple(out.shape)} (strides {out.stride()}) and ids"
            f" {tuple(ids.shape)} (strides {ids.stride()}); expected as many rows, each"
            " contiguous"
        )
    high, low = failure.tag_halves()
    kernel = kernel_module().unwritten_rows_kernel
    # Triton launches on the current device: the rows' device, so that the check is ordered
    # with the experts and the combine on that device's current stream.
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        kernel[(-(-rows // block),)](
            out.view(torch.int16),
            ids,
            scratch,
            failure.status,
            failure.record,
            failure.calls_done,
            rows,
            high,
            low,
            HAS_CALL=failure.calls_done is not None,
            MARK=UNWRITTEN_ROW_MARK,
            OUT_STRIDE=out.stride(0),
            IDS_STRIDE=ids.stride(0),
            TOPK=topk,
            TOPK_POW2=1 << (topk - 1).bit_length(),  # the next power of two
            BLOCK=block,
        )


def kernel_module():
    """ep/unwritten_rows_kernel.py, imported on first use (Triton is not a core dependency);
    ImportError with the pip line when Triton is missing."""
    try:
        from dep_ep.ep import unwritten_rows_kernel
    except ImportError as err:
        raise ImportError(
            "EpConfig(check_expert_rows=True) on CUDA runs a Triton kernel, and Triton is not"
            " importable: pip install -e '.[gpu]' (or a torch build that brings triton)"
        ) from err
    return unwritten_rows_kernel
