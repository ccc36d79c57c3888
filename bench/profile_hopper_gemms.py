"""What bounds HopperExperts' GEMMs (humming engine, its defaults) where the call misses its
floor: Nsight Compute's metrics of every kernel of one call at K3 geometry, per (local experts,
T) case, beside the dense FP8 GEMM whose rate sets the MMA floor, profiled the same way.

    python -m bench.profile_hopper_gemms   # runs ncu; docs/results/profile_hopper_gemms.md

The module starts `ncu` (Nsight Compute, on PATH) once per case on a child run of itself. The
child builds HopperExperts for rank 0's local experts, draws the receive rows as bench_experts.py
does (uniform routing), runs two eager calls (humming compiles its kernels for the pair count),
then one more between cudaProfilerStart and cudaProfilerStop: ncu profiles every kernel of that
call (`--profile-from-start off`), replaying each once per metric pass with its memory restored.
The dense case profiles one torch._scaled_mm of e4m3 [8192, 8192] x [8192, 8192] (the GEMM of
bench_experts' `fp8_tflops`). ncu holds the clocks near base and serializes the kernels, so its
durations exceed graph replay's; rates are compared within the page, every kernel under the same
clock control, which keeps the SM clock near base but not fixed (`gpc__cycles_elapsed` on the
page gives each launch's), so a "% dense" may be off by the ratio of the two clocks. The child
writes its rows and pairs to a JSON file beside ncu's CSV (stdout) and log (stderr).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from bench import cli, report
from bench.bench_experts import FP8_GEMM, receive_rows
from dep_ep.ep import K3

# (local experts, T per rank): the rows below issue 24's targets (80% of the floor from T = 4,
# 70% at T = 1 and 2) in bench_experts.md, from decode (T = 1) to prefill (T = 2048).
CASES = ((56, 1), (56, 64), (56, 256), (56, 2048), (448, 1024))
SECTIONS = (
    "SpeedOfLight",
    "ComputeWorkloadAnalysis",
    "MemoryWorkloadAnalysis",
    "Occupancy",
    "LaunchStats",
    "SchedulerStats",
    "WarpStateStats",
)
WARM_CALLS = 2
NCU_TIMEOUT_S = 900
# The raw metrics a page shows, by name pattern, in this order (ncu names them; a pattern that
# matches no metric of a run is said so on the page).
SHOWN = (
    r"gpu__time_duration\.sum",
    r"launch__grid_size",
    r"launch__block_size",
    r"launch__registers_per_thread",
    r"launch__shared_mem_per_block_dynamic",
    r"launch__occupancy_limit_.*",
    r"gpc__cycles_elapsed\.avg\.per_second",
    r"sm__warps_active\.avg\.pct_of_peak_sustained_active",
    r"sm__throughput\.avg\.pct_of_peak_sustained_elapsed",
    r"gpu__compute_memory_throughput\.avg\.pct_of_peak_sustained_elapsed",
    r"gpu__dram_throughput\.avg\.pct_of_peak_sustained_elapsed",
    r"dram__bytes\.sum\.per_second",
    r"lts__t_sector_hit_rate\.pct",
    r"smsp__issue_active\.avg\.pct_of_peak_sustained_active",
    r"sm__inst_executed\.avg\.per_cycle_active",
    r"sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active",
    r"sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active",
    r"smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio",
)
KERNEL_NAME_CHARS = 48
TIME_METRIC = "gpu__time_duration.sum"
# The rates table's utilizations, each the launches' mean weighted by their durations.
UTILIZATION = {
    "tensor pipe %": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "issue active %": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "ALU %": "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
    "FMA %": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "DRAM %": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
}
# The experts' geometry as every profiler's page states it.
K3_EXPERTS_GEOMETRY = (
    f"K3 geometry (L {K3.latent}, I {K3.intermediate}, K {K3.topk}, E {K3.experts})"
)
RUN_FILE = "run.json"  # the profiling run's header (command, hardware, software, date)
CASES_FILE = "cases.json"  # the profiling run's cases, [[local, T], ...], dense GEMM not counted
# ncu's time units (short, as ncu 2025 writes them, and long) in microseconds.
TIME_UNITS_US = {
    "ns": 1e-3,
    "nsecond": 1e-3,
    "us": 1.0,
    "usecond": 1.0,
    "ms": 1e3,
    "msecond": 1e3,
    "s": 1e6,
    "second": 1e6,
}
# How ncu's output is read and its files kept (subprocess.run's and bytes.decode's keywords):
# UTF-8 whatever the locale, undecodable bytes replaced, so that a kernel name or a log line in
# another encoding cannot cost a run.
NCU_TEXT = {"encoding": "utf-8", "errors": "replace"}
# The first line of ncu's raw table.
HEADER_START = '"ID","'


@dataclasses.dataclass(frozen=True)
class Case:
    """One profiled call: `local` experts and `tokens` per rank (0, 0: the dense FP8 GEMM)."""

    local: int
    tokens: int

    @property
    def name(self) -> str:
        if self.local == 0:
            return f"dense FP8 GEMM {FP8_GEMM}^3"
        return f"{self.local} local experts, T = {self.tokens}"

    @property
    def slug(self) -> str:
        return "dense" if self.local == 0 else f"l{self.local}_t{self.tokens}"


def child(case: Case, facts: Path) -> None:
    """The profiled program: warm calls, then one call inside the profiler's range."""
    cudart = torch.cuda.cudart()
    if case.local == 0:
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(FP8_GEMM, FP8_GEMM, device="cuda", generator=gen)
        b = torch.randn(FP8_GEMM, FP8_GEMM, device="cuda", generator=gen)
        a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")

        def call():
            torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)

        flops = {"dense": 2 * FP8_GEMM**3}
        fact = {"flops": flops}
    else:
        from dep_ep.experts.hopper import HopperExperts, HummingEngine
        from dep_ep.testing.synthetic import SyntheticLayer

        weights = SyntheticLayer(K3, seed=1, device="cuda").local_weights(0, case.local)
        backend = HopperExperts(weights, engine=HummingEngine())
        gen = torch.Generator(device="cuda").manual_seed(0)
        rows = receive_rows(K3.experts // case.local, case.tokens, case.local, gen)
        ids = rows[2]
        out = torch.empty(ids.shape[0], K3.latent, dtype=torch.bfloat16, device="cuda")
        pairs = int(((ids >= 0) & (ids < case.local)).sum())
        touched = int(ids[(ids >= 0) & (ids < case.local)].unique().numel())

        def call():
            backend.forward(*rows, out)

        latent, inter = K3.latent, K3.intermediate
        flops = {"fc1": 2 * pairs * latent * 2 * inter, "fc2": 2 * pairs * inter * latent}
        fact = {"rows": int(ids.shape[0]), "pairs": pairs, "touched": touched, "flops": flops}
    for _ in range(WARM_CALLS):
        call()
    torch.cuda.synchronize()
    cudart.cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    cudart.cudaProfilerStop()
    facts.write_text(json.dumps(fact))


def run_ncu(
    command: list[str], csv_path: Path, log_path: Path, timeout_s: int, who: str, made: Path
):
    """Run `command` (ncu on a child) with a timeout, keeping its stdout (ncu's CSV) in csv_path
    and its stderr in log_path, also when it runs past `timeout_s`. SystemExit, `who` (the
    module and the profiled case) naming what ran, when it runs past that time, exits with an
    error or leaves no `made` (the file the child writes). Returns the CompletedProcess."""
    try:
        done = subprocess.run(command, capture_output=True, timeout=timeout_s, **NCU_TEXT)
    except subprocess.TimeoutExpired as exc:
        # The partial output of a timed-out run comes as bytes whatever the decoding asked.
        for path, text in ((csv_path, exc.stdout), (log_path, exc.stderr)):
            if isinstance(text, bytes):
                text = text.decode(**NCU_TEXT)
            path.write_text(text or "", encoding=NCU_TEXT["encoding"])
        raise SystemExit(
            f"{who}: ncu ran past {timeout_s} s; its output so far is in {csv_path.parent}"
        ) from None
    csv_path.write_text(done.stdout, encoding=NCU_TEXT["encoding"])
    log_path.write_text(done.stderr, encoding=NCU_TEXT["encoding"])
    if done.returncode != 0 or not made.is_file():
        raise SystemExit(
            f"{who}: ncu failed (exit {done.returncode}):\n"
            f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return done


def raw_rows(
    text: str, who: str = "bench.profile_hopper_gemms"
) -> tuple[list[str], dict[str, str], list[dict[str, str]]]:
    """ncu's `--csv --page raw` output -> (the column names in order, each column's unit, one
    dict per profiled launch in launch order). The table starts at the first line that starts
    with HEADER_START; the units row is the line after it (its "ID" is empty); lines before the
    table (the program's own output, ncu's notes) and after it (rows of another width, or with
    no ID) are skipped. SystemExit, its message starting with `who` (the module reading it), for
    text without a table or a table without a launch."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith(HEADER_START)), None)
    if start is None:
        raise SystemExit(f"{who}: no ncu table in:\n{text[-2000:]}")
    reader = csv.reader(io.StringIO("".join(lines[start:])))
    columns = next(reader)
    units: dict[str, str] = {}
    launches: list[dict[str, str]] = []
    for index, cells in enumerate(reader):
        if len(cells) != len(columns):
            continue  # a line of the program's output after the table
        row = dict(zip(columns, cells))
        if index == 0 and not row["ID"]:
            units = row
        elif row["ID"]:
            launches.append(row)
    if not launches:
        raise SystemExit(f"{who}: ncu's table has no profiled launch")
    return columns, units, launches


def kernel_group(name: str) -> str:
    """Which part of the call a kernel is: "fc1" / "fc2" for humming's GEMMs (by their N, K shape:
    FC1 [L] -> [2I], FC2 [I] -> [L]), "dense" for the FP8 GEMM, else "other"."""
    if "humming" in name:
        # ncu writes the template's shape as "Shape<0, 6144, 3584>"; torch's profiler with "u"s
        shape = re.search(r"Shape<0u?, (\d+)u?, (\d+)u?>", name)
        n_k = (int(shape[1]), int(shape[2])) if shape else None
        if n_k == (2 * K3.intermediate, K3.latent):
            return "fc1"
        if n_k == (K3.latent, K3.intermediate):
            return "fc2"
        return "other"
    if any(word in name for word in ("gemm", "nvjet", "xmma", "cutlass")):
        return "dense"
    return "other"


def number(cell: str) -> float:
    """A raw cell as a float (ncu writes thousands separators); nan when not a number."""
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return math.nan


def shown_columns(columns: list[str]) -> tuple[list[str], list[str]]:
    """(the metric columns SHOWN selects, in SHOWN's order; the patterns that matched none)."""
    picked, missing = [], []
    for pattern in SHOWN:
        hits = [c for c in columns if re.fullmatch(pattern, c) and c not in picked]
        if not hits:
            missing.append(pattern)
        picked += sorted(hits)
    return picked, missing


def time_us(row: dict[str, str], units: dict[str, str]) -> float:
    """A launch's duration in us from gpu__time_duration.sum in the unit ncu gave it (SystemExit
    for a unit not in TIME_UNITS_US, or no units row)."""
    unit = units.get(TIME_METRIC)
    if unit not in TIME_UNITS_US:
        raise SystemExit(
            f"bench.profile_hopper_gemms: {TIME_METRIC} in unit {unit!r}; expected"
            f" one of {sorted(TIME_UNITS_US)}"
        )
    return number(row[TIME_METRIC]) * TIME_UNITS_US[unit]


def group_rates(launches, units, flops: dict[str, int]) -> dict[str, tuple[int, float, float]]:
    """Per group with FLOPs: (launches, us summed over them, TFLOP/s). SystemExit when a group
    has no launch (a kernel name kernel_group does not know)."""
    rates = {}
    for group, group_flops in flops.items():
        rows = [r for r in launches if kernel_group(r["Kernel Name"]) == group]
        if not rows:
            names = sorted({r["Kernel Name"][:KERNEL_NAME_CHARS] for r in launches})
            raise SystemExit(f"bench.profile_hopper_gemms: no {group} launch among {names}")
        us = sum(time_us(r, units) for r in rows)
        rates[group] = (len(rows), us, group_flops / (us * 1e-6) / 1e12)
    return rates


def weighted_mean(launches, units, group: str, metric: str) -> float:
    """`metric` over the launches of `group`, weighted by their durations (nan: none, or a
    metric ncu did not give)."""
    rows = [r for r in launches if kernel_group(r["Kernel Name"]) == group]
    weights = [time_us(r, units) for r in rows]
    values = [number(r.get(metric, "")) for r in rows]
    if not rows or sum(weights) <= 0:
        return math.nan
    return sum(w * v for w, v in zip(weights, values)) / sum(weights)


def write_report(out: Path, results, run: report.Run | None = None) -> Path:
    """OUTDIR/profile_hopper_gemms.md from `results`: [(Case, facts, columns, units, launches)]."""
    run = run or report.Run.this_process()
    title = "What bounds HopperExperts' GEMMs (humming engine), under Nsight Compute"
    page = report.Page(out / "profile_hopper_gemms.md", title, report.summary(__doc__), run)
    page.text(
        f"{K3_EXPERTS_GEOMETRY}; uniform routing; ncu sections: "
        + ", ".join(SECTIONS)
        + ". TFLOP/s: the call's FC1 (FC2)"
        " FLOPs over the summed durations of its FC1 (FC2) launches under ncu; % dense: that"
        " rate over the dense FP8 GEMM's under the same clock control."
    )
    dense = [r for r in results if r[0].local == 0]
    dense_rate = math.nan
    if dense:
        _, facts, _, units, launches = dense[0]
        dense_rate = group_rates(launches, units, facts["flops"])["dense"][2]
    summary_rows = []
    for case, facts, _, units, launches in results:
        for group, (count, us, rate) in group_rates(launches, units, facts["flops"]).items():
            share = 100 * rate / dense_rate if dense_rate > 0 else math.nan
            use = [weighted_mean(launches, units, group, m) for m in UTILIZATION.values()]
            summary_rows.append(
                [
                    case.name,
                    facts.get("pairs", "-"),
                    group,
                    count,
                    f"{us:.1f}",
                    f"{rate:.0f}",
                    f"{share:.0f}%",
                    *(f"{u:.1f}" for u in use),
                ]
            )
    page.section("Rates")
    page.text(
        "Utilizations: each a mean over the group's launches weighted by their durations;"
        " the metrics: " + ", ".join(f"{k} `{m}`" for k, m in UTILIZATION.items()) + "."
    )
    columns = ["case", "pairs", "kernel", "launches", "us (ncu)", "TFLOP/s", "% dense"]
    page.table([*columns, *UTILIZATION], summary_rows)
    for case, facts, columns, units, launches in results:
        picked, missing = shown_columns(columns)
        page.section(case.name)
        if facts.get("pairs") is not None:
            page.text(
                f"{facts['rows']} rows, {facts['pairs']} pairs, {facts['touched']} experts touched;"
                f" {len(launches)} kernels profiled."
            )
        if missing:
            page.text("No metric matched: " + ", ".join(f"`{m}`" for m in missing) + ".")
        heads = [f"{i}: {r['Kernel Name'][:KERNEL_NAME_CHARS]}" for i, r in enumerate(launches)]
        rows = [
            [name, units.get(name, ""), *(r.get(name, "-") for r in launches)] for name in picked
        ]
        page.table(["metric", "unit", *(f"`{h}`" for h in heads)], rows)
    return page.write()


def all_cases(cases=CASES) -> list[Case]:
    """The dense GEMM, then `cases` ((local experts, T) pairs) in order."""
    return [Case(0, 0), *(Case(*c) for c in cases)]


def cases_problem(cases: list[tuple[int, int]]) -> str | None:
    """What is wrong with `cases` ((local experts, T) pairs of positive ints) as a run's list, or
    None: none at all, one twice (its second profile would overwrite the first's files, and the
    page again from them would show it twice), or local experts not dividing K3's experts."""
    if not cases:
        return "no case"
    for i, (local, tokens) in enumerate(cases):
        if (local, tokens) in cases[:i]:
            return f"case {local}:{tokens} twice"
        if K3.experts % local:
            return f"case {local}:{tokens}: local experts must divide {K3.experts}"
    return None


def run_cases(raw: Path) -> list[tuple[int, int]]:
    """The (local experts, T) cases of the profiling run in `raw`: its CASES_FILE, or CASES for
    a run that wrote none (runs before --cases). SystemExit for a file that is not a list of
    [local, T] pairs of positive ints that cases_problem accepts."""
    listed = raw / CASES_FILE
    if not listed.exists():
        return list(CASES)
    who = f"bench.profile_hopper_gemms: {listed}"
    try:
        cases = json.loads(listed.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{who}: not readable as JSON: {exc}") from None

    def positive(value) -> bool:
        return type(value) is int and value >= 1

    def pair(item) -> bool:
        return isinstance(item, list) and len(item) == 2 and all(map(positive, item))

    if not isinstance(cases, list) or not all(map(pair, cases)):
        raise SystemExit(f"{who}: expected [[local, T], ...], positive ints; got {cases!r:.200}")
    cases = [(local, tokens) for local, tokens in cases]
    problem = cases_problem(cases)
    if problem:
        raise SystemExit(f"{who}: {problem}")
    return cases


def from_raw(raw: Path, out: Path) -> Path:
    """The page again from a profiling run's folder (its CSVs, facts and run.json), no GPU."""
    header = raw / RUN_FILE
    if not header.is_file():
        raise SystemExit(f"bench.profile_hopper_gemms: {header} is missing; not a profiling run")
    try:
        run = report.Run(**json.loads(header.read_text()))
    except (ValueError, TypeError) as exc:  # not JSON (a ValueError), not the header's fields
        raise SystemExit(
            f"bench.profile_hopper_gemms: {header}: not a run's header as this module writes"
            f" it: {exc}"
        ) from None
    # The page's command: the profiling run's, then this one (the page is this one's output).
    again = f"python -m bench.profile_hopper_gemms --from-raw {raw}"
    run = dataclasses.replace(run, command=f"{run.command}; then {again}")
    results = []
    for case in all_cases(run_cases(raw)):
        table, facts = raw / f"{case.slug}.csv", raw / f"{case.slug}.json"
        if not (table.is_file() and facts.is_file()):
            raise SystemExit(f"bench.profile_hopper_gemms: {case.name}: no {table} or {facts}")
        results.append(
            (
                case,
                json.loads(facts.read_text()),
                *raw_rows(table.read_text(encoding=NCU_TEXT["encoding"])),
            )
        )
    return write_report(out, results, run)


def main() -> int:
    p = cli.parser(__doc__, page="profile_hopper_gemms.md")
    p.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    p.add_argument("--facts", type=Path, help=argparse.SUPPRESS)
    text = "ncu's CSV outputs and logs, the child's facts and the run's header go here"
    p.add_argument("--raw", type=Path, default=Path("profile_hopper_gemms_raw"), help=text)
    text = "write the page from the folder of an earlier run (--raw), running nothing"
    p.add_argument("--from-raw", type=Path, default=None, help=text)
    text = (
        "the (local experts, T) calls profiled, as LOCAL:T (the dense GEMM always comes first;"
        f" default: {' '.join(f'{local}:{tokens}' for local, tokens in CASES)})"
    )
    p.add_argument("--cases", type=cli.local_tokens, nargs="+", default=None, help=text)
    args = p.parse_args()
    if args.child:
        child(Case(*args.child), args.facts)
        return 0
    if args.from_raw is not None and args.cases is not None:
        p.error("--cases with --from-raw: the page shows the cases of the run it reads")
    cases = list(CASES) if args.cases is None else args.cases
    problem = cases_problem(cases)
    if problem:
        p.error(problem)
    if args.from_raw is not None:
        print(from_raw(args.from_raw, args.out))
        return 0
    if shutil.which("ncu") is None:
        raise SystemExit("bench.profile_hopper_gemms: no `ncu` on PATH (Nsight Compute)")
    sections = [a for s in SECTIONS for a in ("--section", s)]
    raw = args.raw
    raw.mkdir(parents=True, exist_ok=True)
    run = report.Run.this_process()
    (raw / RUN_FILE).write_text(json.dumps(dataclasses.asdict(run)))
    (raw / CASES_FILE).write_text(json.dumps(cases))
    results = []
    for case in all_cases(cases):
        facts = raw / f"{case.slug}.json"
        facts.unlink(missing_ok=True)  # a folder reused from an earlier run
        command = ["ncu", "--csv", "--page", "raw", "--profile-from-start", "off", *sections]
        command += [sys.executable, "-m", "bench.profile_hopper_gemms", "--facts", str(facts)]
        command += ["--child", str(case.local), str(case.tokens)]
        print(f"profiling {case.name}", flush=True)
        csv_path, log_path = raw / f"{case.slug}.csv", raw / f"{case.slug}.log"
        who = f"bench.profile_hopper_gemms: {case.name}"
        done = run_ncu(command, csv_path, log_path, NCU_TIMEOUT_S, who, facts)
        columns, units, launches = raw_rows(done.stdout)
        results.append((case, json.loads(facts.read_text()), columns, units, launches))
        write_report(args.out, results, run)  # the cases so far, should a later one fail
    return 0


if __name__ == "__main__":
    sys.exit(main())
