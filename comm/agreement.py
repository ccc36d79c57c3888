"""Agreement at construction: every rank of a group compares what it was built with.

Arguments that differ across ranks (max_tokens, topk, the expert count, the device kind, the
library version) would pair rows of different shapes without any error; the fingerprint exchange
turns them into one ValueError on every rank naming the fields and each rank's value. The
exchange is bounded: a rank that never arrives gives EpTimeoutError naming it.
"""

from __future__ import annotations

import uuid

import torch.distributed as dist

from dep_ep.comm.errors import EpPeerError
from dep_ep.comm.host_sync import bounded_barrier

JOB_FIELD = "job"  # rank 0's tag for names of this construction's shared-memory files
REJECTED_FIELD = "rejected"  # a rank's own argument error, as text


def agree_on_construction(
    fn: str,
    group: dist.ProcessGroup,
    rank: int,
    fingerprint: dict,
    timeout_s: float,
    rejected: Exception | None = None,
) -> str:
    """Collective, blocks the host (at most `timeout_s` for the ranks to arrive). `rejected`:
    this rank's own argument error, if any: that rank raises it and every other rank EpPeerError
    naming it. Raises ValueError on every rank when the fingerprints differ; returns a tag chosen
    by group rank 0, the same on every rank, for naming what this construction creates."""
    bounded_barrier(group, rank, "construction", timeout_s)
    mine = dict(fingerprint, **{JOB_FIELD: uuid.uuid4().hex[:16], REJECTED_FIELD: None})
    if rejected is not None:
        mine[REJECTED_FIELD] = f"{type(rejected).__name__}: {rejected}"
    gathered: list[dict] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(gathered, mine, group=group)
    refusals = {r: g[REJECTED_FIELD] for r, g in enumerate(gathered) if g[REJECTED_FIELD]}
    if refusals:
        if rejected is not None:
            raise rejected
        named = "; ".join(f"rank {r}: {text}" for r, text in refusals.items())
        raise EpPeerError(f"{fn}: rank(s) {sorted(refusals)} rejected their arguments ({named})")
    differing = []
    for field in fingerprint:  # a rejecting rank's fingerprint is not compared (raised above)
        values = [g.get(field) for g in gathered]
        if len(set(map(repr, values))) > 1:
            by_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            differing.append(f"{field} ({by_rank})")
    if differing:
        raise ValueError(
            f"{fn}: the ranks were built with different arguments: {'; '.join(differing)}."
            " Every rank of the group must pass the same geometry"
        )
    return gathered[0][JOB_FIELD]
