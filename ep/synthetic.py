"""Deterministic synthetic layer weights: every rank builds any expert from (seed, expert id)
alone, so tests and examples need no checkpoint and no weight exchange."""

from __future__ import annotations

import math

import torch

from dep_ep.config import SCALE_BLOCK, MoeGeometry

_E2M1_RMS = math.sqrt(8.5625)  # rms of the E2M1 magnitudes over uniformly random codes


def _scale_byte(fan_in: int) -> int:
    """E8M0 byte giving weights of rms ~ 1/sqrt(fan_in) from uniformly random E2M1 codes."""
    return 127 + round(math.log2(1.0 / (math.sqrt(fan_in) * _E2M1_RMS)))


class SyntheticLayer:
    """Random MXFP4 experts (checkpoint layout), router and norm weights of one MoE layer.

    expert(e) -> (w13 uint8 [2I, L/2], s13 uint8 [2I, L/32], w2 uint8 [L, I/2], s2 uint8
    [L, I/32]); local(first, count) stacks experts [first, first+count) along a new dim 0.
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
