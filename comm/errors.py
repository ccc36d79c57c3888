"""Errors raised by the communication layer."""

from __future__ import annotations

from dep_ep.constants import NO_TAG


def tag_text(tag: int) -> str:
    """A step tag as error messages show it ("none" for a call that gave none)."""
    return "none" if tag == NO_TAG else str(tag)


class EpTimeoutError(RuntimeError):
    """A bounded wait expired: names the rank that waited, the phase and the peer(s) it waited for.

    After this error the buffers (and, on CPU, the process group) are in an unknown state: close
    them and build new ones; do not call dispatch/combine on them again.
    """

    def __init__(self, rank: int, phase: str, peers: str, detail: str = "") -> None:
        self.rank, self.phase, self.peers = rank, phase, peers
        msg = f"rank {rank}: timed out in phase '{phase}' waiting for {peers}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class EpDesyncError(RuntimeError):
    """The ranks are out of step: in the same call they passed different tags (one rank skipped
    a step, or ran the layers in another order), or their calls did not pair (two EpRouted used
    in a different order on different ranks). Names the ranks and what each ran."""


class EpPeerError(RuntimeError):
    """Another rank of the group rejected its input for this call; no rank used the exchanged rows.

    The rank that rejected its input raises the ValueError/TypeError naming the argument instead.
    """
