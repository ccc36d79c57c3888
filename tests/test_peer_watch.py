"""comm/peer_watch.py on CPU with a stand-in channel: the thread sees a gone peer and writes the
abort request; period None starts no thread, stops cleanly and still looks when asked."""

from __future__ import annotations

import threading
import time

import torch

from dep_ep.comm.peer_watch import PeerWatch
from dep_ep.constants import ABORT_PEER_LOST, ERROR_ABORT


class Channel:
    """The part of GroupChannel PeerWatch reads: rank 1 is watchable and gone once `dead`."""

    size = 2
    checkable = [False, True]

    def __init__(self) -> None:
        self.dead = False

    def gone(self, ranks) -> list[int]:
        return [1] if self.dead and 1 in ranks else []


def record() -> torch.Tensor:
    return torch.zeros(ERROR_ABORT + 1, dtype=torch.int64)


def test_the_thread_sees_a_gone_peer():
    channel, error = Channel(), record()
    watch = PeerWatch(channel, error, 0.01)
    channel.dead = True
    deadline = time.monotonic() + 5
    while not watch.lost and time.monotonic() < deadline:
        time.sleep(0.005)
    watch.stop()
    assert watch.lost == [1] and int(error[ERROR_ABORT]) == ABORT_PEER_LOST


def test_period_none_starts_no_thread_and_stops():
    before = {t.name for t in threading.enumerate()}
    channel, error = Channel(), record()
    watch = PeerWatch(channel, error, None)
    assert "dep-ep-peer-watch" not in {t.name for t in threading.enumerate()} - before
    watch.stop()  # before: 2 * None in the join's timeout raised TypeError (and close() with it)
    channel.dead = True
    assert int(error[ERROR_ABORT]) == 0
    assert watch.check_now() == [1] and int(error[ERROR_ABORT]) == ABORT_PEER_LOST
