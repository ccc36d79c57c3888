"""HopperExperts: MXFP4 experts on SM90 over device-grouped pairs, in one of two engines
(experts/hopper/engine.py):

- HummingEngine (the default when humming-kernels 0.1.19 is installed, `pip install -e '.[gpu]'`):
  humming-kernels' GEMMs on e4m3 rows, SiTU rounded to MXFP8 (experts/hopper/humming_engine.py).
- TritonEngine: our own kernels (experts/hopper/kernels.py) with ReferenceExperts' BF16 numerics
  (experts/hopper/triton_engine.py).

The grouping is one launch of experts/hopper/grouping_kernel.py (HopperTiles.grouping
Grouping.TRITON, the default) or experts/hopper/grouping.py's group_pairs and tile_routes in torch
(Grouping.TORCH), the same tensors. Both engines keep the weights at 4 bits and read the receive
rows' MXFP8 bytes as they are (humming reads the E8M0 scales widened to fp32). No host
synchronisation and no launch shape that depends on the data: a call can be captured in a CUDA
graph with the routed path.
"""

from __future__ import annotations

import importlib.util

import torch

from dep_ep.comm.failure import StepFailure
from dep_ep.experts.base import (
    ExpertsBackend,
    check_call_size,
    check_receive_rows,
    cuda_capability_reason,
)
from dep_ep.experts.hopper.engine import PAIR_BUDGET_SKEW, HopperEngine, check_skew
from dep_ep.experts.hopper.humming_engine import HummingEngine, humming_installed
from dep_ep.experts.hopper.tiles import HopperTiles
from dep_ep.experts.hopper.triton_engine import TritonEngine
from dep_ep.experts.weights import ExpertWeights

# HummingEngine is the default where L and I are multiples of this (K3: 3584 = 7 x 512,
# 3072 = 6 x 512); humming has run only at K3's widths.
HUMMING_DEFAULT_MULTIPLE = 512


def default_engine(
    latent: int, intermediate: int, *, tiles: HopperTiles | None = None
) -> HopperEngine:
    """HummingEngine() when the humming-kernels release it wraps (HUMMING_RELEASE) is installed
    and L and I are multiples of HUMMING_DEFAULT_MULTIPLE, else TritonEngine() (another humming
    release is not used: 0.1.12 lacks API the engine calls); with `tiles` (default
    HopperTiles())."""
    tiles = HopperTiles() if tiles is None else tiles
    fits = all(size % HUMMING_DEFAULT_MULTIPLE == 0 for size in (latent, intermediate))
    return HummingEngine(tiles=tiles) if fits and humming_installed() else TritonEngine(tiles=tiles)


class HopperExperts(ExpertsBackend):
    """The rank's MXFP4 experts on an SM90 GPU, from an ExpertWeights (experts/weights.py).

    engine: a HopperEngine, which holds the numerics, its options and the tiles:
      TritonEngine(tiles=): the same numerics as ReferenceExperts up to the order of fp32 sums
        (MXFP8 rows and MXFP4 weights decoded exactly; FC1 with fp32 sums; SiTU in fp32, one
        rounding to BF16; FC2 with fp32 sums, one rounding to BF16; per row the fp32 sum over k in
        order of weight * expert output, one rounding to BF16).
      HummingEngine(deterministic=, tune_for_capacity=, chunk_pairs=, tiles=): e4m3 rows times
        the weights in e4m3 (exact within an expert's 11-binade scale spread, checked at
        construction) with fp32 sums, FC1's output in BF16, SiTU rounded to MXFP8, FC2 rounded
        to BF16, the same finalize; humming may pick stream-K kernels (more roundings, reruns
        not bitwise equal) unless deterministic=True.
      None: `default_engine(L, I)`: HummingEngine() where humming-kernels 0.1.19 is installed
        and L and I are multiples of 512, else TritonEngine().
    The triton engine and the finalize use no atomics and no split K: with them (and humming with
    deterministic=True) reruns on the same rows are bitwise equal (`deterministic`).
    humming's kernels are chosen for `tuning_pairs(rows, topk)`, from the weights' num_experts.

    pair_skew: "auto" (the default): PAIR_BUDGET_SKEW (2.25) on an engine that takes a pair
      budget (both do); None: every call sized for the most pairs its rows can hold, R * K (R
      receive rows of K ids: N * T rows on N ranks), which no routing exceeds; or a number >= 1:
      a call's pair-sized workspace holds P = `pair_budget(R, K, E_local, E, pair_skew)` pairs,
      pair_skew times the pairs R rows hold on average under uniform routing (at least
      PAIR_BUDGET_LEAST, at most R * K), so the memory follows the work rather than the slots
      (hot-expert routing, every token's first choice one expert, holds 1.92x the mean at K3 on
      16 ranks and fits). TritonEngine: BF16 act [P, I] and y [P, L] (K3, 16 ranks, T = 2048,
      2.25: 0.99 GB, where R * K took 6.99 GB). HummingEngine: a call over more than its
      chunk_pairs receive slots runs in chunks, P the budget split into equal chunks rounded up
      to 64 pairs (0.83 GB there, where the slots took 12.0 GB); a smaller call runs on its slots
      and never overflows. A call
      whose rows hold more pairs than P (counted on the device: no host synchronisation,
      graph-capturable) writes NaN into every row with a local id (never a partial sum), and
      raises `pairs_over_budget` to its pair count (`check_pair_budget()` raises it on the
      host). Under
      EpRouted the step fails on every rank (`failure`, below): this rank raises
      EpPairBudgetError naming the pair count, the budget, the step's tag and the fix (raise
      pair_skew), every peer EpPeerError naming this rank; in that call on CPU, at the next
      call, poll() or synchronize() on GPU, where every rank's output of the step is NaN. The
      next step runs as usual (and overflows again under the same routing).
    failure (forward's keyword, from EpRouted; `device_failures` is True with a pair budget):
      a comm.failure.StepFailure through which an overflowing call fails the step on every rank
      (experts/base.py).

    Memory: the triton engine keeps the caller's weights (no copy when contiguous, and then
    `copies_weights` is False: writes into them reach the backend); humming keeps its own
    re-laid-out copy (the same 17.5 MB per K3 expert) and not the caller's. Per call,
    `workspace_bytes` from torch's caching allocator (inside a graph capture, the graph's pool).
    The humming engine compiles its kernels the first time a call's `tuning_pairs` (a power of
    two from the row count) is new (seconds): make one eager call of each row count before
    capturing a graph.

    Attributes beside the contract's: engine, tiles (the engine's), deterministic, num_experts,
    intermediate, device, sms, pair_skew, pairs_over_budget (int32 [1] on the device: 0, or the
    largest pair count of a call over its budget since `check_pair_budget`), prepared (the engine's
    state for these weights: TritonPrepared or HummingPrepared, whose fc1 and fc2 the benchmarks
    time alone).

    Rows without a local id keep whatever `out` held. A NaN or Inf in a row stays within the
    outputs of that row's pairs.
    """

    requires = "an SM90 (Hopper) CUDA GPU and triton (and humming-kernels for HummingEngine)"

    # Built outside inference mode even inside one: check_pair_budget() zeroes the pair record
    # in place, which an inference tensor refuses outside inference mode.
    @torch.inference_mode(False)
    def __init__(
        self,
        weights: ExpertWeights,
        *,
        engine: HopperEngine | None = None,
        pair_skew: float | str | None = "auto",
    ) -> None:
        owner = type(self).__name__
        self._take_weights(weights)
        # Arguments first, the device last: a mistake shows on any machine.
        if engine is None:
            engine = default_engine(weights.latent, weights.intermediate)
        if not isinstance(engine, HopperEngine):
            raise TypeError(
                f"{owner}: engine is {type(engine).__name__}; expected None or a HopperEngine"
                " (TritonEngine(...), HummingEngine(...))"
            )
        engine.check(owner, weights)
        if isinstance(pair_skew, str):  # the default's spelling; check_skew names numbers only
            if pair_skew != "auto":
                raise TypeError(
                    f'{owner}: pair_skew={pair_skew!r}; expected "auto", None or a number >= 1'
                )
            pair_skew = PAIR_BUDGET_SKEW if engine.takes_pair_budget else None
        self.pair_skew = check_skew(owner, pair_skew)
        if self.pair_skew is not None and not engine.takes_pair_budget:
            raise ValueError(
                f"{owner}: pair_skew={pair_skew}; {type(engine).__name__} takes no pair budget"
            )
        self.check_device(weights.device)
        self.engine, self.tiles = engine, engine.tiles
        self.activation_format = engine.activation_format
        self.deterministic = engine.deterministic
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.prepared = engine.prepare(owner, weights, self.sms, self.pair_skew)
        self.pairs_over_budget = self.prepared.pairs_over_budget
        self.copies_weights = self.prepared.copies_weights
        # A call can overflow (and fail its step through forward's `failure`) only under a budget.
        self.device_failures = self.pair_skew is not None

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        reason = cuda_capability_reason(device, 9)
        if reason is not None:
            return reason
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        return None

    def tuning_pairs(self, rows: int, topk: int) -> int:
        """The pair count humming's kernels are chosen for on R = rows receive rows: the prepared
        call's (capped at its plan's tuning_cap in chunks) where it chooses by it, else
        `engine.tuning_pairs(rows, topk, num_local_experts, num_experts)`. TypeError for a
        non-int, ValueError for rows below 0 or topk below 1."""
        rows, topk = check_call_size(f"{type(self).__name__}.tuning_pairs", rows, topk)
        chosen = getattr(self.prepared, "tuning_pairs", None)
        if chosen is not None:
            return chosen(rows, topk)
        return self.engine.tuning_pairs(rows, topk, self.num_local_experts, self.num_experts)

    def max_pairs(self, rows: int, topk: int) -> int:
        """The pairs a call over `rows` receive rows of `topk` ids is sized for, the prepared
        call's, so this and the call agree: `pair_budget(rows, topk, num_local_experts,
        num_experts, pair_skew)` on the triton engine; on humming the capacity rows * topk for a
        call on its slots, the budget rounded up to whole chunks for a call in chunks. TypeError
        for a non-int, ValueError for rows below 0 or topk below 1."""
        rows, topk = check_call_size(f"{type(self).__name__}.max_pairs", rows, topk)
        return self.prepared.max_pairs(rows, topk)

    def workspace_bytes(self, rows: int, topk: int) -> int:
        """Bytes a call over `rows` receive rows with `topk` ids each allocates, at its pair
        budget: the sum of the prepared call's `workspace_parts` (exact with the grouping kernel,
        Grouping.TRITON, the default; with Grouping.TORCH the grouping's temporaries are an
        estimate). TypeError for a non-int, ValueError for rows below 0 or topk below 1."""
        rows, topk = check_call_size(f"{type(self).__name__}.workspace_bytes", rows, topk)
        return sum(self.prepared.workspace_parts(rows, topk).values())

    def check_pair_budget(self) -> None:
        """Blocks the host (reads a device value): RuntimeError when a call since the last check
        held more pairs than its budget (its rows with a local id came out NaN), naming the
        largest pair count of such a call; the record is zeroed either way. Call it on the
        stream that ran forward (or after waiting for it): the read and the zeroing are ordered
        on the current stream. Not inside a CUDA graph capture."""
        over = int(self.pairs_over_budget.item())
        self.pairs_over_budget.zero_()
        if over:
            raise RuntimeError(
                f"HopperExperts: a call held {over} (row, local expert) pairs, more than its pair"
                f" budget (pair_skew={self.pair_skew}; max_pairs(rows, topk)); its rows with a"
                " local id were written as NaN. Raise pair_skew, or None for the capacity"
            )

    def forward(
        self,
        x: torch.Tensor,
        sf: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
        failure: StepFailure | None = None,
    ) -> torch.Tensor:
        check_receive_rows(type(self).__name__, x, sf, ids, weights, out, self.latent, self.device)
        if failure is not None and not isinstance(failure, StepFailure):
            raise TypeError(
                f"{type(self).__name__}.forward: failure is {type(failure).__name__}; expected"
                " None or a StepFailure (EpRouted.step_failure())"
            )
        if ids.shape[0] == 0:
            return out
        with torch.cuda.device(self.device):  # triton and humming launch on the current device
            if failure is None or not self.device_failures:  # no budget: nothing to fail
                return self.prepared(x, sf, ids, weights, out)
            return self.prepared(x, sf, ids, weights, out, failure=failure)
