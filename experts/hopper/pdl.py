"""Programmatic dependent launch (PDL) between HopperExperts' kernels.

A kernel launched with PDL (Triton's `launch_pdl=True`, humming's `use_pdl`) may be launched
while the kernel before it on the stream is still running, once every program of that kernel
has run `griddepcontrol.launch_dependents` (or exited); its programs then wait in
`griddepcontrol.wait` until the kernel before has completed and its memory is visible. What it
saves is the launch latency and ramp between two kernels of a call: the gaps between kernels
and the programs' start-up, which at T = 1 are a few us of a call of 70-120 us
(docs/experts.md, "Where the time goes").

Each of HopperExperts' Triton kernels takes PDL: tl.constexpr and starts with `wait_then_release`
(PDL): wait for the kernel before, then let the kernel after launch, before any global memory
access. The order matters: humming's GEMMs read their tile routes and padded pair count (made
by the grouping, two kernels before FC1) before their own `griddepcontrol.wait`; they are
launched only once every program of the kernel before them has waited, so once the kernels
before that have completed. A kernel launched without PDL (torch's, a caller's) waits for the
whole stream before it as always, and one launched with PDL after it starts when it completes.

Triton's CPU interpreter runs no `griddepcontrol` (the kernels there take PDL False):
`launches_pdl` is False for a CPU device and for the interpreter's kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# The first compute capability with griddepcontrol (SM90).
PDL_MIN_MAJOR = 9


def launches_pdl(wanted: bool, device: torch.device, kernel) -> bool:
    """Whether HopperExperts' kernels on `device` run with PDL: `wanted` (HopperTiles.pdl), a
    CUDA device of compute capability 9.0 or later, and `kernel` (any of ours) compiled for the
    GPU, not run by Triton's CPU interpreter."""
    if not wanted or device.type != "cuda":
        return False
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return False
    return torch.cuda.get_device_capability(device)[0] >= PDL_MIN_MAJOR


def pdl_options(pdl: bool) -> dict:
    """A Triton launch's keyword arguments for `pdl`: the kernel's PDL constant and the launch
    attribute (both or neither: a kernel launched with PDL must wait)."""
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """With PDL: wait for the kernel before this one on the stream (complete, its memory
    visible), then let the kernel after launch. Call it first, before any global access."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
