"""Trial of humming-kernels 0.1.19's SM90 MoE GEMMs on our MXFP8 rows x MXFP4 experts at K3
geometry, as rank 0 of 896 / local ranks receives them:

    python -m bench.try_humming --out DIR [--local 56 112] [--tokens 1 2 4 ... 256]

Per (local experts, T): FC1 = x @ w13^T for every (row, local expert) pair, reading the rows in
place through humming's "indexed" MoE GEMM (vLLM-style sorted pair ids, top_k = 16); humming's
SiTU + requantisation (`process_input` with SiTU as a CUDA expression: a separate kernel, not an
epilogue); FC2 = act [P, I] @ w2^T. Medians of CUDA-event-timed graph replays (eager if capture
fails); FC1 checked at one T per local count against exact fp32. Modes, first that runs wins:
  mxfp8  e4m3 activations, a scale per 32 along K. SM90 has no block-scaled MMA: humming reads the
         activation scales as fp32 [rows, L/32] (our E8M0 bytes widened, a copy) and folds the
         weights' E8M0 scales into its FP4 -> FP8 dequant (use_fused_e8m0_scale: <= 11 binades of
         scale spread per expert, plus an fp32 scale per expert).
  bf16   BF16 activations (our MXFP8 rows decoded exactly): humming's W4A16 path.
Weights are re-laid-out once by humming.transform.transform_humming_tensors (a second copy).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.timing import capture, time_us
from dep_ep.comm.mxfp8 import e8m0_to_fp32, mxfp8_dequantize, mxfp8_quantize
from dep_ep.ep import K3
from dep_ep.experts.mxfp4 import mxfp4_dequantize
from dep_ep.experts.situ import situ

L, I, EXPERTS, TOPK = K3.latent, K3.intermediate, K3.experts, K3.topk  # noqa: E741
EXPERT_BYTES = 2 * I * (L // 2 + L // 32) + L * (I // 2 + I // 32)  # w13 + w2 with scales
assert EXPERT_BYTES == 17_547_264
HBM_BYTES_PER_S = 4.3e12
REPS = 10  # launches per captured graph
# Pasted into `float apply(float a, float b)`; binary_split: a = first half (gate), b = second (up).
SITU_CUDA = "(4.0f * tanhf(a / 4.0f) / (1.0f + expf(-a))) * (25.0f * tanhf(b / 25.0f))"
NOTES: list[str] = []


def log(msg: str, keep: bool = False) -> None:
    """Timestamped progress line; keep=True also lists it (once) under the report's notes."""
    if keep and msg in NOTES:
        return
    if keep:
        NOTES.append(msg)
    print(f"[{datetime.datetime.now():%H:%M:%S}] {'NOTE ' if keep else ''}{msg}", flush=True)


def receive_rows(ranks: int, tokens: int, local: int, gen: torch.Generator):
    """(x uint8 [R, L], sf uint8 [R, L/32], ids [R, 16]) of the tokens with an id < local."""
    ids = torch.rand(ranks * tokens, EXPERTS, device="cuda", generator=gen).argsort(dim=1)
    ids = ids[:, :TOPK][(ids[:, :TOPK] < local).any(dim=1)]
    x, sf = mxfp8_quantize(torch.randn(ids.shape[0], L, device="cuda", generator=gen).bfloat16())
    return x, sf, ids


def make_weights(local: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Checkpoint layout: w13 [E, 2I, L/2], s13 [E, 2I, L/32], w2 [E, L, I/2], s2 [E, L, I/32];
    random code bytes, scale bytes in 118..124."""
    shapes = [(2 * I, L // 2), (2 * I, L // 32), (L, I // 2), (L, I // 32)]
    ranges = [(0, 256), (118, 125)] * 2
    return [torch.randint(*r, (local, *s), generator=gen, dtype=torch.uint8, device="cuda")
            for r, s in zip(ranges, shapes)]  # fmt: skip


def build_layer(w: torch.Tensor, s: torch.Tensor, mode: str, n: int, k: int):
    """(LayerConfig, transformed tensors) of one MoE GEMM [E, n, k] from our MXFP4 bytes."""
    import humming.transform as ht
    from humming.schema import HummingInputSchema, HummingWeightSchema

    weight_schema = HummingWeightSchema(b_dtype="float4e2m1", bs_dtype="float8e8m0",
                                        weight_scale_group_size=32)  # fmt: skip
    input_schema = None  # None: BF16 activations
    if mode == "mxfp8":
        input_schema = HummingInputSchema(a_dtype="float8e4m3", input_scale_group_size=32)
    # humming's MXFP4 words (int32, element i at bits 4i) are our bytes viewed as int32.
    tensors = {"weight": w.view(torch.int32), "weight_scale": s.view(torch.float8_e8m0fnu)}
    cfg = ht.prepare_layer_config(shape_n=n, shape_k=k, weight_schema=weight_schema,
                                  input_schema=input_schema, num_experts=w.shape[0],
                                  torch_dtype=torch.bfloat16, tensors=tensors,
                                  device=torch.cuda.current_device())  # fmt: skip
    cfg, tensors = ht.prepare_fp16_e8m0_scale(cfg, tensors)
    log(f"{mode} [E, {n}, {k}]: a={cfg.a_dtype} (scales {cfg.as_dtype}, group"
        f" {cfg.input_scale_group_size}), b={cfg.b_dtype} (scales {cfg.bs_dtype}), block-scaled"
        f" MMA={cfg.use_block_scaled_mma}, fused E8M0 weight scales={cfg.use_fused_e8m0_scale},"
        f" weight_scale_2={cfg.weight_scale_2_type.value}", keep=True)  # fmt: skip
    return cfg, ht.transform_humming_tensors(cfg, tensors)


def align(pair_ids, pair_exp, experts: int, block_m: int, sentinel: int) -> dict:
    """moe_align_block_size: pair ids grouped by expert, each padded to block_m with sentinel."""
    order = torch.argsort(pair_exp, stable=True)
    counts = torch.bincount(pair_exp, minlength=experts)
    blocks = (counts + block_m - 1) // block_m
    exp_sorted, padded = pair_exp[order], blocks * block_m
    rank = torch.arange(order.numel(), device="cuda") - (counts.cumsum(0) - counts)[exp_sorted]
    sorted_ids = torch.full((int(padded.sum()),), sentinel, dtype=torch.int32, device="cuda")
    sorted_ids[(padded.cumsum(0) - padded)[exp_sorted] + rank] = pair_ids[order].int()
    expert_ids = torch.arange(experts, dtype=torch.int32, device="cuda").repeat_interleave(blocks)
    total = torch.tensor(sorted_ids.numel(), dtype=torch.int32, device="cuda")
    return {"sorted_ids": sorted_ids, "expert_ids": expert_ids, "num_tokens_padded": total}


def make_gemm(layer, inputs, scale, pair_ids, pair_exp, top_k: int):
    """(call, out, tuning) of humming's indexed MoE GEMM: pair p reads row pair_ids[p] // top_k
    of `inputs` (in place), expert pair_exp[p], and writes row pair_ids[p] of out."""
    from humming.ops import humming_gemm
    from humming.tune import get_heuristics_config

    cfg, w = layer
    tuning = get_heuristics_config(cfg, shape_m=pair_ids.numel(), gemm_type="indexed",
                                   device=inputs.device)  # fmt: skip
    rows_out = inputs.shape[0] * top_k
    route = align(pair_ids, pair_exp, cfg.num_experts, tuning["block_shape"][0], rows_out)
    out = torch.zeros(rows_out, cfg.shape_n - cfg.pad_shape_n, dtype=torch.bfloat16, device="cuda")
    kwargs = dict(layer_config=cfg.to_str(), compute_config=json.dumps({"gemm_type": "indexed"}),
                  tuning_config=json.dumps(tuning), inputs=inputs, weight=w["weight"],
                  weight_scale=w["weight_scale"], weight_scale_2=w.get("weight_scale_2"),
                  input_scale=scale, outputs=out, top_k=top_k,
                  locks=torch.zeros(1 << 16, dtype=torch.int32, device="cuda"),
                  **route)  # fmt: skip
    return (lambda: humming_gemm(**kwargs)), out, tuning


def timed(name: str, fn, samples: int) -> tuple[float, str]:
    """Median us per call: graph replays of REPS calls, else eager calls. First call: JIT build."""
    t0 = time.time()
    fn()
    torch.cuda.synchronize()
    log(f"  {name}: first call (JIT build/load) {time.time() - t0:.1f} s")
    try:
        return time_us(capture(fn, REPS).replay, REPS, samples), "graph"
    except Exception as error:  # noqa: BLE001 - say so and time eager calls
        torch.cuda.synchronize()
        log(f"{name}: CUDA-graph capture failed ({type(error).__name__}: {error})", keep=True)
        return time_us(fn, 1, samples), "eager"


def run_case(row: dict, data, mode: str, layers, weights, gen, samples: int, check: bool) -> dict:
    (x, sf, ids), local = data, row["local"]
    flat = (ids < local).flatten().nonzero().squeeze(1)  # row * 16 + k of every local pair
    pair_exp, pairs = ids.flatten()[flat], flat.numel()
    row.update(pairs=pairs, touched=int(pair_exp.unique().numel()), mode=mode)
    row["floor"] = row["touched"] * EXPERT_BYTES / HBM_BYTES_PER_S * 1e6  # weight-read floor, us
    if mode == "mxfp8":  # x as-is (e4m3 bytes); E8M0 scales widened to the fp32 SM90 reads
        a1, s1 = x.view(torch.float8_e4m3fn), e8m0_to_fp32(sf)
    else:
        a1, s1 = mxfp8_dequantize(x, sf), None
    call1, out1, tune1 = make_gemm(layers[0], a1, s1, flat, pair_exp, TOPK)
    log(f"  fc1 tuning {tune1}")
    row["fc1"], how1 = timed("fc1", call1, samples)
    from humming.ops import process_input  # SiTU (+ requant) between the GEMMs, on [P, 2I]

    h = torch.randn(pairs, 2 * I, device="cuda", generator=gen).bfloat16()
    act = torch.empty(pairs, I, dtype=a1.dtype, device="cuda")
    act_sf, quant = None, {}
    if mode == "mxfp8":
        act_sf = torch.empty(pairs, I // 32, dtype=torch.float32, device="cuda")
        quant = dict(quant_mode="dynamic_group", quant_dtype="float8e4m3", quant_group_size=32,
                     group_scales=act_sf, group_scale_dtype="float32")  # fmt: skip

    def act_call():
        process_input(h, outputs=act, activation_type="binary_split", activation_impl=SITU_CUDA,
                      **quant)  # fmt: skip

    row["act"], _ = timed("situ", act_call, samples)
    call2, _, tune2 = make_gemm(layers[1], act, act_sf, torch.arange(pairs, device="cuda"),
                                pair_exp, 1)  # fmt: skip
    log(f"  fc2 tuning {tune2}")
    row["fc2"], how2 = timed("fc2", call2, samples)
    row["mode"] += "/graph" if how1 == how2 == "graph" else "/eager"
    row["total"] = row["fc1"] + row["fc2"]
    row["pct"] = 100 * row["floor"] / row["total"]
    log(f"  fc1 {row['fc1']:.1f} + fc2 {row['fc2']:.1f} = {row['total']:.1f} us (act"
        f" {row['act']:.1f}); floor {row['floor']:.1f} us = {row['pct']:.0f}%")  # fmt: skip
    if check:
        call1()
        got, ref = out1[flat].float(), torch.empty(pairs, 2 * I, device="cuda")
        xr = mxfp8_dequantize(x, sf).float()
        for e in pair_exp.unique().tolist():
            sel = (pair_exp == e).nonzero().squeeze(1)
            w = mxfp4_dequantize(weights[0][e], weights[1][e], torch.float32)
            ref[sel] = xr[flat[sel] // TOPK] @ w.T
        row["err"] = float((got - ref).norm() / ref.norm())
        act_call()
        deq = act.float() * (act_sf.repeat_interleave(32, 1) if act_sf is not None else 1.0)
        sref = situ(h[:, :I].float(), h[:, I:].float())
        log(f"  check: fc1 rel L2 {row['err']:.2e}; SiTU (+requant) rel L2"
            f" {float((deq - sref).norm() / sref.norm()):.2e} (e4m3 rounding: ~3e-2)")  # fmt: skip
    return row


def measure(base: dict, data, layers: dict, weights, gen, args) -> dict:
    """The first of args.modes that runs this case; failures are reported, never raised."""
    for mode in args.modes:
        log(f"local={base['local']} T={base['T']} rows={base['rows']} {mode}")
        try:
            if mode not in layers:  # built once per local count; a build failure is remembered
                t0, layers[mode] = time.time(), "the weight transform failed earlier"
                layers[mode] = (build_layer(*weights[:2], mode, 2 * I, L),
                                build_layer(*weights[2:], mode, L, I))  # fmt: skip
                log(f"  weights transformed in {time.time() - t0:.1f} s")
            if isinstance(layers[mode], str):
                raise RuntimeError(layers[mode])
            return run_case(dict(base), data, mode, layers[mode], weights, gen, args.samples,
                            base["T"] == args.check_tokens)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - keep the other cases
            traceback.print_exc()
            log(f"local={base['local']} T={base['T']} {mode} failed: {type(error).__name__}:"
                f" {str(error)[:300]}", keep=True)  # fmt: skip
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - a sticky CUDA error: later cases fail too
                pass
    return dict(base, mode="failed: " + ", ".join(args.modes))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for try_humming.md")
    p.add_argument("--local", type=int, nargs="+", default=[56, 112])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--modes", nargs="+", default=["mxfp8", "bf16"], choices=["mxfp8", "bf16"])
    p.add_argument("--check-tokens", type=int, default=8, help="T of the FC1 correctness check")
    p.add_argument("--samples", type=int, default=30)
    args = p.parse_args()
    import humming

    torch.backends.cuda.matmul.allow_tf32 = False
    log(f"humming {humming.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for local in args.local:
        weights, layers = make_weights(local, gen), {}
        for tokens in args.tokens:
            data = receive_rows(EXPERTS // local, tokens, local, gen)
            base = dict(local=local, T=tokens, rows=data[0].shape[0])
            rows.append(measure(base, data, layers, weights, gen, args))
        del weights, layers
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "try_humming.md").write_text(text := report(rows, args, humming.__version__))
    print(text, flush=True)
    return 0


def report(rows: list, args, version: str) -> str:
    lines = ["# humming-kernels SM90 MoE GEMMs on our MXFP8 x MXFP4 data, K3 geometry", "",
             f"{torch.cuda.get_device_name()}, {datetime.date.today().isoformat()}, humming"
             f" {version}, torch {torch.__version__}; `python -m bench.try_humming` (its docstring"
             " says what is measured). pairs: (row, local expert) pairs; touched: local experts"
             f" with rows. Medians of {args.samples} samples. total = fc1 + fc2; act (humming's"
             " SiTU kernel, separate) is not in total. Floor: touched x 17,547,264 B at 4.3 TB/s;"
             " % floor = floor / total. fc1 rel err: relative L2 against exact fp32.", "",
             "| local | T | rows | pairs | touched | fc1 us | fc2 us | total us | floor us |"
             " % floor | fc1 rel err | act us | mode |", "|" + "---|" * 13]  # fmt: skip
    for r in rows:
        cells = [format(r[k], f) if k in r else "-" for k, f in
                 [("local", "d"), ("T", "d"), ("rows", "d"), ("pairs", "d"), ("touched", "d"),
                  ("fc1", ".1f"), ("fc2", ".1f"), ("total", ".1f"), ("floor", ".1f"),
                  ("pct", ".0f"), ("err", ".1e"), ("act", ".1f"), ("mode", "s")]]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", "Notes from the run:", ""] + [f"- {n}" for n in NOTES] + [""])


if __name__ == "__main__":
    sys.exit(main())
