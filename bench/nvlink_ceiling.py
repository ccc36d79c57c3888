"""NVLink write ceiling between two GPUs: what an SM kernel (and the copy engines) can store into
the peer's NVSHMEM memory, one way and both ways at once, at the sizes our dispatch and combine
move. The floor the EP=2 benchmark is read against.

    torchrun --nproc-per-node 2 -m bench.nvlink_ceiling     # docs/results/nvlink_ceiling.md

Kernel: `torch.mul(src, 1, out=peer_view)` (an elementwise kernel whose stores go over NVLink);
copy engine: `peer_view.copy_(src)`. Both captured in a CUDA graph (--reps per replay) and timed
with CUDA events after a host barrier, the median of --samples; GB/s = bytes written by one rank
/ its median time; "both" means both ranks write to each other at the same time (as dispatch and
combine do).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bench import cli, report
from bench.timing import capture, time_us
from dep_ep.comm.nvshmem_alloc import allocate_nvshmem, free_nvshmem
from dep_ep.launch import init_rank_context, teardown

SIZES_MB = [1, 4, 16, 64, 256]
REPS, SAMPLES = 5, 20  # writes per captured graph, timed replays (median)


def main() -> int:
    args = cli.parser(__doc__, page="nvlink_ceiling.md", timing=(REPS, SAMPLES)).parse_args()
    ctx = init_rank_context("cuda", timeout_s=120.0)
    if ctx.world_size != 2 or ctx.backend != "nccl":
        raise SystemExit("bench.nvlink_ceiling: two processes, one GPU each")
    group, rank = ctx.cpu_group, ctx.rank
    most = max(SIZES_MB) << 20
    mem = allocate_nvshmem(group, rank, 2, most, ctx.device)
    src = torch.randn(most // 4, device=ctx.device)
    peer = mem[1 - rank].view(torch.float32)
    rows = []
    for mb in SIZES_MB:
        n = (mb << 20) // 4
        for name, fn in (
            ("kernel", lambda: torch.mul(src[:n], 1.0, out=peer[:n])),
            ("copy engine", lambda: peer[:n].copy_(src[:n])),
        ):
            graph = capture(fn, args.reps)
            for both in (False, True):
                writes = both or rank == 0
                run = graph.replay if writes else (lambda: None)
                us = time_us(run, args.reps, args.samples, before=lambda: dist.barrier(group))
                t = torch.tensor([us if writes else 0.0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                gbs = (mb << 20) / (float(t) * 1e-6) / 1e9
                rows.append((mb, name, "both" if both else "one way", float(t), gbs))
                if rank == 0:
                    print(rows[-1], flush=True)
    dist.barrier(group)
    if rank == 0:
        write_report(args.out, rows)
    free_nvshmem(mem[rank])
    teardown(ctx)
    return 0


def write_report(out: Path, rows, run: report.Run | None = None) -> Path:
    """OUTDIR/nvlink_ceiling.md from (MB, writer, direction, us, GB/s) rows."""
    run = run or report.Run.this_process(2)
    title = "NVLink write ceiling, two GPUs"
    page = report.Page(out / "nvlink_ceiling.md", title, report.summary(__doc__), run)
    page.text(
        "Stores from GPU r into GPU 1-r's NVSHMEM memory; medians of graph replays (slowest"
        " rank); GB/s per writing rank.",
    )
    cells = [
        (mb, name, direction, f"{us:.1f}", f"{gbs:.0f}") for mb, name, direction, us, gbs in rows
    ]
    page.table(["MB", "writer", "direction", "us", "GB/s"], cells)
    return page.write()


if __name__ == "__main__":
    sys.exit(main())
