"""The routed path end to end with real experts, one process per GPU: dispatch -> HopperExperts (or
the device's default experts) -> combine with RMSNorm, K3 geometry, against the MXFP4 weight-read
floor, beside FlashInfer's fused MoE-EP layer when its log is given.

    torchrun --nproc-per-node N -m bench.bench_routed_experts [--peer-log FILE]
    # docs/results/bench_routed_experts{N}.md, .png

Weights: SyntheticLayer(K3) experts, this rank's 896 / N (448 at N = 2). Experts backend: on
SM90 HopperExperts(..., num_experts=896, tiles=HopperTiles(grouping=--grouping, pdl=not
--no-pdl)), its default
engine (humming where installed); elsewhere `default_experts`. Routing: uniform, 16 distinct
experts a token (synthetic_ids), fresh per T. Times: EpRouted.routed (dispatch + experts +
combine + RMSNorm), median over --samples of CUDA-event-timed graph replays of --reps calls (eager
where capture fails, marked), ranks lined up by a host barrier, the slowest rank's median. One
eager call per T first (humming compiles a kernel for a new pair bound there). Floor: the
experts a rank's rows touch (17,547,264 MXFP4 bytes each) read once at the copy bandwidth
measured in the run, the largest over ranks.

--peer-log: the stdout of FlashInfer's fused layer benchmark run on the same GPUs in the same
session, whose result lines read `FI_MEGA {json}` with keys T, local, layer_us (and error): its
layer time is put beside ours, T by T, in one table and one plot (--peer-ranks: the world size
it ran at, 2 by default; the file is read before any GPU work). Ranks sharing one GPU are
time-sliced: refused.

--check-expert-rows: each T is also timed on a second EpRouted with
EpConfig(check_expert_rows=True) (the unwritten-rows mark at dispatch and its check's launch
before the combine), the same inputs and experts, its rows compared with the unchecked call's
(bitwise for deterministic experts); the page adds its time and the difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bench import cli, report
from bench.bench_experts import EXPERT_BYTES, copy_gbs
from bench.ranks import all_reduced, slowest
from bench.timing import timed_us
from dep_ep.config import EpConfig
from dep_ep.ep import K3, EpRouted
from dep_ep.experts import default_experts
from dep_ep.experts.hopper import Grouping, HopperExperts, HopperTiles, default_engine
from dep_ep.launch import init_rank_context, new_dep_group, teardown
from dep_ep.testing.synthetic import SyntheticLayer, synthetic_ids

TOKENS = [1, 4, 16, 64, 128, 256]  # the FlashInfer anchor's token counts
REPS = 10
SAMPLES = 20
PEER_PREFIX = "FI_MEGA "


def read_peer_log(path: Path, local: int) -> dict[int, float]:
    """{T: layer us} from the lines of `path` holding `FI_MEGA {json}` (anywhere in the line: a
    launcher may prefix it) with `local` experts per rank and no error. A line whose JSON does not
    parse is skipped with a warning; ValueError when no line matches (a wrong file)."""
    times = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        at = line.find(PEER_PREFIX)
        if at < 0:
            continue
        try:
            row = json.loads(line[at + len(PEER_PREFIX) :])
        except json.JSONDecodeError as err:
            print(f"{path}:{number}: skipped, not JSON ({err})", file=sys.stderr)
            continue
        if row.get("error") is None and int(row.get("local", -1)) == local and "layer_us" in row:
            times[int(row["T"])] = float(row["layer_us"])
    if not times:
        raise ValueError(
            f"{path}: no `{PEER_PREFIX.strip()}` line without error at {local} local"
            " experts per rank"
        )
    return times


def main() -> int:
    page = "bench_routed_experts{N}.md and .png (N: the ranks)"
    p = cli.parser(__doc__, page=page, tokens=TOKENS, timing=(REPS, SAMPLES))
    groupings = [g.value for g in Grouping]  # the option takes a Grouping's value
    p.add_argument("--grouping", choices=groupings, default=HopperTiles().grouping.value)
    p.add_argument("--peer-log", type=Path, default=None, help="FlashInfer fused layer's stdout")
    p.add_argument("--peer-ranks", type=int, default=2, help="the ranks the peer ran on")
    p.add_argument(
        "--check-expert-rows",
        action="store_true",
        help="also time each step on an EpRouted with EpConfig(check_expert_rows=True)",
    )
    p.add_argument(
        "--no-pdl",
        action="store_true",
        help="HopperExperts' kernels without programmatic dependent launch (HopperTiles.pdl)",
    )
    args = p.parse_args()
    # The peer's log is read before any GPU work, so that a wrong file fails at once.
    peer = read_peer_log(args.peer_log, K3.experts // args.peer_ranks) if args.peer_log else {}
    ctx = init_rank_context("cuda", timeout_s=300.0)
    if ctx.backend != "nccl":
        raise SystemExit("bench.bench_routed_experts: one GPU per rank (time-slicing)")
    n, rank = ctx.world_size, ctx.rank
    cpu = new_dep_group(ctx, n).cpu_group

    def build(check_expert_rows: bool) -> EpRouted:
        config = EpConfig(timeout_s=60.0, check_expert_rows=check_expert_rows)
        geometry = dict(num_experts=K3.experts, latent=K3.latent, topk=K3.topk)
        return EpRouted(cpu, max(args.tokens), "cuda", config=config, **geometry)

    routed = build(False)
    checked = build(True) if args.check_expert_rows else None
    local = routed.experts_per_rank
    synthetic = SyntheticLayer(K3, seed=1, device="cuda")
    weights_4bit = synthetic.local_weights(routed.first_expert, local)
    if HopperExperts.unsupported_reason(ctx.device) is None:
        tiles = HopperTiles(grouping=Grouping(args.grouping), pdl=not args.no_pdl)
        engine = default_engine(K3.latent, K3.intermediate, tiles=tiles)
        experts = HopperExperts(weights_4bit, engine=engine)
    else:  # not SM90: the device's default backend (--grouping does not apply)
        experts = default_experts(weights_4bit)
    norm = SyntheticLayer(K3, seed=1, device="cuda").norm_weight()
    bandwidth = all_reduced(copy_gbs(), cpu, dist.ReduceOp.MIN)
    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    results = []
    for tokens in args.tokens:
        latent = torch.randn(tokens, K3.latent, device="cuda", generator=gen).to(torch.bfloat16)
        ids = synthetic_ids(tokens, K3.experts, K3.topk, "uniform", gen, "cuda")
        weights = torch.rand(tokens, K3.topk, device="cuda", generator=gen)

        def step(on: EpRouted = routed):
            return on.routed(latent, ids, weights, norm, experts=experts, tokens=tokens)

        finite = bool(step().isfinite().all())  # eager first: humming compiles here
        routed.synchronize()
        rows = routed.receive(tokens).ids
        mine = rows[(rows >= routed.first_expert) & (rows < routed.first_expert + local)]
        touched = int(mine.unique().numel())
        us, mode = timed_us(step, cpu, args.reps, args.samples)
        routed.synchronize()
        row = {
            "tokens": tokens,
            "us": slowest(us, cpu),
            "touched": slowest(touched, cpu),
            "mode": mode,
            "finite": slowest(0.0 if finite else 1.0, cpu) == 0.0,
        }
        row["floor_us"] = row["touched"] * EXPERT_BYTES / (bandwidth * 1e9) * 1e6
        if checked is not None:
            checked_time = checked_us(checked, step, experts, cpu, args, mode)
            row["checked_us"] = slowest(checked_time, cpu)
        results.append(row)
        if rank == 0:
            print(row, flush=True)
    backend = type(experts).__name__ + (
        f" ({experts.engine})" if hasattr(experts, "engine") else ""
    )
    routed.close()
    if checked is not None:
        checked.close()
    if peer and args.peer_ranks != n:
        peer = {}  # another world size: nothing to compare with
        print(f"--peer-ranks {args.peer_ranks} != {n} ranks: the peer is left out", file=sys.stderr)
    if rank == 0:
        meta = {
            "n": n,
            "local": local,
            "bandwidth": bandwidth,
            "backend": backend,
            "grouping": args.grouping,
        }
        write_report(args.out, results, peer, meta)
    teardown(ctx)
    return 0


# The largest relative L2 difference allowed between a row of the checked and of the unchecked
# call when the experts do not promise bitwise reruns (humming's stream-K kernels add split-K
# partials in any order): rounding, not a changed row (a row the check spoiled is NaN or off by
# its whole norm). Per row: one changed row among thousands hides in a norm of the whole.
CHECKED_REL_L2 = 1e-2


def checked_us(checked: EpRouted, step, experts, cpu, args, mode: str) -> float:
    """The median us of `step(checked)`: the same call on `checked`, an EpRouted with
    check_expert_rows on (the mark at dispatch, the check's launch before the combine), timed
    the same way as the unchecked call (`mode`, else SystemExit). Its rows must be the unchecked
    call's bits when the experts rerun bitwise (`deterministic`), else each row within
    CHECKED_REL_L2."""
    want = step()
    got = step(checked)
    checked.synchronize()
    if getattr(experts, "deterministic", True):
        same = torch.equal(want.view(torch.int16), got.view(torch.int16))
    else:
        rows = want.float().norm(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
        gap = (got.float() - want.float()).norm(dim=1) / rows
        same = bool(got.isfinite().all()) and float(gap.max()) <= CHECKED_REL_L2
    if not same:
        raise SystemExit("bench_routed_experts: check_expert_rows changed a step's rows")
    us, checked_mode = timed_us(lambda: step(checked), cpu, args.reps, args.samples)
    checked.synchronize()
    if checked_mode != mode:
        raise SystemExit(f"bench_routed_experts: checked call timed {checked_mode}, ours {mode}")
    return us


def write_report(
    out: Path,
    results: list[dict],
    peer: dict[int, float],
    meta: dict,
    run: report.Run | None = None,
) -> Path:
    """OUTDIR/bench_routed_experts{N}.md and .png from the rows of `main` and the peer's times;
    meta: n (ranks), local (experts per rank), bandwidth (GB/s), backend, grouping."""
    n = meta["n"]
    run = run or report.Run.this_process(n)
    title = f"Routed path with experts, {n} GPU{'s' if n > 1 else ''}, one process per GPU"
    page = report.Page(out / f"bench_routed_experts{n}.md", title, report.summary(__doc__), run)
    page.text(
        f"K3 geometry, {meta['local']} local experts per rank, experts backend {meta['backend']},"
        f" copy bandwidth {meta['bandwidth']:.0f} GB/s.",
    )
    page.text(
        "ours: EpRouted.routed (dispatch, experts, combine with RMSNorm), CUDA-graph replay,"
        " slowest rank. floor: the touched experts' MXFP4 bytes at the copy bandwidth"
        " (% = floor / time). FlashInfer: its fused MoE-EP layer's time from the log of the same"
        " session (--peer-log); x = FlashInfer / ours (above 1: ours is faster).",
    )
    columns = "T | touched | floor us | ours us | ours % | FlashInfer us | FlashInfer % | x"
    check = bool(results) and all("checked_us" in r for r in results)
    if check:
        page.text(
            "checked: the same call on an EpRouted with check_expert_rows on (its rows the same"
            " bits); + = checked - ours.",
        )
        columns += " | checked us | +"
    rows = []
    for r in results:
        theirs = peer.get(r["tokens"])
        cells = [
            r["tokens"],
            f"{r['touched']:.0f}",
            f"{r['floor_us']:.0f}",
            f"{r['us']:.0f}",
            f"{100 * r['floor_us'] / r['us']:.0f}%",
        ]
        if theirs is None:
            cells += ["-", "-", "-"]
        else:
            cells += [
                f"{theirs:.0f}",
                f"{100 * r['floor_us'] / theirs:.0f}%",
                f"{theirs / r['us']:.2f}",
            ]
        if check:
            cells += [f"{r['checked_us']:.1f}", f"{r['checked_us'] - r['us']:+.1f}"]
        cells += [r["mode"], "yes" if r["finite"] else "NO"]
        rows.append(cells)
    page.table([*columns.split(" | "), "timing", "finite"], rows)
    ts = [r["tokens"] for r in results]
    series = [
        report.Series(f"ours: routed path, {meta['backend']}", ts, [r["us"] for r in results])
    ]
    shared = [t for t in ts if t in peer]
    if shared:
        label = "FlashInfer fused MoE-EP layer"
        series.append(report.Series(label, shared, [peer[t] for t in shared], "s-"))
    floor = [r["floor_us"] for r in results]
    series.append(report.Series("MXFP4 weight-read floor", ts, floor, "--"))
    panel = report.Panel("tokens per rank (T)", "us per layer call", series, x_log=2, y_log=10)
    title = f"K3 routed path, {run.hardware}, {meta['local']} local experts"
    page.plot(report.Figure(title, [panel]))
    return page.write()


if __name__ == "__main__":
    sys.exit(main())
