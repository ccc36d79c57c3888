"""Run without mpirun (it launches its own ranks): python -m pytest tests/gpu/test_gpu_timeout.py"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_skipped_dispatch_times_out_then_rebuild_works():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "tests/gpu/timeout_case.py"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    assert len(lines) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RESULT rank 0: EpTimeoutError" in lines[0], lines
    assert "rank 0: timed out in phase 'dispatch' waiting for rank 1" in lines[0], lines
    took = float(re.search(r"after ([\d.]+)s", lines[0]).group(1))
    assert 1.5 < took < 10, f"rank 0 waited {took}s with a 2 s timeout"
    assert lines[0].endswith("rebuilt: ok") and lines[1].endswith("rebuilt: ok"), lines
