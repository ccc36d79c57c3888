"""HopperEngine: what HopperExperts runs its GEMMs with (TritonEngine, HummingEngine), and the
pair counts both size their work by."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Callable, ClassVar

import torch

from dep_ep.checks import check_int, check_positive_int, check_real
from dep_ep.experts.base import check_call_size
from dep_ep.experts.hopper.grouping import pair_capacity
from dep_ep.experts.hopper.tiles import HopperTiles
from dep_ep.experts.weights import ExpertWeights

# group_pairs' tensors per (row, k) slot: int64 key, order and position (and the sort's scratch
# of about two more), int32 pair lists and slot map.
GROUPING_BYTES_PER_SLOT = 64
# pair_budget's defaults. SKEW: the budget is this multiple of the pairs a rank receives on average
# (R * K * E_local / E). Under "hot" routing (one expert every token's first choice) the hot
# expert's rank receives R * (1 + (K - 1)(E_local - 1)/(E - 1)) pairs: 1.92x the mean at K3 on 16
# ranks; under synthetic "zipf" routing the busiest of 16 ranks received 1.6-2.2x the mean
# (dep_ep.testing.synthetic). LEAST: a budget below this many pairs is not worth its overflow risk
# (54 MB of the triton engine's act and y at K3): small calls keep their capacity R * K.
PAIR_BUDGET_SKEW = 2.25
PAIR_BUDGET_LEAST = 4096

# A prepared engine: forward's contract on R >= 1 receive rows (x, sf, ids, weights, out),
# returning out; HopperExperts calls it with the weights' device current.
PreparedCall = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def check_at_least(fn: str, name: str, value: object, least: int) -> int:
    """value as an int: TypeError naming `fn` and `name` for a non-int (a bool included),
    ValueError below `least` (a bound that varies; for 1, dep_ep.checks.check_positive_int)."""
    value = check_int(fn, name, value)
    if value < least:
        raise ValueError(f"{fn}: {name}={value}; expected >= {least}")
    return value


def check_workspace_args(
    fn: str, rows, topk, latent, intermediate, num_local, max_pairs
) -> tuple[int, int, int, int]:
    """(rows, topk, latent, intermediate) as ints, each checked (`check_call_size`; latent and
    intermediate >= 1), and num_local and max_pairs (None, or ints >= 1; max_pairs 0 where rows
    * topk is 0, the budget `pair_budget` gives such a call): the arguments of the engines'
    workspace_parts."""
    rows, topk = check_call_size(fn, rows, topk)
    latent = check_positive_int(fn, "latent", latent)
    intermediate = check_positive_int(fn, "intermediate", intermediate)
    if num_local is not None:
        check_positive_int(fn, "num_local", num_local)
    if max_pairs is not None:  # a call of no slot has a budget of 0 (pair_budget)
        check_at_least(fn, "max_pairs", max_pairs, 1 if rows * topk else 0)
    return rows, topk, latent, intermediate


def tuning_pairs(rows: int, topk: int, num_local: int, num_experts: int | None) -> int:
    """The pair count humming's kernels are tuned for (humming's shape_m): the power of two
    nearest in log2 to the pairs R = rows receive rows are expected to hold, at least 16 (one
    compilation per value). Only speed depends on it: any count of pairs runs correctly.
    Expected pairs: with num_experts, under uniform routing (K of E experts, num_local here, each
    row holding at least one local id); without it (None), the capacity R * K.

    Nearest rather than the next power of two up: on an H200 at K3's shapes the kernel chosen for
    the nearest one was the fastest of humming's tunings for 16..65536 pairs, or within 10%, for
    FC1 and FC2 at T = 1..256 on a DEP16 shard and at T = 16, 256 on a DEP2 shard; the next one
    up took 1.3x at T = 64 (docs/results/bench_humming_tuning.md). TypeError for a non-int;
    ValueError for rows below 0, topk or num_local below 1, num_experts below num_local."""
    rows, topk = check_call_size("tuning_pairs", rows, topk)
    num_local = check_positive_int("tuning_pairs", "num_local", num_local)
    if num_experts is not None:
        check_at_least("tuning_pairs", "num_experts", num_experts, num_local)
    pairs = float(pair_capacity(rows, topk))
    if num_experts is not None:
        share = num_local / num_experts
        some_local = 1.0 - (1.0 - share) ** topk  # a token holds >= 1 local id
        pairs = min(pairs, rows * topk * share / some_local)
    return 1 << max(4, round(math.log2(max(pairs, 1.0))))


def pair_budget(rows: int, topk: int, num_local: int, num_experts: int, skew: float | None) -> int:
    """The most pairs a call over R = rows receive rows of topk ids computes (the rows of its
    pair-sized workspace): skew None, the capacity R * K (a call never overflows); else
    min(R * K, max(PAIR_BUDGET_LEAST, ceil(skew * R * K * num_local / num_experts))), skew times
    the pairs R rows hold on average under uniform routing (K of num_experts experts, num_local of
    them here). A call holding more pairs overflows: HopperExperts writes NaN rows instead.

    The arithmetic at K3 (E = 896, K = 16) on N = 16 ranks (E_local = 56), T = 2048 tokens a rank:
    R = N * T = 32,768 receive rows, capacity R * K = 524,288 pairs (every token choosing 16 of
    this rank's experts); mean R * K * 56 / 896 = 32,768 pairs; hot routing with the hot expert here
    R * (1 + 15 * 55 / 895) = 62,973 pairs; skew 2.25: 73,728 pairs. The triton engine's call then
    takes 13,312 bytes a pair (BF16 act [I] and y [L]) and about 21 a slot (the grouping kernel's
    tables): 0.99 GB (0.92 GiB; `TritonEngine.workspace_bytes`), where the capacity took
    6.99 GB."""
    capacity = pair_capacity(rows, topk)
    if skew is None:
        return capacity
    mean = rows * topk * num_local / num_experts
    return min(capacity, max(PAIR_BUDGET_LEAST, math.ceil(skew * mean)))


def check_skew(owner: str, skew: object) -> float | None:
    """None, or `skew` as a float >= 1 (a finite real number of any kind, `check_real`'s: NumPy's
    and 0-dim torch numbers included; bools refused); TypeError or ValueError naming `owner`."""
    if skew is None:
        return None
    try:
        value = check_real(owner, "pair_skew", skew)
    except TypeError:
        raise TypeError(f"{owner}: pair_skew={skew!r}; expected None or a number >= 1") from None
    if not 1.0 <= value < math.inf:
        raise ValueError(f"{owner}: pair_skew={skew!r}; expected None or a finite number >= 1")
    return value


def check_tiles(owner: str, tiles: object) -> None:
    """TypeError naming `owner` unless `tiles` is a HopperTiles."""
    if not isinstance(tiles, HopperTiles):
        raise TypeError(f"{owner}: tiles is {type(tiles).__name__}; expected HopperTiles")


class HopperEngine(ABC):
    """How HopperExperts computes its experts on SM90. An engine is a frozen value of options
    (one engine may serve every layer); `prepare` makes one layer's state from its weights.

    Subclasses (frozen dataclasses) hold `tiles: HopperTiles` and say:
      name               "triton" or "humming"; str(engine) gives it (reports, labels)
      activation_format  FC2's input (ExpertsBackend.activation_format): "bf16" or "mxfp8"
      deterministic      True when reruns on the same rows are bitwise equal
      takes_pair_budget  True when a call can be sized for a pair budget (HopperExperts'
                         pair_skew): both engines
    """

    name: ClassVar[str]
    activation_format: ClassVar[str]
    # Whether a call can be sized for a pair budget below its capacity (`pair_budget`).
    takes_pair_budget: ClassVar[bool] = False
    tiles: HopperTiles
    deterministic: bool

    def __str__(self) -> str:
        return self.name

    def check(self, owner: str, weights: ExpertWeights) -> None:
        """ValueError naming the option unless the engine's tiles suit the weights' L and I.
        HopperExperts calls it before the device check, so mistakes show on any machine."""
        self.tiles.check(weights.latent, weights.intermediate)

    def tuning_pairs(self, rows: int, topk: int, num_local: int, num_experts: int) -> int:
        """The pair count the engine's kernels are chosen for on R = rows receive rows (only
        HummingEngine chooses by it): `tuning_pairs(rows, topk, num_local, num_experts)`."""
        return tuning_pairs(rows, topk, num_local, num_experts)

    @abstractmethod
    def workspace_parts(
        self,
        rows: int,
        topk: int,
        latent: int,
        intermediate: int,
        *,
        num_local: int | None = None,
        max_pairs: int | None = None,
    ) -> dict[str, int]:
        """The bytes of each tensor one call allocates (from torch's caching allocator), by name,
        for R = rows receive rows with topk ids each over num_local experts, at the pair budget
        max_pairs (`pair_budget`; None: the capacity R * K). Each engine says how exact it is
        (and may take more keywords); the prepared call's `workspace_parts` knows the call's
        tiles and budget."""

    def workspace_bytes(
        self, rows: int, topk: int, latent: int, intermediate: int, **options
    ) -> int:
        """The sum of `workspace_parts` (same arguments)."""
        return sum(self.workspace_parts(rows, topk, latent, intermediate, **options).values())

    @abstractmethod
    def prepare(
        self, owner: str, weights: ExpertWeights, sms: int, skew: float | None = None
    ) -> PreparedCall:
        """The engine's state for `weights` on their (SM90) device of `sms` SMs, as a callable
        with forward's contract, `max_pairs(rows, topk)` (the pairs a call is sized for:
        `pair_budget` with `skew`), `workspace_parts(rows, topk)` (the bytes of each tensor a
        call allocates, by name) and `pairs_over_budget` (int32 [1] on the device, 0 or the
        largest pair count of a call over its budget); errors name `owner`. An engine that takes no
        pair budget (takes_pair_budget False) refuses a skew with ValueError."""
