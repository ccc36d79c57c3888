"""EpMoeLayer on CUDA (NVSHMEM buffers, CuTeDSL kernels): against the float64 reference of the
K3 formula with the error model of tests/test_layer_mpi.py; the overlapped schedule against the
serial order bit for bit; CUDA-graph capture and replay (DenseExperts). TINY, and K3's widths
(H 7168, L 3584, S 6144, E 896, K 16) with an expert intermediate of 32 so that DenseExperts
fits. Several processes may share the GPU (gloo group): correctness only, no timing.

    mpirun -n 2 python -m pytest -q --with-mpi tests/gpu/test_gpu_layer.py

The reference, the input drawing and the tolerance below repeat tests/test_layer_mpi.py's (test
modules import no other test module); its docstring derives the tolerance.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from dep_ep.config import EpConfig, MoeGeometry
from dep_ep.ep import K3, TINY, EpMoeLayer, EpRouted
from dep_ep.experts import DenseExperts, ReferenceExperts
from dep_ep.experts.checkpoint import dense_shapes
from dep_ep.testing import SyntheticLayer, internals
from dep_ep.testing.allgather_reference import NORM_EPS, SITU_BETA, SITU_LINEAR_BETA, expert_sums
from dep_ep.testing.tolerance import BF16, ROUTED_ROUNDINGS, SAFETY, model_rms

from helpers.cases import agreed_seed
from helpers.collective import collective_assert

MAX_TOKENS = 64
REPLAYS = int(os.environ.get("EP_TEST_REPLAYS", "200"))
ROUTER_MARGIN = 1e-4
ROUTED_REL = model_rms(ROUTED_ROUNDINGS)
# K3's widths with an expert intermediate small enough for DenseExperts (fp32 copies of every
# local expert: 448 experts at 2 ranks take 0.6 GB); the dense tensors keep K3's S = 6144.
K3_WIDTHS = MoeGeometry(
    "k3-widths",
    hidden=K3.hidden,
    latent=K3.latent,
    experts=K3.experts,
    topk=K3.topk,
    intermediate=32,
)

GATE, BIAS, NORM = "gate.weight", "gate.e_score_correction_bias", "routed_expert_norm.weight"
DOWN, UP = "routed_expert_down_proj.weight", "routed_expert_up_proj.weight"
SHARED_GATE, SHARED_UP = "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"
SHARED_DOWN = "shared_experts.down_proj.weight"


# ------------------------------------------------- the reference (as in tests/test_layer_mpi.py)
def make_dense(geometry: MoeGeometry, seed: int) -> dict[str, torch.Tensor]:
    """Seeded dense tensors (CPU) of `geometry` (S = 2 * its intermediate)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in dense_shapes(geometry).items():
        w = torch.randn(shape, generator=gen, dtype=torch.float32)
        w = 1 + 0.1 * w if name == NORM else 0.01 * w if name == BIAS else w / math.sqrt(shape[1])
        out[name] = w.to(dtype)
    return out


def reference_router(x: torch.Tensor, dense: dict, topk: int):
    """float64 (ids [n, K], weights [n, K], top-K margin [n]) of bf16 x [n, H]."""
    scores = torch.sigmoid(x.double() @ dense[GATE].double().T)
    chosen = (scores + dense[BIAS].double()).topk(topk + 1, dim=-1)
    ids = chosen.indices[:, :topk]
    w = scores.gather(1, ids)
    margin = chosen.values[:, topk - 1] - chosen.values[:, topk]
    return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20), margin


def draw_hidden(hidden: int, topk: int, dense: dict, counts: list[int], gen: torch.Generator):
    """Every rank's x (bf16 [counts[r], H], CPU, N(0, 1)); rows with a float64 top-K margin
    below ROUTER_MARGIN are redrawn."""
    xs = []
    for n in counts:
        x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
        for _ in range(100):
            close = reference_router(x, dense, topk)[2] < ROUTER_MARGIN
            if not close.any():
                break
            x[close] = torch.randn(int(close.sum()), hidden, generator=gen).to(torch.bfloat16)
        xs.append(x)
    return xs


@dataclass
class Reference:
    out: torch.Tensor
    routed: torch.Tensor
    shared: torch.Tensor
    gain_g: float
    gain_u: float


def layer_reference(x: torch.Tensor, dense: dict, expert_weights, topk: int) -> Reference:
    d = {name: t.double() for name, t in dense.items()}
    x64 = x.double()
    ids, weights, _ = reference_router(x, dense, topk)
    latent = (x64 @ d[DOWN].T).to(torch.bfloat16)
    sums = torch.zeros(0, latent.shape[1], dtype=torch.float64)
    if x.shape[0]:
        sums = expert_sums(latent, ids, weights, expert_weights)
    normed = sums / torch.sqrt(sums.square().mean(dim=-1, keepdim=True) + NORM_EPS) * d[NORM]
    g, u = x64 @ d[SHARED_GATE].T, x64 @ d[SHARED_UP].T
    b, lb = SITU_BETA, SITU_LINEAR_BETA
    sig, tg, tu = torch.sigmoid(g), torch.tanh(g / b), torch.tanh(u / lb)
    f, h = b * tg * sig, lb * tu
    df = (1 - tg * tg) * sig + b * tg * sig * (1 - sig)
    act = f * h
    norm = act.square().sum().clamp(min=1e-300)
    gain_g = float(((df * g * h).square().sum() / norm).sqrt())
    gain_u = float(((f * (1 - tu * tu) * u).square().sum() / norm).sqrt())
    routed, shared = normed @ d[UP].T, act @ d[SHARED_DOWN].T
    return Reference(routed + shared, routed, shared, gain_g, gain_u)


def compare_layer(out: torch.Tensor, ref: Reference, label: str) -> list[str]:
    if tuple(out.shape) != tuple(ref.out.shape) or out.dtype != torch.bfloat16:
        return [f"{label}: output {out.dtype} {tuple(out.shape)}; expected {tuple(ref.out.shape)}"]
    if ref.out.numel() == 0:
        return []
    got = out.cpu().double()
    if not got.isfinite().all():
        return [f"{label}: non-finite output"]
    e_shared2 = BF16**2 * (ref.gain_g**2 + ref.gain_u**2 + 2)
    r2, s2 = ref.routed.square().sum(), ref.shared.square().sum()
    e2 = float((r2 * ROUTED_REL**2 + s2 * e_shared2) / ref.out.square().sum()) + BF16**2
    bound = SAFETY * math.sqrt(e2)
    rel = float((got - ref.out).norm() / ref.out.norm())
    return [] if rel <= bound else [f"{label}: rel L2 {rel:.3e} > bound {bound:.3e}"]


def unequal_counts(tokens: int, num_ranks: int) -> list[int]:
    """T on rank 0, fewer on the next ones, none on the last (one rank: T)."""
    counts = [max(tokens - (r * tokens) // num_ranks - r, 1) for r in range(num_ranks)]
    counts[0] = tokens
    if num_ranks > 1:
        counts[-1] = 0
    return counts


# ------------------------------------------------------------------------------------ fixtures
@dataclass
class Setup:
    geometry: MoeGeometry
    routed: EpRouted
    synthetic: SyntheticLayer
    dense: dict  # CPU tensors (the reference's)
    overlap: EpMoeLayer
    serial: EpMoeLayer
    seeds: dict


def build(gpu_dep, geometry: MoeGeometry, dense_geometry: MoeGeometry, base: int) -> Setup:
    n, rank = gpu_dep.size, gpu_dep.rank
    seeds = {
        "experts": agreed_seed(gpu_dep.cpu_group, base),
        "dense": agreed_seed(gpu_dep.cpu_group, base + 1),
    }
    routed = EpRouted(
        gpu_dep.cpu_group,
        MAX_TOKENS,
        torch.device("cuda"),
        num_experts=geometry.experts,
        latent=geometry.latent,
        topk=geometry.topk,
        config=EpConfig(timeout_s=60.0),
    )
    synthetic = SyntheticLayer(geometry, seeds["experts"])
    per_rank = geometry.experts // n
    experts = DenseExperts(synthetic.local_weights(rank * per_rank, per_rank).to("cuda"))
    dense = make_dense(dense_geometry, seeds["dense"])
    on_gpu = {name: t.cuda() for name, t in dense.items()}
    overlap = EpMoeLayer(on_gpu, routed, experts, topk=geometry.topk)
    serial = EpMoeLayer(overlap.dense, routed, experts, topk=geometry.topk, schedule="serial")
    return Setup(geometry, routed, synthetic, dense, overlap, serial, seeds)


@pytest.fixture(scope="module")
def tiny(gpu_dep):
    setup = build(gpu_dep, TINY, TINY, 500)
    yield setup
    setup.routed.close()


@pytest.fixture(scope="module")
def k3_widths(gpu_dep):
    dense_geometry = MoeGeometry(
        "k3-dense",
        hidden=K3.hidden,
        latent=K3.latent,
        experts=K3.experts,
        topk=K3.topk,
        intermediate=K3.intermediate,
    )
    setup = build(gpu_dep, K3_WIDTHS, dense_geometry, 600)
    yield setup
    setup.routed.close()


def poison(setup: Setup, counts: list[int], rank: int) -> None:
    """NaN into the routed path's buffers and into freed blocks of the sizes the layer allocates
    (the caching allocator hands them out again), so values the layer fails to write show."""
    b = internals.buffers(setup.routed)
    b.partials(b.layout.max_rows).fill_(float("nan"))
    setup.routed.receive(MAX_TOKENS).out.fill_(float("nan"))
    n, g = counts[rank], setup.geometry
    sizes = [
        (n, setup.overlap.hidden),
        (n, 2 * setup.overlap.shared_intermediate + g.latent),
        (n, g.latent),
        (n, setup.overlap.shared_intermediate),
    ]
    blocks = [torch.full(s, float("nan"), dtype=torch.bfloat16, device="cuda") for s in sizes]
    del blocks
    torch.cuda.synchronize()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


# ------------------------------------------------------------------------------------ tests
def check_against_reference(gpu_dep, setup: Setup, tokens: int, label: str) -> list[str]:
    n, rank = gpu_dep.size, gpu_dep.rank
    g = setup.geometry
    setup.seeds[f"x {label}"] = agreed_seed(gpu_dep.cpu_group, tokens)
    counts = unequal_counts(tokens, n)
    gen = torch.Generator().manual_seed(setup.seeds[f"x {label}"])
    x = draw_hidden(g.hidden, g.topk, setup.dense, counts, gen)[rank]
    failures = []
    outs = {}
    for name, layer in (("overlap", setup.overlap), ("serial", setup.serial)):
        poison(setup, counts, rank)
        dist.barrier(gpu_dep.cpu_group)
        outs[name] = layer(x.cuda(), tokens=tokens)
        setup.routed.synchronize()
    if not bits_equal(outs["overlap"], outs["serial"]):
        differ = int((outs["overlap"].view(torch.int16) != outs["serial"].view(torch.int16)).sum())
        failures.append(f"{label}: overlapped and serial schedules differ in {differ} elements")
    ref = layer_reference(x, setup.dense, setup.synthetic.expert, g.topk)
    return failures + compare_layer(outs["overlap"], ref, f"{label} T={tokens}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tokens", [1, 9, MAX_TOKENS])
def test_tiny_layer_matches_reference(gpu_dep, tiny, tokens):
    failures = check_against_reference(gpu_dep, tiny, tokens, "tiny")
    collective_assert(gpu_dep.cpu_group, failures, seeds=tiny.seeds)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tokens", [1, 16])
def test_k3_widths_layer_matches_reference(gpu_dep, k3_widths, tokens):
    failures = check_against_reference(gpu_dep, k3_widths, tokens, "k3 widths")
    collective_assert(gpu_dep.cpu_group, failures, seeds=k3_widths.seeds)


@pytest.mark.mpi(min_size=1)
def test_layer_matches_reference_experts_backend(gpu_dep, tiny):
    """The same layer with ReferenceExperts (not capturable; host syncs) gives the reference."""
    n, rank, g = gpu_dep.size, gpu_dep.rank, TINY
    per_rank = g.experts // n
    experts = ReferenceExperts(tiny.synthetic.local_weights(rank * per_rank, per_rank).to("cuda"))
    layer = EpMoeLayer(tiny.overlap.dense, tiny.routed, experts, topk=g.topk)
    seeds = {**tiny.seeds, "x": agreed_seed(gpu_dep.cpu_group, 77)}
    counts = unequal_counts(20, n)
    x = draw_hidden(g.hidden, g.topk, tiny.dense, counts, torch.Generator().manual_seed(seeds["x"]))
    poison(tiny, counts, rank)
    out = layer(x[rank].cuda(), tokens=20)
    tiny.routed.synchronize()
    ref = layer_reference(x[rank], tiny.dense, tiny.synthetic.expert, g.topk)
    collective_assert(gpu_dep.cpu_group, compare_layer(out, ref, "ReferenceExperts"), seeds=seeds)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("schedule", ["overlap", "serial"])
def test_graph_replay_matches_eager(gpu_dep, tiny, schedule):
    """The layer (DenseExperts) captured once for T = 24 with n real rows, replayed REPLAYS
    times with fresh x copied into the static input: every replay equals an eager call on the
    same x bit for bit; one replay also matches the reference."""
    n, rank, g, tokens = gpu_dep.size, gpu_dep.rank, TINY, 24
    layer = tiny.overlap if schedule == "overlap" else tiny.serial
    seeds = {**tiny.seeds, "x": agreed_seed(gpu_dep.cpu_group, 88)}
    gen = torch.Generator().manual_seed(seeds["x"])
    counts = unequal_counts(tokens, n)

    def fresh():
        return draw_hidden(g.hidden, g.topk, tiny.dense, counts, gen)[rank]

    first = fresh()
    static = first.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on the capture stream
        layer(static, tokens=tokens)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier(gpu_dep.cpu_group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(static, tokens=tokens)
    failures = []
    for step in range(REPLAYS):
        x = first if step == 0 else fresh()
        static.copy_(x.cuda())
        captured.fill_(float("nan"))
        graph.replay()
        replayed = captured.clone()
        eager = layer(x.cuda(), tokens=tokens)
        tiny.routed.synchronize()
        if not bits_equal(replayed, eager):
            failures.append(f"replay {step} differs from eager")
            break
        if step == 0:
            ref = layer_reference(x, tiny.dense, tiny.synthetic.expert, g.topk)
            failures += compare_layer(replayed, ref, f"replay 0 ({schedule})")
    collective_assert(gpu_dep.cpu_group, failures, seeds=seeds)
