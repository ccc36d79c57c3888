"""humming's kernel per pair count: FC1 and FC2 of HopperExperts' humming engine timed alone with
each kernel HummingGemm.tuning picks for 16, 32, ..., 65536 pairs, at K3 geometry on rank 0's
receive rows, beside the kernel `tuning_pairs` picks; the measurement behind `tuning_pairs`.

    python -m bench.bench_humming_tuning --variants   # docs/results/bench_humming_tuning.md

Rows drawn as bench_experts.py draws them (uniform routing), in a draw of their own. Each GEMM in
CUDA-graph replay of --reps calls, median of --samples replays, per call, on the routes of the
grouping for that kernel's tile size; FC2 reads random e4m3 activations with unit scales (its
time does not depend on their values).
Tunings that pick the same kernel are timed once, under the smallest pair count picking it.
Variants (56 local experts, T = VARIANT_TOKENS): humming's own choices for 512, 1024 and 2048
pairs (before humming_gemm.TUNING_UPDATES) and each of the first two with 16, 24 or 32 pairs a
block, stream-K on or off; the measurement behind TUNING_UPDATES.
Decode variants (--decode-variants; 56 local experts, T = DECODE_TOKENS): the kernel humming
picks for DECODE_BASE pairs (the one `tuning_pairs` picks at T = 1 there) and, one change at a
time, other block N and K, pipeline stages, CTAs an SM and stream-K; at T = 1 the GEMMs read
the touched experts' weights at 61-83% of the copy bandwidth (docs/experts.md), and these are
the launch shapes that decide how evenly the SMs share that stream.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from bench import cli, report
from bench.bench_experts import receive_rows
from bench.timing import capture, replay_us
from dep_ep.constants import SCALE_BLOCK
from dep_ep.ep import K3
from dep_ep.experts.hopper import (
    Grouping,
    HopperExperts,
    HummingEngine,
    routed_tilings,
    tuning_pairs,
)
from dep_ep.experts.hopper.humming_gemm import HUMMING_USE_PDL
from dep_ep.testing.synthetic import SyntheticLayer

CASES = {56: (1, 8, 16, 32, 64, 128, 256), 448: (16, 256)}  # local experts: T per rank
VARIANT_LOCAL, VARIANT_TOKENS = 56, (16, 32, 64, 128)
VARIANT_BASES, VARIANT_BLOCKS = (512, 1024, 2048), (16, 24, 32)
DECODE_TOKENS, DECODE_BASE = (1, 2, 4), 16
DECODE_BLOCK_N, DECODE_BLOCK_K = (64, 128, 256), (128, 256, 512)
DECODE_STAGES, DECODE_CTAS = (2, 3, 4, 6), (1, 2, 3, 4)
# A --variants-only page's summary: it has no per-count tables.
VARIANTS_DOC = f"""FC1 and FC2 of HopperExperts' humming engine timed alone, at K3 geometry on rank
0's receive rows at {VARIANT_LOCAL} local experts, with variants of the kernels humming picks
(the page's sections say which), graph replay."""
TUNINGS = [1 << i for i in range(4, 17)]  # pair counts humming is asked to tune for
REPS, SAMPLES = 10, 10  # calls per captured graph, timed replays (median)
E4M3 = torch.float8_e4m3fn


def distinct_tunings(gemm) -> dict[int, dict]:
    """{smallest pair count picking it: kernel config} over TUNINGS."""
    seen = {}
    for pairs in TUNINGS:
        seen.setdefault(json.dumps(gemm.tuning(pairs), sort_keys=True), pairs)
    return {pairs: gemm.tuning(pairs) for pairs in seen.values()}


def column_of(kernels: dict[int, dict], gemm, pairs: int) -> int:
    """The column (key of `kernels`) of the kernel humming picks for `pairs`."""
    config = gemm.tuning(pairs)
    return next(column for column, kernel in kernels.items() if kernel == config)


def routed_call(gemm, name: str, ids, num_local: int, inputs, input_scale, out, tuned: int):
    """(call, groups): a no-argument call of humming GEMM `name` ("fc1" or "fc2") with the kernel
    tuned for `tuned` pairs, on the routes of the Triton grouping of `ids` (int32 [R, K]) over
    `num_local` local experts in that kernel's tiles, writing `out`; groups: that grouping's
    PairGroups."""
    topk = ids.shape[1]
    [(groups, routes)] = routed_tilings(ids, 0, num_local, (gemm.block_m(tuned),), Grouping.TRITON)
    # FC1 reads row id // K for route id = row * K + k; FC2 reads activation row = pair.
    sorted_ids, top_k = (routes.flat, topk) if name == "fc1" else (routes.pair, 1)

    def call():
        gemm(
            inputs,
            input_scale,
            sorted_ids,
            groups.tile_expert,
            routes.num_padded,
            top_k,
            out,
            tuned,
        )

    return call, groups


def time_gemm(
    backend: HopperExperts, name: str, kernels: dict[int, dict], rows, timing: tuple[int, int]
) -> dict[int, float]:
    """{column: us per call} of GEMM `name` ("fc1" or "fc2") with each of `kernels`; timing:
    (calls per captured graph, timed replays)."""
    x, sf, ids, _ = rows
    count, topk = ids.shape
    capacity, inter = count * topk, backend.intermediate
    gemm = getattr(backend.prepared, name)
    if name == "fc1":
        inputs, input_scale = x.view(E4M3), torch.ones(sf.shape, device="cuda")
        out = torch.empty(capacity, 2 * inter, dtype=torch.bfloat16, device="cuda")
    else:
        inputs = torch.randn(capacity, inter, device="cuda").to(E4M3)
        input_scale = torch.ones(capacity, inter // SCALE_BLOCK, device="cuda")
        out = torch.empty(capacity, backend.latent, dtype=torch.bfloat16, device="cuda")
    times = {}
    for column in kernels:
        call, _ = routed_call(
            gemm, name, ids, backend.num_local_experts, inputs, input_scale, out, column
        )
        reps, samples = timing
        times[column] = replay_us(capture(call, reps), reps, samples)
    return times


def distinct_configs(tried: list[tuple[str, dict]]) -> dict[str, dict]:
    """{label: config} of `tried` in order, each config once (under its first label)."""
    configs, seen = {}, set()
    for label, config in tried:
        key = json.dumps(config, sort_keys=True)
        if key not in seen:
            seen.add(key)
            configs[label] = config
    return configs


def variant_configs(gemm) -> dict[str, dict]:
    """{label: config}: humming's own choice for each of VARIANT_BASES and, for all but the last,
    the same kernel with VARIANT_BLOCKS pairs a block and stream-K on or off (distinct only)."""
    tried = []
    for base_pairs in VARIANT_BASES:
        base = gemm.heuristic(base_pairs)
        tried.append((f"humming's {base_pairs}", base))
        if base_pairs != VARIANT_BASES[-1]:
            for block, stream_k in itertools.product(VARIANT_BLOCKS, (True, False)):
                label = f"{base_pairs}'s, {block} pairs, stream-K {'on' if stream_k else 'off'}"
                shape = [block, *base["block_shape"][1:]]
                tried.append((label, {**base, "block_shape": shape, "use_stream_k": stream_k}))
    return distinct_configs(tried)


def decode_variant_configs(gemm) -> dict[str, dict]:
    """{label: config}: humming's own choice for DECODE_BASE pairs, then that kernel with one
    change each: block N (DECODE_BLOCK_N), block K (DECODE_BLOCK_K), pipeline stages
    (DECODE_STAGES), CTAs an SM (DECODE_CTAS), stream-K flipped (distinct only; humming may
    refuse some, which the page says)."""
    base = gemm.heuristic(DECODE_BASE)
    m, n, k = base["block_shape"]
    tried = [(f"humming's {DECODE_BASE}", base)]
    tried += [(f"N {v}", {**base, "block_shape": [m, v, k]}) for v in DECODE_BLOCK_N]
    tried += [(f"K {v}", {**base, "block_shape": [m, n, v]}) for v in DECODE_BLOCK_K]
    tried += [(f"{v} stages", {**base, "num_stages": v}) for v in DECODE_STAGES]
    tried += [(f"{v} CTAs an SM", {**base, "num_ctas_per_sm": v}) for v in DECODE_CTAS]
    stream_k = not base.get("use_stream_k", True)
    tried.append((f"stream-K {'on' if stream_k else 'off'}", {**base, "use_stream_k": stream_k}))
    return distinct_configs(tried)


def add_variants(
    page: report.Page,
    gen: torch.Generator,
    timing: tuple[int, int],
    configs_of=None,
    token_counts: tuple[int, ...] = VARIANT_TOKENS,
    title: str = "Variants",
) -> None:
    """The variants' sections of `page`: per GEMM, a row per variant (`configs_of(gemm)`,
    default `variant_configs`), a column per T of `token_counts` (us, or why not run)."""
    configs_of = configs_of or variant_configs
    weights = SyntheticLayer(K3, seed=1, device="cuda").local_weights(0, VARIANT_LOCAL)
    backend = HopperExperts(weights, engine=HummingEngine())
    rows = {
        t: receive_rows(K3.experts // VARIANT_LOCAL, t, VARIANT_LOCAL, gen) for t in token_counts
    }
    for name in ("fc1", "fc2"):
        gemm = getattr(backend.prepared, name)
        table = []
        for index, (label, config) in enumerate(configs_of(gemm).items()):
            column = -1 - index  # a tuning key no pair count uses
            # use_pdl set as HummingGemm.tuning sets it, whatever a later humming's heuristic says
            gemm.tunings[column] = {**config, "use_pdl": HUMMING_USE_PDL}
            cells = []
            for tokens in token_counts:
                try:
                    times = time_gemm(backend, name, {column: config}, rows[tokens], timing)
                    cells.append(f"{times[column]:.0f}")
                except Exception as error:  # humming refuses some shapes (an assertion)
                    cells.append(f"not built ({type(error).__name__})")
            block = ", ".join(str(v) for v in config["block_shape"])
            shape = [block, config.get("num_stages", "-"), config.get("num_ctas_per_sm", "-")]
            table.append([label, *shape, config.get("use_stream_k", "-"), *cells])
            print(name, table[-1], flush=True)
        page.section(f"{title}, {VARIANT_LOCAL} local experts: {name.upper()}")
        columns = ["kernel", "block (pairs, N, K)", "stages", "CTAs an SM", "stream-K"]
        page.table(columns + [f"T = {t} us" for t in token_counts], table)


def main() -> int:
    timing = (REPS, SAMPLES)
    p = cli.parser(__doc__, page="bench_humming_tuning.md", timing=timing)
    p.add_argument(
        "--variants",
        action="store_true",
        help="also time the variants of humming's kernels (VARIANT_TOKENS)",
    )
    p.add_argument(
        "--decode-variants",
        action="store_true",
        help="also time the decode variants of humming's kernel for DECODE_BASE pairs",
    )
    p.add_argument(
        "--variants-only",
        action="store_true",
        help="time only the variants asked for, not humming's kernel per pair count (CASES)",
    )
    args = p.parse_args()
    timing = (args.reps, args.samples)
    gen = torch.Generator(device="cuda").manual_seed(0)
    title, summary = "humming's kernel per pair count (HopperExperts' humming engine)", __doc__
    if args.variants_only:
        title, summary = (
            "Variants of humming's kernels (HopperExperts' humming engine)",
            VARIANTS_DOC,
        )
    page = report.Page(
        args.out / "bench_humming_tuning.md",
        title,
        report.summary(summary),
        report.Run.this_process(),
    )
    page.text("Each GEMM alone, graph replay, us per call.")
    if not args.variants_only:
        page.text(
            "Per pair count, columns: the kernels HummingGemm.tuning picks (humming's heuristic"
            " with humming_gemm.TUNING_UPDATES) when asked to tune for 16, 32, ..., 65536 pairs,"
            " each under the smallest count picking it; bold: the kernel of `tuning_pairs` for"
            " these rows (the power of two nearest the expected pairs).",
        )
    for local, token_counts in ({} if args.variants_only else CASES).items():
        weights = SyntheticLayer(K3, seed=1, device="cuda").local_weights(0, local)
        backend = HopperExperts(weights, engine=HummingEngine())
        gemms = {"fc1": backend.prepared.fc1, "fc2": backend.prepared.fc2}
        kernels = {name: distinct_tunings(gemm) for name, gemm in gemms.items()}
        tables = {name: [] for name in gemms}
        for tokens in token_counts:
            rows = receive_rows(K3.experts // local, tokens, local, gen)
            ids = rows[2]
            chosen = tuning_pairs(ids.shape[0], K3.topk, local, K3.experts)
            held = int(((ids >= 0) & (ids < local)).sum())
            for name, gemm in gemms.items():
                times = time_gemm(backend, name, kernels[name], rows, timing)
                picked = column_of(kernels[name], gemm, chosen)
                cells = [
                    f"**{us:.0f}**" if column == picked else f"{us:.0f}"
                    for column, us in times.items()
                ]
                tables[name].append([tokens, ids.shape[0], held, chosen, *cells])
                print(local, name, tables[name][-1], flush=True)
        for name in gemms:
            page.section(f"{local} local experts: {name.upper()}")
            columns = ["kernel tuned for (pairs)", "block (pairs, N, K)", "CTAs per SM", "stream-K"]
            page.table(
                columns,
                [
                    [
                        column,
                        ", ".join(str(v) for v in config["block_shape"]),
                        config["num_ctas_per_sm"],
                        config["use_stream_k"],
                    ]
                    for column, config in kernels[name].items()
                ],
            )
            columns = ["T", "rows", "pairs", "tuning_pairs"]
            page.table(columns + [f"{column} us" for column in kernels[name]], tables[name])
        del weights, backend
        torch.cuda.empty_cache()
    if args.variants:
        add_variants(page, gen, timing)
    if args.decode_variants:
        add_variants(page, gen, timing, decode_variant_configs, DECODE_TOKENS, "Decode variants")
    page.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
