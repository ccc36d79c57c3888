"""The grouping of experts/grouping.py and its tile routes in one Triton launch.

`group_pairs` (torch) runs ~30 small kernels: 107 us in graph replay on an H200 for the 1.4k
slots of T=8 on a DEP16 shard, a quarter of HopperExperts' 426 us there (docs/bench_experts.md).
This kernel produces the same tensors,
bitwise (the tests compare them), in one launch of num_local + 1 programs:

  program e < num_local  expert e: counts every expert's slots (so it knows where its pairs
                         start), then writes its pairs in (row, k) order, its tiles and its
                         tiles' route entries;
  program num_local      the non-local slots (after the pairs, as the stable sort leaves them),
                         the unused tiles, their route entries and the three device scalars.

Each program reads ids twice (a histogram pass, then the scatter), BLOCK_S slots a step; nothing
is shared between programs, so no atomics and no ordering between them. Work per program grows
with R * K: at K3's T=256 on DEP16 (65,536 slots) each program takes 64 steps a pass. The
histogram counts the local slots only (masked): Triton lowers it to one shared-memory atomic per
counted element, and on a DEP16 shard 15 of 16 slots are not local, all in one bin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dep_ep.experts.grouping import (
    PairGroups,
    TileRoutes,
    check_grouping_args,
    pair_capacity,
    tile_capacity,
)

BLOCK_S = 1024  # slots a program reads per step
BLOCK_T = 64  # tiles a program writes per step
NUM_WARPS = 4
# Triton's largest block is 2^20 elements: [BLOCK_T, block_n] route slots of the unused tiles.
MAX_BLOCK_N = (1 << 20) // BLOCK_T


def fits(block_n: int) -> bool:
    """Whether the kernel takes tiles of block_n pairs: a power of two (tl.arange's lanes) up
    to MAX_BLOCK_N."""
    return 1 <= block_n <= MAX_BLOCK_N and block_n & (block_n - 1) == 0


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
def group_route_kernel(
    ids_ptr,  # int32 [R*K] global expert ids, -1 = none
    pair_row_ptr,  # int32 [R*K] out
    pair_flat_ptr,  # int32 [R*K] out
    pair_slot_ptr,  # int32 [R*K] out
    num_pairs_ptr,  # int32 [1] out
    tile_expert_ptr,  # int32 [TC] out
    tile_start_ptr,  # int32 [TC] out
    tile_rows_ptr,  # int32 [TC] out
    num_tiles_ptr,  # int32 [1] out
    expert_pairs_ptr,  # int64 [num_local] out
    route_flat_ptr,  # int32 [TC * BLOCK_N] out: pair_flat of the tile slot's pair, or sentinel
    route_pair_ptr,  # int32 [TC * BLOCK_N] out: the tile slot's pair number, or sentinel
    num_padded_ptr,  # int32 [1] out: num_tiles * BLOCK_N
    num_slots,  # R * K (also the routes' sentinel)
    topk,
    first_expert,
    num_local,
    tile_cap,  # TC
    BLOCK_N: tl.constexpr,
    BINS: tl.constexpr,  # a power of two >= num_local + 2: experts, the non-local bin, JUNK
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    me = tl.program_id(0)  # local expert, or num_local for the non-local slots
    JUNK: tl.constexpr = BINS - 1
    slot = tl.arange(0, BLOCK_S)

    # Pass 1: pairs per expert over every slot (the non-local bin and JUNK stay 0).
    counts = tl.zeros((BINS,), dtype=tl.int32)
    for s0 in range(0, num_slots, BLOCK_S):
        key = _keys(ids_ptr, s0 + slot, num_slots, first_expert, num_local, JUNK)
        counts += tl.histogram(key, BINS, mask=key < num_local)
    bins = tl.arange(0, BINS)
    is_expert = bins < num_local
    first_pair = tl.cumsum(counts, 0) - counts  # the non-local bin starts at num_pairs
    tiles = tl.where(is_expert, (counts + BLOCK_N - 1) // BLOCK_N, 0)
    tiles_before = tl.cumsum(tiles, 0) - tiles
    mine = bins == me
    my_count = tl.sum(tl.where(mine, counts, 0), 0)
    my_first = tl.sum(tl.where(mine, first_pair, 0), 0)
    my_tiles = tl.sum(tl.where(mine, tiles, 0), 0)
    my_tile0 = tl.sum(tl.where(mine, tiles_before, 0), 0)
    num_pairs = tl.sum(tl.where(is_expert, counts, 0), 0)
    num_tiles = tl.sum(tiles, 0)
    is_pair = me < num_local

    # Pass 2: this bin's slots in (row, k) order -> pair numbers my_first, my_first + 1, ...
    seen = tl.full((), 0, tl.int32)
    for s0 in range(0, num_slots, BLOCK_S):
        offs = s0 + slot
        key = _keys(ids_ptr, offs, num_slots, first_expert, num_local, JUNK)
        hit = key == me
        within = seen + tl.cumsum(hit.to(tl.int32), 0) - 1  # index among this bin's slots
        pair = my_first + within
        tl.store(pair_flat_ptr + pair, offs, mask=hit)
        tl.store(pair_row_ptr + pair, offs // topk, mask=hit)
        tl.store(pair_slot_ptr + offs, tl.where(is_pair, pair, -1), mask=hit)
        # Pair `within` of expert me sits in tile my_tile0 + within // BLOCK_N at slot
        # within % BLOCK_N: route index my_tile0 * BLOCK_N + within.
        route = my_tile0 * BLOCK_N + within
        hit_pair = hit & (key < num_local)  # hit, and this program is an expert's
        tl.store(route_flat_ptr + route, offs, mask=hit_pair)
        tl.store(route_pair_ptr + route, pair, mask=hit_pair)
        seen += tl.sum(hit.to(tl.int32), 0)

    lane = tl.arange(0, BLOCK_N)
    tile = tl.arange(0, BLOCK_T)
    if is_pair:
        tl.store(expert_pairs_ptr + me, my_count.to(tl.int64))
        # The slots of the last tile past the expert's pairs.
        pad = my_count + lane
        pad_mask = pad < my_tiles * BLOCK_N
        tl.store(route_flat_ptr + my_tile0 * BLOCK_N + pad, num_slots, mask=pad_mask)
        tl.store(route_pair_ptr + my_tile0 * BLOCK_N + pad, num_slots, mask=pad_mask)
        for j0 in range(0, my_tiles, BLOCK_T):
            j = j0 + tile
            used = j < my_tiles
            tl.store(tile_expert_ptr + my_tile0 + j, tl.zeros_like(j) + me, mask=used)
            tl.store(tile_start_ptr + my_tile0 + j, my_first + j * BLOCK_N, mask=used)
            rows = tl.minimum(my_count - j * BLOCK_N, BLOCK_N)
            tl.store(tile_rows_ptr + my_tile0 + j, rows, mask=used)
    else:
        tl.store(num_pairs_ptr, num_pairs)
        tl.store(num_tiles_ptr, num_tiles)
        tl.store(num_padded_ptr, num_tiles * BLOCK_N)
        for t0 in range(num_tiles, tile_cap, BLOCK_T):
            t = t0 + tile
            unused = t < tile_cap
            tl.store(tile_expert_ptr + t, tl.zeros_like(t) + num_local, mask=unused)
            tl.store(tile_start_ptr + t, tl.zeros_like(t), mask=unused)
            tl.store(tile_rows_ptr + t, tl.zeros_like(t), mask=unused)
            entry = t[:, None] * BLOCK_N + lane[None, :]  # [BLOCK_T, BLOCK_N]
            sentinel = tl.zeros_like(entry) + num_slots
            tl.store(route_flat_ptr + entry, sentinel, mask=unused[:, None])
            tl.store(route_pair_ptr + entry, sentinel, mask=unused[:, None])


def group_and_route(
    ids: torch.Tensor, first_expert: int, num_local: int, block_n: int
) -> tuple[PairGroups, TileRoutes]:
    """`group_pairs(ids, ...)` and `tile_routes` of it (experts/grouping.py), bitwise the same
    tensors, from one launch on ids' device (a CUDA GPU, or Triton's CPU interpreter). ids int32
    [R, K], contiguous; block_n a power of two (`fits`)."""
    check_grouping_args("group_and_route", ids, first_expert, num_local, block_n)
    if not fits(block_n):
        raise ValueError(f"group_and_route: block_n={block_n}; expected a power of two up to"
                         f" {MAX_BLOCK_N} (the kernel's tile lanes); group_pairs takes any"
                         " block_n")  # fmt: skip
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(f"group_and_route: ids {ids.dtype}, contiguous={ids.is_contiguous()};"
                         " expected contiguous int32")  # fmt: skip
    rows, topk = ids.shape
    slots = pair_capacity(rows, topk)
    tiles = tile_capacity(rows, topk, num_local, block_n)
    device = ids.device

    def int32(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, device=device)

    groups = PairGroups(
        pair_row=int32(slots), pair_flat=int32(slots), num_pairs=int32(1), pair_slot=int32(slots),
        tile_expert=int32(tiles), tile_start=int32(tiles), tile_rows=int32(tiles),
        num_tiles=int32(1), expert_pairs=torch.empty(num_local, dtype=torch.int64, device=device),
        block_n=block_n,
    )  # fmt: skip
    routes = TileRoutes(flat=int32(tiles * block_n), pair=int32(tiles * block_n),
                        num_padded=int32(1).reshape(()), sentinel=slots)  # fmt: skip
    bins = triton.next_power_of_2(num_local + 2)
    group_route_kernel[(num_local + 1,)](
        ids, groups.pair_row, groups.pair_flat, groups.pair_slot, groups.num_pairs,
        groups.tile_expert, groups.tile_start, groups.tile_rows, groups.num_tiles,
        groups.expert_pairs, routes.flat, routes.pair, routes.num_padded,
        slots, topk, first_expert, num_local, tiles,
        block_n, bins, BLOCK_S, BLOCK_T, num_warps=NUM_WARPS,
    )  # fmt: skip
    return groups, routes
