"""The transport interface EpRouted drives: one implementation per kind of symmetric memory.

`HostTransport` (CPU ranks: POSIX shared memory, torch reference writes, a host agreement
protocol) and `DeviceTransport` (CUDA ranks: NVSHMEM, CuTeDSL kernels, step flags) take the
same calls with the same meaning; EpRouted validates the arguments and never asks which one
it holds. `open_transport` picks by the buffers' device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from dep_ep.comm.buffers import EpBuffers
from dep_ep.comm.failure import StepFailure
from dep_ep.config import EpConfig
from dep_ep.constants import NO_TAG

# Why a rank failed a call, as its peers' EpPeerError says it ("rank 2 <cause>: <its error>").
CAUSE_INPUT = "rejected its input"
CAUSE_EXPERTS = "failed in its experts"
CAUSE_REJECT_STEP = "called reject_step"
CAUSE_ABORT_STEP = "called abort_step"
CAUSE_EARLIER_PIECE = "failed an earlier piece of this step"
# Not a caller's: the GPU combine's ready flag of a rank whose dispatch of the step had failed.
CAUSE_UNUSABLE = (
    "had failed this step before its combine (its dispatch, or its experts on the device: over"
    " their pair budget, or rows left unwritten under check_expert_rows); its rows were not used"
)
# The causes the device transport tells apart in its step flags (STATUS_FAILED: the experts);
# the others travel as STATUS_REJECTED.
EXPERT_CAUSES = (CAUSE_EXPERTS, CAUSE_ABORT_STEP)


class Transport(ABC):
    """Moves one step's rows between the ranks of one EpBuffers.

    Every call is collective (every rank, same order). `rejected` is this rank's error for the
    call (its input failed validation, or its experts failed), or None: the call still takes
    part without payload, so that no peer waits for it, and then raises `rejected`; `cause` (one
    of the CAUSE_* texts) says which. The peers raise EpPeerError naming the rank and the cause:
    in the same call on the host transport, at their next call, `poll()` or `synchronize()` on
    the device transport, whose outputs of the failed call are NaN.
    """

    buffers: EpBuffers
    # True when dispatch/combine complete before they return (the host waits): value checks that
    # read the tensors cost nothing extra there, so EpConfig.check_values=None turns them on.
    completes_on_return: bool
    # The phase of the host barrier that ends a step on every rank (the host transport's
    # "combine-end": every rank has read every rank's rows), or None where no host barrier
    # ends it (the device transport's steps end in kernels). An exception raised on a rank
    # after it passed that barrier leaves the ranks in step (EpRouted._run).
    final_barrier: str | None = None

    @abstractmethod
    def dispatch(
        self,
        latent: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        *,
        tokens: int,
        rejected: BaseException | None,
        cause: str = CAUSE_INPUT,
        tag: int = NO_TAG,
        checked: bool = True,
    ) -> None:
        """Quantize latent bf16 [n, L] (n <= T; a token with no expert is never read) to MXFP8
        once per token and write it, with ids int32 [T, K] (-1 = none) and weights fp32 [T, K],
        into the receive rows of every rank owning one of the token's experts (the row contract,
        docs/design.md). `tokens` is T (0 when rejected); `tag` identifies the step (NO_TAG when
        the caller gave none): ranks whose tags differ raise EpDesyncError. `checked`: raise an
        error an earlier call left behind (`check()`) before starting; False for the later
        pieces of a step run in pieces, which every rank runs to the end."""

    @abstractmethod
    def combine(
        self,
        ids: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        *,
        rejected: BaseException | None,
        cause: str = CAUSE_INPUT,
        tag: int = NO_TAG,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tell every rank that this rank's expert output rows of the step are written (the
        buffers' `out` region, bf16 [N*T, L]), then read each of this rank's tokens' rows where
        they lie (the `out` region of every rank owning one of its experts, row rank*T + t), sum
        them in fp32 in rank order, RMSNorm with norm_weight bf16 [L] and eps (norm_weight None:
        the sum rounded to BF16); returns bf16 [T, L], `out` (contiguous bf16 [T, L]) when
        given. ids int32 [T, K] are the ids this rank dispatched in the step; `tag` is the
        dispatch's."""

    @abstractmethod
    def step_failure(self, tag: int) -> StepFailure:
        """Where an experts backend fails the current step on the device (comm/failure.py): this
        transport's step status word and failure record, with the step's `tag`. Local, cheap;
        the tensors are the same every call (a CUDA graph may capture them)."""

    @abstractmethod
    def check(self) -> None:
        """Raise the error a failed earlier call left behind, without waiting."""

    @abstractmethod
    def poll(self) -> None:
        """`check()`, and raise EpPeerLostError for a rank this process can watch that has
        exited. Non-blocking; outside any CUDA graph capture."""

    def capturing(self) -> bool:
        """True while the current stream is being captured into a CUDA graph (never on CPU)."""
        return False

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for this rank's queued work, then `poll()`."""

    @abstractmethod
    def reset(self) -> None:
        """Collective, blocks the host: every rank leaves whatever call it was in and starts
        afresh (a new epoch of the host barriers; on GPU also zeroed step flags and state), so
        that nothing a failed call left can be taken for a later call's."""

    # Set (to the error's text) when a launch of this rank went into an epoch its call did not
    # begin in: a reset() ran between the call's last check and the launch
    # (comm/device_transport.py, `_refuse_launch_after_reset`). The peers' next calls pair with
    # that launch, so the ranks are out of step until the next reset() on every rank, which
    # clears it. Never set on CPU, where a barrier's keys carry the epoch (a message published
    # after a reset is in no epoch).
    launched_after_reset: str | None = None

    def drop_abandoned_failure(self) -> None:
        """Local: after this rank's reset() overtook a call (a signal handler's, nested in it),
        wait for what that call queued after the reset and clear the failure record it may have
        stored. Its experts' kernels launched after the reset read the new epoch's call count,
        so a record they stored would carry the next call's index and be raised as that call's
        failure. Nothing to do on CPU: every call completes before it returns, and each dispatch
        clears the record."""

    @abstractmethod
    def close(self) -> None:
        """Stop what the transport runs beside the calls (local)."""


def open_transport(buffers: EpBuffers, experts_per_rank: int, config: EpConfig) -> Transport:
    """The transport for `buffers`' device: HostTransport on CPU, DeviceTransport on CUDA."""
    if buffers.device.type == "cuda":
        from dep_ep.comm.device_transport import DeviceTransport

        return DeviceTransport(buffers, experts_per_rank, config)
    from dep_ep.comm.host_transport import HostTransport

    return HostTransport(buffers, experts_per_rank, config)
