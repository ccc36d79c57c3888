"""Reference dispatch and combine in torch: the row contract. The dispatch writes into the peers'
buffers, the combine reads the peers' expert output rows where they lie.

Completion (every source has delivered, every owner's rows are written) is the caller's barrier
(EpRouted's host protocol on CPU). The GPU kernels are compared against these bit for bit.
"""

from __future__ import annotations

import torch

from dep_ep.comm.buffers import EpBuffers
from dep_ep.constants import (
    NORM_CHUNK,
    NORM_LANES,
    NORM_SCALE_MAX_EXP,
    NORM_SCALE_MIN_EXP,
    NORM_WARPS,
    WARP_LANES,
)


def owner_ranks(ids: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """int64 [T, K]: the rank owning each expert id (ranks own contiguous ranges), -1 for id -1."""
    ids = ids.long()
    return torch.where(ids >= 0, torch.div(ids, experts_per_rank, rounding_mode="floor"), -1)


def dispatch_write(
    buffers: EpBuffers,
    q: torch.Tensor,
    sf: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts_per_rank: int,
) -> None:
    """Write this rank's T tokens into every rank's receive rows [rank*S, rank*S + T).

    q uint8 [T, L], sf uint8 [T, L/32] (the token's MXFP8, quantized once), ids int [T, K] global
    (-1 = none), weights fp32 [T, K]. Destination d gets, for token t: ids with every id d does not
    own replaced by -1; and, only when one id is d's, the x, sf and weights rows (each token
    reaches each rank at most once). Rows of tokens with no id on d carry ids of -1 only.
    """
    tokens = ids.shape[0]
    stride = buffers.layout.stride(tokens)
    rows = buffers.layout.rows(tokens)
    owners = owner_ranks(ids, experts_per_rank)
    base = buffers.rank * stride
    for dest, peer in enumerate(buffers.peers):
        local = owners == dest
        peer.ids(rows)[base : base + tokens] = torch.where(local, ids.int(), -1)
        hit = local.any(dim=1).nonzero().squeeze(1)
        if hit.numel() == 0:
            continue
        at = base + hit
        peer.x(rows)[at] = q[hit]
        peer.sf(rows)[at] = sf[hit]
        peer.weights(rows)[at] = weights[hit]


def combine_pull(
    buffers: EpBuffers,
    ids: torch.Tensor,
    experts_per_rank: int,
    norm_weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """This rank's tokens' combine, read where the rows lie: for token t, row rank*S + t of the
    `out` region of every rank that owns one of its experts, summed in fp32 in rank order 0..N-1
    (starting from +0.0; deterministic), then `rms_norm` (or, with norm_weight None, the sum
    rounded to BF16). Returns bf16 [T, L]. Rows of ranks that own none of the token's experts
    are never read (they may be stale). ids int [T, K] as dispatched (-1 = none)."""
    tokens = ids.shape[0]
    stride = buffers.layout.stride(tokens)
    rows = buffers.layout.rows(tokens)
    mine = buffers.rank * stride + torch.arange(tokens, device=ids.device)
    owners = owner_ranks(ids, experts_per_rank)
    total = torch.zeros(tokens, buffers.layout.latent, dtype=torch.float32, device=ids.device)
    for rank, peer in enumerate(buffers.peers):
        hit = (owners == rank).any(dim=1).nonzero().squeeze(1)
        total[hit] += peer.out(rows)[mine[hit]].float()
    if norm_weight is None:
        return total.to(torch.bfloat16)
    return rms_norm(total, norm_weight, eps)


def _lane_ordered_sumsq(h: torch.Tensor) -> torch.Tensor:
    """fp32 [T, 1]: the sum of squares of each row of h fp32 [T, L] in the combine kernel's order:
    lane l of NORM_LANES (128, a group of NORM_WARPS warps) adds its NORM_CHUNK-element chunks
    l, l+128, ... in chunk and element order; then the tree x[i] += x[i + o], o = 16, 8, 4, 2, 1
    over each warp's 32 lanes; then the same tree over the warps' totals, o = 2, 1 (so
    (w0 + w2) + (w1 + w3))."""
    tokens, latent = h.shape
    chunks = latent // NORM_CHUNK
    per_lane = -(-chunks // NORM_LANES)
    padded = torch.zeros(tokens, per_lane * NORM_LANES * NORM_CHUNK, device=h.device)
    padded[:, :latent] = h
    squares = (padded * padded).view(tokens, per_lane, NORM_LANES, NORM_CHUNK)
    lanes = torch.zeros(tokens, NORM_LANES, device=h.device)
    for i in range(per_lane):
        valid = min(NORM_LANES, chunks - i * NORM_LANES)
        for j in range(NORM_CHUNK):
            lanes[:, :valid] = lanes[:, :valid] + squares[:, i, :valid, j]
    return _tree(_tree(lanes.view(tokens, NORM_WARPS, WARP_LANES)).view(tokens, NORM_WARPS))


def _tree(x: torch.Tensor) -> torch.Tensor:
    """The tree x[i] += x[i + o], o = n/2, ..., 2, 1 over the last dimension (n a power of two),
    which it keeps as 1: [..., n] -> [..., 1], every addition rounded to fp32."""
    width = x.shape[-1]
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width : 2 * width]
    return x


def rms_norm(total: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The latent norm of the HF block, in the exact order of the combine kernel.

    h = BF16(total) (as HF's block casts the expert sum); sum of squares in fp32: lane l of 128
    adds h*h over its chunks l, l+128, ... (8 elements each) in order, then each warp's 32 lanes
    are reduced by the tree x[i] += x[i + o], o = 16, 8, 4, 2, 1, then the 4 warps' totals by
    the same tree, o = 2, 1 (`_lane_ordered_sumsq`); inv = 1 / sqrt(sumsq / L + eps) (IEEE
    division and square root); out = BF16(BF16(h * inv) * weight). A row whose sum of squares
    overflows (Inf or NaN) is summed again as h*s with s = 2^(127 - clamp(E, 127, 253)), E the
    fp32 biased exponent of max |h| over the row, and eps*s*s: scaling by a power of two is
    exact and commutes with every rounding above, so the normalised row is the one the unscaled
    formula would give without overflow. total fp32 [T, L] -> bf16 [T, L].
    """
    tokens, latent = total.shape
    h = total.to(torch.bfloat16).float()
    total_sq = _lane_ordered_sumsq(h)
    exponent = (h.abs().amax(dim=1).view(torch.int32) >> 23) & 0xFF
    exponent = exponent.clamp(NORM_SCALE_MIN_EXP, NORM_SCALE_MAX_EXP)
    scale = ((254 - exponent) << 23).view(torch.float32).unsqueeze(1)  # fp32 [T, 1]
    scale = torch.where(total_sq.isfinite(), torch.ones_like(scale), scale)
    if not bool((scale == 1).all()):
        h = h * scale
        total_sq = _lane_ordered_sumsq(h)
    eps_row = (torch.tensor(eps, dtype=torch.float32) * scale) * scale
    inv = norm_inverse(total_sq, latent, eps_row)
    return (h * inv).to(torch.bfloat16) * norm_weight


def norm_inverse(total_sq: torch.Tensor, latent: int, eps: torch.Tensor) -> torch.Tensor:
    """fp32 1 / sqrt(total_sq / latent + eps), each operation rounded once as the kernel's
    div.rn, add.rn, sqrt.rn (total_sq, eps fp32 of one shape). An operation on fp32 operands done
    in fp64 and rounded to fp32 is exact for + - * / (53 >= 2 * 24 + 2); the root goes through
    sqrt_rn_fp32, since torch's own sqrt on CPU is not correctly rounded."""
    mean = (total_sq.double() / float(latent)).float()
    root = sqrt_rn_fp32((mean.double() + eps.double()).float())
    return (1.0 / root.double()).float()


def sqrt_rn_fp32(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of fp32 `x` >= 0 (finite), fp32, as PTX sqrt.rn.f32.

    torch.sqrt on CPU is not (about 0.7% of fp32 inputs in [0.5, 4.5] come out 1 ulp off with
    torch 2.13, e.g. bits 0x4002cab7: 0x3fb6fb9a, IEEE 0x3fb6fb9b; its fp64 sqrt misses too).
    So: a first guess r from fp64, then r moves to a neighbour when x lies beyond the midpoint
    between them; midpoints have 25 significant bits, so their squares are exact in fp64 (and
    the square root of an fp32 never falls on a midpoint: no ties)."""
    r = torch.sqrt(x.double()).float()
    down = torch.nextafter(r, torch.zeros_like(r))
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    low = (r.double() + down.double()) / 2
    high = (r.double() + up.double()) / 2
    xd = x.double()
    r = torch.where(xd < low * low, down, r)
    return torch.where(xd > high * high, up, r)
