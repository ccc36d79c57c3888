"""Whole processes: the example under torchrun on 2-4 ranks; a rank that skips a dispatch."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers.launchers import ROOT, launcher

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_example_passes_its_check(ranks):
    cmd = [
        launcher("torchrun"),
        "--nproc-per-node",
        str(ranks),
        "examples/dep_layer.py",
        "--steps",
        "3",
        "--tokens",
        "9",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 of 3 steps failed" in proc.stdout, proc.stdout[-3000:]
    assert len(re.findall(r"  ok$", proc.stdout, re.M)) == 3


def test_skipped_dispatch_times_out_naming_rank_phase_peer():
    cmd = [launcher("mpiexec"), "-n", "2", sys.executable, "-m", "helpers.timeout_case_cpu"]
    proc = subprocess.run(cmd, cwd=TESTS, capture_output=True, text=True, timeout=120)
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    assert len(lines) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RESULT rank 0: EpTimeoutError" in lines[0]
    assert "timed out in phase 'dispatch' waiting for rank(s) 1" in lines[0]
    took = float(re.search(r"after ([\d.]+)s", lines[0]).group(1))
    assert 2.5 < took < 10, f"rank 0 waited {took}s with a 3 s timeout"
    # Rank 1's late dispatch finds that rank 0 gave the barrier up: it gives the call up too.
    assert "RESULT rank 1: EpPeerTimeoutError" in lines[1], lines[1]
    assert "rank 0 timed out waiting for rank(s) 1 (this rank, late)" in lines[1], lines[1]
