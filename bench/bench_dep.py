"""Multi-GPU benchmark, one process per GPU: our dispatch and combine against the strongest peer we
can run and the baselines every user has, side by side in one run, K3 geometry.

    torchrun --nproc-per-node 8 -m bench.bench_dep   # docs/results/bench_dep8.md and .png

Peer (--peer; "auto": when FlashInfer imports): FlashInfer's NVLink one-sided MoE all-to-all
through its public API, same payload (MXFP8 rows, scales, ids, weights; BF16 rows back), same
timing (bench/peer_one_sided.py says what it moves and how it is built). Ours: the transport's
dispatch (which quantizes the BF16 latents to MXFP8 itself) and combine (fixed-order sum and the
fused RMSNorm); the peer's combine sums without a norm.
Baselines, on the NCCL group over the same GPUs:
  allgather: vLLM's default: all-gather of the BF16 latents [T, L] plus ids and weights (the
    dispatch side), reduce-scatter of the BF16 expert sums [N*T, L] (the combine side);
  all_to_all: torch.distributed.all_to_all_single moving exactly the bytes our kernels move (each
    token's MXFP8 row + scales + ids + weights to each rank owning one of its experts; BF16 rows
    back). Its split sizes are given to it on the host, a count exchange a real user would pay
    for is not timed.
Routing (--routing, each at every T): "uniform" (16 distinct random experts a token), "zipf"
(Zipf-skewed expert popularity, the same popular experts on every rank) and "hot" (expert 0 is
every token's first choice): dep_ep.testing.synthetic_ids. Skew: the busiest rank's receive rows
over the mean (what dispatch and combine move; ~1 at N = 2, where nearly every token reaches
both ranks), and its (row, local id) pairs over the mean (the experts' load). Receive MiB:
EpRouted.workspace_bytes of a rank sized for T (the run's EpRouted is sized for the largest T);
the peer's workspace is sized for the largest T. Construction: the EpRouted built for the run,
ranks lined up first, slowest rank, NVSHMEM start-up and kernel compilation included; the peer's:
import, JIT build or load, construction.
Times: ours and the peer's by timing.pair_timed_us (pair: graph replays of --reps back-to-back
pairs; dispatch, combine: events around each call in a second graph), the NCCL baselines by
timing.timed_us (graph replays of --reps calls; eager when capture fails, marked); medians over
--samples, the slowest rank's median reported. GB/s per rank: bytes that cross NVLink for this
rank / time (mean over ranks): dispatch, the rows it sends to other ranks; combine, the expert
rows of its tokens that other ranks hold (ours reads them there, the peer's are sent back).
Ranks sharing one GPU are time-sliced: the script refuses them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench import cli, peer_one_sided, report
from bench.ranks import mean, slowest
from bench.timing import pair_timed_us, timed_us
from dep_ep.comm.kernels.launch_args import KernelTuning
from dep_ep.config import DEFAULT_NORM_EPS
from dep_ep.constants import SCALE_BLOCK
from dep_ep.ep import K3, EpRouted
from dep_ep.launch import init_rank_context, new_dep_group, teardown
from dep_ep.testing import internals
from dep_ep.testing.synthetic import ROUTINGS, synthetic_ids

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
REPS = 10
SAMPLES = 20


def destinations(ids: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """bool [T, N]: token t goes to rank d (d owns one of its experts)."""
    per_rank = K3.experts // num_ranks
    owner = torch.where(ids >= 0, ids.long() // per_rank, num_ranks)
    hits = torch.zeros(ids.shape[0], num_ranks + 1, dtype=torch.bool, device=ids.device)
    hits.scatter_(1, owner, True)
    return hits[:, :num_ranks]


def make_peer(args, ctx, cpu, n: int):
    """(the peer, None) or (None, the report's line on why not). Collective over `cpu`."""
    if args.peer == "none":
        return None, "Peer: not run (`--peer none`)."
    peer, why_not = peer_one_sided.OneSidedPeer.create(
        cpu,
        ctx.rank,
        n,
        ctx.device,
        max(args.tokens),
        latent=K3.latent,
        topk=K3.topk,
        experts=K3.experts,
        timeout_s=args.peer_timeout_s,
        handles=args.peer_handles,
    )
    if peer is None and args.peer == "flashinfer":
        raise SystemExit(f"bench.bench_dep: rank {ctx.rank}: the peer cannot run: {why_not}")
    if ctx.rank == 0:
        print(f"peer: {peer.path if peer else why_not}", flush=True)
    return peer, None if peer else f"Peer: {peer_one_sided.NAME} not run: {why_not}."


def peer_line(peer, cpu) -> str:
    """The report's line on the peer that ran. Collective over `cpu`."""
    import flashinfer

    construction = slowest(peer.construction_s, cpu)
    return (
        f"Peer: {peer_one_sided.NAME} (flashinfer {flashinfer.__version__},"
        f" NVLinkOneSidedAlltoAll: {peer.path}); its workspace {peer.workspace_mib:.1f} MiB"
        f" per rank (sized for the largest T); import, JIT build or load and construction"
        f" {construction:.2f} s, slowest rank."
    )


def main() -> int:
    page = "bench_dep{N}.md and .png (N: the ranks)"
    timing = (REPS, SAMPLES)
    p = cli.parser(__doc__, page=page, tokens=TOKENS, routing=ROUTINGS, timing=timing)
    p.add_argument(
        "--peer",
        choices=("auto", "flashinfer", "none"),
        default="auto",
        help="time FlashInfer's one-sided all-to-all beside ours (auto: when it imports;"
        " flashinfer: fail when it cannot run)",
    )
    p.add_argument(
        "--peer-handles",
        choices=peer_one_sided.HANDLES,
        default="posix",
        help="the peer's memory handles (bench/peer_one_sided.py)",
    )
    p.add_argument("--peer-timeout-s", type=int, default=30, help="the peer's wait bound, seconds")
    p.add_argument(
        "--tuning",
        choices=sorted(cli.KERNEL_TUNINGS),
        default="default",
        help="our kernels' tuning (bench/cli.py, KERNEL_TUNINGS)",
    )
    args = p.parse_args()
    ctx = init_rank_context("cuda", timeout_s=300.0)
    if ctx.backend != "nccl":
        raise SystemExit("bench.bench_dep: needs one GPU per rank (ranks sharing a GPU time-slice)")
    n, rank = ctx.world_size, ctx.rank
    dep = new_dep_group(ctx, n)
    cpu = dep.cpu_group
    torch.cuda.synchronize()
    dist.barrier(cpu)
    start = time.perf_counter()
    routed = EpRouted(
        cpu,
        max(args.tokens),
        "cuda",
        num_experts=K3.experts,
        latent=K3.latent,
        topk=K3.topk,
    )
    construction_s = slowest(time.perf_counter() - start, cpu)
    # The transport alone: a dispatch and its combine, no experts between.
    # EpRouted's own transport, private to it: a benchmark of one phase alone skips the
    # validation and the dispatch/combine pairing on purpose.
    transport = internals.transport(routed)
    if args.tuning != "default":
        transport.retune(KernelTuning(**cli.KERNEL_TUNINGS[args.tuning]))
    peer, peer_note = make_peer(args, ctx, cpu, n)
    L, K = K3.latent, K3.topk
    row_bytes = L + L // SCALE_BLOCK + 4 * K + 4 * K  # MXFP8 row, scales, ids, weights
    norm = torch.ones(L, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    results = []
    for tokens, routing in [(t, r) for t in args.tokens for r in args.routing]:
        latent = torch.randn(tokens, L, device="cuda", generator=gen).to(torch.bfloat16)
        ids = synthetic_ids(tokens, K3.experts, K, routing, gen, "cuda").contiguous()
        weights = torch.rand(tokens, K, device="cuda", generator=gen)
        transport.reset()  # every rank's kernels are done: its rows can be rewritten
        out = routed.receive(tokens).out
        out.copy_(torch.randn(out.shape, device="cuda", generator=gen).to(torch.bfloat16))
        pair_us, d_us, c_us = pair_timed_us(
            lambda: transport.dispatch(latent, ids, weights, tokens=tokens, rejected=None),
            lambda: transport.combine(ids, norm, DEFAULT_NORM_EPS, rejected=None),
            cpu,
            args.reps,
            args.samples,
        )
        routed.synchronize()
        transport.reset()
        peer_us = (None, None, None)
        if peer is not None:
            step = peer.step(latent, ids, weights)
            peer_us = pair_timed_us(
                lambda: peer.dispatch(step),
                lambda: peer.combine(step),
                cpu,
                args.reps,
                args.samples,
            )
            torch.cuda.synchronize()

        # Baseline 1: all-gather + reduce-scatter (BF16 latents, as vLLM's default).
        g_latent = torch.empty(n * tokens, L, dtype=torch.bfloat16, device="cuda")
        g_ids = torch.empty(n * tokens, K, dtype=torch.int32, device="cuda")
        g_weights = torch.empty(n * tokens, K, dtype=torch.float32, device="cuda")
        sums = torch.randn(n * tokens, L, device="cuda", generator=gen).to(torch.bfloat16)
        scattered = torch.empty(tokens, L, dtype=torch.bfloat16, device="cuda")

        def allgather():
            dist.all_gather_into_tensor(g_latent, latent, group=ctx.group)
            dist.all_gather_into_tensor(g_ids, ids, group=ctx.group)
            dist.all_gather_into_tensor(g_weights, weights, group=ctx.group)

        ag_us, ag_mode = timed_us(allgather, cpu, args.reps, args.samples)

        def reduce_scatter():
            dist.reduce_scatter_tensor(scattered, sums, group=ctx.group)

        rs_us, rs_mode = timed_us(reduce_scatter, cpu, args.reps, args.samples)

        # Baseline 2: all_to_all_single with our bytes.
        dest = destinations(ids, n)
        send_rows = dest.sum(dim=0).tolist()  # rows to each rank
        recv_rows = torch.tensor(send_rows, dtype=torch.int64)
        all_rows = [torch.empty_like(recv_rows) for _ in range(n)]
        dist.all_gather(all_rows, recv_rows, group=cpu)
        recv_rows = [int(all_rows[s][rank]) for s in range(n)]  # rows each source sends here
        receive_rows = torch.stack(all_rows).sum(dim=0).double()  # rows each rank receives
        skew = float(receive_rows.max() / receive_rows.mean().clamp(min=1e-9))
        owner = ids[ids >= 0].long() // (K3.experts // n)
        receive_pairs = torch.bincount(owner, minlength=n).to(torch.float64).cpu()
        dist.all_reduce(receive_pairs, group=cpu)  # (row, id) pairs each rank receives
        pair_skew = float(receive_pairs.max() / receive_pairs.mean().clamp(min=1e-9))
        a2a_send = torch.empty(sum(send_rows) * row_bytes, dtype=torch.uint8, device="cuda")
        a2a_recv = torch.empty(sum(recv_rows) * row_bytes, dtype=torch.uint8, device="cuda")
        back_send = torch.empty(sum(recv_rows) * 2 * L, dtype=torch.uint8, device="cuda")
        back_recv = torch.empty(sum(send_rows) * 2 * L, dtype=torch.uint8, device="cuda")
        out_split = [r * row_bytes for r in recv_rows]
        in_split = [r * row_bytes for r in send_rows]

        back_out = [r * 2 * L for r in send_rows]
        back_in = [r * 2 * L for r in recv_rows]

        def all_to_all():
            dist.all_to_all_single(a2a_recv, a2a_send, out_split, in_split, group=ctx.group)

        def all_to_all_back():
            dist.all_to_all_single(back_recv, back_send, back_out, back_in, group=ctx.group)

        a2a_us, a2a_mode = timed_us(all_to_all, cpu, args.reps, args.samples)
        back_us, back_mode = timed_us(all_to_all_back, cpu, args.reps, args.samples)

        # Bytes that cross NVLink for this rank: the rows it dispatches to other ranks, and the
        # expert rows of its tokens that other ranks hold (the same rows, one BF16 row each).
        remote_rows = sum(r for d, r in enumerate(send_rows) if d != rank)
        d_bytes, c_bytes = remote_rows * row_bytes, remote_rows * 2 * L
        row = dict(
            tokens=tokens,
            routing=routing,
            skew=skew,
            pair_skew=pair_skew,
            receive_mib=EpRouted.workspace_bytes(n, tokens, latent=L, topk=K) / 2**20,
            dispatch=slowest(d_us, cpu),
            combine=slowest(c_us, cpu),
            pair=slowest(pair_us, cpu),
            allgather=slowest(ag_us, cpu),
            reduce_scatter=slowest(rs_us, cpu),
            a2a=slowest(a2a_us, cpu),
            a2a_back=slowest(back_us, cpu),
            d_bytes=mean(d_bytes, cpu),
            c_bytes=mean(c_bytes, cpu),
            modes="/".join(sorted({ag_mode, rs_mode, a2a_mode, back_mode})),
        )
        if peer is not None:
            row.update(
                peer_pair=slowest(peer_us[0], cpu),
                peer_dispatch=slowest(peer_us[1], cpu),
                peer_combine=slowest(peer_us[2], cpu),
            )
        results.append(row)
        if rank == 0:
            print(
                {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True
            )
    if peer is not None:
        torch.cuda.synchronize()
        dist.barrier(cpu)  # every rank done with the peer's workspace
        peer_note = peer_line(peer, cpu)
        peer.close()
    routed.close()
    if rank == 0:
        write_report(args.out, results, n, construction_s, peer_note, tuning=args.tuning)
    teardown(ctx)
    return 0


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _gbps(nbytes: float, us: float | None) -> str:
    return "-" if us is None else f"{nbytes / max(us, 1e-3) / 1e3:.0f}"


def write_report(
    out: Path,
    results: list[dict],
    n: int,
    construction_s: float,
    peer_note: str = "Peer: not run.",
    run: report.Run | None = None,
    tuning: str = "default",
) -> Path:
    """OUTDIR/bench_dep{n}.md (and .png): ours beside the peer (its columns "-" where it
    did not run), then beside the NCCL baselines; `tuning`: our kernels' (cli.KERNEL_TUNINGS)."""
    run = run or report.Run.this_process(n)
    title = f"DEP benchmark, {n} GPU{'s' if n > 1 else ''}, one process per GPU"
    page = report.Page(out / f"bench_dep{n}.md", title, report.summary(__doc__), run)
    page.text(
        f"K3 geometry (L {K3.latent}, K {K3.topk}, E {K3.experts}, {K3.experts // n} experts per"
        f" rank). Construction of the EpRouted (sized for T = {max(r['tokens'] for r in results)},"
        f" kernels compiled in it): {construction_s:.2f} s, slowest rank, ranks lined up first,"
        " NVSHMEM start-up and kernel compilation included. Our kernels' tuning:"
        f" {cli.tuning_text(tuning)}.",
    )
    page.text(peer_note)
    page.text(
        "Medians over graph replays, slowest rank (bench/bench_dep.py: methods and the baselines'"
        " definitions). Pair: back-to-back dispatch + combine pairs, no events between; dispatch,"
        " combine: events around each call (which cut the programmatic overlap). GB/s: bytes the"
        " rank sends to other ranks / time (mean over ranks).",
    )
    columns = (
        "T | routing | skew rows / pairs | receive MiB | dispatch us ours / peer"
        " | combine us ours / peer | pair us ours / peer | peer pair / ours"
        " | dispatch GB/s ours / peer | combine GB/s ours / peer"
    )
    rows = []
    for r in results:
        pd, pc, pp = r.get("peer_dispatch"), r.get("peer_combine"), r.get("peer_pair")
        rows.append(
            [
                r["tokens"],
                r["routing"],
                f"{r['skew']:.2f} / {r['pair_skew']:.2f}",
                f"{r['receive_mib']:.2f}",
                f"{_us(r['dispatch'])} / {_us(pd)}",
                f"{_us(r['combine'])} / {_us(pc)}",
                f"{_us(r['pair'])} / {_us(pp)}",
                "-" if pp is None else f"{pp / r['pair']:.2f}",
                f"{_gbps(r['d_bytes'], r['dispatch'])} / {_gbps(r['d_bytes'], pd)}",
                f"{_gbps(r['c_bytes'], r['combine'])} / {_gbps(r['c_bytes'], pc)}",
            ]
        )
    page.table(columns.split(" | "), rows)
    page.text(
        "NCCL baselines, same run (x: baseline time / ours; dispatch side against our dispatch,"
        " combine side against our combine):",
    )
    columns = (
        "T | routing | all-gather us (x) | reduce-scatter us (x) | a2a dispatch us (x)"
        " | a2a combine us (x) | NCCL timing"
    )
    rows = []
    for r in results:
        d, c = max(r["dispatch"], 1e-3), max(r["combine"], 1e-3)
        rows.append(
            [
                r["tokens"],
                r["routing"],
                f"{r['allgather']:.1f} ({r['allgather'] / d:.1f}x)",
                f"{r['reduce_scatter']:.1f} ({r['reduce_scatter'] / c:.1f}x)",
                f"{r['a2a']:.1f} ({r['a2a'] / d:.1f}x)",
                f"{r['a2a_back']:.1f} ({r['a2a_back'] / c:.1f}x)",
                r["modes"],
            ]
        )
    page.table(columns.split(" | "), rows)
    page.plot(figure(results, f"DEP, {run.hardware}, K3 geometry, {run.date}"))
    return page.write()


# The time panels: ours (a key of a result row), the NCCL baselines beside it (key, label).
TIME_PANELS = (
    ("pair", ()),
    ("dispatch", (("allgather", "all-gather"), ("a2a", "all_to_all_single"))),
    ("combine", (("reduce_scatter", "reduce-scatter"), ("a2a_back", "all_to_all_single"))),
)


def figure(results: list[dict], title: str) -> report.Figure:
    """Times against T: the pair, dispatch and combine (ours per routing, the peer and the NCCL
    baselines under the first routing), and ours and the peer's in GB/s."""
    routings = list(dict.fromkeys(r["routing"] for r in results))
    by_routing = {name: [r for r in results if r["routing"] == name] for name in routings}
    first = routings[0]
    base = by_routing[first]  # the peer and the baselines under the first routing
    peer = [r for r in base if r.get("peer_pair") is not None]

    def line(label: str, rows: list[dict], value, style: str = "o-") -> report.Series:
        """`value(row)` of each of `rows` against its T."""
        return report.Series(label, [r["tokens"] for r in rows], [value(r) for r in rows], style)

    def rate(nbytes: str, us: str):
        return lambda r: r[nbytes] / max(r[us], 1e-3) / 1e3

    panels = []
    for ours, baselines in TIME_PANELS:
        series = [
            line(f"ours, {name}", rows, lambda r: max(r[ours], 1e-2))
            for name, rows in by_routing.items()
        ]
        if peer:
            label = f"{peer_one_sided.NAME}, {first}"
            series.append(line(label, peer, lambda r: r[f"peer_{ours}"], "^-"))
        for key, label in baselines:
            series.append(line(f"NCCL {label}, {first}", base, lambda r: r[key], "s--"))
        panels.append(report.Panel("tokens per rank T", "us", series, title=ours, y_log=10))
    rates = []
    for name, rows in by_routing.items():
        rates.append(line(f"ours dispatch, {name}", rows, rate("d_bytes", "dispatch")))
        rates.append(line(f"ours combine, {name}", rows, rate("c_bytes", "combine"), "s-"))
    if peer:
        rates.append(line(f"peer dispatch, {first}", peer, rate("d_bytes", "peer_dispatch"), "^--"))
        rates.append(line(f"peer combine, {first}", peer, rate("c_bytes", "peer_combine"), "v--"))
    title_rates = "GB/s sent to other ranks, per rank"
    panels.append(report.Panel("tokens per rank T", "GB/s", rates, title=title_rates))
    return report.Figure(title, panels)


if __name__ == "__main__":
    sys.exit(main())
