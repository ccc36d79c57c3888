"""What bounds the narrow GEMM's forms on humming's prepared weights beside humming's own GEMMs,
FC1 and FC2 alone at K3 geometry: Nsight Compute's metrics (stall reasons among them) of each
GEMM of bench_narrow_gemm's rows, one launch each.

    python -m bench.profile_narrow_gemm   # runs ncu; docs/results/profile_narrow_gemm.md

The module starts `ncu` (Nsight Compute, on PATH) once, on a child run of itself. The child
builds each shard's weights and each row's calls as bench_narrow_gemm does (`row_calls`: the
same rows, pairs and forms), runs every call once (each form compiles then), and runs them once
more between cudaProfilerStart and cudaProfilerStop, one after another in row_calls' order, so
that ncu's launches map onto the calls by position (the page refuses a run whose launch count
differs). ncu runs with `--clock-control none` (the clocks as the GPU sets them) and serializes
the kernels, replaying each once per metric pass with its memory restored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch

from bench import cli, report
from bench.bench_narrow_gemm import EVERY_FORM, Layer, form_launches, row_calls
from bench.profile_hopper_gemms import (
    K3_EXPERTS_GEOMETRY,
    KERNEL_NAME_CHARS,
    NCU_TEXT,
    RUN_FILE,
    SECTIONS,
    number,
    raw_rows,
    run_ncu,
    shown_columns,
    time_us,
)
from dep_ep.ep import K3

# (local experts, T per rank): 56 local at T = 64 and 128 (about 18 and 37 pairs an expert, the
# rows humming leaves below target that the wider tiles are for) and 448 at T = 16 (about one
# pair an expert: every width reads each touched expert once, so the width's own cost shows).
ROWS = ((56, 64), (56, 128), (448, 16))
FORMS = (
    "humming words",
    "humming words, tiles of 16",
    "humming words, tiles of 32",
    "humming words, tiles of 32, ring 6x2",
)
NCU_TIMEOUT_S = 1500
WHO = "bench.profile_narrow_gemm"  # the start of its messages
# The summary's columns: (heading, ncu metric).
SUMMARY = (
    ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L2 hit %", "lts__t_sector_hit_rate.pct"),
    ("issue active %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("warps active %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("tensor %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("FMA %", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("ALU %", "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"),
    ("registers", "launch__registers_per_thread"),
    ("shared bytes", "launch__shared_mem_per_block_dynamic"),
)
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
TOP_STALLS = 4
# Warp states ncu reports beside the stalls that are not reasons for a stall: "selected" is the
# issuing cycle itself (1 an issued instruction); "not_selected" (eligible, another warp issued)
# is kept, a sign of issue contention.
NOT_STALLS = ("selected", "not_issued")
OCCUPANCY_PREFIX = "launch__occupancy_limit_"


def child(rows: list[tuple[int, int]], forms: list[str], facts_path: Path) -> None:
    """The profiled program: each row's calls once to compile and warm, then once each inside the
    profiler's range; their names and the rows' facts to `facts_path`."""
    cudart = torch.cuda.cudart()
    gen = torch.Generator(device="cuda").manual_seed(0)
    launches = form_launches({form: EVERY_FORM[form] for form in forms})
    facts = []
    for local in dict.fromkeys(local for local, _ in rows):
        layer = Layer(local, gen)
        for tokens in (t for row_local, t in rows if row_local == local):
            calls, row_facts = row_calls(layer, launches, K3.experts // local, tokens, gen)
            cudart.cudaProfilerStart()
            for fn in calls.values():
                fn()
            torch.cuda.synchronize()
            cudart.cudaProfilerStop()
            facts.append(row_facts | {"calls": list(calls)})
        del layer
        torch.cuda.empty_cache()
    facts_path.write_text(json.dumps(facts))


def top_stalls(launch: dict[str, str]) -> str:
    """The launch's TOP_STALLS largest stall reasons (not NOT_STALLS), each in warp cycles an
    issued instruction."""
    stalls = []
    for name, cell in launch.items():
        if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX):
            reason = name[len(STALL_PREFIX) : -len(STALL_SUFFIX)]
            value = number(cell)
            if not math.isnan(value) and reason not in NOT_STALLS:
                stalls.append((value, reason))
    stalls.sort(reverse=True)
    return ", ".join(f"{reason} {value:.2f}" for value, reason in stalls[:TOP_STALLS]) or "-"


def occupancy(launch: dict[str, str]) -> str:
    """CTAs an SM the launch's limits allow (the least of ncu's occupancy limits) and which."""
    limits = {
        name[len(OCCUPANCY_PREFIX) :]: number(cell)
        for name, cell in launch.items()
        if name.startswith(OCCUPANCY_PREFIX) and not math.isnan(number(cell))
    }
    if not limits:
        return "-"
    least = min(limits.values())
    return f"{least:.0f} ({', '.join(k for k, v in limits.items() if v == least)})"


def write_report(out: Path, facts: list[dict], columns, units, launches, run=None) -> Path:
    """OUTDIR/profile_narrow_gemm.md: per row, a summary line per GEMM and ncu's raw metrics.
    SystemExit when ncu profiled another number of launches than the rows' calls."""
    calls = [(row, name) for row in facts for name in row["calls"]]
    if len(calls) != len(launches):
        names = [r.get("Kernel Name", "?")[:KERNEL_NAME_CHARS] for r in launches]
        raise SystemExit(
            f"bench.profile_narrow_gemm: ncu profiled {len(launches)} launches for"
            f" {len(calls)} calls; the launches: {names}"
        )
    run = run or report.Run.this_process()
    title = "What bounds the narrow GEMM on humming's weights, under Nsight Compute"
    page = report.Page(out / "profile_narrow_gemm.md", title, report.summary(__doc__), run)
    page.text(
        f"{K3_EXPERTS_GEOMETRY}; uniform routing; ncu sections: "
        + ", ".join(SECTIONS)
        + ". GB/s: the GEMM's touched weight"
        " bytes (bench_narrow_gemm's) over its duration under ncu. diff: the narrow form's"
        " output against humming's on the same pairs (relative L2, from the child's warm run)."
        " Stalls: the"
        f" {TOP_STALLS} largest `{STALL_PREFIX}*{STALL_SUFFIX}`, warp cycles an issued"
        " instruction. CTAs/SM: the least of ncu's occupancy limits, and which limit it is."
    )
    picked, missing = shown_columns(columns)
    start = 0
    for row in facts:
        mine = launches[start : start + len(row["calls"])]
        start += len(row["calls"])
        page.section(f"{row['local']} local experts, T = {row['tokens']}")
        page.text(
            f"{row['rows']} rows, {row['pairs']} pairs, {row['touched']} experts touched; FC1"
            f" {row['fc1_bytes'] / 1e6:.1f} MB and FC2 {row['fc2_bytes'] / 1e6:.1f} MB of"
            " weights."
        )
        lines = []
        for name, launch in zip(row["calls"], mine):
            us = time_us(launch, units)
            gbs = row[f"{name.rsplit('_', 1)[1]}_bytes"] / (us * 1e-6) / 1e9
            diff = row.get(f"{name}_diff")
            cells = [f"`{name}`", f"{us:.1f}", f"{gbs:.0f}", "-" if diff is None else f"{diff:.1e}"]
            cells += [launch.get(metric, "-") for _, metric in SUMMARY]
            cells += [occupancy(launch), top_stalls(launch)]
            lines.append(cells)
        heads = ["GEMM", "us (ncu)", "GB/s", "diff", *(h for h, _ in SUMMARY), "CTAs/SM", "stalls"]
        page.table(heads, lines)
        if missing:
            page.text("No metric matched: " + ", ".join(f"`{m}`" for m in missing) + ".")
        raw = [[m, units.get(m, ""), *(r.get(m, "-") for r in mine)] for m in picked]
        page.table(["metric", "unit", *(f"`{n}`" for n in row["calls"])], raw)
    return page.write()


# What write_report reads of each row of facts.json, beside a "<fc>_bytes" for each call's GEMM.
FACT_KEYS = ("calls", "local", "tokens", "rows", "pairs", "touched")


def checked_facts(rows) -> list[dict]:
    """facts.json's rows (the child's) as write_report reads them; ValueError naming what a row
    lacks."""
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise ValueError("facts.json: expected a list of rows (objects)")
    for row in rows:
        calls = row.get("calls")
        if not isinstance(calls, list) or not all(isinstance(c, str) for c in calls):
            raise ValueError(f"facts.json: a row's calls {calls!r}; expected a list of names")
        needed = [*FACT_KEYS, *(f"{name.rsplit('_', 1)[-1]}_bytes" for name in calls)]
        missing = [key for key in dict.fromkeys(needed) if key not in row]
        if missing:
            raise ValueError(f"facts.json: a row without {missing}")
    return rows


def from_raw(raw: Path, out: Path) -> Path:
    """The page again from a profiling run's folder (ncu's CSV, the facts, run.json), no GPU."""
    header, table, facts = raw / RUN_FILE, raw / "ncu.csv", raw / "facts.json"
    for path in (header, table, facts):
        if not path.is_file():
            raise SystemExit(f"bench.profile_narrow_gemm: {path} is missing; not a profiling run")
    try:
        run = report.Run(**json.loads(header.read_text()))
        rows = checked_facts(json.loads(facts.read_text()))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        # json's errors are ValueErrors; a field missing or of another shape the others.
        raise SystemExit(
            f"bench.profile_narrow_gemm: {raw} does not hold a profiling run's"
            f" {RUN_FILE} and facts.json as this module writes them: {exc!r}"
        ) from None
    again = f"python -m bench.profile_narrow_gemm --from-raw {raw}"
    run = dataclasses.replace(run, command=f"{run.command}; then {again}")
    columns, units, launches = raw_rows(table.read_text(encoding=NCU_TEXT["encoding"]), WHO)
    return write_report(out, rows, columns, units, launches, run)


def main() -> int:
    p = cli.parser(__doc__, page="profile_narrow_gemm.md")
    text = "(local experts, T) rows as LOCAL:T"
    p.add_argument("--rows", type=cli.local_tokens, nargs="+", default=list(ROWS), help=text)
    text = "the narrow GEMM's forms profiled beside humming's GEMMs (bench_narrow_gemm's names)"
    p.add_argument(
        "--forms",
        nargs="+",
        choices=list(EVERY_FORM),
        default=list(FORMS),
        metavar="FORM",
        help=text,
    )
    text = "ncu's CSV output and log, the child's facts and the run's header go here"
    p.add_argument("--raw", type=Path, default=Path("profile_narrow_gemm_raw"), help=text)
    text = "write the page from the folder of an earlier run (--raw), running nothing"
    p.add_argument("--from-raw", type=Path, default=None, help=text)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--facts", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    for local, tokens in args.rows:
        if K3.experts % local:
            p.error(f"row {local}:{tokens}: local experts must divide {K3.experts}")
    if args.child:
        child(args.rows, args.forms, args.facts)
        return 0
    if args.from_raw is not None:
        print(from_raw(args.from_raw, args.out))
        return 0
    if shutil.which("ncu") is None:
        raise SystemExit("bench.profile_narrow_gemm: no `ncu` on PATH (Nsight Compute)")
    for folder in (args.out, args.raw):
        # Both written after ncu's run, which takes minutes: refused before it.
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SystemExit(
                f"bench.profile_narrow_gemm: cannot write to {folder}: {exc}"
            ) from None
        if not os.access(folder, os.W_OK):
            raise SystemExit(f"bench.profile_narrow_gemm: cannot write to {folder}")
    raw = args.raw
    run = report.Run.this_process()
    (raw / RUN_FILE).write_text(json.dumps(dataclasses.asdict(run)))
    facts = raw / "facts.json"
    facts.unlink(missing_ok=True)  # a folder reused from an earlier run
    command = ["ncu", "--csv", "--page", "raw", "--profile-from-start", "off"]
    command += ["--clock-control", "none", *(a for s in SECTIONS for a in ("--section", s))]
    command += [sys.executable, "-m", "bench.profile_narrow_gemm", "--child"]
    command += ["--facts", str(facts), "--rows", *(f"{local}:{t}" for local, t in args.rows)]
    command += ["--forms", *args.forms]
    print(f"profiling {len(args.rows)} rows x {len(args.forms)} forms under ncu", flush=True)
    done = run_ncu(command, raw / "ncu.csv", raw / "ncu.log", NCU_TIMEOUT_S, WHO, facts)
    columns, units, launches = raw_rows(done.stdout, WHO)
    print(write_report(args.out, json.loads(facts.read_text()), columns, units, launches, run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
