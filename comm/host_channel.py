"""Host barriers between the ranks of one process group, keyed so that no message can stand for
another (docs/design.md, "Host protocol", restates this with the error table).

Every host-side agreement of the library (construction, the CPU transport's dispatch and combine,
the shared-memory setup, the NVSHMEM bootstrap, reset) is a barrier of one *object*: each rank
publishes one message, a small JSON dict holding the phase and what the ranks agree on, under

    dep-ep/<generation>/<object>/<epoch>.<count>/<rank>

in the group's store (launch/store.py), and waits until the message of every rank exists under
the same (object, epoch, count). <object> is the id an EpRouted's construction agreed on, or
"construction" for the group's constructions; <count> numbers the object's barriers, <epoch> its
resets; <generation> numbers the channels the store has seen for this group (a store can outlive
a process group: torchrun's agent keeps one across restarts).

Why a stale or foreign message is never taken for the one awaited:
- A barrier reads only the keys of its own (object, epoch, count). A message of another object,
  of another barrier, or of an epoch before a reset lies under another key. The phase travels
  in the message and must be the same on every rank: a rank at the same count in another phase
  is a desync, never a partner.
- A rank writes each message key once: its count only grows within an epoch, and a reset takes
  every rank to an epoch no key was written in. So a key holds the message of its barrier or
  nothing.
- A call's barriers compare the object's (epoch, reset round) with the call's start
  (`call.began`, set around each call by its caller): after a reset() nested in the call (a
  signal handler's), whether it came before the call's first barrier or during one, the call
  publishes nothing in the new epoch, so no peer's next call pairs with the abandoned one.
- A rank deletes its message of barrier c - 1 once it has passed barrier c: passing c means that
  every rank published c, which each does only after it has read every message of c - 1. The
  message of a barrier that raised before passing on this rank stays until the object's next
  reset (a peer that saw every message may still read it; after the reset no rank does).
Why a wait for a partner that will not come ends at once:
- Each rank also publishes where it is (`where/<rank>`: the barrier it entered last). A waiting
  rank reads the positions of the ranks it lacks and raises EpDesyncError when one waits where
  this rank will not go (a barrier of another object this rank has not entered, a reset, a
  construction): the two would wait for each other until the deadline. Before it raises, it
  gives up its own barrier and the one that rank waits in (below: the out-of-step mark), so the
  other rank's wait ends at its next look, and no rank that arrives at either barrier later
  passes it (this rank's next call of the other object would otherwise pair with the waiting
  call: two objects of one geometry built in different orders returned rows of the wrong
  object with no error).
- A rank that closes an object marks it (`<object>/closed/<rank>`, kept): a barrier or a reset
  of that object on another rank raises EpPeerLostError naming it at its next look, also after
  the closer's position has moved on (to a new construction, say).
- It checks the processes of those ranks (comm/liveness.py): EpPeerLostError for one that is
  gone, and for a store that stops answering.
- At the deadline it gives the barrier up and raises EpTimeoutError naming the ranks whose
  arrival bit is missing (unless every rank has arrived: below). It waits by polling (non-blocking
  store reads and short sleeps), never inside a blocking store call, so a signal (SIGINT,
  SIGTERM) takes effect within milliseconds and the store stays usable after any timeout.
Why a barrier that a rank gives up at its deadline is passed by no rank, the late and the
waiting ones included (they would otherwise disagree: one raised, the other returned the call's
result, and a server retrying the step on one rank never got back in step; a rank that leaves a
barrier another way, an interrupt or a desync, is told to reset, and the reset settles it):
- Each barrier has one counter (`<object>/<epoch>.<count>/arrived`): rank r adds its bit 2^r
  once its message is published (once: a retry of the barrier after an interrupt reads the
  counter first). A rank that gives up at its deadline sets GAVE_UP * (its rank + 1) into the
  counter by compare-and-set, and only while a bit is missing: so a give-up comes before the
  last bit or not at all. The barrier completes iff every bit comes in with no give-up. A rank
  that finds the ranks out of step sets GAVE_UP * (its rank + 1 + BARRIER_RANKS) the same way,
  and a rank whose reset() runs nested in its exchange (a signal handler's) GAVE_UP * (its rank
  + 1 + 2 * BARRIER_RANKS): the peers waiting there raise EpDesyncError at their next look
  instead of waiting for its arrival bit until their timeout.
- A rank whose arrival finds a give-up, and a waiting rank that reads one, raise
  EpPeerTimeoutError naming the rank that gave up (read from the counter) and those it waited
  for, or EpDesyncError naming it for the out-of-step mark; a rank that finds every bit at its
  deadline passes, as the others do.
- An abandoned barrier is passed by no rank, and each rank that gives it up at its deadline,
  arrives late or reads the give-up counts it: its next barrier is the one after it (a
  construction retried after a timeout pairs there). A rank that gives a barrier up for being
  out of step raises EpDesyncError without counting it: the reset that error asks for settles
  the counts; when another rank's give-up was there first, it counts it as a rank that reads
  that give-up does. A rank that left the barrier another way (an interrupt) finds
  the give-up at its next attempt there, which fails once and counts it.
- The group's constructions have no reset() to settle their counts. A construction barrier
  given up for being out of step together with a call or a reset() of another object is
  counted by a rank that was in that call or reset() at its first attempt there (it read the
  call's mark, or has reset that object since: the construction's record names it), and by a
  rank that was building (it set the mark, read it, or came after it) at its next attempt,
  which fails there (`_counts_construction`): after that object's reset() every rank's first
  construction fails once and the next pairs on every rank.
Ordering: a rank writes its payload (shared-memory rows) before it publishes, and its peers read
the rows after they found its message; the store's socket round trips order the two (the
kernel's socket locks give happens-before from the writer's send to the reader's receive).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import torch.distributed as dist

from dep_ep.comm.errors import (
    RECOVERY_REBUILD,
    RECOVERY_RESET,
    RESET_REMEDY,
    EpDesyncError,
    EpError,
    EpPeerLostError,
    EpPeerTimeoutError,
    EpResetDuringCallError,
    EpTimeoutError,
    ranks_text,
)
from dep_ep.comm.liveness import ProcessIdentity
from dep_ep.constants import MAX_RANKS
from dep_ep.launch.store import give_up, group_name, group_store

# A barrier polls the store (a `check` round trip, ~50 us on one host) back to back for
# POLL_SPIN_S, then sleeps between polls, doubling from POLL_SLEEP_MIN_S to POLL_SLEEP_MAX_S; it
# looks at the missing ranks' positions and processes every WAIT_SLICE_S. A signal takes effect
# at the next poll; a desync or a dead peer is seen within WAIT_SLICE_S.
POLL_SPIN_S, POLL_SLEEP_MIN_S, POLL_SLEEP_MAX_S = 2e-3, 5e-5, 2e-3
WAIT_SLICE_S = 0.02
# A barrier's counter: bit r is rank r's arrival; a give-up sets GAVE_UP * (the rank that gave
# up + 1 + kind * BARRIER_RANKS) above them: kind 0 at a timeout, OUT_OF_STEP when the rank
# found the ranks out of step, RESET_IN_CALL when a reset() ran nested in the rank's exchange (a
# signal handler's). So a group takes at most BARRIER_RANKS ranks, the GPU kernels' limit, and
# the largest mark, 96 * 2^32, fits the int64 counter.
BARRIER_RANKS = MAX_RANKS
GAVE_UP_SHIFT = BARRIER_RANKS
GAVE_UP = 1 << GAVE_UP_SHIFT
TIMED_OUT, OUT_OF_STEP, RESET_IN_CALL = 0, 1, 2  # the kinds of give-up
COMPLETE, ABANDONED = "complete", "abandoned"
# Bound of a store call that should answer at once (a set, a read of keys that exist): only a
# store that stopped answering takes this long.
STORE_CALL_S = 30.0
RESET_POLL_S = 0.002  # a reset polls the peers' reset rounds this often (resets are rare)
# After the store stops answering, how long to look for the rank whose death closed it: a killed
# process closes its sockets before /proc shows it as exited.
LOST_STORE_GRACE_S = 0.5
CONSTRUCTION = "construction"


class GroupChannel:
    """The barriers of every object on one process group, in this process (one per group:
    `GroupChannel.of(group)`). Holds the store connection, this rank's position in every live
    object (for telling a peer that waits elsewhere) and, after the first construction, every
    rank's process identity."""

    _channels: dict[object, GroupChannel] = {}

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> GroupChannel:
        channel = cls._channels.get(group)
        if channel is None:
            channel = cls._channels[group] = GroupChannel(group)
        return channel

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        if self.size > BARRIER_RANKS:
            raise ValueError(
                f"dep_ep: a group of {self.size} ranks; the host barriers take at most"
                f" {BARRIER_RANKS} (each rank's arrival is one bit of a barrier's counter)"
            )
        self.name = group_name(group)
        self.store = None
        self.prefix = ""
        if self.size > 1:
            self.store = group_store(group, STORE_CALL_S)
            generation = self.store.add(f"dep-ep/generation/{self.rank}", 1)
            self.prefix = f"dep-ep/{generation}/"
        self.objects: dict[str, ObjectBarriers] = {}  # live objects of this rank, by id
        # Closed objects, by id: where this rank left them (a peer's position there is stale
        # when it is before that; a barrier this rank never entered waits for ever).
        self.closed: dict[str, ObjectBarriers] = {}
        self.identities: list[ProcessIdentity] | None = None  # every rank's, once agreed
        # (constructions' barrier count, job): the job this rank proposed there, which a retry
        # at the same count proposes again (comm/agreement.py).
        self.proposed_job: tuple[int, str] | None = None
        self.checkable: list[bool] = [False] * self.size
        self.constructions = ObjectBarriers(
            self,
            CONSTRUCTION,
            "the group's constructions",
            CONSTRUCTION_REMEDY,
            RECOVERY_REBUILD,
        )

    def learn_identities(self, identities: list[ProcessIdentity]) -> None:
        """Every rank's process (from a construction exchange): which of them this rank can
        watch (same host, same pid namespace)."""
        self.identities = identities
        self.checkable = [
            r != self.rank and identity.checkable() for r, identity in enumerate(identities)
        ]

    def gone(self, ranks) -> list[int]:
        """The ranks among `ranks` whose process this rank can watch and has exited."""
        if self.identities is None:
            return []
        return [r for r in ranks if self.checkable[r] and not self.identities[r].alive()]

    def key(self, *parts) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def lost(self, phase: str, err: BaseException | None = None) -> EpPeerLostError:
        """The error for a store that stopped answering (err) or a peer found gone: names the
        dead rank when one of the watchable ranks has exited within LOST_STORE_GRACE_S."""
        deadline = time.monotonic() + (LOST_STORE_GRACE_S if err is not None else 0.0)
        while True:
            dead = self.gone(range(self.size))
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(RESET_POLL_S)
        if dead:
            return EpPeerLostError(self.rank, phase, ranks_text(dead), "the process exited")
        detail = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}" if err else ""
        return EpPeerLostError(
            self.rank,
            phase,
            "the rendezvous store (group rank 0's process or the launcher)",
            f"it stopped answering ({detail})",
        )


# What an error of the group's constructions tells its caller to do in place of RESET_REMEDY
# (comm/errors.py): there is no object to reset.
CONSTRUCTION_REMEDY = (
    "build it again on every rank, in the same order (no object was built on any rank)"
)
# What a rank that came to a construction after its peers gave it up at their deadline is told:
# they counted it, so this rank's next construction pairs with their next one, whatever object
# that is; a retry of this rank only after the group agrees again (a lockstep retry) would be
# one behind at every round.
CONSTRUCTION_LATE_REMEDY = (
    "no object was built on any rank; this rank came after its peers gave it up and counted it,"
    " so its next construction pairs with their next one: build the object they build next (this"
    " one, as their error says) on this rank at once, before any other agreement with them (a"
    " group that agrees before every retry stays one construction apart)"
)


def _give_up_mark(kind: int, rank: int) -> int:
    """What rank `rank` sets into a barrier's counter to give it up for `kind` (TIMED_OUT,
    OUT_OF_STEP, RESET_IN_CALL): GAVE_UP * (rank + 1 + kind * BARRIER_RANKS)."""
    return GAVE_UP * (rank + 1 + kind * BARRIER_RANKS)


def _given_up_by(counter: int) -> tuple[int, int]:
    """(kind, rank) of the give-up a counter at or above GAVE_UP holds (`_give_up_mark`)."""
    return divmod((counter >> GAVE_UP_SHIFT) - 1, BARRIER_RANKS)


class CallStart(threading.local):
    """`began`: (epoch, reset round) when the calling thread's current call of an object began
    (set by the caller around each call: EpRouted's `_one_thread`, or an EpMoeLayer call around
    its routed calls), None outside a call. A reset() run on this rank since (nested in the
    call: a signal handler's) makes the call's later barriers and launches refuse before this
    rank publishes anything (`exchange(since=)`, `refuse_reset_in_call`). A plain attribute of
    a thread-local, so that setting it and restoring it in a `finally` run no Python call,
    where a signal handler could raise (a KeyboardInterrupt) and leave a stale start behind:
    with a property setter that happened, and after the next reset() every call of this rank
    refused itself as overtaken by it (found by a careless-user probe)."""

    began: tuple[int, int] | None = None


class ObjectBarriers:
    """The barriers of one object on a group: `exchange` (one barrier with a payload), `reset`
    (every rank to a new epoch), `close`. Driven from one thread, in the same order on every
    rank, as the object's collective calls are. `remedy`: what its errors of a barrier given
    up or out of step tell the caller to do; `recovery`: the same for code (comm/errors.py).
    """

    def __init__(
        self,
        channel: GroupChannel,
        obj: str,
        label: str,
        remedy: str = RESET_REMEDY,
        recovery: str = RECOVERY_RESET,
    ) -> None:
        self.channel, self.obj, self.label = channel, obj, label
        self.remedy, self.recovery = remedy, recovery
        self.epoch, self.count, self.reset_round = 0, 0, 0
        # The group's constructions only: the counts of construction barriers given up together
        # with a call of another object this rank was in (`_counts_construction`).
        self.owed: set[int] = set()
        # The barrier (epoch, count) whose counter this rank last added its arrival bit to: a
        # retry of that barrier (its attempt raised, a KeyboardInterrupt say) adds it only if
        # the counter lacks it.
        self._arriving: tuple[int, int] | None = None
        self._published: str | None = None  # this rank's key of the last barrier it passed
        # This rank's keys of barriers that raised before passing (an interrupt, a desync, a
        # timeout, a lost peer): a peer may be reading them still, so they go at the next reset.
        self._stale: list[str] = []
        # The start of each thread's current call (a signal handler runs on the thread it
        # interrupts, so a handler's call nests in that thread's call; another thread's call is
        # its own).
        self.call = CallStart()
        # The barrier (epoch, count) this rank's exchange is in, from before it publishes until
        # it leaves: a reset() nested in it (a signal handler's) gives it up, so that the peers
        # waiting there for this rank's arrival raise instead of waiting out their timeout, and
        # no peer passes it after this rank abandoned it.
        self._in_barrier: tuple[int, int] | None = None
        # The phase of the last barrier this rank counted as passed in the current epoch (None
        # after a reset or a barrier given up): set with the count, by a plain store, so that an
        # exception raised on after it (a KeyboardInterrupt in the exchange's last calls) can be
        # told to have come once every rank passed that barrier (EpRouted._run).
        self.passed_phase: str | None = None
        # While a reset() of this object runs on this rank: its deadline, which a reset() nested
        # in it (a signal handler's) keeps, so that resets nested again and again stay bounded
        # by the first one's timeout_s.
        self._reset_deadline: float | None = None
        channel.objects[obj] = self

    def built(self) -> None:
        """The object's constructor returned: its errors from now on say to reset it."""
        self.remedy, self.recovery = RESET_REMEDY, RECOVERY_RESET

    # ------------------------------------------------------------------------ positions
    def _set_where(self, store, phase: str, **position) -> None:
        where = json.dumps({"obj": self.obj, "phase": phase, **position})
        store.set(self.channel.key("where", self.channel.rank), where)

    def _blocking(self, peer_where: dict) -> str | None:
        """Why a peer at `peer_where` will not reach this object's current barrier, or None."""
        ch, obj = self.channel, peer_where.get("obj")
        phase = peer_where.get("phase")
        target = ch.objects.get(obj) or ch.closed.get(obj)
        if target is None:
            return f"waits in {phase} of an EpRouted this rank never built"
        gone = " (closed on this rank)" if obj in ch.closed else ""
        if phase == "closed":
            return None  # it left another object: its next barrier is still to come
        if obj in ch.closed:
            # This rank closed that object: the peer waiting there finds this rank's closed mark
            # and leaves it (EpPeerLostError), so it does not wait for this rank for ever.
            return None
        if phase == "reset":
            if peer_where["round"] > target.reset_round:
                return f"is in reset() of {target.label}{gone}"
            return None  # a reset this rank took part in too: it has left it
        position = (peer_where["epoch"], peer_where["count"])
        if target is self:
            ahead = (self.epoch, self.count + 1)  # it passed this barrier and entered the next
            return None if position <= ahead else f"is at barrier {position} of {self.label}"
        if position >= (target.epoch, target.count):
            return f"waits in {phase} of {target.label}{gone}, which this rank has not reached"
        return None

    def _check_waiting(
        self,
        store,
        missing: list[int],
        phase: str,
        barrier: tuple[int, int],
        began: tuple[int, int],
    ) -> None:
        """Raise when a rank whose arrival bit is missing from `barrier`'s counter will not
        come (module docstring). A position read says something only while the rank's bit is
        still missing after the read: a rank may arrive here and move on in between, and a
        rank that has moved on has arrived here first. A rank whose message is there but not
        its bit (interrupted in between, then gone to its reset(), say) is judged by its
        position like one whose message is missing; one in between the two stores has its
        position here, which blocks nothing (a give-up's mark is added above the bits, which
        stay readable). Before EpDesyncError for a rank
        that waits where this rank will not go, this rank gives up `barrier` (the one it waits
        in) and the one that rank waits in (`_give_up_out_of_step`); when `barrier` completed
        meanwhile (that rank came after all), it returns and the barrier passes. A reset (a
        signal handler's) since `began` abandons the call first. A rank gone or closed counts
        only while its bit is still missing after that was seen: a rank that arrived, then
        closed the object or exited (the barrier completed on every rank), arrived first, so
        the call completes here too."""
        ch = self.channel
        arrived = self._counter_key(*barrier)
        dead = ch.gone(missing)
        if dead and self._still_missing(store, arrived, dead):
            raise ch.lost(phase)
        closed = self._closed_among(store, missing)
        closed = self._still_missing(store, arrived, closed) if closed else []
        if closed:
            raise self._closed_by(closed, phase)
        wheres = [ch.key("where", r) for r in missing]
        if not store.check(wheres):
            return
        for r, raw in zip(missing, store.multi_get(wheres)):
            if not self._still_missing(store, arrived, [r]):
                continue  # it arrived after all
            where = json.loads(raw)
            if where.get("obj") == self.obj and where.get("phase") == "closed":
                raise self._closed_by([r], phase)
            why = self._blocking(where)
            if why is not None and self._given_up_there(store, where):
                # It gave that barrier up (at its deadline, say) or leaves it at its next look:
                # its position is old, not a wait. Before, a rank that came to its next call
                # within the peer's timeout_s read such a position as out of step, and the
                # call failed on every rank.
                continue
            if why is not None:
                # Not into a new epoch's first barrier: a reset run since the read is the call's.
                self._refuse_interrupted(phase, began)
                outcome, earlier = self._give_up_out_of_step(store, where, barrier)
                if outcome == COMPLETE:
                    return
                other, epoch = ch.objects.get(where.get("obj")), where.get("epoch")
                if where.get("phase") == "reset" and other is not None:
                    epoch = other.epoch  # in a reset() of it this rank has not joined
                remedy, recovery = self._out_of_step_remedy(where.get("obj"), epoch)
                error = EpDesyncError(
                    f"rank {ch.rank} in {phase} of {self.label}: the ranks are out of step: rank"
                    f" {r} {why} (the ranks call their EpRouted, or their layers, in different"
                    f" orders, or one rank reset); {remedy}",
                    recovery,
                )
                if earlier is None:
                    # Not counted: the reset() asked for settles an object's counts; a
                    # construction given up out of step by this rank is counted at the next
                    # attempt (`_counts_construction`).
                    raise error
                # Another rank gave the barrier up first (at its deadline, say): this rank
                # counts it as a rank that reads that give-up does, so a construction's count
                # stays equal to that of the rank that gave it up at its deadline.
                raise self._abandon(
                    error, phase, began, self._counts_construction(earlier, barrier, True)
                )

    @staticmethod
    def _still_missing(store, arrived: str, ranks: list[int]) -> list[int]:
        """Those of `ranks` whose bit the counter at `arrived` still lacks (read now)."""
        counter = store.add(arrived, 0)
        return [r for r in ranks if not counter >> r & 1]

    def _given_up_there(self, store, peer_where: dict) -> bool:
        """Whether the barrier of a live object a peer's position names (`peer_where`) holds a
        give-up: the peer raised there or raises at its next look, and then goes elsewhere."""
        target = self.channel.objects.get(peer_where.get("obj"))
        if target is None or peer_where.get("phase") == "reset" or "count" not in peer_where:
            return False
        key = target._counter_key(peer_where["epoch"], peer_where["count"])
        return bool(store.check([key])) and store.add(key, 0) >= GAVE_UP

    def _with_key(self, barrier: tuple[int, int]) -> str:
        """Where a barrier given up for being out of step together with a construction barrier
        names the other: on the construction's, the object and its epoch then ({"obj",
        "epoch"}; kept, as the constructions' counters are: they are never reset); on the
        object's, the construction's count ({"construction"}; deleted at the object's reset by
        the ranks that read it). Set before the marks, so a rank that reads a mark finds it."""
        return self._counter_key(*barrier) + "/with"

    def _out_of_step_remedy(self, other_obj: str | None, epoch: int | None) -> tuple[str, str]:
        """(remedy, recovery) of an error for being out of step: the object's own, but for a
        construction given up with a call of another live object `other_obj` in `epoch`,
        whose barrier was given up with it: only a reset() of that object on every rank
        settles that one, so it comes first (recovery "reset"), unless this rank has reset
        that object since."""
        other = self.channel.objects.get(other_obj)
        if self.obj == CONSTRUCTION and other is not None and other is not self:
            if other.epoch == epoch:
                return f"call reset() of {other.label} on every rank, then {self.remedy}", (
                    RECOVERY_RESET
                )
        return self.remedy, self.recovery

    def _give_up_out_of_step(
        self, store, peer_where: dict, barrier: tuple[int, int]
    ) -> tuple[str, int | None]:
        """This rank, waiting in `barrier`, found a peer waiting where it will not go
        (`peer_where`, the peer's position): it gives up, with the out-of-step mark, `barrier`
        and, when the peer waits in a barrier of a live object in the same epoch as that
        object's here, that barrier. So the peer's wait ends at its next look, and neither
        barrier is passed later by a rank that arrives after this one left: before, this rank's
        next call of the other object paired with the peer's waiting call, which returned rows
        of the wrong object with no error (two EpRouted of one geometry built or called in
        different orders). A counter already complete or given up is left as it is. Returns
        (COMPLETE, None) when `barrier` completed before its give-up (the peer came after all:
        it passes, and the other barrier is left alone), else (ABANDONED, the counter of
        `barrier` when another rank's give-up was in it first, else None)."""
        ch = self.channel
        mark = _give_up_mark(OUT_OF_STEP, ch.rank)
        everyone = (1 << ch.size) - 1
        barriers = [(self, barrier)]
        target = ch.objects.get(peer_where.get("obj"))
        if target is not None and target is not self and peer_where.get("phase") != "reset":
            if peer_where.get("epoch") == target.epoch and "count" in peer_where:
                barriers.append((target, (target.epoch, peer_where["count"])))
        if len(barriers) == 2 and CONSTRUCTION in (self.obj, target.obj):
            # A construction given up with a call of a live object: the ranks that read the
            # construction's mark learn which object to reset first (`_with_key`, `_given_up`).
            (construction, at), (other, other_at) = sorted(
                barriers, key=lambda pair: pair[0].obj != CONSTRUCTION
            )
            record = {"obj": other.obj, "epoch": other_at[0]}
            store.set(construction._with_key(at), json.dumps(record))
            store.set(other._with_key(other_at), json.dumps({"construction": at[1]}))
            other._stale.append(other._with_key(other_at))
            if other is self:  # this rank was in the call: it owes the construction
                construction.owed.add(at[1])
        elif self.obj == CONSTRUCTION and target is not None and target is not self:
            # A construction given up with a peer in a reset() of a live object, or in a call
            # of it in an epoch this rank has not reached (no barrier of it to give up here):
            # the record tells the ranks there, at their first attempt here after they reset
            # that object, that they were not building (`_counts_construction`).
            record = {"obj": target.obj, "epoch": target.epoch}
            store.set(self._with_key(barrier), json.dumps(record))
        earlier = None
        for owner, (epoch, count) in barriers:
            key = owner._counter_key(epoch, count)
            try:
                counter, mine = give_up(store, key, store.add(key, 0), everyone, mark, GAVE_UP)
            except LookupError:
                continue  # a reset deleted it: no rank passes it any more
            if owner is self and counter == everyone:
                return COMPLETE, None
            if owner is self and not mine:
                earlier = counter
        return ABANDONED, earlier

    def _closed_key(self, rank: int) -> str:
        """Where rank `rank` marks that it closed this object (set once, kept: unlike its
        position, which its next barrier of another object overwrites)."""
        return self.channel.key(self.obj, "closed", rank)

    def _closed_by(self, ranks: list[int], phase: str) -> EpPeerLostError:
        they = "it" if len(ranks) == 1 else "they"
        return EpPeerLostError(
            self.channel.rank,
            phase,
            ranks_text(ranks),
            f"{they} closed {self.label}; close it here too",
        )

    def closed_here(self) -> bool:
        """Whether this rank closed the object (its close() took it out of the channel)."""
        return self.obj in self.channel.closed

    def _refuse_closed(self, phase: str) -> None:
        """RuntimeError when this rank closed the object: at the start of a barrier, or while it
        waited in one (a signal handler's close() inside a call), whose result is then not used.
        Its peers learn of the close from its closed mark (EpPeerLostError)."""
        if self.closed_here():
            raise RuntimeError(
                f"rank {self.channel.rank} in {phase} of {self.label}: it was closed on this rank"
                " during the call (close() from a signal handler, say); nothing of the call was"
                " used"
            )

    def _refuse_interrupted(self, phase: str, began: tuple[int, int]) -> None:
        """While a barrier waits: RuntimeError when this rank closed the object
        (`_refuse_closed`), EpResetDuringCallError when it reset it (its (epoch, reset round)
        moved on from `began`; a signal handler's reset(), say): the barrier's messages belong
        to an epoch no rank is in any more, and the call is abandoned."""
        self._refuse_closed(phase)
        if (self.epoch, self.reset_round) != began:
            raise self._reset_during_call(phase)

    def reset_in_call(self) -> bool:
        """Whether this rank reset the object since its current call began (`call.began`; outside
        a call: False)."""
        since = self.call.began
        return since is not None and (self.epoch, self.reset_round) != since

    def refuse_reset_in_call(self, phase: str) -> None:
        """EpResetDuringCallError when this rank reset the object since its current call began
        (`reset_in_call`): the call was abandoned by that reset and must not publish or launch in
        the new epoch, where its peers' next calls would pair with it."""
        if self.reset_in_call():
            raise self._reset_during_call(phase)

    def _reset_during_call(self, phase: str) -> EpResetDuringCallError:
        return EpResetDuringCallError(
            f"rank {self.channel.rank} in {phase} of {self.label}: reset() ran on this rank"
            " during the call (from a signal handler, say); nothing of the call was used. The"
            " ranks are in step after that reset: the next call needs no reset"
        )

    def _check_closed(self, store, ranks: list[int], phase: str) -> None:
        """EpPeerLostError naming those of `ranks` that closed this object: they take part in
        none of its barriers or resets again."""
        closed = self._closed_among(store, ranks)
        if closed:
            raise self._closed_by(closed, phase)

    def _closed_among(self, store, ranks: list[int]) -> list[int]:
        """Those of `ranks` (this rank aside) whose closed mark of this object is in the store."""
        me = self.channel.rank
        return [r for r in ranks if r != me and store.check([self._closed_key(r)])]

    # ------------------------------------------------------------------------ barriers
    def exchange(
        self,
        phase: str,
        payload: dict,
        timeout_s: float,
        since: tuple[int, int] | None = None,
        last: bool = False,
    ) -> list[dict]:
        """Collective over the group: publish this rank's `payload` (JSON-serialisable) for this
        object's next barrier, wait (at most `timeout_s`) for every rank's, and return them in
        rank order, each with its "phase". `last`: the call's last barrier, which nothing of
        the call follows on any rank (not a construction's, which a rank retries at once after
        an interrupt, into the same barrier). `since`: the object's (epoch, reset round) when the
        call this barrier belongs to began (`call.began`), None for now; a reset() on this rank
        after it (nested in the call) raises EpResetDuringCallError, before this rank publishes
        when it came before the barrier. Raises EpDesyncError when the ranks are in different
        phases or a missing rank waits elsewhere; EpPeerLostError; EpTimeoutError naming the
        missing ranks; EpPeerTimeoutError when a peer gave the barrier up before every rank
        arrived (the module docstring: then it passes on no rank); RuntimeError when this rank
        closed the object, before the barrier or while it waited. The errors of a barrier given
        up or out of step end with the object's `remedy` and carry its `recovery`. The barrier
        counts as passed on every rank that returns or raises EpDesyncError for differing
        phases, or, `last`, is interrupted (an exception not of this module) once every rank's
        bit is in, and as given up (counted too, so that the next barrier pairs) on every rank
        that raises EpTimeoutError or EpPeerTimeoutError."""
        ch = self.channel
        self._refuse_closed(phase)
        # One look at the object's state, with no call in between (where a signal handler's
        # reset() could run): the barrier's keys are this epoch's, so a reset after it leaves
        # this rank's message in an epoch no rank is in, and the wait refuses the call.
        epoch, count, reset_round = self.epoch, self.count, self.reset_round
        began = (epoch, reset_round) if since is None else since
        if (epoch, reset_round) != began:  # reset since the call began: publish nothing
            raise self._reset_during_call(phase)
        message = dict(payload, phase=phase)
        if ch.size == 1:
            self.count += 1
            self.passed_phase = phase
            return [message]
        store, me = ch.store, ch.rank
        barrier = (epoch, count)
        keys = [ch.key(self.obj, f"{barrier[0]}.{barrier[1]}", r) for r in range(ch.size)]
        counter_key = self._counter_key(*barrier)
        passed = False
        outer_barrier, self._in_barrier = self._in_barrier, barrier
        try:
            self._set_where(store, phase, epoch=epoch, count=count)
            store.set(keys[me], json.dumps(message))
            counter, added = self._arrive(store, barrier)
            if counter >= GAVE_UP:  # a peer gave the barrier up before this rank's bit
                raise self._found_given_up(phase, counter, barrier, began, added, added)
            values = self._wait_all(store, keys, phase, timeout_s, began, counter, barrier)
            self._refuse_closed(phase)
            # Every rank arrived: the barrier is passed (when the phases below differ, every
            # rank raises EpDesyncError, and a rank interrupted before that check is told of it
            # by its peers' reset at its next call), unless a reset() run on this rank meanwhile
            # (a signal handler's) moved the object to a new epoch: then this barrier belongs to
            # none, and its key waits for the next reset (a peer's own reset may have come after
            # its last look, so it may still read it).
            previous = self._count_passed(phase, keys[me], began)
            if previous is False:
                raise self._reset_during_call(phase)
            passed = True
        except (EpDesyncError, EpTimeoutError, EpPeerLostError, EpResetDuringCallError):
            raise
        except dist.DistError as err:
            if (self.epoch, self.reset_round) != began:
                # A read of a key a signal handler's reset() deleted waited out the store call.
                raise self._reset_during_call(phase) from None
            raise ch.lost(phase, err) from None
        except BaseException as err:
            # An interrupt (a signal handler's exception) in the wait of a call's last barrier,
            # once every rank's bit is in: no give-up can follow, so every rank passes it, having
            # read this rank's rows (the barrier's promise); it counts as passed here too, so
            # that the ranks stay in step (a careless-user probe: the note said to reset, which
            # cost the peers a step). The messages' phases are not compared (the peers raise
            # EpDesyncError if they differ, and this rank meets their reset at its next call).
            # With only some bits in, the peers may still be reading this rank's rows: not
            # counted (docs/reliability.md, open cases). Not a construction's barrier: its retry
            # after an interrupt re-enters it.
            if (
                last
                and self.count == count  # not counted before the interrupt
                and not isinstance(err, EpError)
                and not self.closed_here()
                and self._read_complete(store, barrier, began)
            ):
                previous = self._count_passed(phase, keys[me], began)
                if previous is not False:
                    passed = True
                    self._stale_passed(previous)
            raise
        finally:
            self._in_barrier = outer_barrier
            if not passed and keys[me] not in self._stale:
                # Not deleted here: a peer that saw every message may be reading this one (a
                # read of a missing key would wait for it). After the next reset no rank is.
                self._stale += [keys[me], counter_key]
        try:
            # Every rank has arrived at this barrier, so has left the one before: its keys go
            # (this rank's message; its counter by one rank a barrier, in turn).
            if previous is not None:
                store.delete_key(previous)
            if self.count >= 2 and (self.count - 2) % ch.size == me:
                store.delete_key(self._counter_key(self.epoch, self.count - 2))
        except dist.DistError as err:
            raise ch.lost(phase, err) from None
        except BaseException:  # an interrupt: the next reset, if any, deletes them
            self._stale_passed(previous)
            raise
        messages = [json.loads(v) for v in values]
        phases = [m["phase"] for m in messages]
        if len(set(phases)) > 1:
            ranks = "; ".join(f"rank {r}: {p}" for r, p in enumerate(phases))
            raise EpDesyncError(
                f"rank {me}: the ranks are in different calls of {self.label} ({ranks}): a rank"
                f" skipped a call; {self.remedy}",
                self.recovery,
            )
        return messages

    def _read_complete(self, store, barrier: tuple[int, int], began: tuple[int, int]) -> bool:
        """Whether one read of barrier `barrier`'s counter finds every rank's bit in (False
        after a reset since `began`, or when the store fails; a second interrupt raises)."""
        if (self.epoch, self.reset_round) != began:
            return False
        try:
            counter = store.add(self._counter_key(*barrier), 0)
        except dist.DistError:
            return False
        return self._outcome(counter) == COMPLETE

    def _count_passed(
        self, phase: str, published: str, began: tuple[int, int]
    ) -> str | bool | None:
        """Count the barrier this rank published `published` for as passed, unless a reset
        (a signal handler's) ran since `began`: then False. Returns the key this rank published
        for the barrier before (None for none), which the pass lets go. The test comes first
        and no call stands between it and the stores, so no handler can run in between
        (CPython runs them at calls and backward jumps)."""
        if (self.epoch, self.reset_round) != began:
            return False
        previous, self._published = self._published, published
        self.count += 1
        self.passed_phase = phase
        return previous

    def _stale_passed(self, previous: str | None) -> None:
        """The keys a passed barrier lets go (this rank's message of the barrier before,
        `previous`, and the counter two barriers back), left for the next reset to delete."""
        if previous is not None:
            self._stale.append(previous)
        if self.count >= 2:
            self._stale.append(self._counter_key(self.epoch, self.count - 2))

    def _arrive(self, store, barrier: tuple[int, int]) -> tuple[int, bool]:
        """Add this rank's arrival bit to barrier `barrier`'s counter (once, also when an
        earlier attempt at the same barrier raised after adding it). Returns the counter and
        whether this call added the bit."""
        arrived, bit = self._counter_key(*barrier), 1 << self.channel.rank
        if self._arriving == barrier:
            counter = store.add(arrived, 0)
            if counter & bit:
                return counter, False
        self._arriving = barrier  # before the add: a retry reads the counter first
        return store.add(arrived, bit), True

    def _abandon(
        self, error: EpError, phase: str, began: tuple[int, int], count: bool = True
    ) -> EpError:
        """The barrier is given up (module docstring): no rank passes it, and this rank's next
        barrier is the one after it (a construction retried after a timeout pairs there), unless
        a reset (a signal handler's) already moved the object on since `began`: then the call
        was abandoned by that reset, or `count` is False (`_counts_construction`). Returns the
        error to raise."""
        if (self.epoch, self.reset_round) != began:
            return self._reset_during_call(phase)
        if not count:
            return error
        # The barrier before it is passed, but its counter would have gone when this one was.
        if self.count >= 1:
            self._stale.append(self._counter_key(self.epoch, self.count - 1))
        self.count += 1
        self.passed_phase = None
        return error

    def _found_given_up(
        self,
        phase: str,
        counter: int,
        barrier: tuple[int, int],
        began: tuple[int, int],
        late: bool = False,
        first_touch: bool = True,
    ) -> EpError:
        """The error to raise for `barrier`, found given up (`counter`): `_given_up`'s (`late`:
        this rank's bit came after the give-up), after `_abandon` counted the barrier or not
        (`_counts_construction`; `first_touch`: this attempt's bit is this rank's first there,
        as it is for a rank that found the give-up while it waited)."""
        error = self._given_up(phase, counter, late, barrier)
        count = self._counts_construction(counter, barrier, first_touch)
        return self._abandon(error, phase, began, count)

    def _counts_construction(
        self, counter: int, barrier: tuple[int, int], first_touch: bool
    ) -> bool:
        """Whether this rank counts `barrier`, given up (`counter`), now. Always, but for a
        construction given up for being out of step (no reset() settles the constructions'
        counts): a rank that was building when the mark came (it set it, read it while it
        waited, or came to the barrier after it: `first_touch`, its bit added by this attempt)
        counts it at its next attempt, which fails there; a rank that was in the call given up
        with it (`owed`), or in that object's call or reset() and has reset it since
        (`_settled_since`), counts it at its first. So every rank fails one attempt there after
        the reset() of that object, and the next pairs. Before, a rank that read the mark while
        it waited, or came to it late, counted it at once, and a rank that gave that call up at
        its own deadline, or was in the reset(), at its next attempt: the ranks stayed one
        construction apart."""
        if self.obj != CONSTRUCTION or _given_up_by(counter)[0] != OUT_OF_STEP:
            return True
        if barrier[1] in self.owed:
            self.owed.discard(barrier[1])
            return True
        return not first_touch or self._settled_since(barrier)

    def _settled_since(self, barrier: tuple[int, int]) -> bool:
        """Whether the object that construction barrier `barrier` was given up with (its
        `_with_key` record) was reset or closed on this rank since: then this rank was in that
        object's call or reset() when the construction was given up, not building, and counts
        the construction at its first attempt, as `owed` does for a rank that read the mark.
        A rank that learned nothing from a mark (it gave that call up at its own deadline, or
        was in the reset() a builder found) is known so."""
        record = self._given_up_with(barrier)
        obj, epoch = record.get("obj"), record.get("epoch")
        live = self.channel.objects.get(obj)
        if live is not None:
            return epoch is not None and live.epoch > epoch
        return obj in self.channel.closed

    def _counter_key(self, epoch: int, count: int) -> str:
        """Barrier (epoch, count)'s counter (module docstring)."""
        return self.channel.key(self.obj, f"{epoch}.{count}", "arrived")

    def _outcome(self, counter: int) -> str | None:
        """The barrier's outcome from a read of its counter: ABANDONED once a rank gave it up,
        COMPLETE once every rank's bit is in, else None (open)."""
        if counter >= GAVE_UP:
            return ABANDONED
        return COMPLETE if counter == (1 << self.channel.size) - 1 else None

    def _given_up(self, phase: str, counter: int, late: bool, barrier: tuple[int, int]) -> EpError:
        """The error of a barrier a rank gave up (held in the counter): EpPeerTimeoutError
        naming that rank and those whose arrival `counter` lacks (this rank too when it is
        `late`: its own bit came after the give-up) after its timeout; EpDesyncError naming it
        when it found the ranks out of step."""
        me, ranks = self.channel.rank, range(self.channel.size)
        kind, giver = _given_up_by(counter)
        if kind == RESET_IN_CALL:
            return EpDesyncError(
                f"rank {me} in {phase} of {self.label}: rank {giver} called reset() during this"
                f" call (a signal handler's, say), which gave the call up on every rank;"
                f" {self.remedy}",
                self.recovery,
            )
        if kind == OUT_OF_STEP:
            who = "this rank" if giver == me else f"rank {giver}"
            record = self._given_up_with(barrier)
            constructions = getattr(self.channel, "constructions", None)
            if "construction" in record and constructions is not None:
                # This rank was in the call given up with a construction: it owes that one.
                constructions.owed.add(record["construction"])
                self._stale.append(self._with_key(barrier))
            remedy, recovery = self._out_of_step_remedy(record.get("obj"), record.get("epoch"))
            return EpDesyncError(
                f"rank {me} in {phase} of {self.label}: the ranks are out of step: {who} found"
                " a rank waiting in another call or object and gave this call up (the ranks"
                f" call their EpRouted, or their layers, in different orders); {remedy}",
                recovery,
            )
        missing = [r for r in ranks if not counter >> r & 1 or (late and r == me)]
        remedy = CONSTRUCTION_LATE_REMEDY if late and self.obj == CONSTRUCTION else self.remedy
        return EpPeerTimeoutError(me, phase, giver, missing, remedy, self.recovery)

    def _given_up_with(self, barrier: tuple[int, int]) -> dict:
        """The record of what `barrier`, given up for being out of step, was given up with
        (`_with_key`); {} when none or the store fails."""
        store, key = self.channel.store, self._with_key(barrier)
        try:
            if store is None or not store.check([key]):
                return {}
            return json.loads(store.get(key))
        except dist.DistError:
            return {}

    def _give_up(
        self,
        store,
        phase: str,
        timeout_s: float,
        missing: list[int],
        barrier: tuple[int, int],
        began: tuple[int, int],
    ) -> str:
        """At this rank's deadline: set the give-up into the counter of `barrier` (GAVE_UP times
        this rank + 1) if it still lacks a rank's bit, by compare-and-set, so that a give-up
        always comes before the last bit or not at all. Returns COMPLETE (its only value) when
        every bit is there. Raises EpTimeoutError naming `missing` when this rank gave the
        barrier up, EpPeerTimeoutError when another rank had, EpResetDuringCallError when a
        reset (a signal handler's) moved the object on meanwhile, EpDesyncError when the
        counter is gone otherwise, and RuntimeError when this rank closed the object."""
        me, everyone = self.channel.rank, (1 << self.channel.size) - 1
        arrived = self._counter_key(*barrier)
        self._refuse_interrupted(phase, began)
        counter = store.add(arrived, 0)
        try:
            mark = _give_up_mark(TIMED_OUT, me)
            counter, mine = give_up(store, arrived, counter, everyone, mark, GAVE_UP)
        except LookupError:
            # A reset (this rank's, a signal handler's, which every rank joined) deleted it.
            self._refuse_interrupted(phase, began)
            raise EpDesyncError(
                f"rank {me} in {phase} of {self.label}: the barrier's counter is gone (a reset"
                f" ran); {self.remedy}",
                self.recovery,
            ) from None
        if mine:
            timeout = EpTimeoutError(
                me,
                phase,
                f"rank(s) {', '.join(map(str, missing))}" if missing else "a rank's arrival",
                f"not arrived within {timeout_s:g} s",
                self.remedy,
                self.recovery,
            )
            raise self._abandon(timeout, phase, began)
        if counter >= GAVE_UP:
            raise self._found_given_up(phase, counter, barrier, began)
        return COMPLETE

    def _wait_all(
        self,
        store,
        keys: list[str],
        phase: str,
        timeout_s: float,
        began: tuple[int, int],
        counter: int,
        barrier: tuple[int, int],
    ) -> list[bytes]:
        """Every rank's message, once barrier `barrier` completes (module docstring;
        `counter`: the counter as this rank's arrival left it; `began`: this object's (epoch,
        reset round) when the barrier began, for `_refuse_interrupted`). Polls the counter (an
        `add` of 0; a store `wait` that times out logs a warning in torch's C++ layer each
        time): back to back for POLL_SPIN_S, then with sleeps growing to POLL_SLEEP_MAX_S; the
        peers are looked at every WAIT_SLICE_S. EpPeerTimeoutError when a peer gave the barrier
        up."""
        arrived = self._counter_key(*barrier)
        start = time.monotonic()
        deadline, next_look, sleep = start + timeout_s, start + WAIT_SLICE_S, 0.0
        while (outcome := self._outcome(counter)) is None:
            now = time.monotonic()
            self._refuse_interrupted(phase, began)
            if now >= next_look:
                # A rank lacking its bit: its message may be there (a KeyboardInterrupt between
                # its message and its bit, then its reset(): its position says where it went).
                missing = [r for r in range(len(keys)) if not counter >> r & 1]
                if missing:
                    self._check_waiting(store, missing, phase, barrier, began)
                if now >= deadline:
                    outcome = self._give_up(store, phase, timeout_s, missing, barrier, began)
                    break
                next_look = now + WAIT_SLICE_S
            if now - start > POLL_SPIN_S:
                sleep = min(POLL_SLEEP_MAX_S, max(POLL_SLEEP_MIN_S, 2 * sleep))
                time.sleep(sleep)
            counter = store.add(arrived, 0)
        if outcome == ABANDONED:
            raise self._found_given_up(phase, counter, barrier, began)
        # A reset() a signal handler ran meanwhile (every rank then reset) may have deleted the
        # messages after the counter was read complete: a read of a missing key would wait for it
        # until the store call's bound (30 s), and the call is abandoned anyway.
        self._refuse_interrupted(phase, began)
        return store.multi_get(keys)

    def reset(self, timeout_s: float) -> None:
        """Collective over the group: every rank leaves whatever barrier of this object it was
        in and starts a new epoch (count 0), the same on every rank. Each rank raises its reset
        round to its previous round + 1 and waits until every rank's round reaches it; the new
        epoch is the largest round (a rank whose earlier reset failed catches up). Raises
        EpTimeoutError naming the ranks that did not call reset(), EpPeerLostError,
        EpDesyncError when a rank resets another object at the same time, and RuntimeError when
        this rank closed the object."""
        ch = self.channel
        self._refuse_closed("reset")
        target = self.reset_round + 1
        if ch.size == 1:
            self.epoch, self.count, self.reset_round = target, 0, target
            self.passed_phase = None
            return
        store, me = ch.store, ch.rank
        round_keys = [ch.key(self.obj, "reset", r) for r in range(ch.size)]
        outer = self._reset_deadline  # a reset this one is nested in (a signal handler's)
        deadline = time.monotonic() + timeout_s
        if outer is not None:
            deadline = min(deadline, outer)
        # Plain stores around the try, no call between them and it (CallStart's reason).
        self._reset_deadline = deadline
        try:
            self._reset(store, me, round_keys, target, deadline, timeout_s)
        finally:
            self._reset_deadline = outer

    def _reset(
        self, store, me: int, round_keys: list[str], target: int, deadline: float, timeout_s: float
    ) -> None:
        """reset() past its start: give up the barrier it is nested in, publish this rank's
        round, wait (until `deadline`) for every rank's, then start the new epoch."""
        ch = self.channel
        try:
            if self._in_barrier is not None:  # nested in this rank's exchange: give it up
                key = self._counter_key(*self._in_barrier)
                mark = _give_up_mark(RESET_IN_CALL, me)
                with contextlib.suppress(LookupError):  # a counter gone: no rank passes it
                    give_up(store, key, store.add(key, 0), (1 << ch.size) - 1, mark, GAVE_UP)
            self._set_where(store, "reset", round=target)
            mine = store.add(round_keys[me], 0)
            store.add(round_keys[me], target - mine)
            while True:
                self._refuse_closed("reset")
                rounds = [store.add(k, 0) for k in round_keys]
                # A rank that closed the object never resets it again; one whose round is
                # already past this one (it reset, then closed) would let this reset return.
                self._check_closed(store, list(range(ch.size)), "reset")
                missing = [r for r, n in enumerate(rounds) if n < target]
                if not missing:
                    break
                if ch.gone(missing):
                    raise ch.lost("reset")
                self._check_resetting(store, round_keys, target, missing)
                if time.monotonic() >= deadline:
                    raise EpTimeoutError(
                        me,
                        "reset",
                        f"rank(s) {', '.join(map(str, missing))}",
                        f"they did not call reset() within {timeout_s:g} s",
                    )
                time.sleep(RESET_POLL_S)
            epoch = max(rounds)
            if epoch > target:
                store.add(round_keys[me], epoch - target)
            # Every rank has left every earlier barrier of the object: no one reads these now.
            # The last two barriers' counters (the one before them went when the last was
            # passed) go too: every rank deletes them (a deletion of a missing key is nothing).
            passed = [
                self._counter_key(self.epoch, c) for c in (self.count - 2, self.count - 1) if c >= 0
            ]
            for key in [self._published, *self._stale, *passed]:
                if key is not None:
                    store.delete_key(key)
        except (EpDesyncError, EpTimeoutError, EpPeerLostError):
            raise
        except dist.DistError as err:
            raise ch.lost("reset", err) from None
        self._published, self._stale = None, []
        self.epoch, self.count, self.reset_round = epoch, 0, epoch
        self.passed_phase = None

    def peer_rounds(self, store) -> list[int]:
        """Every rank's reset round of this object as the store holds it (a rank that never
        reset: 0). A rank whose round exceeds this rank's `reset_round` is in (or past) a reset
        this rank has not taken part in. Two store round trips once every rank's counter exists
        (the first look creates the missing ones at 0, as a rank's own first reset does); the
        caller's `store` is a connection of its own when it reads from another thread
        (comm/peer_watch.py)."""
        ch = self.channel
        keys = [ch.key(self.obj, "reset", r) for r in range(ch.size)]
        if store.check(keys):
            return [int(value) for value in store.multi_get(keys)]
        return [store.add(key, 0) for key in keys]

    def _check_resetting(self, store, round_keys, target: int, missing: list[int]) -> None:
        """While this rank resets: a missing rank that resets another object waits for this rank
        there while this rank waits for it here (its round read again after its position: it
        may have passed this reset and moved on in between)."""
        ch = self.channel
        wheres = [ch.key("where", r) for r in missing]
        if not store.check(wheres):
            return
        for r, raw in zip(missing, store.multi_get(wheres)):
            if store.add(round_keys[r], 0) >= target:
                continue
            where = json.loads(raw)
            other = ch.objects.get(where.get("obj"))
            if where.get("phase") == "reset" and other is not self and other is not None:
                if where["round"] > other.reset_round:
                    raise EpDesyncError(
                        f"rank {ch.rank} in reset() of {self.label}: rank {r} is in reset() of"
                        f" {other.label}; reset the EpRouted of a group in the same order on"
                        " every rank",
                        RECOVERY_RESET,
                    )

    def close(self) -> None:
        """This rank leaves the object (local): a peer waiting in one of its barriers or in its
        reset(), now or later, raises EpPeerLostError naming this rank at its next look (this
        rank's position says "closed" until its next barrier elsewhere; its closed mark stays)."""
        ch = self.channel
        if ch.objects.get(self.obj) is self:
            # The mark first, the local state after: a close() interrupted in between (a
            # KeyboardInterrupt in the store call) is still open here, so a retry publishes it
            # (before, the retry found the object closed and did nothing, and the peers waited
            # out their timeout_s).
            if ch.size > 1:
                try:
                    ch.store.set(self._closed_key(ch.rank), "1")
                    self._set_where(ch.store, "closed")
                except dist.DistError:
                    pass  # the store is gone: the peers learn that from it
            del ch.objects[self.obj]
            ch.closed[self.obj] = self
