"""Running a helper module under Triton's CPU interpreter, in its own process (the interpreter is
chosen by TRITON_INTERPRET before triton is imported)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
HAVE_TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON = "triton is not installed (pip install -e '.[test]')"


def run_in_interpreter(module: str, *args: str, expect: str) -> None:
    """Run tests/<module> under TRITON_INTERPRET=1 in its own process; it must exit 0 and print
    a line starting with `expect`."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    where = f"{module} {' '.join(args)}"
    assert run.returncode == 0, f"{where}:\n{run.stdout}\n{run.stderr[-3000:]}"
    assert run.stdout.startswith(expect), f"{where}: {run.stdout}"
