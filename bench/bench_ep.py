"""EP=1 benchmark on one GPU: dispatch, combine and the pair, against the device-to-device copy
ceiling measured in the same run; the MXFP8 quantize kernel against the torch reference.

    python -m bench.bench_ep      # writes docs/results/bench_ep1.md and .png (--out: elsewhere)

One process, every expert local (EP=1), K3 geometry (L 3584, K 16, E 896). Times are medians of
CUDA-event-timed graph replays (each replay runs --reps launches back to back on the same
inputs; the median of --samples replays). Combine cannot run without a dispatch before it (the
dispatch opens the call whose flags the combine waits for), so it is timed as (dispatch +
combine) - dispatch.
Bytes are the fewest each kernel must move through device memory at EP=1 (inputs read once,
outputs written once); the receive rows and the expert output rows are fixed regions of the
symmetric buffer, as in real use. `--tunings` times the same steps with other kernel tunings
(KernelTuning: programmatic dependent launch, loads in flight, the combine's CTA size) on the
same buffers; "eager pair"
is the host's view of one dispatch + combine launched without a graph (100 pairs back to back,
then a synchronize: launch overhead included).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from bench import cli, report
from bench.timing import capture, replay_us, time_us
from dep_ep.comm.kernels.launch_args import KernelTuning
from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.config import DEFAULT_NORM_EPS
from dep_ep.constants import SCALE_BLOCK
from dep_ep.ep import K3, EpRouted
from dep_ep.launch import init_rank_context, new_dep_group, teardown
from dep_ep.testing import internals

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
REPS = 20  # launches captured per graph
SAMPLES = 30  # timed replays per step (median)
EAGER_PAIRS = 100


def copy_ceiling_gbs() -> dict[str, float]:
    """Device-to-device copy of 2 GiB of fp32, (bytes read + bytes written) / time, three ways:
    `copy_` captured in a graph (a memcpy node), the same copy eager, and an elementwise kernel
    (`torch.mul(src, 1, out=dst)`) captured in a graph. The ceiling is the best of them."""
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    nbytes = 2 * 4 * src.numel()
    graph_copy = replay_us(capture(lambda: dst.copy_(src), 2), 2, 10)
    kernel_copy = replay_us(capture(lambda: torch.mul(src, 1.0, out=dst), 2), 2, 10)
    eager_copy = time_us(lambda: dst.copy_(src), 1, 10)
    return {
        "graph memcpy": nbytes / (graph_copy * 1e-6) / 1e9,
        "eager memcpy": nbytes / (eager_copy * 1e-6) / 1e9,
        "graph kernel": nbytes / (kernel_copy * 1e-6) / 1e9,
    }


def bytes_moved(tokens: int) -> tuple[int, int]:
    """(dispatch, combine) bytes at EP=1 per step of `tokens` tokens."""
    L, K, S = K3.latent, K3.topk, K3.latent // SCALE_BLOCK  # S: scale bytes a row
    dispatch = tokens * (2 * L + 8 * K + L + S + 8 * K)  # read latent+ids+w, write x+sf+ids+w
    # read the ids row and the expert output row, write the normed row; the norm weight once
    combine = tokens * (4 * K + 2 * L + 2 * L) + 2 * L
    return dispatch, combine


def main() -> int:
    page = "bench_ep1.md and bench_ep1.png"
    p = cli.parser(__doc__, page=page, tokens=TOKENS, timing=(REPS, SAMPLES))
    p.add_argument(
        "--tunings",
        nargs="+",
        choices=sorted(cli.KERNEL_TUNINGS),
        default=["default"],
        help="kernel tunings to time, the first one in the main table",
    )
    args = p.parse_args()
    ctx = init_rank_context("cuda")
    if ctx.world_size != 1:
        raise SystemExit("bench.bench_ep: run one process (EP=1); several processes share time")
    dep = new_dep_group(ctx, 1)
    max_tokens = max(args.tokens)
    routed = EpRouted(
        dep.cpu_group,
        max_tokens,
        "cuda",
        num_experts=K3.experts,
        latent=K3.latent,
        topk=K3.topk,
    )
    # The transport alone: a dispatch without its combine (the public calls pair them).
    # EpRouted's own transport, private to it: a benchmark of one phase alone skips the
    # validation and the dispatch/combine pairing on purpose.
    transport = internals.transport(routed)
    copies = copy_ceiling_gbs()
    print("copy GB/s:", {k: round(v) for k, v in copies.items()}, flush=True)
    norm = torch.ones(K3.latent, dtype=torch.bfloat16, device="cuda")
    inputs = {tokens: make_inputs(routed, tokens) for tokens in args.tokens}
    rows, tuned = [], {}
    for name in args.tunings:
        transport.retune(KernelTuning(**cli.KERNEL_TUNINGS[name]))
        steps = [(tokens, *inputs[tokens], norm, args.reps, args.samples) for tokens in args.tokens]
        tuned[name] = [time_step(transport, routed, *step) for step in steps]
    transport.retune(None)
    for tokens, (d_us, c_us, pair_us, eager_us) in zip(args.tokens, tuned[args.tunings[0]]):
        latent = inputs[tokens][0]
        q_graph = capture(lambda: mxfp8_quantize(latent), 5)
        torch_q_us = replay_us(q_graph, 5, 10)
        d_bytes, c_bytes = bytes_moved(tokens)
        rows.append((tokens, d_us, c_us, pair_us, d_bytes, c_bytes, torch_q_us, eager_us))
    quant = quantize_speedup(max_tokens)
    routed.close()
    write_report(args.out, rows, copies, quant, tuned, args.tokens, args.reps)
    teardown(ctx)
    return 0


def make_inputs(routed: EpRouted, tokens: int):
    """(latent, ids, weights) of one step, fresh random data; the receive rows' `out` filled."""
    latent = torch.randn(tokens, K3.latent, device="cuda").to(torch.bfloat16)
    ids = torch.stack(
        [torch.randperm(K3.experts, device="cuda")[: K3.topk] for _ in range(tokens)]
    ).int()
    weights = torch.rand(tokens, K3.topk, device="cuda")
    out = routed.receive(tokens).out
    out.copy_(torch.randn_like(out, dtype=torch.float32).to(torch.bfloat16))
    return latent, ids, weights


def time_step(transport, routed, tokens, latent, ids, weights, norm, reps: int, samples: int):
    """(dispatch us, combine us, pair us, eager pair us) of one T on the transport's kernels:
    graph replays of `reps` launches, medians of `samples` replays."""

    def pair():
        transport.dispatch(latent, ids, weights, tokens=tokens, rejected=None)
        transport.combine(ids, norm, DEFAULT_NORM_EPS, rejected=None)

    transport.reset()
    pair_us = replay_us(capture(pair, reps), reps, samples)
    routed.synchronize()
    transport.reset()
    start = time.perf_counter()
    for _ in range(EAGER_PAIRS):
        pair()
    routed.synchronize()
    eager_us = (time.perf_counter() - start) * 1e6 / EAGER_PAIRS
    transport.reset()  # a dispatch alone leaves its call open: reset after it
    dispatch = capture(
        lambda: transport.dispatch(latent, ids, weights, tokens=tokens, rejected=None), reps
    )
    d_us = replay_us(dispatch, reps, samples)
    routed.synchronize()
    transport.reset()
    print(
        f"T={tokens:5d} dispatch {d_us:8.2f} us combine {pair_us - d_us:8.2f} us pair"
        f" {pair_us:8.2f} us  eager pair {eager_us:8.2f} us",
        flush=True,
    )
    return d_us, pair_us - d_us, pair_us, eager_us


def quantize_speedup(tokens: int) -> tuple[int, float, float]:
    """(tokens, kernel us, torch us) for MXFP8 quantization of [tokens, L] on the GPU."""
    from dep_ep.comm.device_transport import import_cute

    import_cute()
    from dep_ep.comm.kernels.mxfp8_quantize import Mxfp8QuantizeLaunch

    x = torch.randn(tokens, K3.latent, device="cuda").to(torch.bfloat16)
    q = torch.empty(tokens, K3.latent, dtype=torch.uint8, device="cuda")
    sf = torch.empty(tokens, K3.latent // SCALE_BLOCK, dtype=torch.uint8, device="cuda")
    quantize = Mxfp8QuantizeLaunch(K3.latent)

    def run():
        quantize(x, q, sf, torch.cuda.current_stream().cuda_stream)

    want = mxfp8_quantize(x)
    run()
    torch.cuda.synchronize()
    assert torch.equal(q, want[0]) and torch.equal(sf, want[1]), "quantize kernel != reference"
    return (
        tokens,
        replay_us(capture(run, REPS), REPS),
        replay_us(capture(lambda: mxfp8_quantize(x), 5), 5),
    )


def write_report(
    out: Path,
    rows,
    copies: dict,
    quant,
    tuned: dict,
    tokens,
    reps: int,
    run: report.Run | None = None,
) -> Path:
    """OUTDIR/bench_ep1.md and .png from the rows of `main` (us, bytes per T)."""
    run = run or report.Run.this_process()
    ceiling = max(copies.values())
    title = "EP=1 benchmark (one GPU, every expert local)"
    page = report.Page(out / "bench_ep1.md", title, report.summary(__doc__), run)
    copy_ways = ", ".join(f"{k} {v:.0f}" for k, v in copies.items())
    page.text(
        f"One process. K3 geometry: L {K3.latent}, K {K3.topk}, E {K3.experts}. Medians of"
        f" CUDA-event-timed graph replays, {reps} launches per replay on the same inputs. Copy"
        " ceiling (2 GiB device-to-device copy, read + written bytes, same run, the best of:"
        f" {copy_ways} GB/s): **{ceiling:.0f} GB/s**.",
    )
    page.text(
        "combine = (dispatch + combine) - dispatch, as combine cannot run without its dispatch.",
        "GB/s = fewest bytes the kernel must move at EP=1 / time; % = of the copy ceiling.",
    )
    columns = [
        "T",
        "dispatch us",
        "dispatch GB/s",
        "% ceiling",
        "combine us",
        "combine GB/s",
        "% ceiling",
        "dispatch+combine us",
        "eager pair us",
        "torch MXFP8 quantize us",
    ]
    cells = []
    for t, d_us, c_us, pair_us, d_bytes, c_bytes, tq, eager_us in rows:
        d_gbs, c_gbs = d_bytes / d_us / 1e3, c_bytes / max(c_us, 1e-3) / 1e3
        cells.append(
            [
                t,
                f"{d_us:.2f}",
                f"{d_gbs:.0f}",
                f"{100 * d_gbs / ceiling:.0f}%",
                f"{c_us:.2f}",
                f"{c_gbs:.0f}",
                f"{100 * c_gbs / ceiling:.0f}%",
                f"{pair_us:.2f}",
                f"{eager_us:.2f}",
                f"{tq:.1f}",
            ]
        )
    page.table(columns, cells)
    quant_tokens, k_us, t_us = quant
    page.text(
        f"MXFP8 quantization of [{quant_tokens}, {K3.latent}] BF16: kernel {k_us:.1f} us, torch"
        f" reference {t_us:.1f} us: **{t_us / k_us:.1f}x** (bit-identical outputs checked).",
    )
    if len(tuned) > 1:
        names = list(tuned)
        page.section("Kernel tunings, same run (dispatch / combine / pair, us)")
        page.text(", ".join(cli.tuning_text(n) for n in names))
        page.table(
            ["T", *names],
            [
                [t] + [" / ".join(f"{v:.2f}" for v in tuned[n][i][:3]) for n in names]
                for i, t in enumerate(tokens)
            ],
        )
    ts = [r[0] for r in rows]
    times = report.Panel(
        "tokens T",
        "us",
        y_log=10,
        series=[
            report.Series("dispatch", ts, [r[1] for r in rows], "o-"),
            report.Series("combine", ts, [max(r[2], 1e-2) for r in rows], "s-"),
        ],
    )
    rates = report.Panel(
        "tokens T",
        "GB/s",
        reference=(ceiling, "copy ceiling"),
        series=[
            report.Series("dispatch", ts, [r[4] / r[1] / 1e3 for r in rows], "o-"),
            report.Series("combine", ts, [r[5] / max(r[2], 1e-3) / 1e3 for r in rows], "s-"),
        ],
    )
    page.plot(report.Figure(f"EP=1, K3 geometry, {run.hardware}, {run.date}", [times, rates]))
    return page.write()


if __name__ == "__main__":
    sys.exit(main())
