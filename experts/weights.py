"""ExpertWeights: one rank's routed experts in the checkpoint layout, validated once; every
backend takes one."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from dep_ep.checks import check_int
from dep_ep.constants import MAX_EXPERTS, SCALE_BLOCK

TENSORS = ("w13", "s13", "w2", "s2")


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """The MXFP4 weights of experts [first_expert, first_expert + E_local) of a model of
    num_experts (E) experts, in the checkpoint layout (docs/formats.md), checked once here.

    w13 uint8 [E_local, 2I, L/2]  FC1 rows [w1 (gate); w3 (up)], two E2M1 codes a byte (low
                                  nibble first, docs/formats.md "MXFP4")
    s13 uint8 [E_local, 2I, L/32] their E8M0 scale bytes, one per 32 elements along L
    w2  uint8 [E_local, L, I/2]   FC2 (down) rows, codes likewise
    s2  uint8 [E_local, L, I/32]  their E8M0 scale bytes
    first_expert                  global id of local expert 0, an int >= 0
    num_experts                   E, the model's total, an int >= first_expert + E_local (at most
                                  2^31: ids are int32). No default: TrtllmExperts' routing and
                                  HopperExperts' kernel choice read it, and the model's E is the
                                  one value that is right for both.

    Rules (TypeError for a type or dtype, ValueError for the rest, each naming the field): the
    four are dense (strided) torch tensors of dtype uint8, 3-D, of the shapes above for the
    E_local, L and I that w13 gives, with E_local >= 1 and L and I positive multiples of 32, all
    on one device that holds data (not "meta").

    The tensors are the caller's, neither copied nor changed; a backend prepares its own layout
    from them at construction (docs/experts.md says which keep them). `to(device)` moves all four.
    """

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    _: KW_ONLY
    first_expert: int
    num_experts: int

    def __post_init__(self) -> None:
        fn = "ExpertWeights"
        tensors = {name: getattr(self, name) for name in TENSORS}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{fn}: {name} is {type(t).__name__}; expected a torch.Tensor")
            if t.dtype != torch.uint8:
                raise TypeError(
                    f"{fn}: {name} dtype {t.dtype}; expected torch.uint8 (MXFP4 codes or E8M0"
                    " scale bytes)"
                )
            if t.dim() != 3:
                raise ValueError(
                    f"{fn}: {name} shape {tuple(t.shape)}; expected 3-D [E_local, rows, K/2 or"
                    " K/32]"
                )
            if t.layout != torch.strided:
                raise ValueError(
                    f"{fn}: {name} layout {t.layout}; expected torch.strided (a dense tensor:"
                    " call .to_dense())"
                )
        for name in ("first_expert", "num_experts"):  # integers of any kind, kept as int
            object.__setattr__(self, name, check_int(fn, name, getattr(self, name)))
        num_local, two_inter, half_latent = self.w13.shape
        latent, inter = 2 * half_latent, two_inter // 2
        if num_local < 1:
            raise ValueError(
                f"{fn}: w13 shape {tuple(self.w13.shape)} holds no expert; expected E_local >= 1"
            )
        if two_inter % 2 or not (latent and inter) or latent % SCALE_BLOCK or inter % SCALE_BLOCK:
            raise ValueError(
                f"{fn}: w13 shape {tuple(self.w13.shape)} gives L={latent}, 2I={two_inter};"
                f" L and I must be positive multiples of {SCALE_BLOCK}"
            )
        expected = {
            "s13": (num_local, 2 * inter, latent // SCALE_BLOCK),
            "w2": (num_local, latent, inter // 2),
            "s2": (num_local, latent, inter // SCALE_BLOCK),
        }
        for name, shape in expected.items():
            if tuple(tensors[name].shape) != shape:
                raise ValueError(
                    f"{fn}: {name} shape {tuple(tensors[name].shape)}; expected {shape} (E_local,"
                    f" L, I = {num_local}, {latent}, {inter} from w13 {tuple(self.w13.shape)})"
                )
        devices = {name: t.device for name, t in tensors.items()}
        if len(set(devices.values())) != 1:
            where = ", ".join(f"{name} on {device}" for name, device in devices.items())
            raise ValueError(f"{fn}: {where}; expected all four on one device")
        if self.w13.device.type == "meta":
            raise ValueError(
                f"{fn}: the weights are on the meta device (shapes without data); expected a"
                " device that holds them"
            )
        if self.first_expert < 0:
            raise ValueError(f"{fn}: first_expert={self.first_expert}; expected an int >= 0")
        last = self.first_expert + num_local
        if not last <= self.num_experts <= MAX_EXPERTS:
            raise ValueError(
                f"{fn}: num_experts={self.num_experts}; expected >= first_expert + E_local ="
                f" {self.first_expert} + {num_local} = {last} and at most 2^31 (ids are int32)"
            )

    @property
    def num_local_experts(self) -> int:
        """E_local, the experts held."""
        return self.w13.shape[0]

    @property
    def latent(self) -> int:
        """L, FC1's input and FC2's output width."""
        return 2 * self.w13.shape[2]

    @property
    def intermediate(self) -> int:
        """I, the width of SiTU's output (FC1 writes 2I: gate and up)."""
        return self.w13.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.w13.device

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w13, s13, w2, s2)."""
        return self.w13, self.s13, self.w2, self.s2

    def to(self, device: torch.device | str) -> ExpertWeights:
        """The same experts with the four tensors on `device` (torch's `to`: no copy where they
        already are)."""
        moved = (t.to(device) for t in self.tensors)
        return ExpertWeights(*moved, first_expert=self.first_expert, num_experts=self.num_experts)

    def __repr__(self) -> str:
        last = self.first_expert + self.num_local_experts - 1
        return (
            f"ExpertWeights(experts {self.first_expert}..{last} of {self.num_experts},"
            f" L={self.latent}, I={self.intermediate}, {self.device})"
        )


def expect_expert_weights(fn: str, weights: object) -> ExpertWeights:
    """`weights`, or TypeError naming `fn` unless it is an ExpertWeights (backends take one, not
    the four tensors)."""
    if not isinstance(weights, ExpertWeights):
        raise TypeError(
            f"{fn}: weights is {type(weights).__name__}; expected an ExpertWeights (dep_ep.experts."
            "ExpertWeights(w13, s13, w2, s2, first_expert=, num_experts=))"
        )
    return weights
