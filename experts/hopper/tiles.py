"""HopperTiles: the block shapes and launches of HopperExperts' kernels, which each engine carries
(TritonEngine reads them all, HummingEngine the finalize's, the grouping and pdl)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dep_ep.checks import check_flag, check_int, check_int_in
from dep_ep.constants import SCALE_BLOCK
from dep_ep.experts.hopper.grouping import Grouping, check_grouping

MATHS = ("bf16", "fp32")  # experts/hopper/kernels.py
# A CUDA thread block holds at most 1024 threads: 32 warps (64 failed in ptxas).
MAX_WARPS = 32
# The largest block side of the triton engine's GEMMs (block_n, fc1_block_m, fc2_block_m) and K
# step (*_block_k). Past them a kernel cannot fit an SM: block_n=1024 compiled for 190 s and then
# needed more than the 227 KiB of shared memory, block_n=32768 failed inside Triton (a
# careless-user probe). Within them Triton names the shared memory a shape lacks at its first call.
MAX_BLOCK_SIDE, MAX_BLOCK_K = 256, 1024
# An SM90 SM holds at most 32 resident CTAs. Stages: bounds, not measured optima (the defaults
# are 4 stages and 2 programs an SM); they stop values no launch can use.
MAX_PROGRAMS_PER_SM, MAX_STAGES = 32, 8
# HopperTiles' fields that are sizes: Python ints once made (the kernels take them as
# compile-time constants).
SIZE_FIELDS = (
    "block_n",
    "fc1_block_m",
    "fc1_block_k",
    "fc2_block_m",
    "fc2_block_k",
    "finalize_block_l",
    "finalize_warps",
    "num_warps",
    "num_stages",
    "programs_per_sm",
)


@dataclass(frozen=True)
class HopperTiles:
    """Block shapes and launch of the triton engine's kernels (experts/hopper/kernels.py has what
    they mean); HummingEngine uses finalize_block_l, finalize_warps, grouping and pdl only.

    block_n: pairs per tile (the MMA's N side; >= 16); fc1_block_m: intermediate columns per FC1
    work item (it reads 2 * fc1_block_m weight rows: gate and up); fc2_block_m: output columns per
    FC2 work item; *_block_k: K per step (a multiple of 64); finalize_block_l: the most output
    columns per finalize program (it takes the largest power of two <= this dividing L);
    finalize_warps: warps per finalize program; num_warps, num_stages: the GEMM kernels' launch;
    programs_per_sm: persistent programs per SM; math: one of MATHS;
    persistent: each GEMM program walks the work list (True) or one program per work item, the
    grid covering the work list's capacity (False); grouping: a Grouping (both engines),
    how the rows are grouped by expert (the same tensors either way); pdl: our Triton kernels of a
    call (both engines) launched with programmatic dependent launch where the GPU has it, each
    waiting for the kernel before it in every program (experts/hopper/pdl.py); humming's GEMMs
    never are.
    """

    block_n: int = 16
    fc1_block_m: int = 64
    fc1_block_k: int = 128
    fc2_block_m: int = 64
    fc2_block_k: int = 128
    # 512 columns over 2 warps (16-byte loads): 4.8 us at T=64 on a DEP16 shard where 256 over 4
    # took 16.7; the fastest or within 20% of the fastest of six shapes (128..512 columns over 1, 2
    # or 4 warps) at every T measured (H200, docs/results/bench_hopper_launch.md).
    finalize_block_l: int = 512
    finalize_warps: int = 2
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 2
    math: str = "bf16"
    persistent: bool = True
    grouping: Grouping = Grouping.TRITON
    pdl: bool = True

    def __post_init__(self) -> None:
        # An integer of another kind (NumPy, a 0-dim torch integer) becomes a Python int here, as
        # everywhere in dep_ep; anything else stays for `check` to name.
        for name in SIZE_FIELDS:
            try:
                object.__setattr__(self, name, check_int("HopperTiles", name, getattr(self, name)))
            except TypeError:
                pass

    def check(self, latent: int, intermediate: int) -> None:
        """ValueError naming the field unless every block divides its dimension (powers of two)."""
        check_int_in("HopperTiles.check", "latent", latent, 1)
        check_int_in("HopperTiles.check", "intermediate", intermediate, 1)
        if self.math not in MATHS:
            raise ValueError(f"HopperTiles: math={self.math!r}; expected one of {MATHS}")
        check_grouping("HopperTiles", self.grouping)
        for name in ("persistent", "pdl"):
            check_flag("HopperTiles", name, getattr(self, name))
        for name in SIZE_FIELDS:
            check_int("HopperTiles", name, getattr(self, name))  # TypeError naming a non-int
        for name, value, dim, least, most in (
            ("block_n", self.block_n, None, 16, MAX_BLOCK_SIDE),
            ("fc1_block_m", self.fc1_block_m, intermediate, 16, MAX_BLOCK_SIDE),
            ("fc1_block_k", self.fc1_block_k, latent, 2 * SCALE_BLOCK, MAX_BLOCK_K),
            ("fc2_block_m", self.fc2_block_m, latent, 16, MAX_BLOCK_SIDE),
            ("fc2_block_k", self.fc2_block_k, intermediate, 2 * SCALE_BLOCK, MAX_BLOCK_K),
            ("finalize_block_l", self.finalize_block_l, None, 16, None),
        ):
            bad = value < least or value & (value - 1) or (dim is not None and dim % value)
            if bad or (most is not None and value > most):
                where = "" if dim is None else f" dividing {dim}"
                upto = "" if most is None else f" and <= {most}"
                raise ValueError(
                    f"HopperTiles: {name}={value}; expected a power of two >= {least}{upto}{where}"
                )
        for name in ("num_warps", "finalize_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1) or value > MAX_WARPS:
                raise ValueError(
                    f"HopperTiles: {name}={value}; expected a power of two <= {MAX_WARPS}"
                )
        for name, value, most in (
            ("num_stages", self.num_stages, MAX_STAGES),
            ("programs_per_sm", self.programs_per_sm, MAX_PROGRAMS_PER_SM),
        ):
            if value < 1 or value > most:
                raise ValueError(f"HopperTiles: {name}={value}; expected 1..{most}")

    def finalize_columns(self, latent: int) -> int:
        """Output columns per finalize program at L = latent: the largest power of two <=
        finalize_block_l dividing L (>= 16 after `check`: fc2_block_m >= 16 divides L)."""
        return math.gcd(self.finalize_block_l, latent)
