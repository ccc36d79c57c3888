"""StepFailure: how an experts backend fails a step on the device, for every rank, with no host
synchronisation (docs/design.md, "Experts failures on the device").

A transport hands EpRouted one per step (`Transport.step_failure(tag)`), and EpRouted hands it to
a backend whose `device_failures` is True (experts/base.py). The backend, when a call cannot be
computed (HopperExperts: more (row, local expert) pairs than its pair budget), does two stores
from its own kernels, stream-ordered before the step's combine:
- `status`: KIND_EXPERTS into the transport's step status word. The combine reads that word:
  on GPU (comm/kernels/combine.py) a nonzero status makes this rank publish STATUS_UNUSABLE in
  its ready flag, so every rank marks its tokens of the step NaN and the peers record the
  rejection (EpPeerError at their next call, poll() or synchronize()); this rank records its own
  flag and raises the failure below at the same point. On CPU (comm/host_transport.py) the
  combine fails the call on every rank in that call.
- `record`, when its code word is still 0 (the first failure since the host read it wins, as
  the first error wins in the transport's error record): [code, count, limit, tag, call], the
  code last. Host-readable without a sync (host-mapped pinned memory on GPU, CPU memory on CPU);
  the transport turns it into the error this rank raises (`failure_error`) and zeroes it.
  `call` is the step's call index, read on the device from the transport's count of calls done
  (`StepFailure.calls_done`, the GPU state's STATE_CALL word, + 1), so a graph replay records its
  own call; 0: none (the host transport, whose combine reads the record in the same call). The
  GPU transport reads the record at its next call without a sync, and kernels of a failed step
  still queued then may store it after it was cleared (a step with two faults, whose first
  error was of another kind): a later step's rejection finds a record of another call, drops it
  and raises the rejection as it is (`failure_error`'s `call`), unless its code is none a kernel
  stores (a stray write: RuntimeError, whatever call it names).
EpRouted fails a step the same way under EpConfig.check_expert_rows when the experts left receive
rows unwritten (ep/unwritten_rows.py; code FAILURE_UNWRITTEN_ROWS).
The dispatch of every step zeroes the status word (GPU: the dispatch kernel; CPU: the host
transport), so the next step runs as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dep_ep.checks import check_int
from dep_ep.comm.errors import EpPairBudgetError, EpUnwrittenRowsError, tag_text

# The record's words (int64) and its codes.
FAILURE_WORDS = 5
FAILURE_CODE, FAILURE_COUNT, FAILURE_LIMIT, FAILURE_TAG, FAILURE_CALL = 0, 1, 2, 3, 4
FAILURE_PAIR_BUDGET = 1  # count: the call's (row, local expert) pairs; limit: its pair budget
# EpConfig.check_expert_rows (ep/unwritten_rows.py), count: the receive rows with a local id the
# experts left unwritten; limit: the step's receive rows checked.
FAILURE_UNWRITTEN_ROWS = 2


@dataclass(frozen=True)
class StepFailure:
    """Where a backend fails the current step (module docstring): `status` int64 [1] on the
    experts' device (the transport's step status word), `record` int64 [FAILURE_WORDS] the host
    reads without a sync, `tag` the step's tag (the one its dispatch sent; a CUDA graph replays
    the tag it was captured with, as the transport's kernels do), `calls_done` int64 [1] on the
    experts' device: the transport's count of calls done, which the step's call index exceeds by
    1 until its combine counts it (None: no call index, the record's call word stays 0)."""

    status: torch.Tensor
    record: torch.Tensor
    tag: int
    calls_done: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # The kernels store FAILURE_WORDS words into the record and read one word of status and
        # calls_done, whatever they are given: a 4-word record (the format before the call
        # word) had the word after it overwritten (a careless-user probe). About 1.2 us a step
        # on a loaded 2-core x86 host (1.7 against 0.5-0.6 for the bare dataclass, timeit).
        check_words("status", self.status, 1)
        check_words("record", self.record, FAILURE_WORDS)
        if self.calls_done is not None:
            check_words("calls_done", self.calls_done, 1)
        if type(self.tag) is not int:
            object.__setattr__(self, "tag", check_int("StepFailure", "tag", self.tag))
        if not -(2**63) <= self.tag < 2**63:
            raise ValueError(f"StepFailure: tag={self.tag}; expected an int64")

    def tag_halves(self) -> tuple[int, int]:
        """The tag as two signed 32-bit ints (high, low), so that a kernel taking them as int32
        arguments compiles once whatever the tag: `(high << 32) | (low & 0xFFFFFFFF)`."""
        low = self.tag & 0xFFFFFFFF
        return self.tag >> 32, low - (1 << 32) if low >= 1 << 31 else low


def check_words(name: str, t: object, words: int) -> None:
    """TypeError unless `t` is an int64 tensor, ValueError unless it is [words] and contiguous,
    each naming StepFailure's field `name`."""
    if t.__class__ is not torch.Tensor and not isinstance(t, torch.Tensor):
        raise TypeError(f"StepFailure: {name} is {type(t).__name__}; expected an int64 tensor")
    if t.dtype != torch.int64:
        raise TypeError(f"StepFailure: {name} is {t.dtype}; expected an int64 tensor")
    if t.shape != (words,):
        raise ValueError(f"StepFailure: {name} shape {tuple(t.shape)}; expected [{words}]")
    if not t.is_contiguous():
        raise ValueError(f"StepFailure: {name} is not contiguous (strides {t.stride()})")


def warmup_failure(device: torch.device | str) -> StepFailure:
    """A StepFailure over fresh zeroed words on `device` (status, calls done and the record, one
    allocation), for a warm-up launch that compiles what a step's launch compiles (a count of
    calls done, as a transport's StepFailure has on a GPU) without touching a transport's words.
    Device words are freed stream-ordered: a kernel's late store never lands in memory handed out
    again (a page-locked record would be, at once, when the caller drops it)."""
    words = torch.zeros(2 + FAILURE_WORDS, dtype=torch.int64, device=device)
    return StepFailure(words[0:1], words[2:], 0, words[1:2])


def new_record(pinned: bool) -> torch.Tensor:
    """A zeroed record: int64 [FAILURE_WORDS] in CPU memory, page-locked (host-mapped under UVA, so
    a CUDA kernel stores into it and the host reads it without a sync) when `pinned`."""
    record = torch.zeros(FAILURE_WORDS, dtype=torch.int64)
    return record.pin_memory() if pinned else record


def failure_error(
    record: torch.Tensor, where: str, outcome: str, call: int = 0
) -> EpPairBudgetError | EpUnwrittenRowsError | None:
    """The error of the failure `record` holds (zeroing it), or None when it holds none or, with
    `call` (the call index of the step being raised; 0: any), the failure of another call (a stale
    record, zeroed too: module docstring; a record without a call index, 0, is taken as the
    call's). RuntimeError for a code no kernel stores. `where` names the rank and the call,
    `outcome` says what became of the step and what follows."""
    code, count, limit, tag, recorded = (int(v) for v in record.tolist())
    if code == 0:
        return None
    record.zero_()
    if code not in (FAILURE_PAIR_BUDGET, FAILURE_UNWRITTEN_ROWS):  # a stray write, of any call
        raise RuntimeError(
            f"{where}: unknown experts failure code {code} (counts {count}, {limit})"
        )
    if call != 0 and recorded != 0 and recorded != call:  # recorded 0: no call index stored
        return None
    if code == FAILURE_PAIR_BUDGET:
        return EpPairBudgetError(
            f"{where}, {tag_text(tag)}: this rank's experts received {count} (row, local expert)"
            f" pairs, more than their pair budget of {limit} pairs (the workspace HopperExperts"
            f" sized for its pair_skew), so they computed nothing; {outcome}. Raise pair_skew"
            " (HopperExperts(pair_skew=...); None sizes every call for its capacity R * K) if"
            " such routing is expected",
            count,
            limit,
            tag,
        )
    return EpUnwrittenRowsError(
        f"{where}, {tag_text(tag)}: {count} of this rank's {limit} receive row(s) hold local"
        " expert ids but the experts did not write them since the dispatch"
        f" (check_expert_rows), so the step was not summed; {outcome}. The experts backend"
        " must write every receive row with a local id (docs/design.md, the row contract)",
        count,
        limit,
        tag,
    )
