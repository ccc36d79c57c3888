"""The grouping of experts/hopper/grouping.py and its tile routes: one launch, or three from two
chunks on (two Triton kernels and the histogram's prefix).

`group_pairs` (torch) runs ~30 small kernels: 119-209 us in graph replay on an H200 for the slots
of T = 1..256 on a DEP16 shard (docs/results/bench_experts.md). These kernels produce the same
tensors, bitwise (the tests compare them). The R * K slots are cut into chunks of BLOCK_S:

  chunk_histogram_kernel  (only when there are two chunks or more) one program per chunk: the
                          chunk's pairs per local expert, a row of int32 [chunks, BINS];
  chunk_prefix_kernel     (from PREFIX_KERNEL_CHUNKS chunks; below, torch's cumsum_) a program
                          per PREFIX_BINS bins: the rows summed over the chunks in place (row c
                          holds chunks 0..c);
  group_route_kernel      a program per (bin, chunk), bin e < num_local an expert, num_local the
                          non-local slots: from two rows of the prefix it knows where bin e's
                          pairs start and how many of them earlier chunks hold, and writes the
                          pairs of its chunk in (row, k) order. Chunk 0's program of each expert
                          also writes the expert's tiles and the sentinel routes after its pairs;
                          chunk 0's non-local program writes the three device scalars, and every
                          chunk's non-local program a share of the unused tiles and their routes.
                          The non-local slots follow the pairs, as the stable sort leaves them.
                          An expert's program with no slot in its chunk writes only its count
                          (0, with one chunk; nothing in a later chunk) and stops.

With one chunk group_route_kernel counts that chunk itself: one launch. Nothing is shared between
the programs of a launch: no atomics, no ordering between them; each program reads one chunk of
ids (the histogram kernel reads every chunk once more). On an H200 at K3's DEP16 shard the pair
takes 9.2 us at T = 64 and 36 us at T = 256 where one launch whose every program read all the
slots twice took 20.9 and 73 (CHANGELOG.md, 2026-12-01, "Grouping alone").

The same launch can cut the pairs into tiles of two sizes (`group_and_route_tilings`: humming's
FC1 and FC2 kernels may tile differently); the pair lists are written once. The histograms count
the local slots only (masked): Triton lowers tl.histogram to one shared-memory atomic per counted
element, and on a DEP16 shard 15 of 16 slots are not local, all in one bin.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from dep_ep.experts.hopper.grouping import (
    PairGroups,
    TileRoutes,
    check_grouping_args,
    pair_capacity,
    tile_capacity,
)
from dep_ep.experts.hopper.pdl import pdl_options, wait_then_release

# Slots a chunk, and warps a program: on an H200 at K3's DEP16 shard (tiles of 16) 1024 slots over
# 4 warps took 5.6 / 7.0 / 9.3 / 17.5 / 36.0 us at T = 8 / 32 / 64 / 128 / 256 where 2048 over 8
# took 4.8 / 9.7 / 13.0 / 18.6 / 43.6, and 9.7 / 35.0 us at T = 16 / 256 on a DEP2 shard (448
# local) against 17.6 / 46.7; the fastest or within 25% of the fastest of five shapes (512..4096
# slots over 4 or 8 warps) at every T (graph replay; docs/results/bench_hopper_launch.md).
BLOCK_S = 1024
NUM_WARPS = 4
BLOCK_T = 64  # tiles a program writes per step
# chunk_prefix_kernel's shape: PREFIX_BINS bins a program (fewer when there are fewer), 64 chunks
# a step at that width (PREFIX_TILE entries).
PREFIX_BINS = 64
PREFIX_TILE = 4096
# The histogram's prefix over this many chunks or more by chunk_prefix_kernel, over fewer by
# torch's cumsum_(0). On an H200 at K3's DEP16 shard (64 bins: one program) with
# bench.profile_hopper, 2026-12-04: the kernel took 8.9 us over the 332 chunks of T = 2048 where
# cumsum_ took 60.1, 2.1 against 8.0 over 41 (T = 256), 1.8 against 2.5 over 11 (T = 64), 1.9
# against 1.9 over 6 (T = 32) and 1.9 against 1.2 over 2 (T = 8). Wider histograms (more local
# experts) take more programs of the same shape; not timed.
PREFIX_KERNEL_CHUNKS = 6
# Triton's largest block is 2^20 elements: [BLOCK_T, LANES] route slots of the unused tiles, LANES
# the power of two >= block_n (tl.arange's length).
MAX_BLOCK_N = (1 << 20) // BLOCK_T


def fits(block_n: int) -> bool:
    """Whether the kernel takes tiles of block_n pairs: 1..MAX_BLOCK_N (humming's tiles hold
    8, 16, 24, 32, 40, 48, 56 or 64 pairs)."""
    return 1 <= block_n <= MAX_BLOCK_N


@triton.jit
def _keys(ids_ptr, offs, num_slots, first_expert, num_local, JUNK: tl.constexpr):
    """Local expert of each slot: 0..num_local-1, num_local when the id is not local (or -1), and
    JUNK past the slots (a histogram bin no expert uses)."""
    inside = offs < num_slots
    ids = tl.load(ids_ptr + offs, mask=inside, other=-1)
    local = ids - first_expert
    is_local = (ids >= 0) & (local >= 0) & (local < num_local)
    return tl.where(inside, tl.where(is_local, local, num_local), JUNK)


@triton.jit
def _tiling(counts, is_expert, mine, BLOCK_N: tl.constexpr):
    """(this program's tiles, its first tile, tiles in use) when every expert's pairs are cut
    into tiles of BLOCK_N."""
    tiles = tl.where(is_expert, (counts + BLOCK_N - 1) // BLOCK_N, 0)
    tiles_before = tl.cumsum(tiles, 0) - tiles
    my_tiles = tl.sum(tl.where(mine, tiles, 0), 0)
    my_tile0 = tl.sum(tl.where(mine, tiles_before, 0), 0)
    return my_tiles, my_tile0, tl.sum(tiles, 0)


@triton.jit
def _route_pairs(
    route_flat_ptr, route_pair_ptr, my_tile0, within, offs, pair, hit_pair, BLOCK_N: tl.constexpr
):
    """Pair `within` of this program's expert sits in tile my_tile0 + within // BLOCK_N at slot
    within % BLOCK_N: route index my_tile0 * BLOCK_N + within."""
    route = my_tile0 * BLOCK_N + within
    tl.store(route_flat_ptr + route, offs, mask=hit_pair)
    tl.store(route_pair_ptr + route, pair, mask=hit_pair)


@triton.jit
def _expert_tiles(
    tile_expert_ptr,
    tile_start_ptr,
    tile_rows_ptr,
    route_flat_ptr,
    route_pair_ptr,
    me,
    my_count,
    my_first,
    my_tiles,
    my_tile0,
    num_slots,
    BLOCK_N: tl.constexpr,
    LANES: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Expert me's tiles, and the route slots of its last tile past its pairs (sentinel)."""
    pad = my_count + tl.arange(0, LANES)
    pad_mask = pad < my_tiles * BLOCK_N
    tl.store(route_flat_ptr + my_tile0 * BLOCK_N + pad, num_slots, mask=pad_mask)
    tl.store(route_pair_ptr + my_tile0 * BLOCK_N + pad, num_slots, mask=pad_mask)
    tile = tl.arange(0, BLOCK_T)
    for j0 in range(0, my_tiles, BLOCK_T):
        j = j0 + tile
        used = j < my_tiles
        tl.store(tile_expert_ptr + my_tile0 + j, tl.zeros_like(j) + me, mask=used)
        tl.store(tile_start_ptr + my_tile0 + j, my_first + j * BLOCK_N, mask=used)
        rows = tl.minimum(my_count - j * BLOCK_N, BLOCK_N)
        tl.store(tile_rows_ptr + my_tile0 + j, rows, mask=used)


@triton.jit
def _unused_tiles(
    tile_expert_ptr,
    tile_start_ptr,
    tile_rows_ptr,
    route_flat_ptr,
    route_pair_ptr,
    num_tiles,
    tile_cap,
    num_local,
    num_slots,
    part,
    parts,
    BLOCK_N: tl.constexpr,
    LANES: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Part `part` of `parts` of the tiling's tiles past num_tiles (expert num_local, no rows,
    routes all sentinel): blocks of BLOCK_T tiles part, part + parts, ... (every chunk's
    non-local program writes its part: one program wrote them all, 921k route words at T = 2048
    on a DEP16 shard)."""
    lane = tl.arange(0, LANES)
    tile = tl.arange(0, BLOCK_T)
    for t0 in range(num_tiles + part * BLOCK_T, tile_cap, parts * BLOCK_T):
        t = t0 + tile
        unused = t < tile_cap
        tl.store(tile_expert_ptr + t, tl.zeros_like(t) + num_local, mask=unused)
        tl.store(tile_start_ptr + t, tl.zeros_like(t), mask=unused)
        tl.store(tile_rows_ptr + t, tl.zeros_like(t), mask=unused)
        entry = t[:, None] * BLOCK_N + lane[None, :]  # [BLOCK_T, LANES]
        sentinel = tl.zeros_like(entry) + num_slots
        in_tile = unused[:, None] & (lane < BLOCK_N)[None, :]
        tl.store(route_flat_ptr + entry, sentinel, mask=in_tile)
        tl.store(route_pair_ptr + entry, sentinel, mask=in_tile)


@triton.jit
def chunk_histogram_kernel(
    ids_ptr,  # int32 [R*K] global expert ids, -1 = none
    hist_ptr,  # int32 [chunks, BINS] out: chunk c's pairs per local expert (other bins 0)
    num_slots,
    first_expert,
    num_local,
    BINS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (pdl.py)
):
    wait_then_release(PDL)
    chunk = tl.program_id(0)
    JUNK: tl.constexpr = BINS - 1
    offs = chunk * BLOCK_S + tl.arange(0, BLOCK_S)
    key = _keys(ids_ptr, offs, num_slots, first_expert, num_local, JUNK)
    counts = tl.histogram(key, BINS, mask=key < num_local)
    tl.store(hist_ptr + chunk * BINS + tl.arange(0, BINS), counts)


@triton.jit
def chunk_prefix_kernel(
    hist_ptr,  # int32 [chunks, BINS]: each chunk's counts in, their inclusive prefix out
    num_chunks,
    BINS: tl.constexpr,
    BLOCK_B: tl.constexpr,  # bins a program (a power of two dividing BINS)
    BLOCK_C: tl.constexpr,  # chunks a step
    PDL: tl.constexpr = False,  # as in chunk_histogram_kernel
):
    """Row c of hist becomes the sum of rows 0..c, in place. Program p takes bins
    [p * BLOCK_B, (p + 1) * BLOCK_B) (the grid: BINS / BLOCK_B), BLOCK_C rows a step, the running
    sum of the rows before carried in registers (int32: the sums are exact)."""
    wait_then_release(PDL)
    bins = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    carry = tl.zeros([BLOCK_B], dtype=tl.int32)
    for first in range(0, num_chunks, BLOCK_C):
        rows = first + tl.arange(0, BLOCK_C)
        inside = (rows < num_chunks)[:, None]
        at = hist_ptr + rows[:, None] * BINS + bins[None, :]
        block = tl.load(at, mask=inside, other=0)
        tl.store(at, tl.cumsum(block, 0) + carry[None, :], mask=inside)
        carry += tl.sum(block, 0)


@triton.jit
def _counts_from_prefix(prefix_ptr, num_chunks, chunk, BINS: tl.constexpr):
    """(pairs per bin over every chunk, pairs per bin in the chunks before `chunk`), int32 [BINS]
    each: rows num_chunks - 1 and chunk - 1 of the histogram's inclusive prefix over chunks."""
    bins = tl.arange(0, BINS)
    counts = tl.load(prefix_ptr + (num_chunks - 1) * BINS + bins)
    earlier = bins < tl.where(chunk > 0, BINS, 0)  # chunk 0 has no chunk before it
    before = tl.load(prefix_ptr + (chunk - 1) * BINS + bins, mask=earlier, other=0)
    return counts, before


@triton.jit
def group_route_kernel(
    ids_ptr,  # int32 [R*K] global expert ids, -1 = none
    hist_ptr,  # int32 [chunks, BINS]: chunk_histogram_kernel's rows, summed over the chunks
    # before and at each (an inclusive prefix, chunk_prefix_kernel's; read when CHUNKED)
    pair_row_ptr,  # int32 [R*K] out
    pair_flat_ptr,  # int32 [R*K] out
    pair_slot_ptr,  # int32 [R*K] out
    num_pairs_ptr,  # int32 [1] out
    expert_pairs_ptr,  # int64 [num_local] out
    # Tiling A (tiles of BLOCK_N pairs), then tiling B (BLOCK_N_B; written when TWO_TILINGS):
    tile_expert_ptr,  # int32 [TC] out
    tile_start_ptr,  # int32 [TC] out
    tile_rows_ptr,  # int32 [TC] out
    num_tiles_ptr,  # int32 [1] out
    route_flat_ptr,  # int32 [TC * BLOCK_N] out: pair_flat of the tile slot's pair, or sentinel
    route_pair_ptr,  # int32 [TC * BLOCK_N] out: the tile slot's pair number, or sentinel
    num_padded_ptr,  # int32 [1] out: num_tiles * BLOCK_N
    tile_expert_b_ptr,
    tile_start_b_ptr,
    tile_rows_b_ptr,
    num_tiles_b_ptr,
    route_flat_b_ptr,
    route_pair_b_ptr,
    num_padded_b_ptr,
    num_slots,  # R * K (also the routes' sentinel)
    topk,
    first_expert,
    num_local,
    tile_cap,  # TC of tiling A
    tile_cap_b,  # TC of tiling B
    BLOCK_N: tl.constexpr,  # pairs per tile of tiling A, any count
    LANES: tl.constexpr,  # the power of two >= BLOCK_N: one tile's route slots as lanes
    BLOCK_N_B: tl.constexpr,
    LANES_B: tl.constexpr,
    TWO_TILINGS: tl.constexpr,
    BINS: tl.constexpr,  # a power of two >= num_local + 2: experts, the non-local bin, JUNK
    BLOCK_S: tl.constexpr,  # slots a chunk
    CHUNKED: tl.constexpr,  # more than one chunk: the counts come from hist_ptr
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr = False,  # as in chunk_histogram_kernel
):
    wait_then_release(PDL)
    me = tl.program_id(0)  # local expert, or num_local for the non-local slots
    chunk = tl.program_id(1)
    JUNK: tl.constexpr = BINS - 1
    offs = chunk * BLOCK_S + tl.arange(0, BLOCK_S)
    key = _keys(ids_ptr, offs, num_slots, first_expert, num_local, JUNK)
    bins = tl.arange(0, BINS)
    is_expert = bins < num_local
    mine = bins == me
    is_pair = me < num_local

    hit = key == me
    # An expert's program with no slot in its chunk has nothing to write there but, when its
    # chunk is the only one, its pair count (0). It skips the histogram and prefixes over BINS
    # every program computes: with them group_route_kernel took 29.8 us at 896 local experts
    # and one receive row, 9.3 at 448; without them 10.6 and 6.6 (profile_hopper, one H200).
    no_hit = tl.sum(hit.to(tl.int32), 0) == 0
    if CHUNKED:
        idle = is_pair & no_hit & (chunk > 0)
    else:
        idle = is_pair & no_hit
    if idle:
        if not CHUNKED:
            tl.store(expert_pairs_ptr + me, tl.full((), 0, tl.int64))
    else:
        # Pairs per expert (the non-local bin and JUNK stay 0), and this bin's slots before the
        # chunk.
        if CHUNKED:
            counts, before = _counts_from_prefix(hist_ptr, tl.num_programs(1), chunk, BINS)
            # Every slot before this chunk is a real one (only the last chunk is partial): the
            # non-local ones are those the histogram did not count.
            local_before = tl.sum(tl.where(is_expert, before, 0), 0)
            seen = tl.where(
                is_pair, tl.sum(tl.where(mine, before, 0), 0), chunk * BLOCK_S - local_before
            )
        else:
            counts = tl.histogram(key, BINS, mask=key < num_local)
            seen = 0
        first_pair = tl.cumsum(counts, 0) - counts  # the non-local bin starts at num_pairs
        my_count = tl.sum(tl.where(mine, counts, 0), 0)
        my_first = tl.sum(tl.where(mine, first_pair, 0), 0)
        num_pairs = tl.sum(tl.where(is_expert, counts, 0), 0)
        my_tiles, my_tile0, num_tiles = _tiling(counts, is_expert, mine, BLOCK_N)
        my_tiles_b, my_tile0_b, num_tiles_b = _tiling(counts, is_expert, mine, BLOCK_N_B)

        # This bin's slots of the chunk in (row, k) order -> pair numbers my_first + seen, ...
        within = seen + tl.cumsum(hit.to(tl.int32), 0) - 1  # index among this bin's slots
        pair = my_first + within
        tl.store(pair_flat_ptr + pair, offs, mask=hit)
        tl.store(pair_row_ptr + pair, offs // topk, mask=hit)
        tl.store(pair_slot_ptr + offs, tl.where(is_pair, pair, -1), mask=hit)
        hit_pair = hit & (key < num_local)  # hit, and this program is an expert's
        _route_pairs(
            route_flat_ptr, route_pair_ptr, my_tile0, within, offs, pair, hit_pair, BLOCK_N
        )
        if TWO_TILINGS:
            _route_pairs(
                route_flat_b_ptr,
                route_pair_b_ptr,
                my_tile0_b,
                within,
                offs,
                pair,
                hit_pair,
                BLOCK_N_B,
            )

        if is_pair:
            if chunk == 0:
                tl.store(expert_pairs_ptr + me, my_count.to(tl.int64))
                _expert_tiles(
                    tile_expert_ptr,
                    tile_start_ptr,
                    tile_rows_ptr,
                    route_flat_ptr,
                    route_pair_ptr,
                    me,
                    my_count,
                    my_first,
                    my_tiles,
                    my_tile0,
                    num_slots,
                    BLOCK_N,
                    LANES,
                    BLOCK_T,
                )
                if TWO_TILINGS:
                    _expert_tiles(
                        tile_expert_b_ptr,
                        tile_start_b_ptr,
                        tile_rows_b_ptr,
                        route_flat_b_ptr,
                        route_pair_b_ptr,
                        me,
                        my_count,
                        my_first,
                        my_tiles_b,
                        my_tile0_b,
                        num_slots,
                        BLOCK_N_B,
                        LANES_B,
                        BLOCK_T,
                    )
        else:
            if chunk == 0:
                tl.store(num_pairs_ptr, num_pairs)
                tl.store(num_tiles_ptr, num_tiles)
                tl.store(num_padded_ptr, num_tiles * BLOCK_N)
                if TWO_TILINGS:
                    tl.store(num_tiles_b_ptr, num_tiles_b)
                    tl.store(num_padded_b_ptr, num_tiles_b * BLOCK_N_B)
            _unused_tiles(
                tile_expert_ptr,
                tile_start_ptr,
                tile_rows_ptr,
                route_flat_ptr,
                route_pair_ptr,
                num_tiles,
                tile_cap,
                num_local,
                num_slots,
                chunk,
                tl.num_programs(1),
                BLOCK_N,
                LANES,
                BLOCK_T,
            )
            if TWO_TILINGS:
                _unused_tiles(
                    tile_expert_b_ptr,
                    tile_start_b_ptr,
                    tile_rows_b_ptr,
                    route_flat_b_ptr,
                    route_pair_b_ptr,
                    num_tiles_b,
                    tile_cap_b,
                    num_local,
                    num_slots,
                    chunk,
                    tl.num_programs(1),
                    BLOCK_N_B,
                    LANES_B,
                    BLOCK_T,
                )


def workspace_parts(
    rows: int, topk: int, num_local: int, block_ns: tuple[int, ...]
) -> dict[str, int]:
    """Bytes of each tensor one `_launch` over R = rows receive rows of topk ids allocates, by
    name: "pairs" int32 pair_row, pair_flat, pair_slot [R * K] and num_pairs [1];
    "expert_pairs" int64 [E_local]; per tiling "tiles" int32 tile_expert, tile_start, tile_rows
    [TC] and num_tiles [1] (TC = tile_capacity) and "routes" int32 flat, pair [TC * block_n] and
    num_padded [1] (both summed over the tilings); "histogram" int32 [chunks, bins]."""
    slots = pair_capacity(rows, topk)
    tiles = [tile_capacity(rows, topk, num_local, block_n) for block_n in block_ns]
    return {
        "pairs": (3 * slots + 1) * 4,
        "expert_pairs": num_local * 8,
        "tiles": sum((3 * t + 1) * 4 for t in tiles),
        "routes": sum((2 * t * n + 1) * 4 for t, n in zip(tiles, block_ns)),
        "histogram": max(1, -(-slots // BLOCK_S)) * triton.next_power_of_2(num_local + 2) * 4,
    }


def group_and_route(
    ids: torch.Tensor, first_expert: int, num_local: int, block_n: int, pdl: bool = False
) -> tuple[PairGroups, TileRoutes]:
    """`group_pairs(ids, ...)` and `tile_routes` of it (experts/hopper/grouping.py), bitwise the
    same tensors, from one launch on ids' device (a CUDA GPU, or Triton's CPU interpreter). ids
    int32 [R, K], contiguous; block_n 1..MAX_BLOCK_N (`fits`). pdl: launch with programmatic
    dependent launch where the device allows it (experts/hopper/pdl.py, `pdl_options`)."""
    return _launch("group_and_route", ids, first_expert, num_local, (block_n,), pdl)[0]


def group_and_route_tilings(
    ids: torch.Tensor,
    first_expert: int,
    num_local: int,
    block_ns: tuple[int, ...],
    pdl: bool = False,
) -> list[tuple[PairGroups, TileRoutes]]:
    """`group_and_route` for one or two distinct tile sizes in one launch: [(groups, routes)]
    per block_n, as group_pairs(ids, ..., block_n) and tile_routes of it would give; the pair
    tensors (pair_row, pair_flat, num_pairs, pair_slot, expert_pairs) are shared. humming's FC1
    and FC2 kernels can tile differently (24 and 32 pairs at T=64 on a DEP16 shard): one launch
    instead of two saves one grouping (21 us there). pdl as in group_and_route."""
    return _launch("group_and_route_tilings", ids, first_expert, num_local, block_ns, pdl)


def _tiling_outputs(groups: PairGroups, routes: TileRoutes) -> tuple[torch.Tensor, ...]:
    """One tiling's outputs in group_route_kernel's order."""
    tiles = (groups.tile_expert, groups.tile_start, groups.tile_rows, groups.num_tiles)
    return (*tiles, routes.flat, routes.pair, routes.num_padded)


def _tile_lanes(groups: PairGroups) -> tuple[int, int]:
    """(BLOCK_N, LANES) of one tiling: pairs a tile, and the power of two >= that."""
    return groups.block_n, triton.next_power_of_2(groups.block_n)


def _launch(
    owner: str,
    ids: torch.Tensor,
    first_expert: int,
    num_local: int,
    block_ns: tuple[int, ...],
    pdl: bool,
) -> list[tuple[PairGroups, TileRoutes]]:
    """The checks (ValueError naming `owner`), the outputs and the launch of both functions."""
    if not isinstance(block_ns, tuple) or len(block_ns) not in (1, 2):
        raise ValueError(
            f"{owner}: block_ns={block_ns!r}; expected a tuple of one or two tile sizes"
        )
    if len(set(block_ns)) != len(block_ns):
        raise ValueError(
            f"{owner}: block_ns={block_ns!r}; expected distinct tile sizes (pass an"
            " equal size once)"
        )
    for block_n in block_ns:
        check_grouping_args(owner, ids, first_expert, num_local, block_n)
        if not fits(block_n):
            raise ValueError(
                f"{owner}: block_n={block_n}; expected at most {MAX_BLOCK_N} (the"
                " kernel's tile lanes); group_pairs takes any block_n"
            )
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(
            f"{owner}: ids {ids.dtype}, contiguous={ids.is_contiguous()}; expected contiguous int32"
        )
    rows, topk = ids.shape
    slots = pair_capacity(rows, topk)
    device = ids.device

    def int32(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, device=device)

    pairs = PairGroups(
        pair_row=int32(slots),
        pair_flat=int32(slots),
        num_pairs=int32(1),
        pair_slot=int32(slots),
        tile_expert=int32(0),
        tile_start=int32(0),
        tile_rows=int32(0),
        num_tiles=int32(0),
        expert_pairs=torch.empty(num_local, dtype=torch.int64, device=device),
        block_n=0,
    )
    tilings = []
    for block_n in block_ns:
        tiles = tile_capacity(rows, topk, num_local, block_n)
        groups = dataclasses.replace(
            pairs,
            tile_expert=int32(tiles),
            tile_start=int32(tiles),
            tile_rows=int32(tiles),
            num_tiles=int32(1),
            block_n=block_n,
        )
        routes = TileRoutes(
            flat=int32(tiles * block_n),
            pair=int32(tiles * block_n),
            num_padded=int32(1).reshape(()),
            sentinel=slots,
        )
        tilings.append((groups, routes))
    (a, a_routes), (b, b_routes) = tilings[0], tilings[-1]
    bins = triton.next_power_of_2(num_local + 2)
    chunks = max(1, -(-slots // BLOCK_S))
    hist = torch.empty(chunks, bins, dtype=torch.int32, device=device)
    if chunks > 1:
        chunk_histogram_kernel[(chunks,)](
            ids,
            hist,
            slots,
            first_expert,
            num_local,
            bins,
            BLOCK_S,
            num_warps=NUM_WARPS,
            **pdl_options(pdl, device, chunk_histogram_kernel),
        )
        # Each program reads two rows of the prefix where it read every chunk's row (57 x 512
        # programs x 512 rows at T = 2048 on a DEP16 shard: 3.8 GB of L2 reads).
        if chunks < PREFIX_KERNEL_CHUNKS:
            hist.cumsum_(0)
        else:
            width = min(bins, PREFIX_BINS)
            chunk_prefix_kernel[(bins // width,)](
                hist,
                chunks,
                bins,
                width,
                PREFIX_TILE // width,
                num_warps=NUM_WARPS,
                **pdl_options(pdl, device, chunk_prefix_kernel),
            )
    # group_route_kernel's arguments, in the groups of its signature.
    pair_outputs = (a.pair_row, a.pair_flat, a.pair_slot, a.num_pairs, a.expert_pairs)
    sizes = (slots, topk, first_expert, num_local, a.tile_capacity, b.tile_capacity)
    flags = (len(tilings) == 2, bins, BLOCK_S, chunks > 1, BLOCK_T)
    group_route_kernel[(num_local + 1, chunks)](
        ids,
        hist,
        *pair_outputs,
        *_tiling_outputs(a, a_routes),
        *_tiling_outputs(b, b_routes),
        *sizes,
        *_tile_lanes(a),
        *_tile_lanes(b),
        *flags,
        num_warps=NUM_WARPS,
        **pdl_options(pdl, device, group_route_kernel),
    )
    return tilings
