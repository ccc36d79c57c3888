"""Programmatic dependent launch (PDL) between HopperExperts' kernels.

A kernel launched with PDL (Triton's `launch_pdl=True`) may be launched while the kernel before
it on the stream is still running, once every program of that kernel has run
`griddepcontrol.launch_dependents` (or exited); its programs then wait in `griddepcontrol.wait`
until the kernel before has completed and its memory is visible. What it saves is the launch
latency and start-up between two kernels of a call (docs/experts.md, "Programmatic dependent
launch", has what was measured).

Each of HopperExperts' Triton kernels takes PDL: tl.constexpr and starts with `wait_then_release`
(PDL): every program waits for the kernel before, then lets the kernel after launch, before any
global memory access. So a kernel of ours completes only after the kernel before it has
completed, and by induction after everything before it on the stream.

humming's GEMMs are launched without PDL (experts/hopper/humming_gemm.py, HUMMING_USE_PDL): with
its `use_pdl` their CTAs wait at their first tile, but a CTA that gets no tile exits without
waiting, so a GEMM with no pair (a call or a chunk without one) could complete while the kernel
before it still runs, and the PTX manual promises a wait only on the grids a kernel depends on.
Launched without PDL, a GEMM starts once everything before it has completed (its scheduler also
reads the routes and padded pair count before it would wait). A kernel launched with PDL after
one launched without it (a GEMM, a torch kernel, a caller's) makes its first memory access
after that one has completed.

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


def pdl_options(wanted: bool, device: torch.device, kernel) -> dict:
    """The keyword arguments of a launch of `kernel` on `device`: the kernel's PDL constant (wait,
    then release the next kernel) and Triton's launch attribute, both where `launches_pdl` says
    so and neither elsewhere (a kernel launched with PDL must wait, and the interpreter runs
    neither)."""
    pdl = launches_pdl(wanted, device, kernel)
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """With PDL: wait for the kernel before this one on the stream (complete, its memory
    visible), then let the kernel after launch. Call it first, before any global access."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
