"""Device-side grouping of receive rows by local expert, for the fused experts kernels.

Everything here is plain torch on fixed-size tensors: no host synchronisation, no shape that
depends on the data, so it runs on CPU (the tests) and inside a CUDA graph capture alike.

A pair is one (row, k) slot of ids [R, K] whose id is local, i.e. in [first_expert, first_expert
+ num_local). Pairs are numbered in expert order, and within an expert in (row, k) order: the
stable sort of the flattened slots by local expert. Each expert's pairs are cut into tiles of at
most `block_n` pairs (the kernels' N side); tile t covers pairs [tile_start[t], tile_start[t] +
tile_rows[t]) of expert tile_expert[t]. Tiles follow each other in expert order, so the tiles of
one expert are adjacent in the work list (their weight tiles are read once into L2).

A tile route lays the tiles out at `block_n` slots each (humming's indexed routing): slot i of
tile t holds a value of pair tile_start[t] + i, or a sentinel past the tile's pairs.

`group_pairs` and `tile_routes` are the torch versions (any device, ~30 launches);
experts/hopper/grouping_kernel.py computes the same tensors in one Triton launch. `grouped` and
`routed_tilings` run one or the other (Grouping, HopperTiles.grouping).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from dep_ep.checks import check_flag, check_int_in
from dep_ep.constants import MAX_EXPERTS


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


@dataclass(frozen=True)
class TileRoutes:
    """The tiles of a PairGroups at block_n slots each; sentinel = R * K (past every slot).

    flat       int32 [tile_capacity * block_n]  slot t * block_n + i: pair_flat of pair
                                                tile_start[t] + i, or sentinel past tile_rows[t]
    pair       int32 [tile_capacity * block_n]  the same slots: the pair number, or sentinel
    num_padded int32 []                         num_tiles * block_n (the slots in use)
    """

    flat: torch.Tensor
    pair: torch.Tensor
    num_padded: torch.Tensor
    sentinel: int


class Grouping(enum.Enum):
    """How the pairs are grouped (HopperTiles.grouping), the same tensors either way. TRITON:
    experts/hopper/grouping_kernel.py in one launch; TORCH: group_pairs and tile_routes (~30
    launches, any device). On an H200 at K3's DEP16 shard the kernel takes 5-74 us where torch
    takes 119-209 us (T = 1..256, tiles of 16; docs/results/bench_experts.md)."""

    TORCH = "torch"
    TRITON = "triton"


def check_grouping(fn: str, grouping: object) -> None:
    """ValueError naming `fn` unless `grouping` is a Grouping (a string, even its value, is not)."""
    if not isinstance(grouping, Grouping):
        choices = ", ".join(str(g) for g in Grouping)
        raise ValueError(f"{fn}: grouping={grouping!r}; expected one of {choices}")


def pair_capacity(rows: int, topk: int) -> int:
    """Most pairs R receive rows can hold: R * K (a row may repeat a local id, so R * min(K,
    E_local) would not bound it; the two agree whenever E_local >= K, as at K3 up to 56 ranks)."""
    return rows * topk


def tile_capacity(rows: int, topk: int, num_local: int, block_n: int) -> int:
    """Most tiles: every expert's last tile may be partial, so sum ceil(p_e / block_n) <=
    floor(P / block_n) + num_local for P pairs over num_local experts."""
    return pair_capacity(rows, topk) // block_n + num_local


def check_grouping_args(fn: str, ids, first_expert, num_local, block_n) -> None:
    """ValueError naming `fn` unless ids is an integer [R, K] tensor and the ints are in range
    (first_expert + num_local below 2^31: ids are int32 on the wire)."""
    if (
        not isinstance(ids, torch.Tensor)
        or ids.dim() != 2
        or ids.dtype not in (torch.int32, torch.int64)
    ):
        shown = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids)
        raise ValueError(f"{fn}: ids {shown}; expected int32 or int64 [R, K]")
    first_expert = check_int_in(fn, "first_expert", first_expert, 0)
    num_local = check_int_in(fn, "num_local", num_local, 1)
    check_int_in(fn, "block_n", block_n, 1)
    if first_expert + num_local > MAX_EXPERTS:
        raise ValueError(
            f"{fn}: first_expert + num_local = {first_expert + num_local}; expected"
            f" at most 2^31 (expert ids are int32)"
        )


def kernel_ids(ids: torch.Tensor) -> bool:
    """Whether the grouping kernel reads `ids` as they are: contiguous int32 (the row contract's;
    int64 or strided ids are grouped in torch)."""
    return ids.dtype == torch.int32 and ids.is_contiguous()


def group_pairs(ids: torch.Tensor, first_expert: int, num_local: int, block_n: int) -> PairGroups:
    """Group the local (row, k) slots of ids int32 [R, K] (global ids, -1 = none) by local expert
    (module docstring). Runs on ids' device; no host synchronisation. On an H200, with
    tile_routes, it takes 133 us in graph replay for the 1.4k slots of T=8 on a DEP16 shard and
    209 us for the 42.7k of T=256, most of it the launches of its ~30 small kernels
    (docs/results/bench_experts.md)."""
    check_grouping_args("group_pairs", ids, first_expert, num_local, block_n)
    rows, topk = ids.shape
    device = ids.device
    flat = ids.reshape(-1).long()  # [R*K]
    local = flat - first_expert
    is_local = (flat >= 0) & (local >= 0) & (local < num_local)
    key = torch.where(is_local, local, num_local)  # non-local slots sort after every expert
    order = torch.sort(key, stable=True).indices  # pair j is slot order[j]: pairs sort first
    position = torch.empty_like(order)  # slot i is pair position[i]
    position[order] = torch.arange(key.numel(), device=device)
    expert_pairs = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    expert_pairs.scatter_add_(0, key, torch.ones_like(key))
    expert_pairs = expert_pairs[:num_local]

    pairs = pair_capacity(rows, topk)
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


def tile_routes(groups: PairGroups) -> TileRoutes:
    """The tile routes of `groups` (class TileRoutes), in torch."""
    block = groups.block_n
    sentinel = groups.pair_slot.shape[0]  # R * K
    within = torch.arange(block, device=groups.pair_flat.device)
    pair = groups.tile_start.long()[:, None] + within  # [tiles, block]
    used = within < groups.tile_rows[:, None]
    safe = pair.clamp(max=max(groups.pair_capacity - 1, 0))

    def lay_out(values: torch.Tensor) -> torch.Tensor:
        picked = values[safe] if values.numel() else torch.zeros_like(safe)
        return torch.where(used, picked, sentinel).to(torch.int32).reshape(-1)

    numbers = torch.arange(groups.pair_capacity, dtype=torch.int32, device=within.device)
    return TileRoutes(
        flat=lay_out(groups.pair_flat),
        pair=lay_out(numbers),
        num_padded=(groups.num_tiles * block).reshape(()),
        sentinel=sentinel,
    )


def grouped(
    ids: torch.Tensor,
    first_expert: int,
    num_local: int,
    block_n: int,
    grouping: Grouping,
    pdl: bool = False,
) -> tuple[PairGroups, TileRoutes | None]:
    """The pairs of ids grouped by local expert, and their tile routes where the grouping makes
    them in the same launch (Grouping.TRITON; TORCH returns None: tile_routes would cost
    launches). TRITON takes contiguous int32 ids and block_n up to grouping_kernel.MAX_BLOCK_N
    (16384); other ids or a larger block_n are grouped in torch, with the same result. pdl (a
    bool): the kernel launched with programmatic dependent launch (experts/hopper/pdl.py)."""
    check_grouping("grouped", grouping)
    check_grouping_args("grouped", ids, first_expert, num_local, block_n)
    check_flag("grouped", "pdl", pdl)
    if grouping is Grouping.TRITON and kernel_ids(ids):
        from dep_ep.experts.hopper.grouping_kernel import fits, group_and_route  # imports triton

        if fits(block_n):
            return group_and_route(ids, first_expert, num_local, block_n, pdl)
    return group_pairs(ids, first_expert, num_local, block_n), None


def routed_tilings(
    ids: torch.Tensor,
    first_expert: int,
    num_local: int,
    block_ns: tuple[int, ...],
    grouping: Grouping,
    pdl: bool = False,
) -> list[tuple[PairGroups, TileRoutes]]:
    """[(groups, routes)] for each tile size in block_ns (a tuple of one or two, distinct), as
    group_pairs and tile_routes give them: Grouping.TRITON in one launch of experts/hopper/
    grouping_kernel.py (when every size fits and the ids are contiguous int32; pdl, a bool: with
    programmatic dependent launch, experts/hopper/pdl.py), TORCH (or a size past the kernel's
    lanes, or other ids) in torch, once per size."""
    check_grouping("routed_tilings", grouping)
    if not isinstance(block_ns, (tuple, list)) or not block_ns:
        raise TypeError(f"routed_tilings: block_ns={block_ns!r}; expected a tuple of tile sizes")
    for block_n in block_ns:
        check_grouping_args("routed_tilings", ids, first_expert, num_local, block_n)
    check_flag("routed_tilings", "pdl", pdl)
    if grouping is Grouping.TRITON and kernel_ids(ids):
        from dep_ep.experts.hopper.grouping_kernel import fits, group_and_route_tilings

        if all(fits(block_n) for block_n in block_ns):
            return group_and_route_tilings(ids, first_expert, num_local, tuple(block_ns), pdl)
    tilings = []
    for block_n in block_ns:
        groups = group_pairs(ids, first_expert, num_local, block_n)
        tilings.append((groups, tile_routes(groups)))
    return tilings
