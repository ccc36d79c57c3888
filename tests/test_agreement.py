"""The job a construction proposes (comm/agreement.py): the same one when it is retried at the
same barrier count, a new one at a new count. The group's channel is a stand-in here whose
exchange plays each attempt's outcome, so the cases need no process group."""

from __future__ import annotations

import pytest

import dep_ep.comm.agreement as agreement
from dep_ep.comm.errors import RESET_REMEDY, EpPeerTimeoutError
from dep_ep.comm.host_channel import CONSTRUCTION_REMEDY


class Constructions:
    """The group's construction barriers as agree_on_construction uses them: `exchange` records
    the proposed job and plays the next outcome, moving `count` as the barriers do (a barrier
    passed or given up counts; an interrupt before the pass does not)."""

    def __init__(self, outcomes: list[str]) -> None:
        self.outcomes, self.jobs, self.count = outcomes, [], 0

    def exchange(self, phase: str, payload: dict, timeout_s: float) -> list[dict]:
        self.jobs.append(payload["job"])
        outcome = self.outcomes.pop(0)
        if outcome == "interrupted before passing":
            raise KeyboardInterrupt(outcome)
        self.count += 1
        if outcome == "given up":
            raise EpPeerTimeoutError(0, phase, 1, [0])
        if outcome == "interrupted after passing":  # as it deleted the last barrier's keys
            raise KeyboardInterrupt(outcome)
        return [payload]


class Channel:
    def __init__(self, outcomes: list[str]) -> None:
        self.proposed_job = None
        self.constructions = Constructions(outcomes)

    def learn_identities(self, identities) -> None:
        pass


def test_a_retry_at_the_same_barrier_proposes_the_same_job(monkeypatch):
    """Attempts: interrupted before its barrier passed, then again, given up, interrupted after
    its barrier passed, passed. The first three propose one job (a peer may have read it and
    gone on into the object's barriers under that id); each later one a new job: after the
    give-up (no rank holds an object of it, but a new one costs nothing) and after the pass
    (the peers hold an object of it: proposing it again would give them two)."""
    outcomes = ["interrupted before passing"] * 2 + ["given up", "interrupted after passing"]
    channel = Channel([*outcomes, "passed"])
    monkeypatch.setattr(agreement.GroupChannel, "of", staticmethod(lambda group: channel))
    monkeypatch.setattr(agreement, "ObjectBarriers", lambda channel, job, *rest: job)
    for _ in outcomes:
        with pytest.raises((KeyboardInterrupt, EpPeerTimeoutError)):
            agreement.agree_on_construction("EpRouted", None, {"T": 4}, 1.0)
    built = agreement.agree_on_construction("EpRouted", None, {"T": 4}, 1.0)
    jobs = channel.constructions.jobs
    assert jobs[0] == jobs[1] == jobs[2], jobs
    assert len({jobs[2], jobs[3], jobs[4]}) == 3, jobs
    assert built.job == jobs[4], (built, jobs)


def test_the_new_objects_barriers_fail_as_a_construction_until_it_is_built(monkeypatch):
    """The agreed object's barriers (its shared-memory setup and NVSHMEM bootstrap run on them
    inside the constructor) end their errors with the construction's remedy, recovery
    "rebuild", until `built()`: before, a timeout there said to call reset() on an object the
    caller never got."""
    channel = Channel(["passed"])
    channel.objects = {}
    monkeypatch.setattr(agreement.GroupChannel, "of", staticmethod(lambda group: channel))
    agreed = agreement.agree_on_construction("EpRouted", None, {"T": 4}, 1.0)
    barriers = agreed.barriers
    assert (barriers.remedy, barriers.recovery) == (CONSTRUCTION_REMEDY, "rebuild")
    barriers.built()
    assert (barriers.remedy, barriers.recovery) == (RESET_REMEDY, "reset")
