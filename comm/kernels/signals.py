"""Device code shared by the kernels: peer addresses, step flags, bounded waits, the error
record, the destination ranks of a token and the CTAs' contiguous shares of the work.

Step flags (symmetric memory, `FLAG_WORDS` int64 per phase and source rank, in the destination):
[flag, unused, tokens, tag]. When every CTA of a source's launch has stored its payload and fenced
at system scope, the last CTA to finish (found with a counter in the source's own device state)
stores the step's tokens and tag into each destination's slot for that source, then the flag
`call << 2 | status` with release semantics at system scope. A destination waits (acquire,
system scope) until the flag reaches `call << 2` and then reads status, tokens and tag. The call
index only grows (the device state keeps it), so nothing is reset between calls and a CUDA graph
can replay the launches.

The error record (int64 [ERROR_WORDS], host-mapped pinned memory): [status, phase, peer, rank,
kind, theirs, mine, call]; status 0 = fine, 1 = being written, 2 = complete. The first error wins.
A timeout also sets the state's abort word, which makes every later wait return at once (the
buffers must be rebuilt); the other kinds leave the protocol in step and the next call is good.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from dep_ep.constants import (  # noqa: F401 (re-exported for the kernels)
    FLAG_TAG,
    FLAG_TOKENS,
    FLAG_WORDS,
    KIND_CALL,
    KIND_REJECTED,
    KIND_TAG,
    KIND_TIMEOUT,
    KIND_TOKENS,
    PHASE_COMBINE,
    PHASE_DISPATCH,
    STATE_ABORT,
    STATE_CALL,
    STATE_DONE_COMBINE,
    STATE_DONE_DISPATCH,
    STATE_STEP_STATUS,
    STATUS_OK,
    STATUS_REJECTED,
)


def gmem_ptr(dtype, addr: Int64, align: int = 4):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align).llvm_ptr


def load_i64(addr: Int64) -> Int64:
    return cute.arch.load(gmem_ptr(Int64, addr, 8), Int64)


def load_i32(addr: Int64) -> Int32:
    return cute.arch.load(gmem_ptr(Int32, addr, 4), Int32)


def gmem_i64x2(addr: Int64) -> cute.Tensor:
    """Two int64 at a 16-byte aligned address as a gmem tensor: one vector load or store."""
    ptr = cute.make_ptr(Int64, addr, cute.AddressSpace.gmem, assumed_align=16)
    return cute.make_tensor(ptr, cute.make_layout(2))


def store_i64(addr: Int64, value: Int64):
    cute.arch.store(gmem_ptr(Int64, addr, 8), Int64(value))


@cute.jit
def record_error(error: Int64, kind: int, phase: Int32, peer: Int32, rank: Int32, theirs: Int64,
                 mine: Int64, call: Int64):  # fmt: skip
    """Record the first error of this rank (later ones are dropped) in host-mapped memory."""
    old = cute.arch.atomic_cas(gmem_ptr(Int64, error, 8), cmp=Int64(0), val=Int64(1),
                               sem="relaxed", scope="sys")  # fmt: skip
    if old == 0:
        store_i64(error + 8, Int64(phase))
        store_i64(error + 16, Int64(peer))
        store_i64(error + 24, Int64(rank))
        store_i64(error + 32, Int64(kind))
        store_i64(error + 40, theirs)
        store_i64(error + 48, mine)
        store_i64(error + 56, call)
        cute.arch.store(gmem_ptr(Int64, error, 8), Int64(2), sem="release", scope="sys")


@cute.jit
def wait_arrivals(
    counter: Int64, target: Int64, abort: Int64, error: Int64, rank: Int32, phase: int,
    peer: Int32, timeout_ns: Int64,
) -> Int64:  # fmt: skip
    """Spin (acquire, system scope) until the int64 at `counter` reaches `target`, at most
    `timeout_ns`; return the value seen. On expiry set the abort word, record a timeout of
    (phase, peer, rank) and return -1; after an abort return -1 at once."""
    seen = Int64(-1)
    if load_i64(abort) == 0:
        start = cute.arch.globaltimer()
        seen = cute.arch.load(gmem_ptr(Int64, counter, 8), Int64, sem="acquire", scope="sys")
        expired = Int32(0)
        while seen < target and expired == 0:
            if cute.arch.globaltimer() - start > timeout_ns:
                expired = Int32(1)
            else:
                seen = cute.arch.load(gmem_ptr(Int64, counter, 8), Int64, sem="acquire",
                                      scope="sys")  # fmt: skip
        if expired != 0:
            cute.arch.store(gmem_ptr(Int64, abort, 8), Int64(1))
            record_error(error, KIND_TIMEOUT, Int32(phase), peer, rank, seen, target, Int64(0))
            seen = Int64(-1)
    return seen


@cute.jit
def is_last_cta(done: Int64, grid: Int32) -> Int32:
    """Thread 0 of each CTA, after the CTA's payload and its system-scope fence: 1 for the last
    CTA of the launch to get here, which also zeroes the counter for the next launch (launches of
    one stream never overlap), else 0. A one-CTA launch skips the count. The count is an
    acquire-release atomic at GPU scope (every CTA is on this GPU): it orders every CTA's fenced
    payload before the last CTA's release stores at system scope, which peers acquire."""
    last = Int32(1)
    if grid > 1:
        old = cute.arch.atomic_add(gmem_ptr(Int32, done, 4), Int32(1), sem="acq_rel", scope="gpu")
        last = Int32(0)
        if old == grid - 1:
            cute.arch.store(gmem_ptr(Int32, done, 4), Int32(0))
            last = Int32(1)
    return last


@cute.jit
def signal_step(slot: Int64, call: Int64, status: int, tokens: Int32, tag: Int64):
    """Store a step's tokens and tag into a destination's flag slot for this source, then the
    flag `call << 2 | status` with release semantics at system scope (after the payload)."""
    store_i64(slot + FLAG_TOKENS * 8, Int64(tokens))
    store_i64(slot + FLAG_TAG * 8, tag)
    cute.arch.store(gmem_ptr(Int64, slot, 8), (call << 2) | Int64(status), sem="release",
                    scope="sys")  # fmt: skip


@cute.jit
def destination_mask(
    ids: Int64, t: Int32, topk: cutlass.Constexpr[int], experts_per_rank: cutlass.Constexpr[int]
) -> Uint32:
    """Bit d set: token t of the int32 ids [*, topk] at `ids` (-1 = none) has an expert on rank d
    (ranks own `experts_per_rank` consecutive experts)."""
    hits = Uint32(0)
    for k in cutlass.range_constexpr(topk):
        e = load_i32(ids + (Int64(t) * topk + k) * 4)
        if e >= 0:
            hits = hits | (Uint32(1) << Uint32(e // experts_per_rank))
    return hits


@cute.jit
def chunk_begin(count: Int32, block: Int32, grid: Int32) -> Int32:
    """First item of CTA `block`'s contiguous share of `count` items over `grid` CTAs."""
    return cutlass.min(block * ((count + grid - 1) // grid), count)


@cute.jit
def chunk_end(count: Int32, block: Int32, grid: Int32) -> Int32:
    """One past the last item of CTA `block`'s share (see chunk_begin); begin == end: none."""
    return cutlass.min(chunk_begin(count, block, grid) + (count + grid - 1) // grid, count)


def flag_slot(base: Int64, flags_off: Int64, phase: int, num_ranks: int, source) -> Int64:
    """Address of the flag slot of (phase, source) in the allocation at `base` (symmetric)."""
    row = (phase - PHASE_DISPATCH) * num_ranks + source
    return base + flags_off + Int64(row) * (FLAG_WORDS * 8)


@cute.jit
def check_step(slot: Int64, call: Int64, tokens: Int32, tag: Int64, state: Int64, error: Int64,
               rank: Int32, phase: int, peer: Int32, timeout_ns: Int64,
               check_payload: cutlass.Constexpr[bool]) -> Int32:  # fmt: skip
    """Wait (bounded) for the flag of `call` in a source's slot and check what it says against
    this rank's own step: 0 when the source delivered the same call (and, with check_payload, the
    same tokens and tag) without rejecting it; otherwise the error kind, recorded (first error
    wins) and stored in the state's step status (the combine of the call then marks its output
    instead of using it). The combine skips the payload check: its T and tag are the dispatch's
    on every rank, which the dispatch checked (one dependent load less on its critical path)."""
    flag = wait_arrivals(slot, call << 2, state + STATE_ABORT * 8, error, rank, phase, peer,
                         timeout_ns)  # fmt: skip
    kind = Int32(0)
    if flag < 0:
        kind = Int32(KIND_TIMEOUT)
    else:
        if (flag >> 2) != call:
            kind = Int32(KIND_CALL)
            record_error(error, KIND_CALL, Int32(phase), peer, rank, flag >> 2, call, call)
        elif (flag & 3) != STATUS_OK:
            kind = Int32(KIND_REJECTED)
            record_error(error, KIND_REJECTED, Int32(phase), peer, rank, Int64(0), Int64(0), call)
        elif cutlass.const_expr(check_payload):
            rWords = cute.make_rmem_tensor(cute.make_layout(2), Int64)
            cute.autovec_copy(gmem_i64x2(slot + FLAG_TOKENS * 8), rWords)  # one 16-byte load
            theirs_tokens, theirs_tag = rWords[0], rWords[1]
            if theirs_tag != tag:
                kind = Int32(KIND_TAG)
                record_error(error, KIND_TAG, Int32(phase), peer, rank, theirs_tag, tag, call)
            elif theirs_tokens != Int64(tokens):
                kind = Int32(KIND_TOKENS)
                record_error(error, KIND_TOKENS, Int32(phase), peer, rank, theirs_tokens,
                             Int64(tokens), call)  # fmt: skip
    if kind != 0:
        store_i64(state + STATE_STEP_STATUS * 8, Int64(kind))
    return kind
