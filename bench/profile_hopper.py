"""Where HopperExperts (humming engine, its defaults) spends a call at K3 geometry: torch profiler
over 5 eager calls after one warm-up call, GPU time per call of each kernel, at 56 local experts
(rank 0 of 16) for T = 1, 2, 8, 32, 64, 256, 2048, at 448 (rank 0 of 2) for T = 1, 16, 256 and
at 896 (one rank) for T = 1; beside it, the call in graph replay.

    python -m bench.profile_hopper     # writes docs/results/profile_hopper.md

Eager calls: the kernels' GPU times are those of graph replay; the gaps between launches are not.
The busy sum counts each kernel once per call; the call in graph replay (bench_experts' timing,
the same rows) is the busy time plus the gaps between its kernels.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench import cli, report
from bench.bench_experts import copy_gbs, floors, fp8_tflops, graph_us, receive_rows
from dep_ep.ep import K3
from dep_ep.experts.hopper import HopperExperts, HummingEngine
from dep_ep.testing.synthetic import SyntheticLayer

CASES = {
    56: (1, 2, 8, 32, 64, 256, 2048),
    448: (1, 16, 256),
    896: (1,),
}  # local experts: T per rank
CALLS = 5
KERNEL_NAME_CHARS = 60


def out_of(rows) -> torch.Tensor:
    """A call's output rows for receive rows `rows` (x, sf, ids, weights)."""
    return torch.empty(rows[2].shape[0], K3.latent, dtype=torch.bfloat16, device="cuda")


def profile_case(backend: HopperExperts, rows) -> tuple[float, list[tuple[str, float, int]]]:
    """(GPU busy us a call, [(kernel, us a call, launches a call)] longest first)."""
    out = out_of(rows)
    backend.forward(*rows, out)  # compiles humming's kernels for this pair count
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            backend.forward(*rows, out)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels = [
        (e.key[:KERNEL_NAME_CHARS], e.self_device_time_total / CALLS, e.count // CALLS)
        for e in sorted(events, key=lambda e: -e.self_device_time_total)
    ]
    return sum(us for _, us, _ in kernels), kernels


def main() -> int:
    args = cli.parser(__doc__, page="profile_hopper.md").parse_args()
    bandwidth, rate = copy_gbs(), fp8_tflops()
    title = "Where HopperExperts' call goes (humming engine)"
    page = report.Page(
        args.out / "profile_hopper.md", title, report.summary(__doc__), report.Run.this_process()
    )
    page.text(
        f"Copy bandwidth measured in the run: {bandwidth:.0f} GB/s; dense FP8 rate (bench_experts'"
        f" fp8_tflops): {rate:.0f} TFLOP/s. torch profiler over {CALLS}"
        " eager calls after a warm-up call; per call, each kernel's GPU time (eager launches: the"
        " gaps between kernels are not counted). Rows drawn as bench_experts.py draws them"
        " (uniform routing), in a draw of their own; floor: bench_experts' `floors`, the larger of"
        " the touched experts' weights read once and the pairs' FLOPs at the dense FP8 rate.",
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    for local, token_counts in CASES.items():
        weights = SyntheticLayer(K3, seed=1, device="cuda").local_weights(0, local)
        backend = HopperExperts(weights, engine=HummingEngine())
        for tokens in token_counts:
            rows = receive_rows(K3.experts // local, tokens, local, gen)
            ids = rows[2]
            touched = int(ids[(ids >= 0) & (ids < local)].unique().numel())
            pairs = int(((ids >= 0) & (ids < local)).sum())
            floor = floors(touched, pairs, bandwidth, rate).floor_us
            busy, kernels = profile_case(backend, rows)
            tuned = backend.tuning_pairs(ids.shape[0], K3.topk)
            title = (
                f"{local} local experts, T = {tokens}: {ids.shape[0]} rows, {pairs} pairs,"
                f" kernels for {tuned}"
            )
            out = out_of(rows)
            replay = graph_us(lambda b=backend, r=rows, o=out: b.forward(*r, o), 10, 10)
            busy_line = (
                f"GPU busy {busy:.0f} us a call; floor {floor:.0f} us ({100 * floor / busy:.0f}%);"
                f" the call in graph replay {replay:.0f} us ({100 * floor / replay:.0f}%), gaps"
                f" {replay - busy:.0f} us."
            )
            print(title, "|", busy_line, flush=True)
            page.section(title)
            page.text(busy_line)
            cells = [
                (f"`{name}`", f"{us:.1f}", count, f"{100 * us / busy:.0f}%")
                for name, us, count in kernels
            ]
            page.table(["kernel", "us a call", "launches", "share"], cells)
        del weights, backend
        torch.cuda.empty_cache()
    page.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
