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
from dep_ep.constants import COMBINE_WARPS


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
    combine_warps: warps of a combine CTA, one token each; combine_ctas_per_sm: 0 launches
    ceil(T / combine_warps) CTAs, c > 0 at most c CTAs an SM (each CTA's warps then loop over
    the tokens: one wave where c CTAs fit an SM).

    The defaults, measured at EP=1 on an H200 (docs/results/bench_ep1.md): PDL took the T = 1 pair
    from 13.0 to 12.2 us; two blocks in flight the T = 4096 dispatch from 15.8 to 14.5 us; one
    combine CTA an SM (the kernel takes 255 registers a thread: one 8-warp CTA fits an SM) the
    T = 4096 combine from 38.2 to 30.2 us in the run of that page (no change up to T = 1024,
    where ceil(T / 8) CTAs are one wave anyway)."""

    pdl: bool = True
    dispatch_blocks_in_flight: int = 2
    combine_warps: int = COMBINE_WARPS
    combine_ctas_per_sm: int = 1

    def __post_init__(self) -> None:
        for name, low in (
            ("dispatch_blocks_in_flight", 1),
            ("combine_warps", 1),
            ("combine_ctas_per_sm", 0),
        ):
            value = check_int_in("KernelTuning", name, getattr(self, name), low, 8)
            object.__setattr__(self, name, value)  # a Python int: part of the compile cache's key
