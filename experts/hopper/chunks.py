"""The humming engine's calls in chunks of pairs: memory that follows the pairs a rank receives,
not its receive slots.

humming's FC1 reads input row id // top_k and writes output row id of its sorted id list, so a
call on the receive rows themselves (top_k = K) writes one FC1 row per slot, R * K rows of 2I: at
K3 on 16 ranks and T = 2048 tokens a rank that is 524,288 rows, 6.4 GB, where the rank receives
about 32,768 pairs. A chunked call instead computes its pairs in fixed ranges of the pair list
(pairs are numbered in expert order, experts/hopper/grouping.py): chunk c holds pairs
[c * C, (c + 1) * C), and for each chunk

  gather_rows_kernel    copies the chunk's pairs' MXFP8 rows to C contiguous rows (scales widened
                        to the fp32 factors humming reads), so FC1 runs with top_k = 1 on chunk-
                        local ids;
  humming FC1           on the chunk's tile routes (below), output [C, 2I];
  situ_mxfp8_kernel     SiTU -> MXFP8 of the chunk's rows (INDEXED False);
  humming FC2           output rows [c * C, (c + 1) * C) of the call's expert output [P, L].

The buffers of a chunk are reused by the next (stream order), so a call holds C rows of the
gathered input, FC1's output and the activation, and P = chunks * C rows of expert output (the
finalize reads a row's pairs from every chunk). P is the pair budget (engine.pair_budget) split
into chunks of equal size, rounded up to CHUNK_ALIGN (`chunk_plan`): a call holding more pairs
computes none (chunk_routes_kernel gives every chunk no tile and no pair) and the finalize writes
NaN into every row with a local id (engine.py, the pair budget). Every chunk up to P is launched;
one without pairs has no tiles, and humming's kernels stop at once.

The kernels and their launches are in experts/hopper/chunk_kernels.py (Triton); this file is the
arithmetic, importable without Triton. chunk_routes_kernel cuts each tiling's routes (TileRoutes)
into chunks: chunk c's tiles are the tiles that hold a pair of the chunk (those are adjacent:
tiles follow the pair order), their slots carry the chunk-local pair number or the sentinel C (a
tile cut by a chunk's edge holds the pairs on this side only; humming computes the tile's other
rows as padding). A range of C pairs meets at most ceil(C / block_n) + 2 * E_local tiles (each
expert adds at most one partial tile at each end), which sizes the chunk's route rows
(`chunk_tile_capacity`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dep_ep.experts.hopper.grouping import pair_capacity

# A chunk's pair count is a multiple of this (so are the offsets c * C the kernels are given).
CHUNK_ALIGN = 64
# Route rows are padded to this many int32 (256 bytes), so every chunk's sorted-id list and tile
# expert list starts 256-byte aligned, as a fresh tensor would.
ROUTE_ROW_ALIGN = 64


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ChunkPlan:
    """How a call over R receive rows of K ids runs in chunks.

    chunk       pairs a chunk computes (C, a multiple of CHUNK_ALIGN): the rows of its buffers
    chunks      chunks launched (every one, whatever the routing: the launch shape is fixed)
    tuning_cap  the most pairs humming's kernels are chosen for in a chunked call: the largest
                power of two <= min(chunk_pairs, the budget rounded up to CHUNK_ALIGN), whatever
                C the budget's split gave (kernels chosen for a count a chunk may fall short of,
                as its last chunk does under any routing; correct for any count)
    pairs       chunks * C: the rows of the expert output, the call's max_pairs
    """

    chunk: int
    chunks: int
    tuning_cap: int

    @property
    def pairs(self) -> int:
        return self.chunk * self.chunks


def chunk_plan(rows: int, topk: int, budget: int, chunk_pairs: int) -> ChunkPlan | None:
    """None when the R * K slots fit one chunk (the call runs on the slots directly, at its
    capacity: it never overflows); else the budget (cut to 1..R * K) in as few chunks of at most
    chunk_pairs as it needs, of equal size rounded up to CHUNK_ALIGN: P = chunks * C exceeds the
    budget by less than CHUNK_ALIGN a chunk (73,920 pairs for a budget of 73,728 in chunks of
    16,384, where whole chunks of 16,384 would hold 81,920). budget: the pair budget;
    chunk_pairs: HummingEngine.chunk_pairs (a multiple of CHUNK_ALIGN)."""
    capacity = pair_capacity(rows, topk)
    if capacity <= chunk_pairs:
        return None
    budget = max(1, min(budget, capacity))
    chunks = -(-budget // chunk_pairs)
    chunk = round_up(-(-budget // chunks), CHUNK_ALIGN)  # <= chunk_pairs: both multiples of 64
    widest = min(chunk_pairs, round_up(budget, CHUNK_ALIGN))
    return ChunkPlan(chunk=chunk, chunks=chunks, tuning_cap=1 << (widest.bit_length() - 1))


def chunk_tile_capacity(chunk: int, block_n: int, num_local: int, tile_cap: int) -> int:
    """Route rows of one chunk, in tiles: the most tiles a range of `chunk` pairs meets,
    ceil(chunk / block_n) + 2 * num_local, at most `chunk` (each tile it meets holds one of its
    pairs at least) and the tiling's tile_cap."""
    return min(-(-chunk // block_n) + 2 * num_local, chunk, tile_cap)


@dataclass(frozen=True)
class ChunkRoutes:
    """One tiling's routes cut into a plan's chunks (humming's sorted ids per chunk).

    routes     int32 [chunks, S]  chunk c's slots: the chunk-local pair number (0..C-1) or the
                                  sentinel C (padding); S = route_row_slots(...)
    experts    int32 [chunks, T]  local expert of chunk c's tile i (num_local past its tiles)
    num_padded int32 [chunks]     chunk c's slots in use: its tiles * block_n
    pairs      int32 [chunks]     chunk c's pairs: clamp(num_pairs - c * C, 0, C)
                                  (0 in every chunk of a call over its budget, as num_padded)
    """

    routes: torch.Tensor
    experts: torch.Tensor
    num_padded: torch.Tensor
    pairs: torch.Tensor


def route_row_shape(chunk: int, block_n: int, num_local: int, tile_cap: int) -> tuple[int, int]:
    """(S, T): slots and tiles of a chunk's route rows, each padded to ROUTE_ROW_ALIGN."""
    tiles = chunk_tile_capacity(chunk, block_n, num_local, tile_cap)
    return round_up(tiles * block_n, ROUTE_ROW_ALIGN), round_up(tiles, ROUTE_ROW_ALIGN)


def chunk_routes_bytes(plan: ChunkPlan, block_n: int, num_local: int, tile_cap: int) -> int:
    """Bytes `chunk_routes` allocates for one tiling."""
    slots, tiles = route_row_shape(plan.chunk, block_n, num_local, tile_cap)
    return plan.chunks * (slots + tiles + 2) * 4
