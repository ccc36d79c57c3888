"""The kernels' launch arguments in three small structs instead of a dozen scalars, and the
compile-time tuning that does not change their results.

Frozen dataclasses whose fields are CuTeDSL numbers: CuTeDSL passes each field as a kernel
parameter, a runtime value (never a compile-time constant), so one compiled kernel serves every
EpBuffers of its geometry. This module must not use `from __future__ import annotations`: the
fields' types must stay classes for CuTeDSL to see that they are numbers.
"""

from dataclasses import dataclass

from cutlass import Int32, Int64

from dep_ep.checks import check_int_in
from dep_ep.constants import COMBINE_CTAS_PER_SM, COMBINE_WARPS, NORM_WARPS


@dataclass(frozen=True)
class SymmetricRegions:
    """Where every rank's receive regions are. `peers`: the device address of int64 [N], every
    rank's allocation base (EpBuffers.peer_addresses); `own`: this rank's base; the rest: byte
    offsets of the regions in every allocation (EpLayout.regions: the same on every rank)."""

    peers: Int64
    own: Int64
    x: Int64
    sf: Int64
    ids: Int64
    weights: Int64
    out: Int64
    flags: Int64


@dataclass(frozen=True)
class RankControl:
    """This rank's control words. `state`: device int64 [STATE_WORDS] (constants.STATE_*);
    `error`: host-mapped int64 [ERROR_WORDS] (constants.ERROR_*); `rank` in the EP group;
    `timeout_ns` bounds every wait."""

    state: Int64
    error: Int64
    rank: Int32
    timeout_ns: Int64


@dataclass(frozen=True)
class Step:
    """One call: T tokens per rank (the same on every rank; -1 in a rejected call) and the
    caller's tag (constants.NO_TAG when it gave none)."""

    tokens: Int32
    tag: Int64


@dataclass(frozen=True)
class KernelTuning:
    """Choices that change the kernels' speed, never their results (compile-time; part of the
    compile cache's key). pdl: launch with programmatic dependent launch (each kernel waits for
    the grid before it, griddepcontrol.wait, before it reads, and lets the next launch early);
    dispatch_blocks_in_flight: 32-element blocks a dispatch thread loads before it quantizes;
    combine_warps: warps of a combine CTA, a multiple of NORM_WARPS (4 or 8): each group of
    NORM_WARPS warps reduces one token at a time; combine_ctas_per_sm: 0 launches
    ceil(T / groups) CTAs, c > 0 at most c CTAs an SM (each CTA's groups then loop over the
    tokens) and compiles the kernel so that c CTAs fit an SM (launch bounds: at most
    65536 / (c x 32 x combine_warps) registers a thread; a shared-memory carveout for c CTAs).

    The defaults, measured at EP=1 on an H200 (docs/results/bench_ep1.md): PDL took the T = 1 pair
    from 13.0 to 12.2 us; two blocks in flight the T = 4096 dispatch from 15.8 to 14.5 us. The
    combine's, 8 warps (two token groups) and 2 CTAs an SM (ptxas: 96-100 registers a thread,
    no spills), took the T = 128 and 256 combine from 4.9 and 5.6 us to 3.8 and 4.5 us against
    4 warps and 8 CTAs an SM (64 registers), 2.5 to 2.3 us at T = 1, and 22.0 to 23.0 us at
    T = 4096 (one run, 2026-12-03; docs/perf_notes.md, "The group combine")."""

    pdl: bool = True
    dispatch_blocks_in_flight: int = 2
    combine_warps: int = COMBINE_WARPS
    combine_ctas_per_sm: int = COMBINE_CTAS_PER_SM

    def __post_init__(self) -> None:
        for name, low in (
            ("dispatch_blocks_in_flight", 1),
            ("combine_warps", 1),
            ("combine_ctas_per_sm", 0),
        ):
            value = check_int_in("KernelTuning", name, getattr(self, name), low, 8)
            object.__setattr__(self, name, value)  # a Python int: part of the compile cache's key
        if self.combine_warps % NORM_WARPS:
            raise ValueError(
                f"KernelTuning: combine_warps={self.combine_warps}; expected a multiple of"
                f" {NORM_WARPS} (a token's row is reduced by a group of {NORM_WARPS} warps)"
            )
