"""Agreement at construction: every rank of a group compares what it was built with.

Arguments that differ across ranks (max_tokens, topk, the expert count, the device kind, the
library version) would pair rows of different shapes without any error; the fingerprint exchange
turns them into one ValueError on every rank naming the fields and each rank's value. The
exchange is one barrier of the group's constructions (comm/host_channel.py): bounded, and it
also carries every rank's process identity (for telling a dead peer) and group rank 0's tag for
the new object.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch.distributed as dist

from dep_ep.comm.errors import RECOVERY_REBUILD, EpPeerError, error_text
from dep_ep.comm.host_channel import CONSTRUCTION_REMEDY, GroupChannel, ObjectBarriers
from dep_ep.comm.liveness import ProcessIdentity


@dataclass(frozen=True)
class Agreement:
    """What a construction's exchange settled: `job`, group rank 0's random tag (the new object's
    id, and the names of its shared-memory files), and the new object's host `barriers`."""

    job: str
    barriers: ObjectBarriers


def agree_on_construction(
    fn: str,
    group: dist.ProcessGroup,
    fingerprint: dict,
    timeout_s: float,
    rejected: Exception | None = None,
) -> Agreement:
    """Collective, blocks the host (at most `timeout_s` for the ranks to arrive). `fingerprint`:
    the values every rank must share, compared by repr. `rejected`: this rank's own argument
    error, if any: that rank raises it and every other rank EpPeerError naming it and its error.
    Raises ValueError on every rank when the fingerprints differ."""
    channel = GroupChannel.of(group)
    # A construction retried at the same barrier (the last attempt raised inside the exchange, a
    # KeyboardInterrupt say, after its message was published) proposes the same job: a peer may
    # have read that message and gone on into the new object's barriers under its id.
    count = channel.constructions.count
    proposed = channel.proposed_job
    job = proposed[1] if proposed is not None and proposed[0] == count else uuid.uuid4().hex[:16]
    channel.proposed_job = (count, job)
    payload = {
        "fingerprint": {field: repr(value) for field, value in fingerprint.items()},
        "job": job,
        "rejected": None if rejected is None else error_text(rejected),
        "identity": ProcessIdentity.mine().as_dict(),
    }
    messages = channel.constructions.exchange("construction", payload, timeout_s)
    channel.learn_identities([ProcessIdentity.from_dict(m["identity"]) for m in messages])
    refusals = {r: m["rejected"] for r, m in enumerate(messages) if m["rejected"]}
    if refusals:
        if rejected is not None:
            raise rejected
        named = "; ".join(f"rank {r}: {text}" for r, text in refusals.items())
        raise EpPeerError(f"{fn}: rank(s) {sorted(refusals)} rejected their arguments ({named})")
    differing = []
    for field in fingerprint:
        values = [m["fingerprint"].get(field) for m in messages]
        if len(set(values)) > 1:
            by_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            differing.append(f"{field} ({by_rank})")
    if differing:
        raise ValueError(
            f"{fn}: the ranks were built with different arguments: {'; '.join(differing)}."
            " Every rank of the group must pass the same geometry and settings"
        )
    job = messages[0]["job"]
    number = channel.constructions.count
    # Until the constructor returns (`ObjectBarriers.built`), the new object's barriers (the
    # shared-memory setup, the NVSHMEM bootstrap) fail as a construction does: no object exists
    # to reset.
    label = f"EpRouted #{number} ({job[:8]})"
    barriers = ObjectBarriers(channel, job, label, CONSTRUCTION_REMEDY, RECOVERY_REBUILD)
    return Agreement(job, barriers)
