"""The combine's torch reference rounds as the kernel does: its fp32 square root is IEEE's
(sqrt.rn.f32), which torch's own CPU sqrt is not."""

from __future__ import annotations

from decimal import Decimal, getcontext

import numpy as np
import pytest
import torch

from dep_ep.comm.reference import _lane_ordered_sumsq, norm_inverse, rms_norm, sqrt_rn_fp32

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


def scalar_sumsq(row: list[float]) -> np.float32:
    """The combine's sum of squares of one row, one fp32 operation at a time (numpy scalars): lane
    m of 128 adds its 8-element chunks m, m+128, ... in chunk and element order; each warp's 32
    lanes by the tree x[i] += x[i + o], o = 16, 8, 4, 2, 1; then the 4 warps' totals by the same
    tree, o = 2, 1."""
    f32 = np.float32
    chunks = len(row) // 8
    lanes = [f32(0)] * 128
    for c in range(chunks):
        for j in range(8):
            v = f32(row[8 * c + j])
            lanes[c % 128] = f32(lanes[c % 128] + f32(v * v))

    def tree(x: list) -> np.float32:
        x = list(x)
        width = len(x)
        while width > 1:
            width //= 2
            x = [f32(x[i] + x[i + width]) for i in range(width)]
        return x[0]

    return tree([tree(lanes[32 * w : 32 * w + 32]) for w in range(4)])


@pytest.mark.parametrize("latent", [64, 2080, 3584])
def test_sumsq_order_is_the_kernels(latent):
    """The reference's sum of squares is the kernel's order, operation by operation, on fresh
    rows of BF16 values of mixed magnitudes (where the order changes the bits): every width a
    lane meets at L = 3584 (4 chunks on lanes 0-63, 3 on the rest), L = 2080 (2 or 3) and
    L = 64 (fewer chunks than lanes)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    h = torch.randn(6, latent, generator=gen) * torch.exp2(torch.randint(-20, 20, (6, latent)))
    h = h.to(torch.bfloat16).float()
    got = _lane_ordered_sumsq(h).squeeze(1)
    for row, value in zip(h.tolist(), got.tolist()):
        assert np.float32(value) == scalar_sumsq(row), latent


def test_overflowing_rows_normalise_as_their_unscaled_rows():
    """A row whose squares overflow fp32 takes the rescaled path and gives the bits of the same
    row 2^100 times smaller, which does not overflow (a power of two commutes with every
    rounding; eps scales with it)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    total = torch.randn(5, 2080, generator=gen) * 8
    weight = (1 + 0.1 * torch.randn(2080, generator=gen)).to(torch.bfloat16)
    small = rms_norm(total, weight, 2.0**-100)
    big = total * 2.0**100
    assert not _lane_ordered_sumsq(big.to(torch.bfloat16).float()).isfinite().any()
    assert torch.equal(rms_norm(big, weight, 2.0**100).view(torch.int16), small.view(torch.int16))
