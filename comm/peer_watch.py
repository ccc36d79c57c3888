"""PeerWatch: a thread beside a CUDA rank's calls that ends its kernels' waits when a peer's
process is gone.

A kernel waiting for a dead peer's flag would spin until EpConfig.timeout_s (60 s by default),
and under CUDA-graph replay the host may be blocked meanwhile in its own sync (the sampled
tokens' copy), calling nothing of ours. Every `period_s` the watch reads the /proc entries of
the peers this process can watch (comm/liveness.py: same host, same pid namespace); when one is
gone it writes ABORT_PEER_LOST into the error record's abort request, which every wait that has
lasted HOST_ABORT_POLL_NS reads (comm/kernels/signals.py): the kernels end, their outputs are
NaN, and the next `poll()`, call or `synchronize()` raises EpPeerLostError naming the rank. The
thread touches host memory only (no CUDA call, no collective). Peers on other hosts are left to
the kernels' bounded waits.
"""

from __future__ import annotations

import threading

import torch

from dep_ep.comm.host_channel import GroupChannel
from dep_ep.constants import ABORT_PEER_LOST, ERROR_ABORT


class PeerWatch:
    """Watches the checkable peers of `channel` every `period_s` seconds; `lost` holds the gone
    ranks once one is seen (and then the watch stops). `error`: the host-mapped error record.
    period_s None: no thread (EpConfig.peer_watch_s=None); `check_now` still looks, from the
    caller's thread (`poll()`, `synchronize()`)."""

    def __init__(self, channel: GroupChannel, error: torch.Tensor, period_s: float | None) -> None:
        self.channel, self.error, self.period_s = channel, error, period_s
        self.lost: list[int] = []
        self._stop = threading.Event()
        self._thread = None
        if period_s is not None and any(channel.checkable):
            self._thread = threading.Thread(target=self._run, name="dep-ep-peer-watch", daemon=True)
            self._thread.start()

    def check_now(self) -> list[int]:
        """Look once (from the caller's thread); abort the kernels' waits if a peer is gone."""
        if not self.lost:
            dead = self.channel.gone(range(self.channel.size))
            if dead:
                self.lost = dead
                self.error[ERROR_ABORT] = ABORT_PEER_LOST
        return self.lost

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.check_now():
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period_s + 1.0)
