"""GPU kernels against the torch references, bit for bit; EpRouted on NVSHMEM buffers against the
all-gather reference; graph replay; many layers back to back. Several processes may share the GPU
(gloo group): correctness only, no timing."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.comm.reference import owner_ranks, rms_norm
from dep_ep.config import EpConfig
from dep_ep.cuda_graphs import capture_graph
from dep_ep.ep import TINY, EpRouted, MoeGeometry
from dep_ep.experts import DenseExperts, ReferenceExperts
from dep_ep.testing import SyntheticLayer, allgather_reference, internals
from dep_ep.testing.allgather_reference import NORM_EPS
from dep_ep.testing.compare import compare

from helpers.cases import agreed_seed, make_case
from helpers.collective import collective_assert
from helpers.dispatch_rows import check_rows, provenance_weights
from helpers.mxfp8_blocks import edge_blocks
from helpers.reference_check import check_ragged

MAX_TOKENS = 64
REPLAYS = int(os.environ.get("EP_TEST_REPLAYS", "1000"))
LAYERS = int(os.environ.get("EP_TEST_LAYERS", "1000"))


def build(gpu_dep, geometry, max_tokens, config=None):
    return EpRouted(
        gpu_dep.cpu_group,
        max_tokens,
        torch.device("cuda"),
        num_experts=geometry.experts,
        latent=geometry.latent,
        topk=geometry.topk,
        config=config or EpConfig(timeout_s=60.0),
    )


@pytest.fixture(scope="module")
def routed(gpu_dep):
    """TINY with the default combine path (one launch at these T)."""
    r = build(gpu_dep, TINY, MAX_TOKENS)
    yield r
    r.close()


def on_gpu(case, rank):
    dev = torch.device("cuda")
    return case.latent[rank].to(dev), case.ids[rank].to(dev), case.weights[rank].to(dev)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of bf16 tensors, any NaN equal to any NaN."""
    nan_a, nan_b = a.isnan(), b.isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(
        a.view(torch.int16)[~nan_a], b.view(torch.int16)[~nan_b]
    )


@pytest.mark.mpi(min_size=1)
def test_quantize_kernel_bit_exact(gpu_dep):
    from dep_ep.comm.device_transport import import_cute

    import_cute()
    from dep_ep.comm.kernels.mxfp8_quantize import Mxfp8QuantizeLaunch

    seed = agreed_seed(gpu_dep.cpu_group, 0)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.tensor(edge_blocks()).bfloat16()  # [blocks, 32]: L = 32
    scales = torch.exp2(torch.randint(-40, 40, (64, 1), generator=gen).float())
    rand = (torch.randn(64, 3584, generator=gen) * scales).bfloat16()
    failures = []
    for x in (blocks, rand):
        x = x.cuda()
        q = torch.full(x.shape, 0xEE, dtype=torch.uint8, device="cuda")
        sf = torch.full((x.shape[0], x.shape[1] // 32), 0xEE, dtype=torch.uint8, device="cuda")
        quantize = Mxfp8QuantizeLaunch(x.shape[1])
        quantize(x, q, sf, torch.cuda.current_stream().cuda_stream)
        want_q, want_sf = mxfp8_quantize(x.cpu())
        if not torch.equal(q.cpu(), want_q) or not torch.equal(sf.cpu(), want_sf):
            bad = (q.cpu() != want_q).nonzero()[:3].tolist()
            failures.append(f"L={x.shape[1]}: bytes differ at {bad}")
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


def poison_receive(routed):
    b = internals.buffers(routed)
    rows = b.layout.max_rows
    b.x(rows).fill_(0xFF)
    b.sf(rows).fill_(0xEE)
    b.ids(rows).fill_(-7)
    b.weights(rows).fill_(float("nan"))
    b.out(rows).fill_(float("nan"))
    torch.cuda.synchronize()


def dispatch_rows_failures(gpu_dep, routed, geometry, tokens, routing, misaligned=False):
    """Dispatch provenance-encoded rows into poisoned buffers and check this rank's receive rows
    bit for bit against the row contract (helpers.dispatch_rows). `misaligned`: the weights
    start 4 bytes past a 16-byte boundary (EpRouted stages them for the kernel's vector loads).
    Returns (failures, seed)."""
    n, rank = gpu_dep.size, gpu_dep.rank
    seed = agreed_seed(gpu_dep.cpu_group, tokens)
    case = make_case(geometry, n, tokens, seed, routing)
    weights = [provenance_weights(s, tokens, geometry.topk) for s in range(n)]
    poison_receive(routed)
    dist.barrier(gpu_dep.cpu_group)
    latent, ids, _ = on_gpu(case, rank)
    mine = weights[rank].cuda()
    if misaligned:
        flat = torch.empty(mine.numel() + 1, device="cuda")
        flat[1:].copy_(mine.flatten())
        mine = flat[1:].view(mine.shape)
    rows = routed.dispatch(latent, ids, mine)
    routed.synchronize()
    cpu_rows = type(rows)(*(t.cpu() for t in (rows.x, rows.sf, rows.ids, rows.weights, rows.out)))
    failures = check_rows(cpu_rows, case, weights, rank, n, tokens, geometry)
    rows.out.zero_()
    routed.combine(torch.ones(geometry.latent, dtype=torch.bfloat16, device="cuda"))
    routed.synchronize()
    return failures, seed


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "tokens,routing",
    [
        (1, "random"),
        (7, "random"),
        (MAX_TOKENS, "random"),
        (13, "skewed"),
        (12, "padded"),
        (5, "same"),
    ],
)
def test_dispatch_rows_bitwise(gpu_dep, routed, tokens, routing):
    failures, seed = dispatch_rows_failures(gpu_dep, routed, TINY, tokens, routing)
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


# K3's row widths (latent 3584, topk 16: ids and weights move in 16-byte vectors) over few experts.
WIDE = MoeGeometry("wide", hidden=512, latent=3584, experts=64, topk=16, intermediate=128)


def many_passes_tokens() -> int:
    """A T at which the kernels' pass loops run more than once and end on a partial pass: more
    than PASS_TOKENS tokens per dispatch CTA (a grid of at most CTAS_PER_SM CTAs an SM), and so
    more than 32 rows per CTA of the one-launch combine's send (one CTA an SM) on 2 ranks."""
    from dep_ep.comm.kernels.dispatch import PASS_TOKENS
    from dep_ep.constants import CTAS_PER_SM

    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return PASS_TOKENS * CTAS_PER_SM * sms + 5


@pytest.fixture(scope="module")
def routed_wide(gpu_dep):
    """WIDE, sized for many_passes_tokens(), the default combine path."""
    r = build(gpu_dep, WIDE, many_passes_tokens())
    yield r
    r.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "tokens,routing,misaligned",
    [
        (1, "random", False),
        (37, "padded", False),
        (29, "random", True),
        ("many", "random", False),
        ("many", "padded", False),
    ],
)
def test_dispatch_rows_bitwise_wide(gpu_dep, routed_wide, tokens, routing, misaligned):
    tokens = many_passes_tokens() if tokens == "many" else tokens
    failures, seed = dispatch_rows_failures(gpu_dep, routed_wide, WIDE, tokens, routing, misaligned)
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


# latent 2080 = 260 chunks of 8: lanes hold unequal chunk counts (the combine's guarded path).
ODD = MoeGeometry("odd", hidden=512, latent=2080, experts=48, topk=6, intermediate=128)


def pull_config() -> EpConfig:
    return EpConfig(timeout_s=60.0)


@pytest.fixture(scope="module")
def routed_path(gpu_dep):
    """TINY, sized for MAX_TOKENS."""
    r = build(gpu_dep, TINY, MAX_TOKENS, pull_config())
    yield r
    r.close()


@pytest.fixture(scope="module")
def routed_odd(gpu_dep):
    """ODD, sized for 16 tokens."""
    r = build(gpu_dep, ODD, 16, pull_config())
    yield r
    r.close()


def check_combine_bitwise(gpu_dep, routed, geometry, tokens, routing, scale=1.0):
    """Expert outputs drawn from (seed, rank) on every rank, times `scale` (1e30: every row's
    squares overflow fp32, the norm's rescaled path); combine must equal the torch reference
    (rank-ordered fp32 sum + rms_norm) bit for bit. Returns (failures, seed)."""
    n, rank = gpu_dep.size, gpu_dep.rank
    seed = agreed_seed(gpu_dep.cpu_group, 7)
    case = make_case(geometry, n, tokens, seed, routing)
    gens = [torch.Generator().manual_seed(seed + d) for d in range(n)]
    outs = [
        (torch.randn(n * tokens, geometry.latent, generator=gens[d]) * scale).to(torch.bfloat16)
        for d in range(n)
    ]
    if routing == "nan":
        outs[0][3, 5] = float("nan")
    norm = 1 + 0.1 * torch.randn(geometry.latent, generator=torch.Generator().manual_seed(seed))
    norm = norm.to(torch.bfloat16)
    poison_receive(routed)
    dist.barrier(gpu_dep.cpu_group)
    latent, ids, weights = on_gpu(case, rank)
    rows = routed.dispatch(latent, ids, weights)
    hit = (rows.ids >= 0).any(dim=1)
    rows.out.copy_(torch.where(hit.unsqueeze(1), outs[rank].cuda(), float("nan")))
    normed = routed.combine(norm.cuda())
    routed.synchronize()
    owners = owner_ranks(case.ids[rank], geometry.experts // n)
    total = torch.zeros(tokens, geometry.latent)
    for d in range(n):
        mine = (owners == d).any(dim=1).nonzero().squeeze(1)
        total[mine] += outs[d][rank * tokens + mine].float()
    want = rms_norm(total, norm, NORM_EPS)
    got = normed.cpu()
    if bits_equal(got, want):
        return [], seed
    where = f"L={geometry.latent} T={tokens} {routing}"
    return [f"{where}: combine differs: {describe_rows(got, want, owners)}"], seed


def describe_rows(got: torch.Tensor, want: torch.Tensor, owners: torch.Tensor) -> str:
    """The rows where bf16 [T, L] `got` and `want` differ (any NaN equal to any NaN): how many,
    and for the first few the token, its owner ranks, the differing elements (NaN in got / in
    want) and the first differing column."""
    nan_got, nan_want = got.isnan(), want.isnan()
    same = (got.view(torch.int16) == want.view(torch.int16)) | (nan_got & nan_want)
    rows = (~same).any(dim=1).nonzero().squeeze(1).tolist()
    parts = []
    for t in rows[:6]:
        cols = (~same[t]).nonzero().squeeze(1)
        ranks = sorted(set(owners[t][owners[t] >= 0].tolist()))
        c = int(cols[0])
        parts.append(
            f"token {t} (ranks {ranks}): {cols.numel()} elements, NaN got"
            f" {int(nan_got[t].sum())} / want {int(nan_want[t].sum())}, first column"
            f" {c}: {float(got[t, c])} vs {float(want[t, c])}"
        )
    return f"{len(rows)} rows; " + "; ".join(parts)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "tokens,routing",
    [(1, "random"), (9, "padded"), (MAX_TOKENS, "skewed"), (10, "nan"), (33, "ragged")],
)
def test_combine_bitwise(gpu_dep, routed_path, tokens, routing):
    failures, seed = check_combine_bitwise(gpu_dep, routed_path, TINY, tokens, routing)
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("scale", [1.0, 1e30])
def test_combine_bitwise_unequal_lanes(gpu_dep, routed_odd, scale):
    """A lane's last chunk is missing (L = 2080); at 1e30 every row takes the overflow-safe
    norm, whose largest magnitude must come from the chunks the lane holds."""
    failures, seed = check_combine_bitwise(gpu_dep, routed_odd, ODD, 13, "padded", scale)
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


@pytest.fixture(scope="module")
def routed_wide_path(gpu_dep):
    """WIDE, sized for many_passes_tokens()."""
    tokens = many_passes_tokens()
    r = build(gpu_dep, WIDE, tokens, pull_config())
    yield r
    r.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tokens,routing", [(1, "random"), ("many", "padded"), ("many", "nan")])
def test_combine_bitwise_wide(gpu_dep, routed_wide_path, tokens, routing):
    tokens = many_passes_tokens() if tokens == "many" else tokens
    failures, seed = check_combine_bitwise(gpu_dep, routed_wide_path, WIDE, tokens, routing)
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)


# The combine's tunings other than the default (docs/perf_notes.md): two groups a CTA (their
# own named barriers and exchange slots), fewer CTAs an SM (more tokens a group), no cap.
COMBINE_TUNINGS = {
    "warps-4": {"combine_warps": 4, "combine_ctas_per_sm": 8},
    "ctas-1": {"combine_ctas_per_sm": 1},
    "waves": {"combine_ctas_per_sm": 0},
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tuning", sorted(COMBINE_TUNINGS))
@pytest.mark.parametrize("case", ["wide-many", "odd-overflow"])
def test_combine_bitwise_tunings(gpu_dep, routed_wide_path, routed_odd, tuning, case):
    """Every combine tuning gives the reference's bits: WIDE at many_passes_tokens() (the groups
    loop over several tokens, their exchange slots reused), and ODD at 1e30 (every row takes
    the rescaled norm, three exchanges a token)."""
    from dep_ep.comm.kernels.launch_args import KernelTuning

    routed, geometry, tokens, routing, scale = (
        (routed_wide_path, WIDE, many_passes_tokens(), "padded", 1.0)
        if case == "wide-many"
        else (routed_odd, ODD, 13, "padded", 1e30)
    )
    transport = internals.transport(routed)
    transport.retune(KernelTuning(**COMBINE_TUNINGS[tuning]))
    try:
        failures, seed = check_combine_bitwise(gpu_dep, routed, geometry, tokens, routing, scale)
    finally:
        transport.retune(None)
    collective_assert(gpu_dep.cpu_group, [f"{tuning}: {f}" for f in failures], seeds=seed)


def experts_for(kind, layer, rank, n):
    per_rank = TINY.experts // n
    return kind(layer.local_weights(rank * per_rank, per_rank).to("cuda"))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "tokens,routing",
    [(1, "random"), (17, "padded"), (MAX_TOKENS, "random"), (11, "duplicate"), (10, "nan")],
)
def test_routed_matches_allgather_reference(gpu_dep, routed_path, tokens, routing):
    routed, n, rank = routed_path, gpu_dep.size, gpu_dep.rank
    seed = agreed_seed(gpu_dep.cpu_group, 3)
    layer = SyntheticLayer(TINY, seed)
    experts = experts_for(ReferenceExperts, layer, rank, n)
    case = make_case(TINY, n, tokens, seed, routing)
    latent, ids, weights = on_gpu(case, rank)
    out = routed.routed(latent, ids, weights, layer.norm_weight().cuda(), experts=experts)
    routed.synchronize()
    ref = allgather_reference(
        gpu_dep.cpu_group,
        case.latent[rank],
        case.ids[rank],
        case.weights[rank],
        layer.norm_weight(),
        layer.expert,
    )
    failures = compare(out.cpu(), ref, f"T={tokens} {routing}")
    collective_assert(gpu_dep.cpu_group, failures, seeds={"layer and case": seed})


@pytest.mark.mpi(min_size=1)
def test_ragged_token_counts(gpu_dep, routed):
    """Ranks with different real token counts (one idle on >= 3 ranks) padded to one T: real rows
    match the all-gather reference, padding rows are exactly +0.0."""
    n, rank = gpu_dep.size, gpu_dep.rank
    group = gpu_dep.cpu_group
    seeds = {"layer": agreed_seed(group, 13), "case": agreed_seed(group, 14)}
    layer = SyntheticLayer(TINY, seeds["layer"])
    experts = experts_for(ReferenceExperts, layer, rank, n)
    case = make_case(TINY, n, 40, seeds["case"], "ragged")
    out = routed.routed(*on_gpu(case, rank), layer.norm_weight().cuda(), experts=experts)
    routed.synchronize()
    ref = allgather_reference(
        gpu_dep.cpu_group,
        case.latent[rank],
        case.ids[rank],
        case.weights[rank],
        layer.norm_weight(),
        layer.expert,
    )
    collective_assert(gpu_dep.cpu_group, check_ragged(out.cpu(), ref, rank, n), seeds=seeds)


def fresh_inputs(gen, tokens, n_experts):
    latent = torch.randn(tokens, TINY.latent, generator=gen, device="cuda").to(torch.bfloat16)
    perms = [torch.randperm(n_experts, generator=gen, device="cuda") for _ in range(tokens)]
    ids = torch.stack([p[: TINY.topk] for p in perms]).int()
    weights = torch.rand(tokens, TINY.topk, generator=gen, device="cuda") + 0.05
    return latent, ids, weights / weights.sum(1, keepdim=True)


@pytest.mark.mpi(min_size=1)
def test_graph_replay_matches_eager(gpu_dep, routed_path):
    """routed() for a fixed T captured once, replayed REPLAYS times with fresh inputs copied into
    the captured buffers: every replay equals, bit for bit, an eager call on the same inputs."""
    routed, n, rank, tokens = routed_path, gpu_dep.size, gpu_dep.rank, 24
    seeds = {
        "layer": agreed_seed(gpu_dep.cpu_group, 11),
        "inputs (plus the rank)": agreed_seed(gpu_dep.cpu_group, 1000),
    }
    layer = SyntheticLayer(TINY, seeds["layer"])
    experts = experts_for(DenseExperts, layer, rank, n)
    norm = layer.norm_weight().cuda()
    gen = torch.Generator(device="cuda").manual_seed(seeds["inputs (plus the rank)"] + rank)
    static = [t.clone() for t in fresh_inputs(gen, tokens, TINY.experts)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on the capture stream
        routed.routed(*static, norm, experts=experts)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier(gpu_dep.cpu_group)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        captured = routed.routed(*static, norm, experts=experts)
    failures = []
    for step in range(REPLAYS):
        fresh = fresh_inputs(gen, tokens, TINY.experts)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        replayed = captured.clone()
        eager = routed.routed(*fresh, norm, experts=experts)
        routed.synchronize()
        if not bits_equal(replayed, eager):
            failures.append(f"replay {step} differs from eager")
            break
    collective_assert(gpu_dep.cpu_group, failures, seeds=seeds)


@pytest.mark.mpi(min_size=1)
def test_many_layers_back_to_back(gpu_dep, routed):
    """LAYERS routed calls alternating two layers, fresh data and T each time, no host sync in
    between; every 100th checked against the all-gather reference, every output finite."""
    n, rank = gpu_dep.size, gpu_dep.rank
    seeds = {f"layer {i}": agreed_seed(gpu_dep.cpu_group, 20 + i) for i in range(2)}
    seeds["steps"] = agreed_seed(gpu_dep.cpu_group, 5)  # draws every step's T and case seed
    layers = [SyntheticLayer(TINY, seeds[f"layer {i}"]) for i in range(2)]
    experts = [experts_for(DenseExperts, layer, rank, n) for layer in layers]
    norms = [layer.norm_weight().cuda() for layer in layers]
    gen = torch.Generator().manual_seed(seeds["steps"])
    failures = []
    finite = torch.ones((), dtype=torch.bool, device="cuda")
    for step in range(LAYERS):
        tokens = int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=gen))
        case = make_case(TINY, n, tokens, int(torch.randint(0, 2**31, (1,), generator=gen)))
        which = step % 2
        out = routed.routed(*on_gpu(case, rank), norms[which], experts=experts[which])
        finite &= out.isfinite().all()
        if step % 100 == 99:
            routed.synchronize()
            ref = allgather_reference(
                gpu_dep.cpu_group,
                case.latent[rank],
                case.ids[rank],
                case.weights[rank],
                layers[which].norm_weight(),
                layers[which].expert,
            )
            failures += compare(out.cpu(), ref, f"layer step {step}")
    routed.synchronize()
    if not bool(finite):
        failures.append("a non-finite output")
    collective_assert(gpu_dep.cpu_group, failures, seeds=seeds)


@pytest.mark.mpi(min_size=2)
def test_out_rows_are_free_once_combine_completes(gpu_dep, routed):
    """The peers read this rank's expert output rows where they lie; a combine launch completes
    only once every rank has read them (its combine-end flags). Rank 0 overwrites its rows on
    the stream right after each call, with no host sync or collective between the steps: every
    rank's outputs stay the reference's (the overwrite is NaN: a row read after it shows)."""
    n, rank = gpu_dep.size, gpu_dep.rank
    seed = agreed_seed(gpu_dep.cpu_group, 31)
    layer = SyntheticLayer(TINY, seed)
    experts = experts_for(DenseExperts, layer, rank, n)
    norm = layer.norm_weight().cuda()
    cases = [make_case(TINY, n, 16, seed + i) for i in range(3)]
    refs = [
        allgather_reference(
            gpu_dep.cpu_group,
            c.latent[rank],
            c.ids[rank],
            c.weights[rank],
            layer.norm_weight(),
            layer.expert,
        )
        for c in cases
    ]
    inputs = [on_gpu(c, rank) for c in cases]
    dist.barrier(gpu_dep.cpu_group)
    outs = []
    for step in range(60):
        outs.append(routed.routed(*inputs[step % 3], norm, experts=experts))
        if rank == 0:
            routed.receive(16).out.fill_(float("nan"))
    routed.synchronize()
    failures = []
    for step, out in enumerate(outs):
        failures += compare(out.cpu(), refs[step % 3], f"step {step}")
    collective_assert(gpu_dep.cpu_group, failures[:3], seeds=seed)


@pytest.mark.mpi(min_size=1)
def test_strided_latent_and_out_buffer(gpu_dep, routed):
    """The dispatch kernel reading a latent that is a column slice of a wider tensor (rows of
    S + L + 16 elements) gives the bits of the contiguous latent, on fresh rows; combine into a
    caller's buffer (in place at n = T, copied at n < T) gives the bits of a new output; a step
    of more tokens than max_tokens (in pieces) the bits of the steps it is made of."""
    n, rank = gpu_dep.size, gpu_dep.rank
    seed = agreed_seed(gpu_dep.cpu_group, 77)
    layer = SyntheticLayer(TINY, seed)
    experts = experts_for(DenseExperts, layer, rank, n)
    norm = layer.norm_weight().cuda()
    tokens = 13
    latent, ids, weights = on_gpu(make_case(TINY, n, tokens, seed + 1), rank)
    S, L = 48, TINY.latent
    wide = torch.randn(tokens, S + L + 16, device="cuda").to(torch.bfloat16)
    wide[:, S : S + L] = latent
    failures = []
    want = routed(latent, ids, weights, norm, experts=experts)
    got = routed(wide[:, S : S + L], ids, weights, norm, experts=experts)
    if not bits_equal(got, want):
        failures.append("column-slice latent: other bits than the contiguous one")
    buf = torch.full_like(want, float("nan"))
    if routed(latent, ids, weights, norm, experts=experts, out=buf) is not buf:
        failures.append("out=: not the caller's buffer")
    if not bits_equal(buf, want):
        failures.append("out= (in place): other bits")
    part = torch.full_like(want[:9], float("nan"))
    routed(latent[:9], ids[:9], weights[:9], norm, experts=experts, tokens=tokens, out=part)
    if not bits_equal(
        part, routed(latent[:9], ids[:9], weights[:9], norm, experts=experts, tokens=tokens)
    ):
        failures.append("out= (n < T, copied): other bits")
    big = 3 * MAX_TOKENS + 5
    latent, ids, weights = on_gpu(make_case(TINY, n, big, seed + 2), rank)
    pieces = routed(latent, ids, weights, norm, experts=experts, tokens=big)
    for start in range(0, big, MAX_TOKENS):
        stop = min(start + MAX_TOKENS, big)
        one = routed(
            latent[start:stop], ids[start:stop], weights[start:stop], norm, experts=experts
        )
        if not bits_equal(pieces[start:stop], one):
            failures.append(f"a step in pieces: rows {start}..{stop} differ from their step")
    routed.synchronize()
    collective_assert(gpu_dep.cpu_group, failures, seeds=seed)
