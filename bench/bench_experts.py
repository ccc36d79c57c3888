"""ReferenceExperts on one GPU at K3 geometry: 56 and 112 local experts (16 and 8 ranks' worth),
T = 1..256 tokens per rank, against a per-expert loop baseline, measured in the same run.

    python bench/bench_experts.py --out docs        # writes docs/bench_experts.md

Receive rows as rank 0 of `ranks` would get them: ranks * T tokens, each with K3's 16 distinct
random experts of 896, keeping the tokens with at least one of rank 0's experts. Times are
medians of CUDA-event-timed calls (the backend reads sizes back to the host every call, so it is not
graph-captured). Floor: the BF16 weights of the experts the rows touch read once, at the copy
bandwidth measured in the same run (the reference reads its BF16 cache; a fused MXFP4 kernel
would read a quarter of that).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
from timing import time_us

from dep_ep.comm.mxfp8 import mxfp8_dequantize, mxfp8_quantize
from dep_ep.ep import K3
from dep_ep.ep.synthetic import SyntheticLayer
from dep_ep.experts import ReferenceExperts
from dep_ep.experts.situ import situ

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
LOCAL_EXPERTS = [56, 112]


def loop_forward(backend: ReferenceExperts, x, sf, ids, weights, out):
    """The previous ReferenceExperts.forward (one fp32 GEMM pair per touched expert on the
    widened BF16 cache, a masked update per k): the baseline."""
    first, count = backend.first_expert, backend.num_local_experts
    local = (ids >= first) & (ids < first + count)
    rows = local.any(dim=1).nonzero().squeeze(1)
    h = mxfp8_dequantize(x[rows], sf[rows]).float()
    row_ids = ids[rows].long() - first
    pairs = local[rows].nonzero()
    pair_expert = row_ids[pairs[:, 0], pairs[:, 1]]
    expert_out = torch.empty(pairs.shape[0], backend.latent, device=x.device)
    inter = backend.intermediate
    for expert in pair_expert.unique().tolist():
        sel = (pair_expert == expert).nonzero().squeeze(1)
        gate_up = h[pairs[sel, 0]] @ backend.w13_bf16[expert].float().T
        act = situ(gate_up[:, :inter], gate_up[:, inter:])
        o = act.to(torch.bfloat16).float() @ backend.w2_bf16[expert].float().T
        expert_out[sel] = o.to(torch.bfloat16).float()
    total = torch.zeros(rows.numel(), backend.latent, device=x.device)
    row_weights = weights[rows]
    for k in range(ids.shape[1]):
        sel = (pairs[:, 1] == k).nonzero().squeeze(1)
        at = pairs[sel, 0]
        total[at] += row_weights[at, k].unsqueeze(1) * expert_out[sel]
    out[rows] = total.to(torch.bfloat16)
    return out


def median_ms(fn, iterations: int) -> float:
    """Median milliseconds of `fn()` (one call: CUDA events around it, host syncs inside count)."""
    return time_us(fn, 1, iterations) / 1e3


def copy_gbs() -> float:
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10)
    return 2 * 4 * src.numel() / (ms * 1e-3) / 1e9


def receive_rows(ranks: int, tokens: int, local: int, gen: torch.Generator):
    """(x, sf, ids, weights) of the tokens among ranks * tokens with an id in [0, local)."""
    total = ranks * tokens
    ids = torch.rand(total, K3.experts, device="cuda", generator=gen).argsort(dim=1)
    ids = ids[:, : K3.topk].int()
    keep = (ids < local).any(dim=1)
    ids = ids[keep]
    latent = torch.randn(ids.shape[0], K3.latent, device="cuda", generator=gen).bfloat16()
    weights = torch.rand(ids.shape[0], K3.topk, device="cuda", generator=gen)
    x, sf = mxfp8_quantize(latent)
    return x, sf, ids, weights


def bench_local(local: int, ceiling: float, iterations: int, gen: torch.Generator) -> list:
    """Report rows for one local expert count (rank 0 of K3.experts // local ranks)."""
    ranks = K3.experts // local
    expert_bytes = 3 * K3.intermediate * K3.latent * 2  # BF16 cache per expert
    layer = SyntheticLayer(K3, seed=1, device="cuda")
    backend = ReferenceExperts(*layer.local(0, local), first_expert=0)
    rows = []
    for tokens in TOKENS:
        x, sf, ids, weights = receive_rows(ranks, tokens, local, gen)
        out = torch.empty(x.shape[0], K3.latent, dtype=torch.bfloat16, device="cuda")
        base = torch.empty_like(out)
        new_ms = median_ms(lambda: backend.forward(x, sf, ids, weights, out), iterations)
        old_ms = median_ms(lambda: loop_forward(backend, x, sf, ids, weights, base), iterations)
        diff = (out.float() - base.float()).norm() / base.float().norm()
        touched = int(ids[(ids < local)].unique().numel())
        pairs = int((ids < local).sum())
        floor_ms = touched * expert_bytes / (ceiling * 1e9) * 1e3
        rows.append((local, ranks, tokens, x.shape[0], pairs, touched, new_ms, old_ms, floor_ms,
                     float(diff)))  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs", help="folder for bench_experts.md")
    p.add_argument("--iterations", type=int, default=10)
    args = p.parse_args()
    ceiling = copy_gbs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for local in LOCAL_EXPERTS:
        rows += bench_local(local, ceiling, args.iterations, gen)
        torch.cuda.empty_cache()
    write_report(Path(args.out), rows, ceiling, args.iterations)
    return 0


def write_report(out: Path, rows, ceiling: float, iterations: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# ReferenceExperts on one GPU, K3 geometry", "",
        f"GPU: {torch.cuda.get_device_name()}. Date: {datetime.date.today().isoformat()}."
        f" Command: `python bench/bench_experts.py --out OUTDIR` (one process). torch"
        f" {torch.__version__}.", "",
        "Rows: rank 0's receive rows when `ranks` ranks each route T tokens (16 distinct random"
        " experts of 896). pairs: (row, local expert) pairs; touched: local experts with rows."
        f" Medians of {iterations} CUDA-event-timed calls. Baseline: a per-expert loop"
        " (fp32 GEMMs on widened weights, a masked update per k), same run, same"
        " rows. Floor: touched experts' BF16 weights (66.1 MB each) read once at the copy"
        f" bandwidth measured in the same run ({ceiling:.0f} GB/s). rel diff: relative L2"
        " between the two implementations' outputs (summation order only).", "",
        "| local experts (ranks) | T | rows | pairs | touched | ReferenceExperts ms |"
        " per-expert loop ms | speedup | floor ms | % of floor | rel diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for local, ranks, tokens, nrows, pairs, touched, new_ms, old_ms, floor_ms, diff in rows:
        lines.append(f"| {local} ({ranks}) | {tokens} | {nrows} | {pairs} | {touched} |"
                     f" {new_ms:.3f} | {old_ms:.3f} | {old_ms / new_ms:.1f}x | {floor_ms:.3f} |"
                     f" {100 * floor_ms / new_ms:.0f}% | {diff:.1e} |")  # fmt: skip
    lines.append("")
    (out / "bench_experts.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
