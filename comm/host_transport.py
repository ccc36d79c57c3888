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
from dep_ep.comm.errors import EpPeerError
from dep_ep.comm.host_sync import bounded_barrier
from dep_ep.comm.layout import HEADER_SEQ, HEADER_STATUS, HEADER_TOKENS
from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.comm.reference import combine_reduce, combine_write, dispatch_write
from dep_ep.comm.transport import Transport

from dep_ep.config import EpConfig

STATUS_OK, STATUS_REJECTED = 0, 1
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

    def dispatch(self, latent, ids, weights, *, tokens, rejected):
        if rejected is None:
            q, sf = mxfp8_quantize(latent)
            dispatch_write(self.buffers, q, sf, ids, weights, self.experts_per_rank)
        self._agree("dispatch", rejected, tokens)

    def combine(self, expert_out, ids, norm_weight, eps, *, rejected):
        tokens = ids.shape[0]
        if rejected is None:
            combine_write(self.buffers, expert_out, tokens)
        self._agree("combine", rejected, tokens)
        return combine_reduce(self.buffers, ids, self.experts_per_rank, norm_weight, eps)

    def check(self) -> None:
        """Every host call completes (or raises) before it returns: nothing is left to report."""

    def synchronize(self) -> None:
        self.check()

    def reset(self) -> None:
        b = self.buffers
        bounded_barrier(b.group, b.rank, "reset", self.timeout_s)
        self.seq = 0

    def _agree(self, phase: str, error: Exception | None, tokens: int) -> None:
        """Publish this rank's status and T, wait for every rank, and raise on every rank if any
        rank rejected its input or the ranks' T differ."""
        b = self.buffers
        self.seq += 1
        slot = PHASE_SLOT[phase]
        header = b.header[slot]
        header[HEADER_SEQ] = self.seq
        header[HEADER_TOKENS] = tokens if error is None else -1
        header[HEADER_STATUS] = STATUS_OK if error is None else STATUS_REJECTED
        bounded_barrier(b.group, b.rank, phase, self.timeout_s)
        headers = [peer.header[slot].clone() for peer in b.peers]
        stale = [r for r, h in enumerate(headers) if int(h[HEADER_SEQ]) != self.seq]
        if stale:
            raise RuntimeError(
                f"rank {b.rank}: {phase} call {self.seq} met rank(s) {stale} in another call;"
                " the ranks' calls are out of step (internal error: report it)"
            )
        rejected = [r for r, h in enumerate(headers) if int(h[HEADER_STATUS]) != STATUS_OK]
        counts = [int(h[HEADER_TOKENS]) for h in headers]
        if not rejected and len(set(counts)) == 1:
            return
        # Everyone has read the headers before anyone may start the next call and rewrite them.
        bounded_barrier(b.group, b.rank, phase + "-abort", self.timeout_s)
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
