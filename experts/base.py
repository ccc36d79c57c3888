"""The one interface every experts backend implements for EpRouted."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from dep_ep.checks import check_int, check_tensor
from dep_ep.comm.failure import warmup_failure
from dep_ep.constants import SCALE_BLOCK
from dep_ep.experts.situ import SITU_BETA, SITU_LINEAR_BETA
from dep_ep.experts.weights import ExpertWeights, expect_expert_weights


def check_receive_rows(
    owner: str, x, sf, ids, weights, out, latent: int, device: torch.device | None = None
) -> None:
    """Raise naming `owner`.forward and the argument unless the tensors follow the row contract
    (ExpertsBackend) with R rows of width `latent` on `device` (None: x's device), K >= 1 ids a
    row, contiguous, `out` sharing no byte with an input; ids must be int32 here. A wrong dtype
    or type raises TypeError, a wrong shape, device, layout or an overlap ValueError."""
    fn = f"{owner}.forward"
    # The sizes from x and ids where they are 2-D tensors; check_tensor refuses anything else.
    for name, t, dims in (("x", x, "[R, L]"), ("ids", ids, "[R, K]")):
        if isinstance(t, torch.Tensor) and t.dim() != 2:
            raise ValueError(f"{fn}: {name} shape {tuple(t.shape)}; expected a 2-D {dims}")
    rows = x.shape[0] if isinstance(x, torch.Tensor) else -1
    topk = ids.shape[1] if isinstance(ids, torch.Tensor) else -1
    device = x.device if device is None and isinstance(x, torch.Tensor) else device
    check_tensor(fn, "x", x, (torch.uint8,), (rows, latent), device)
    check_tensor(fn, "sf", sf, (torch.uint8,), (rows, latent // SCALE_BLOCK), device)
    check_tensor(fn, "ids", ids, (torch.int32,), (rows, topk), device)
    if topk == 0:
        raise ValueError(f"{fn}: ids shape {tuple(ids.shape)}; expected topk >= 1 columns")
    check_tensor(fn, "weights", weights, (torch.float32,), (rows, topk), device)
    out_shaped = isinstance(out, torch.Tensor) and out.shape == (rows, latent)
    if out_shaped and out.dtype == torch.bfloat16 and not out.is_contiguous():
        # .contiguous() would make a copy, which the result would not reach.
        raise ValueError(f"{fn}: out must be contiguous (row-major): pass a contiguous tensor")
    check_tensor(fn, "out", out, (torch.bfloat16,), (rows, latent), device)
    # A backend may write rows of `out` while it still reads the inputs (HopperExperts'
    # finalize reads `weights` as it writes: weights inside `out` gave rows up to 4.9 off at
    # outputs of about 5, no error). Every tensor is contiguous here, so its bytes are one interval:
    # 1.7 us a call for the four, where ep/routed.py's byte-span helpers took 15.0 (views of one
    # segment, as EpRouted passes them, timeit on a loaded 2-core CPU).
    first = out.data_ptr()
    end = first + out.numel() * out.element_size()
    for name, t in (("x", x), ("sf", sf), ("ids", ids), ("weights", weights)):
        start = t.data_ptr()
        if t.numel() and start < end and first < start + t.numel() * t.element_size():
            raise ValueError(f"{fn}: out shares memory with {name}; give out a tensor of its own")


def check_call_size(fn: str, rows: object, topk: object) -> tuple[int, int]:
    """(rows, topk) as ints: TypeError naming `fn` for a non-int (a bool included), ValueError
    for rows below 0 or topk below 1 (the sizes every per-row-count question of a backend
    takes: max_pairs, warmup, workspace_bytes, tuning_pairs)."""
    rows, topk = check_int(fn, "rows", rows), check_int(fn, "topk", topk)
    if rows < 0 or topk < 1:
        raise ValueError(f"{fn}: rows={rows}, topk={topk}; expected rows >= 0 and topk >= 1")
    return rows, topk


def cuda_capability_reason(device: torch.device | str, major: int) -> str | None:
    """None when `device` is a CUDA device, CUDA is available and the device has compute
    capability major.x, else why not (a CPU-only torch gets a reason, not torch's
    AssertionError). For the `unsupported_reason`s of backends that need one GPU generation."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device.type} is not a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    found, minor = torch.cuda.get_device_capability(device)
    return None if found == major else f"its compute capability is {found}.{minor}"


class ExpertsBackend(ABC):
    """Routed experts of one rank: global experts [first_expert, first_expert + num_local_experts).

    `forward(x, sf, ids, weights, out)` consumes receive rows (the row contract):
      x uint8 [R, L] MXFP8 e4m3 bytes, sf uint8 [R, L/32] E8M0 bytes (linear layout),
      ids int32 [R, K] global expert ids (-1 = none; ids outside this rank's range are skipped),
      weights fp32 [R, K], out bf16 [R, L] (caller-allocated, sharing no memory with the inputs).
    For every row holding at least one local id it writes out[row] = BF16 of the fp32 sum over k in
    order of weights[row, k] * expert_{ids[row, k]}(x[row]) (each expert output BF16). Rows with no
    local id may hold anything in x/sf/weights; a backend may leave their output or write anything
    there (combine never reads them).

    A backend that can fail a call on the device, where raising would need a host sync
    (HopperExperts over its pair budget), sets `device_failures` True and takes forward's keyword
    `failure`: None (called alone), or a comm.failure.StepFailure from EpRouted, through which it
    fails the step on every rank (its status word and record, comm/failure.py; the combine then
    marks every rank's output of the step NaN on GPU, and every rank raises: this one
    EpPairBudgetError, the peers EpPeerError). EpRouted passes `failure` only to such backends;
    the others (`device_failures` False, the default) take the five arguments alone.
    """

    first_expert: int
    num_local_experts: int
    latent: int
    # True when forward takes `failure=` and may fail a call through it (the class docstring).
    device_failures: bool = False
    # True when the backend computes from its own copy of the weights, made at construction
    # (writes into the ExpertWeights' tensors since do not reach it); False when it reads the
    # caller's tensors in place (HopperExperts' triton engine, given contiguous tensors).
    # EpMoeLayer refuses expert tensors changed after it built such a backend from them.
    copies_weights: bool = True
    # Human-readable hardware the backend needs, for error messages ("any torch device", ...).
    requires: str = "any torch device"
    # Format of FC2's input (the SiTU activation): "bf16", or "mxfp8" (e4m3 elements with one
    # scale per 32), whose rounding dominates the output's error (docs/experts.md).
    activation_format: str = "bf16"

    def _take_weights(self, weights: ExpertWeights) -> ExpertWeights:
        """TypeError naming the backend unless `weights` is an ExpertWeights; else take its
        geometry as the backend's (first_expert, num_local_experts, latent, and beside the
        contract num_experts, intermediate, device) and return it. The tensors are not kept:
        each backend keeps what it prepares from them."""
        expect_expert_weights(type(self).__name__, weights)
        self.first_expert, self.num_local_experts = weights.first_expert, weights.num_local_experts
        self.num_experts = weights.num_experts
        self.latent, self.intermediate = weights.latent, weights.intermediate
        self.device = weights.device
        return weights

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        """None when the backend runs on `device`, else why not (naming the hardware it needs).
        Backends with hardware needs override this; construction calls `check_device`."""
        return None

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        """Raise RuntimeError naming the hardware this backend needs when it cannot run there."""
        reason = cls.unsupported_reason(torch.device(device))
        if reason is not None:
            raise RuntimeError(
                f"{cls.__name__} cannot run on {device}: {reason}; it needs {cls.requires}"
            )

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        sf: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Write the weighted expert sums of the rows with a local id into `out`; return `out`."""

    # The SiTU constants the backend computes with (experts/situ.py): every backend of the
    # library bakes Kimi K3's.
    situ_beta: float = SITU_BETA
    situ_linear_beta: float = SITU_LINEAR_BETA

    def check_situ(self, fn: str, beta: float, linear_beta: float) -> None:
        """ValueError unless (beta, linear_beta), a model's or an engine's SiTU constants, are
        the ones this backend computes with (so a model configured otherwise fails at load
        instead of giving other numbers)."""
        theirs, mine = (float(beta), float(linear_beta)), (self.situ_beta, self.situ_linear_beta)
        if theirs != mine:
            raise ValueError(
                f"{fn}: SiTU beta={theirs[0]}, linear_beta={theirs[1]}; {type(self).__name__}"
                f" computes SiTU with beta={mine[0]}, linear_beta={mine[1]}"
            )

    def max_pairs(self, rows: int, topk: int) -> int:
        """The (row, local expert) pairs a call over `rows` receive rows of `topk` ids is sized
        for: its capacity rows * topk here; a backend with a pair budget (HopperExperts) says
        its own. TypeError for a non-int, ValueError for rows below 0 or topk below 1."""
        rows, topk = check_call_size(f"{type(self).__name__}.max_pairs", rows, topk)
        return rows * topk

    def warmup(self, rows: int, topk: int) -> None:
        """Local: do once, on scratch receive rows, what a call over `rows` receive rows of
        `topk` ids does the first time (a backend that compiles per row count compiles here:
        HopperExperts' humming kernels), so that capturing such a call in a CUDA graph compiles
        nothing. The first min(rows, max_pairs(rows, topk)) scratch rows hold one local id each
        (no more pairs than the call's budget: an overflowing warm-up would set the backend's
        over-budget record), the others none; the outputs are thrown away. A backend whose
        `device_failures` is True is called as EpRouted calls it, with a StepFailure (scratch
        status and record words on the device, written only by an overflow), so that the
        kernels of a call that may fail the step (HopperExperts' finalize with FAIL_STEP)
        compile here too. rows 0 does nothing; TypeError for a non-int, ValueError for rows
        below 0 or topk below 1."""
        rows, topk = check_call_size(f"{type(self).__name__}.warmup", rows, topk)
        if rows == 0:
            return
        on = dict(device=self.device)
        x = torch.zeros(rows, self.latent, dtype=torch.uint8, **on)
        sf = torch.full((rows, self.latent // SCALE_BLOCK), 127, dtype=torch.uint8, **on)
        ids = torch.full((rows, topk), -1, dtype=torch.int32, **on)
        paired = min(rows, self.max_pairs(rows, topk))
        local = torch.arange(paired, dtype=torch.int32, **on) % self.num_local_experts
        ids[:paired, 0] = self.first_expert + local
        weights = torch.ones(rows, topk, dtype=torch.float32, **on)
        out = torch.empty(rows, self.latent, dtype=torch.bfloat16, **on)
        if not self.device_failures:
            self.forward(x, sf, ids, weights, out)
            return
        self.forward(x, sf, ids, weights, out, failure=warmup_failure(self.device))
