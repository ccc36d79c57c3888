"""Construction time of EpRouted at K3 geometry: the first construction (kernels compiled), a
second one of the same geometry (kernels from the in-process cache), and one with the cache
emptied first (what every construction cost before the cache).

    torchrun --nproc-per-node 1 -m bench.bench_construction   # docs/results/bench_construction.md
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench import cli, report
from dep_ep.comm import device_transport
from dep_ep.config import K3
from dep_ep.ep import EpRouted
from dep_ep.launch import init_rank_context, new_dep_group, teardown

MAX_TOKENS = 256


def construct_s(group, device) -> float:
    """Host wall-clock seconds of one EpRouted construction (closed after)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    routed = EpRouted(
        group, MAX_TOKENS, device, num_experts=K3.experts, latent=K3.latent, topk=K3.topk
    )
    took = time.perf_counter() - start
    routed.close()
    return took


def main() -> int:
    args = cli.parser(__doc__, page="bench_construction.md").parse_args()
    ctx = init_rank_context("cuda")
    dep = new_dep_group(ctx, ctx.world_size)
    runs = [("first (compiles)", construct_s(dep.cpu_group, ctx.device))]
    runs.append(("second, same geometry (cached kernels)", construct_s(dep.cpu_group, ctx.device)))
    device_transport._COMPILED.clear()
    runs.append(("cache emptied first (compiles again)", construct_s(dep.cpu_group, ctx.device)))
    if dep.rank == 0:
        print(write_report(args.out, runs, dep.size).read_text())
    teardown(ctx)
    return 0


def write_report(
    out: Path, runs: list[tuple[str, float]], ranks: int, run: report.Run | None = None
) -> Path:
    """OUTDIR/bench_construction.md from (construction, seconds) pairs."""
    run = run or report.Run.this_process(ranks)
    summary = report.summary(__doc__)
    page = report.Page(out / "bench_construction.md", "EpRouted construction time", summary, run)
    page.text(
        f"K3 geometry, max_tokens {MAX_TOKENS}, {ranks} rank(s). Host wall clock of the"
        " constructor (agreement, NVSHMEM allocation, kernel compilation).",
    )
    page.table(["construction", "seconds"], [(name, f"{s:.2f}") for name, s in runs])
    return page.write()


if __name__ == "__main__":
    raise SystemExit(main())
