"""HummingEngine: HopperExperts' GEMMs in humming-kernels' SM90 MoE GEMM (experts/hopper/
humming_gemm.py wraps it): the grouping (pairs by expert and their tile routes) ->
widen_scales_kernel -> humming's FC1 (WGMMA, e4m3 rows x MXFP4) -> situ_mxfp8_kernel (SiTU, then
MXFP8 like the dispatch) -> humming's FC2 -> finalize_kernel (experts/hopper/kernels.py).
`pip install -e '.[gpu]'` brings humming-kernels."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from dep_ep.constants import SCALE_BLOCK
from dep_ep.experts.hopper.engine import (
    GROUPING_BYTES_PER_SLOT,
    HopperEngine,
    PreparedCall,
    check_flag,
    check_tiles,
    tuning_pairs,
)
from dep_ep.experts.hopper.grouping import pair_capacity, routed_tilings
from dep_ep.experts.hopper.humming_gemm import HummingGemm, scale_spread_error
from dep_ep.experts.hopper.tiles import HopperTiles
from dep_ep.experts.weights import ExpertWeights

# tile_routes' tensors per tile slot (about one per pair): int32 flat and pair lists, int64 index
# and gathered values. The humming engine routes twice when FC1 and FC2 tile differently.
ROUTE_BYTES_PER_SLOT = 32
# situ_mxfp8_kernel: pairs per step, the most intermediate columns per program, and programs per SM
# (4 warps each). 8 pairs x 256 columns at 16 programs an SM took 9.2 us at T=64 on a DEP16 shard
# where 16 x 256 at 4 took 12.8 (4.4 / 7.2 / 33.3 against 6.0 / 7.5 / 38.6 at T = 8 / 32 / 256);
# the fastest or within 12% of the fastest of eight shapes at every T measured (H200,
# docs/results/bench_hopper_launch.md).
SITU_ROWS, SITU_MAX_BLOCK_I, SITU_PROGRAMS_PER_SM = 8, 256, 16
# widen_scales_kernel: scale bytes per program.
WIDEN_BLOCK = 1024
HUMMING_PIP = "pip install -e '.[gpu]'"
# The humming-kernels release humming_gemm.py wraps (the `gpu` extra's pin): 0.1.12, which
# SGLang 0.5.23 pins, lacks transform.prepare_fp16_e8m0_scale.
HUMMING_RELEASE = "0.1.19"


def humming_release() -> str | None:
    """The installed humming-kernels' version, or None when humming is not importable."""
    if importlib.util.find_spec("humming") is None:
        return None
    try:
        return importlib.metadata.version("humming-kernels")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def humming_installed() -> bool:
    """True when the humming-kernels release this engine wraps (HUMMING_RELEASE) is installed."""
    return humming_release() == HUMMING_RELEASE


@dataclass(frozen=True)
class HummingEngine(HopperEngine):
    """The humming engine: e4m3 rows times the weights in e4m3 (exact for MXFP4 within an
    expert's 11-binade scale spread, checked when HopperExperts is built) with fp32 sums; FC1's
    output rounded to BF16; SiTU in fp32 rounded to MXFP8 (e4m3 elements, one scale per 32, the
    dispatch's recipe); FC2 with fp32 sums, one rounding to BF16; the triton engine's finalize.

    deterministic: False lets humming pick stream-K kernels, which split K over CTAs and add the
      BF16 partial outputs (atomically beyond 3 slices): more roundings, and reruns not
      guaranteed bitwise equal; True asks for its batch-invariant kernels (no stream-K).
    tune_for_capacity: humming's kernels are chosen per call for a pair count (`tuning_pairs`):
      False, the pairs expected under uniform routing over the weights' num_experts; True, the
      capacity R * K (every slot local).
    tiles: the finalize's launch and the grouping are read (HopperTiles' other fields are the
      triton engine's).
    """

    name: ClassVar[str] = "humming"
    activation_format: ClassVar[str] = "mxfp8"

    deterministic: bool = False
    tune_for_capacity: bool = False
    tiles: HopperTiles = field(default_factory=HopperTiles)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_flag(owner, "deterministic", self.deterministic)
        check_flag(owner, "tune_for_capacity", self.tune_for_capacity)
        check_tiles(owner, self.tiles)

    def tuning_pairs(self, rows: int, topk: int, num_local: int, num_experts: int) -> int:
        """`tuning_pairs(rows, topk, num_local, num_experts)`, or of the capacity (num_experts
        None) when tune_for_capacity."""
        return tuning_pairs(rows, topk, num_local, None if self.tune_for_capacity else num_experts)

    def workspace_bytes(
        self,
        rows: int,
        topk: int,
        latent: int,
        intermediate: int,
        *,
        num_local: int | None = None,
        max_pairs: int | None = None,
    ) -> int:
        """About the bytes of a call: the grouping's temporaries (GROUPING_BYTES_PER_SLOT a slot),
        the rows' scales in fp32 [R, L/32], BF16 FC1 outputs [R * K, 2I], MXFP8 activations
        [P, I] with fp32 scales, the tile routes of two groupings (ROUTE_BYTES_PER_SLOT a pair
        each) and BF16 expert outputs [P, L], at the pair capacity P = R * K (this engine takes
        no pair budget: max_pairs must be None or at least R * K; num_local is not read)."""
        if max_pairs is not None and max_pairs < pair_capacity(rows, topk):
            raise ValueError(
                f"HummingEngine.workspace_bytes: max_pairs={max_pairs} below the capacity"
                f" R * K = {pair_capacity(rows, topk)}; this engine takes no pair budget"
            )
        pairs = pair_capacity(rows, topk)
        grouping = rows * topk * GROUPING_BYTES_PER_SLOT
        scales = rows * (latent // SCALE_BLOCK) * 4
        act = pairs * (intermediate + intermediate // SCALE_BLOCK * 4)
        routing = 2 * pairs * ROUTE_BYTES_PER_SLOT
        fc1_out = rows * topk * 2 * intermediate * 2
        return grouping + scales + fc1_out + act + routing + pairs * latent * 2

    def prepare(
        self, owner: str, weights: ExpertWeights, sms: int, skew: float | None = None
    ) -> PreparedCall:
        """humming's re-laid-out copy of the weights (the caller's are neither kept nor changed).
        RuntimeError without humming-kernels; ValueError naming the experts whose scale bytes
        spread wider than humming keeps exact, or a pair budget (skew not None): humming's FC1
        writes one output row per slot (R * K rows of 2I), which a budget would not bound."""
        if skew is not None:
            raise ValueError(
                f"{owner}: pair_skew={skew}; HummingEngine takes no pair budget (its FC1 output"
                " has a row per slot); use engine=TritonEngine() for one"
            )
        if not humming_installed():
            found = humming_release()
            raise RuntimeError(
                f"{owner}: HummingEngine needs humming-kernels {HUMMING_RELEASE}"
                + (f" (found {found})" if found else "")
                + f": {HUMMING_PIP}"
            )
        for name, scales in (("s13", weights.s13), ("s2", weights.s2)):
            error = scale_spread_error(owner, name, scales)
            if error is not None:
                raise ValueError(error)
        w13, s13, w2, s2 = (t.contiguous() for t in weights.tensors)
        fc1 = HummingGemm.prepare(w13, s13, self.deterministic)
        fc2 = HummingGemm.prepare(w2, s2, self.deterministic)
        return HummingPrepared(
            fc1=fc1,
            fc2=fc2,
            engine=self,
            first_expert=weights.first_expert,
            num_local_experts=weights.num_local_experts,
            num_experts=weights.num_experts,
            latent=weights.latent,
            intermediate=weights.intermediate,
            sms=sms,
            # SiTU's column block: the largest power of two <= SITU_MAX_BLOCK_I dividing I (>= 32:
            # I is a multiple of 32).
            situ_block_i=math.gcd(SITU_MAX_BLOCK_I, weights.intermediate),
            pairs_over_budget=torch.zeros(1, dtype=torch.int32, device=weights.device),
        )


@dataclass(frozen=True)
class HummingPrepared:
    """One layer on the humming engine: humming's FC1 and FC2 (HummingGemm: the weights in its
    layout, its lock words, the kernels chosen so far), the engine, the weights' geometry, the
    device's SMs, SiTU's column block, and the finalize's overflow record (int32 [1], stays 0:
    every call is sized for its capacity)."""

    fc1: HummingGemm
    fc2: HummingGemm
    engine: HummingEngine
    first_expert: int
    num_local_experts: int
    num_experts: int
    latent: int
    intermediate: int
    sms: int
    situ_block_i: int
    pairs_over_budget: torch.Tensor

    def max_pairs(self, rows: int, topk: int) -> int:
        """The pairs a call over `rows` receive rows is sized for: the capacity R * K."""
        return pair_capacity(rows, topk)

    @property
    def tiles(self) -> HopperTiles:
        return self.engine.tiles

    def tuning_pairs(self, rows: int, topk: int) -> int:
        return self.engine.tuning_pairs(rows, topk, self.num_local_experts, self.num_experts)

    def __call__(self, x, sf, ids, weights, out) -> torch.Tensor:
        """forward's contract (same tensors) on the humming engine: group, FC1, SiTU -> MXFP8,
        FC2, finalize; R >= 1."""
        from dep_ep.experts.hopper import kernels

        rows, topk = ids.shape
        inter, latent = self.intermediate, self.latent
        capacity = pair_capacity(rows, topk)
        tuned = self.tuning_pairs(rows, topk)
        # humming's FC1 and FC2 kernels may take tiles of different sizes: one grouping, one or
        # two tilings.
        block_ns = tuple(dict.fromkeys((self.fc1.block_m(tuned), self.fc2.block_m(tuned))))
        tilings = routed_tilings(
            ids, self.first_expert, self.num_local_experts, block_ns, self.tiles.grouping
        )
        (fc1_groups, fc1_routes), (fc2_groups, fc2_routes) = tilings[0], tilings[-1]
        # humming reads the rows' scales as fp32 2^(byte - 127).
        scales = torch.empty(sf.shape, dtype=torch.float32, device=x.device)
        kernels.widen_scales_kernel[(-(-sf.numel() // WIDEN_BLOCK),)](
            sf, scales, sf.numel(), WIDEN_BLOCK, num_warps=4
        )
        # FC1 reads row id // K of x for pair id = row * K + k and writes row id of gate_up.
        gate_up = torch.empty(rows * topk, 2 * inter, dtype=torch.bfloat16, device=x.device)
        self.fc1(
            x.view(torch.float8_e4m3fn),
            scales,
            fc1_routes.flat,
            fc1_groups.tile_expert,
            fc1_routes.num_padded,
            topk,
            gate_up,
            tuned,
        )
        act = torch.empty(capacity, inter, dtype=torch.float8_e4m3fn, device=x.device)
        act_scale = torch.empty(
            capacity, inter // SCALE_BLOCK, dtype=torch.float32, device=x.device
        )
        column_blocks = inter // self.situ_block_i
        situ_programs = max(
            1, min(-(-capacity // SITU_ROWS), SITU_PROGRAMS_PER_SM * self.sms // column_blocks)
        )
        kernels.situ_mxfp8_kernel[(situ_programs, column_blocks)](
            gate_up,
            fc1_groups.pair_flat,
            fc1_groups.num_pairs,
            act,
            act_scale,
            inter,
            SITU_ROWS,
            self.situ_block_i,
            num_warps=4,
        )
        # FC2: pair j reads act row j and writes expert output row j.
        expert_out = torch.empty(capacity, latent, dtype=torch.bfloat16, device=x.device)
        self.fc2(
            act,
            act_scale,
            fc2_routes.pair,
            fc2_groups.tile_expert,
            fc2_routes.num_padded,
            1,
            expert_out,
            tuned,
        )
        columns = self.tiles.finalize_columns(latent)
        kernels.finalize_kernel[(rows, latent // columns)](
            expert_out,
            fc1_groups.pair_slot,
            weights,
            out,
            fc1_groups.num_pairs,  # never above the capacity: no overflow
            capacity,
            self.pairs_over_budget,
            latent,
            topk,
            columns,
            num_warps=self.tiles.finalize_warps,
        )
        return out
