"""Construction time of EpRouted at K3 geometry, one process: the first construction (kernels
compiled), a second one of the same geometry (kernels from the in-process cache), and one with the
cache emptied first (what every construction cost before the cache).

    python -m bench.bench_construction --out OUTDIR      # writes OUTDIR/bench_construction.md
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import torch

from dep_ep.comm import device_transport
from dep_ep.config import K3
from dep_ep.ep import EpRouted
from dep_ep.launch import init_rank_context, new_dep_group, teardown

MAX_TOKENS = 256


def construct_s(group, device) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    routed = EpRouted(group, MAX_TOKENS, device, num_experts=K3.experts, latent=K3.latent,
                      topk=K3.topk)  # fmt: skip
    took = time.perf_counter() - start
    routed.close()
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    args = p.parse_args()
    ctx = init_rank_context("cuda")
    dep = new_dep_group(ctx, ctx.world_size)
    runs = [("first (compiles)", construct_s(dep.cpu_group, ctx.device))]
    runs.append(("second, same geometry (cached kernels)", construct_s(dep.cpu_group, ctx.device)))
    device_transport._COMPILED.clear()
    runs.append(("cache emptied first (compiles again)", construct_s(dep.cpu_group, ctx.device)))
    if dep.rank == 0:
        lines = [
            "# EpRouted construction time", "",
            f"GPU: {dep.size} x {torch.cuda.get_device_name()}. Date:"
            f" {datetime.date.today().isoformat()}. Command: `torchrun --nproc-per-node"
            f" {dep.size} -m bench.bench_construction --out OUTDIR`. K3 geometry, max_tokens"
            f" {MAX_TOKENS}, {dep.size} rank(s). Host wall clock of the constructor (agreement,"
            " NVSHMEM allocation, kernel compilation).", "",
            "| construction | seconds |", "|---|---|",
            *(f"| {name} | {s:.2f} |" for name, s in runs), "",
        ]  # fmt: skip
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_construction.md").write_text("\n".join(lines))
        print("\n".join(lines))
    teardown(ctx)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
