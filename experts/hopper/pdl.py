"""Programmatic dependent launch (PDL) between HopperExperts' kernels.

A kernel launched with PDL (Triton's `launch_pdl=True`, humming's `use_pdl`) may be launched
while the kernel before it on the stream is still running, once every program of that kernel
has run `griddepcontrol.launch_dependents` (or exited); its programs then wait in
`griddepcontrol.wait` until the kernel before has completed and its memory is visible. What it
saves is the launch latency and ramp between two kernels of a call: on one H200, with every
kernel launched with PDL (before `after_humming`, below, which is not timed), 4 us of a call at
T = 1 (76 -> 72 us at 56 local experts) and 2-19 us from T = 4 to 256 (docs/experts.md,
"Programmatic dependent launch").

Each of HopperExperts' Triton kernels takes PDL: tl.constexpr and starts with `wait_then_release`
(PDL): wait for the kernel before, then let the kernel after launch, before any global memory
access. The order matters: humming's GEMMs read their tile routes and padded pair count (made
by the grouping, two kernels before FC1) before their own `griddepcontrol.wait`; they are
launched only once every program of the kernel before them has waited, so once the kernels
before that have completed. A kernel launched without PDL (torch's, a caller's) waits for the
whole stream before it as always, and one launched with PDL after it starts when it completes.

The kernel after one of humming's GEMMs is launched without PDL (`after_humming`): humming's
CTAs that get no tile exit without `griddepcontrol.wait`, so a GEMM with no pair (a call or a
chunk without one) can complete while the kernel before it still runs, and a wait on that GEMM
alone would not cover it (the PTX manual promises a wait on the grids a kernel depends on, not
on theirs). Launched without PDL, the kernel starts once everything before it on the stream has
completed; it still releases the kernel after it at once.

Each launch asks `pdl_options(wanted, device, kernel)`: PDL where it is wanted (HopperTiles.pdl)
and can run, that is on a CUDA device of SM90 or later and not in Triton's CPU interpreter
(which runs no `griddepcontrol`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# The first compute capability with griddepcontrol (SM90).
PDL_MIN_MAJOR = 9


@functools.cache
def device_has_pdl(index: int) -> bool:
    """Whether CUDA device `index` has griddepcontrol (compute capability 9.0 or later)."""
    return torch.cuda.get_device_capability(index)[0] >= PDL_MIN_MAJOR


def launches_pdl(wanted: bool, device: torch.device, kernel) -> bool:
    """Whether `kernel` (one of HopperExperts' Triton kernels) runs with PDL on `device`:
    `wanted` (HopperTiles.pdl; TypeError unless a bool), a CUDA device with griddepcontrol (a
    torch.device or its name), and the kernel compiled for the GPU, not run by Triton's CPU
    interpreter."""
    if not isinstance(wanted, bool):
        raise TypeError(f"pdl={wanted!r}; expected a bool")
    device = torch.device(device)
    if not wanted or device.type != "cuda":
        return False
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return device_has_pdl(index)


def pdl_options(wanted: bool, device: torch.device, kernel, *, after_humming: bool = False) -> dict:
    """The keyword arguments of a launch of `kernel` on `device`: the kernel's PDL constant (wait,
    then release the next kernel) where `launches_pdl` says so, and Triton's launch attribute
    with it unless the kernel comes right after one of humming's GEMMs (`after_humming`: module
    docstring). Never the attribute without the constant: a kernel launched with PDL must wait,
    and the interpreter runs neither."""
    pdl = launches_pdl(wanted, device, kernel)
    return {"PDL": pdl, "launch_pdl": pdl and not after_humming}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """With PDL: wait for the kernel before this one on the stream (complete, its memory
    visible), then let the kernel after launch. Call it first, before any global access."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
