"""The repository's root and the launchers (torchrun, mpiexec) of the test environment, for the
tests that start whole jobs."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launcher(name: str) -> str:
    """The path of `name` beside this Python, else on PATH; fails the test when neither has it."""
    path = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: install the test extras (pip install -e '.[test]')")
    return path
