"""Hopper trial of FlashInfer's SM90 `cutlass_fused_moe` (BF16 activations x MXFP4 weights, SiTU):
can its JIT module be built within the device machine's limits, and how long would it take?

    python -m bench.try_cutlass_sm90 --deadline 360 --out cutlass_sm90_build.json

Generates the module's sources with FlashInfer's own JIT spec (`gen_cutlass_fused_moe_sm90_module`),
writes its ninja file, runs ninja with every CPU for at most `--deadline` seconds, then reads
ninja's log: objects finished, their compile times, and the build time they extrapolate to. A
finished build is loaded to prove it links; the kernel itself is not called by this script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path


def object_targets(ninja_file: Path) -> list[str]:
    """Object files the ninja file builds (one per source)."""
    return re.findall(r"^build (\S+\.o):", ninja_file.read_text(), flags=re.M)


def finished_objects(build_dir: Path) -> dict[str, float]:
    """target -> compile seconds, from .ninja_log (format v5: start end mtime target hash)."""
    log = build_dir / ".ninja_log"
    done = {}
    if log.exists():
        for line in log.read_text().splitlines()[1:]:
            start, end, _, target, _ = line.split("\t")
            if target.endswith(".o"):
                done[target] = (int(end) - int(start)) / 1e3
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deadline", type=float, default=360.0, help="seconds ninja may run")
    p.add_argument("--out", default="cutlass_sm90_build.json")
    args = p.parse_args()
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    report: dict = {"cpus": os.cpu_count(), "deadline_s": args.deadline}
    t0 = time.time()
    spec = gen_cutlass_fused_moe_sm90_module()
    report["generate_s"] = round(time.time() - t0, 1)
    sources = [Path(s) for s in spec.sources]
    report["sources"] = len(sources)
    report["generated_sources"] = sum("generated" in s.name for s in sources)
    report["source_mb"] = round(sum(s.stat().st_size for s in sources) / 1e6, 2)
    spec.write_ninja()
    targets = object_targets(spec.ninja_path)
    report["objects"] = len(targets)
    command = ["ninja", "-C", str(spec.build_dir), "-f", str(spec.ninja_path),
               "-j", str(os.cpu_count())]  # fmt: skip
    print(f"building {len(targets)} objects with {os.cpu_count()} jobs for at most"
          f" {args.deadline:.0f} s", flush=True)  # fmt: skip
    t0 = time.time()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.deadline)
        report["ninja_rc"] = result.returncode
        report["ninja_tail"] = (result.stdout + result.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        report["ninja_rc"] = "timeout"
    report["build_wall_s"] = round(time.time() - t0, 1)
    done = finished_objects(spec.build_dir)
    report["objects_finished"] = len(done)
    if done:
        seconds = sorted(done.values())
        report["object_compile_s"] = {
            "median": round(statistics.median(seconds), 1),
            "max": round(seconds[-1], 1),
            "sum": round(sum(seconds), 1),
        }
        # Objects still compiling when ninja was stopped do not appear in the log, so this is a
        # lower bound: total CPU-seconds / CPUs, assuming the unfinished ones cost the median.
        remaining = len(targets) - len(done)
        cpu_s = sum(seconds) + remaining * statistics.median(seconds)
        report["extrapolated_build_s"] = round(cpu_s / os.cpu_count(), 0)
    if report["ninja_rc"] == 0:
        t0 = time.time()
        spec.load(spec.jit_library_path)
        report["load_s"] = round(time.time() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "ninja_tail"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
