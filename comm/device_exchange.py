"""DeviceExchange: the GPU side of dispatch and combine for one EpBuffers.

Compiles the CuTeDSL kernels once (at construction, before any graph capture; T is a runtime
argument, so no compile per token count), keeps the device state (expected arrival counts per
source, the abort word) and the host-mapped error record, and launches on the current stream.
No host synchronisation and no memset between calls: every launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from comm.buffers import EpBuffers
from comm.errors import EpTimeoutError
from launch.nvshmem import GPU_EXTRA

PHASE_NAMES = {1: "dispatch", 2: "combine"}
MAX_RANKS = 32  # destination sets are 32-bit masks in the kernels
MAX_TOPK = 128  # dispatch writes a token's ids with one thread per k (128 threads)
CTAS_PER_SM = 8  # dispatch grid: enough 128-thread CTAs to keep loads in flight
COMBINE_TOKENS_PER_CTA = 8  # combine: one warp per token in the reduce phase, 8 warps
# From this T on, combine runs as two launches (send, then reduce over T/8 CTAs) instead of one
# co-resident launch, where that was measured faster (docs/perf_notes.md, v6): at EP=1 from
# T = 1024 on (T = 4096: 56 against 77 us); at EP=2 the one launch stayed as fast or faster
# (T = 4096: 130 against 135 us), so with several ranks the split is off until measured at EP=8.
COMBINE_SPLIT_MIN_TOKENS = {1: 1024}  # num_ranks -> T; ranks not listed: never split
NEVER = 1 << 62


def import_cute():
    try:
        import cuda.bindings.driver as cuda
        import cutlass
        import cutlass.cute as cute
    except ImportError as err:
        raise ImportError(f"the GPU kernels need CuTeDSL: {GPU_EXTRA}") from err
    return cuda, cutlass, cute


COMBINE_MODES = {"combine": "fused", "combine_send": "send", "combine_reduce": "reduce"}
KERNEL_NAMES = ("dispatch", *COMBINE_MODES)
SPLIT_COMBINE = ("combine_send", "combine_reduce")


def compile_kernels(
    num_ranks: int,
    latent: int,
    topk: int,
    experts_per_rank: int,
    arch: str | None = None,
    keep_ptx_dir: str | None = None,
    names: tuple[str, ...] = KERNEL_NAMES,
) -> dict:
    """Compile the kernels `names` (of KERNEL_NAMES) for one geometry. `arch` (e.g.
    "sm_90a", "sm_100a") compiles for that GPU without needing one; `keep_ptx_dir` keeps the PTX.
    Returns {name: compiled function}."""
    cuda, cutlass, cute = import_cute()
    from cutlass import Float32, Int32, Int64

    from comm.kernels.combine import CombineKernel
    from comm.kernels.dispatch import DispatchKernel

    options = []
    if arch:
        options.append(f"--gpu-arch {arch}")
    if keep_ptx_dir:
        options += ["--keep-ptx", f"--dump-dir {keep_ptx_dir}"]
    kw = {"options": " ".join(options)} if options else {}
    z, one, stream = Int64(0), Int32(1), cuda.CUstream(0)
    kernels = {}
    for name in names:
        if name == "dispatch":
            kernels[name] = cute.compile(
                DispatchKernel(num_ranks, latent, topk, experts_per_rank),
                *([z] * 12),
                one,
                Int32(0),
                z,
                one,
                stream,
                **kw,
            )
        else:
            combine = CombineKernel(num_ranks, latent, topk, experts_per_rank, COMBINE_MODES[name])
            kernels[name] = cute.compile(
                combine, *([z] * 11), Float32(1e-5), one, Int32(0), z, one, stream, **kw
            )
    return kernels  # fmt: skip


class DeviceExchange:
    """Launch wrappers over one CUDA EpBuffers (see docs/design.md for the protocol)."""

    def __init__(self, buffers: EpBuffers, experts_per_rank: int, timeout_s: float):
        layout = buffers.layout
        if layout.num_ranks > MAX_RANKS or layout.topk > MAX_TOPK:
            raise ValueError(
                f"EpRouted: the GPU kernels take at most {MAX_RANKS} ranks and topk {MAX_TOPK};"
                f" got {layout.num_ranks} ranks, topk {layout.topk}"
            )
        if not 0 < timeout_s < 1e9:
            raise ValueError(f"EpRouted: timeout_s={timeout_s} must be in (0, 1e9)")
        self.cuda, _, _ = import_cute()
        self.buffers = buffers
        self.num_ranks, self.rank, self.device = buffers.num_ranks, buffers.rank, buffers.device
        self.experts_per_rank = experts_per_rank
        self.timeout_ns = int(timeout_s * 1e9)
        regions = layout.regions
        self.offsets = {name: r.offset for name, r in regions.items()}
        self.sig_dispatch = regions["signals"].offset
        self.sig_combine = regions["signals"].offset + 8 * layout.num_ranks
        # int64 [2N + 1]: expected dispatch rows per source, expected combine rows, abort word.
        self.state = torch.zeros(2 * layout.num_ranks + 1, dtype=torch.int64, device=self.device)
        # int64 [4] host-mapped: [status (2 = recorded), phase, peer, rank] of the first timeout.
        self.error = torch.zeros(4, dtype=torch.int64).pin_memory()
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.max_ctas = CTAS_PER_SM * self.num_sms
        self.kernels = self._compile(("dispatch", "combine"))
        self._split_min_tokens = NEVER
        self.combine_split_min_tokens = COMBINE_SPLIT_MIN_TOKENS.get(self.num_ranks, NEVER)
        self.own = buffers.base_address
        self.peers = buffers.peer_addresses.data_ptr()

    def _compile(self, names: tuple[str, ...]) -> dict:
        layout = self.buffers.layout
        return compile_kernels(layout.num_ranks, layout.latent, layout.topk,
                               self.experts_per_rank, names=names)  # fmt: skip

    @property
    def combine_split_min_tokens(self) -> int:
        """T from which combine takes two launches (NEVER: always one)."""
        return self._split_min_tokens

    @combine_split_min_tokens.setter
    def combine_split_min_tokens(self, tokens: int) -> None:
        """Tests and benchmarks set it to force a path; the two-launch kernels are compiled the
        first time a reachable T asks for them (here, on the host: set it before any capture)."""
        if tokens < NEVER and SPLIT_COMBINE[0] not in self.kernels:
            self.kernels.update(self._compile(SPLIT_COMBINE))
        self._split_min_tokens = tokens

    def _stream(self):
        return self.cuda.CUstream(torch.cuda.current_stream(self.device).cuda_stream)

    def check(self) -> None:
        """Raise EpTimeoutError if a kernel recorded a timeout (host-mapped memory: no sync)."""
        if int(self.error[0]) == 2:
            phase, peer, rank = (int(v) for v in self.error[1:4])
            raise EpTimeoutError(rank, PHASE_NAMES.get(phase, str(phase)), f"rank {peer}",
                                 "recorded by the GPU kernel; rebuild the buffers")  # fmt: skip

    def reset_counters(self) -> None:
        """Zero this rank's arrival counters and expectations (and the abort word). Only when no
        kernel of this EP group is queued or running and every rank resets (benchmarks, tests)."""
        torch.cuda.synchronize(self.device)
        self.buffers.signals.zero_()
        self.state.zero_()
        torch.cuda.synchronize(self.device)

    def dispatch(self, latent: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """latent bf16 [T, L], ids int32 [T, K], weights fp32 [T, K], contiguous, on the device."""
        tokens = latent.shape[0]
        o = self.offsets
        self.kernels["dispatch"](
            latent.data_ptr(), ids.data_ptr(), weights.data_ptr(), self.peers, self.own,
            self.state.data_ptr(), self.error.data_ptr(), o["x"], o["sf"], o["ids"], o["weights"],
            self.sig_dispatch, tokens, self.rank, self.timeout_ns, min(tokens, self.max_ctas),
            self._stream(),
        )  # fmt: skip

    def combine(self, expert_out: torch.Tensor, ids: torch.Tensor, norm_weight: torch.Tensor,
                eps: float, normed: torch.Tensor) -> None:  # fmt: skip
        """expert_out bf16 [N*T, L] (rows with a local id), ids int32 [T, K] as dispatched,
        norm_weight bf16 [L]; writes normed bf16 [T, L]."""
        tokens = ids.shape[0]
        o = self.offsets
        args = (
            expert_out.data_ptr(), self.own + o["ids"], ids.data_ptr(), norm_weight.data_ptr(),
            normed.data_ptr(), self.peers, self.own, self.state.data_ptr(), self.error.data_ptr(),
            o["partials"], self.sig_combine, eps, tokens, self.rank, self.timeout_ns,
        )  # fmt: skip
        if tokens >= self.combine_split_min_tokens:
            send_grid = min(tokens * self.num_ranks, self.max_ctas)
            self.kernels["combine_send"](*args, send_grid, self._stream())
            reduce_grid = -(-tokens // COMBINE_TOKENS_PER_CTA)
            self.kernels["combine_reduce"](*args, reduce_grid, self._stream())
            return
        # The fused kernel waits inside: its grid must be co-resident (<= one CTA per SM).
        wanted = max(tokens * self.num_ranks, -(-tokens // COMBINE_TOKENS_PER_CTA))
        self.kernels["combine"](*args, min(wanted, self.num_sms), self._stream())
