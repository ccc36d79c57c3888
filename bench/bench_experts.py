"""Experts backends on one GPU at K3 geometry: HopperExperts against the weight-read floor, beside
ReferenceExperts, at 56, 112 and 448 local experts (rank 0 of 16, 8 and 2 ranks), T = 1..256 tokens
per rank, all measured in the same run.

    python -m bench.bench_experts     # writes docs/results/bench_experts.md and .png

Receive rows as rank 0 of `ranks` would get them: ranks * T tokens, each with K3's 16 distinct
random experts of 896, keeping the tokens with at least one of rank 0's experts.
- HopperExperts (VARIANTS: HummingEngine, its kernels chosen for the pairs expected from
  num_experts, with the one-launch grouping kernel (the default) and with the torch grouping;
  HummingEngine(tune_for_capacity=True), its kernels chosen for the pair capacity; TritonEngine):
  CUDA-graph replay of `--reps` back-to-back calls on the same rows (a call has no host
  synchronisation), median of `--samples` replays, per call; one eager call first (humming
  compiles its kernels for a new pair count there).
- ReferenceExperts: eager (it reads sizes back to the host), median of CUDA-event-timed calls;
  skipped at 448 local experts (its BF16 cache would take 29.6 GB).
- Floor: the MXFP4 weights and scales of the experts the rows touch (17,547,264 bytes each at K3)
  read once at the copy bandwidth measured in the same run.
- diff: relative L2 between each variant and ReferenceExperts on the same rows.
- grouping: the grouping and tile routes alone (block_n 16), group_pairs + tile_routes (torch)
  and group_and_route (one Triton launch), graph replay like HopperExperts.
"""

from __future__ import annotations

import datetime
import math
import sys
from pathlib import Path

import torch

from bench import cli, report
from bench.timing import capture, replay_us, time_us
from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.constants import SCALE_BLOCK
from dep_ep.ep import K3
from dep_ep.experts import ReferenceExperts
from dep_ep.experts.hopper import HopperExperts, HopperTiles, HummingEngine, TritonEngine
from dep_ep.experts.hopper.grouping import group_pairs, tile_routes
from dep_ep.experts.hopper.grouping_kernel import group_and_route
from dep_ep.testing.synthetic import SyntheticLayer, synthetic_ids

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
LOCAL_EXPERTS = [56, 112, 448]
REFERENCE_MAX_LOCAL = 112
REPS, SAMPLES = 10, 20  # calls per captured graph, timed replays (median)
# w13 + s13 + w2 + s2 of one K3 expert: 3 * I * L / 2 code bytes + 3 * I * L / 32 scale bytes.
EXPERT_BYTES = 3 * K3.intermediate * K3.latent // 2 + 3 * K3.intermediate * K3.latent // SCALE_BLOCK


def copy_gbs() -> float:
    """Device-to-device copy bandwidth of a 1 GiB buffer (read + write bytes per second)."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), 1, 10)
    return 2 * 4 * src.numel() / (us * 1e-6) / 1e9


def receive_rows(
    ranks: int, tokens: int, local: int, gen: torch.Generator, routing: str = "uniform"
):
    """(x, sf, ids, weights) of the tokens among ranks * tokens with an id in [0, local), routed
    by synthetic_ids(routing): under "hot" expert 0, a local one, is every token's first choice."""
    ids = synthetic_ids(ranks * tokens, K3.experts, K3.topk, routing, gen, "cuda")
    ids = ids[(ids < local).any(dim=1)].contiguous()
    latent = torch.randn(ids.shape[0], K3.latent, device="cuda", generator=gen).bfloat16()
    weights = torch.rand(ids.shape[0], K3.topk, device="cuda", generator=gen)
    x, sf = mxfp8_quantize(latent)
    return x, sf, ids, weights


def graph_us(backend, rows, launches: int, samples: int) -> float:
    """Median us per call of `backend` on `rows`, in graph replay."""
    out = torch.empty(rows[0].shape[0], K3.latent, dtype=torch.bfloat16, device="cuda")
    graph = capture(lambda: backend.forward(*rows, out), launches)
    return replay_us(graph, launches, samples)


# (column, HopperExperts engine): every engine setting timed in the run.
VARIANTS = [
    ("humming", HummingEngine()),
    ("humming, torch grouping", HummingEngine(tiles=HopperTiles(grouping="torch"))),
    ("humming capacity", HummingEngine(tune_for_capacity=True)),
    ("triton", TritonEngine()),
]


GROUPING_BLOCK_N = 16
GROUPINGS = {
    "grouping torch": lambda ids, local: tile_routes(group_pairs(ids, 0, local, GROUPING_BLOCK_N)),
    "grouping kernel": lambda ids, local: group_and_route(ids, 0, local, GROUPING_BLOCK_N),
}


def bench_local(local: int, args, bandwidth: float, gen: torch.Generator) -> list[dict]:
    ranks = K3.experts // local
    weights = SyntheticLayer(K3, seed=1, device="cuda").local_weights(0, local)
    variants = {}
    for name, engine in VARIANTS:
        try:
            variants[name] = HopperExperts(weights, engine=engine)
        except (RuntimeError, ValueError) as error:  # e.g. humming-kernels not installed
            print(f"{name}: not measured: {error}", flush=True)
    reference = None
    if local <= REFERENCE_MAX_LOCAL:
        reference = ReferenceExperts(weights)
    results = []
    for tokens, routing in [(t, r) for t in args.tokens for r in args.routing]:
        rows = receive_rows(ranks, tokens, local, gen, routing)
        ids = rows[2]
        touched = int(ids[ids < local].unique().numel())
        result = {
            "local": local,
            "ranks": ranks,
            "tokens": tokens,
            "routing": routing,
            "rows": ids.shape[0],
            "pairs": int((ids < local).sum()),
            "touched": touched,
            "floor_us": touched * EXPERT_BYTES / (bandwidth * 1e9) * 1e6,
        }
        outputs = {}
        for name, backend in variants.items():
            out = torch.empty(ids.shape[0], K3.latent, dtype=torch.bfloat16, device="cuda")
            backend.forward(*rows, out)  # eager first: compiles outside the capture
            outputs[name] = out.clone()
            result[name] = graph_us(backend, rows, args.reps, args.samples)
        for name, grouping in GROUPINGS.items():  # capture's warm-up call compiles the kernel
            graph = capture(lambda grouping=grouping: grouping(ids, local), args.reps)
            result[name] = replay_us(graph, args.reps, args.samples)
        if reference is not None:
            want = torch.empty(ids.shape[0], K3.latent, dtype=torch.bfloat16, device="cuda")
            result["reference"] = time_us(lambda: reference.forward(*rows, want), 1, 10)
            written = (ids < local).any(dim=1)
            b = want[written].float()
            for name, out in outputs.items():
                result[f"{name} diff"] = float((out[written].float() - b).norm() / b.norm())
        results.append(result)
        print(datetime.datetime.now().strftime("%H:%M:%S"), result, flush=True)
    return results


def main() -> int:
    p = cli.parser(
        __doc__,
        page="bench_experts.md and .png",
        tokens=TOKENS,
        routing=["uniform"],
        timing=(REPS, SAMPLES),
    )
    p.add_argument(
        "--local",
        type=int,
        nargs="+",
        default=LOCAL_EXPERTS,
        help="local experts of rank 0, each a case (896 / local ranks)",
    )
    args = p.parse_args()
    bandwidth = copy_gbs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for local in args.local:
        results += bench_local(local, args, bandwidth, gen)
        torch.cuda.empty_cache()
    write_report(args.out, results, bandwidth, args.reps, args.samples)
    return 0


def write_report(
    out: Path,
    results: list[dict],
    bandwidth: float,
    reps: int,
    samples: int,
    run: report.Run | None = None,
) -> Path:
    """OUTDIR/bench_experts.md and .png from the rows of `bench_local`."""
    run = run or report.Run.this_process()
    names = [name for name, _ in VARIANTS if any(name in r for r in results)]
    title = "Experts backends on one GPU, K3 geometry"
    page = report.Page(out / "bench_experts.md", title, report.summary(__doc__), run)
    page.text(
        f"One process. Copy bandwidth measured in the run: {bandwidth:.0f} GB/s.",
        "Rows: rank 0's receive rows when `ranks` ranks each route T tokens (16 distinct experts"
        " of 896 by synthetic_ids: uniform; zipf; hot, expert 0 of rank 0 in every token).",
        "pairs: (row, local expert) pairs; touched: local experts with rows.",
        f"HopperExperts (engine, math): graph replay of {reps} calls, median of {samples}"
        " replays, per call. ReferenceExperts: eager, median of 10 calls. floor: the touched"
        " experts' MXFP4 weights and scales (17.5 MB each) read once at the measured copy"
        " bandwidth; % = floor / time. diff: relative L2 against ReferenceExperts.",
    )
    columns = ["local (ranks)", "T", "routing", "rows", "pairs", "touched", "floor us"]
    columns += [f"{n} {unit}" for n in names for unit in ("us", "%")]
    columns += ["Reference us", *(f"{n} diff" for n in names), *(f"{n} us" for n in GROUPINGS)]
    rows = []
    for r in results:
        cells = [
            f"{r['local']} ({r['ranks']})",
            r["tokens"],
            r["routing"],
            r["rows"],
            r["pairs"],
            r["touched"],
            f"{r['floor_us']:.0f}",
        ]
        for n in names:
            cells += [f"{r[n]:.0f}", f"{100 * r['floor_us'] / r[n]:.0f}%"] if n in r else ["-", "-"]
        cells.append(f"{r['reference']:.0f}" if "reference" in r else "-")
        cells += [f"{r[f'{n} diff']:.1e}" if f"{n} diff" in r else "-" for n in names]
        cells += [f"{r[n]:.1f}" for n in GROUPINGS]
        rows.append(cells)
    page.table(columns, rows)
    series = []
    for local, routing in sorted({(r["local"], r["routing"]) for r in results}):
        mine = [r for r in results if r["local"] == local and r["routing"] == routing]
        t = [r["tokens"] for r in mine]
        us = [r.get("humming", r.get("triton", math.nan)) for r in mine]  # nan: not measured
        series.append(report.Series(f"HopperExperts, {local}, {routing}", t, us))
        floor = [r["floor_us"] for r in mine]
        label = f"weight-read floor, {local}, {routing}"
        series.append(report.Series(label, t, floor, "--", color_of_previous=True))
    panel = report.Panel("tokens per rank (T)", "us per call", series, x_log=2, y_log=10)
    page.plot(report.Figure(f"K3 experts on {run.hardware} (local experts)", [panel]))
    return page.write()


if __name__ == "__main__":
    sys.exit(main())
