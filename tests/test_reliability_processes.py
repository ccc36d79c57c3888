"""Whole processes: construction with a rank that never arrives is bounded by timeout_s, and so
is MPI's start-up in init_rank_context when a rank of the job exits before it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

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
    # No object exists to reset: both say to build again (before: "call reset() on every rank").
    late = lines[missing]
    assert f"RESULT rank {missing}: late, EpPeerTimeoutError" in late, late
    assert float(re.search(r"after ([\d.]+)s", late).group(1)) < 1.0, late
    # The late rank: its peer counted the construction, so it builds again at once.
    assert "build it again on every rank" in waiting, waiting
    assert "on this rank at once" in late, late
    for line in (waiting, late):
        assert "recovery rebuild" in line and "reset()" not in line, line


def test_mpi_start_up_without_a_rank_ends_after_timeout_s():
    """Rank 1 of an mpiexec job exits (code 2) before it starts MPI, as a server whose arguments
    one rank refuses does: rank 0's init_rank_context(timeout_s=2) writes its traceback, naming
    `_mpi_start_up_waits_for_every_rank`, to stderr and exits (the job ends well within the
    subprocess's 60 s; a child takes about 4 s to import the package on a loaded 2-core CI).
    Before: rank 0 waited in MPI_Init (`from mpi4py import MPI`) with no limit; MPICH's mpiexec
    does not end the job when a rank exits with an error."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    waiting = "from dep_ep.launch import init_rank_context; init_rank_context('cpu', timeout_s=2)"
    cmd = [mpiexec, "-n", "1", sys.executable, "-c", waiting]
    cmd += [":", "-n", "1", sys.executable, "-c", "import sys; sys.exit(2)"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=TESTS, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    said = proc.stdout + proc.stderr
    assert "Timeout (0:00:02)!" in said, said[-3000:]
    assert "_mpi_start_up_waits_for_every_rank" in said, said[-3000:]
    assert proc.returncode != 0 and took < 40.0, (proc.returncode, took, said[-3000:])
