"""What the kernels' launchers share: the geometry they compile for, the process's cache of
compiled kernels, and the launch parameters that are the same for every kernel of a transport.

Each kernel's module holds its launcher beside the kernel (DispatchLaunch in dispatch.py,
CombineLaunch in combine.py, RejectLaunch in reject.py, Mxfp8QuantizeLaunch in
mxfp8_quantize.py): the compile for a geometry with placeholder arguments, the grid rule, the
HostParams it writes in place at each launch (but Mxfp8QuantizeLaunch, a test and benchmark
path, which passes plain values), and the launch with typed parameters. The device
transport (comm/device_transport.py) composes them.

Importing this module needs no CuTeDSL (`compiled_count` is read where it may be missing);
`compile_cached` and `TransportParams` import it when called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dep_ep.constants import STATUS_FAILED, STATUS_REJECTED

if TYPE_CHECKING:
    import torch

    from dep_ep.comm.buffers import EpBuffers

# (num_ranks, latent, topk, experts_per_rank, kernel name, arch, tuning) -> compiled kernel.
_COMPILED: dict[tuple, object] = {}


def compiled_count() -> int:
    """Kernels compiled so far in this process (the cache's size)."""
    return len(_COMPILED)


# The RejectKernel variants by launcher name: (phase where the call failed, the flags' status).
# Here, not in reject.py, so that the transport names its kernels without importing CuTeDSL.
REJECT_KERNELS = {
    "reject_dispatch": ("dispatch", STATUS_REJECTED),
    "reject_combine": ("combine", STATUS_REJECTED),
    "fail_combine": ("combine", STATUS_FAILED),
}


@dataclass(frozen=True)
class KernelGeometry:
    """The compile-time geometry of the dispatch, combine and reject kernels: num_ranks N
    (1..MAX_RANKS), latent L (a multiple of SCALE_BLOCK), topk K (1..MAX_TOPK),
    experts_per_rank. T is a runtime argument: no compile per token count. The bounds every
    launcher shares, stated here once: those, and N * max_tokens * max(L / 2, K) < 2^31 (the
    kernels index in int32; check_kernel_limits, at DeviceTransport's construction)."""

    num_ranks: int
    latent: int
    topk: int
    experts_per_rank: int


# The targets the library's kernels are written for: Hopper and Blackwell datacenter parts.
KERNEL_ARCHS = ("sm_90a", "sm_100a")


def compile_cached(
    geometry: KernelGeometry,
    name: str,
    arch: str | None,
    tuning: object,
    build: Callable[[], tuple[object, tuple]],
    keep_ptx_dir: str | None = None,
):
    """The compiled kernel `name` of `geometry` and `tuning` (a KernelTuning) for `arch`
    ("sm_90a", "sm_100a"; None: this process's GPU), from the process's cache or compiled now:
    `build()` returns (the kernel object, its placeholder launch arguments but the stream, of
    which only the types reach the compiled kernel). `keep_ptx_dir` keeps the PTX there and
    always compiles afresh (the cached entry is replaced). The key is (N, L, K,
    experts_per_rank, name, arch, tuning)."""
    key = (
        geometry.num_ranks,
        geometry.latent,
        geometry.topk,
        geometry.experts_per_rank,
        name,
        arch,
        tuning,
    )
    if key in _COMPILED and keep_ptx_dir is None:
        return _COMPILED[key]
    compiled = compile_kernel(build, arch, keep_ptx_dir)
    _COMPILED[key] = compiled
    return compiled


def compile_kernel(
    build: Callable[[], tuple[object, tuple]], arch: str | None, keep_ptx_dir: str | None = None
):
    """cute.compile of `build()`'s kernel and placeholder arguments, then a placeholder stream,
    for `arch` (one of KERNEL_ARCHS; None: this process's GPU), keeping the PTX in
    `keep_ptx_dir` when given. No cache. ValueError for another arch (CuTe's own error is a
    bare KeyError), and for None in a process without a GPU (CuTe then compiles for a default
    arch, not one the caller chose)."""
    if arch is not None and arch not in KERNEL_ARCHS:
        raise ValueError(f"compile_kernel: arch {arch!r}; expected one of {KERNEL_ARCHS} or None")
    if arch is None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                f"compile_kernel: arch None (this process's GPU) in a process without a GPU;"
                f" name one of {KERNEL_ARCHS}"
            )
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute

    options = []
    if arch:
        options.append(f"--gpu-arch {arch}")
    if keep_ptx_dir:
        options += ["--keep-ptx", f"--dump-dir {keep_ptx_dir}"]
    kw = {"options": " ".join(options)} if options else {}
    kernel, args = build()
    return cute.compile(kernel, *args, cuda.CUstream(0), **kw)


def placeholder_structs() -> tuple:
    """Placeholders of the launch structs (SymmetricRegions, RankControl, Step) for a compile:
    only their types reach the compiled kernel."""
    from cutlass import Int32, Int64

    from dep_ep.comm.kernels.launch_args import RankControl, Step, SymmetricRegions

    z = Int64(0)
    return SymmetricRegions(*[z] * 8), RankControl(z, z, Int32(0), z), Step(Int32(1), z)


class TransportParams:
    """The launch parameters every kernel of one DeviceTransport shares and that are the same at
    every call, in HostParams (comm/kernels/host_params.py): `regions` (SymmetricRegions of the
    transport's buffers) and `control` (RankControl: its device state, error record, rank and
    timeout). The launchers take them at construction and pass them as they are."""

    def __init__(
        self,
        buffers: EpBuffers,
        state: torch.Tensor,
        error: torch.Tensor,
        rank: int,
        timeout_ns: int,
    ) -> None:
        """state: device int64 [STATE_WORDS]; error: host-mapped int64 [ERROR_WORDS]; rank in
        the EP group; timeout_ns bounds every wait of the kernels."""
        from dep_ep.comm.kernels.host_params import HostParams
        from dep_ep.comm.kernels.launch_args import RankControl, SymmetricRegions

        offsets = {name: r.offset for name, r in buffers.layout.regions.items()}
        self.regions = HostParams.of(
            SymmetricRegions(
                buffers.peer_addresses.data_ptr(),
                buffers.base_address,
                offsets["x"],
                offsets["sf"],
                offsets["ids"],
                offsets["weights"],
                offsets["out"],
                offsets["flags"],
            )
        )
        self.control = HostParams.of(
            RankControl(state.data_ptr(), error.data_ptr(), rank, timeout_ns)
        )
