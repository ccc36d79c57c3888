"""The repository's Python files, for the tests that read sources (import directions, the
captures that must hold the garbage collector)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SKIP_DIRS = {
    ".git",
    ".venv",
    "venv",
    "build",
    "dist",
    "__pycache__",
    ".pytest_cache",
    ".stage",
    ".engines",
}


def python_files(top: Path) -> list[Path]:
    """Every .py file of the repository under `top`: git's tracked and untracked files less the
    ignored ones in a checkout, else every file below `top` (links not followed) outside build
    and environment folders."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "*.py"],
        cwd=top,
        capture_output=True,
        text=True,
    )
    if listing.returncode == 0:
        names = set(listing.stdout.split("\0")) - {""}
        return sorted(top / name for name in names if (top / name).is_file())  # not deleted
    found = []
    for folder, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        found += [Path(folder, name) for name in files if name.endswith(".py")]
    return sorted(found)
