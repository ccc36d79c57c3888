"""HostTransport: dispatch and combine between CPU ranks over POSIX shared memory.

Each call writes with the torch reference (dep_ep.comm.reference) and then runs the agreement
protocol: every rank publishes its status and T in its header slot for the phase, passes a bounded
barrier (the completion of the phase: every write made before it is visible after it) and reads
every rank's slot. When any rank rejected its input, or the ranks' T differ, every rank raises
together (the rejecting rank its own ValueError/TypeError, the others EpPeerError) and nothing
written in the call is used; the buffers stay usable for the next call.
"""

from __future__ import annotations

from dep_ep.comm.buffers import EpBuffers
from dep_ep.comm.errors import EpDesyncError, EpPeerError, tag_text
from dep_ep.comm.host_sync import bounded_barrier
from dep_ep.comm.layout import HEADER_SEQ, HEADER_STATUS, HEADER_TAG, HEADER_TOKENS
from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.comm.reference import combine_reduce, combine_write, dispatch_write
from dep_ep.comm.transport import Transport
from dep_ep.config import EpConfig
from dep_ep.constants import NO_TAG, STATUS_OK, STATUS_REJECTED

# Header slot per phase. One slot for both would race: after the dispatch barrier a fast rank may
# already write its combine status while a slow rank still reads the dispatch statuses. A phase's
# slot is rewritten only after the other phase's next barrier, which every reader passes first.
PHASE_SLOT = {"dispatch": 0, "combine": 1}


class HostTransport(Transport):
    """The CPU transport of one EpBuffers (see the module docstring for the protocol)."""

    completes_on_return = True

    def __init__(self, buffers: EpBuffers, experts_per_rank: int, config: EpConfig) -> None:
        self.buffers = buffers
        self.experts_per_rank = experts_per_rank
        self.timeout_s = config.timeout_s
        self.seq = 0  # calls of this rank so far; every rank's slot must carry the same

    def dispatch(self, latent, ids, weights, *, tokens, rejected, tag=NO_TAG):
        if rejected is None:
            q, sf = mxfp8_quantize(latent)
            dispatch_write(self.buffers, q, sf, ids, weights, self.experts_per_rank)
        self._agree("dispatch", rejected, tokens, tag)

    def combine(self, expert_out, ids, norm_weight, eps, *, rejected, tag=NO_TAG):
        tokens = ids.shape[0]
        if rejected is None:
            combine_write(self.buffers, expert_out, tokens)
        self._agree("combine", rejected, tokens, tag)
        return combine_reduce(self.buffers, ids, self.experts_per_rank, norm_weight, eps)

    def check(self) -> None:
        """Every host call completes (or raises) before it returns: nothing is left to report."""

    def synchronize(self) -> None:
        self.check()

    def reset(self) -> None:
        b = self.buffers
        bounded_barrier(b.group, b.rank, "reset", self.timeout_s)
        self.seq = 0

    def _agree(self, phase: str, error: BaseException | None, tokens: int, tag: int) -> None:
        """Publish this rank's call number, status, T and tag, wait for every rank, and raise on
        every rank if the ranks are out of step (call numbers or tags differ: EpDesyncError), any
        rank rejected its input (its own error there, EpPeerError elsewhere) or the ranks' T
        differ (ValueError)."""
        b = self.buffers
        self.seq += 1
        slot = PHASE_SLOT[phase]
        header = b.header[slot]
        header[HEADER_SEQ] = self.seq
        header[HEADER_TOKENS] = tokens if error is None else -1
        header[HEADER_STATUS] = STATUS_OK if error is None else STATUS_REJECTED
        header[HEADER_TAG] = tag
        bounded_barrier(b.group, b.rank, phase, self.timeout_s)
        headers = [peer.header[slot].clone() for peer in b.peers]
        calls = [int(h[HEADER_SEQ]) for h in headers]
        tags = [int(h[HEADER_TAG]) for h in headers]
        rejected = [r for r, h in enumerate(headers) if int(h[HEADER_STATUS]) != STATUS_OK]
        counts = [int(h[HEADER_TOKENS]) for h in headers]
        # A rejecting rank's tag may be the argument it rejected: only the others' must agree.
        accepted_tags = {t for r, t in enumerate(tags) if r not in rejected}
        in_step = len(set(calls)) == 1 and len(accepted_tags) <= 1
        if in_step and not rejected and len(set(counts)) == 1:
            return
        # Everyone has read the headers before anyone may start the next call and rewrite them.
        bounded_barrier(b.group, b.rank, phase + "-abort", self.timeout_s)
        if not in_step:
            ranks = "; ".join(
                f"rank {r}: call {c}, tag {tag_text(t)}"
                for r, (c, t) in enumerate(zip(calls, tags))
            )
            raise EpDesyncError(
                f"EpRouted.{phase}: the ranks are out of step ({ranks}): a rank skipped a step or"
                " ran the layers (or two EpRouted) in another order; nothing was used"
            )
        if error is not None:
            raise error
        if rejected:
            raise EpPeerError(
                f"EpRouted.{phase}: rank(s) {rejected} rejected their input; nothing was used"
            )
        raise ValueError(
            f"EpRouted.{phase}: ranks passed different token counts {counts}; every rank must"
            " pass the same T (pad with rows of -1 ids)"
        )
