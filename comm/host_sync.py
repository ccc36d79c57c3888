"""Bounded host barriers over a gloo group, turning a timeout into EpTimeoutError."""

from __future__ import annotations

import datetime
import re

import torch.distributed as dist
from dep_ep.comm.errors import EpTimeoutError


def bounded_barrier(group: dist.ProcessGroup, rank: int, phase: str, timeout_s: float) -> None:
    """Wait until every rank of `group` reaches this barrier, at most `timeout_s` seconds.

    Collective, blocks the host. Group rank 0 collects the others and names those that did not
    arrive; the other ranks wait on rank 0. Raises EpTimeoutError(rank, phase, peers).
    """
    try:
        dist.monitored_barrier(
            group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True
        )
    except RuntimeError as err:
        text = str(err)
        found = re.search(r"[Rr]anks? ([\d, ]+) failed to pass", text)
        if found:
            peers = "rank(s) " + found.group(1).strip().rstrip(",")
        else:
            peers = "group rank 0 (the barrier's root) or a rank it waited for"
        raise EpTimeoutError(rank, phase, peers, text.splitlines()[0][:300]) from err
