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
stream's work is router + shared. Times: medians over samples of CUDA-event-timed graph replays
(REPS calls per replay; eager when capture fails, marked), ranks lined up by a host barrier before
each sample, the slowest rank's median reported. Ranks sharing one GPU are time-sliced: refused.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bench.timing import timed_us
from dep_ep.config import EpConfig
from dep_ep.ep import K3, EpMoeLayer, EpRouted
from dep_ep.experts import ExpertsBackend
from dep_ep.launch import init_rank_context, new_dep_group, teardown

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
REPS = 10  # calls captured per graph
SAMPLES = 20
PARTS = ("front", "router", "shared", "routed", "up")
SHARED = 2 * K3.intermediate  # S: the shared MLP's intermediate (experts/checkpoint.py)


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
    H, L, E, S = K3.hidden, K3.latent, K3.experts, SHARED
    shapes = {
        "gate.weight": (E, H), "routed_expert_down_proj.weight": (L, H),
        "routed_expert_up_proj.weight": (H, L), "shared_experts.gate_proj.weight": (S, H),
        "shared_experts.up_proj.weight": (S, H), "shared_experts.down_proj.weight": (H, S),
    }  # fmt: skip
    out = {name: (torch.randn(shape, generator=gen, device="cuda") / math.sqrt(shape[1]))
           .to(torch.bfloat16) for name, shape in shapes.items()}  # fmt: skip
    out["gate.e_score_correction_bias"] = 0.01 * torch.randn(E, generator=gen, device="cuda")
    norm = 1 + 0.1 * torch.randn(L, generator=gen, device="cuda")
    out["routed_expert_norm.weight"] = norm.to(torch.bfloat16)
    return out


def slowest(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="docs", help="folder for bench_layer.md and bench_layer.png")
    p.add_argument("--tokens", type=int, nargs="*", default=TOKENS, help="tokens per rank T")
    args = p.parse_args()
    ctx = init_rank_context("cuda", timeout_s=300.0)
    if ctx.backend != "nccl":
        raise SystemExit("bench_layer.py: needs one GPU per rank (ranks sharing a GPU time-slice)")
    n, rank = ctx.world_size, ctx.rank
    dep = new_dep_group(ctx, n)
    cpu = dep.cpu_group
    routed = EpRouted(cpu, max(args.tokens), "cuda", num_experts=K3.experts, latent=K3.latent,
                      topk=K3.topk, config=EpConfig(timeout_s=60.0))  # fmt: skip
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
            us, mode = timed_us(fn, cpu, REPS, SAMPLES)
            routed.synchronize()
            row[name] = slowest(us, cpu)
            modes.add(mode)
        row["modes"] = "/".join(sorted(modes))
        row["bitwise"] = bool(slowest(0.0 if same else 1.0, cpu) == 0.0)
        results.append(row)
        if rank == 0:
            print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()},
                  flush=True)  # fmt: skip
    routed.close()
    if rank == 0:
        write_report(Path(args.out), results, n)
    teardown(ctx)
    return 0


def write_report(out: Path, results: list[dict], n: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    lines = [
        f"# K3 MoE layer, {n} GPU(s), one process per GPU: overlapped schedule against serial", "",
        f"GPU: {n} x {gpu}. Date: {date}. Command: `torchrun --nproc-per-node {n}"
        " -m bench.bench_layer --out OUTDIR`. K3 geometry (H 7168, L 3584, S 6144, E 896,"
        f" K 16, {K3.experts // n} experts per rank), random dense weights.", "",
        "Experts: a stand-in that writes zeros into the expert output rows (no expert GEMMs): the"
        " routed column is dispatch + combine (+ RMSNorm) + that memset. The point is the"
        " schedule around the routed path. Times: us, medians of CUDA-event-timed graph replays,"
        " slowest rank. hidden = serial - overlap; side = router + shared (the side stream's"
        " work); % hidden = hidden / side. bitwise: the two schedules' outputs equal bit for bit.",
        "",
        "| T | front | router | shared | routed | up | serial | overlap | hidden | % hidden |"
        " bitwise | timing |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in results:
        hidden = r["serial"] - r["overlap"]
        side = r["router"] + r["shared"]
        parts = " | ".join(f"{r[name]:.1f}" for name in PARTS)
        lines.append(
            f"| {r['tokens']} | {parts} | {r['serial']:.1f} | {r['overlap']:.1f} | {hidden:.1f} |"
            f" {100 * hidden / side:.0f}% | {'yes' if r['bitwise'] else 'NO'} | {r['modes']} |"
        )
    lines.append("")
    plotted = plot(out / "bench_layer.png", results, n, gpu, date)
    lines.append("![parts and wholes against T](bench_layer.png)" if plotted else
                 "No plot: matplotlib is not importable here.")  # fmt: skip
    lines.append("")
    (out / "bench_layer.md").write_text("\n".join(lines))


def plot(path: Path, results: list[dict], n: int, gpu: str, date: str) -> bool:
    """Parts and wholes against T, and the hidden share; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ts = [r["tokens"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for name in PARTS:
        a.semilogx(ts, [r[name] for r in results], "o--", label=name)
    for name in ("serial", "overlap"):
        a.semilogx(ts, [r[name] for r in results], "s-", linewidth=2, label=f"layer, {name}")
    a.set_xlabel("tokens per rank T"), a.set_ylabel("us"), a.set_title("parts and the layer")
    a.legend(fontsize=8), a.grid(True, which="both", alpha=0.3)
    hidden = [r["serial"] - r["overlap"] for r in results]
    b.semilogx(ts, hidden, "o-", label="hidden us (serial - overlap)")
    b.semilogx(ts, [r["router"] + r["shared"] for r in results], "s--", label="side-stream work us")
    b.set_xlabel("tokens per rank T"), b.set_ylabel("us"), b.set_title("what the overlap hides")
    b.legend(fontsize=8), b.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"K3 MoE layer, {n} x {gpu}, zero-cost experts, {date}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


if __name__ == "__main__":
    sys.exit(main())
