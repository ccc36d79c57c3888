"""Whole processes: construction with a rank that never arrives is bounded by timeout_s."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 2.0  # helpers/missing_rank_case.py


@pytest.mark.parametrize("missing", [0, 1])
def test_construction_with_a_missing_rank_times_out(missing):
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "helpers.missing_rank_case", str(missing)]
    proc = subprocess.run(cmd, cwd=TESTS, capture_output=True, text=True, timeout=120)
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    assert len(lines) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    waiting = lines[1 - missing]
    assert f"RESULT rank {1 - missing}: EpTimeoutError" in waiting, waiting
    assert "phase 'construction'" in waiting and str(missing) in waiting.split("waiting for")[1]
    took = float(re.search(r"after ([\d.]+)s", waiting).group(1))
    assert took <= TIMEOUT_S + 1.0, f"the construction waited {took}s with timeout_s={TIMEOUT_S}"
