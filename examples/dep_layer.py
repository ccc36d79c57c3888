"""Run the routed-expert path of one MoE layer across the ranks of a DEP group and check each step.

    torchrun --nproc-per-node 4 examples/dep_layer.py            # CPU, tiny preset, 4 ranks
    mpiexec -n 3 python examples/dep_layer.py --steps 20
    torchrun --nproc-per-node 2 examples/dep_layer.py --layer --steps 2   # the whole MoE layer

Every step draws fresh hidden states, routes them (sigmoid top-K with the bias), gives each rank a
random number of real tokens padded to the same T with rows of -1 ids, runs dispatch -> experts ->
combine (+ RMSNorm) through EpRouted, and compares every rank's output with the all-gather
reference. Rank 0 prints per-phase times (host wall clock with a device sync after each phase,
max over ranks: not a benchmark; bench/bench_ep.py is) and the worst error. On GPU the path runs
on NVSHMEM buffers and the CuTeDSL kernels. Exit status 1 if any step fails its check.

--layer runs the whole MoE layer instead (EpMoeLayer: router, latent down projection, routed path,
up projection, shared experts) on synthetic dense weights: each rank passes a random number of
real tokens (0 included) with tokens=T, and every output is compared with a float64 evaluation of
the formula (docs/formats.md) whose routed part is the all-gather reference. Its routing is the
layer's own router part (the same function the call runs, so near-tied experts cannot make the
two pick differently); tests/test_layer_mpi.py checks the router against a float64 one.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from dep_ep.config import EpConfig
from dep_ep.ep import PRESETS, EpMoeLayer, EpRouted, route
from dep_ep.experts import default_experts
from dep_ep.launch import init_rank_context, new_dep_group, teardown
from dep_ep.testing import SyntheticLayer, allgather_reference, rel_l2
from dep_ep.testing.layer_reference import layer_reference, synthetic_dense
from dep_ep.testing.tolerance import LAYER_REL_L2_BY_ACTIVATION, ROUTED_REL_L2_BY_ACTIVATION

# Tolerances of the checks against the float64 reference, by the experts backend's activation
# format (the error model of dep_ep.testing.tolerance).
MAX_REL_L2 = ROUTED_REL_L2_BY_ACTIVATION
MAX_LAYER_REL_L2 = LAYER_REL_L2_BY_ACTIVATION


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--preset",
        choices=["auto", *PRESETS],
        default="auto",
        help="layer geometry: tiny (seconds on CPU) or k3 (Kimi K3: ~20 GB of GPU"
        " memory per rank at 4 ranks); auto: k3 on GPU, tiny on CPU",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where tensors and buffers live; auto: cuda when a GPU and the GPU extras"
        " (CuTeDSL, nvshmem4py) are present, else cpu",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=16,
        help="T: tokens every rank passes per step (real ones + padding rows)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="capacity of the buffers (default: --tokens)"
    )
    p.add_argument("--steps", type=int, default=5, help="steps, each with fresh data")
    p.add_argument(
        "--dep-size",
        type=int,
        default=None,
        help="ranks per DEP group (default: all ranks; must divide the world size)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds any wait may take before EpTimeoutError",
    )
    p.add_argument("--no-check", action="store_true", help="skip the all-gather reference")
    p.add_argument(
        "--layer",
        action="store_true",
        help="run the whole MoE layer (EpMoeLayer) with synthetic dense weights; default: the"
        " routed path alone",
    )
    return p.parse_args()


def gpu_stack_present() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cutlass.cute  # noqa: F401
        import nvshmem.core  # noqa: F401
    except ImportError:
        return False
    return True


def run_layer(args, ctx, dep, geometry, layer, experts, routed) -> int:
    """--layer: the whole MoE layer for args.steps steps; returns the number of failed steps."""
    dense = synthetic_dense(geometry, layer, args.seed, ctx.device)
    moe = EpMoeLayer(dense, routed, experts, topk=geometry.topk)
    tolerance = MAX_LAYER_REL_L2[experts.activation_format]
    gen = torch.Generator().manual_seed(args.seed * 7919 + ctx.rank + 1)
    T = args.tokens
    if ctx.rank == 0:
        print(
            f"dep_layer --layer: {ctx.world_size} rank(s), DEP groups of {dep.size}, preset"
            f" {geometry.name}, T={T}, device {ctx.device}, {args.steps} steps"
        )
        print(
            f"{'step':>4} {'real tokens':>14} {'layer ms':>9} {'check ms':>8} {'rel L2 err':>10}"
            "  result"
        )
    failed = 0
    for step in range(args.steps):
        real = int(torch.randint(0, T + 1, (1,), generator=gen))  # 0 real tokens happen
        x = torch.randn(real, geometry.hidden, generator=gen).to(ctx.device, torch.bfloat16)
        t0 = time.perf_counter()
        out = moe(x, tokens=T)
        routed.synchronize()
        layer_s = time.perf_counter() - t0
        error = 0.0
        t0 = time.perf_counter()
        if not args.no_check:
            ref = layer_reference(dep.cpu_group, moe, layer.expert, x, T)
            if real:
                error = rel_l2(out, ref) if out.isfinite().all() else float("inf")
        check_s = time.perf_counter() - t0
        stats = torch.tensor([layer_s, check_s, error, real], dtype=torch.float64)
        dist.all_reduce(stats[:3], op=dist.ReduceOp.MAX, group=ctx.cpu_group)
        reals = [torch.zeros(1, dtype=torch.float64) for _ in range(ctx.world_size)]
        dist.all_gather(reals, stats[3:4], group=ctx.cpu_group)
        ok = args.no_check or float(stats[2]) <= tolerance
        failed += not ok
        if ctx.rank == 0:
            counts = ",".join(str(int(r)) for r in reals)
            check = "skipped" if args.no_check else ("ok" if ok else "FAILED")
            print(
                f"{step:>4} {counts:>14} {1e3 * float(stats[0]):>9.2f}"
                f" {1e3 * float(stats[1]):>8.2f} {float(stats[2]):>10.2e}  {check}",
                flush=True,
            )
    if ctx.rank == 0:
        verdict = "check skipped" if args.no_check else f"{failed} of {args.steps} steps failed"
        print(
            f"dep_layer --layer: {verdict} (tolerance: relative L2 <= {tolerance:g};"
            " times are host wall clock with a sync, max over ranks)"
        )
    return failed


def main() -> int:
    args = parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if gpu_stack_present() else "cpu"
    ctx = init_rank_context(device, timeout_s=args.timeout)
    dep = new_dep_group(ctx, args.dep_size or ctx.world_size)
    on_gpu = ctx.device.type == "cuda"
    geometry = PRESETS[("k3" if on_gpu else "tiny") if args.preset == "auto" else args.preset]
    max_tokens = args.max_tokens or args.tokens
    if not 1 <= args.tokens <= max_tokens:
        raise SystemExit(f"dep_layer.py: --tokens {args.tokens} outside 1..{max_tokens}")
    per_rank = geometry.experts // dep.size
    layer = SyntheticLayer(geometry, args.seed + dep.index, ctx.device)
    # The device's best backend: HopperExperts on SM90, TrtllmExperts on SM100, else the reference.
    experts = default_experts(layer.local_weights(dep.rank * per_rank, per_rank))
    if ctx.rank == 0:
        engine = getattr(experts, "engine", None)
        print(
            f"dep_layer: experts backend {type(experts).__name__}"
            + (f" (engine {engine})" if engine else ""),
            flush=True,
        )
    gate, bias = layer.router()
    norm_weight = layer.norm_weight()
    routed = EpRouted(
        dep.cpu_group,
        max_tokens,
        ctx.device,
        num_experts=geometry.experts,
        latent=geometry.latent,
        topk=geometry.topk,
        config=EpConfig(timeout_s=args.timeout),
    )
    if args.layer:
        failed = run_layer(args, ctx, dep, geometry, layer, experts, routed)
        routed.close()
        teardown(ctx)
        return 1 if failed else 0
    gen = torch.Generator().manual_seed(args.seed * 7919 + ctx.rank)
    tolerance = MAX_REL_L2[experts.activation_format]
    if ctx.rank == 0:
        print(
            f"dep_layer: {ctx.world_size} rank(s), DEP groups of {dep.size}, preset"
            f" {geometry.name}, T={args.tokens}, device {ctx.device}, {args.steps} steps"
        )
        print(
            f"{'step':>4} {'real tokens':>14} {'dispatch ms':>11} {'experts ms':>10}"
            f" {'combine ms':>10} {'check ms':>8} {'rel L2 err':>10}  result"
        )
    failed = 0
    for step in range(args.steps):
        T = args.tokens
        hidden = torch.randn(T, geometry.hidden, generator=gen).to(ctx.device, torch.bfloat16)
        latent = torch.randn(T, geometry.latent, generator=gen).to(ctx.device, torch.bfloat16)
        ids, weights = route(hidden, gate, bias, geometry.topk)
        real = int(torch.randint(1, T + 1, (1,), generator=gen))
        ids[real:] = -1  # padding rows: no expert
        times = []
        t0 = time.perf_counter()
        rows = routed.dispatch(latent, ids, weights, experts=experts)
        routed.synchronize()
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        # A backend that may fail a call on the device (HopperExperts over its pair budget)
        # fails the step on every rank through the step's StepFailure, as EpRouted.routed does.
        failure = {"failure": routed.step_failure()} if experts.device_failures else {}
        experts.forward(rows.x, rows.sf, rows.ids, rows.weights, rows.out, **failure)
        routed.synchronize()
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        normed = routed.combine(norm_weight)  # the latent RMSNorm, K3's eps (the default)
        routed.synchronize()
        times.append(time.perf_counter() - t0)
        error = 0.0
        t0 = time.perf_counter()
        if not args.no_check:
            ref = allgather_reference(
                dep.cpu_group, latent, ids, weights, norm_weight, layer.expert
            )
            error = rel_l2(normed, ref) if normed.isfinite().all() else float("inf")
        times.append(time.perf_counter() - t0)
        stats = torch.tensor([*times, error, real, real], dtype=torch.float64)
        dist.all_reduce(stats[:5], op=dist.ReduceOp.MAX, group=ctx.cpu_group)
        reals = [torch.zeros(1, dtype=torch.float64) for _ in range(ctx.world_size)]
        dist.all_gather(reals, stats[5:6], group=ctx.cpu_group)
        ok = args.no_check or float(stats[4]) <= tolerance
        failed += not ok
        if ctx.rank == 0:
            counts = ",".join(str(int(r)) for r in reals)
            ms = [f"{1e3 * float(v):.2f}" for v in stats[:4]]
            check = "skipped" if args.no_check else ("ok" if ok else "FAILED")
            print(
                f"{step:>4} {counts:>14} {ms[0]:>11} {ms[1]:>10} {ms[2]:>10} {ms[3]:>8}"
                f" {float(stats[4]):>10.2e}  {check}",
                flush=True,
            )
    routed.close()
    if ctx.rank == 0:
        verdict = "check skipped" if args.no_check else f"{failed} of {args.steps} steps failed"
        shared = (
            " (ranks share GPUs: time-sliced)"
            if on_gpu and ctx.world_size > torch.cuda.device_count()
            else ""
        )
        print(
            f"dep_layer: {verdict} (tolerance: relative L2 <= {tolerance:g}; times are host"
            f" wall clock with a sync after each phase, max over ranks{shared})"
        )
    teardown(ctx)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
