"""RejectKernel: this rank's part in a call whose input it rejected, without any payload.

A rank that rejects its dispatch input (or whose experts failed before the combine) still takes
part in the call, so that no peer waits out its timeout: thread s < N stores this rank's flag
with the status "rejected" into rank s (the dispatch flag and the combine flag for a rejected
dispatch; the combine flag alone for a rejected combine), then waits (bounded) for rank s's
combine flag of the same call, so that this rank's next call cannot overwrite rows or flags a
peer still reads. The peers record the rejection and mark their outputs (combine.py); the call
then counts as done on every rank and the next one is in step.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from dep_ep.comm.kernels.signals import (
    PHASE_COMBINE,
    PHASE_DISPATCH,
    STATE_ABORT,
    STATE_CALL,
    STATUS_REJECTED,
    flag_slot,
    load_i64,
    signal_step,
    store_i64,
    wait_arrivals,
)
from dep_ep.constants import MAX_RANKS

LANES = 32  # one warp; thread s signals and waits for rank s
PHASES = ("dispatch", "combine")


class RejectKernel:
    """Static geometry: num_ranks N (<= 32); `phase` is where the call was rejected: "dispatch"
    (signals both phases) or "combine" (the dispatch went through; signals the combine)."""

    def __init__(self, num_ranks: int, phase: str):
        assert 1 <= num_ranks <= MAX_RANKS and phase in PHASES
        self.num_ranks, self.phase = num_ranks, phase

    @cute.jit
    def __call__(self, peers: Int64, own: Int64, state: Int64, error: Int64, flags_off: Int64,
                 tokens: Int32, rank: Int32, tag: Int64, timeout_ns: Int64,
                 stream: cuda.CUstream):  # fmt: skip
        self.kernel(peers, own, state, error, flags_off, tokens, rank, tag, timeout_ns).launch(
            grid=[1, 1, 1], block=[LANES, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, peers: Int64, own: Int64, state: Int64, error: Int64, flags_off: Int64,
               tokens: Int32, rank: Int32, tag: Int64, timeout_ns: Int64):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        N = self.num_ranks
        call = load_i64(state + STATE_CALL * 8) + 1
        if tidx < N:
            peer = load_i64(peers + tidx * 8)
            if cutlass.const_expr(self.phase == "dispatch"):
                signal_step(flag_slot(peer, flags_off, PHASE_DISPATCH, N, rank), call,
                            STATUS_REJECTED, tokens, tag)  # fmt: skip
            signal_step(flag_slot(peer, flags_off, PHASE_COMBINE, N, rank), call,
                        STATUS_REJECTED, tokens, tag)  # fmt: skip
            wait_arrivals(flag_slot(own, flags_off, PHASE_COMBINE, N, tidx), call << 2,
                          state + STATE_ABORT * 8, error, rank, PHASE_COMBINE, tidx,
                          timeout_ns)  # fmt: skip
        cute.arch.barrier()
        if tidx == 0:
            store_i64(state + STATE_CALL * 8, call)
