"""Device-side grouping of receive rows by local expert, for the fused experts kernels.

Everything here is plain torch on fixed-size tensors: no host synchronisation, no shape that
depends on the data, so it runs on CPU (the tests) and inside a CUDA graph capture alike.

A pair is one (row, k) slot of ids [R, K] whose id is local, i.e. in [first_expert, first_expert
+ num_local). Pairs are numbered in expert order, and within an expert in (row, k) order: the
stable sort of the flattened slots by local expert. Each expert's pairs are cut into tiles of at
most `block_n` pairs (the kernels' N side); tile t covers pairs [tile_start[t], tile_start[t] +
tile_rows[t]) of expert tile_expert[t]. Tiles follow each other in expert order, so the tiles of
one expert are adjacent in the work list (their weight tiles are read once into L2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PairGroups:
    """Pairs grouped by local expert; capacities are bounds fixed by (R, K, num_local, block_n).

    pair_row   int32 [pair_capacity]   receive row of pair j (j < num_pairs; the rest is the row
                                       of a non-local slot, never read by the kernels)
    pair_flat  int32 [pair_capacity]   flat slot row * K + k of pair j (likewise)
    num_pairs  int32 [1]               pairs (on the device)
    pair_slot  int32 [R * K]           pair number of slot (row, k), -1 where the id is not local
    tile_expert int32 [tile_capacity]  local expert of tile t; num_local for t >= num_tiles
    tile_start int32 [tile_capacity]   first pair of tile t
    tile_rows  int32 [tile_capacity]   pairs in tile t, 1..block_n (0 for t >= num_tiles)
    num_tiles  int32 [1]               tiles in use (on the device; the kernels read it)
    expert_pairs int64 [num_local]     pairs per local expert
    """

    pair_row: torch.Tensor
    pair_flat: torch.Tensor
    num_pairs: torch.Tensor
    pair_slot: torch.Tensor
    tile_expert: torch.Tensor
    tile_start: torch.Tensor
    tile_rows: torch.Tensor
    num_tiles: torch.Tensor
    expert_pairs: torch.Tensor
    block_n: int

    @property
    def pair_capacity(self) -> int:
        return self.pair_row.shape[0]

    @property
    def tile_capacity(self) -> int:
        return self.tile_expert.shape[0]


def pair_capacity(rows: int, topk: int, num_local: int) -> int:
    """Most pairs R receive rows can hold: a row has at most min(K, num_local) local ids."""
    return rows * min(topk, num_local)


def tile_capacity(rows: int, topk: int, num_local: int, block_n: int) -> int:
    """Most tiles: every expert's last tile may be partial, so sum ceil(p_e / block_n) <=
    floor(P / block_n) + num_local for P pairs over num_local experts."""
    return pair_capacity(rows, topk, num_local) // block_n + num_local


# Up to this many one-hot elements (E_local + 1 keys x R * K slots) the pair order comes from a
# running count per key, above it from a stable sort. On an H200 torch's sort of 1.4k keys took
# 29 us and of 42k keys 102 us (16 launches); a running count along dim 0 of [N, keys] was far
# slower (~9 ms at 42k x 57), hence the [keys, N] layout, counted along its last dim.
ONE_HOT_MAX = 1 << 20


def stable_order(key: torch.Tensor, num_keys: int, one_hot_max: int = ONE_HOT_MAX):
    """(order, position, counts) for keys int64 [N] in [0, num_keys): order int64 [N] lists the
    elements in the stable sort by key, position int64 [N] is each element's place in it (the
    inverse of order), counts int64 [num_keys] how many elements hold each key."""
    arange = torch.arange(key.numel(), device=key.device)
    if key.numel() * num_keys <= one_hot_max:
        keys = torch.arange(num_keys, device=key.device)
        one_hot = (key[None, :] == keys[:, None]).to(torch.int32)  # [num_keys, N]
        running = torch.cumsum(one_hot, 1)  # elements up to and including each, per key
        counts = running[:, -1].long() if key.numel() else torch.zeros_like(keys)
        before = (running - one_hot)[key, arange].long()  # earlier elements with the same key
        position = (torch.cumsum(counts, 0) - counts)[key] + before
        order = torch.empty_like(key)
        order[position] = arange
        return order, position, counts
    counts = torch.zeros(num_keys, dtype=torch.int64, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    order = torch.sort(key, stable=True).indices
    position = torch.empty_like(key)
    position[order] = arange
    return order, position, counts


def group_pairs(ids: torch.Tensor, first_expert: int, num_local: int, block_n: int,
                one_hot_max: int = ONE_HOT_MAX) -> PairGroups:  # fmt: skip
    """Group the local (row, k) slots of ids int32 [R, K] (global ids, -1 = none) by local expert
    (module docstring). Runs on ids' device; no host synchronisation. one_hot_max: see
    stable_order (both ways give the same groups)."""
    if ids.dim() != 2:
        raise ValueError(f"group_pairs: ids shape {tuple(ids.shape)}; expected [R, K]")
    if block_n < 1 or num_local < 1:
        raise ValueError(f"group_pairs: block_n={block_n}, num_local={num_local}; both >= 1")
    rows, topk = ids.shape
    device = ids.device
    local = ids.reshape(-1).long() - first_expert  # [R*K]
    is_local = (local >= 0) & (local < num_local)
    key = torch.where(is_local, local, num_local)  # non-local slots sort after every expert
    # Pair j is slot order[j]; slot i is pair position[i] (pairs come first in the order).
    order, position, counts = stable_order(key, num_local + 1, one_hot_max)
    expert_pairs = counts[:num_local]

    pairs = pair_capacity(rows, topk, num_local)
    pair_row = torch.div(order[:pairs], topk, rounding_mode="floor").to(torch.int32)
    pair_flat = order[:pairs].to(torch.int32)
    pair_slot = torch.where(is_local, position, -1).to(torch.int32)

    first_pair = torch.cumsum(expert_pairs, 0) - expert_pairs
    expert_tiles = torch.div(expert_pairs + block_n - 1, block_n, rounding_mode="floor")
    tiles_through = torch.cumsum(expert_tiles, 0)  # tiles of experts 0..e
    tiles = tile_capacity(rows, topk, num_local, block_n)
    t = torch.arange(tiles, device=device)
    tile_expert = torch.searchsorted(tiles_through, t, right=True)  # num_local: unused tile
    e = tile_expert.clamp(max=num_local - 1)
    within = (t - (tiles_through[e] - expert_tiles[e])) * block_n
    used = tile_expert < num_local
    tile_start = torch.where(used, first_pair[e] + within, 0)
    tile_rows = torch.where(used, (expert_pairs[e] - within).clamp(0, block_n), 0)
    return PairGroups(
        pair_row=pair_row,
        pair_flat=pair_flat,
        num_pairs=expert_pairs.sum().reshape(1).to(torch.int32),
        pair_slot=pair_slot,
        tile_expert=tile_expert.to(torch.int32),
        tile_start=tile_start.to(torch.int32),
        tile_rows=tile_rows.to(torch.int32),
        num_tiles=tiles_through[-1:].to(torch.int32),
        expert_pairs=expert_pairs,
        block_n=block_n,
    )
