"""Validation of the checkpoint-layout MXFP4 expert weights every backend takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dep_ep.experts.mxfp4 import SCALE_BLOCK


@dataclass(frozen=True)
class ExpertWeightGeometry:
    """num_local experts of width `latent` (L) and intermediate size `intermediate` (I)."""

    num_local: int
    latent: int
    intermediate: int
    device: torch.device


def _check(owner: str, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.uint8:
        raise TypeError(f"{owner}: {name} dtype {t.dtype}; expected torch.uint8")
    if tuple(t.shape) != shape:
        raise ValueError(f"{owner}: {name} shape {tuple(t.shape)}; expected {shape}")


def check_expert_weights(
    owner: str,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    first_expert: int,
) -> ExpertWeightGeometry:
    """Check the checkpoint layout and return its geometry; errors name `owner` and the tensor.

    w13 uint8 [E_local, 2I, L/2]: rows [w1 (gate); w3 (up)], two E2M1 codes per byte (low nibble
    first); s13 uint8 [E_local, 2I, L/32]; w2 uint8 [E_local, L, I/2]; s2 uint8 [E_local, L, I/32]
    (E8M0 scale bytes), E_local >= 1, L and I positive multiples of 32, on one device that holds
    data (not "meta"); first_expert: an int >= 0, the global id of local expert 0.
    """
    for name, t in (("w13", w13), ("s13", s13), ("w2", w2), ("s2", s2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{owner}: {name} is {type(t).__name__}; expected a torch.Tensor")
    if isinstance(first_expert, bool) or not isinstance(first_expert, int):
        raise TypeError(f"{owner}: first_expert={first_expert!r}; expected an int")
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"{owner}: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be 3-D"
            " [E_local, rows, K/2]"
        )
    num_local, two_i, half_latent = w13.shape
    latent, intermediate = half_latent * 2, two_i // 2
    if two_i % 2 or latent % SCALE_BLOCK or intermediate % SCALE_BLOCK or not latent * intermediate:
        raise ValueError(
            f"{owner}: w13 shape {tuple(w13.shape)} gives L={latent}, I={intermediate};"
            f" both must be positive multiples of {SCALE_BLOCK}"
        )
    if num_local < 1:
        raise ValueError(f"{owner}: w13 shape {tuple(w13.shape)} holds no expert")
    _check(owner, "w13", w13, (num_local, 2 * intermediate, latent // 2))
    _check(owner, "s13", s13, (num_local, 2 * intermediate, latent // SCALE_BLOCK))
    _check(owner, "w2", w2, (num_local, latent, intermediate // 2))
    _check(owner, "s2", s2, (num_local, latent, intermediate // SCALE_BLOCK))
    devices = {t.device for t in (w13, s13, w2, s2)}
    if len(devices) != 1:
        raise ValueError(f"{owner}: weights on several devices {sorted(map(str, devices))}")
    if w13.device.type == "meta":
        raise ValueError(f"{owner}: the weights are on the meta device (shapes without data)")
    if first_expert < 0:
        raise ValueError(f"{owner}: first_expert={first_expert} must be >= 0")
    return ExpertWeightGeometry(num_local, latent, intermediate, w13.device)


def check_num_experts(owner: str, num_experts: object, least: int) -> None:
    """TypeError / ValueError unless num_experts is an int (not a bool) >= least (first_expert +
    the local experts)."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int):
        raise TypeError(f"{owner}: num_experts={num_experts!r}; expected an int")
    if num_experts < least:
        raise ValueError(f"{owner}: num_experts={num_experts}; expected >= first_expert + local"
                         f" experts = {least}")  # fmt: skip
