"""Device code shared by the kernels: peer addresses, arrival signals, bounded waits, the error
record, the destination ranks of a token and the CTAs' contiguous shares of the work.

Arrival counters (int64, one per source rank and phase, in the destination's symmetric memory)
only grow: a source adds the number of rows it delivered, with a release atomic at system scope
after its payload; the destination waits (acquire, system scope) until the counter reaches its own
running expectation (`state`, device memory) plus T. Nothing is ever reset, so no memset runs
between calls and a CUDA graph can replay the launches.

The error record (int64 [4], host-mapped pinned memory): [status, phase, peer, rank]; status 0 =
fine, 1 = being written, 2 = complete. The first timeout wins; the state's abort word makes every
later wait return at once.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

PHASE_DISPATCH, PHASE_COMBINE = 1, 2
ERROR_WORDS = 4


def gmem_ptr(dtype, addr: Int64, align: int = 4):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align).llvm_ptr


def load_i64(addr: Int64) -> Int64:
    return cute.arch.load(gmem_ptr(Int64, addr, 8), Int64)


def load_i32(addr: Int64) -> Int32:
    return cute.arch.load(gmem_ptr(Int32, addr, 4), Int32)


@cute.jit
def signal_arrival(addr: Int64, count: Int64):
    """Release-add `count` to a peer's arrival counter at system scope (after the payload)."""
    cute.arch.atomic_add(gmem_ptr(Int64, addr, 8), count, sem="release", scope="sys")


@cute.jit
def wait_arrivals(
    counter: Int64, target: Int64, abort: Int64, error: Int64, rank: Int32, phase: int,
    peer: Int32, timeout_ns: Int64,
):  # fmt: skip
    """Spin (acquire, system scope) until the counter at `counter` reaches `target`, at most
    `timeout_ns`; on expiry set the abort word and record (phase, peer, rank) once."""
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
            old = cute.arch.atomic_cas(gmem_ptr(Int64, error, 8), cmp=Int64(0), val=Int64(1),
                                       sem="relaxed", scope="sys")  # fmt: skip
            if old == 0:
                cute.arch.store(gmem_ptr(Int64, error + 8, 8), Int64(phase))
                cute.arch.store(gmem_ptr(Int64, error + 16, 8), Int64(peer))
                cute.arch.store(gmem_ptr(Int64, error + 24, 8), Int64(rank))
                cute.arch.store(gmem_ptr(Int64, error, 8), Int64(2), sem="release", scope="sys")


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


def overlap(a0, a1, b0, b1):
    """Length of [a0, a1) intersected with [b0, b1), at least 0."""
    return cutlass.max(cutlass.min(a1, b1) - cutlass.max(a0, b0), 0)
