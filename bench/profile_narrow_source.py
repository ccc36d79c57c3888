"""Where one narrow GEMM form's warps wait, instruction by instruction: Nsight Compute's source
counters (warp states sampled at each SASS instruction) of the form's FC1 at one row of
bench_narrow_gemm, with the instructions that hold the most samples and the reasons they wait.

    python -m bench.profile_narrow_source --form "specialized, tiles of 8, ring 4x2, 2 slots"

The module starts `ncu` (Nsight Compute, on PATH) on profile_narrow_gemm's child, which builds
the row's calls as bench_narrow_gemm does and runs them inside the profiler's range; ncu profiles
the first launch of the narrow kernel there (the form's FC1; humming's kernels and FC2 are not
profiled) with its SourceCounters and WarpStateStats sections and `--clock-control none`, keeps
the report, and exports its source page (SASS) as CSV, from which the page is written. A sample
is one warp's state at one instant, so an instruction's share of the samples is the share of the
kernel's resident warp time spent at it (issuing or stalled there).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench import cli, report
from bench.bench_narrow_gemm import EVERY_FORM
from bench.profile_hopper_gemms import K3_EXPERTS_GEOMETRY, NCU_TEXT, RUN_FILE, run_ncu
from dep_ep.ep import K3

FORM = "specialized, tiles of 8, ring 4x2, 2 slots"
ROW = (56, 16)
TOP = 25
NCU_TIMEOUT_S = 900
WHO = "bench.profile_narrow_source"  # the start of its messages
KERNEL_FILTER = "regex:NarrowGemmKernel"
SECTIONS = ("SourceCounters", "WarpStateStats")
# The source page's columns this page reads (ncu 2025's names).
ADDRESS, SOURCE = "Address", "Source"
SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
# A sampled warp state's column: "stall_<reason>"; "(Not Issued)" columns repeat them for the
# samples where no instruction issued, and are not read.
STATE_PREFIX = "stall_"
NOT_ISSUED = "(Not Issued)"
TOP_REASONS = 3


def source_rows(text: str) -> tuple[str, list[str], list[dict[str, str | int]]]:
    """ncu's `--page source --csv --print-source sass` output -> (the kernel's name, the
    columns, one dict a SASS instruction in address order, its SAMPLES, EXECUTED and warp
    states' cells read as counts once here). The table starts at the line whose
    first cell is ADDRESS; the kernel's name is the cell after "Kernel Name" on the line before
    it. SystemExit (starting with WHO) for text without such a table, without an instruction,
    without SAMPLES, SOURCE and EXECUTED or with one of them twice, or with a row of another
    width than the header (a row dropped would shift every instruction after it)."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith(f'"{ADDRESS}"')), None)
    if start is None:
        raise SystemExit(f"{WHO}: no ncu source table in:\n{text[-2000:]}")
    kernel = "?"
    if start > 0:
        before = next(csv.reader([lines[start - 1]]), [])
        if len(before) > 1 and before[0] == "Kernel Name":
            kernel = before[1]
    reader = csv.reader(io.StringIO("".join(lines[start:])))
    columns = next(reader)
    missing = [c for c in (SOURCE, SAMPLES, EXECUTED) if c not in columns]
    if missing:
        raise SystemExit(f"{WHO}: the source table has no {missing} column")
    doubled = [c for c in (SOURCE, SAMPLES, EXECUTED) if columns.count(c) > 1]
    if doubled:
        raise SystemExit(f"{WHO}: the source table has the {doubled} column more than once")
    counted = (SAMPLES, EXECUTED, *state_columns(columns))
    rows = []
    for number, cells in enumerate(reader, start=start + 2):
        if len(cells) != len(columns):
            raise SystemExit(
                f"{WHO}: line {number} of the source table has {len(cells)} cells, the header"
                f" {len(columns)}"
            )
        row: dict[str, str | int] = dict(zip(columns, cells))
        for column in counted:
            row[column] = count(row[column])  # SystemExit naming a cell that is not a count
        rows.append(row)
    if not rows:
        raise SystemExit(f"{WHO}: the source table holds no instruction")
    return kernel, columns, rows


def count(cell: str) -> int:
    """A sample or execution count ("1,234"; "" and "-": 0). SystemExit for anything else than
    a count of 0 or more."""
    text = cell.replace(",", "").strip()
    if text in ("", "-"):
        return 0
    if not text.isdigit():
        raise SystemExit(f"{WHO}: {cell!r} in the source table is not a count")
    return int(text)


def state_columns(columns: list[str]) -> list[str]:
    """The sampled warp states' columns (STATE_PREFIX, not the NOT_ISSUED repeats)."""
    return [c for c in columns if c.startswith(STATE_PREFIX) and NOT_ISSUED not in c]


def states_total(columns: list[str], rows: list[dict[str, str | int]]) -> list[tuple[str, int]]:
    """Every warp state's samples over the kernel, largest first: (state, samples); `rows` as
    source_rows returns them."""
    totals = [(c[len(STATE_PREFIX) :], sum(r[c] for r in rows)) for c in state_columns(columns)]
    return sorted(totals, key=lambda item: -item[1])


def top_instructions(
    columns: list[str], rows: list[dict[str, str | int]], top: int
) -> list[list[str]]:
    """The `top` instructions with the most samples: [index in address order, SASS, the SASS
    before it, times a warp executed it, share of all samples, its TOP_REASONS largest
    states]."""
    states = state_columns(columns)
    total = sum(r[SAMPLES] for r in rows) or 1
    ranked = sorted(range(len(rows)), key=lambda i: -rows[i][SAMPLES])[:top]
    lines = []
    for i in ranked:
        row = rows[i]
        reasons = sorted(((row[c], c[len(STATE_PREFIX) :]) for c in states), reverse=True)
        shown = ", ".join(f"{name} {n}" for n, name in reasons[:TOP_REASONS] if n)
        sass = " ".join(row[SOURCE].split()).replace("|", "\\|")
        share = 100 * row[SAMPLES] / total
        before = " ".join(rows[i - 1][SOURCE].split()).replace("|", "\\|") if i else ""
        lines.append(
            [
                str(i),
                f"`{sass}`",
                f"`{before}`" if before else "-",
                f"{row[EXECUTED]:,}",
                f"{share:.1f}%",
                shown,
            ]
        )
    return lines


def write_report(
    out: Path, facts: dict, form: str, text: str, run: report.Run, top: int = TOP
) -> Path:
    """OUTDIR/profile_narrow_source.md from the source page's CSV `text` and the child's facts
    (its one row)."""
    kernel, columns, rows = source_rows(text)
    samples = sum(r[SAMPLES] for r in rows)
    if not samples:
        raise SystemExit(f"{WHO}: the source table holds no sample (no warp was sampled)")
    title = "Where the narrow GEMM's warps wait, under Nsight Compute's source counters"
    page = report.Page(out / "profile_narrow_source.md", title, report.summary(__doc__), run)
    page.text(
        f"{K3_EXPERTS_GEOMETRY}; uniform routing; {facts['local']} local experts,"
        f" T = {facts['tokens']}: {facts['rows']} rows,"
        f" {facts['pairs']} pairs, {facts['touched']} experts touched. Form: `{form}`, FC1"
        f" ({facts['fc1_bytes'] / 1e6:.1f} MB of weights). Kernel: `{kernel[:120]}`."
    )
    page.section("Warp states over the kernel")
    page.text(
        f"{samples:,} samples over {len(rows)} SASS instructions; each state's share of them"
        ' ("selected": the warp issued).'
    )
    totals = states_total(columns, rows)
    page.table(
        ["state", "samples", "share"],
        [[name, f"{n:,}", f"{100 * n / (samples or 1):.1f}%"] for name, n in totals if n],
    )
    page.section(f"The {min(top, len(rows))} instructions with the most samples")
    page.text(
        "index: the instruction's position in the kernel's SASS (address order); after: the"
        " instruction before it; executed: times a warp executed it; states: its largest sampled"
        " states. A branch after a wait (an mbarrier's `SYNCS.PHASECHK`, a `BAR.SYNC`) holds the"
        " samples of that wait."
    )
    page.table(
        ["index", "SASS", "after", "executed", "share", "states"],
        top_instructions(columns, rows, top),
    )
    return page.write()


def load_raw(raw: Path) -> tuple[report.Run, dict, str, str]:
    """A profiling run's folder -> (its run.json, the child's one row of facts.json, form.txt,
    source.csv's text). SystemExit naming the folder for a file missing or malformed."""
    paths = [raw / RUN_FILE, raw / "facts.json", raw / "form.txt", raw / "source.csv"]
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"{WHO}: {path} is missing; not a profiling run")
    header, facts, form, table = paths
    try:
        run = report.Run(**json.loads(header.read_text()))
        (row,) = json.loads(facts.read_text())
        for key in ("local", "tokens", "rows", "pairs", "touched"):
            if type(row[key]) is not int or row[key] < 0:
                raise ValueError(f"{key} {row[key]!r}; expected a count")
        if type(row["fc1_bytes"]) not in (int, float) or not 0 < row["fc1_bytes"] < float("inf"):
            raise ValueError(f"fc1_bytes {row['fc1_bytes']!r}; expected a positive number")
        name = form.read_text().strip()
        if name not in EVERY_FORM:
            raise ValueError(f"form {name[:80]!r}; not one of bench_narrow_gemm's forms")
        text = table.read_text(encoding=NCU_TEXT["encoding"])
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        # json's and the decoder's errors are ValueErrors.
        raise SystemExit(
            f"{WHO}: {raw} does not hold a profiling run's files as this module writes them:"
            f" {exc!r}"
        ) from None
    return run, row, name, text


def from_raw(raw: Path, out: Path, top: int = TOP) -> Path:
    """The page again from a profiling run's folder (load_raw's files), no GPU."""
    run, row, form, text = load_raw(raw)
    again = f"python -m {WHO} --from-raw {raw}"
    run = dataclasses.replace(run, command=f"{run.command}; then {again}")
    return write_report(out, row, form, text, run, top)


def writable(folder: Path) -> None:
    """Make `folder` (and its parents); SystemExit when it cannot be, cannot be written to, or
    holds a folder where the page goes."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"{WHO}: cannot write to {folder}: {exc}") from None
    if not os.access(folder, os.W_OK) or (folder / "profile_narrow_source.md").is_dir():
        raise SystemExit(f"{WHO}: cannot write to {folder}")


def main() -> int:
    p = cli.parser(__doc__, page="profile_narrow_source.md")
    text = "the (local experts, T) row as LOCAL:T"
    p.add_argument("--row", type=cli.local_tokens, default=ROW, help=text)
    text = "the narrow GEMM's form (one of bench_narrow_gemm's names)"
    p.add_argument("--form", choices=list(EVERY_FORM), default=FORM, metavar="FORM", help=text)
    p.add_argument("--top", type=int, default=TOP, help="instructions listed")
    text = "ncu's report, its source page's CSV and log, the child's facts and the run's header"
    p.add_argument("--raw", type=Path, default=Path("profile_narrow_source_raw"), help=text)
    text = "write the page from the folder of an earlier run (--raw), running nothing"
    p.add_argument("--from-raw", type=Path, default=None, help=text)
    args = p.parse_args()
    local, tokens = args.row
    if K3.experts % local:
        p.error(f"row {local}:{tokens}: local experts must divide {K3.experts}")
    if args.top < 1:
        p.error(f"--top {args.top}: at least 1")
    if args.from_raw is not None:
        writable(args.out)
        print(from_raw(args.from_raw, args.out, args.top))
        return 0
    if shutil.which("ncu") is None:
        raise SystemExit(f"{WHO}: no `ncu` on PATH (Nsight Compute)")
    for folder in (args.out, args.raw):
        writable(folder)
    raw = args.raw
    run = report.Run.this_process()
    (raw / RUN_FILE).write_text(json.dumps(dataclasses.asdict(run)))
    (raw / "form.txt").write_text(args.form + "\n")
    facts = raw / "facts.json"
    rep = raw / "source.ncu-rep"
    for stale in (facts, rep, raw / "source.csv"):
        stale.unlink(missing_ok=True)  # a folder reused from an earlier run
    command = ["ncu", "--profile-from-start", "off", "--clock-control", "none"]
    command += [a for s in SECTIONS for a in ("--section", s)]
    command += ["--import-source", "no", "-k", KERNEL_FILTER, "--launch-count", "1"]
    command += ["--export", str(rep), "-f"]
    command += [sys.executable, "-m", "bench.profile_narrow_gemm", "--child", "--facts"]
    command += [str(facts), "--rows", f"{local}:{tokens}", "--forms", args.form]
    print(f"profiling {args.form!r} at {local}:{tokens} under ncu", flush=True)
    run_ncu(command, raw / "ncu.out", raw / "ncu.log", NCU_TIMEOUT_S, WHO, facts)
    page = ["ncu", "--import", str(rep), "--page", "source", "--csv", "--print-source", "sass"]
    if not rep.is_file():
        raise SystemExit(f"{WHO}: ncu wrote no report (no NarrowGemmKernel launch profiled?)")
    try:
        done = subprocess.run(page, capture_output=True, timeout=NCU_TIMEOUT_S, **NCU_TEXT)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{WHO}: ncu --import ran past {NCU_TIMEOUT_S} s") from None
    (raw / "source.csv").write_text(done.stdout, encoding=NCU_TEXT["encoding"])
    if done.returncode != 0:
        raise SystemExit(f"{WHO}: ncu --import failed (exit {done.returncode}): {done.stderr}")
    run, row, form, text = load_raw(raw)
    print(write_report(args.out, row, form, text, run, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
