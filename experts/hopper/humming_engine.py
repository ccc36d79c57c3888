"""HummingEngine: HopperExperts' GEMMs in humming-kernels' SM90 MoE GEMM (experts/hopper/
humming_gemm.py wraps it). A call whose R * K receive slots fit one chunk (chunk_pairs) runs on
the slots: the grouping (pairs by expert and their tile routes) -> widen_scales_kernel ->
humming's FC1 (WGMMA, e4m3 rows x MXFP4, one output row a slot) -> situ_mxfp8_kernel (SiTU, then
MXFP8 like the dispatch) -> humming's FC2 -> finalize_kernel (experts/hopper/kernels.py). A larger
call runs its pairs in chunks (experts/hopper/chunks.py; the kernels in chunk_kernels.py): the
grouping -> chunk_routes_kernel, then per chunk gather_rows_kernel -> FC1 -> SiTU -> FC2, then the
finalize; its memory follows the pair budget, not the slots. `pip install -e '.[gpu]'` brings
humming-kernels."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch

from dep_ep.checks import check_flag, check_positive_int
from dep_ep.comm.failure import StepFailure
from dep_ep.config import K3
from dep_ep.constants import SCALE_BLOCK
from dep_ep.experts.hopper import chunks as chunking
from dep_ep.experts.hopper.engine import (
    GROUPING_BYTES_PER_SLOT,
    HopperEngine,
    PreparedCall,
    check_tiles,
    check_workspace_args,
    pair_budget,
    tuning_pairs,
)
from dep_ep.experts.hopper.grouping import Grouping, pair_capacity, routed_tilings, tile_capacity
from dep_ep.experts.hopper.humming_gemm import (
    FC1_UPDATES,
    FC2_UPDATES,
    HummingGemm,
    scale_spread_error,
)
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
# HummingEngine.chunk_pairs' default: a call over more receive slots than this runs in chunks of at
# most this many pairs. At K3 widths a chunk's buffers take 19,776 bytes a pair (the gathered row
# and its fp32 scales, FC1's BF16 output, the MXFP8 activation): 324 MB for 16,384, and the call's
# expert output 7,168 bytes a pair of its budget; on 16 ranks at T = 2048 (budget 73,728 pairs,
# 5 chunks of 14,784, 73,920 rows of expert output) 0.83 GB in all, under issue 24's GiB.
CHUNK_PAIRS = 16384
# The largest tile (pairs) humming's SM90 kernels take: workspace_bytes' tiles when not given.
HUMMING_MAX_BLOCK_M = 64
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
      capacity R * K (every slot local). A chunked call caps it at its plan's tuning_cap.
    chunk_pairs: a call over at most this many receive slots (R * K) runs on the slots, sized for
      its capacity (it never overflows); a larger one runs its pairs in chunks of at most this
      many (experts/hopper/chunks.py), with a pair budget (HopperExperts' pair_skew). A multiple
      of chunks.CHUNK_ALIGN (64); default CHUNK_PAIRS.
    tiles: the finalize's launch and the grouping are read (HopperTiles' other fields are the
      triton engine's).
    """

    name: ClassVar[str] = "humming"
    activation_format: ClassVar[str] = "mxfp8"
    takes_pair_budget: ClassVar[bool] = True

    deterministic: bool = False
    tune_for_capacity: bool = False
    chunk_pairs: int = CHUNK_PAIRS
    tiles: HopperTiles = field(default_factory=HopperTiles)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_flag(owner, "deterministic", self.deterministic)
        check_flag(owner, "tune_for_capacity", self.tune_for_capacity)
        # A Python int from here on (a NumPy or 0-dim torch integer is taken, as everywhere).
        chunk_pairs = check_positive_int(
            owner, "chunk_pairs", self.chunk_pairs, chunking.CHUNK_ALIGN
        )
        object.__setattr__(self, "chunk_pairs", chunk_pairs)
        check_tiles(owner, self.tiles)

    def tuning_pairs(self, rows: int, topk: int, num_local: int, num_experts: int) -> int:
        """`tuning_pairs(rows, topk, num_local, num_experts)`, or of the capacity (num_experts
        None) when tune_for_capacity."""
        return tuning_pairs(rows, topk, num_local, None if self.tune_for_capacity else num_experts)

    def plan(self, rows: int, topk: int, max_pairs: int | None) -> chunking.ChunkPlan | None:
        """The call's chunks (`chunks.chunk_plan`) for the pair budget max_pairs (None: the
        capacity R * K); None when it runs on the slots."""
        budget = pair_capacity(rows, topk) if max_pairs is None else max_pairs
        return chunking.chunk_plan(rows, topk, budget, self.chunk_pairs)

    def workspace_parts(
        self,
        rows: int,
        topk: int,
        latent: int,
        intermediate: int,
        *,
        num_local: int | None = None,
        max_pairs: int | None = None,
        block_ns: tuple[int, ...] = (HUMMING_MAX_BLOCK_M,),
    ) -> dict[str, int]:
        """Bytes of each tensor a call allocates, by name, for R = rows receive rows of topk ids
        over num_local experts, at the pair budget max_pairs (None: the capacity R * K), with
        humming's tiles block_ns (FC1's and FC2's, distinct; the prepared call knows them: the
        default, humming's largest tile as one tiling, is an estimate, within 1% at K3 on 16
        ranks and T = 2048). Exact with num_local, the call's block_ns and the grouping kernel
        (Grouping.TRITON, the default); else the grouping counts GROUPING_BYTES_PER_SLOT a slot
        and each tiling's routes ROUTE_BYTES_PER_SLOT, an estimate. humming allocates nothing
        itself; torch's caching allocator rounds each tensor up to 512 bytes.
          on the slots: "grouping" or the grouping kernel's parts; "scales" fp32 [R, L/32];
          "fc1_out" BF16 [R * K, 2I]; "act" e4m3 [R * K, I] and its fp32 scales [R * K, I/32];
          "expert_out" BF16 [R * K, L];
          in chunks (C pairs, P = chunks * C): the grouping; "chunk_routes" (chunks.
          chunk_routes_bytes per tiling); "gathered" e4m3 [C, L] and fp32 scales [C, L/32];
          "fc1_out" BF16 [C, 2I]; "act" [C, I] and [C, I/32]; "expert_out" BF16 [P, L].
        A size that is not an int, or out of range: TypeError or ValueError naming it
        (`engine.check_workspace_args`)."""
        rows, topk, latent, intermediate = check_workspace_args(
            "HummingEngine.workspace_parts", rows, topk, latent, intermediate, num_local, max_pairs
        )
        slots = pair_capacity(rows, topk)
        exact = num_local is not None and self.tiles.grouping is Grouping.TRITON
        if exact:
            from dep_ep.experts.hopper import grouping_kernel  # imports triton

            exact = all(grouping_kernel.fits(block_n) for block_n in block_ns)
        if exact:
            parts = grouping_kernel.workspace_parts(rows, topk, num_local, block_ns)
        else:
            parts = {"grouping": slots * (GROUPING_BYTES_PER_SLOT + 2 * ROUTE_BYTES_PER_SLOT)}
        inter = intermediate
        plan = self.plan(rows, topk, max_pairs)
        if plan is None:
            return {
                **parts,
                "scales": rows * (latent // SCALE_BLOCK) * 4,
                "fc1_out": slots * 2 * inter * 2,
                "act": slots * (inter + inter // SCALE_BLOCK * 4),
                "expert_out": slots * latent * 2,
            }
        local = slots if num_local is None else num_local
        routes = 0
        for block_n in block_ns:
            tile_cap = tile_capacity(rows, topk, local, block_n)
            routes += chunking.chunk_routes_bytes(plan, block_n, local, tile_cap)
        c = plan.chunk
        return {
            **parts,
            "chunk_routes": routes,
            "gathered": c * (latent + latent // SCALE_BLOCK * 4),
            "fc1_out": c * 2 * inter * 2,
            "act": c * (inter + inter // SCALE_BLOCK * 4),
            "expert_out": plan.pairs * latent * 2,
        }

    def prepare(
        self, owner: str, weights: ExpertWeights, sms: int, skew: float | None = None
    ) -> PreparedCall:
        """humming's re-laid-out copy of the weights (the caller's are neither kept nor changed),
        and the pair budget's skew (`pair_budget`; None: every call sized for its capacity).
        RuntimeError without humming-kernels; ValueError naming the experts whose scale bytes
        spread wider than humming keeps exact."""
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
        # The decode changes were measured at K3's widths only.
        k3 = (weights.latent, weights.intermediate) == (K3.latent, K3.intermediate)
        fc1_updates, fc2_updates = (FC1_UPDATES, FC2_UPDATES) if k3 else (None, None)
        fc1 = HummingGemm.prepare(w13, s13, self.deterministic, updates=fc1_updates)
        fc2 = HummingGemm.prepare(w2, s2, self.deterministic, updates=fc2_updates)
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
            skew=skew,
            # SiTU's column block: the largest power of two <= SITU_MAX_BLOCK_I dividing I (>= 32:
            # I is a multiple of 32).
            situ_block_i=math.gcd(SITU_MAX_BLOCK_I, weights.intermediate),
            pairs_over_budget=torch.zeros(1, dtype=torch.int32, device=weights.device),
        )


class CallShape(NamedTuple):
    """What a humming call over R receive rows of K ids is sized and tuned for, from (R, K) alone:
    budget (`pair_budget`), plan (its chunks, or None on the slots), max_pairs (R * K on the
    slots, plan.pairs in chunks), tuned (the pair count humming's kernels are chosen for) and
    block_ns (FC1's and FC2's tiles, distinct)."""

    budget: int
    plan: chunking.ChunkPlan | None
    max_pairs: int
    tuned: int
    block_ns: tuple[int, ...]


@dataclass(frozen=True)
class HummingPrepared:
    """One layer on the humming engine: humming's FC1 and FC2 (HummingGemm: the weights in its
    layout, its lock words, the kernels chosen so far; a stand-in with the same `block_m` and
    call in the CPU tests), the engine, the weights' geometry, the device's SMs, the pair
    budget's skew, SiTU's column block, and pairs_over_budget int32 [1] on the device: 0, or the
    largest pair count of a chunked call over its budget since it was last zeroed. The call
    shapes seen so far are kept by (R, K) (host arithmetic once per row count, not per call)."""

    fc1: HummingGemm
    fc2: HummingGemm
    engine: HummingEngine
    first_expert: int
    num_local_experts: int
    num_experts: int
    latent: int
    intermediate: int
    sms: int
    skew: float | None
    situ_block_i: int
    pairs_over_budget: torch.Tensor
    # humming re-lays out its own copy of the weights (HummingGemm.prepare).
    copies_weights = True
    # Not an init field: dataclasses.replace() starts a new object's shapes afresh.
    shapes: dict[tuple[int, int], CallShape] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def tiles(self) -> HopperTiles:
        return self.engine.tiles

    def shape(self, rows: int, topk: int) -> CallShape:
        """The CallShape of a call over `rows` receive rows of `topk` ids (kept once made)."""
        known = self.shapes.get((rows, topk))
        if known is not None:
            return known
        budget = pair_budget(rows, topk, self.num_local_experts, self.num_experts, self.skew)
        plan = self.engine.plan(rows, topk, budget)
        tuned = self.engine.tuning_pairs(rows, topk, self.num_local_experts, self.num_experts)
        if plan is not None:
            tuned = min(tuned, plan.tuning_cap)
        block_ns = tuple(dict.fromkeys((self.fc1.block_m(tuned), self.fc2.block_m(tuned))))
        max_pairs = pair_capacity(rows, topk) if plan is None else plan.pairs
        shape = CallShape(budget, plan, max_pairs, tuned, block_ns)
        self.shapes[(rows, topk)] = shape
        return shape

    def budget(self, rows: int, topk: int) -> int:
        """`pair_budget(rows, topk, num_local, num_experts, skew)`."""
        return self.shape(rows, topk).budget

    def plan(self, rows: int, topk: int) -> chunking.ChunkPlan | None:
        """The call's chunks, or None when it runs on the slots (HummingEngine.plan)."""
        return self.shape(rows, topk).plan

    def max_pairs(self, rows: int, topk: int) -> int:
        """The pairs a call over `rows` receive rows is sized for: its capacity R * K on the
        slots, the chunks' pairs (chunks.chunk_plan: the budget split into equal chunks rounded
        up to CHUNK_ALIGN) in chunks."""
        return self.shape(rows, topk).max_pairs

    def tuning_pairs(self, rows: int, topk: int) -> int:
        """The pair count humming's kernels are chosen for: the engine's, at most the chunk's
        tuning cap in chunks."""
        return self.shape(rows, topk).tuned

    def block_ns(self, rows: int, topk: int) -> tuple[int, ...]:
        """The tiles (pairs) of the kernels a call uses: FC1's and FC2's, distinct."""
        return self.shape(rows, topk).block_ns

    def workspace_parts(self, rows: int, topk: int) -> dict[str, int]:
        """HummingEngine.workspace_parts of a call over `rows` receive rows, with its kernels'
        tiles and budget."""
        return self.engine.workspace_parts(
            rows,
            topk,
            self.latent,
            self.intermediate,
            num_local=self.num_local_experts,
            max_pairs=self.budget(rows, topk),
            block_ns=self.block_ns(rows, topk),
        )

    def __call__(
        self, x, sf, ids, weights, out, failure: StepFailure | None = None
    ) -> torch.Tensor:
        """forward's contract (same tensors) on the humming engine, R >= 1: on the slots or in
        chunks (module docstring); `failure` as TritonEngine's finalize takes it."""
        from dep_ep.experts.hopper import kernels
        from dep_ep.experts.hopper.pdl import pdl_options
        from dep_ep.experts.hopper.triton_engine import fail_step

        rows, topk = ids.shape
        shape = self.shape(rows, topk)
        pdl = self.tiles.pdl
        tilings = routed_tilings(
            ids,
            self.first_expert,
            self.num_local_experts,
            shape.block_ns,
            self.tiles.grouping,
            pdl,
        )
        if shape.plan is None:
            expert_out = self._on_slots(x, sf, ids, tilings, shape.tuned, pdl)
        else:
            expert_out = self._in_chunks(x, sf, ids, tilings, shape.plan, shape.tuned, pdl)

        latent = self.latent
        columns = self.tiles.finalize_columns(latent)
        kernels.finalize_kernel[(rows, latent // columns)](
            expert_out,
            tilings[0][0].pair_slot,
            weights,
            out,
            tilings[0][0].num_pairs,
            shape.max_pairs,
            self.pairs_over_budget,
            latent,
            topk,
            columns,
            **fail_step(failure),
            num_warps=self.tiles.finalize_warps,
            **pdl_options(pdl, out.device, kernels.finalize_kernel),
        )
        return out

    def _situ(self, gate_up, pair_flat, num_pairs, act, act_scale, rows, *, indexed, pdl) -> None:
        """situ_mxfp8_kernel over `rows` activation rows (`indexed`: gate_up row pair_flat[j]),
        with programmatic dependent launch where `pdl` (wanted) and the device allow (pdl.py)."""
        from dep_ep.experts.hopper import kernels
        from dep_ep.experts.hopper.pdl import pdl_options

        column_blocks = self.intermediate // self.situ_block_i
        programs = max(
            1, min(-(-rows // SITU_ROWS), SITU_PROGRAMS_PER_SM * self.sms // column_blocks)
        )
        kernels.situ_mxfp8_kernel[(programs, column_blocks)](
            gate_up,
            pair_flat,
            num_pairs,
            act,
            act_scale,
            self.intermediate,
            SITU_ROWS,
            self.situ_block_i,
            indexed,
            num_warps=4,
            **pdl_options(pdl, act.device, kernels.situ_mxfp8_kernel),
        )

    def _on_slots(self, x, sf, ids, tilings, tuned: int, pdl: bool) -> torch.Tensor:
        """FC1 on the receive rows (top_k = K, one output row a slot), SiTU, FC2, humming's
        kernels chosen for `tuned` pairs (launched without PDL), ours with it where `pdl`
        (pdl.py): the expert output BF16 [R * K, L] by pair number (a call on the slots never
        overflows: its max_pairs is its capacity)."""
        from dep_ep.experts.hopper import kernels
        from dep_ep.experts.hopper.pdl import pdl_options

        rows, topk = ids.shape
        inter, latent = self.intermediate, self.latent
        capacity = pair_capacity(rows, topk)
        (fc1_groups, fc1_routes), (fc2_groups, fc2_routes) = tilings[0], tilings[-1]
        # humming reads the rows' scales as fp32 2^(byte - 127).
        scales = torch.empty(sf.shape, dtype=torch.float32, device=x.device)
        kernels.widen_scales_kernel[(-(-sf.numel() // WIDEN_BLOCK),)](
            sf,
            scales,
            sf.numel(),
            WIDEN_BLOCK,
            num_warps=4,
            **pdl_options(pdl, sf.device, kernels.widen_scales_kernel),
        )
        # FC1 reads row id // K of x for pair id = row * K + k and writes row id of gate_up.
        gate_up = torch.empty(capacity, 2 * inter, dtype=torch.bfloat16, device=x.device)
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
        num_pairs = fc1_groups.num_pairs
        self._situ(
            gate_up,
            fc1_groups.pair_flat,
            num_pairs,
            act,
            act_scale,
            capacity,
            indexed=True,
            pdl=pdl,
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
        return expert_out

    def _in_chunks(self, x, sf, ids, tilings, plan, tuned: int, pdl: bool) -> torch.Tensor:
        """Each chunk's pairs gathered, FC1, SiTU and FC2 (experts/hopper/chunks.py), humming's
        kernels chosen for `tuned` pairs (launched without PDL), ours with it where `pdl`
        (pdl.py): the expert output BF16 [P, L] by pair number, P = plan.pairs (the finalize's
        bound: a call over it writes NaN rows, never reads past P)."""
        inter, latent = self.intermediate, self.latent
        from dep_ep.experts.hopper.chunk_kernels import chunk_routes, gather_rows

        local = self.num_local_experts
        cut = [chunk_routes(groups, routes, plan, local, pdl) for groups, routes in tilings]
        fc1_cut, fc2_cut = cut[0], cut[-1]
        groups = tilings[0][0]
        device, c = x.device, plan.chunk
        xg = torch.empty(c, latent, dtype=torch.uint8, device=device)
        xs = torch.empty(c, latent // SCALE_BLOCK, dtype=torch.float32, device=device)
        gate_up = torch.empty(c, 2 * inter, dtype=torch.bfloat16, device=device)
        act = torch.empty(c, inter, dtype=torch.float8_e4m3fn, device=device)
        act_scale = torch.empty(c, inter // SCALE_BLOCK, dtype=torch.float32, device=device)
        expert_out = torch.empty(plan.pairs, latent, dtype=torch.bfloat16, device=device)
        for i in range(plan.chunks):
            pairs = fc1_cut.pairs[i:]  # element 0: chunk i's pair count
            gather_rows(x, sf, groups.pair_row, i * c, pairs, xg, xs, self.sms, pdl=pdl)
            self.fc1(
                xg.view(torch.float8_e4m3fn),
                xs,
                fc1_cut.routes[i],
                fc1_cut.experts[i],
                fc1_cut.num_padded[i],
                1,
                gate_up,
                tuned,
            )
            self._situ(gate_up, groups.pair_flat, pairs, act, act_scale, c, indexed=False, pdl=pdl)
            self.fc2(
                act,
                act_scale,
                fc2_cut.routes[i],
                fc2_cut.experts[i],
                fc2_cut.num_padded[i],
                1,
                expert_out[i * c : (i + 1) * c],
                tuned,
            )
        return expert_out
