"""Edge-case bf16 blocks of 32 values for the MXFP8 quantizers (the torch reference and the GPU
kernel): amax at and around every power-of-two scale step, zeros, subnormals, the bf16 extremes,
spreads over e4m3 subnormals, and random blocks over 120 binades."""

from __future__ import annotations

import torch


def bf16_values(t: torch.Tensor) -> list[float]:
    return [float(v) for v in t.float().tolist()]


def bf16_neighbours(x: float) -> tuple[float, float]:
    t = torch.tensor([x], dtype=torch.bfloat16).view(torch.int16)
    return (float(torch.tensor([t + 1]).view(torch.bfloat16)), float((t - 1).view(torch.bfloat16)))


def edge_blocks() -> list[list[float]]:
    gen = torch.Generator().manual_seed(7)
    blocks = []
    for k in range(-20, 9):
        for amax in (448.0 * 2.0**k, *bf16_neighbours(448.0 * 2.0**k)):
            rest = bf16_values((torch.rand(31, generator=gen) * 2 - 1).bfloat16() * amax)
            blocks.append([amax] + rest)
            blocks.append([-amax] + [-v for v in rest])
    blocks.append([0.0] * 32)
    blocks.append([-0.0] * 32)
    blocks.append([-0.0, 0.0] * 16)
    tiny = [2.0**-133, 2.0**-126, 1e-38, 2.0**-130]  # bf16 subnormals and the smallest normal
    blocks.append([tiny[i % 4] * (1 if i % 3 else -1) for i in range(32)])
    blocks.append([2.0**-133] * 32)
    huge = float(torch.finfo(torch.bfloat16).max)
    blocks.append([huge, -huge] + [1.0] * 30)
    blocks.append([3e38, 1e-3] * 16)
    blocks.append([0.001 * (i + 1) for i in range(32)])  # values spread over e4m3 subnormals
    for _ in range(40):
        scale = 2.0 ** float(torch.randint(-60, 60, (1,), generator=gen))
        blocks.append(bf16_values((torch.randn(32, generator=gen) * scale).bfloat16()))
    return [bf16_values(torch.tensor(b).bfloat16()) for b in blocks]
