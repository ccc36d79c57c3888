"""RejectKernel: this rank's part in a call whose input it rejected, without any payload.

A rank that rejects its dispatch input (or whose experts failed before the combine) still takes
part in the call, so that no peer waits out its timeout: thread s < N stores this rank's flag
with a failure status into rank s (STATUS_REJECTED: the dispatch flag and the combine flag for
a rejected dispatch, the combine flag alone for a rejected combine; STATUS_FAILED: the combine
flag of a call whose experts failed) and its combine-end flag (it reads no rows), then waits
(bounded) for rank s's combine-end flag of the same call, so that this rank's next call cannot
overwrite rows or flags a peer still reads.
The peers record the rejection (with its status) and mark their outputs (combine.py); the call
then counts as done on every rank and the next one is in step.
RejectLaunch: a variant's compile and launch (the host side).
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from dep_ep.comm.kernels.host_params import STREAM, HostParams
from dep_ep.comm.kernels.launch_args import KernelTuning, RankControl, Step, SymmetricRegions
from dep_ep.comm.kernels.launcher import (
    REJECT_KERNELS,
    KernelGeometry,
    TransportParams,
    compile_cached,
    placeholder_structs,
)
from dep_ep.comm.kernels.signals import flag_slot, signal_step, wait_flag
from dep_ep.comm.kernels.tensors import flag_slots, peer_base, state_words
from dep_ep.constants import (
    MAX_RANKS,
    PHASE_COMBINE,
    PHASE_COMBINE_END,
    PHASE_DISPATCH,
    STATE_CALL,
    STATUS_FAILED,
    STATUS_OK,
    STATUS_REJECTED,
    WARP_LANES,
)

PHASES = ("dispatch", "combine")


class RejectKernel:
    """Static geometry: num_ranks N (<= 32); `phase` is where the call was rejected: "dispatch"
    (signals both phases) or "combine" (the dispatch went through; signals the combine);
    `status` the flags' status (STATUS_REJECTED, or STATUS_FAILED for failed experts). One
    warp: thread s signals and waits for rank s."""

    def __init__(self, num_ranks: int, phase: str, status: int = STATUS_REJECTED):
        assert 1 <= num_ranks <= MAX_RANKS and phase in PHASES
        assert status in (STATUS_REJECTED, STATUS_FAILED)
        self.num_ranks, self.phase, self.status = num_ranks, phase, status

    @cute.jit
    def __call__(
        self, regions: SymmetricRegions, control: RankControl, step: Step, stream: cuda.CUstream
    ):
        self.kernel(regions, control, step).launch(
            grid=[1, 1, 1], block=[WARP_LANES, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, regions: SymmetricRegions, control: RankControl, step: Step):
        tidx, _, _ = cute.arch.thread_idx()
        N = self.num_ranks
        mState = state_words(control)
        call = mState[STATE_CALL] + 1
        if tidx < N:
            mPeerFlags = flag_slots(peer_base(regions, tidx, N), regions, N)
            if cutlass.const_expr(self.phase == "dispatch"):
                signal_step(
                    flag_slot(mPeerFlags, PHASE_DISPATCH, control.rank), call, STATUS_REJECTED, step
                )
            signal_step(flag_slot(mPeerFlags, PHASE_COMBINE, control.rank), call, self.status, step)
            # This rank reads no rows in this call: its reading is done at once.
            end = flag_slot(mPeerFlags, PHASE_COMBINE_END, control.rank)
            signal_step(end, call, STATUS_OK, step)
            mOwnFlags = flag_slots(regions.own, regions, N)
            wait_flag(
                flag_slot(mOwnFlags, PHASE_COMBINE_END, tidx),
                call << 2,
                control,
                PHASE_COMBINE_END,
                Int32(tidx),
            )
        cute.arch.barrier()
        if tidx == 0:
            mState[STATE_CALL] = call


class RejectLaunch:
    """One RejectKernel variant's launch (`name`, of REJECT_KERNELS), for one geometry and one
    transport: its compile (cached per geometry, tuning and arch, as the other kernels'; the
    kernel depends on N alone), its launch parameters in HostParams written in place, and the
    launch.

    Constraints (stated here once):
    - Geometry: KernelGeometry's (the kernel depends on N alone). Grid: one CTA of one warp
      (thread s signals and waits for rank s), whatever T is.
    - It replaces this rank's dispatch ("reject_dispatch") or combine ("reject_combine",
      "fail_combine") of a call: the step's T is -1, its tag the call's. Stream order: this
      rank's previous call (for "reject_dispatch") or this call's dispatch (for the others)
      comes before it on its stream.
    - Co-residency: one CTA, nothing to share. It waits (bounded) for every rank's combine-end
      flag; kernels beside it on other streams only delay its start.
    """

    def __init__(
        self,
        name: str,
        geometry: KernelGeometry,
        tuning: KernelTuning,
        transport: TransportParams,
        arch: str | None = None,
    ):
        """Compile (or take from the cache) variant `name` for `arch` (None: this process's
        GPU); `transport`: the transport's regions and control words."""
        self.name = name
        self.compiled = self.compile(name, geometry, tuning, arch)
        self.transport = transport
        self.step = HostParams(*(f.type for f in dataclasses.fields(Step)))
        self.stream = HostParams(STREAM)

    @staticmethod
    def compile(
        name: str,
        geometry: KernelGeometry,
        tuning: KernelTuning,
        arch: str | None = None,
        keep_ptx_dir: str | None = None,
    ):
        """The compiled variant `name` (of REJECT_KERNELS) for `arch` (None: this process's
        GPU), from the process's cache (comm/kernels/launcher.py, compile_cached)."""

        def build():
            return RejectKernel(geometry.num_ranks, *REJECT_KERNELS[name]), placeholder_structs()

        return compile_cached(geometry, name, arch, tuning, build, keep_ptx_dir)

    def __call__(self, tag: int, stream: int) -> None:
        """Launch on `stream` (a CUstream handle) this rank's part without payload in the call
        with `tag`."""
        self.compiled(
            self.transport.regions,
            self.transport.control,
            self.step.set(-1, tag),
            self.stream.set(stream),
        )
