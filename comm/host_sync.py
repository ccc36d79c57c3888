"""Bounded host barriers over a gloo group, turning a timeout into EpTimeoutError.

gloo's own `monitored_barrier` bounds the wait of group rank 0 only: the other ranks wait for
rank 0's answer with the process group's timeout (300 s by default), so a missing rank 0 stalls
them that long. This barrier bounds every rank: each non-root rank sends its arrival to the root
and waits for the root's answer at most `timeout_s`; the root waits for the arrivals until its
deadline and answers every rank that arrived with the arrival vector, so that they all name the
ranks that did not arrive.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from dep_ep.comm.errors import EpTimeoutError

BARRIER_TAG = 0x6570  # point-to-point tag of the barrier's messages (apart from other traffic)
MIN_WAIT_S = 1e-3  # a wait whose deadline has passed still polls once


def _wait(work: dist.Work, deadline: float) -> bool:
    """True when `work` completed before `deadline` (time.monotonic()), False on timeout."""
    remaining = max(deadline - time.monotonic(), MIN_WAIT_S)
    try:
        return work.wait(timeout=datetime.timedelta(seconds=remaining)) is not False
    except RuntimeError:  # gloo raises on timeout (and on a peer that went away)
        return False


def bounded_barrier(group: dist.ProcessGroup, rank: int, phase: str, timeout_s: float) -> None:
    """Wait until every rank of `group` reaches this barrier, at most `timeout_s` seconds on
    every rank. Collective, blocks the host. Raises EpTimeoutError(rank, phase, peers) naming the
    ranks that did not arrive (or group rank 0, the root, when it did not answer)."""
    num_ranks = dist.get_world_size(group)
    if num_ranks == 1:
        return
    deadline = time.monotonic() + timeout_s
    root = dist.get_global_rank(group, 0)
    if rank == 0:
        arrived = torch.zeros(num_ranks, dtype=torch.int64)
        arrived[0] = 1
        tokens = [torch.zeros(1, dtype=torch.int64) for _ in range(num_ranks)]
        works = {r: dist.irecv(tokens[r], dist.get_global_rank(group, r), group=group,
                               tag=BARRIER_TAG) for r in range(1, num_ranks)}  # fmt: skip
        for r, work in works.items():
            arrived[r] = 1 if _wait(work, deadline) else 0
        # The ranks that arrived have their receive posted: the answers go out at once.
        answers = [dist.isend(arrived, dist.get_global_rank(group, r), group=group, tag=BARRIER_TAG)
                   for r in range(1, num_ranks) if arrived[r]]  # fmt: skip
        for work in answers:
            _wait(work, time.monotonic() + timeout_s)
    else:
        # gloo's send completes only once the receiver posted its receive: never wait on it alone.
        arrived = torch.zeros(num_ranks, dtype=torch.int64)
        detail = f"no answer within {timeout_s:g} s"
        try:
            sent = dist.isend(torch.ones(1, dtype=torch.int64), root, group=group, tag=BARRIER_TAG)
            answer = dist.irecv(arrived, root, group=group, tag=BARRIER_TAG)
            answered = _wait(answer, deadline) and _wait(sent, deadline)
        except RuntimeError as err:  # the connection to the root is gone
            answered, detail = False, f"connection lost: {str(err).splitlines()[0][:200]}"
        if not answered:
            raise EpTimeoutError(rank, phase, "group rank 0 (the barrier's root)", detail)
    missing = [r for r in range(num_ranks) if not arrived[r]]
    if missing:
        raise EpTimeoutError(rank, phase, f"rank(s) {', '.join(map(str, missing))}",
                             f"they did not arrive within {timeout_s:g} s")  # fmt: skip
