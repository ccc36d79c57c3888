"""The narrow GEMM (experts/hopper/narrow_gemm.py) against humming's GEMMs, FC1 and FC2 alone, on
one GPU at K3 geometry: local experts 56, 112 and 448 (rank 0 of 16, 8 and 2 ranks) unless
`--local` picks others, T = 1..16 tokens per rank unless `--tokens` does, uniform routing, all
measured in the same run.

    python -m bench.bench_narrow_gemm     # writes docs/results/bench_narrow_gemm.md

Receive rows as bench_experts draws them (rank 0 of `ranks`, T tokens each, K3's 16 distinct
experts of 896 by synthetic_ids). Weights: random MXFP4 codes for the local experts, scale bytes
118..126 (humming's fused scales take a spread of 11 binades). FC1: the receive rows (e4m3, fp32
scales) to BF16 [2I] per pair; FC2: random e4m3 activation rows [I] per pair to BF16 [L]. Each
kernel alone, the grouping done before it, the narrow GEMM in five forms (FORMS: one mma.sync a
warp, or a chunk's four wgmma a warpgroup with the rows in shared memory, each chunk loaded
straight into registers; and the default, the wgmma form with each warp's weights streamed
through a ring in shared memory by bulk copies; "humming words", the wgmma form on humming's
prepared weights (the tensors humming's own GEMM reads, no copy of ours; their scales folded into
the expansion), through a warpgroup's ring and loaded directly; with --shapes, SHAPES' other rings
too; with --wide, WIDE's tiles of 16, 24 and 32 pairs, for T past decode, e.g. `--wide --tokens
16 32 64 128 256`; `--forms` names the forms to time instead, DEEP's wider tiles through deeper
rings among them; `--local` picks shards): graph replay of `--reps` calls,
median of `--samples` replays, per call. The bytes: the touched experts' codes and scales of that
GEMM (FC1: 2I * L / 2 + 2I * L / 32 bytes an expert; FC2: half that), once; GB/s = bytes / time; %
of copy = GB/s over the device-to-device copy bandwidth measured in the run. diff: relative L2 of
the narrow GEMM's output against humming's on the same pairs.
"""

from __future__ import annotations

import sys

import torch

from bench import cli, report
from bench.bench_experts import copy_gbs, graph_us, receive_rows
from dep_ep.comm.mxfp8 import e8m0_to_fp32
from dep_ep.constants import SCALE_BLOCK
from dep_ep.ep import K3
from dep_ep.experts.hopper.engine import tuning_pairs
from dep_ep.experts.hopper.grouping import group_pairs, tile_routes
from dep_ep.experts.hopper.humming_gemm import HummingGemm
from dep_ep.experts.hopper.humming_layout import prepared_tensors
from dep_ep.experts.hopper.narrow_gemm import WARPGROUP_WARPS, NarrowGemmLaunch, NarrowTuning
from dep_ep.experts.hopper.narrow_layout import NARROW_PAIRS, NARROW_TILE_PAIRS, narrow_weights

TOKENS = [1, 2, 4, 8, 16]
LOCAL_EXPERTS = [56, 112, 448]
REPS, SAMPLES = 10, 10
SCALE_BYTES = (118, 127)  # [low, high): a spread humming keeps exact


def random_mxfp4(local: int, n: int, k: int, gen: torch.Generator):
    """Codes uint8 [local, n, k/2] and scale bytes uint8 [local, n, k/32] on the GPU."""
    w = torch.randint(0, 256, (local, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    s = torch.randint(
        *SCALE_BYTES, (local, n, k // SCALE_BLOCK), dtype=torch.uint8, device="cuda", generator=gen
    )
    return w, s


def gemm_bytes(n: int, k: int) -> int:
    """One expert's codes and scale bytes of an [n, k] GEMM."""
    return n * k // 2 + n * k // SCALE_BLOCK


class Layer:
    """One shard's FC1 and FC2 weights in both kernels' layouts."""

    def __init__(self, local: int, gen: torch.Generator) -> None:
        latent, inter = K3.latent, K3.intermediate
        self.local = local
        self.w13, self.s13 = random_mxfp4(local, 2 * inter, latent, gen)
        self.w2, self.s2 = random_mxfp4(local, latent, inter, gen)
        self.narrow13 = narrow_weights(self.w13, self.s13)
        self.narrow2 = narrow_weights(self.w2, self.s2)
        self.humming13 = HummingGemm.prepare(self.w13, self.s13, False)
        self.humming2 = HummingGemm.prepare(self.w2, self.s2, False)
        # The narrow GEMM's humming form on the tensors humming's GEMMs read (no copy).
        self.prepared13 = prepared_tensors(self.humming13.tensors)
        self.prepared2 = prepared_tensors(self.humming2.tensors)


# The narrow GEMM's forms timed (column name -> NarrowTuning): its MMA either way, each chunk
# loaded straight into registers, and the default, a ring of chunks in shared memory.
FORMS = {
    "mma.sync": NarrowTuning(wgmma=False, stages=0),
    "wgmma": NarrowTuning(stages=0),
    "wgmma ring": NarrowTuning(),
    "humming words": NarrowTuning(weights="humming"),
    "humming words direct": NarrowTuning(weights="humming", stages=0),
}
# Other ring shapes (warps, slots x chunks a slot), timed beside FORMS with --shapes.
SHAPES = {
    "ring 2x4": NarrowTuning(stages=2, stage_chunks=4),
    "ring 3x2": NarrowTuning(stages=3, stage_chunks=2),
    "ring 4x2": NarrowTuning(stages=4, stage_chunks=2),
    "ring 2x1": NarrowTuning(stages=2, stage_chunks=1),
    "4 warps, ring 2x2": NarrowTuning(warps=4),
    "mma.sync ring": NarrowTuning(wgmma=False),
}
# The default form on wider tiles (`--wide`): each tile reads its expert's weights once for up to
# 16, 24 or 32 of its pairs (about 19 pairs an expert at T = 64 on a DEP16 shard, 37 at 128).
WIDE = {f"ring, tiles of {p}": NarrowTuning(pairs=p) for p in NARROW_TILE_PAIRS[1:]}
WIDE |= {
    f"humming words, tiles of {p}": NarrowTuning(weights="humming", pairs=p)
    for p in NARROW_TILE_PAIRS[1:]
}
# The wider tiles through deeper rings, and `ahead` (a chunk's MMAs issued before the previous
# chunk's promotion), by name with --forms. At P = 8 three CTAs fit an SM, each with two
# warpgroups' rings of 2 x 2 chunks; at P = 32 one does, so its rings of 2 x 2 hold a third of
# the weight bytes an SM running tiles of 8 has in flight. These hold about as many (P = 16,
# 3 x 2: two CTAs an SM) or more (P = 24 and 32, 6 x 2: 102 KiB a CTA).
DEEP = {
    "humming words, tiles of 16, ring 3x2": NarrowTuning(weights="humming", pairs=16, stages=3),
    "humming words, tiles of 16, ring 4x2": NarrowTuning(weights="humming", pairs=16, stages=4),
    "humming words, tiles of 24, ring 6x2": NarrowTuning(weights="humming", pairs=24, stages=6),
    "humming words, tiles of 32, ring 6x2": NarrowTuning(weights="humming", pairs=32, stages=6),
    "humming words, ahead": NarrowTuning(weights="humming", ahead=True),
    "humming words, tiles of 16, ahead": NarrowTuning(weights="humming", pairs=16, ahead=True),
    "humming words, tiles of 16, ring 3x4, ahead": NarrowTuning(
        weights="humming", pairs=16, stages=3, stage_chunks=4, ahead=True
    ),
    "humming words, tiles of 32, ring 6x2, ahead": NarrowTuning(
        weights="humming", pairs=32, stages=6, ahead=True
    ),
}
# The activation scales staged with the tile's rows (`stage_scales`), by name with --forms: the
# tiles of 32's largest stall (long scoreboard) waited on their per-chunk loads from global
# memory (docs/experts.md, "What bounds the narrow GEMM past decode").
DEEP |= {
    f"humming words{'' if p == 8 else f', tiles of {p}'}, staged scales": NarrowTuning(
        weights="humming", pairs=p, stage_scales=True
    )
    for p in NARROW_TILE_PAIRS
}
# The specialized form (NarrowTuning.expanded_slots), by name with --forms: warpgroup 0 expands
# each chunk into shared memory, the other warpgroups run its MMAs from there and promote them,
# taking the chunks in turn (two consumers unless named).
SPECIALIZED = {
    f"specialized, tiles of {p}": NarrowTuning(
        weights="humming", warps=12, pairs=p, expanded_slots=4, stage_scales=p == 32
    )
    for p in NARROW_TILE_PAIRS
}
SPECIALIZED |= {
    "specialized, tiles of 16, ring 4x2": NarrowTuning(
        weights="humming", warps=12, pairs=16, expanded_slots=4, stages=4
    ),
    "specialized, tiles of 32, ring 4x2": NarrowTuning(
        weights="humming", warps=12, pairs=32, expanded_slots=4, stages=4, stage_scales=True
    ),
    "specialized, tiles of 16, 3 consumers": NarrowTuning(
        weights="humming", warps=16, pairs=16, expanded_slots=6
    ),
}
# With two expanded slots and the scales staged: more weight bytes in flight a CTA (deeper
# rings); two 64-column blocks a CTA (`blocks`: the tile's rows staged once for 128 columns, each
# consumer on its own block, 8.5 KiB a chunk); the ring's copies issued by a warp of their own
# (`copy_warp`, so that no expanding thread's fence for the async proxy waits on them); the
# consumers' A words loaded into registers (`register_a`: no async-proxy fence at all).
# (P, stages, chunks a stage, blocks, copy warp, A from registers)
STAGED_SPECIALIZED = (
    (8, 4, 2, 1, False, False),
    (8, 6, 4, 1, False, False),
    (16, 3, 2, 1, False, False),
    (16, 6, 4, 1, False, False),
    (32, 4, 4, 1, False, False),
    (8, 4, 4, 2, False, False),
    (16, 4, 2, 2, False, False),
    (32, 3, 2, 2, False, False),
    (8, 4, 2, 1, True, False),
    (16, 4, 2, 1, True, False),
    (16, 4, 2, 2, True, False),
    (8, 4, 2, 1, False, True),
    (16, 4, 2, 2, False, True),
    (16, 4, 2, 2, True, True),
)


def staged_specialized(
    pairs: int,
    stages: int,
    chunks: int,
    blocks: int,
    copy_warp: bool,
    register_a: bool,
    expanders: int = 1,
):
    """(bench name, NarrowTuning) of a STAGED_SPECIALIZED row (two consumer warpgroups beside
    `expanders` expanding ones)."""
    name = f"specialized, tiles of {pairs}{', 2 blocks' if blocks == 2 else ''}"
    name += f", {expanders} expanders" if expanders > 1 else ""
    name += f"{', copy warp' if copy_warp else ''}{', A from registers' if register_a else ''}"
    name += f", ring {stages}x{chunks}"
    plain = blocks == 1 and expanders == 1 and not copy_warp and not register_a
    name += ", 2 slots" if plain else ""
    return name, NarrowTuning(
        weights="humming",
        warps=WARPGROUP_WARPS * (expanders + 2),
        pairs=pairs,
        blocks=blocks,
        expanded_slots=2,
        stages=stages,
        stage_chunks=chunks,
        stage_scales=True,
        copy_warp=copy_warp,
        register_a=register_a,
        expanders=expanders,
    )


SPECIALIZED |= dict(staged_specialized(*row) for row in STAGED_SPECIALIZED)
# Two expanding warpgroups (NarrowTuning.expanders), each expanding a ring stage's chunk of its
# own into slots of its own: one expanding warpgroup left the consumers waiting on `full` for 81%
# of their loop's samples under Nsight Compute; two took 3-5% off FC1 on one H100
# (docs/experts.md, "The specialized narrow GEMM").
# (P, blocks, A from registers), each through a ring of 4 x 2
TWO_EXPANDERS = ((8, 1, False), (8, 1, True), (16, 1, False), (16, 2, True), (32, 1, False))
SPECIALIZED |= dict(
    staged_specialized(p, 4, 2, blocks, False, register_a, expanders=2)
    for p, blocks, register_a in TWO_EXPANDERS
)

EVERY_FORM = FORMS | SHAPES | WIDE | DEEP | SPECIALIZED


def form_launches(forms: dict) -> dict:
    """form -> (FC1, FC2) NarrowGemmLaunch at K3's widths for `forms` (name -> NarrowTuning):
    FC1 reads the receive rows through pair_row, FC2 its rows by pair number."""
    latent, inter = K3.latent, K3.intermediate
    return {
        form: (
            NarrowGemmLaunch(2 * inter, latent, True, tuning),
            NarrowGemmLaunch(latent, inter, False, tuning),
        )
        for form, tuning in forms.items()
    }


def row_calls(layer: Layer, launches: dict, ranks: int, tokens: int, gen) -> tuple:
    """One (local, T) row's GEMMs, each run once (its compile, then its output): (calls,
    facts). calls: name -> a function that launches one GEMM on the current stream
    ("<form>_fc1", "<form>_fc2" for every narrow form of `launches`, form_launches', then
    "humming_fc1", "humming_fc2"), all on the same pairs; facts: the row's shard, T, rows,
    pairs, touched experts and weight bytes, and each form's relative L2 against humming's
    outputs ("<form>_fc1_diff", "<form>_fc2_diff"). Each form runs on the tiles of its
    tuning's width; the pairs' numbering is the same for every width (grouping.py), so the
    forms' outputs line up row for row."""
    latent, inter, topk = K3.latent, K3.intermediate, K3.topk
    x, sf, ids, _ = receive_rows(ranks, tokens, layer.local, gen)
    rows = ids.shape[0]
    capacity = rows * topk
    scales = e8m0_to_fp32(sf).contiguous()
    widths = {fc1.tuning.pairs for fc1, _ in launches.values()} | {NARROW_PAIRS}
    groups_of = {p: group_pairs(ids, 0, layer.local, p) for p in sorted(widths)}
    narrow_groups = groups_of[NARROW_PAIRS]
    pairs = int(narrow_groups.num_pairs)
    touched = int((narrow_groups.expert_pairs > 0).sum())
    act = (torch.randn(capacity, inter, device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
    act_scale = torch.pow(
        2.0, torch.randint(-4, 5, (capacity, inter // SCALE_BLOCK), device="cuda", generator=gen)
    ).float()
    calls, outputs = {}, {}
    for form, (fc1, fc2) in launches.items():
        gate_up = torch.empty(capacity, 2 * inter, dtype=torch.bfloat16, device="cuda")
        expert_out = torch.empty(capacity, latent, dtype=torch.bfloat16, device="cuda")
        outputs[form] = (gate_up, expert_out)
        groups = groups_of[fc1.tuning.pairs]

        weights13, weights2 = layer.narrow13, layer.narrow2
        extra13, extra2 = {}, {}
        if fc1.tuning.weights == "humming":
            *weights13, scale13 = layer.prepared13
            *weights2, scale2 = layer.prepared2
            extra13, extra2 = {"expert_scale": scale13}, {"expert_scale": scale2}

        # The stream is read at each call: a graph capture runs on a stream of its own.
        def narrow_fc1(fc1=fc1, gate_up=gate_up, groups=groups, w=weights13, extra=extra13):
            stream = torch.cuda.current_stream().cuda_stream
            fc1(*w, x, scales, groups.pair_row, groups, gate_up, stream, **extra)

        def narrow_fc2(fc2=fc2, expert_out=expert_out, groups=groups, w=weights2, extra=extra2):
            stream = torch.cuda.current_stream().cuda_stream
            fc2(*w, act, act_scale, groups.pair_row, groups, expert_out, stream, **extra)

        calls[f"{form}_fc1"], calls[f"{form}_fc2"] = narrow_fc1, narrow_fc2

    tuned = tuning_pairs(rows, topk, layer.local, K3.experts)
    h1_groups = group_pairs(ids, 0, layer.local, layer.humming13.block_m(tuned))
    h1_routes = tile_routes(h1_groups)
    h2_groups = group_pairs(ids, 0, layer.local, layer.humming2.block_m(tuned))
    h2_routes = tile_routes(h2_groups)
    h_gate_up = torch.empty(capacity, 2 * inter, dtype=torch.bfloat16, device="cuda")
    h_expert_out = torch.empty(capacity, latent, dtype=torch.bfloat16, device="cuda")
    x8 = x.view(torch.float8_e4m3fn)

    def humming_fc1():
        layer.humming13(
            x8,
            scales,
            h1_routes.flat,
            h1_groups.tile_expert,
            h1_routes.num_padded,
            topk,
            h_gate_up,
            tuned,
        )

    def humming_fc2():
        layer.humming2(
            act,
            act_scale,
            h2_routes.pair,
            h2_groups.tile_expert,
            h2_routes.num_padded,
            1,
            h_expert_out,
            tuned,
        )

    calls["humming_fc1"], calls["humming_fc2"] = humming_fc1, humming_fc2
    flat = narrow_groups.pair_flat[:pairs].long()

    def diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
        a, b = ours.float(), theirs.float()
        return float((a - b).norm() / b.norm())

    facts = {
        "local": layer.local,
        "ranks": ranks,
        "tokens": tokens,
        "rows": rows,
        "pairs": pairs,
        "touched": touched,
        "fc1_bytes": touched * gemm_bytes(2 * inter, latent),
        "fc2_bytes": touched * gemm_bytes(latent, inter),
    }
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    for form, (gate_up, expert_out) in outputs.items():
        facts[f"{form}_fc1_diff"] = diff(gate_up[:pairs], h_gate_up[flat])
        facts[f"{form}_fc2_diff"] = diff(expert_out[:pairs], h_expert_out[:pairs])
    return calls, facts


def bench_row(layer: Layer, launches: dict, ranks: int, tokens: int, args, gen) -> dict:
    """One (local, T) row (row_calls): its facts, every GEMM's time in graph replay (us, under
    its call's name) and each form's difference from humming's outputs."""
    calls, result = row_calls(layer, launches, ranks, tokens, gen)
    for name, fn in calls.items():
        result[name] = graph_us(fn, args.reps, args.samples)
    return result


def write_report(results: list[dict], bandwidth: float, out, run: report.Run | None = None) -> None:
    """The page (and its plot) of `results` (bench_row's dicts) at `bandwidth` GB/s into `out`;
    `run`: what produced them (default: this process)."""
    page = report.Page(
        out / "bench_narrow_gemm.md",
        "The narrow GEMM against humming's, FC1 and FC2 alone, K3",
        report.summary(__doc__),
        run or report.Run.this_process(),
    )
    page.text(f"One process. Copy bandwidth measured in the run: {bandwidth:.0f} GB/s.")
    forms = [f for f in EVERY_FORM if f"{f}_fc1" in results[0]]
    kernels = [*forms, "humming"]
    for fc in ("fc1", "fc2"):
        page.section(fc.upper())
        rows = []
        for r in results:
            gb = r[f"{fc}_bytes"] / 1e9
            cells = [f"{r['local']} ({r['ranks']})", r["tokens"], r["pairs"], r["touched"]]
            for kernel in kernels:
                us = r[f"{kernel}_{fc}"]
                cells += [f"{us:.1f}", f"{100 * gb / (us * 1e-6) / bandwidth:.0f}%"]
            for form in forms:
                cells += [f"{r[f'{form}_{fc}'] / r[f'humming_{fc}']:.2f}"]
                cells += [f"{r[f'{form}_{fc}_diff']:.1e}"]
            rows.append(cells)
        columns = ["local (ranks)", "T", "pairs", "touched"]
        for kernel in kernels:
            columns += [f"{kernel} us", "% of copy"]
        for form in forms:
            columns += [f"{form} / humming", f"{form} diff"]
        page.table(columns, rows)
    panels = []
    styles = {"mma.sync": ":^", "wgmma": ":o", "wgmma ring": "o-", "humming": "s--"}
    styles |= {"humming words": "x-", "humming words direct": ":x"}
    styles |= dict(zip(WIDE, ("d-", "v-", "P-", "d--", "v--", "P--")))
    styles |= dict(
        zip(DEEP, ("v:", "v-.", "P:", "d:", "x:", "v-", "v--", "d-.", "x-.", "^-.", "P-.", "s-."))
    )
    for fc in ("fc1", "fc2"):
        series = []
        for local in dict.fromkeys(r["local"] for r in results):
            mine = [r for r in results if r["local"] == local]
            t = [r["tokens"] for r in mine]
            for i, kernel in enumerate(kernels):
                gbs = [r[f"{fc}_bytes"] / (r[f"{kernel}_{fc}"] * 1e-6) / 1e9 for r in mine]
                percent = [100 * g / bandwidth for g in gbs]
                label = f"{kernel}, {local} local"
                style = styles.get(kernel, "o-")
                series.append(report.Series(label, t, percent, style, color_of_previous=i > 0))
        title = f"{fc.upper()}: weight bytes at % of copy bandwidth"
        panels.append(report.Panel("T (tokens per rank)", "% of copy", series, title, x_log=2))
    page.plot(report.Figure("Narrow GEMM vs humming, 1 GPU, K3", panels))
    print(page.write())


def timed_forms(args) -> dict:
    """The forms a run times: `--forms`, else FORMS with SHAPES (--shapes) and WIDE (--wide)."""
    if args.forms:
        return {form: EVERY_FORM[form] for form in args.forms}
    return FORMS | (SHAPES if args.shapes else {}) | (WIDE if args.wide else {})


def main() -> int:
    parser = cli.parser(__doc__, page="bench_narrow_gemm.md", tokens=TOKENS, timing=(REPS, SAMPLES))
    parser.add_argument(
        "--shapes", action="store_true", help="time the other ring shapes (SHAPES) as well"
    )
    parser.add_argument(
        "--wide", action="store_true", help="time the tiles of 16, 24 and 32 pairs (WIDE) as well"
    )
    parser.add_argument(
        "--forms",
        nargs="+",
        choices=list(EVERY_FORM),
        metavar="FORM",
        help=f"time only these forms (any of {list(EVERY_FORM)})",
    )
    parser.add_argument(
        "--local",
        type=int,
        nargs="+",
        choices=LOCAL_EXPERTS,
        default=LOCAL_EXPERTS,
        help="the shards' local experts, each at every T",
    )
    args = parser.parse_args()
    if args.forms and (args.wide or args.shapes):
        parser.error("--forms names every form timed; --wide and --shapes add to the default forms")
    if not torch.cuda.is_available():
        print("bench_narrow_gemm: needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_gbs()
    launches = form_launches(timed_forms(args))
    results = []
    for local in args.local:
        layer = Layer(local, gen)
        for tokens in args.tokens:
            result = bench_row(layer, launches, K3.experts // local, tokens, args, gen)
            print(result, flush=True)
            results.append(result)
        del layer
        torch.cuda.empty_cache()
    write_report(results, bandwidth, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
