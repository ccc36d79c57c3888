"""TritonEngine: HopperExperts' GEMMs in our own Triton kernels (experts/hopper/kernels.py), with
ReferenceExperts' BF16 numerics: the grouping -> fc1_situ_kernel -> fc2_kernel -> finalize_kernel.
Runs wherever Triton does, its CPU interpreter included (HopperTiles(math="fp32"))."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from dep_ep.comm.failure import StepFailure
from dep_ep.experts.hopper.engine import (
    GROUPING_BYTES_PER_SLOT,
    HopperEngine,
    PreparedCall,
    check_tiles,
    check_workspace_args,
    pair_budget,
)
from dep_ep.experts.hopper.grouping import Grouping, grouped, pair_capacity
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
    takes_pair_budget: ClassVar[bool] = True

    tiles: HopperTiles = field(default_factory=HopperTiles)

    def __post_init__(self) -> None:
        check_tiles(type(self).__name__, self.tiles)

    def workspace_parts(
        self,
        rows: int,
        topk: int,
        latent: int,
        intermediate: int,
        *,
        num_local: int | None = None,
        max_pairs: int | None = None,
    ) -> dict[str, int]:
        """`workspace_parts` (the module's) with this engine's tiles: exact with num_local and
        the grouping kernel (Grouping.TRITON, the default); with Grouping.TORCH, or without
        num_local, the grouping counts GROUPING_BYTES_PER_SLOT a slot, an estimate. torch's
        caching allocator rounds each tensor up to 512 bytes."""
        return workspace_parts(rows, topk, latent, intermediate, num_local, self.tiles, max_pairs)

    def prepare(
        self, owner: str, weights: ExpertWeights, sms: int, skew: float | None = None
    ) -> PreparedCall:
        """The caller's uint8 weights as the kernels read them (contiguous: no copy when they
        are), tiles.programs_per_sm persistent programs per SM, and the pair budget's skew
        (`pair_budget`; None: every call sized for its capacity R * K)."""
        kept = tuple(t.contiguous() for t in weights.tensors)
        return TritonPrepared(
            *kept,
            first_expert=weights.first_expert,
            tiles=self.tiles,
            programs=sms * self.tiles.programs_per_sm,
            num_experts=weights.num_experts,
            skew=skew,
            pairs_over_budget=torch.zeros(1, dtype=torch.int32, device=weights.device),
            copies_weights=any(k is not t for k, t in zip(kept, weights.tensors)),
        )


def fail_step(failure: StepFailure | None) -> dict:
    """finalize_kernel's keyword arguments that fail the step through `failure` (none for None)."""
    if failure is None:
        return {}
    high, low = failure.tag_halves()
    return dict(
        FAIL_STEP=True,
        status_ptr=failure.status,
        record_ptr=failure.record,
        tag_high=high,
        tag_low=low,
        calls_done_ptr=failure.calls_done,
        HAS_CALL=failure.calls_done is not None,
    )


def workspace_parts(
    rows: int,
    topk: int,
    latent: int,
    intermediate: int,
    num_local: int | None,
    tiles: HopperTiles,
    max_pairs: int | None = None,
) -> dict[str, int]:
    """Bytes of each tensor a triton-engine call over R = rows receive rows allocates, by name:
    "act" BF16 [P, I] and "y" BF16 [P, L] at P = max_pairs (None: the capacity R * K; larger is
    cut to it), and the grouping's. With num_local and Grouping.TRITON (block_n up to the kernel's
    MAX_BLOCK_N) the grouping kernel's tensors, each as `grouping_kernel._launch` makes it:
    "pairs" int32 pair_row, pair_flat, pair_slot [R * K] and num_pairs [1]; "expert_pairs" int64
    [E_local]; "tiles" int32 tile_expert, tile_start, tile_rows [TC] and num_tiles [1] (TC =
    tile_capacity); "routes" int32 flat, pair [TC * block_n] and num_padded [1]; "histogram" int32
    [chunks, bins]. Otherwise "grouping" GROUPING_BYTES_PER_SLOT a slot (group_pairs' temporaries,
    an estimate). A size that is not an int, or out of range: TypeError or ValueError naming it
    (`engine.check_workspace_args`)."""
    rows, topk, latent, intermediate = check_workspace_args(
        "TritonEngine.workspace_parts", rows, topk, latent, intermediate, num_local, max_pairs
    )
    slots = pair_capacity(rows, topk)
    pairs = slots if max_pairs is None else min(slots, max_pairs)
    parts = {"act": pairs * intermediate * 2, "y": pairs * latent * 2}
    kernel = tiles.grouping is Grouping.TRITON and num_local is not None
    if kernel:
        from dep_ep.experts.hopper import grouping_kernel  # imports triton

        kernel = grouping_kernel.fits(tiles.block_n)
    if not kernel:
        return {"grouping": slots * GROUPING_BYTES_PER_SLOT, **parts}
    return {**grouping_kernel.workspace_parts(rows, topk, num_local, (tiles.block_n,)), **parts}


@dataclass(frozen=True)
class TritonPrepared:
    """One layer on the triton engine: w13, s13, w2, s2 in the checkpoint layout (contiguous),
    the global id of local expert 0, the tiles, the persistent programs per GEMM, the model's
    expert count and the pair budget's skew (`pair_budget`), and pairs_over_budget int32 [1] on
    the device: 0, or the largest pair count of a call over its budget since it was last zeroed
    (written by the finalize of such a call, whose rows with a local id are NaN); copies_weights:
    whether any of the four is a copy (False: the caller's contiguous tensors, read in place)."""

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    first_expert: int
    tiles: HopperTiles
    programs: int
    num_experts: int
    skew: float | None
    pairs_over_budget: torch.Tensor
    copies_weights: bool

    def max_pairs(self, rows: int, topk: int) -> int:
        """The pair budget of a call over `rows` receive rows: `pair_budget(...)`."""
        num_local = self.w13.shape[0]
        return pair_budget(rows, topk, num_local, self.num_experts, self.skew)

    def workspace_parts(self, rows: int, topk: int) -> dict[str, int]:
        """`workspace_parts` of a call over `rows` receive rows at its pair budget."""
        num_local, two_inter, half_latent = self.w13.shape
        return workspace_parts(
            rows,
            topk,
            2 * half_latent,
            two_inter // 2,
            num_local,
            self.tiles,
            self.max_pairs(rows, topk),
        )

    def __call__(
        self, x, sf, ids, weights, out, failure: StepFailure | None = None
    ) -> torch.Tensor:
        tensors = (self.w13, self.s13, self.w2, self.s2)
        return fused_experts(
            *tensors,
            self.first_expert,
            x,
            sf,
            ids,
            weights,
            out,
            self.tiles,
            self.programs,
            max_pairs=self.max_pairs(*ids.shape),
            pairs_over_budget=self.pairs_over_budget,
            failure=failure,
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
    *,
    max_pairs: int | None = None,
    pairs_over_budget: torch.Tensor | None = None,
    failure: StepFailure | None = None,
) -> torch.Tensor:
    """The three kernels over the rows (HopperExperts.forward's contract); `programs` persistent
    programs per GEMM. Runs wherever Triton does, its CPU interpreter included (math="fp32").

    max_pairs: the pair budget (an int >= 1; None: the capacity R * K): act and y take
    P = min(R * K, max_pairs) rows. A call whose rows hold more pairs (counted on the device)
    computes nothing and writes NaN into every row with a local id, and raises
    pairs_over_budget int32 [1] (on x's device; None: a scratch one) to its pair count when that
    is larger: no host synchronisation, so a CUDA graph replays it as it is. `failure` (a
    StepFailure, from EpRouted): such a call also fails the step on every rank through it
    (comm/failure.py: the status word and the record [FAILURE_PAIR_BUDGET, pairs, P, tag,
    call])."""
    from dep_ep.experts.hopper import kernels  # triton is imported on first use
    from dep_ep.experts.hopper.pdl import pdl_options

    num_local, two_inter, half_latent = w13.shape
    latent, inter = 2 * half_latent, two_inter // 2
    rows, topk = ids.shape
    # The kernel grouping also writes tile routes, which this engine does not read (workspace_parts
    # counts them).
    groups, _ = grouped(ids, first_expert, num_local, tiles.block_n, tiles.grouping, tiles.pdl)
    if max_pairs is not None and max_pairs < 1:
        raise ValueError(f"fused_experts: max_pairs={max_pairs}; expected None or >= 1")
    # At least one row: R = 0 (a direct call; forward returns before) launches on empty work.
    pairs = max(
        1, groups.pair_capacity if max_pairs is None else min(groups.pair_capacity, max_pairs)
    )
    if pairs_over_budget is None:
        pairs_over_budget = torch.zeros(1, dtype=torch.int32, device=x.device)
    act = torch.empty(pairs, inter, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(pairs, latent, dtype=torch.bfloat16, device=x.device)
    launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    budget = (groups.num_pairs, pairs)
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
        *budget,
        latent,
        inter,
        tiles.fc1_block_m,
        tiles.block_n,
        tiles.fc1_block_k,
        tiles.math,
        tiles.persistent,
        **launch,
        **pdl_options(tiles.pdl, x.device, kernels.fc1_situ_kernel),
    )
    fc2_work = groups.tile_capacity * (latent // tiles.fc2_block_m)
    fc2_programs = min(programs, fc2_work) if tiles.persistent else fc2_work
    kernels.fc2_kernel[(max(1, fc2_programs),)](
        act,
        w2,
        s2,
        y,
        *tile_args,
        *budget,
        latent,
        inter,
        tiles.fc2_block_m,
        tiles.block_n,
        tiles.fc2_block_k,
        tiles.math,
        tiles.persistent,
        **launch,
        **pdl_options(tiles.pdl, x.device, kernels.fc2_kernel),
    )
    if rows:  # forward returns before this for R = 0; a direct call may not
        columns = tiles.finalize_columns(latent)
        kernels.finalize_kernel[(rows, latent // columns)](
            y,
            groups.pair_slot,
            weights,
            out,
            *budget,
            pairs_over_budget,
            latent,
            topk,
            columns,
            **fail_step(failure),
            num_warps=tiles.finalize_warps,
            **pdl_options(tiles.pdl, out.device, kernels.finalize_kernel),
        )
    return out
