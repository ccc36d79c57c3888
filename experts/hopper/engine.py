"""HopperEngine: what HopperExperts runs its GEMMs with (TritonEngine, HummingEngine), and the
pair counts both size their work by."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Callable, ClassVar

import torch

from dep_ep.experts.hopper.grouping import pair_capacity
from dep_ep.experts.hopper.tiles import HopperTiles
from dep_ep.experts.weights import ExpertWeights

# group_pairs' tensors per (row, k) slot: int64 key, order and position (and the sort's scratch
# of about two more), int32 pair lists and slot map.
GROUPING_BYTES_PER_SLOT = 64

# A prepared engine: forward's contract on R >= 1 receive rows (x, sf, ids, weights, out),
# returning out; HopperExperts calls it with the weights' device current.
PreparedCall = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def tuning_pairs(rows: int, topk: int, num_local: int, num_experts: int | None) -> int:
    """The pair count humming's kernels are tuned for (humming's shape_m): the power of two
    nearest in log2 to the pairs R = rows receive rows are expected to hold, at least 16 (one
    compilation per value). Only speed depends on it: any count of pairs runs correctly.
    Expected pairs: with num_experts, under uniform routing (K of E experts, num_local here, each
    row holding at least one local id); without it (None), the capacity R * K.

    Nearest rather than the next power of two up: on an H200 at K3's shapes the kernel chosen for
    the nearest one was the fastest of humming's tunings for 16..65536 pairs, or within 10%, for
    FC1 and FC2 at T = 1..256 on a DEP16 shard and at T = 16, 256 on a DEP2 shard; the next one
    up took 1.3x at T = 64 (docs/results/bench_humming_tuning.md)."""
    pairs = float(pair_capacity(rows, topk))
    if num_experts is not None:
        share = num_local / num_experts
        some_local = 1.0 - (1.0 - share) ** topk  # a token holds >= 1 local id
        pairs = min(pairs, rows * topk * share / some_local)
    return 1 << max(4, round(math.log2(max(pairs, 1.0))))


def check_flag(owner: str, name: str, value: object) -> None:
    """TypeError naming `owner` and the option unless `value` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name}={value!r}; expected a bool")


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
    """

    name: ClassVar[str]
    activation_format: ClassVar[str]
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
    def workspace_bytes(self, rows: int, topk: int, latent: int, intermediate: int) -> int:
        """About the bytes one call allocates (from torch's caching allocator) for R = rows
        receive rows with topk ids each, at the pair capacity R * K."""

    @abstractmethod
    def prepare(self, owner: str, weights: ExpertWeights, sms: int) -> PreparedCall:
        """The engine's state for `weights` on their (SM90) device of `sms` SMs, as a callable
        with forward's contract; errors name `owner`."""
