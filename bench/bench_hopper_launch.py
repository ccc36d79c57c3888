"""Launch shapes of HopperExperts' own kernels around humming's GEMMs, at K3 geometry on rank 0's
receive rows: the grouping (experts/hopper/grouping_kernel.py: slots a chunk, warps), the finalize
(output columns a program, warps) and SiTU -> MXFP8 (pairs a step, programs per SM, columns,
warps); the measurement behind BLOCK_S / NUM_WARPS, HopperTiles.finalize_* and SITU_*.

    python -m bench.bench_hopper_launch     # writes docs/results/bench_hopper_launch.md

Rows drawn as bench_experts.py draws them (uniform routing). Each kernel alone in CUDA-graph
replay of --reps calls, median of --samples replays, per call. The grouping cuts tiles of 16
pairs (one tiling); the finalize reads random BF16 expert outputs, SiTU random BF16 FC1 outputs.
Every shape's outputs must equal the first shape's, bit for bit (the run stops otherwise).
"""

from __future__ import annotations

import datetime
import math
import sys
from pathlib import Path

import torch

from bench import cli, report
from bench.bench_experts import receive_rows
from bench.timing import capture, replay_us
from dep_ep.constants import SCALE_BLOCK
from dep_ep.ep import K3
from dep_ep.experts.hopper import HopperTiles, grouping_kernel, kernels
from dep_ep.experts.hopper.humming_engine import SITU_MAX_BLOCK_I, SITU_PROGRAMS_PER_SM, SITU_ROWS

CASES = [(56, 8), (56, 32), (56, 64), (56, 128), (56, 256), (448, 16), (448, 256)]  # (local, T)
GROUPING = [(512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8)]  # (slots a chunk, warps)
FINALIZE = [(128, 1), (256, 1), (256, 2), (256, 4), (512, 2), (512, 4)]  # (columns, warps)
SITU = [  # (pairs a step, programs per SM, columns, warps)
    (16, 4, 256, 4),
    (16, 8, 256, 4),
    (16, 16, 256, 4),
    (16, 32, 256, 4),
    (8, 16, 256, 4),
    (32, 16, 256, 8),
    (16, 16, 512, 8),
    (16, 32, 128, 4),
]
REPS, SAMPLES = 20, 15  # calls per captured graph, timed replays (median)
BLOCK_N = 16


def grouping_times(ids: torch.Tensor, local: int, timed) -> dict[str, float]:
    """{shape: us} of group_and_route with each GROUPING shape (module constants set per shape),
    `timed(call)` the us per call; each shape's tensors equal the first's."""
    saved = grouping_kernel.BLOCK_S, grouping_kernel.NUM_WARPS
    times, first = {}, None
    try:
        for block_s, warps in GROUPING:
            grouping_kernel.BLOCK_S, grouping_kernel.NUM_WARPS = block_s, warps
            groups, routes = grouping_kernel.group_and_route(ids, 0, local, BLOCK_N)
            got = (
                groups.pair_flat,
                groups.pair_slot,
                groups.tile_expert,
                groups.tile_rows,
                routes.flat,
                routes.pair,
                routes.num_padded,
            )
            if first is None:
                first = got
            if not all(torch.equal(a, b) for a, b in zip(got, first)):
                raise SystemExit(f"grouping {block_s}/{warps} differs from {GROUPING[0]}")
            times[f"{block_s}/{warps}"] = timed(
                lambda: grouping_kernel.group_and_route(ids, 0, local, BLOCK_N)
            )
    finally:
        grouping_kernel.BLOCK_S, grouping_kernel.NUM_WARPS = saved
    return times


def finalize_times(y, pair_slot, weights, rows: int, timed) -> dict[str, float]:
    """{shape: us} of finalize_kernel with each FINALIZE shape; outputs bitwise equal. y holds
    every slot's row (the capacity): the pair budget never overflows."""
    times, first = {}, None
    # The pair budget's arguments: the pair count (at most the slots), y's rows, the record.
    num_pairs = torch.full((1,), y.shape[0], dtype=torch.int32, device="cuda")
    budget = (num_pairs, y.shape[0], torch.zeros(1, dtype=torch.int32, device="cuda"))
    for columns, warps in FINALIZE:
        out = torch.full((rows, K3.latent), float("nan"), dtype=torch.bfloat16, device="cuda")

        def call(columns=columns, warps=warps, out=out):
            kernels.finalize_kernel[(rows, K3.latent // columns)](
                y, pair_slot, weights, out, *budget, K3.latent, K3.topk, columns, num_warps=warps
            )

        times[f"{columns}/{warps}"] = timed(call)
        bits = out.view(torch.int16)
        first = bits if first is None else first
        if not torch.equal(bits, first):
            raise SystemExit(f"finalize {columns}/{warps} differs from {FINALIZE[0]}")
    return times


def situ_times(gate_up, groups, sms: int, timed) -> dict[str, float]:
    """{shape: us} of situ_mxfp8_kernel with each SITU shape, launched as HopperExperts launches
    it; the MXFP8 activations of the pairs bitwise equal."""
    inter, capacity = K3.intermediate, gate_up.shape[0]
    pairs = int(groups.num_pairs)
    times, first = {}, None
    for step, per_sm, columns, warps in SITU:
        blocks = inter // columns
        programs = max(1, min(-(-capacity // step), per_sm * sms // blocks))
        act = torch.empty(capacity, inter, dtype=torch.float8_e4m3fn, device="cuda")
        scale = torch.empty(capacity, inter // SCALE_BLOCK, device="cuda")

        def call(
            step=step,
            columns=columns,
            warps=warps,
            programs=programs,
            blocks=blocks,
            act=act,
            scale=scale,
        ):
            kernels.situ_mxfp8_kernel[(programs, blocks)](
                gate_up,
                groups.pair_flat,
                groups.num_pairs,
                act,
                scale,
                inter,
                step,
                columns,
                num_warps=warps,
            )

        times[f"{step}/{per_sm}/{columns}/{warps}"] = timed(call)
        got = (act[:pairs].view(torch.uint8), scale[:pairs].view(torch.int32))
        first = got if first is None else first
        if not all(torch.equal(a, b) for a, b in zip(got, first)):
            raise SystemExit(f"SiTU {step}/{per_sm}/{columns}/{warps} differs from {SITU[0]}")
    return times


def add_table(
    page: report.Page, title: str, legend: str, results: list[dict], key: str, default: str
) -> None:
    """A section of `page`: us per call of each shape in results[i][key] (bold: `default`, the
    library's shape), a row per case, the fastest marked."""
    page.section(title)
    page.text(legend)
    shapes = list(results[0][key])
    columns = ["local", "T", "rows"] + [
        f"**{s}** us" if s == default else f"{s} us" for s in shapes
    ]
    rows = []
    for r in results:
        best = min(r[key].values())
        cells = [f"{us:.1f}" + (" (best)" if us == best else "") for us in r[key].values()]
        rows.append([r["local"], r["tokens"], r["rows"], *cells])
    page.table(columns, rows)


def main() -> int:
    args = cli.parser(__doc__, page="bench_hopper_launch.md", timing=(REPS, SAMPLES)).parse_args()

    def timed(call) -> float:
        """us per call of `call` in graph replay."""
        return replay_us(capture(call, args.reps), args.reps, args.samples)

    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for local, tokens in CASES:
        x, sf, ids, weights = receive_rows(K3.experts // local, tokens, local, gen)
        rows, capacity = ids.shape[0], ids.numel()
        groups, _ = grouping_kernel.group_and_route(ids, 0, local, BLOCK_N)
        y = torch.randn(capacity, K3.latent, device="cuda", generator=gen).bfloat16()
        gate_up = torch.randn(capacity, 2 * K3.intermediate, device="cuda", generator=gen)
        result = {
            "local": local,
            "tokens": tokens,
            "rows": rows,
            "grouping": grouping_times(ids, local, timed),
            "finalize": finalize_times(y, groups.pair_slot, weights, rows, timed),
            "situ": situ_times(gate_up.bfloat16(), groups, sms, timed),
        }
        results.append(result)
        print(datetime.datetime.now().strftime("%H:%M:%S"), result, flush=True)
    write_report(args.out, results)
    return 0


def write_report(out: Path, results: list[dict], run: report.Run | None = None) -> Path:
    """OUTDIR/bench_hopper_launch.md from the cases of `main`."""
    run = run or report.Run.this_process()
    tiles = HopperTiles()
    columns = math.gcd(SITU_MAX_BLOCK_I, K3.intermediate)  # HopperExperts.situ_block_i
    situ_default = f"{SITU_ROWS}/{SITU_PROGRAMS_PER_SM}/{columns}/4"
    title = "Launch shapes of HopperExperts' grouping, finalize and SiTU kernels"
    page = report.Page(out / "bench_hopper_launch.md", title, report.summary(__doc__), run)
    page.text(
        "Each kernel alone, graph replay, us per call; rows drawn as bench_experts.py draws them"
        " (uniform routing), rank 0 of 896 / local ranks. Bold: the library's shape; every"
        " shape's outputs equal the first's bit for bit.",
    )
    grouping = f"{grouping_kernel.BLOCK_S}/{grouping_kernel.NUM_WARPS}"
    add_table(
        page,
        "Grouping (slots a chunk / warps)",
        "group_and_route, tiles of 16 pairs.",
        results,
        "grouping",
        grouping,
    )
    finalize = f"{tiles.finalize_columns(K3.latent)}/{tiles.finalize_warps}"
    add_table(
        page,
        "Finalize (columns a program / warps)",
        "finalize_kernel over every row.",
        results,
        "finalize",
        finalize,
    )
    add_table(
        page,
        "SiTU -> MXFP8 (pairs a step / programs per SM / columns / warps)",
        "situ_mxfp8_kernel over the pairs.",
        results,
        "situ",
        situ_default,
    )
    return page.write()


if __name__ == "__main__":
    sys.exit(main())
