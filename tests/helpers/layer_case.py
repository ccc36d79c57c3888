"""The float64 reference of EpMoeLayer that tests/test_layer_mpi.py (CPU) and
tests/gpu/test_gpu_layer.py (CUDA) compare the layer with: seeded dense tensors, a float64
router, inputs drawn away from near-tied experts, the K3 formula in float64 and the tolerance
of the comparison. Written without the layer's code (the router included: an independent
evaluation of the formula, docs/formats.md); the routed sum is testing/allgather_reference.py's
`expert_sums`.

Error model of the comparison with the reference (docs/layer.md restates it)
---------------------------------------------------------------------------
The reference computes in float64 from the same BF16 inputs and weights. It reproduces two
roundings of the layer exactly: the latent's BF16 (the down projection's output; the reference
rounds its float64 product once) and the latent's MXFP8 (testing/allgather_reference.py). The layer
differs from it by these roundings to BF16 (relative rms of each: dep_ep.testing.tolerance.BF16 =
1.66e-3, from the unit roundoff u = 2^-8):
- routed part r = up(normed): the routed path's six (dep_ep.testing.tolerance.ROUTED_ROUNDINGS: SiTU
  activation, expert output, rank partial, rank sum, and the norm's two), rms e_r = 4.06e-3; the
  up projection's output is not rounded on its own (it is summed into the shared output in fp32
  by one addmm);
- shared part s: the front GEMM's gate and up outputs g and u (each rounding enters through
  SiTU with the gain below), the activation, the down projection's output:
  e_s^2 = BF16^2 * (gain_g^2 + gain_u^2 + 2);
- the output: one rounding of r + s, BF16.
SiTU gains: a relative error d of g changes SiTU(g, u) = f(g) h(u) by f'(g) g h(u) d, so the
relative L2 gain is gain_g^2 = sum (f'(g) g h(u))^2 / sum (f(g) h(u))^2, and likewise for u;
the test evaluates them on the reference's own g and u (about 1.1 and 1.0 for N(0, 1) inputs).
The projections keep relative L2 errors in expectation (random weights), and independent errors
add in quadrature, so the expected relative L2 error of the output is
    e^2 = (|r|^2 e_r^2 + |s|^2 e_s^2) / |r + s|^2 + BF16^2,
with |r|, |s|, |r + s| the reference's norms over the rank's rows. The bound is
dep_ep.testing.tolerance.SAFETY (2) times e: about 8e-3 when |r| ~ |s|.
Neglected: fp32 sums and fp32 transcendental functions (below 1e-5 relative); the router's fp32
logits (the inputs are redrawn where the float64 top-K margin is below ROUTER_MARGIN, so both
choose the same experts); an fp32-accumulated latent element that rounds to the other BF16
neighbour than the float64 one (probability ~1e-4 per element, then at most one e4m3 step of
that element or one changed block scale: below 3e-3 relative L2 of a rank's rows, added in
quadrature).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dep_ep.config import MoeGeometry
from dep_ep.experts.checkpoint import (
    BIAS,
    DOWN,
    GATE,
    NORM,
    SHARED_DOWN,
    SHARED_GATE,
    SHARED_UP,
    UP,
    dense_shapes,
)
from dep_ep.testing.allgather_reference import NORM_EPS, SITU_BETA, SITU_LINEAR_BETA, expert_sums
from dep_ep.testing.compare import rel_l2
from dep_ep.testing.tolerance import BF16, ROUTED_RMS, SAFETY

# Smallest float64 gap between the K-th and (K+1)-th of scores + bias that the tests accept: the
# layer's fp32 logits differ from float64 by ~1e-6 at H = 7168, so both pick the same experts.
ROUTER_MARGIN = 1e-4


# ---------------------------------------------------------------------------------- inputs
def make_dense(geometry: MoeGeometry, seed: int) -> dict[str, torch.Tensor]:
    """The layer's dense tensors (CPU) by checkpoint name, seeded: projections with rms
    1/sqrt(fan_in) (outputs of the size of their inputs), the norm weight around 1, a small
    selection bias."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in dense_shapes(geometry).items():
        w = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name == NORM:
            w = 1 + 0.1 * w
        elif name == BIAS:
            w = 0.01 * w
        else:
            w = w / math.sqrt(shape[1])
        out[name] = w.to(dtype)
    return out


def reference_router(x: torch.Tensor, dense: dict, topk: int, factor: float = 1.0):
    """float64: (ids int64 [n, K], weights [n, K], margin [n]) of bf16 x [n, H]; margin = the
    K-th minus the (K+1)-th largest of scores + bias."""
    scores = torch.sigmoid(x.double() @ dense[GATE].double().T)
    chosen = (scores + dense[BIAS].double()).topk(min(topk + 1, scores.shape[1]), dim=-1)
    ids = chosen.indices[:, :topk]
    margin = torch.full((x.shape[0],), math.inf, dtype=torch.float64)  # K = E: no choice
    if topk < scores.shape[1]:
        margin = chosen.values[:, topk - 1] - chosen.values[:, topk]
    w = scores.gather(1, ids)
    return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * factor, margin


def draw_hidden(
    geometry: MoeGeometry, dense: dict, counts: list[int], gen: int | torch.Generator
) -> list[torch.Tensor]:
    """Every rank's x (bf16 [counts[r], H], CPU, N(0, 1)) from one generator (`gen`, or a fresh
    one seeded with it); rows whose float64 top-K margin is below ROUTER_MARGIN are redrawn."""
    if not isinstance(gen, torch.Generator):
        gen = torch.Generator().manual_seed(gen)
    xs = []
    for n in counts:
        x = torch.randn(n, geometry.hidden, generator=gen).to(torch.bfloat16)
        for _ in range(100):
            close = reference_router(x, dense, geometry.topk)[2] < ROUTER_MARGIN
            if not close.any():
                break
            fresh = torch.randn(int(close.sum()), geometry.hidden, generator=gen)
            x[close] = fresh.to(torch.bfloat16)
        xs.append(x)
    return xs


def unequal_counts(tokens: int, num_ranks: int) -> list[int]:
    """Real rows per rank: T on rank 0, fewer on the next ones, none on the last (one rank: T)."""
    counts = [max(tokens - (r * tokens) // num_ranks - r, 1) for r in range(num_ranks)]
    counts[0] = tokens
    if num_ranks > 1:
        counts[-1] = 0
    return counts


# ---------------------------------------------------------------------------------- reference
@dataclass
class Reference:
    out: torch.Tensor  # float64 [n, H]
    routed: torch.Tensor  # float64 [n, H]: up(RMSNorm(routed sum))
    shared: torch.Tensor  # float64 [n, H]
    ids: torch.Tensor  # int64 [n, K]
    gain_g: float  # SiTU's relative L2 gains (module docstring)
    gain_u: float


def situ64(g: torch.Tensor, u: torch.Tensor):
    """float64 SiTU(g, u) and its relative-error gains (module docstring)."""
    b, lb = SITU_BETA, SITU_LINEAR_BETA
    sig, tg, tu = torch.sigmoid(g), torch.tanh(g / b), torch.tanh(u / lb)
    f, h = b * tg * sig, lb * tu
    df = (1 - tg * tg) * sig + b * tg * sig * (1 - sig)
    dh = 1 - tu * tu
    act = f * h
    norm = act.square().sum().clamp(min=1e-300)
    gain_g = float(((df * g * h).square().sum() / norm).sqrt())
    gain_u = float(((f * dh * u).square().sum() / norm).sqrt())
    return act, gain_g, gain_u


def layer_reference(
    x: torch.Tensor, dense: dict, expert_weights, topk: int, *, eps=NORM_EPS, factor=1.0
) -> Reference:
    """The K3 layer in float64 on bf16 x [n, H] (CPU). expert_weights(e) -> (w13, s13, w2, s2)."""
    d = {name: t.double() for name, t in dense.items()}
    x64 = x.double()
    ids, weights, _ = reference_router(x, dense, topk, factor)
    # The down projection's one rounding to BF16, as the layer's GEMM output; MXFP8 follows.
    latent = (x64 @ d[DOWN].T).to(torch.bfloat16)
    sums = torch.zeros(0, latent.shape[1], dtype=torch.float64)
    if x.shape[0]:  # expert_sums needs rows
        sums = expert_sums(latent, ids, weights, expert_weights)
    normed = sums / torch.sqrt(sums.square().mean(dim=-1, keepdim=True) + eps) * d[NORM]
    routed = normed @ d[UP].T
    act, gain_g, gain_u = situ64(x64 @ d[SHARED_GATE].T, x64 @ d[SHARED_UP].T)
    shared = act @ d[SHARED_DOWN].T
    return Reference(routed + shared, routed, shared, ids, gain_g, gain_u)


def layer_tolerance(ref: Reference) -> float:
    """SAFETY times the expected relative L2 error of the rank's output (module docstring)."""
    e_shared2 = BF16**2 * (ref.gain_g**2 + ref.gain_u**2 + 2)
    r2, s2 = ref.routed.square().sum(), ref.shared.square().sum()
    out2 = ref.out.square().sum().clamp(min=1e-300)
    return SAFETY * math.sqrt(float((r2 * ROUTED_RMS**2 + s2 * e_shared2) / out2) + BF16**2)


def compare_layer(out: torch.Tensor, ref: Reference, label: str) -> tuple[list[str], float]:
    """(failures, relative L2) of the layer's bf16 output against the reference."""
    want_shape = tuple(ref.out.shape)
    if tuple(out.shape) != want_shape or out.dtype != torch.bfloat16:
        return [f"{label}: output {out.dtype} {tuple(out.shape)}; expected bf16 {want_shape}"], 0.0
    if ref.out.numel() == 0:
        return [], 0.0
    got = out.cpu().double()
    if not got.isfinite().all():
        return [f"{label}: non-finite output"], math.inf
    rel = rel_l2(got, ref.out)
    bound = layer_tolerance(ref)
    return ([] if rel <= bound else [f"{label}: rel L2 {rel:.3e} > bound {bound:.3e}"]), rel
