"""The Triton kernels of a chunked humming-engine call (experts/hopper/chunks.py says what a
chunk is): chunk_routes_kernel cuts a tiling's routes into the chunks, gather_rows_kernel copies a
chunk's pairs' rows; `chunk_routes` and `gather_rows` launch them."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dep_ep.constants import SCALE_BLOCK
from dep_ep.experts.hopper.chunks import ChunkPlan, ChunkRoutes, route_row_shape
from dep_ep.experts.hopper.grouping import PairGroups, TileRoutes
from dep_ep.experts.hopper.kernels import _e8m0_to_fp32
from dep_ep.experts.hopper.pdl import pdl_options, wait_then_release

SCALE_BLOCK_C = tl.constexpr(SCALE_BLOCK)
# chunk_routes_kernel: tiles scanned and slots written per step.
ROUTE_BLOCK = 1024
# gather_rows_kernel: rows per step, the most columns per program, programs per SM (4 warps).
GATHER_ROWS, GATHER_MAX_BLOCK_L, GATHER_PROGRAMS_PER_SM = 8, 512, 16


@triton.jit(do_not_specialize=["chunk"])
def chunk_routes_kernel(
    tile_expert_ptr,
    tile_start_ptr,
    tile_rows_ptr,
    num_tiles_ptr,
    route_pair_ptr,
    num_pairs_ptr,
    routes_ptr,
    experts_ptr,
    num_padded_ptr,
    pairs_ptr,
    chunk,
    num_local,
    SLOTS: tl.constexpr,
    TILES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program c of a grid of `chunks` programs writes chunk c of ChunkRoutes from one tiling:
    PairGroups' tile_expert, tile_start, tile_rows int32 [TC] and num_tiles, num_pairs int32
    [1]; TileRoutes.pair int32 [TC * BLOCK_N], global pair numbers or a sentinel >= num_pairs;
    into routes int32 [chunks, SLOTS], experts int32 [chunks, TILES], num_padded and pairs int32
    [chunks] (chunks.ChunkRoutes: chunk-local pair numbers, the sentinel `chunk`). A call
    over its budget (num_pairs > chunks * chunk, the grid's chunks) gets no tile and no pair in
    any chunk: its GEMMs, gathers and SiTU do no work, and the finalize writes its NaN rows.
    PDL: launched with programmatic dependent launch (experts/hopper/pdl.py)."""
    wait_then_release(PDL)
    c = tl.program_id(0)
    lo = c.to(tl.int64) * chunk
    hi = lo + chunk
    num_tiles = tl.load(num_tiles_ptr)
    num_pairs = tl.load(num_pairs_ptr).to(tl.int64)
    over_budget = num_pairs > tl.num_programs(0).to(tl.int64) * chunk
    num_tiles = tl.where(over_budget, 0, num_tiles)
    num_pairs = tl.where(over_budget, 0, num_pairs)
    # Tiles are in pair order: the chunk's are [first, end), first = tiles ending at or before lo,
    # end = tiles starting before hi.
    first = 0
    end = 0
    t0 = 0
    while t0 < num_tiles:
        t = t0 + tl.arange(0, BLOCK)
        used = t < num_tiles
        start = tl.load(tile_start_ptr + t, mask=used, other=0).to(tl.int64)
        rows = tl.load(tile_rows_ptr + t, mask=used, other=0).to(tl.int64)
        first += tl.sum((used & (start + rows <= lo)).to(tl.int32))
        end += tl.sum((used & (start < hi)).to(tl.int32))
        t0 += BLOCK
    # At most the route rows' tiles (chunks.py's bound, which no routing exceeds: a tile meeting
    # the chunk holds one of its pairs at least, and each expert adds at most one partial tile at
    # each end). The clamp only keeps a broken bound from pointing humming at the next chunk's
    # row; the tiles it would drop are not computed, so it is no substitute for the bound.
    tiles = tl.minimum(tl.maximum(end - first, 0), tl.minimum(TILES, SLOTS // BLOCK_N))
    for i0 in range(0, TILES, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        inside = i < TILES
        mine = i < tiles
        expert = tl.load(tile_expert_ptr + first + i, mask=mine, other=num_local)
        tl.store(experts_ptr + c * TILES + i, expert, mask=inside)
    for s0 in range(0, SLOTS, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        inside = s < SLOTS
        mine = s < tiles * BLOCK_N
        pair = tl.load(route_pair_ptr + first * BLOCK_N + s, mask=mine, other=0).to(tl.int64)
        keep = mine & (pair >= lo) & (pair < hi) & (pair < num_pairs)
        local = tl.where(keep, pair - lo, chunk)
        tl.store(routes_ptr + c * SLOTS + s, local.to(tl.int32), mask=inside)
    tl.store(num_padded_ptr + c, tiles * BLOCK_N)
    tl.store(pairs_ptr + c, tl.minimum(tl.maximum(num_pairs - lo, 0), chunk).to(tl.int32))


def chunk_routes(
    groups: PairGroups, routes: TileRoutes, plan: ChunkPlan, num_local: int, pdl: bool = False
) -> ChunkRoutes:
    """One tiling's routes in the plan's chunks (ChunkRoutes), one launch, on the groups'
    device (a CUDA GPU or Triton's CPU interpreter); no host synchronisation. pdl: launch with
    programmatic dependent launch where the device allows it (experts/hopper/pdl.py)."""
    device = groups.tile_expert.device
    slots, tiles = route_row_shape(plan.chunk, groups.block_n, num_local, groups.tile_capacity)
    out = ChunkRoutes(
        routes=torch.empty(plan.chunks, slots, dtype=torch.int32, device=device),
        experts=torch.empty(plan.chunks, tiles, dtype=torch.int32, device=device),
        num_padded=torch.empty(plan.chunks, dtype=torch.int32, device=device),
        pairs=torch.empty(plan.chunks, dtype=torch.int32, device=device),
    )
    chunk_routes_kernel[(plan.chunks,)](
        groups.tile_expert,
        groups.tile_start,
        groups.tile_rows,
        groups.num_tiles,
        routes.pair,
        groups.num_pairs,
        out.routes,
        out.experts,
        out.num_padded,
        out.pairs,
        plan.chunk,
        num_local,
        slots,
        tiles,
        groups.block_n,
        ROUTE_BLOCK,
        num_warps=4,
        **pdl_options(pdl, device, chunk_routes_kernel),
    )
    return out


# first_pair is c * C (a multiple of CHUNK_ALIGN); chunk_pairs_ptr points at element c of
# ChunkRoutes.pairs (4-byte aligned): neither is specialised, so every chunk runs one compilation.
@triton.jit(do_not_specialize=["first_pair"], do_not_specialize_on_alignment=["chunk_pairs_ptr"])
def gather_rows_kernel(
    x_ptr,
    sf_ptr,
    pair_row_ptr,
    first_pair,
    chunk_pairs_ptr,
    xg_ptr,
    xs_ptr,
    LATENT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """For j < chunk_pairs (int32 [1]): xg[j] = x[pair_row[first_pair + j]] (uint8 [.., L], the
    e4m3 bytes) and xs[j] = 2^(byte - 127) of that row's E8M0 scales sf uint8 [R, L/32] (fp32
    [.., L/32]; byte 255 NaN, as widen_scales_kernel). Grid (programs, L / BLOCK_L); program p
    takes rows p * ROWS, (p + programs) * ROWS, ... PDL as in chunk_routes_kernel."""
    wait_then_release(PDL)
    count = tl.load(chunk_pairs_ptr)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    scale_cols = tl.program_id(1) * (BLOCK_L // SCALE_BLOCK_C) + tl.arange(
        0, BLOCK_L // SCALE_BLOCK_C
    )
    first = tl.program_id(0) * ROWS
    while first < count:
        rows = first + tl.arange(0, ROWS)
        ok = rows < count
        src = tl.load(pair_row_ptr + first_pair + rows, mask=ok, other=0).to(tl.int64)
        dst = rows.to(tl.int64)
        values = tl.load(x_ptr + src[:, None] * LATENT + cols[None, :], mask=ok[:, None])
        tl.store(xg_ptr + dst[:, None] * LATENT + cols[None, :], values, mask=ok[:, None])
        scale = tl.load(
            sf_ptr + src[:, None] * (LATENT // SCALE_BLOCK_C) + scale_cols[None, :],
            mask=ok[:, None],
            other=0,
        )
        tl.store(
            xs_ptr + dst[:, None] * (LATENT // SCALE_BLOCK_C) + scale_cols[None, :],
            _e8m0_to_fp32(scale),
            mask=ok[:, None],
        )
        first += tl.num_programs(0) * ROWS


def gather_rows(
    x: torch.Tensor,
    sf: torch.Tensor,
    pair_row: torch.Tensor,
    first_pair: int,
    chunk_pairs: torch.Tensor,
    xg: torch.Tensor,
    xs: torch.Tensor,
    sms: int,
    pdl: bool = False,
) -> None:
    """Launch gather_rows_kernel: x uint8 [R, L] (e4m3 bytes), sf uint8 [R, L/32] (E8M0),
    pair_row int32 [R * K] (PairGroups: the receive row of pair p, in expert order), rows
    first_pair .. first_pair + count - 1 of it, count = element 0 of chunk_pairs (an int32 view,
    ChunkRoutes.pairs[c:]), into xg uint8 [C, L] and xs fp32 [C, L/32] (rows past count
    untouched); `sms` sizes the grid; pdl as in chunk_routes."""
    latent = x.shape[1]
    block_l = math.gcd(GATHER_MAX_BLOCK_L, latent)
    column_blocks = latent // block_l
    rows = xg.shape[0]
    programs = max(1, min(-(-rows // GATHER_ROWS), GATHER_PROGRAMS_PER_SM * sms // column_blocks))
    gather_rows_kernel[(programs, column_blocks)](
        x,
        sf,
        pair_row,
        first_pair,
        chunk_pairs,
        xg,
        xs,
        latent,
        GATHER_ROWS,
        block_l,
        num_warps=4,
        **pdl_options(pdl, x.device, gather_rows_kernel),
    )
