"""PeerWatch: a thread beside a CUDA rank's calls that ends its kernels' waits when a peer's
process is gone or a peer called reset().

A kernel waiting for a dead peer's flag would spin until EpConfig.timeout_s (60 s by default),
and under CUDA-graph replay the host may be blocked meanwhile in its own sync (the sampled
tokens' copy), calling nothing of ours. Every `period_s` the watch
- reads the /proc entries of the peers this process can watch (comm/liveness.py: same host, same
  pid namespace); when one is gone it writes ABORT_PEER_LOST into the error record's abort
  request, which every wait that has lasted HOST_ABORT_POLL_NS reads (comm/kernels/signals.py):
  the kernels end, their outputs are NaN, and the next `poll()`, call or `synchronize()` raises
  EpPeerLostError naming the rank. Peers on other hosts are left to the kernels' bounded waits.
- reads every rank's reset round of the object (ObjectBarriers.peer_rounds, from the group's
  store, on a connection of the watch's own): a peer whose round exceeds this rank's has called
  reset() (it waits there for this rank, whose kernels would wait for that peer until the
  timeout). Then it writes ABORT_PEER_RESET: the kernels end, and the next `poll()`, call or
  `synchronize()` raises EpDesyncError saying to call reset() here too, where both ranks meet.

The thread makes no CUDA call and no collective; its store reads are bounded by its
connection's timeout, and a store that does not answer is left to the dead-peer look and the
kernels' timeouts. `lock` orders its writes of the abort request against reset()'s clearing of
the error record: the watch compares a peer's round with this rank's `reset_round` and writes
under the lock, and reset() clears the record under it after raising `reset_round`, so a round
this rank has reset past never aborts a later call.
"""

from __future__ import annotations

import threading

import torch

from dep_ep.comm.host_channel import GroupChannel, ObjectBarriers
from dep_ep.constants import ABORT_PEER_LOST, ABORT_PEER_RESET, ERROR_ABORT


class PeerWatch:
    """Watches the checkable peers of `channel` every `period_s` seconds; `lost` holds the gone
    ranks once one is seen (and then the watch stops). With `barriers` (the object's host
    barriers) and `store` (a store connection for the thread alone), it also looks for peers
    that called reset() of that object: `resetting` holds them once seen (until reset() here
    clears it). `error`: the host-mapped error record. period_s None: no thread
    (EpConfig.peer_watch_s=None); `check_now` still looks, from the caller's thread (`poll()`,
    `synchronize()`), on the channel's own store connection."""

    def __init__(
        self,
        channel: GroupChannel,
        error: torch.Tensor,
        period_s: float | None,
        barriers: ObjectBarriers | None = None,
        store=None,
    ) -> None:
        self.channel, self.error, self.period_s = channel, error, period_s
        self.barriers, self._store = barriers, store
        self.lost: list[int] = []
        self.resetting: list[int] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        watch_resets = barriers is not None and store is not None and channel.size > 1
        if period_s is not None and (any(channel.checkable) or watch_resets):
            self._thread = threading.Thread(target=self._run, name="dep-ep-peer-watch", daemon=True)
            self._thread.start()

    def check_now(self) -> list[int]:
        """Look once (from the caller's thread); abort the kernels' waits if a peer is gone, and,
        when no thread watches, if a peer called reset(). Returns the gone ranks."""
        self._look_for_dead()
        if self._thread is None and self.barriers is not None:
            self.look_for_resets(self.channel.store)
        return self.lost

    def _look_for_dead(self) -> None:
        if not self.lost:
            dead = self.channel.gone(range(self.channel.size))
            if dead:
                self.lost = dead
                self.error[ERROR_ABORT] = ABORT_PEER_LOST

    def look_for_resets(self, store) -> list[int]:
        """Read every rank's reset round from `store`; when a peer's exceeds this rank's, write
        ABORT_PEER_RESET (unless another reason is there already) and record the peers in
        `resetting`. Returns `resetting`."""
        if store is None or self.barriers is None or self.channel.size == 1:
            return self.resetting
        try:
            rounds = self.barriers.peer_rounds(store)
        except Exception:
            return self.resetting
        me = self.channel.rank
        with self.lock:  # against reset() clearing the record (module docstring)
            mine = self.barriers.reset_round
            ahead = [r for r, n in enumerate(rounds) if r != me and n > mine]
            if ahead and not self.resetting:
                self.resetting = ahead
                if int(self.error[ERROR_ABORT]) == 0:
                    self.error[ERROR_ABORT] = ABORT_PEER_RESET
        return self.resetting

    def cleared(self) -> None:
        """reset() here has passed every peer's round: forget the resetting peers. Call it with
        `lock` held, with the error record's clearing."""
        self.resetting = []

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._look_for_dead()
            if self.lost:
                return
            self.look_for_resets(self._store)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period_s + 1.0)
        self._store = None
