"""Where ReferenceExperts spends a call at K3 geometry: torch profiler over a few calls, one line
per CUDA kernel and per host-side op, for one local expert count and T. It prints the tables (no
results page).

    python -m bench.profile_experts --local 56 --tokens 1 256
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench import cli
from bench.bench_experts import receive_rows
from bench.timing import time_us
from dep_ep.ep import K3
from dep_ep.experts import ReferenceExperts
from dep_ep.testing.synthetic import SyntheticLayer


def main() -> int:
    p = cli.parser(__doc__, tokens=[1, 256])
    p.add_argument("--local", type=int, default=56, help="local experts of rank 0 (of 896)")
    p.add_argument("--calls", type=int, default=5, help="calls profiled per T")
    args = p.parse_args()
    ranks = K3.experts // args.local
    backend = ReferenceExperts(SyntheticLayer(K3, 1, "cuda").local_weights(0, args.local))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tokens in args.tokens:
        x, sf, ids, weights = receive_rows(ranks, tokens, args.local, gen)
        out = torch.empty(x.shape[0], K3.latent, dtype=torch.bfloat16, device="cuda")
        ms = time_us(lambda: backend.forward(x, sf, ids, weights, out), 1, 10) / 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                backend.forward(x, sf, ids, weights, out)
            torch.cuda.synchronize()
        print(
            f"\n== local {args.local}, T={tokens}: {x.shape[0]} rows, {ms:.3f} ms a call;"
            f" profile of {args.calls} calls",
            flush=True,
        )
        table = prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=25, max_name_column_width=60
        )
        print(table, flush=True)
        table = prof.key_averages().table(
            sort_by="cpu_time_total", row_limit=15, max_name_column_width=60
        )
        print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
