"""HopperExperts: MXFP4 experts on SM90 over device-grouped pairs, in one of two engines.

- "humming" (the default when humming-kernels is installed, `pip install -e '.[gpu]'`):
  the grouping (pairs by expert and their tile routes) -> widen_scales_kernel -> humming's FC1
  (WGMMA, e4m3 rows x MXFP4) -> situ_mxfp8_kernel (SiTU, then MXFP8 like the dispatch) ->
  humming's FC2 -> finalize_kernel (experts/hopper_humming.py).
- "triton": the grouping -> fc1_situ_kernel -> fc2_kernel -> finalize_kernel, all ours
  (experts/hopper_kernels.py), with ReferenceExperts' BF16 numerics.

The grouping is one launch of experts/grouping_kernel.py (HopperTiles.grouping "triton", the
default) or experts/grouping.py's group_pairs and tile_routes in torch ("torch"), the same
tensors. Both engines keep the weights at 4 bits and read the receive rows' MXFP8 bytes as they
are (humming reads the E8M0 scales widened to fp32). No host synchronisation and no launch shape
that depends on the data: a call can be captured in a CUDA graph with the routed path.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch

from dep_ep.constants import SCALE_BLOCK
from dep_ep.experts.base import ExpertsBackend, check_receive_rows, cuda_capability_reason
from dep_ep.experts.hopper.grouping import (
    PairGroups,
    TileRoutes,
    check_grouping_args,
    group_pairs,
    pair_capacity,
    tile_routes,
)
from dep_ep.experts.hopper.humming_gemm import HummingGemm, scale_spread_error
from dep_ep.experts.weights import check_expert_weights, check_num_experts

MATHS = ("bf16", "fp32")  # experts/hopper_kernels.py
# "triton": experts/grouping_kernel.py in one launch; "torch": experts/grouping.py's group_pairs and
# tile_routes (~30 launches), the same tensors. On an H200 at K3's DEP16 shard the kernel takes
# 5-74 us where torch takes 119-209 us (T = 1..256, tiles of 16; docs/bench_experts.md).
GROUPINGS = ("torch", "triton")


@dataclass(frozen=True)
class HopperTiles:
    """Block shapes and launch of the triton engine's kernels (experts/hopper_kernels.py has what
    they mean); the humming engine uses finalize_block_l, finalize_warps and grouping only.

    block_n: pairs per tile (the MMA's N side; >= 16); fc1_block_m: intermediate columns per FC1
    work item (it reads 2 * fc1_block_m weight rows: gate and up); fc2_block_m: output columns per
    FC2 work item; *_block_k: K per step (a multiple of 64); finalize_block_l: the most output
    columns per finalize program (it takes the largest power of two <= this dividing L);
    finalize_warps: warps per finalize program; num_warps, num_stages: the GEMM kernels' launch;
    programs_per_sm: persistent programs per SM; math: one of MATHS;
    persistent: each GEMM program walks the work list (True) or one program per work item, the
    grid covering the work list's capacity (False); grouping: one of GROUPINGS (both engines),
    how the rows are grouped by expert (the same tensors either way).
    """

    block_n: int = 16
    fc1_block_m: int = 64
    fc1_block_k: int = 128
    fc2_block_m: int = 64
    fc2_block_k: int = 128
    # 512 columns over 2 warps (16-byte loads): 4.8 us at T=64 on a DEP16 shard where 256 over 4
    # took 16.7; the fastest or within 20% of the fastest of six shapes (128..512 columns over 1, 2
    # or 4 warps) at every T measured (H200, docs/bench_hopper_launch.md).
    finalize_block_l: int = 512
    finalize_warps: int = 2
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 2
    math: str = "bf16"
    persistent: bool = True
    grouping: str = "triton"

    def check(self, latent: int, intermediate: int) -> None:
        """ValueError naming the field unless every block divides its dimension (powers of two)."""
        for name, dim in (("latent", latent), ("intermediate", intermediate)):
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                raise ValueError(f"HopperTiles.check: {name}={dim!r}; expected an int >= 1")
        if self.math not in MATHS:
            raise ValueError(f"HopperTiles: math={self.math!r}; expected one of {MATHS}")
        if self.grouping not in GROUPINGS:
            raise ValueError(f"HopperTiles: grouping={self.grouping!r}; expected one of"
                             f" {GROUPINGS}")  # fmt: skip
        if not isinstance(self.persistent, bool):
            raise TypeError(f"HopperTiles: persistent={self.persistent!r}; expected a bool")
        for name in ("block_n", "fc1_block_m", "fc1_block_k", "fc2_block_m", "fc2_block_k",
                     "finalize_block_l", "finalize_warps", "num_warps", "num_stages",
                     "programs_per_sm"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"HopperTiles: {name}={value!r}; expected an int")
        for name, value, dim, least in (
            ("block_n", self.block_n, None, 16),
            ("fc1_block_m", self.fc1_block_m, intermediate, 16),
            ("fc1_block_k", self.fc1_block_k, latent, 2 * SCALE_BLOCK),
            ("fc2_block_m", self.fc2_block_m, latent, 16),
            ("fc2_block_k", self.fc2_block_k, intermediate, 2 * SCALE_BLOCK),
            ("finalize_block_l", self.finalize_block_l, None, 16),
        ):
            if value < least or value & (value - 1) or (dim is not None and dim % value):
                where = "" if dim is None else f" dividing {dim}"
                raise ValueError(f"HopperTiles: {name}={value}; expected a power of two >= {least}"
                                 f"{where}")  # fmt: skip
        for name in ("num_warps", "finalize_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"HopperTiles: {name}={value}; expected a power of two")
        for name, value in (("num_stages", self.num_stages),
                            ("programs_per_sm", self.programs_per_sm)):  # fmt: skip
            if value < 1:
                raise ValueError(f"HopperTiles: {name}={value}; expected >= 1")

    def finalize_columns(self, latent: int) -> int:
        """Output columns per finalize program at L = latent: the largest power of two <=
        finalize_block_l dividing L (>= 16 after `check`: fc2_block_m >= 16 divides L)."""
        return math.gcd(self.finalize_block_l, latent)


ENGINES = ("humming", "triton")
# group_pairs' tensors per (row, k) slot: int64 key, order and position (and the sort's scratch
# of about two more), int32 pair lists and slot map.
GROUPING_BYTES_PER_SLOT = 64
# tile_routes' tensors per tile slot (about one per pair): int32 flat and pair lists, int64 index
# and gathered values. The humming engine routes twice when FC1 and FC2 tile differently.
ROUTE_BYTES_PER_SLOT = 32
# situ_mxfp8_kernel: pairs per step, the most intermediate columns per program, and programs per SM
# (4 warps each). 8 pairs x 256 columns at 16 programs an SM took 9.2 us at T=64 on a DEP16 shard
# where 16 x 256 at 4 took 12.8 (4.4 / 7.2 / 33.3 against 6.0 / 7.5 / 38.6 at T = 8 / 32 / 256);
# the fastest or within 12% of the fastest of eight shapes at every T measured (H200,
# docs/bench_hopper_launch.md).
SITU_ROWS, SITU_MAX_BLOCK_I, SITU_PROGRAMS_PER_SM = 8, 256, 16
# widen_scales_kernel: scale bytes per program.
WIDEN_BLOCK = 1024
# The humming engine is the default where L and I are multiples of this (K3: 3584 = 7 x 512,
# 3072 = 6 x 512); humming has run only at K3's widths.
HUMMING_DEFAULT_MULTIPLE = 512


def default_engine(latent: int, intermediate: int) -> str:
    """ "humming" when humming-kernels is importable and L and I are multiples of
    HUMMING_DEFAULT_MULTIPLE, else "triton"."""
    fits = all(size % HUMMING_DEFAULT_MULTIPLE == 0 for size in (latent, intermediate))
    return "humming" if fits and importlib.util.find_spec("humming") is not None else "triton"


def tuning_pairs(rows: int, topk: int, num_local: int, num_experts: int | None) -> int:
    """The pair count humming's kernels are tuned for (humming's shape_m): the power of two
    nearest in log2 to the pairs R = rows receive rows are expected to hold, at least 16 (one
    compilation per value). Only speed depends on it: any count of pairs runs correctly.
    Expected pairs: with num_experts, under uniform routing (K of E experts, num_local here, each
    row holding at least one local id); without it, the capacity R * K.

    Nearest rather than the next power of two up: on an H200 at K3's shapes the kernel chosen for
    the nearest one was the fastest of humming's tunings for 16..65536 pairs, or within 10%, for
    FC1 and FC2 at T = 1..256 on a DEP16 shard and at T = 16, 256 on a DEP2 shard; the next one
    up took 1.3x at T = 64 (docs/bench_humming_tuning.md)."""
    pairs = float(pair_capacity(rows, topk))
    if num_experts is not None:
        share = num_local / num_experts
        some_local = 1.0 - (1.0 - share) ** topk  # a token holds >= 1 local id
        pairs = min(pairs, rows * topk * share / some_local)
    return 1 << max(4, round(math.log2(max(pairs, 1.0))))


def workspace_bytes(rows: int, topk: int, latent: int, intermediate: int, engine: str) -> int:
    """About the bytes one call allocates (from torch's caching allocator) for R receive rows, at
    the pair capacity P = R * K: the grouping's temporaries (GROUPING_BYTES_PER_SLOT a slot);
    triton: BF16 activations [P, I] and expert outputs [P, L]; humming: the rows' scales in fp32
    [R, L/32], BF16 FC1 outputs [R * K, 2I], MXFP8 activations [P, I] with fp32 scales, the
    tile routes of two groupings (ROUTE_BYTES_PER_SLOT a pair each) and BF16 expert outputs
    [P, L]."""
    pairs = pair_capacity(rows, topk)
    grouping = rows * topk * GROUPING_BYTES_PER_SLOT
    if engine == "triton":
        return grouping + pairs * (intermediate + latent) * 2
    scales = rows * (latent // SCALE_BLOCK) * 4
    act = pairs * (intermediate + intermediate // SCALE_BLOCK * 4)
    routing = 2 * pairs * ROUTE_BYTES_PER_SLOT
    return (
        grouping + scales + rows * topk * 2 * intermediate * 2 + act + routing + pairs * latent * 2
    )


def grouped(
    ids: torch.Tensor, first_expert: int, num_local: int, block_n: int, grouping: str
) -> tuple[PairGroups, TileRoutes | None]:
    """The pairs of ids grouped by local expert, and their tile routes where the grouping makes
    them in the same launch ("triton"; "torch" returns None: tile_routes would cost launches).
    "triton" takes block_n up to grouping_kernel.MAX_BLOCK_N (16384); a larger one is grouped in
    torch, with the same result."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouped: grouping={grouping!r}; expected one of {GROUPINGS}")
    check_grouping_args("grouped", ids, first_expert, num_local, block_n)
    if grouping == "triton":
        from dep_ep.experts.hopper.grouping_kernel import fits, group_and_route  # imports triton

        if fits(block_n):
            return group_and_route(ids, first_expert, num_local, block_n)
    return group_pairs(ids, first_expert, num_local, block_n), None


def routed_tilings(
    ids: torch.Tensor, first_expert: int, num_local: int, block_ns: tuple[int, ...], grouping: str
) -> list[tuple[PairGroups, TileRoutes]]:
    """[(groups, routes)] for each tile size in block_ns (one or two, distinct), as group_pairs and
    tile_routes give them: "triton" in one launch of experts/grouping_kernel.py (when every size
    fits), "torch" (or a size past the kernel's lanes) in torch, once per size."""
    if grouping not in GROUPINGS:
        raise ValueError(f"routed_tilings: grouping={grouping!r}; expected one of {GROUPINGS}")
    for block_n in block_ns:
        check_grouping_args("routed_tilings", ids, first_expert, num_local, block_n)
    if grouping == "triton":
        from dep_ep.experts.hopper.grouping_kernel import fits, group_and_route_tilings

        if all(fits(block_n) for block_n in block_ns):
            return group_and_route_tilings(ids, first_expert, num_local, tuple(block_ns))
    tilings = []
    for block_n in block_ns:
        groups = group_pairs(ids, first_expert, num_local, block_n)
        tilings.append((groups, tile_routes(groups)))
    return tilings


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
        x, sf, w13, s13, act, groups.pair_row, *tile_args,
        latent, inter, tiles.fc1_block_m, tiles.block_n, tiles.fc1_block_k, tiles.math,
        tiles.persistent, **launch,
    )  # fmt: skip
    fc2_work = groups.tile_capacity * (latent // tiles.fc2_block_m)
    fc2_programs = min(programs, fc2_work) if tiles.persistent else fc2_work
    kernels.fc2_kernel[(max(1, fc2_programs),)](
        act, w2, s2, y, *tile_args,
        latent, inter, tiles.fc2_block_m, tiles.block_n, tiles.fc2_block_k, tiles.math,
        tiles.persistent, **launch,
    )  # fmt: skip
    if rows:  # forward returns before this for R = 0; a direct call may not
        columns = tiles.finalize_columns(latent)
        kernels.finalize_kernel[(rows, latent // columns)](
            y, groups.pair_slot, weights, out, latent, topk, columns,
            num_warps=tiles.finalize_warps,
        )  # fmt: skip
    return out


class HopperExperts(ExpertsBackend):
    """The rank's MXFP4 experts on an SM90 GPU (experts/weights.py has the checkpoint layout).

    engine "triton": the same numerics as ReferenceExperts up to the order of fp32 sums (MXFP8
    rows and MXFP4 weights decoded exactly; FC1 with fp32 sums; SiTU in fp32, one rounding to
    BF16; FC2 with fp32 sums, one rounding to BF16; per row the fp32 sum over k in order of weight
    * expert output, one rounding to BF16).
    engine "humming": e4m3 rows times the weights in e4m3 (exact for MXFP4 within an expert's
    11-binade scale spread, checked at construction) with fp32 sums; FC1's output rounded to BF16;
    SiTU in fp32 rounded to MXFP8 (e4m3 elements, one scale per 32, the dispatch's recipe); FC2
    with fp32 sums, one rounding to BF16; the same finalize. Unless `deterministic`, humming may
    pick stream-K kernels, which split K over CTAs and add the BF16 partial outputs (atomically
    beyond 3 slices): more roundings, and reruns not guaranteed bitwise equal. deterministic=True
    asks humming for its batch-invariant kernels (no stream-K).
    engine None: "humming" where `default_engine` picks it (humming-kernels installed, L and I
    multiples of 512), else "triton".
    The triton engine and the finalize use no atomics and no split K: with them (and humming with
    deterministic=True) reruns on the same rows are bitwise equal.

    Memory: triton keeps the caller's weights (no copy when contiguous); humming keeps its own
    re-laid-out copy (the same 17.5 MB per K3 expert) and not the caller's. Per call,
    `workspace_bytes` from torch's caching allocator (inside a graph capture, the graph's pool).
    The humming engine compiles its kernels the first time a call's `tuning_pairs` (a power of
    two from the row count) is new (seconds): make one eager call of each row count before
    capturing a graph.

    Rows without a local id keep whatever `out` held. A NaN or Inf in a row stays within the
    outputs of that row's pairs.
    """

    requires = "an SM90 (Hopper) CUDA GPU and triton (and humming-kernels for engine='humming')"

    def __init__(
        self,
        w13: torch.Tensor,
        s13: torch.Tensor,
        w2: torch.Tensor,
        s2: torch.Tensor,
        *,
        first_expert: int,
        num_experts: int | None = None,
        engine: str | None = None,
        deterministic: bool = False,
        tiles: HopperTiles | None = None,
    ) -> None:
        owner = type(self).__name__
        geometry = check_expert_weights(owner, w13, s13, w2, s2, first_expert)
        # Arguments first, the device last: a mistake shows on any machine.
        if num_experts is not None:
            check_num_experts(owner, num_experts, first_expert + geometry.num_local)
        if engine is not None and engine not in ENGINES:
            raise ValueError(f"{owner}: engine={engine!r}; expected None or one of {ENGINES}")
        if not isinstance(deterministic, bool):
            raise TypeError(f"{owner}: deterministic={deterministic!r}; expected a bool")
        if tiles is not None and not isinstance(tiles, HopperTiles):
            raise TypeError(f"{owner}: tiles is {type(tiles).__name__}; expected HopperTiles")
        self.tiles = tiles or HopperTiles()
        self.tiles.check(geometry.latent, geometry.intermediate)
        self.check_device(geometry.device)
        self.num_experts = num_experts
        if engine is None:
            engine = default_engine(geometry.latent, geometry.intermediate)
        self.engine = engine
        self.activation_format = "mxfp8" if self.engine == "humming" else "bf16"
        self.deterministic = deterministic or self.engine == "triton"
        self.first_expert = int(first_expert)
        self.num_local_experts = geometry.num_local
        self.latent, self.intermediate = geometry.latent, geometry.intermediate
        self.device = geometry.device
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.programs = self.sms * self.tiles.programs_per_sm
        if self.engine == "humming":
            if importlib.util.find_spec("humming") is None:
                raise RuntimeError(f"{owner}: engine='humming' needs humming-kernels:"
                                   " pip install -e '.[gpu]'")  # fmt: skip
            for name, scales in (("s13", s13), ("s2", s2)):
                error = scale_spread_error(owner, name, scales)
                if error is not None:
                    raise ValueError(error)
            self.fc1 = HummingGemm.prepare(w13.contiguous(), s13.contiguous(), self.deterministic)
            self.fc2 = HummingGemm.prepare(w2.contiguous(), s2.contiguous(), self.deterministic)
            # SiTU's column block: the largest power of two <= SITU_MAX_BLOCK_I dividing I (>= 32:
            # I is a multiple of 32).
            self.situ_block_i = math.gcd(SITU_MAX_BLOCK_I, geometry.intermediate)
        else:
            # uint8, the checkpoint layout (contiguous: the kernels index it densely).
            self.w13, self.s13 = w13.contiguous(), s13.contiguous()
            self.w2, self.s2 = w2.contiguous(), s2.contiguous()

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        device = torch.device(device)
        if device.type != "cuda":
            return f"it runs on CUDA GPUs, not {device.type}"
        reason = cuda_capability_reason(device, 9)
        if reason is not None:
            return reason
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        return None

    def tuning_pairs(self, rows: int, topk: int) -> int:
        """The pair count humming's kernels are chosen for on R = rows receive rows:
        `tuning_pairs(rows, topk, num_local_experts, num_experts)`."""
        return tuning_pairs(rows, topk, self.num_local_experts, self.num_experts)

    def workspace_bytes(self, rows: int, topk: int) -> int:
        """Bytes a call over `rows` receive rows with `topk` ids each allocates (see the class)."""
        return workspace_bytes(rows, topk, self.latent, self.intermediate,
                               self.engine)  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        sf: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        check_receive_rows(type(self).__name__, x, sf, ids, weights, out, self.latent,
                           self.device)  # fmt: skip
        if ids.shape[0] == 0:
            return out
        with torch.cuda.device(self.device):  # triton and humming launch on the current device
            if self.engine == "triton":
                weights_4bit = (self.w13, self.s13, self.w2, self.s2)
                return fused_experts(*weights_4bit, self.first_expert, x, sf, ids, weights, out,
                                     self.tiles, self.programs)  # fmt: skip
            return self._forward_humming(x, sf, ids, weights, out)

    def _forward_humming(self, x, sf, ids, weights, out) -> torch.Tensor:
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
        tilings = routed_tilings(ids, self.first_expert, self.num_local_experts, block_ns,
                                 self.tiles.grouping)  # fmt: skip
        (fc1_groups, fc1_routes), (fc2_groups, fc2_routes) = tilings[0], tilings[-1]
        # humming reads the rows' scales as fp32 2^(byte - 127).
        scales = torch.empty(sf.shape, dtype=torch.float32, device=x.device)
        kernels.widen_scales_kernel[(-(-sf.numel() // WIDEN_BLOCK),)](
            sf, scales, sf.numel(), WIDEN_BLOCK, num_warps=4,
        )  # fmt: skip
        # FC1 reads row id // K of x for pair id = row * K + k and writes row id of gate_up.
        gate_up = torch.empty(rows * topk, 2 * inter, dtype=torch.bfloat16, device=x.device)
        self.fc1(x.view(torch.float8_e4m3fn), scales, fc1_routes.flat,
                 fc1_groups.tile_expert, fc1_routes.num_padded, topk, gate_up,
                 tuned)  # fmt: skip
        act = torch.empty(capacity, inter, dtype=torch.float8_e4m3fn, device=x.device)
        act_scale = torch.empty(capacity, inter // SCALE_BLOCK, dtype=torch.float32,
                                device=x.device)  # fmt: skip
        column_blocks = inter // self.situ_block_i
        situ_programs = max(
            1, min(-(-capacity // SITU_ROWS), SITU_PROGRAMS_PER_SM * self.sms // column_blocks)
        )
        kernels.situ_mxfp8_kernel[(situ_programs, column_blocks)](
            gate_up, fc1_groups.pair_flat, fc1_groups.num_pairs, act, act_scale,
            inter, SITU_ROWS, self.situ_block_i, num_warps=4,
        )  # fmt: skip
        # FC2: pair j reads act row j and writes expert output row j.
        expert_out = torch.empty(capacity, latent, dtype=torch.bfloat16, device=x.device)
        self.fc2(act, act_scale, fc2_routes.pair, fc2_groups.tile_expert, fc2_routes.num_padded,
                 1, expert_out, tuned)  # fmt: skip
        columns = self.tiles.finalize_columns(latent)
        kernels.finalize_kernel[(rows, latent // columns)](
            expert_out, fc1_groups.pair_slot, weights, out, latent, topk, columns,
            num_warps=self.tiles.finalize_warps,
        )  # fmt: skip
        return out
