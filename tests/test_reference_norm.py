"""The combine's torch reference rounds as the kernel does: its fp32 square root is IEEE's
(sqrt.rn.f32), which torch's own CPU sqrt is not."""

from __future__ import annotations

from decimal import Decimal, getcontext

import numpy as np
import torch

from dep_ep.comm.reference import norm_inverse, sqrt_rn_fp32

getcontext().prec = 60


def nearest_root(x: float, candidates: list[float]) -> float:
    """The candidate nearest the exact square root of x (50 digits; sqrt has no ties)."""
    exact = Decimal(x).sqrt()
    return min(candidates, key=lambda c: abs(Decimal(c) - exact))


def test_sqrt_is_correctly_rounded_on_fresh_inputs():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    exponent = torch.randint(-60, 60, (4000,), generator=gen).float()
    x = (torch.rand(4000, generator=gen) + 1) * torch.exp2(exponent)
    known = torch.tensor([0x4002CAB7], dtype=torch.int32).view(torch.float32)  # torch: 1 ulp off
    x = torch.cat([known, x, torch.tensor([0.0, 1.0, 4.0, 2.0**-100])])
    root = sqrt_rn_fp32(x)
    assert root[0].view(torch.int32).item() == 0x3FB6FB9B
    zero, big = torch.zeros(1), torch.full((1,), float("inf"))
    for xi, ri in zip(x.tolist(), root):
        down, up = torch.nextafter(ri, zero).item(), torch.nextafter(ri, big).item()
        assert ri.item() == nearest_root(xi, [down, ri.item(), up]), (xi, ri.item())


def test_norm_inverse_matches_scalar_ieee_arithmetic():
    """1 / sqrt(s / L + eps) at the sums of squares of constant rows at every BF16 value in
    [0.25, 16) and of fresh random ones, against numpy float32 scalars (IEEE / and +, C's sqrtf,
    correctly rounded). torch.sqrt in sqrt_rn_fp32's place misses a few of these rows."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    latent = 3584
    low, high = (torch.tensor([v]).to(torch.bfloat16).view(torch.int16).item() for v in (0.25, 16))
    values = torch.arange(low, high, dtype=torch.int16).view(torch.bfloat16).float()
    squares = values * values * latent  # exact: 16 significant bits times 7 * 2^9
    random = (torch.rand(2000, generator=gen) * 4 + 0.5) * latent
    total_sq = torch.cat([squares, random])
    eps = torch.full_like(total_sq, 1e-5)
    inv = norm_inverse(total_sq, latent, eps)
    f32 = np.float32
    for s, got in zip(total_sq.tolist(), inv.tolist()):
        want = f32(1) / np.sqrt(f32(f32(f32(s) / f32(latent)) + f32(1e-5)))
        assert f32(got) == want, (s, got, float(want))
