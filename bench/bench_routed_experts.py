"""The routed path end to end with real experts, one process per GPU: dispatch -> HopperExperts (or
the device's default experts) -> combine with RMSNorm, K3 geometry, against the MXFP4 weight-read
floor, beside FlashInfer's fused MoE-EP layer when its log is given.

    torchrun --nproc-per-node N bench/bench_routed_experts.py --out OUTDIR [--peer-log FILE]
    # OUTDIR/bench_routed_experts{N}.md, .png

Weights: SyntheticLayer(K3) experts, this rank's 896 / N (448 at N = 2). Experts backend: on
SM90 HopperExperts(..., num_experts=896, tiles=HopperTiles(grouping=--grouping)), its default
engine (humming where installed); elsewhere `default_experts`. Routing: uniform, 16 distinct
experts a token (synthetic_ids), fresh per T. Times: EpRouted.routed (dispatch + experts +
combine + RMSNorm), median over samples of CUDA-event-timed graph replays of REPS calls (eager
where capture fails, marked), ranks lined up by a host barrier, the slowest rank's median. One
eager call per T first (humming compiles a kernel for a new pair bound there). Floor: the
experts a rank's rows touch (17,547,264 MXFP4 bytes each) read once at the copy bandwidth
measured in the run, the largest over ranks.

--peer-log: the stdout of FlashInfer's fused layer benchmark run on the same GPUs in the same
session, whose result lines read `FI_MEGA {json}` with keys T, local, layer_us (and error): its
layer time is put beside ours, T by T, in one table and one plot (--peer-ranks: the world size
it ran at, 2 by default; the file is read before any GPU work). Ranks sharing one GPU are
time-sliced: refused.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from bench_experts import EXPERT_BYTES, copy_gbs
from timing import timed_us

from dep_ep.config import EpConfig
from dep_ep.ep import K3, EpRouted
from dep_ep.experts import default_experts
from dep_ep.experts.hopper import GROUPINGS, HopperExperts, HopperTiles, default_engine
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
        raise ValueError(f"{path}: no `{PEER_PREFIX.strip()}` line without error at {local} local"
                         " experts per rank")  # fmt: skip
    return times


def reduce(value: float, group, op) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return float(t)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="docs")
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="tokens per rank T")
    p.add_argument("--grouping", choices=GROUPINGS, default=HopperTiles().grouping)
    p.add_argument("--peer-log", type=Path, default=None, help="FlashInfer fused layer's stdout")
    p.add_argument("--peer-ranks", type=int, default=2, help="the ranks the peer ran on")
    args = p.parse_args()
    # The peer's log is read before any GPU work, so that a wrong file fails at once.
    peer = read_peer_log(args.peer_log, K3.experts // args.peer_ranks) if args.peer_log else {}
    ctx = init_rank_context("cuda", timeout_s=300.0)
    if ctx.backend != "nccl":
        raise SystemExit("bench_routed_experts.py: needs one GPU per rank (time-slicing)")
    n, rank = ctx.world_size, ctx.rank
    cpu = new_dep_group(ctx, n).cpu_group
    routed = EpRouted(cpu, max(args.tokens), "cuda", num_experts=K3.experts, latent=K3.latent,
                      topk=K3.topk, config=EpConfig(timeout_s=60.0))  # fmt: skip
    local = routed.experts_per_rank
    synthetic = SyntheticLayer(K3, seed=1, device="cuda")
    weights_4bit = synthetic.local_weights(routed.first_expert, local)
    if HopperExperts.unsupported_reason(ctx.device) is None:
        tiles = HopperTiles(grouping=args.grouping)
        engine = default_engine(K3.latent, K3.intermediate, tiles=tiles)
        experts = HopperExperts(weights_4bit, engine=engine)
    else:  # not SM90: the device's default backend (--grouping does not apply)
        experts = default_experts(weights_4bit)
    norm = SyntheticLayer(K3, seed=1, device="cuda").norm_weight()
    bandwidth = reduce(copy_gbs(), cpu, dist.ReduceOp.MIN)
    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    results = []
    for tokens in args.tokens:
        latent = torch.randn(tokens, K3.latent, device="cuda", generator=gen).to(torch.bfloat16)
        ids = synthetic_ids(tokens, K3.experts, K3.topk, "uniform", gen, "cuda")
        weights = torch.rand(tokens, K3.topk, device="cuda", generator=gen)

        def step():
            return routed.routed(latent, ids, weights, norm, experts=experts, tokens=tokens)

        finite = bool(step().isfinite().all())  # eager first: humming compiles here
        routed.synchronize()
        rows = routed.receive(tokens).ids
        mine = rows[(rows >= routed.first_expert) & (rows < routed.first_expert + local)]
        touched = int(mine.unique().numel())
        us, mode = timed_us(step, cpu, REPS, SAMPLES)
        routed.synchronize()
        row = {
            "tokens": tokens, "us": reduce(us, cpu, dist.ReduceOp.MAX),
            "touched": reduce(touched, cpu, dist.ReduceOp.MAX), "mode": mode,
            "finite": reduce(0.0 if finite else 1.0, cpu, dist.ReduceOp.MAX) == 0.0,
        }  # fmt: skip
        row["floor_us"] = row["touched"] * EXPERT_BYTES / (bandwidth * 1e9) * 1e6
        results.append(row)
        if rank == 0:
            print(row, flush=True)
    backend = type(experts).__name__ + (
        f" ({experts.engine})" if hasattr(experts, "engine") else ""
    )
    routed.close()
    if peer and args.peer_ranks != n:
        peer = {}  # another world size: nothing to compare with
        print(f"--peer-ranks {args.peer_ranks} != {n} ranks: the peer is left out", file=sys.stderr)
    if rank == 0:
        meta = {"n": n, "local": local, "bandwidth": bandwidth, "backend": backend,
                "grouping": args.grouping, "gpu": torch.cuda.get_device_name(),
                "arguments": " ".join(sys.argv[1:])}  # fmt: skip
        write_report(Path(args.out), results, peer, meta)
    teardown(ctx)
    return 0


def write_report(out: Path, results: list[dict], peer: dict[int, float], meta: dict) -> None:
    """OUTDIR/bench_routed_experts{N}.md and .png from the rows of `main` and the peer's times."""
    out.mkdir(parents=True, exist_ok=True)
    n = meta["n"]
    lines = [
        f"# Routed path with experts, {n} GPU{'s' if n > 1 else ''}, one process per GPU", "",
        f"GPU: {n} x {meta['gpu']}. Date: {datetime.date.today().isoformat()}. Command: `torchrun"
        f" --nproc-per-node {n} bench/bench_routed_experts.py {meta['arguments']}` (see its"
        f" docstring). K3 geometry, {meta['local']} local experts per"
        f" rank, experts backend {meta['backend']}, copy bandwidth {meta['bandwidth']:.0f} GB/s.",
        "",
        "ours: EpRouted.routed (dispatch, experts, combine with RMSNorm), CUDA-graph replay,"
        " slowest rank. floor: the touched experts' MXFP4 bytes at the copy bandwidth"
        " (% = floor / time)."
        " FlashInfer: its fused MoE-EP layer's time from the log of the same session (--peer-log);"
        " x = FlashInfer / ours (above 1: ours is faster).", "",
        "| T | touched | floor us | ours us | ours % | FlashInfer us | FlashInfer % | x | timing |"
        " finite |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in results:
        theirs = peer.get(r["tokens"])
        cells = [str(r["tokens"]), f"{r['touched']:.0f}", f"{r['floor_us']:.0f}", f"{r['us']:.0f}",
                 f"{100 * r['floor_us'] / r['us']:.0f}%"]  # fmt: skip
        if theirs is None:
            cells += ["-", "-", "-"]
        else:
            cells += [f"{theirs:.0f}", f"{100 * r['floor_us'] / theirs:.0f}%",
                      f"{theirs / r['us']:.2f}"]  # fmt: skip
        cells += [r["mode"], "yes" if r["finite"] else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    (out / f"bench_routed_experts{n}.md").write_text("\n".join(lines))
    plot(out / f"bench_routed_experts{n}.png", results, peer, meta)


def plot(path: Path, results: list[dict], peer: dict[int, float], meta: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    ts = [r["tokens"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ts, [r["us"] for r in results], "o-", label=f"ours: routed path, {meta['backend']}")
    shared = [t for t in ts if t in peer]
    if shared:
        ax.plot(shared, [peer[t] for t in shared], "s-", label="FlashInfer fused MoE-EP layer")
    ax.plot(ts, [r["floor_us"] for r in results], "--", label="MXFP4 weight-read floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank (T)")
    ax.set_ylabel("us per layer call")
    ax.set_title(f"K3 routed path, {meta['n']} x {meta['gpu']}, {meta['local']} local experts")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
