"""Deterministic synthetic layer weights: every rank builds any expert from (seed, expert id)
alone, so tests and examples need no checkpoint and no weight exchange. And synthetic routing
(`synthetic_ids`): uniform, Zipf-skewed, or one hot expert, for benchmarks of skew."""

from __future__ import annotations

import math

import torch

from dep_ep.checks import check_int, check_int_in
from dep_ep.config import MoeGeometry
from dep_ep.constants import SCALE_BLOCK
from dep_ep.experts.weights import ExpertWeights

_E2M1_RMS = math.sqrt(8.5625)  # rms of the E2M1 magnitudes over uniformly random codes

ROUTINGS = ("uniform", "zipf", "hot")
# "zipf": the i-th most popular expert is drawn with weight 1 / (i + 1)^ZIPF_EXPONENT. At 1.0 over
# 896 experts with top-16 (4096 tokens): the most popular expert is in 92% of the tokens, the
# median one in 0.6%; over 16 ranks the busiest receives 1.6-2.2x the mean of the (row, id) pairs
# (popularity seeds 0..5; 1.77x with seed 0).
ZIPF_EXPONENT = 1.0


def _scale_byte(fan_in: int) -> int:
    """E8M0 byte giving weights of rms ~ 1/sqrt(fan_in) from uniformly random E2M1 codes."""
    return 127 + round(math.log2(1.0 / (math.sqrt(fan_in) * _E2M1_RMS)))


class SyntheticLayer:
    """Random MXFP4 experts (checkpoint layout), router and norm weights of one MoE layer.

    expert(e) -> (w13 uint8 [2I, L/2], s13 uint8 [2I, L/32], w2 uint8 [L, I/2], s2 uint8
    [L, I/32]); local(first, count) stacks experts [first, first+count) along a new dim 0;
    local_weights(first, count) is that as the ExpertWeights the backends take.
    """

    def __init__(self, geometry: MoeGeometry, seed: int, device: torch.device | str = "cpu"):
        self.geometry, self.seed, self.device = geometry, seed, torch.device(device)

    def _generator(self, stream: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed * 1_000_003 + stream)
        return gen

    def _bytes(self, gen: torch.Generator, shape: tuple[int, ...], low: int, high: int):
        return torch.randint(low, high, shape, generator=gen, device=self.device, dtype=torch.uint8)

    def expert(self, expert: int) -> tuple[torch.Tensor, ...]:
        g = self.geometry
        if not 0 <= expert < g.experts:
            raise ValueError(f"SyntheticLayer.expert: expert={expert} outside 0..{g.experts - 1}")
        gen = self._generator(expert)
        s_in, s_mid = _scale_byte(g.latent), _scale_byte(g.intermediate)
        w13 = self._bytes(gen, (2 * g.intermediate, g.latent // 2), 0, 256)
        s13 = self._bytes(gen, (2 * g.intermediate, g.latent // SCALE_BLOCK), s_in - 1, s_in + 2)
        w2 = self._bytes(gen, (g.latent, g.intermediate // 2), 0, 256)
        s2 = self._bytes(gen, (g.latent, g.intermediate // SCALE_BLOCK), s_mid - 1, s_mid + 2)
        return w13, s13, w2, s2

    def local(self, first: int, count: int) -> tuple[torch.Tensor, ...]:
        parts = [self.expert(e) for e in range(first, first + count)]
        return tuple(torch.stack(ts) for ts in zip(*parts))

    def local_weights(self, first: int, count: int) -> ExpertWeights:
        """`local(first, count)` as an ExpertWeights of the geometry's E experts, on the layer's
        device (`.to(device)` moves it)."""
        w13, s13, w2, s2 = self.local(first, count)
        return ExpertWeights(
            w13, s13, w2, s2, first_expert=first, num_experts=self.geometry.experts
        )

    def norm_weight(self) -> torch.Tensor:
        """bf16 [L] around 1."""
        gen = self._generator(-1)
        w = 1.0 + 0.1 * torch.randn(self.geometry.latent, generator=gen, device=self.device)
        return w.to(torch.bfloat16)

    def router(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_weight bf16 [E, H], e_score_correction_bias fp32 [E])."""
        g, gen = self.geometry, self._generator(-2)
        gate = torch.randn(g.experts, g.hidden, generator=gen, device=self.device) / g.hidden**0.5
        bias = 0.01 * torch.randn(g.experts, generator=gen, device=self.device)
        return gate.to(torch.bfloat16), bias


def synthetic_ids(
    tokens: int,
    num_experts: int,
    topk: int,
    routing: str,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
    popularity_seed: int = 0,
) -> torch.Tensor:
    """int32 [tokens, topk] expert ids, distinct within a token, drawn with `generator` (on
    `device`, the generator's device):

    "uniform"  topk of num_experts uniformly at random;
    "zipf"     without replacement, expert weights 1 / (i + 1)^ZIPF_EXPONENT for the i-th of a
               permutation of the experts drawn from `popularity_seed` (the same popular experts
               on every rank that passes the same seed; they land on random ranks);
    "hot"      column 0 is expert 0 for every token (one expert receives every token's first
               choice), the other topk - 1 uniformly among the rest.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"synthetic_ids: routing={routing!r}; expected one of {ROUTINGS}")
    tokens = check_int_in("synthetic_ids", "tokens", tokens, 0)
    num_experts = check_int_in("synthetic_ids", "num_experts", num_experts, 1)
    topk = check_int_in("synthetic_ids", "topk", topk, 1)
    if topk > num_experts:
        raise ValueError(f"synthetic_ids: topk={topk} > num_experts={num_experts}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"synthetic_ids: generator is {type(generator).__name__}; expected a"
            " torch.Generator (the draws must be reproducible)"
        )
    popularity_seed = check_int("synthetic_ids", "popularity_seed", popularity_seed)
    if routing == "uniform":
        scores = torch.rand(tokens, num_experts, generator=generator, device=device)
        return scores.argsort(dim=1)[:, :topk].int()
    if routing == "hot":
        scores = torch.rand(tokens, num_experts - 1, generator=generator, device=device)
        rest = scores.argsort(dim=1)[:, : topk - 1] + 1  # experts 1..E-1
        first = torch.zeros(tokens, 1, dtype=rest.dtype, device=device)
        return torch.cat([first, rest], dim=1).int()
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(popularity_seed))
    order = order.to(device)
    popularity = 1.0 / torch.arange(1, num_experts + 1, device=device) ** ZIPF_EXPONENT
    weights = torch.empty(num_experts, device=device)
    weights[order] = popularity
    if tokens == 0:
        return torch.empty(0, topk, dtype=torch.int32, device=device)
    draws = torch.multinomial(
        weights.expand(tokens, num_experts), topk, replacement=False, generator=generator
    )
    return draws.int()
