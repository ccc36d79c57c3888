"""EpMoeLayer on CUDA (NVSHMEM buffers, CuTeDSL kernels): against the float64 reference of the
K3 formula with its error model (tests/helpers/layer_case.py); the overlapped schedule against the
serial order bit for bit; CUDA-graph capture and replay (DenseExperts). TINY, and K3's widths
(H 7168, L 3584, S 6144, E 896, K 16) with an expert intermediate of 32 so that DenseExperts
fits. Several processes may share the GPU (gloo group): correctness only, no timing.

    mpirun -n 2 python -m pytest -q --with-mpi tests/gpu/test_gpu_layer.py

The reference, the input drawing and the tolerance are tests/helpers/layer_case.py's (as
tests/test_layer_mpi.py's); its docstring derives the tolerance.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from dep_ep.config import EpConfig, MoeGeometry
from dep_ep.cuda_graphs import capture_graph
from dep_ep.ep import K3, TINY, EpMoeLayer, EpRouted
from dep_ep.experts import DenseExperts, ReferenceExperts
from dep_ep.testing import SyntheticLayer

from helpers.cases import agreed_seed
from helpers.collective import collective_assert
from helpers.layer_case import (
    compare_layer,
    draw_hidden,
    layer_reference,
    make_dense,
    unequal_counts,
)

MAX_TOKENS = 64
REPLAYS = int(os.environ.get("EP_TEST_REPLAYS", "200"))
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
    x = draw_hidden(g, setup.dense, counts, gen)[rank]
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
    return failures + compare_layer(outs["overlap"], ref, f"{label} T={tokens}")[0]


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
    x = draw_hidden(g, tiny.dense, counts, seeds["x"])
    poison(tiny, counts, rank)
    out = layer(x[rank].cuda(), tokens=20)
    tiny.routed.synchronize()
    ref = layer_reference(x[rank], tiny.dense, tiny.synthetic.expert, g.topk)
    failures = compare_layer(out, ref, "ReferenceExperts")[0]
    collective_assert(gpu_dep.cpu_group, failures, seeds=seeds)


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
        return draw_hidden(g, tiny.dense, counts, gen)[rank]

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
    with capture_graph(graph):
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
            failures += compare_layer(replayed, ref, f"replay 0 ({schedule})")[0]
    collective_assert(gpu_dep.cpu_group, failures, seeds=seeds)
