"""Across layers: does prefetching an experts call's weights into L2, at the start of the idle
time before it (the previous layer's combine, this layer's dispatch), make the call faster? One
GPU, K3 geometry, HopperExperts (the humming engine) at 56 and 448 local experts (rank 0 of 16
and 2 ranks), decode sizes, all measured in the same run.

    python -m bench.bench_l2_prefetch     # writes docs/results/bench_l2_prefetch.md

Each timed step is [prefetch] -> window -> HopperExperts call, captured in a CUDA graph (--reps
steps a graph, median of --samples replays, per step), on receive rows drawn as bench_experts
draws them (uniform routing). The window: a sleep kernel of --windows us (0: none; its real
length is timed alone in the run and given), standing in for the time a layer sequence leaves
the memory idle before the call. The prefetch: one launch of `l2_prefetch_kernel`
(cp.async.bulk.prefetch.L2, a hint: it moves no data the call reads), the first budget / n bytes
of FC1's weights (humming's layout, expert-major) of n experts: "touched", the experts the call's
rows reach (known only after the layer's routing: an upper bound of what a schedule can know a
layer ahead), or "every", all local experts (what it does know); budgets in MiB. gain = the step
without the prefetch - the step with it (above 0: the prefetch helped). probe: the same for a
32 MiB copy of the weights in place of the call, the prefetched bytes being those 32 MiB, each
step starting with a 128 MiB copy elsewhere (timed alone in the run) that evicts them from L2:
whether the hint brings bytes into L2 at all. A row's "none" column grows by the windows'
lengths from one window to the next where the call's time is steady; where it moves by more,
that row's gains are within its run-to-run spread.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from bench import cli, report
from bench.bench_experts import EXPERT_BYTES, copy_gbs, graph_us, receive_rows
from dep_ep.ep import K3
from dep_ep.experts.hopper import HopperExperts, HummingEngine
from dep_ep.experts.hopper.grouping_kernel import group_and_route
from dep_ep.testing.synthetic import SyntheticLayer

TOKENS = [1, 4, 16, 64]
LOCAL_EXPERTS = [56, 448]
WINDOWS_US = [0, 10, 20]
MIB = 1 << 20
# (column, which experts, budget bytes): the prefetches timed against none.
PREFETCHES = [
    ("touched 16", "touched", 16 * MIB),
    ("touched 32", "touched", 32 * MIB),
    ("every 32", "every", 32 * MIB),
    ("every 64", "every", 64 * MIB),
]
PROBE_BYTES = 32 * MIB
EVICT_BYTES = 128 * MIB  # the probe's copy between steps: 256 MiB of traffic through L2
PREFETCH_CHUNK = 1 << 20  # bytes a program prefetches (32 lanes x 32 KiB)
PREFETCH_LANES = 32
SLEEP_CLOCK_GHZ = 1.98  # the sleep kernel's cycles per ns, nominal (its length is timed)
REPS, SAMPLES = 10, 15


@triton.jit
def l2_prefetch_kernel(
    wanted_ptr,
    base,
    expert_stride,
    expert_bytes,
    budget,
    num_local,
    BINS: tl.constexpr,
    CHUNK: tl.constexpr,
    LANES: tl.constexpr,
):
    """Program (e, c): if local expert e is wanted (wanted int64 [num_local] > 0), hint L2 to
    fetch bytes [c * CHUNK, (c + 1) * CHUNK) of its first min(expert_bytes, budget / wanted
    experts) bytes (rounded down to 4 KiB), the expert's bytes at base + e * expert_stride."""
    e = tl.program_id(0)
    c = tl.program_id(1)
    if tl.load(wanted_ptr + e) > 0:
        bins = tl.arange(0, BINS)
        counts = tl.load(wanted_ptr + bins, mask=bins < num_local, other=0)
        wanted = tl.sum((counts > 0).to(tl.int64))
        limit = tl.minimum(expert_bytes, (budget // wanted) // 4096 * 4096)
        piece: tl.constexpr = CHUNK // LANES
        start = c.to(tl.int64) * CHUNK + tl.arange(0, LANES).to(tl.int64) * piece
        size = tl.minimum(limit - start, piece).to(tl.int32)
        address = base + e.to(tl.int64) * expert_stride + start
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0;"
            " @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [address, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def prefetch(weight: torch.Tensor, wanted: torch.Tensor, budget: int) -> None:
    """One launch: the first budget / n bytes of each wanted expert's [E, ...] `weight` slice."""
    num_local = wanted.numel()
    expert_bytes = weight[0].numel() * weight.element_size()
    grid = (num_local, triton.cdiv(expert_bytes, PREFETCH_CHUNK))
    l2_prefetch_kernel[grid](
        wanted,
        weight.data_ptr(),
        weight.stride(0) * weight.element_size(),
        expert_bytes,
        budget,
        num_local,
        triton.next_power_of_2(num_local),
        PREFETCH_CHUNK,
        PREFETCH_LANES,
        num_warps=1,
    )


def sleep_cycles(window_us: float) -> int:
    return int(window_us * SLEEP_CLOCK_GHZ * 1e3)


def bench_row(experts, fc1_weight, local: int, tokens: int, args, bandwidth, gen) -> dict:
    """One (local, T) row: every window, without and with each prefetch."""
    rows = receive_rows(K3.experts // local, tokens, local, gen)
    ids = rows[2]
    groups, _ = group_and_route(ids, 0, local, 16)
    touched = groups.expert_pairs.clone()
    every = torch.ones(local, dtype=torch.int64, device="cuda")
    out = torch.empty(ids.shape[0], K3.latent, dtype=torch.bfloat16, device="cuda")
    experts.forward(*rows, out)  # humming compiles for this pair count here
    torch.cuda.synchronize()
    want = out.clone()
    n_touched = int((touched > 0).sum())
    result = {
        "local": local,
        "tokens": tokens,
        "touched": n_touched,
        "weight_us": n_touched * EXPERT_BYTES / (bandwidth * 1e9) * 1e6,
    }
    for window in args.windows:
        cycles = sleep_cycles(window)
        settings = [("none", None, 0)] + [
            (name, touched if which == "touched" else every, budget)
            for name, which, budget in PREFETCHES
        ]
        for name, wanted, budget in settings:

            def step(wanted=wanted, budget=budget, cycles=cycles):
                if wanted is not None:
                    prefetch(fc1_weight, wanted, budget)
                if cycles:
                    torch.cuda._sleep(cycles)
                experts.forward(*rows, out)

            step()
            torch.cuda.synchronize()
            # A hint moves no data the call reads: the output is the call's (to its own
            # rerun spread: humming's stream-K kernels may add partial outputs in any order).
            result[f"w{window} diff {name}"] = float((out.float() - want.float()).abs().max())
            result[f"w{window} {name}"] = graph_us(step, args.reps, args.samples)
    return result


def probe(fc1_weight: torch.Tensor, args) -> dict:
    """A 32 MiB copy of the weights after each window, without and with its prefetch, each step
    starting with a 128 MiB copy elsewhere that evicts the previous step's bytes from L2 (the
    H200's L2 is 50 MiB): whether the hint brings bytes into L2 at all."""
    flat = fc1_weight.view(-1)
    span = flat[: PROBE_BYTES // flat.element_size()]
    copied = torch.empty_like(span)
    expert_bytes = fc1_weight[0].numel() * fc1_weight.element_size()
    experts_spanned = -(-PROBE_BYTES // expert_bytes)
    wanted = torch.zeros(fc1_weight.shape[0], dtype=torch.int64, device="cuda")
    wanted[:experts_spanned] = 1
    evict_from = torch.empty(EVICT_BYTES, dtype=torch.uint8, device="cuda")
    evict_to = torch.empty_like(evict_from)
    result = {}
    for window in args.windows:
        cycles = sleep_cycles(window)
        for name, hint in (("none", False), ("prefetched", True)):

            def step(hint=hint, cycles=cycles):
                evict_to.copy_(evict_from)
                if hint:
                    prefetch(fc1_weight, wanted, experts_spanned * expert_bytes)
                if cycles:
                    torch.cuda._sleep(cycles)
                copied.copy_(span)

            step()
            result[f"w{window} {name}"] = graph_us(step, args.reps, args.samples)
        result[f"w{window} sleep"] = graph_us(lambda c=cycles: torch.cuda._sleep(c), 10, 10)
    result["evict"] = graph_us(lambda: evict_to.copy_(evict_from), 10, 10)
    return result


def write_report(results, probe_result, args, bandwidth, run=None) -> None:
    page = report.Page(
        args.out / "bench_l2_prefetch.md",
        "L2 prefetch of an experts call's weights ahead of it, K3, one GPU",
        report.summary(__doc__),
        run or report.Run.this_process(),
    )
    page.text(
        f"One process. Copy bandwidth measured in the run: {bandwidth:.0f} GB/s. Windows, as"
        " timed alone (us): "
        + ", ".join(f"{w}: {probe_result[f'w{w} sleep']:.1f}" for w in args.windows if w)
        + "."
    )
    page.section(
        "Probe: a 128 MiB copy elsewhere, then a 32 MiB copy of the weights after the window"
    )
    page.text(f"The 128 MiB copy alone: {probe_result['evict']:.1f} us.")
    page.table(
        ["window us", "step us", "step with the prefetch us", "gain us"],
        [
            [
                w,
                f"{probe_result[f'w{w} none']:.1f}",
                f"{probe_result[f'w{w} prefetched']:.1f}",
                f"{probe_result[f'w{w} none'] - probe_result[f'w{w} prefetched']:+.1f}",
            ]
            for w in args.windows
        ],
    )
    names = [name for name, _, _ in PREFETCHES]
    for window in args.windows:
        page.section(f"Window {window} us: [prefetch] -> window -> HopperExperts")
        rows = []
        for r in results:
            base = r[f"w{window} none"]
            cells = [r["local"], r["tokens"], r["touched"], f"{r['weight_us']:.0f}", f"{base:.1f}"]
            for name in names:
                us = r[f"w{window} {name}"]
                cells += [f"{us:.1f}", f"{base - us:+.1f}"]
            rows.append(cells)
        columns = ["local", "T", "touched", "weight floor us", "none us"]
        for name in names:
            columns += [f"{name} us", "gain us"]
        page.table(columns, rows)
    page.text(
        "Largest |output - output without a prefetch| over every row and prefetch: "
        f"{max(v for r in results for k, v in r.items() if ' diff ' in k):.3g}"
        " (humming's default kernels; reruns of the call itself may differ in the last bits)."
    )
    print(page.write())


def main() -> int:
    parser = cli.parser(__doc__, page="bench_l2_prefetch.md", tokens=TOKENS, timing=(REPS, SAMPLES))
    parser.add_argument("--local", type=int, nargs="+", default=LOCAL_EXPERTS)
    parser.add_argument("--windows", type=int, nargs="+", default=WINDOWS_US)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_l2_prefetch: needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_gbs()
    results = []
    probe_result = None
    for local in args.local:
        weights = SyntheticLayer(K3, seed=1, device="cuda").local_weights(0, local)
        experts = HopperExperts(weights, engine=HummingEngine())
        fc1_weight = experts.prepared.fc1.tensors["weight"]
        # The prefetch takes an expert's bytes as fc1_weight[e]: [E, ...] and contiguous.
        assert fc1_weight.shape[0] == local and fc1_weight.is_contiguous(), fc1_weight.shape
        print("humming FC1 weight", tuple(fc1_weight.shape), fc1_weight.dtype, flush=True)
        if probe_result is None:
            probe_result = probe(fc1_weight, args)
            print(probe_result, flush=True)
        for tokens in args.tokens:
            result = bench_row(experts, fc1_weight, local, tokens, args, bandwidth, gen)
            print(result, flush=True)
            results.append(result)
        del experts, weights
        torch.cuda.empty_cache()
    write_report(results, probe_result, args, bandwidth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
