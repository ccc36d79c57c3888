"""K3 MoE layer benchmark, one process per GPU: EpMoeLayer's parts and the whole layer, the
overlapped schedule against the serial order, in one run.

    torchrun --nproc-per-node N -m bench.bench_layer --out OUTDIR   # OUTDIR/bench_layer.md, .png

Geometry: K3 (H 7168, L 3584, S 6144, E 896, K 16), seeded random dense weights (BF16, 0.38 GB
a rank). Experts: a stand-in backend that writes zeros into the expert output rows
(ZeroExperts; the real K3 experts do not fit DenseExperts, and the point here is the schedule
around the routed path): the routed path's time is dispatch + combine (+ RMSNorm) + a memset of
the rows, without expert GEMMs. Parts, each timed alone on the current stream: front (the packed
GEMM over the shared gate/up and the latent down projection, plus the latent's copy), router
(fp32 GEMM, sigmoid, top-K, weights), shared (SiTU + shared down projection), routed (EpRouted
with ZeroExperts), up (the up projection added into the shared output, one addmm). Wholes: the
layer with schedule="serial" and with schedule="overlap". hidden = serial - overlap; the side
stream's work is router + shared. Times: medians over --samples of CUDA-event-timed graph replays
(--reps calls per replay; eager when capture fails, marked), ranks lined up by a host barrier before
each sample, the slowest rank's median reported. Ranks sharing one GPU are time-sliced: refused.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from bench import cli, report
from bench.ranks import slowest
from bench.timing import timed_us
from dep_ep.config import EpConfig
from dep_ep.ep import K3, EpMoeLayer, EpRouted
from dep_ep.experts import ExpertsBackend
from dep_ep.experts.checkpoint import BIAS, NORM, dense_shapes
from dep_ep.launch import init_rank_context, new_dep_group, teardown

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
REPS = 10  # calls captured per graph
SAMPLES = 20
PARTS = ("front", "router", "shared", "routed", "up")


class ZeroExperts(ExpertsBackend):
    """Stand-in experts: write zeros into every expert output row (no GEMMs)."""

    def __init__(self, first_expert: int, num_local_experts: int, latent: int) -> None:
        self.first_expert, self.num_local_experts = first_expert, num_local_experts
        self.latent = latent

    def forward(self, x, sf, ids, weights, out):
        return out.zero_()


def dense_weights(seed: int) -> dict[str, torch.Tensor]:
    """K3's dense tensors on the GPU, random with rms 1/sqrt(fan_in)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # The projections, in dense_shapes' order, then the bias and the norm weight.
    shapes = {
        name: shape for name, (shape, _) in dense_shapes(K3).items() if name not in (BIAS, NORM)
    }

    def draw(shape: tuple[int, int]) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device="cuda") / math.sqrt(shape[1])).bfloat16()

    out = {name: draw(shape) for name, shape in shapes.items()}
    out[BIAS] = 0.01 * torch.randn(K3.experts, generator=gen, device="cuda")
    norm = 1 + 0.1 * torch.randn(K3.latent, generator=gen, device="cuda")
    out[NORM] = norm.to(torch.bfloat16)
    return out


def main() -> int:
    page = "bench_layer.md and bench_layer.png"
    args = cli.parser(__doc__, page=page, tokens=TOKENS, timing=(REPS, SAMPLES)).parse_args()
    ctx = init_rank_context("cuda", timeout_s=300.0)
    if ctx.backend != "nccl":
        raise SystemExit(
            "bench.bench_layer: needs one GPU per rank (ranks sharing a GPU time-slice)"
        )
    n, rank = ctx.world_size, ctx.rank
    dep = new_dep_group(ctx, n)
    cpu = dep.cpu_group
    routed = EpRouted(
        cpu,
        max(args.tokens),
        "cuda",
        num_experts=K3.experts,
        latent=K3.latent,
        topk=K3.topk,
        config=EpConfig(timeout_s=60.0),
    )
    experts = ZeroExperts(routed.first_expert, routed.experts_per_rank, K3.latent)
    overlap = EpMoeLayer(dense_weights(1234), routed, experts, topk=K3.topk)
    serial = EpMoeLayer(overlap.dense, routed, experts, topk=K3.topk, schedule="serial")
    gen = torch.Generator(device="cuda").manual_seed(99 + rank)
    results = []
    for tokens in args.tokens:
        x = torch.randn(tokens, K3.hidden, generator=gen, device="cuda").to(torch.bfloat16)
        front = overlap.front(x)
        ids, weights = overlap.router(x)
        latent = overlap.latent_of(front)
        normed = overlap.routed_path(latent, ids, weights, tokens=tokens)
        scratch = overlap.shared(front)  # `up` adds into it on every call
        same = torch.equal(overlap(x).view(torch.int16), serial(x).view(torch.int16))
        routed.synchronize()
        calls = {
            "front": lambda: overlap.latent_of(overlap.front(x)),
            "router": lambda: overlap.router(x),
            "shared": lambda: overlap.shared(front),
            "routed": lambda: overlap.routed_path(latent, ids, weights, tokens=tokens),
            "up": lambda: overlap.up(normed, scratch),
            "serial": lambda: serial(x, tokens=tokens),
            "overlap": lambda: overlap(x, tokens=tokens),
        }
        row, modes = {"tokens": tokens}, set()
        for name, fn in calls.items():
            us, mode = timed_us(fn, cpu, args.reps, args.samples)
            routed.synchronize()
            row[name] = slowest(us, cpu)
            modes.add(mode)
        row["modes"] = "/".join(sorted(modes))
        row["bitwise"] = bool(slowest(0.0 if same else 1.0, cpu) == 0.0)
        results.append(row)
        if rank == 0:
            print(
                {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True
            )
    routed.close()
    if rank == 0:
        write_report(args.out, results, n)
    teardown(ctx)
    return 0


def write_report(out: Path, results: list[dict], n: int, run: report.Run | None = None) -> Path:
    """OUTDIR/bench_layer.md and .png from the rows of `main` (us per part and whole)."""
    run = run or report.Run.this_process(n)
    title = f"K3 MoE layer, {n} GPU(s), one process per GPU: overlapped schedule against serial"
    page = report.Page(out / "bench_layer.md", title, report.summary(__doc__), run)
    page.text(
        f"K3 geometry (H 7168, L 3584, S 6144, E 896, K 16, {K3.experts // n} experts per rank),"
        " random dense weights.",
    )
    page.text(
        "Experts: a stand-in that writes zeros into the expert output rows (no expert GEMMs): the"
        " routed column is dispatch + combine (+ RMSNorm) + that memset. The point is the"
        " schedule around the routed path. Times: us, medians of CUDA-event-timed graph replays,"
        " slowest rank. hidden = serial - overlap; side = router + shared (the side stream's"
        " work); % hidden = hidden / side. bitwise: the two schedules' outputs equal bit for bit.",
    )
    columns = ["T", *PARTS, *"serial | overlap | hidden | % hidden | bitwise | timing".split(" | ")]
    rows = []
    for r in results:
        hidden = r["serial"] - r["overlap"]
        side = r["router"] + r["shared"]
        parts = [f"{r[name]:.1f}" for name in PARTS]
        rows.append(
            [
                r["tokens"],
                *parts,
                f"{r['serial']:.1f}",
                f"{r['overlap']:.1f}",
                f"{hidden:.1f}",
                f"{100 * hidden / side:.0f}%",
                "yes" if r["bitwise"] else "NO",
                r["modes"],
            ]
        )
    page.table(columns, rows)
    ts = [r["tokens"] for r in results]
    parts = [report.Series(name, ts, [r[name] for r in results], "o--") for name in PARTS]
    parts += [
        report.Series(f"layer, {name}", ts, [r[name] for r in results], "s-", bold=True)
        for name in ("serial", "overlap")
    ]
    hidden = [r["serial"] - r["overlap"] for r in results]
    side = [r["router"] + r["shared"] for r in results]
    hides = [
        report.Series("hidden us (serial - overlap)", ts, hidden),
        report.Series("side-stream work us", ts, side, "s--"),
    ]
    panels = [
        report.Panel("tokens per rank T", "us", parts, title="parts and the layer"),
        report.Panel("tokens per rank T", "us", hides, title="what the overlap hides"),
    ]
    page.plot(report.Figure(f"K3 MoE layer, {run.hardware}, zero-cost experts, {run.date}", panels))
    return page.write()


if __name__ == "__main__":
    sys.exit(main())
