"""Model geometry of one MoE layer, and the named presets."""

from __future__ import annotations

from dataclasses import dataclass

SCALE_BLOCK = 32


@dataclass(frozen=True)
class MoeGeometry:
    """hidden: model width (router input); latent: routed-expert width L (dispatch payload);
    experts: E routed experts; topk: K per token; intermediate: I of each expert."""

    name: str
    hidden: int
    latent: int
    experts: int
    topk: int
    intermediate: int

    def __post_init__(self) -> None:
        for field in ("hidden", "latent", "experts", "topk", "intermediate"):
            if getattr(self, field) < 1:
                raise ValueError(f"MoeGeometry {self.name}: {field} must be >= 1")
        for field in ("latent", "intermediate"):
            if getattr(self, field) % SCALE_BLOCK:
                raise ValueError(
                    f"MoeGeometry {self.name}: {field}={getattr(self, field)} must be a multiple"
                    f" of {SCALE_BLOCK}"
                )
        if self.topk > self.experts:
            raise ValueError(f"MoeGeometry {self.name}: topk={self.topk} > experts={self.experts}")


# Kimi K3's MoE layer (FACTS.md: text_config of moonshotai/Kimi-K3).
K3 = MoeGeometry("k3", hidden=7168, latent=3584, experts=896, topk=16, intermediate=3072)
# Small enough for 4 CPU ranks in seconds; 48 experts divide over 1, 2, 3, 4, 6, 8, 12, 16 ranks.
TINY = MoeGeometry("tiny", hidden=512, latent=256, experts=48, topk=6, intermediate=128)

PRESETS = {g.name: g for g in (K3, TINY)}
