"""HostTransport: dispatch and combine between CPU ranks over POSIX shared memory.

A dispatch writes with the torch reference (dep_ep.comm.reference), then runs one barrier of the
buffers' object (comm/host_channel.py); a combine runs that barrier first, then reads its tokens'
expert rows where they lie, then runs one more ("combine-end": every rank has read this rank's
rows, so the caller may rewrite them once it returns). The first barrier carries this rank's
status, T, tag and, when it failed the call, why and its error. Every rank reads every rank's
message of that barrier and decides alike: tags that differ among the ranks that did not fail
give EpDesyncError (the ranks' calls no longer pair: reset() on every rank), a failed rank gives
its own error there and EpPeerError (with its cause and error) on the others, token counts that
differ give ValueError; nothing written in the call is used, and the buffers stay usable for the
next call. A combine whose step status word was set (comm/failure.py: experts over their pair
budget, or rows left unwritten under check_expert_rows) fails as failed experts, with the
record's error (EpPairBudgetError, EpUnwrittenRowsError) on this rank. A message is read only
under its own barrier's key, so no rank ever takes another call's (or another object's) message
for this one's.
"""

from __future__ import annotations

import torch

from dep_ep.comm.buffers import EpBuffers
from dep_ep.comm.errors import (
    MISALIGNED,
    RECOVERY_RESET,
    EpDesyncError,
    EpPeerError,
    EpTokenCountError,
    error_text,
    tag_text,
    tags_differ_text,
)
from dep_ep.comm.failure import StepFailure, failure_error, new_record
from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.comm.reference import combine_pull, dispatch_write
from dep_ep.comm.tags import step_totals
from dep_ep.comm.transport import CAUSE_EXPERTS, CAUSE_INPUT, Transport
from dep_ep.config import EpConfig
from dep_ep.constants import NO_TAG

# The step's last barrier: every rank has read every rank's expert rows (they may be rewritten).
COMBINE_END = "combine-end"


class HostTransport(Transport):
    """The CPU transport of one EpBuffers (see the module docstring for the protocol)."""

    completes_on_return = True
    final_barrier = COMBINE_END

    def __init__(self, buffers: EpBuffers, experts_per_rank: int, config: EpConfig) -> None:
        self.buffers = buffers
        self.experts_per_rank = experts_per_rank
        self.timeout_s = config.timeout_s
        # The step status word and failure record an experts backend fails a step through
        # (comm/failure.py): the combine reads them, as the GPU combine reads its state word.
        self._status = torch.zeros(1, dtype=torch.int64)
        self._record = new_record(pinned=False)

    def step_failure(self, tag: int) -> StepFailure:
        return StepFailure(self._status, self._record, tag)

    def dispatch(
        self, latent, ids, weights, *, tokens, rejected, cause=CAUSE_INPUT, tag=NO_TAG, checked=True
    ):
        # `checked` changes nothing here: every host call completes or raises before it returns.
        self._status.zero_()
        self._record.zero_()  # read in this step's combine, or never (its experts raised)
        if rejected is None:
            q, sf = mxfp8_quantize(latent)
            dispatch_write(self.buffers, q, sf, ids, weights, self.experts_per_rank)
        self._agree("dispatch", rejected, cause, tokens, tag)

    def combine(
        self,
        ids,
        norm_weight,
        eps,
        *,
        rejected,
        cause=CAUSE_INPUT,
        tag=NO_TAG,
        out=None,
    ):
        # The experts wrote this rank's rows into its `out` region; the barrier tells every rank
        # they are ready, then each reads its tokens' rows where they lie.
        tokens = ids.shape[0]
        if rejected is None and int(self._status[0]) != 0:
            # The experts failed the step (over their pair budget, or rows left unwritten under
            # check_expert_rows): every rank raises here.
            rejected, cause = self._experts_failure(), CAUSE_EXPERTS
        self._agree("combine", rejected, cause, tokens, tag)
        normed = combine_pull(self.buffers, ids, self.experts_per_rank, norm_weight, eps)
        # Return only once every rank has read this rank's rows: the caller may rewrite them.
        barriers = self.buffers.barriers
        barriers.exchange(COMBINE_END, {}, self.timeout_s, since=barriers.call.began, last=True)
        return normed if out is None else out.copy_(normed)

    def _experts_failure(self) -> Exception:
        """The error of the failure the experts stored (comm/failure.py); both words zeroed."""
        self._status.zero_()
        where = f"EpRouted.combine (rank {self.buffers.rank})"
        outcome = "the step failed on every rank in this call (the peers raise EpPeerError naming"
        outcome += " this rank) and nothing was used; the next call runs as usual"
        error = failure_error(self._record, where, outcome)
        if error is None:  # a status without a record: a backend that stored only half
            error = RuntimeError(f"{where}: the experts failed the step on the device ({outcome})")
        return error

    def check(self) -> None:
        """Every host call completes (or raises) before it returns: nothing is left to report."""

    def synchronize(self) -> None:
        self.check()

    def poll(self) -> None:
        """Raise EpPeerLostError when a rank this process can watch has exited."""
        channel = self.buffers.barriers.channel
        if channel.gone(range(channel.size)):
            raise channel.lost("poll")

    def reset(self) -> None:
        self.buffers.barriers.reset(self.timeout_s)
        self._status.zero_()
        self._record.zero_()

    def close(self) -> None:
        """Nothing beyond the buffers."""

    def _agree(self, phase, error, cause, tokens: int, tag: int) -> None:
        """One barrier carrying this rank's status, T and tag; raise on every rank if the ranks'
        tags differ (EpDesyncError), any rank failed the call (its own error there, EpPeerError
        elsewhere) or the ranks' T differ (ValueError)."""
        failed = None if error is None else f"{cause}: {error_text(error)}"
        payload = {"tokens": tokens if error is None else -1, "tag": tag, "failed": failed}
        barriers = self.buffers.barriers
        messages = barriers.exchange(phase, payload, self.timeout_s, since=barriers.call.began)
        failures = {r: m["failed"] for r, m in enumerate(messages) if m["failed"]}
        # A failed rank's tag may be the argument it rejected: only the others' must agree.
        tags = [m["tag"] for m in messages]
        accepted = {r: t for r, t in enumerate(tags) if r not in failures}
        if len(set(accepted.values())) > 1:
            counts = [messages[r]["tokens"] for r in accepted]
            totals = step_totals(list(accepted.values()), counts)
            if totals is not None:
                # A step in pieces on some rank (its first piece), the same call's tag on every
                # rank: the ranks passed different T (every rank raises here, in step).
                named = ", ".join(f"rank {r}: T={t}" for r, t in zip(accepted, totals))
                raise EpTokenCountError(
                    f"EpRouted.{phase}: the ranks passed different token counts T to a step run"
                    f" in pieces ({named}), found in its first piece (whose tag carries T);"
                    " every rank must pass the same T (pad with rows of -1 ids); nothing was used"
                )
            ranks = "; ".join(f"rank {r}: {tag_text(t)}" for r, t in enumerate(tags))
            why = tags_differ_text(list(accepted.values()))
            raise EpDesyncError(
                f"EpRouted.{phase}: the ranks are out of step ({ranks}): {why}; nothing was used."
                f" {MISALIGNED}",
                RECOVERY_RESET,
            )
        if error is not None:
            raise error
        if failures:
            named = "; ".join(f"rank {r} {text}" for r, text in failures.items())
            raise EpPeerError(f"EpRouted.{phase}: {named}; nothing was used")
        counts = [m["tokens"] for m in messages]
        if len(set(counts)) > 1:
            raise EpTokenCountError(
                f"EpRouted.{phase}: ranks passed different token counts {counts}; every rank must"
                " pass the same T (pad with rows of -1 ids)"
            )
