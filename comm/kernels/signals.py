"""Device code shared by the kernels: step flags, bounded waits, the error record, a token's
destination ranks and the CTAs' contiguous shares of the work.

Step flags (symmetric memory, FLAG_WORDS int64 per phase and source rank, in the destination):
[flag, unused, tokens, tag]. When every CTA of a source's launch has stored its payload, the last
CTA to finish (found with a counter in the source's own device state) stores the step's tokens
and tag into each destination's slot for that source, then one system-scope fence, then the
flag `call << 2 | status` into each slot (`signal_after_cta`, `signal_all`). A destination waits
(acquire, system scope) until the flag reaches `call << 2` and then reads status, tokens and
tag. A rank's slot for itself is neither stored nor waited for: what it would say is known
where the wait would be (`check_own_step`). The call index only grows (the device state keeps
it), so nothing is reset between calls and a CUDA graph can replay the launches.

The error record (host-mapped int64 [ERROR_WORDS]): [status, phase, peer, rank, kind, theirs,
mine, call]; status 0 = fine, ERROR_WRITING, then ERROR_COMPLETE. The first error wins. Word
ERROR_ABORT is the host's: a reason (constants.ABORT_*) when it wants every wait to end (a peer's
process is gone, reset() runs). A wait that has lasted HOST_ABORT_POLL_NS reads it on every spin
and ends with KIND_ABORTED; a flag that comes sooner costs no read over PCIe. A timeout or an
abort also sets the state's abort word, which makes every later wait return at once (until
reset() zeroes the state); the other kinds leave the flags in step (the host refuses calls
after differing tags or call indices until reset(): comm/device_transport.py, check).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from dep_ep.comm.kernels.launch_args import RankControl, Step, SymmetricRegions
from dep_ep.comm.kernels.tensors import (
    VECTOR_WORDS,
    element_ptr,
    error_words,
    flag_slots,
    peer_base,
    state_words,
    vectors,
)
from dep_ep.constants import (
    ERROR_ABORT,
    ERROR_CALL,
    ERROR_COMPLETE,
    ERROR_KIND,
    ERROR_MINE,
    ERROR_PEER,
    ERROR_PHASE,
    ERROR_RANK,
    ERROR_STATUS,
    ERROR_THEIRS,
    ERROR_WRITING,
    FLAG_CALL,
    FLAG_TAG,
    FLAG_TOKENS,
    HOST_ABORT_POLL_NS,
    KIND_ABORTED,
    KIND_CALL,
    KIND_REJECTED,
    KIND_TAG,
    KIND_TIMEOUT,
    KIND_TOKENS,
    PHASE_DISPATCH,
    STATE_ABORT,
    STATE_STEP_STATUS,
    STATUS_OK,
    WARP_LANES,
)


def flag_slot(mFlags: cute.Tensor, phase: int, source) -> cute.Tensor:
    """Int64 [FLAG_WORDS]: the slot of (phase, source) in one rank's flags."""
    return mFlags[phase - PHASE_DISPATCH, source, None]


@cute.jit
def record_error(
    control: RankControl,
    kind: int,
    phase: Int32,
    peer: Int32,
    theirs: Int64,
    mine: Int64,
    call: Int64,
):
    """Record the first error of this rank (later ones are dropped) in host-mapped memory."""
    mError = error_words(control)
    old = cute.arch.atomic_cas(
        element_ptr(mError, ERROR_STATUS),
        cmp=Int64(0),
        val=Int64(ERROR_WRITING),
        sem="relaxed",
        scope="sys",
    )
    if old == 0:
        mError[ERROR_PHASE] = Int64(phase)
        mError[ERROR_PEER] = Int64(peer)
        mError[ERROR_RANK] = Int64(control.rank)
        mError[ERROR_KIND] = Int64(kind)
        mError[ERROR_THEIRS] = theirs
        mError[ERROR_MINE] = mine
        mError[ERROR_CALL] = call
        cute.arch.store(
            element_ptr(mError, ERROR_STATUS), Int64(ERROR_COMPLETE), sem="release", scope="sys"
        )


@cute.jit
def wait_flag(
    mSlot: cute.Tensor, target: Int64, control: RankControl, phase: int, peer: Int32
) -> Int64:
    """Spin (acquire, system scope) until the slot's flag word reaches `target`, at most
    `control.timeout_ns`; return the value seen. On expiry, or when the host asks for an abort
    (its word read once the wait has lasted HOST_ABORT_POLL_NS), set the state's abort word,
    record a timeout (or an abort, with the host's reason as `theirs`) of (phase, peer) and
    return -1; after an abort return -1 at once."""
    mState = state_words(control)
    abort_request = element_ptr(error_words(control), ERROR_ABORT)
    flag = element_ptr(mSlot, FLAG_CALL)
    seen = Int64(-1)
    if mState[STATE_ABORT] == 0:
        start = cute.arch.globaltimer()
        seen = cute.arch.load(flag, Int64, sem="acquire", scope="sys")
        stop = Int32(0)  # KIND_TIMEOUT or KIND_ABORTED once the wait ends without the flag
        reason = Int64(0)
        while seen < target and stop == 0:
            waited = cute.arch.globaltimer() - start
            if waited > control.timeout_ns:
                stop = Int32(KIND_TIMEOUT)
            else:
                if waited > HOST_ABORT_POLL_NS:
                    reason = cute.arch.load(abort_request, Int64, sem="relaxed", scope="sys")
                if reason != 0:
                    stop = Int32(KIND_ABORTED)
                else:
                    seen = cute.arch.load(flag, Int64, sem="acquire", scope="sys")
        if stop != 0:
            mState[STATE_ABORT] = Int64(1)
            if stop == KIND_TIMEOUT:
                record_error(control, KIND_TIMEOUT, Int32(phase), peer, seen, target, Int64(0))
            else:
                record_error(control, KIND_ABORTED, Int32(phase), peer, reason, target, Int64(0))
            seen = Int64(-1)
    return seen


@cute.jit
def signal_step(mSlot: cute.Tensor, call: Int64, status, step: Step):
    """Store a step's tokens and tag into a destination's flag slot for this source, then the
    flag `call << 2 | status` (status a constant or an Int32) with release semantics at system
    scope (after the payload). One slot (the reject kernel's threads each signal one rank);
    `signal_all` signals every rank behind one fence."""
    mSlot[FLAG_TOKENS] = Int64(step.tokens)
    mSlot[FLAG_TAG] = step.tag
    cute.arch.store(
        element_ptr(mSlot, FLAG_CALL), (call << 2) | Int64(status), sem="release", scope="sys"
    )


@cute.jit
def signal_all(
    regions: SymmetricRegions,
    control: RankControl,
    step: Step,
    call: Int64,
    phase: int,
    status,
    num_ranks: cutlass.Constexpr[int],
):
    """One thread: store this rank's flag of (phase, call) with `status` (a constant or an
    Int32) into every other rank (a rank's slot for itself is never read: `check_own_step`; at
    one rank there is nothing to store and nothing to fence), released at system scope by one
    fence: every destination's tokens and tag, then fence.acq_rel.sys, then every flag word, a
    relaxed store at system scope. A fence followed by a strong store is a release pattern (PTX
    memory model), and the fence is cumulative: it orders before the flags every write that
    precedes it in causality order (this thread's slot words, and what the caller's barrier,
    count or stream order brought before it).
    One fence for N destinations: a release store per destination fences before each (sm_90
    code: a MEMBAR.SYS each, every one waiting for the stores before it, remote ones included).
    The ranks' base addresses are loaded before the first store."""
    if cutlass.const_expr(num_ranks > 1):
        slots = []
        for d in cutlass.range_constexpr(num_ranks):
            base = peer_base(regions, d, num_ranks)
            slots.append(flag_slot(flag_slots(base, regions, num_ranks), phase, control.rank))
        for d in cutlass.range_constexpr(num_ranks):
            if d != control.rank:
                slots[d][FLAG_TOKENS] = Int64(step.tokens)
                slots[d][FLAG_TAG] = step.tag
        cute.arch.fence_acq_rel_sys()
        flag = (call << 2) | Int64(status)
        for d in cutlass.range_constexpr(num_ranks):
            if d != control.rank:
                cute.arch.store(element_ptr(slots[d], FLAG_CALL), flag, sem="relaxed", scope="sys")


@cute.jit
def is_last_cta(control: RankControl, counter: int, grid: Int32) -> Int32:
    """Thread 0 of each CTA, after a CTA barrier that follows the CTA's work: 1 for the last CTA
    of the launch to get here, which also zeroes the counter (state word `counter`) for the next
    launch, else 0. Two launches never count at once: with programmatic dependent launch the
    next one may start early, but it touches the counter only after its griddepcontrol.wait,
    when this launch has completed. A one-CTA launch skips the count. The count is an
    acquire-release atomic at GPU scope (every CTA is on this GPU): it orders every CTA's work
    (the dispatch's payload stores, each CTA fenced at system scope first; the combine's loads,
    whose values were summed and stored before the barrier) before what the last CTA does next
    (`signal_all`: a system-scope fence, then the flags, which peers acquire)."""
    last = Int32(1)
    if grid > 1:
        mState = state_words(control)
        old = cute.arch.atomic_add(
            element_ptr(mState, counter), Int64(1), sem="acq_rel", scope="gpu"
        )
        last = Int32(0)
        if old == Int64(grid) - 1:
            mState[counter] = Int64(0)
            last = Int32(1)
    return last


@cute.jit
def signal_after_cta(
    regions: SymmetricRegions,
    control: RankControl,
    step: Step,
    call: Int64,
    phase: int,
    counter: int,
    num_ranks: cutlass.Constexpr[int],
    tidx: Int32,
    grid: Int32,
) -> Int32:
    """Every thread of the CTA, after its payload stores: the last CTA of the launch stores this
    rank's flag of (phase, call) into every other rank. Returns 1 on the thread that signalled.
    One rank alone does nothing here (no flag to store, so no fence and no count).

    Why one fence suffices: the CTA barrier orders every thread's payload stores before thread
    0's instructions after it (bar.sync synchronizes the CTA's threads: the stores precede the
    fence in causality order). fence.acq_rel.sys is then a release fence at system scope, and
    release is cumulative: it orders before the writes that follow it every write that precedes
    it in causality order, the other threads' stores included. The GPU-scope count carries that
    order from each CTA's thread 0 to the last one, whose `signal_all` (a system-scope fence,
    then the flags) the peers acquire. CUDA's own grid-wide barrier (cooperative groups) has the
    same shape: bar.sync, then one thread fences and arrives."""
    signalled = Int32(0)
    if cutlass.const_expr(num_ranks > 1):  # one rank alone has no other rank to signal
        cute.arch.barrier()
        if tidx == 0:
            cute.arch.fence_acq_rel_sys()
            if is_last_cta(control, counter, grid) != 0:
                signal_all(regions, control, step, call, phase, STATUS_OK, num_ranks)
                signalled = Int32(1)
    return signalled


@cute.jit
def is_first_cta(control: RankControl, counter: int) -> Int32:
    """Thread 0 of each CTA, before anything waits: 1 for the first CTA of the launch to get
    here, else 0. State word `counter` counts the arrivals (a relaxed atomic at GPU scope: it
    elects, it orders nothing); the launch's last CTA, found by `is_last_cta`, zeroes it. The
    first CTA signals for the launch (`signal_all`): for a payload that earlier launches on this
    stream wrote, which completed before this launch read anything (stream order, or
    griddepcontrol.wait), so the fence of `signal_all`, cumulative, orders their writes before
    the flag that peers acquire. The caller issues the count before its other loads so that the
    two are in flight together.

    Why the first CTA and not CTA 0 or the last one: the launch's CTAs then never wait for one
    another. A CTA that waits for the peers' flags holds its SM, and the peers wait for this
    rank's flag; had CTA 0 to signal, a grid larger than what fits at once (or SMs held by a
    side stream's kernels) could keep CTA 0 from starting while every resident CTA waits. The
    first CTA to start is resident by definition."""
    arrived = cute.arch.atomic_add(
        element_ptr(state_words(control), counter), Int64(1), sem="relaxed", scope="gpu"
    )
    first = Int32(0)
    if arrived == 0:
        first = Int32(1)
    return first


def id_vector(topk: int) -> int:
    """Ids per lane in one load: 4 (16 bytes) when a row of `topk` int32 is whole vectors."""
    return VECTOR_WORDS if topk % VECTOR_WORDS == 0 else 1


def id_passes(topk: int) -> int:
    """Id vectors a lane holds for one token: ceil(topk / V / 32) (1 up to topk = 128)."""
    return (topk // id_vector(topk) + WARP_LANES - 1) // WARP_LANES


def token_ids_tensor(topk: int) -> cute.Tensor:
    """A lane's registers for one token's ids: int32 [id_passes, V] (load_token_ids)."""
    V = id_vector(topk)
    return cute.make_rmem_tensor(cute.make_layout((id_passes(topk), V), stride=(V, 1)), Int32)


@cute.jit
def load_token_ids(
    mIds: cute.Tensor,
    t: Int32,
    tokens: Int32,
    lane: Int32,
    topk: cutlass.Constexpr[int],
    rIds: cute.Tensor,
):
    """One warp: lane j loads ids [jV, (j+1)V), [(j+32)V, (j+33)V), ... of token t of mIds
    (int32 [T, topk], 16-byte aligned rows) into rIds (token_ids_tensor); -1 where a lane has no
    vector or t >= tokens. Separate from `destinations`, so that a caller can have the load in
    flight while it does other work."""
    V = id_vector(topk)
    groups = topk // V
    gIds = vectors(mIds, V)  # ((1, V), (T, topk / V))
    for p in cutlass.range_constexpr(id_passes(topk)):
        g = lane + WARP_LANES * p
        if g < groups and t < tokens:
            cute.autovec_copy(gIds[(0, None), (t, g)], rIds[p, None])
        else:
            for i in cutlass.range_constexpr(V):
                rIds[p, i] = Int32(-1)


@cute.jit
def destinations(
    rIds: cute.Tensor,
    topk: cutlass.Constexpr[int],
    experts_per_rank: cutlass.Constexpr[int],
    num_ranks: cutlass.Constexpr[int],
) -> Uint32:
    """One warp, every lane gets the result: bit d set when one of the ids the lanes hold
    (load_token_ids; -1 = none) is an expert on rank d < num_ranks (ranks own
    `experts_per_rank` consecutive experts; an id past the last rank's, which only an unchecked
    caller passes, selects no rank, as -1). The lanes OR their bits (redux.sync)."""
    hits = Uint32(0)
    for p in cutlass.range_constexpr(id_passes(topk)):
        for i in cutlass.range_constexpr(id_vector(topk)):
            if rIds[p, i] >= 0 and rIds[p, i] < num_ranks * experts_per_rank:
                hits = hits | (Uint32(1) << Uint32(rIds[p, i] // experts_per_rank))
    return cute.arch.warp_redux_sync(hits, "or")


@cute.jit
def token_destinations(
    mIds: cute.Tensor,
    t: Int32,
    lane: Int32,
    topk: cutlass.Constexpr[int],
    experts_per_rank: cutlass.Constexpr[int],
    num_ranks: cutlass.Constexpr[int],
) -> Uint32:
    """One warp, every lane gets the result: the ranks owning an expert of token t < T of mIds
    (`destinations` of `load_token_ids`): one load per lane instead of topk."""
    rIds = token_ids_tensor(topk)
    load_token_ids(mIds, t, t + 1, lane, topk, rIds)
    return destinations(rIds, topk, experts_per_rank, num_ranks)


@cute.jit
def chunk_begin(count: Int32, block: Int32, grid: Int32) -> Int32:
    """First item of CTA `block`'s contiguous share of `count` items over `grid` CTAs."""
    return cutlass.min(block * ((count + grid - 1) // grid), count)


@cute.jit
def chunk_end(count: Int32, block: Int32, grid: Int32) -> Int32:
    """One past the last item of CTA `block`'s share (see chunk_begin); begin == end: none."""
    return cutlass.min(chunk_begin(count, block, grid) + (count + grid - 1) // grid, count)


@cute.jit
def store_step_status(control: RankControl, kind: Int32):
    """A step check's outcome into the state's step status word, when it is an error kind
    (non-zero): the combine of the call then marks its output instead of using it. 0 stores
    nothing (another source's error kind may be there already)."""
    if kind != 0:
        mState = state_words(control)
        mState[STATE_STEP_STATUS] = Int64(kind)


@cute.jit
def check_step(
    mSlot: cute.Tensor,
    call: Int64,
    step: Step,
    control: RankControl,
    phase: int,
    peer: Int32,
    check_payload: cutlass.Constexpr[bool],
) -> Int32:
    """Wait (bounded) for the flag of `call` in a source's slot and check what it says against
    this rank's own step: 0 when the source delivered the same call (and, with check_payload, the
    same tokens and tag) without rejecting it; otherwise the error kind, recorded (first error
    wins) and stored in the state's step status (the combine of the call then marks its output
    instead of using it). The combine skips the payload check: its T and tag are the dispatch's
    on every rank, which the dispatch checked (one dependent load less on its critical path)."""
    flag = wait_flag(mSlot, call << 2, control, phase, peer)
    kind = Int32(0)
    if flag < 0:
        kind = Int32(KIND_TIMEOUT)
    else:
        if (flag >> 2) != call:
            kind = Int32(KIND_CALL)
            record_error(control, KIND_CALL, Int32(phase), peer, flag >> 2, call, call)
        elif (flag & 3) != STATUS_OK:
            kind = Int32(KIND_REJECTED)  # theirs: the status (rejected input or failed experts)
            record_error(control, KIND_REJECTED, Int32(phase), peer, flag & 3, Int64(0), call)
        elif cutlass.const_expr(check_payload):
            rWords = cute.make_rmem_tensor(cute.make_layout(2), Int64)
            cute.autovec_copy(cute.local_tile(mSlot, (2,), (FLAG_TOKENS // 2,)), rWords)
            theirs_tokens, theirs_tag = rWords[0], rWords[1]
            if theirs_tag != step.tag:
                kind = Int32(KIND_TAG)
                record_error(control, KIND_TAG, Int32(phase), peer, theirs_tag, step.tag, call)
            elif theirs_tokens != Int64(step.tokens):
                kind = Int32(KIND_TOKENS)
                record_error(
                    control,
                    KIND_TOKENS,
                    Int32(phase),
                    peer,
                    theirs_tokens,
                    Int64(step.tokens),
                    call,
                )
    store_step_status(control, kind)
    return kind


@cute.jit
def check_own_step(
    status: Int32, aborted: Int64, call: Int64, control: RankControl, phase: int
) -> Int32:
    """check_step of this rank's own slot, without the slot: what its flag would say is known
    here. It would carry this call and step, and `status`, the status this rank's own launch
    signals (the dispatch's is STATUS_OK; the combine's says whether its dispatch
    failed or an abort came). So: KIND_TIMEOUT after an abort (`aborted`, the state's abort
    word read by this launch: check_step's wait would return at once, recording nothing),
    else KIND_REJECTED recorded when `status` is not ok, else 0; a kind is stored in the step
    status, as check_step does. At one rank this takes a flag round trip (and, in the dispatch,
    the wait for the launch's last CTA) off the launch; with several ranks the peers' waits,
    side by side with it, still take theirs."""
    kind = Int32(0)
    if aborted != 0:
        kind = Int32(KIND_TIMEOUT)
    elif status != STATUS_OK:
        kind = Int32(KIND_REJECTED)
        record_error(
            control, KIND_REJECTED, Int32(phase), control.rank, Int64(status), Int64(0), call
        )
    store_step_status(control, kind)
    return kind
