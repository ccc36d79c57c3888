"""humming's GEMMs with BF16 activations against its e4m3 ones, at K3 geometry: FC1 and FC2 of
HopperExperts' humming engine timed alone on the same receive rows, the activations once as
e4m3 with per-32 scales (the engine's W4A8 call) and once as their exact BF16 values (humming's
W4A16 MXFP4 kernels: the weights expanded to BF16 with their scales, BF16 wgmma accumulating in
fp32 over all of K, no per-32 promotion).

    python -m bench.bench_humming_a16     # docs/results/bench_humming_a16.md

Rows drawn as bench_experts.py draws them (uniform routing). Each GEMM in CUDA-graph replay of
--reps calls, median of --samples replays, per call, with humming's heuristic kernel for the pairs
present. diff: relative L2 of each form's output against the float64 product of the same
dequantized operands, over CHECK_ROUTES routes spread over the pairs (the output is NaN before
the call); a diff of DIFF_LIMIT or more, or NaN, fails the run.
"""

from __future__ import annotations

import json
import sys

import torch

from bench import cli, report
from bench.bench_experts import bf16_tflops, copy_gbs, fp8_tflops, receive_rows
from bench.bench_humming_tuning import routed_call
from bench.timing import capture, replay_us
from dep_ep.constants import SCALE_BLOCK
from dep_ep.ep import K3
from dep_ep.experts.hopper import HopperExperts, HummingEngine
from dep_ep.experts.hopper.humming_gemm import HummingGemm
from dep_ep.experts.mxfp4 import mxfp4_dequantize
from dep_ep.testing.synthetic import SyntheticLayer

CASES = {56: (1, 4, 16, 64, 256, 1024, 2048), 448: (1, 16, 256, 1024)}
REPS, SAMPLES = 10, 10
CHECK_ROUTES = 64
DIFF_LIMIT = 1e-2  # the BF16 output's rounding alone: about 2e-3
E4M3 = torch.float8_e4m3fn


def bf16_rows(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 [R, K] with fp32 per-32 scales [R, K/32] -> their exact values in BF16 [R, K]."""
    r, k = x.shape
    v = x.float().view(r, k // SCALE_BLOCK, SCALE_BLOCK) * scales.unsqueeze(-1)
    return v.view(r, k).bfloat16()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))


def run_case(gemm, inputs, input_scale, ids, topk, out_cols, name, timing, check):
    """(us per call, diff, block shape) of `gemm` over the routes of `ids`, with humming's kernel
    for the pairs present; `check(out, groups)` -> diff."""
    count = ids.shape[0]
    out = torch.full((count * topk, out_cols), float("nan"), dtype=torch.bfloat16, device="cuda")
    num_local = gemm.config.num_experts
    pairs = int(((ids >= 0) & (ids < num_local)).sum())
    tuned = max(16, 1 << (pairs - 1).bit_length())
    call, groups = routed_call(gemm, name, ids, num_local, inputs, input_scale, out, tuned)
    call()
    torch.cuda.synchronize()
    reps, samples = timing
    us = replay_us(capture(call, reps), reps, samples)
    return us, check(out, groups), json.dumps(gemm.tuning(tuned)["block_shape"])


def main() -> int:
    timing = (REPS, SAMPLES)
    p = cli.parser(__doc__, page="bench_humming_a16.md", timing=timing)
    args = p.parse_args()
    timing = (args.reps, args.samples)
    gen = torch.Generator(device="cuda").manual_seed(0)
    page = report.Page(
        args.out / "bench_humming_a16.md",
        "humming's GEMMs: BF16 against e4m3 activations",
        report.summary(__doc__),
        report.Run.this_process(),
    )
    gbs, tflops = copy_gbs(), fp8_tflops()
    bf16_rate = bf16_tflops()
    page.text(
        f"Copy bandwidth {gbs:.0f} GB/s; dense FP8 (torch._scaled_mm e4m3 8192^3) {tflops:.0f}"
        f" TFLOP/s; dense BF16 (torch.mm 8192^3) {bf16_rate:.0f} TFLOP/s, the same run."
    )
    table = []
    for local, token_counts in CASES.items():
        weights = SyntheticLayer(K3, seed=1, device="cuda").local_weights(0, local)
        backend = HopperExperts(weights, engine=HummingEngine())
        a8 = {"fc1": backend.prepared.fc1, "fc2": backend.prepared.fc2}
        a16 = {
            "fc1": HummingGemm.prepare(weights.w13, weights.s13, False, bf16_inputs=True),
            "fc2": HummingGemm.prepare(weights.w2, weights.s2, False, bf16_inputs=True),
        }
        raw = {"fc1": (weights.w13, weights.s13), "fc2": (weights.w2, weights.s2)}
        for tokens in token_counts:
            x, sf, ids, _ = receive_rows(K3.experts // local, tokens, local, gen)
            count, topk = ids.shape
            pairs = int(((ids >= 0) & (ids < local)).sum())
            fc1_scale = torch.pow(2.0, sf.float() - 127) if sf.dtype == torch.uint8 else sf.float()
            inter = K3.intermediate
            h = torch.randn(count * topk, inter, device="cuda", generator=gen)
            h_scale = torch.pow(
                2.0,
                torch.randint(
                    -3, 3, (count * topk, inter // SCALE_BLOCK), device="cuda", generator=gen
                ).float(),
            )
            h8 = (h.clamp(-400, 400)).to(E4M3)
            forms = {
                "fc1": (x.view(E4M3), fc1_scale, count, K3.latent, 2 * inter),
                "fc2": (h8, h_scale, count * topk, inter, K3.latent),
            }
            for name, (x8, xs, rows, k, n) in forms.items():
                exact_rows = (
                    x8.double().view(rows, k // SCALE_BLOCK, SCALE_BLOCK)
                    * xs.double().unsqueeze(-1)
                ).view(rows, k)
                w, s = raw[name]

                def check(out, groups, name=name, exact_rows=exact_rows, w=w, s=s):
                    # FC1: route r * K + k reads row r; FC2: pair j reads row j, writes row j
                    flat = ids.flatten()
                    if name == "fc1":
                        routes = ((flat >= 0) & (flat < local)).nonzero().flatten()
                        outs, srcs = routes, routes // topk
                    else:
                        outs = torch.arange(int(groups.num_pairs), device="cuda")
                        srcs, routes = outs, groups.pair_flat[outs].long()
                    # spread over every expert's pairs (they are in expert order)
                    pick = torch.linspace(0, outs.numel() - 1, CHECK_ROUTES, device="cuda")
                    pick = pick.round().long().unique()
                    outs, srcs, routes = outs[pick], srcs[pick], routes[pick]
                    want = torch.stack(
                        [
                            mxfp4_dequantize(w[int(flat[r])], s[int(flat[r])], torch.float64)
                            @ exact_rows[int(i)]
                            for r, i in zip(routes.tolist(), srcs.tolist())
                        ]
                    )
                    return rel_l2(out[outs], want)

                us8, d8, b8 = run_case(a8[name], x8, xs, ids, topk, n, name, timing, check)
                xb = bf16_rows(x8, xs)
                us16, d16, b16 = run_case(a16[name], xb, None, ids, topk, n, name, timing, check)
                if not (d8 < DIFF_LIMIT and d16 < DIFF_LIMIT):
                    raise RuntimeError(
                        f"{local} local, T = {tokens}, {name}: diff e4m3 {d8:.1e}, BF16 {d16:.1e}"
                    )
                flops = 2 * pairs * k * n
                row = [
                    local,
                    tokens,
                    pairs,
                    name.upper(),
                    f"{us8:.1f}",
                    f"{us16:.1f}",
                    f"{us8 / us16:.2f}",
                    f"{flops / (us8 * 1e-6) / 1e12:.0f}",
                    f"{flops / (us16 * 1e-6) / 1e12:.0f}",
                    b8,
                    b16,
                    f"{d8:.1e}",
                    f"{d16:.1e}",
                ]
                table.append(row)
                print(row, flush=True)
    page.section("FC1 and FC2 alone, graph replay")
    page.table(
        [
            "local",
            "T",
            "pairs",
            "GEMM",
            "e4m3 us",
            "BF16 us",
            "e4m3 / BF16",
            "e4m3 TFLOP/s",
            "BF16 TFLOP/s",
            "e4m3 block",
            "BF16 block",
            "e4m3 diff",
            "BF16 diff",
        ],
        table,
    )
    page.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
