"""What bounds the combine kernel at EP=1: Nsight Compute's sections (speed of light, memory,
occupancy, launch, warp states) of one combine launch per T, K3 geometry, one GPU.

    python -m bench.profile_combine   # runs ncu on itself; docs/results/profile_combine.md

The module starts `ncu` (Nsight Compute, on PATH) on a child run of itself. The child builds an
EpRouted (EP=1, every expert local), fills the expert output rows, and per T runs three eager
dispatch + combine pairs, then one more between cudaProfilerStart and cudaProfilerStop: ncu
profiles that pair's combine alone (`--profile-from-start off`, kernels whose name holds
CombineKernel), replaying it once per section with its memory restored. The page lists every
metric ncu reports for those sections, one column per T. ncu serializes and replays the kernel:
its duration is the kernel's alone, without the overlap programmatic dependent launch gives in a
real step (bench_ep times that).
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys
from pathlib import Path

import torch

from bench import cli, report
from bench.profile_hopper_gemms import NCU_TEXT
from dep_ep.config import DEFAULT_NORM_EPS
from dep_ep.ep import K3, EpRouted
from dep_ep.launch import init_rank_context, new_dep_group, teardown
from dep_ep.testing import internals

TOKENS = [1, 256, 4096]
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats")
KERNEL = "regex:CombineKernel"
WARM_PAIRS = 3


def child(tokens: list[int]) -> None:
    """The profiled program: warm pairs, then one pair inside the profiler's range, per T."""
    ctx = init_rank_context("cuda")
    dep = new_dep_group(ctx, 1)
    routed = EpRouted(
        dep.cpu_group,
        max(tokens),
        "cuda",
        num_experts=K3.experts,
        latent=K3.latent,
        topk=K3.topk,
    )
    transport = internals.transport(routed)
    norm = torch.ones(K3.latent, dtype=torch.bfloat16, device="cuda")
    cudart = torch.cuda.cudart()
    for t in tokens:
        latent = torch.randn(t, K3.latent, device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(K3.experts, device="cuda")[: K3.topk] for _ in range(t)])
        ids = ids.int()
        weights = torch.rand(t, K3.topk, device="cuda")
        out = routed.receive(t).out
        out.copy_(torch.randn(out.shape, device="cuda").to(torch.bfloat16))

        def pair():
            transport.dispatch(latent, ids, weights, tokens=t, rejected=None)
            transport.combine(ids, norm, DEFAULT_NORM_EPS, rejected=None)

        for _ in range(WARM_PAIRS):
            pair()
        routed.synchronize()
        cudart.cudaProfilerStart()
        pair()
        routed.synchronize()
        cudart.cudaProfilerStop()
    routed.close()
    teardown(ctx)


def metrics(text: str) -> tuple[list[tuple[str, str, str]], dict[tuple[str, str], list[str]]]:
    """ncu's `--csv --page details` output -> (the (section, metric, unit) keys in order, the
    values of each key, one per profiled launch in launch order). Rows without a metric name
    (the sections' rule results) are left out."""
    start = text.find('"ID"')
    if start < 0:
        raise SystemExit(f"bench.profile_combine: no ncu table in its output:\n{text[-2000:]}")
    keys: list[tuple[str, str, str]] = []
    by_launch: dict[tuple[str, str], dict[str, str]] = {}
    launches: list[str] = []
    for row in csv.DictReader(io.StringIO(text[start:])):
        if not row.get("Metric Name"):
            continue
        key, launch = (row["Section Name"], row["Metric Name"]), row["ID"]
        if launch not in launches:
            launches.append(launch)
        if key not in by_launch:
            keys.append((*key, row["Metric Unit"]))
            by_launch[key] = {}
        by_launch[key].setdefault(launch, row["Metric Value"])
    values = {k: [seen.get(launch, "-") for launch in launches] for k, seen in by_launch.items()}
    return keys, values


def main() -> int:
    p = cli.parser(__doc__, page="profile_combine.md", tokens=TOKENS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--raw", type=Path, default=None, help="also keep ncu's CSV output here")
    args = p.parse_args()
    if args.child:
        child(args.tokens)
        return 0
    sections = [a for s in SECTIONS for a in ("--section", s)]
    command = ["ncu", "--csv", "--page", "details", "--profile-from-start", "off", *sections]
    command += ["--kernel-name", KERNEL, sys.executable, "-m", "bench.profile_combine", "--child"]
    command += ["--tokens", *map(str, args.tokens)]
    done = subprocess.run(command, capture_output=True, timeout=1200, **NCU_TEXT)
    if done.returncode != 0:
        raise SystemExit(f"bench.profile_combine: ncu failed:\n{done.stdout[-2000:]}{done.stderr}")
    if args.raw is not None:
        args.raw.write_text(done.stdout, encoding=NCU_TEXT["encoding"])
    keys, values = metrics(done.stdout)
    write_report(args.out, args.tokens, keys, values)
    return 0


def write_report(out, tokens, keys, values, run: report.Run | None = None):
    """OUTDIR/profile_combine.md: one row per metric, one column per T."""
    run = run or report.Run.this_process()
    title = "The combine kernel under Nsight Compute (EP=1, one GPU)"
    page = report.Page(out / "profile_combine.md", title, report.summary(__doc__), run)
    page.text(
        f"K3 geometry (L {K3.latent}, K {K3.topk}, E {K3.experts}), every expert local; one"
        " combine launch per T after three warm pairs; ncu sections: " + ", ".join(SECTIONS) + "."
    )
    rows = []
    for section, name, unit in keys:
        cells = values[(section, name)]
        if len(cells) != len(tokens):
            raise SystemExit(
                f"bench.profile_combine: {len(cells)} launches profiled for {name}; expected one"
                f" per T ({len(tokens)})"
            )
        rows.append([section, name, unit, *cells])
    page.table(["section", "metric", "unit", *(f"T = {t}" for t in tokens)], rows)
    return page.write()


if __name__ == "__main__":
    sys.exit(main())
