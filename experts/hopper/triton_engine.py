"""TritonEngine: HopperExperts' GEMMs in our own Triton kernels (experts/hopper/kernels.py), with
ReferenceExperts' BF16 numerics: the grouping -> fc1_situ_kernel -> fc2_kernel -> finalize_kernel.
Runs wherever Triton does, its CPU interpreter included (HopperTiles(math="fp32"))."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from dep_ep.experts.hopper.engine import (
    GROUPING_BYTES_PER_SLOT,
    HopperEngine,
    PreparedCall,
    check_tiles,
)
from dep_ep.experts.hopper.grouping import grouped, pair_capacity
from dep_ep.experts.hopper.tiles import HopperTiles
from dep_ep.experts.weights import ExpertWeights


@dataclass(frozen=True)
class TritonEngine(HopperEngine):
    """The triton engine: MXFP4 weights and MXFP8 rows decoded exactly to BF16 in registers, BF16
    MMAs with fp32 sums, SiTU in FC1's epilogue (one rounding to BF16), FC2 rounded to BF16 once:
    ReferenceExperts' numerics up to the order of the fp32 sums. No atomics and no split K, so
    reruns on the same rows are bitwise equal.

    tiles: the kernels' block shapes and launches (all of HopperTiles' fields), checked against
    the weights' L and I when HopperExperts is built.
    """

    name: ClassVar[str] = "triton"
    activation_format: ClassVar[str] = "bf16"
    deterministic: ClassVar[bool] = True

    tiles: HopperTiles = field(default_factory=HopperTiles)

    def __post_init__(self) -> None:
        check_tiles(type(self).__name__, self.tiles)

    def workspace_bytes(self, rows: int, topk: int, latent: int, intermediate: int) -> int:
        """The grouping's temporaries (GROUPING_BYTES_PER_SLOT a slot), BF16 activations [P, I]
        and expert outputs [P, L] at the pair capacity P = R * K."""
        grouping = rows * topk * GROUPING_BYTES_PER_SLOT
        return grouping + pair_capacity(rows, topk) * (intermediate + latent) * 2

    def prepare(self, owner: str, weights: ExpertWeights, sms: int) -> PreparedCall:
        """The caller's uint8 weights as the kernels read them (contiguous: no copy when they
        are) and tiles.programs_per_sm persistent programs per SM."""
        return TritonPrepared(
            *(t.contiguous() for t in weights.tensors),
            first_expert=weights.first_expert,
            tiles=self.tiles,
            programs=sms * self.tiles.programs_per_sm,
        )


@dataclass(frozen=True)
class TritonPrepared:
    """One layer on the triton engine: w13, s13, w2, s2 in the checkpoint layout (contiguous),
    the global id of local expert 0, the tiles and the persistent programs per GEMM."""

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    first_expert: int
    tiles: HopperTiles
    programs: int

    def __call__(self, x, sf, ids, weights, out) -> torch.Tensor:
        tensors = (self.w13, self.s13, self.w2, self.s2)
        return fused_experts(
            *tensors, self.first_expert, x, sf, ids, weights, out, self.tiles, self.programs
        )


def fused_experts(
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    first_expert: int,
    x: torch.Tensor,
    sf: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    tiles: HopperTiles,
    programs: int,
) -> torch.Tensor:
    """The three kernels over the rows (HopperExperts.forward's contract); `programs` persistent
    programs per GEMM. Runs wherever Triton does, its CPU interpreter included (math="fp32")."""
    from dep_ep.experts.hopper import kernels  # triton is imported on first use

    num_local, two_inter, half_latent = w13.shape
    latent, inter = 2 * half_latent, two_inter // 2
    rows, topk = ids.shape
    # The kernel grouping also writes tile routes, which this engine does not read: about
    # 8 * (R * K + E_local * block_n) bytes, within workspace_bytes' grouping share.
    groups, _ = grouped(ids, first_expert, num_local, tiles.block_n, tiles.grouping)
    act = torch.empty(groups.pair_capacity, inter, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(groups.pair_capacity, latent, dtype=torch.bfloat16, device=x.device)
    launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    tile_args = (groups.tile_expert, groups.tile_start, groups.tile_rows, groups.num_tiles)
    fc1_work = groups.tile_capacity * (inter // tiles.fc1_block_m)
    fc1_programs = min(programs, fc1_work) if tiles.persistent else fc1_work
    kernels.fc1_situ_kernel[(max(1, fc1_programs),)](
        x,
        sf,
        w13,
        s13,
        act,
        groups.pair_row,
        *tile_args,
        latent,
        inter,
        tiles.fc1_block_m,
        tiles.block_n,
        tiles.fc1_block_k,
        tiles.math,
        tiles.persistent,
        **launch,
    )
    fc2_work = groups.tile_capacity * (latent // tiles.fc2_block_m)
    fc2_programs = min(programs, fc2_work) if tiles.persistent else fc2_work
    kernels.fc2_kernel[(max(1, fc2_programs),)](
        act,
        w2,
        s2,
        y,
        *tile_args,
        latent,
        inter,
        tiles.fc2_block_m,
        tiles.block_n,
        tiles.fc2_block_k,
        tiles.math,
        tiles.persistent,
        **launch,
    )
    if rows:  # forward returns before this for R = 0; a direct call may not
        columns = tiles.finalize_columns(latent)
        kernels.finalize_kernel[(rows, latent // columns)](
            y, groups.pair_slot, weights, out, latent, topk, columns, num_warps=tiles.finalize_warps
        )
    return out
