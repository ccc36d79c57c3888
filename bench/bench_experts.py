"""Experts backends on one GPU at K3 geometry: HopperExperts against the hardware floor, beside
ReferenceExperts, at 56, 112 and 448 local experts (rank 0 of 16, 8 and 2 ranks), T = 1..2048
tokens per rank (powers of two), uniform, Zipf and hot-expert routing, all measured in the same run.

    python -m bench.bench_experts     # writes docs/results/bench_experts.md and .png

Receive rows as rank 0 of `ranks` would get them: ranks * T tokens, each with K3's 16 distinct
experts of 896 drawn by synthetic_ids (--routing: uniform; zipf; hot, expert 0 of rank 0 every
token's first choice), keeping the tokens with at least one of rank 0's experts.
- HopperExperts (VARIANTS, --variants: "humming", HummingEngine, its kernels chosen for the
  pairs expected from num_experts, with the one-launch grouping kernel (the default);
  "humming-torch-grouping", the same with the torch grouping; "humming-capacity",
  HummingEngine(tune_for_capacity=True), its kernels chosen for the pair capacity;
  "humming-slots", every call on its receive slots, never in chunks; "humming-no-pdl", the
  default engine with its kernels launched without programmatic dependent launch; "triton",
  TritonEngine; "humming-decode-heuristic", the default engine with humming's own kernel
  choices at decode, not the engine's changes to them (humming_gemm.FC1_UPDATES and
  FC2_UPDATES; `with_humming_choices`)): CUDA-graph replay of back-to-back calls on the same
  rows (a call has no host synchronisation), median of `--samples` replays, per call; `--reps`
  calls a graph, fewer where one eager call takes longer than REPLAY_BUDGET_US / reps
  (`graph_reps`); one eager call first
  (humming compiles its kernels for a new pair count there).
- ReferenceExperts: eager (it reads sizes back to the host), median of CUDA-event-timed calls;
  skipped at 448 local experts (its BF16 cache would take 29.6 GB).
- The floor (`floors`), the larger of two, both measured in the same run:
  weight read: the MXFP4 weights and scales of the experts the rows touch (17,547,264 bytes
  each at K3) read once at the device-to-device copy bandwidth (`copy_gbs`);
  FP8 MMA: the pairs' FLOPs, FC1 2 * pairs * L * 2I plus FC2 2 * pairs * I * L (`mma_flops`), at
  the dense FP8 rate of torch._scaled_mm on e4m3 [8192, 8192] x [8192, 8192] (`fp8_tflops`,
  graph replay). % of floor = floor / time.
- diff: relative L2 between each variant and ReferenceExperts on the same rows.
- grouping: the grouping and tile routes alone (block_n 16), group_pairs + tile_routes (torch)
  and group_and_route (one Triton launch), graph replay like HopperExperts.

A part of the run (e.g. --local 56, or --tokens 1024 2048) writes a page of its own rows: give
each part its own --out.
"""

from __future__ import annotations

import datetime
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import cli, report
from bench.timing import capture, replay_us, time_us
from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.constants import SCALE_BLOCK
from dep_ep.ep import K3
from dep_ep.experts import ReferenceExperts
from dep_ep.experts.hopper import HopperExperts, HopperTiles, HummingEngine, TritonEngine
from dep_ep.experts.hopper.grouping import Grouping, group_pairs, tile_routes
from dep_ep.experts.hopper.grouping_kernel import group_and_route
from dep_ep.experts.hopper.humming_gemm import TUNING_UPDATES
from dep_ep.testing.synthetic import ROUTINGS, SyntheticLayer, synthetic_ids

TOKENS = [1 << i for i in range(12)]  # 1 .. 2048
LOCAL_EXPERTS = [56, 112, 448]
REFERENCE_MAX_LOCAL = 112
REPS, SAMPLES = 10, 20  # calls per captured graph, timed replays (median)
# A replay holds at most this long of calls (at least one call): at T = 2048 one triton call
# takes tens of ms, and 10 of them per replay would make the run long without a better median.
REPLAY_BUDGET_US = 20_000.0
# w13 + s13 + w2 + s2 of one K3 expert: 3 * I * L / 2 code bytes + 3 * I * L / 32 scale bytes.
EXPERT_BYTES = 3 * K3.intermediate * K3.latent // 2 + 3 * K3.intermediate * K3.latent // SCALE_BLOCK
FP8_GEMM = 8192  # fp8_tflops' square GEMM: M = N = K


def mma_flops(pairs: int, latent: int, intermediate: int) -> int:
    """FLOPs of the experts' GEMMs over `pairs` (row, local expert) pairs: FC1 [L] -> [2I] (gate and
    up) is 2 * pairs * L * 2I, FC2 [I] -> [L] is 2 * pairs * I * L (a multiply-add counts 2)."""
    return 2 * pairs * latent * 2 * intermediate + 2 * pairs * intermediate * latent


@dataclass(frozen=True)
class Floor:
    """The hardware floor of one call, us: weight_us, the touched experts' bytes read once at the
    copy bandwidth; mma_us, the pairs' FLOPs at the dense FP8 rate; floor_us, the larger."""

    weight_us: float
    mma_us: float

    @property
    def floor_us(self) -> float:
        return max(self.weight_us, self.mma_us)

    def percent(self, us: float) -> float:
        """% of the floor a call of `us` microseconds reaches: 100 * floor / time."""
        return 100.0 * self.floor_us / us


def floors(
    touched: int,
    pairs: int,
    copy_gbs: float,
    fp8_tflops: float,
    *,
    expert_bytes: int = EXPERT_BYTES,
    latent: int = K3.latent,
    intermediate: int = K3.intermediate,
) -> Floor:
    """The floor of a call whose rows hold `pairs` pairs over `touched` local experts (ints >= 0),
    at `copy_gbs` GB/s (1e9 bytes a second) and `fp8_tflops` TFLOP/s (1e12; both > 0);
    `expert_bytes` a touched expert's weights and scales (default K3's MXFP4 expert)."""
    for name, value in (("touched", touched), ("pairs", pairs)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"floors: {name}={value!r}; expected an int >= 0")
    for name, rate in (("copy_gbs", copy_gbs), ("fp8_tflops", fp8_tflops)):
        if not rate > 0 or math.isinf(rate):
            raise ValueError(f"floors: {name}={rate!r}; expected a finite rate > 0")
    weight_us = touched * expert_bytes / (copy_gbs * 1e9) * 1e6
    mma_us = mma_flops(pairs, latent, intermediate) / (fp8_tflops * 1e12) * 1e6
    return Floor(weight_us, mma_us)


def graph_reps(call_us: float, reps: int, budget_us: float = REPLAY_BUDGET_US) -> int:
    """Calls a captured graph holds: `reps`, fewer when that many calls of `call_us` (one eager
    call's time) would take longer than `budget_us`, at least 1."""
    if not call_us > 0:
        return reps
    return max(1, min(reps, int(budget_us // call_us)))


def copy_gbs() -> float:
    """Device-to-device copy bandwidth of a 1 GiB buffer (read + write bytes per second)."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), 1, 10)
    return 2 * 4 * src.numel() / (us * 1e-6) / 1e9


def fp8_tflops(size: int = FP8_GEMM, reps: int = 5, samples: int = 10) -> float:
    """Dense FP8 rate, TFLOP/s: torch._scaled_mm of e4m3 [size, size] x [size, size] (the second
    column-major, as cuBLAS takes it), unit per-tensor scales, BF16 output, fast accumulation (no
    periodic promotion to fp32: the highest rate the MMA gives, so the floor stays a lower bound),
    `reps` GEMMs a captured graph, median of `samples` replays."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(size, size, device="cuda", generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device="cuda", generator=gen).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")

    def gemm():
        return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)

    us = replay_us(capture(gemm, reps), reps, samples)
    return 2 * size**3 / (us * 1e-6) / 1e12


def bf16_tflops(size: int = FP8_GEMM, reps: int = 5, samples: int = 10) -> float:
    """Dense BF16 rate, TFLOP/s: torch.mm of BF16 [size, size] x [size, size] (cuBLAS), `reps`
    GEMMs a captured graph, median of `samples` replays."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(size, size, device="cuda", generator=gen).bfloat16()
    us = replay_us(capture(lambda: torch.mm(a, a), reps), reps, samples)
    return 2 * size**3 / (us * 1e-6) / 1e12


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


def eager_us(fn) -> float:
    """Microseconds of one eager call of `fn` (after its warm-up elsewhere), CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def graph_us(fn, reps: int, samples: int) -> float:
    """Median us per call of `fn` in graph replay, `graph_reps` calls a graph (`fn` has run
    eagerly before: its compilation is done)."""
    launches = graph_reps(eager_us(fn), reps)
    graph = capture(fn, launches)
    return replay_us(graph, launches, samples)


# HummingEngine.chunk_pairs past any call's slots: every call runs on its slots.
SLOTS_ONLY = 1 << 40
# (column, HopperExperts engine): every engine setting timed in the run (--variants picks).
VARIANTS = [
    ("humming", HummingEngine()),
    ("humming-torch-grouping", HummingEngine(tiles=HopperTiles(grouping=Grouping.TORCH))),
    ("humming-capacity", HummingEngine(tune_for_capacity=True)),
    # Every call on its receive slots (no chunks): the humming engine before its chunked calls.
    ("humming-slots", HummingEngine(chunk_pairs=SLOTS_ONLY)),
    # Every kernel launched without programmatic dependent launch (experts/hopper/pdl.py).
    ("humming-no-pdl", HummingEngine(tiles=HopperTiles(pdl=False))),
    ("triton", TritonEngine()),
    # The humming engine with humming's own kernels at decode (humming_gemm.TUNING_UPDATES only,
    # not the engine's FC1_UPDATES / FC2_UPDATES): the baseline of those changes.
    ("humming-decode-heuristic", HummingEngine()),
]
VARIANT_NAMES = [name for name, _ in VARIANTS]


def with_humming_choices(backend: HopperExperts) -> None:
    """The humming engine's GEMMs choosing humming's own kernels at decode (TUNING_UPDATES)."""
    for gemm in (backend.prepared.fc1, backend.prepared.fc2):
        gemm.updates = TUNING_UPDATES
        gemm.tunings.clear()


# variant -> what is changed on its HopperExperts once built.
AFTER_BUILD = {"humming-decode-heuristic": with_humming_choices}


GROUPING_BLOCK_N = 16
GROUPINGS = {
    "grouping torch": lambda ids, local: tile_routes(group_pairs(ids, 0, local, GROUPING_BLOCK_N)),
    "grouping kernel": lambda ids, local: group_and_route(ids, 0, local, GROUPING_BLOCK_N),
}


def bench_local(local: int, args, bandwidth: float, tflops: float, gen: torch.Generator):
    """The rows of one shard (`local` experts of rank 0) at every --tokens and --routing."""
    ranks = K3.experts // local
    weights = SyntheticLayer(K3, seed=1, device="cuda").local_weights(0, local)
    variants = {}
    for name, engine in VARIANTS:
        if name not in args.variants:
            continue
        try:
            variants[name] = HopperExperts(weights, engine=engine)
            AFTER_BUILD.get(name, lambda backend: None)(variants[name])
        except (RuntimeError, ValueError) as error:  # e.g. humming-kernels not installed
            print(f"{name}: not measured: {error}", flush=True)
    reference = None
    if local <= REFERENCE_MAX_LOCAL and not args.no_reference:
        reference = ReferenceExperts(weights)
    results = []
    for tokens, routing in [(t, r) for t in args.tokens for r in args.routing]:
        rows = receive_rows(ranks, tokens, local, gen, routing)
        ids = rows[2]
        touched = int(ids[ids < local].unique().numel())
        pairs = int((ids < local).sum())
        floor = floors(touched, pairs, bandwidth, tflops)
        result = {
            "local": local,
            "ranks": ranks,
            "tokens": tokens,
            "routing": routing,
            "rows": ids.shape[0],
            "pairs": pairs,
            "touched": touched,
            "weight_us": floor.weight_us,
            "mma_us": floor.mma_us,
            "floor_us": floor.floor_us,
        }
        outputs = {}
        for name, backend in variants.items():
            out = torch.empty(ids.shape[0], K3.latent, dtype=torch.bfloat16, device="cuda")
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # no cached block handed out whole for a smaller request
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            backend.forward(*rows, out)  # eager first: compiles outside the capture
            torch.cuda.synchronize()
            result[f"{name} peak"] = torch.cuda.max_memory_allocated() - before
            outputs[name] = out.clone()
            result[name] = graph_us(lambda b=backend, o=out: b.forward(*rows, o), *timing(args))
            result[f"{name} workspace"] = backend.workspace_bytes(ids.shape[0], K3.topk)
        for name, grouping in GROUPINGS.items():  # the eager call compiles the kernel
            grouping(ids, local)
            result[name] = graph_us(lambda g=grouping: g(ids, local), *timing(args))
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


def timing(args) -> tuple[int, int]:
    return args.reps, args.samples


def main() -> int:
    p = cli.parser(
        __doc__,
        page="bench_experts.md and .png",
        tokens=TOKENS,
        routing=list(ROUTINGS),
        timing=(REPS, SAMPLES),
    )
    p.add_argument(
        "--local",
        type=int,
        nargs="+",
        default=LOCAL_EXPERTS,
        help="local experts of rank 0, each a case (896 / local ranks)",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANT_NAMES,
        default=VARIANT_NAMES,
        metavar="NAME",
        help="HopperExperts engine settings to time (VARIANTS)",
    )
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="skip ReferenceExperts (its time and the diff columns)",
    )
    args = p.parse_args()
    bandwidth, tflops = copy_gbs(), fp8_tflops()
    print(f"copy {bandwidth:.0f} GB/s, FP8 {tflops:.0f} TFLOP/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for local in args.local:
        results += bench_local(local, args, bandwidth, tflops, gen)
        torch.cuda.empty_cache()
    write_report(args.out, results, bandwidth, tflops, args.reps, args.samples)
    return 0


def default_variant(result: dict) -> str | None:
    """The variant the plot shows: the default engine's ("humming"), else the first measured."""
    return next((name for name in VARIANT_NAMES if name in result), None)


def page_summary(results: list[dict]) -> str:
    """What the page's rows cover (shards, T, routings; ReferenceExperts where measured), from the
    rows themselves: a part of the run (`--local 56 --routing hot`) is not described as the
    whole."""
    shards = sorted({(r["local"], r["ranks"]) for r in results})
    tokens = sorted({r["tokens"] for r in results})
    routings = [name for name in ROUTINGS if any(r["routing"] == name for r in results)]
    reference = ", beside ReferenceExperts" if any("reference" in r for r in results) else ""
    return (
        f"Experts backends on one GPU at K3 geometry: HopperExperts against the hardware floor"
        f"{reference}, at {report.words([str(local) for local, _ in shards])} local experts"
        f" (rank 0 of {report.words([str(ranks) for _, ranks in shards])} ranks), T ="
        f" {', '.join(map(str, tokens))} tokens per rank,"
        f" {report.words(routings)} routing, all measured in the same run."
    )


def write_report(
    out: Path,
    results: list[dict],
    bandwidth: float,
    tflops: float,
    reps: int,
    samples: int,
    run: report.Run | None = None,
) -> Path:
    """OUTDIR/bench_experts.md and .png from the rows of `bench_local`."""
    run = run or report.Run.this_process()
    names = [name for name in VARIANT_NAMES if any(name in r for r in results)]
    groupings = [name for name in GROUPINGS if any(name in r for r in results)]
    title = "Experts backends on one GPU, K3 geometry"
    page = report.Page(out / "bench_experts.md", title, page_summary(results), run)
    page.text(
        f"One process. Measured in the run: copy bandwidth {bandwidth:.0f} GB/s, dense FP8 rate"
        f" {tflops:.0f} TFLOP/s (torch._scaled_mm, e4m3 {FP8_GEMM}^3).",
        "Rows: rank 0's receive rows when `ranks` ranks each route T tokens (16 distinct experts"
        " of 896 by synthetic_ids: uniform; zipf; hot, expert 0 of rank 0 in every token).",
        "pairs: (row, local expert) pairs; touched: local experts with rows.",
        "weight us: the touched experts' MXFP4 weights and scales (17.5 MB each) read once at the"
        " copy bandwidth; MMA us: the pairs' FLOPs (FC1 2 * pairs * L * 2I, FC2 2 * pairs * I * L)"
        " at the FP8 rate; floor us: the larger; % = floor / time.",
        f"HopperExperts (engine, math): graph replay of up to {reps} calls (fewer past"
        f" {REPLAY_BUDGET_US / 1e3:.0f} ms a replay), median of {samples} replays, per call;"
        " workspace: `HopperExperts.workspace_bytes` of the call, MiB; peak: the most memory"
        " torch's allocator held above what it held before, during the eager call after"
        " `torch.cuda.empty_cache()`, MiB."
        " ReferenceExperts: eager,"
        " median of 10 calls. diff: relative L2 against ReferenceExperts.",
    )
    columns = ["local (ranks)", "T", "routing", "rows", "pairs", "touched"]
    columns += ["weight us", "MMA us", "floor us"]
    columns += [f"{n} {unit}" for n in names for unit in ("us", "%")]
    columns += [f"{n} {kind} MiB" for n in names for kind in ("workspace", "peak")]
    columns += ["Reference us", *(f"{n} diff" for n in names), *(f"{n} us" for n in groupings)]
    rows = []
    for r in results:
        floor = Floor(r["weight_us"], r["mma_us"])
        cells = [f"{r['local']} ({r['ranks']})", r["tokens"], r["routing"], r["rows"], r["pairs"]]
        cells += [r["touched"], f"{r['weight_us']:.0f}", f"{r['mma_us']:.0f}"]
        cells.append(f"{floor.floor_us:.0f}")
        for n in names:
            cells += [f"{r[n]:.0f}", f"{floor.percent(r[n]):.0f}%"] if n in r else ["-", "-"]
        for n in names:
            for key in (f"{n} workspace", f"{n} peak"):
                cells.append(f"{r[key] / 2**20:.0f}" if key in r else "-")
        cells.append(f"{r['reference']:.0f}" if "reference" in r else "-")
        cells += [f"{r[f'{n} diff']:.1e}" if f"{n} diff" in r else "-" for n in names]
        cells += [f"{r[n]:.1f}" if n in r else "-" for n in groupings]
        rows.append(cells)
    page.table(columns, rows)
    panels = []
    for local in sorted({r["local"] for r in results}):
        series = []
        for routing in [r for r in ROUTINGS if any(x["routing"] == r for x in results)]:
            mine = [r for r in results if r["local"] == local and r["routing"] == routing]
            mine = [r for r in mine if default_variant(r) is not None]
            if not mine:
                continue
            t = [r["tokens"] for r in mine]
            percent = [
                Floor(r["weight_us"], r["mma_us"]).percent(r[default_variant(r)]) for r in mine
            ]
            series.append(report.Series(f"{default_variant(mine[0])}, {routing}", t, percent))
        ranks = K3.experts // local
        panels.append(
            report.Panel(
                "tokens per rank (T)",
                "% of floor",
                series,
                title=f"{local} local experts ({ranks} ranks)",
                x_log=2,
                reference=(100.0, "floor"),
            )
        )
    page.plot(report.Figure(f"K3 experts on {run.hardware}: % of the floor", panels))
    return page.write()


if __name__ == "__main__":
    sys.exit(main())
