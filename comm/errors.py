"""Errors raised by the communication layer."""

from __future__ import annotations


class EpTimeoutError(RuntimeError):
    """A bounded wait expired: names the rank that waited, the phase and the peer(s) it waited for.

    After this error the buffers (and, on CPU, the process group) are in an unknown state: close
    them and build new ones; do not call dispatch/combine on them again.
    """

    def __init__(self, rank: int, phase: str, peers: str, detail: str = "") -> None:
        self.rank, self.phase, self.peers = rank, phase, peers
        msg = f"rank {rank}: timed out in phase '{phase}' waiting for {peers}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class EpPeerError(RuntimeError):
    """Another rank of the group rejected its input for this call; no rank used the exchanged rows.

    The rank that rejected its input raises the ValueError/TypeError naming the argument instead.
    """
