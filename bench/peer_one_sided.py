"""The peer in bench_dep.py: FlashInfer's NVLink one-sided MoE all-to-all through its public API.

`flashinfer.moe_ep.create_communication(BootstrapConfig, MoEEpCommParams, NVLinkOneSidedConfig)`
returns an `NVLinkOneSidedAlltoAll` (the TensorRT-LLM design: a token's payload written once into
each rank owning one of its experts, a pull-and-sum combine, programmatic dependent launch). It
runs here on its fence transport (`cft=False, lamport=False`: the other two need SM100) with
`dispatch_format=QuantFormat.MXFP8`, so that it moves what our dispatch moves: each token's
MXFP8 row (L e4m3 bytes), its L/32 UE8M0 scale bytes, K int32 ids and K fp32 weights; its combine
sums the BF16 rows [N*T, L] a rank's experts left for each token (no RMSNorm, order not fixed).
Our dispatch quantizes the BF16 latents itself; the peer is handed the bytes of
`dep_ep.comm.mxfp8.mxfp8_quantize` of the same latents, quantized outside the timing.

Memory handles: FlashInfer 0.7.4 shares its workspace through FABRIC handles on one host when
every GPU reports FABRIC support, and has no option to choose. `handles="posix"` (bench_dep's
default) makes every GPU report no FABRIC support (it replaces
`flashinfer.comm.mnnvl._local_fabric_status`), so POSIX file descriptors are used, as on any
single-host NVLink machine without an IMEX service; `handles="auto"` leaves FlashInfer's choice.

NVLink check: FlashInfer 0.7.4 refuses to build the all-to-all on a rank whose NVML does not list
every NVLink of its GPU as up (`MnnvlMemory.supports_mnnvl`). One rank alone moves nothing over
NVLink (its workspace is local memory), and a one-GPU machine may list no NVLink at all, so with
`world == 1` the peer answers that check itself (`_one_rank_nvlink_check`); with two ranks or
more FlashInfer's own check decides.

Its JIT module (`nvlink_one_sided_alltoall`) is built on first use by nvcc: CUDA_HOME must name a
CUDA toolkit with the runtime, cuBLASLt and cuRAND headers, and `-lcuda` must resolve. Every
step that can fail on one rank (import, JIT build, construction) is followed by a vote over the
CPU group, so that a failure on any rank leaves the peer off on every rank with the reason, and
no rank waits alone in a collective.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dep_ep.comm.mxfp8 import mxfp8_quantize

NAME = "FlashInfer one-sided"
HANDLES = ("posix", "auto")


@dataclass
class PeerStep:
    """One step's inputs for the peer (device tensors), made outside the timing.

    payload: uint8 [T, L] e4m3 bytes; scales: uint8 [T, L/32] UE8M0 bytes; ids: int32 [T, K];
    weights: float32 [T, K]; out: bfloat16 [T, L] (the combine's output).
    """

    tokens: int
    payload: torch.Tensor
    scales: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor


def _agreed(error: str | None, cpu_group) -> str | None:
    """None if no rank of `cpu_group` failed; else this rank's error or a line naming a failure
    elsewhere. One all-reduce: every rank gets the same verdict."""
    ok = torch.tensor([0 if error else 1], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=cpu_group)
    if int(ok) == 1:
        return None
    return error or "failed on another rank"


def _last_line(exc: BaseException) -> str:
    lines = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    return lines[-1] if lines else type(exc).__name__


def _one_rank_nvlink_check() -> bool:
    """FlashInfer's NVLink platform check at one rank: True, since no byte leaves the GPU."""
    return True


class OneSidedPeer:
    """FlashInfer's one-sided all-to-all for `world` ranks, sized for `max_tokens` per rank.

    Construct with `OneSidedPeer.create(...)`, which returns (peer or None, reason or None) on
    every rank alike. `dispatch(step)` then `combine(step)` run one step (FlashInfer refuses a
    second dispatch before the combine). `workspace_mib`: its workspace per rank; `path`: the
    transport, handle kind and PDL setting it chose (and, with `one_rank`, that bench_dep
    answered FlashInfer's NVLink check); `construction_s`: import + JIT build/load +
    construction on this rank.
    """

    def __init__(self, comm, construction_s: float, one_rank: bool = False) -> None:
        self._comm = comm
        self.construction_s = construction_s
        index = comm._index.WORKSPACE_SIZE_INDEX  # no public accessor in 0.7.4
        self.workspace_mib = int(comm.metainfo[index]) / 2**20
        kind = "lamport" if comm.lamport_enabled else ("cft" if comm._cft_enabled else "fence")
        fabric = comm._state["mnnvl_mem"].fabric_handles
        self.path = f"{kind}, {'FABRIC' if fabric else 'POSIX-fd'} handles, pdl {comm._enable_pdl}"
        if one_rank:
            self.path += ", NVLink check answered by bench_dep (one rank)"

    @classmethod
    def create(
        cls,
        cpu_group,
        rank: int,
        world: int,
        device: torch.device,
        max_tokens: int,
        *,
        latent: int,
        topk: int,
        experts: int,
        timeout_s: int = 30,
        handles: str = "posix",
    ) -> tuple[OneSidedPeer | None, str | None]:
        """Collective over `cpu_group` (gloo, `world` ranks): (the peer, None), or (None, why not)
        on every rank."""
        if handles not in HANDLES:
            raise ValueError(f"handles must be one of {HANDLES}, got {handles!r}")
        start = time.perf_counter()
        error = None
        try:
            import flashinfer.comm.mnnvl as mnnvl
            from flashinfer.moe_ep.backends.split.comm.nvlink_one_sided.kernels import (
                get_nvlink_one_sided_alltoall_module,
            )

            if handles == "posix":
                mnnvl._local_fabric_status = lambda dev_id: ("FABRIC off (bench_dep)", b"")
            if world == 1:
                mnnvl.MnnvlMemory.supports_mnnvl = staticmethod(_one_rank_nvlink_check)
            get_nvlink_one_sided_alltoall_module()  # the JIT build: one rank builds, one waits
        except Exception as exc:  # any failure turns the peer off, with its reason
            error = f"import/JIT: {_last_line(exc)}"
        error = _agreed(error, cpu_group)
        if error:
            return None, error
        comm = None
        try:
            from flashinfer.fused_moe.api import QuantFormat
            from flashinfer.moe_ep import (
                BootstrapConfig,
                MoEEpCommParams,
                NVLinkOneSidedConfig,
                create_communication,
            )

            params = MoEEpCommParams(
                num_experts=experts,
                top_k=topk,
                max_tokens_per_rank=max_tokens,
                hidden_size=latent,
                dtype=torch.bfloat16,
                dispatch_format=QuantFormat.MXFP8,
            )
            config = NVLinkOneSidedConfig(cft=False, lamport=False, timeout_sec=timeout_s)
            bootstrap = BootstrapConfig(
                world_size=world, rank=rank, device=device.index, process_group=cpu_group
            )
            comm = create_communication(bootstrap, params, config)
        except Exception as exc:
            error = f"create_communication: {_last_line(exc)}"
        error = _agreed(error, cpu_group)
        if error:
            if comm is not None:
                comm.destroy()
            return None, error
        return cls(comm, time.perf_counter() - start, one_rank=world == 1), None

    def step(self, latent: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> PeerStep:
        """The peer's inputs for one step of `latent` bf16 [T, L], `ids` int32 [T, K] (-1: no
        expert), `weights` float32 [T, K]."""
        payload, scales = mxfp8_quantize(latent)
        out = torch.empty_like(latent)
        return PeerStep(
            latent.shape[0],
            payload.contiguous(),
            scales.contiguous(),
            ids.contiguous(),
            weights.contiguous(),
            out,
        )

    def dispatch(self, step: PeerStep) -> None:
        self._comm.dispatch(
            step.payload,
            step.ids,
            step.weights,
            hidden_states_scale=step.scales,
            runtime_max_tokens_per_rank=step.tokens,
        )

    def combine(self, step: PeerStep) -> None:
        self._comm.combine(self._comm.get_combine_input_buffer(torch.bfloat16), output=step.out)

    def close(self) -> None:
        """Free the workspace (after every rank is done with it: the caller synchronizes and
        lines the ranks up first)."""
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
