"""The all-gather reference for the routed path: deliberately plain, sharing no code with it.

Every rank gathers all ranks' tokens, ids and weights, computes every token's result with its own
straightforward MXFP8 rounding, E2M1 decoding, SiTU and RMSNorm in float64 (only the MXFP8
rounding of the latent, which the contract fixes, is reproduced exactly), and returns its own rows.
Use a tolerance: the path under test rounds to BF16 where this one does not.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

# The contract's numbers as docs/formats.md gives them, written here and not imported from the
# library (dep_ep.constants, dep_ep.config, experts/situ.py): a yardstick that took the library's
# values would follow a wrong one instead of catching it. Tests that need them take them from here.
SCALE_BLOCK = 32  # MXFP8 and MXFP4 elements per E8M0 scale byte
E4M3_MAX = 448.0  # the largest finite e4m3 magnitude
R448_BITS = 0x3B124925  # fp32 bits of rcp.approx(448)
NORM_EPS = 1e-5  # Kimi K3's latent RMSNorm
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0  # Kimi K3's SiTU


def _round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float64 y, |y| <= E4M3_MAX, to the nearest e4m3 value, ties to even, by step arithmetic."""
    mag = y.abs()
    exponent = torch.floor(torch.log2(mag.clamp(min=2.0**-6)))
    step = torch.exp2(exponent - 3)  # 3 mantissa bits; below 2^-6 the subnormal step 2^-9
    return torch.copysign(torch.round(mag / step) * step, y).clamp(-E4M3_MAX, E4M3_MAX)


def _mxfp8_roundtrip(latent: torch.Tensor) -> torch.Tensor:
    """bf16 [T, L] -> float64 [T, L] after MXFP8 quantize + dequantize (the contract's rounding)."""
    blocks = latent.double().reshape(latent.shape[0], latent.shape[1] // SCALE_BLOCK, SCALE_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    r448 = torch.tensor([R448_BITS], dtype=torch.int32, device=latent.device).view(torch.float32)
    v = (amax.float() * r448).double()  # the one fp32 multiply of the contract
    mant, exp = torch.frexp(v)
    scale = torch.where(mant == 0.5, exp - 1, exp).double() + 127  # ceil(log2 v) + 127
    scale = torch.where(v == 0, torch.zeros_like(scale), scale).clamp(0, 254)
    finite = torch.isfinite(amax)
    scale = torch.where(finite, scale, torch.full_like(scale, 255))
    usable = (scale > 0) & (scale < 254)
    mult = torch.where(usable, torch.exp2(127 - scale), torch.zeros_like(scale))
    q = _round_e4m3((blocks * mult.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX))
    back = q * torch.exp2(scale - 127).unsqueeze(-1)
    back = torch.where(finite.unsqueeze(-1), back, torch.full_like(back, float("nan")))
    return back.reshape(latent.shape)


def _e2m1(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Checkpoint MXFP4 (low nibble = even element) -> float64, decoded from the bit fields."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    sign = torch.where(codes >= 8, -1.0, 1.0).double()
    exp, man = (codes >> 1) & 3, (codes & 1).double()
    mag = torch.where(exp == 0, man * 0.5, torch.exp2(exp.double() - 1) * (1 + man / 2))
    scale = torch.exp2(scales.double() - 127).repeat_interleave(SCALE_BLOCK, dim=-1)
    return sign * mag * scale


def _gather(group: dist.ProcessGroup, t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def expert_sums(
    latent: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_weights: Callable[[int], tuple[torch.Tensor, ...]],
    *,
    beta: float = SITU_BETA,
    linear_beta: float = SITU_LINEAR_BETA,
) -> torch.Tensor:
    """float64 [T, L]: each token's sum over its ids (-1 skipped) of weight * expert(latent), the
    latent rounded through MXFP8 as the contract fixes, everything after it in float64.

    latent bf16 [T, L], ids [T, K], weights [T, K]; expert_weights(e) -> (w13, s13, w2, s2) of
    global expert e in checkpoint layout. Tokens with no id get zeros.
    """
    device = latent.device
    x = _mxfp8_roundtrip(latent)
    ids, weights = ids.to(device).long(), weights.to(device).double()
    total = torch.zeros_like(x)
    for expert in sorted(set(ids[ids >= 0].tolist())):
        w13, s13, w2, s2 = (t.to(device) for t in expert_weights(expert))
        w13, w2 = _e2m1(w13, s13), _e2m1(w2, s2)
        inter = w13.shape[0] // 2
        token, k = (ids == expert).nonzero(as_tuple=True)
        h = x[token] @ w13.T
        gate, up = h[:, :inter], h[:, inter:]
        act = beta * torch.tanh(gate / beta) / (1 + torch.exp(-gate))
        act = act * linear_beta * torch.tanh(up / linear_beta)
        total.index_add_(0, token, weights[token, k].unsqueeze(1) * (act @ w2.T))
    return total


def routed_reference(
    latent: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    norm_weight: torch.Tensor,
    expert_weights: Callable[[int], tuple[torch.Tensor, ...]],
    *,
    eps: float = NORM_EPS,
    beta: float = SITU_BETA,
    linear_beta: float = SITU_LINEAR_BETA,
) -> torch.Tensor:
    """The expected routed output of these tokens, float64 [T, L], computed locally (a token's
    output depends on that token alone): for tests that must not run a collective, such as one
    checking a recovery while the ranks are out of step.

    latent bf16 [T, L], ids [T, K] (-1 = none), weights fp32 [T, K]; norm_weight bf16 [L];
    expert_weights(e) -> (w13, s13, w2, s2) of global expert e in checkpoint layout.
    """
    total = expert_sums(latent, ids, weights, expert_weights, beta=beta, linear_beta=linear_beta)
    rms = torch.sqrt((total * total).mean(dim=-1, keepdim=True) + eps)
    return total / rms * norm_weight.to(latent.device).double()


def allgather_reference(
    group: dist.ProcessGroup,
    latent: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    norm_weight: torch.Tensor,
    expert_weights: Callable[[int], tuple[torch.Tensor, ...]],
    *,
    eps: float = NORM_EPS,
    beta: float = SITU_BETA,
    linear_beta: float = SITU_LINEAR_BETA,
) -> torch.Tensor:
    """This rank's expected routed output, float64 [T, L] on latent's device (the gather runs on
    CPU tensors, the arithmetic on the device). Collective over `group` (gloo): every rank's
    tokens are gathered, this rank's rows computed from the gathered copy (`routed_reference`).

    latent bf16 [T, L], ids [T, K] (-1 = none), weights fp32 [T, K] as this rank passes them;
    expert_weights(e) -> (w13, s13, w2, s2) of global expert e in checkpoint layout.
    """
    rank, tokens, device = dist.get_rank(group), latent.shape[0], latent.device
    all_latent = _gather(group, latent.cpu().view(torch.uint8)).view(torch.bfloat16)
    all_ids = _gather(group, ids.cpu().long())
    all_weights = _gather(group, weights.cpu().double())
    mine = slice(rank * tokens, (rank + 1) * tokens)
    return routed_reference(
        all_latent[mine].to(device),
        all_ids[mine],
        all_weights[mine],
        norm_weight,
        expert_weights,
        eps=eps,
        beta=beta,
        linear_beta=linear_beta,
    )
