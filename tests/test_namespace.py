"""The one import package, dep_ep: its subpackages import one way, nothing imports the folders
as top-level packages, nothing edits sys.path, a top-level `comm` of another project (Jupyter's)
does not get in the way, the README's example runs as written, and the wheel holds dep_ep alone."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from helpers.source_files import SKIP_DIRS, python_files

ROOT = Path(__file__).resolve().parents[1]
# Folder -> the dep_ep subpackage it is installed as (pyproject.toml, package-dir).
SUBPACKAGES = {
    "launch": "launch",
    "comm": "comm",
    "experts": "experts",
    "ep": "ep",
    "testing": "testing",
    "integrations": "integrations",
}
LEAVES = {"constants", "config", "checks", "cuda_graphs", "version"}
# What each part may import of dep_ep: the leaf modules, and the subpackages before it.
ALLOWED = {
    "leaf": {"leaf"},
    "launch": {"leaf", "launch"},
    "comm": {"leaf", "launch", "comm"},
    "experts": {"leaf", "launch", "comm", "experts"},
    "ep": {"leaf", "launch", "comm", "experts", "ep"},
    # The engines' adapters come after ep: nothing of the library imports them.
    "integrations": {"leaf", "launch", "comm", "experts", "ep", "integrations"},
    # The yardsticks: they may read anything; nothing of the library proper imports them.
    "testing": {"leaf", "launch", "comm", "experts", "ep", "testing"},
}


def imported_modules(path: Path, package: str | None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth (lazy imports
    too). `from X import a, b` yields X.a and X.b; relative imports resolve against `package`
    (None: they are left out)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if package is None:
                    continue
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def part_of(module: str) -> str | None:
    """The part of dep_ep a module name belongs to ("leaf", a subpackage, "dep_ep" for the
    package itself), or None outside dep_ep."""
    parts = module.split(".")
    if parts[0] != "dep_ep":
        return None
    if len(parts) == 1 or parts[1] == "*":
        return "dep_ep"
    if parts[1] in LEAVES:
        return "leaf"
    if parts[1] in SUBPACKAGES.values():
        return parts[1]
    return "dep_ep"  # a name the package's __init__ re-exports: importing it runs all of dep_ep


def package_modules():
    """(path, part, package name) of every module of dep_ep."""
    for folder, sub in SUBPACKAGES.items():
        for path in python_files(ROOT / folder):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            inner = [p for p in rel.parts if p != "__init__"]
            package = ".".join(["dep_ep", sub, *inner[: len(inner) - (path.name != "__init__.py")]])
            yield path, sub, package
    for path in python_files(ROOT / "dep_ep"):
        if path.parent == ROOT / "dep_ep" and path.stem in LEAVES:
            yield path, "leaf", "dep_ep"


def test_subpackages_import_one_way():
    modules = list(package_modules())
    assert len(modules) > 30, f"only {len(modules)} modules found under {ROOT}"
    bad = []
    for path, part, package in modules:
        for line, name in imported_modules(path, package):
            target = part_of(name)
            if target is not None and target not in ALLOWED[part]:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({part}) imports {name}")
    direction = "leaf <- launch <- comm <- experts <- ep, none of them from testing"
    assert not bad, f"imports against the direction {direction}:\n" + "\n".join(bad)


def test_import_direction_check_sees_a_violation(tmp_path):
    """The check above reads lazy and relative imports (so it can fail)."""
    (tmp_path / "m.py").write_text("def f():\n    from ..ep import routed\n    import dep_ep\n")
    names = imported_modules(tmp_path / "m.py", "dep_ep.comm")
    assert names == [(2, "dep_ep.ep.routed"), (3, "dep_ep")]
    assert part_of(names[0][1]) not in ALLOWED["comm"] and part_of(names[1][1]) == "dep_ep"


def test_nothing_imports_the_folders_as_top_level_packages():
    bad = []
    for path in python_files(ROOT):
        for line, name in imported_modules(path, None):
            if name.split(".")[0] in SUBPACKAGES:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "use dep_ep.<subpackage>:\n" + "\n".join(bad)


def test_no_sys_path_edits():
    pattern = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*(\+=|=[^=])")
    bad = []
    for path in python_files(ROOT):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not bad, "the package is installed (pip install -e .): no sys.path edits\n" + (
        "\n".join(bad)
    )


def run(cmd: list[str], cwd: Path, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, (
        f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n" + (proc.stderr[-3000:])
    )
    return proc


def test_jupyter_comm_beside_dep_ep(tmp_path):
    """Jupyter's `comm` (installed by tests/run_all.sh) is the top-level `comm` outside the
    repository, and the example runs on 2 ranks with it installed."""
    probe = "import comm; print(comm.__file__); assert hasattr(comm, 'create_comm'), comm.__file__"
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, (
        "Jupyter's comm is not importable (python -m pip install comm; tests/run_all.sh does):"
        f" {proc.stderr[-1500:]}"
    )
    # The installed package, not the checkout's comm/ folder (a venv may live inside the checkout).
    assert not Path(proc.stdout.strip()).is_relative_to(ROOT / "comm"), proc.stdout
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        str(ROOT / "examples" / "dep_layer.py"),
        "--steps",
        "2",
    ]
    out = run(cmd, tmp_path, 300).stdout
    assert "0 of 2 steps failed" in out, out[-3000:]


def readme_use_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Use\n", 1)
    assert len(section) == 2, "README.md has no '## Use' section"
    block = re.search(r"^```python\n(.*?)^```", section[1], re.S | re.M)
    assert block, "README.md's '## Use' section has no ```python block"
    return block.group(1)


def test_readme_use_block_runs_as_written(tmp_path):
    (tmp_path / "use.py").write_text(readme_use_block())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "use.py"]
    out = run(cmd, tmp_path, 300).stdout
    # Not anchored to lines: the two ranks share the pipe and may interleave a line and its end.
    ranks = re.findall(r"rank (\d+): normed \(\d+, \d+\) torch\.bfloat16", out)
    assert sorted(ranks) == ["0", "1"], out[-3000:]


def test_wheel_holds_dep_ep_alone(tmp_path):
    """Build the wheel from a copy of the sources (so no build output lands in the checkout),
    list it, install it into a folder of its own and import every subpackage from there."""
    import shutil

    source, wheels, target = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    shutil.copytree(
        ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*SKIP_DIRS, "*.egg-info")
    )
    pip = [sys.executable, "-m", "pip"]
    run([*pip, "wheel", "-q", "--no-deps", "-w", str(wheels), str(source)], tmp_path, 240)
    (wheel,) = wheels.glob("dep_ep-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] + "/" for name in names}
    assert {t for t in tops if not t.endswith(".dist-info/")} == {"dep_ep/"}, sorted(tops)
    assert len(tops) == 2, sorted(tops)
    for required in (
        "dep_ep/comm/kernels/combine.py",
        "dep_ep/ep/routed.py",
        "dep_ep/constants.py",
        "dep_ep/launch/env.py",
        "dep_ep/experts/reference/reference_experts.py",
    ):
        assert required in names, f"{wheel.name} lacks {required}"
    run([*pip, "install", "-q", "--no-deps", "--target", str(target), str(wheel)], tmp_path, 120)
    probe = (
        "import dep_ep, dep_ep.comm, dep_ep.experts, dep_ep.ep, dep_ep.launch;"
        " print(dep_ep.__file__); print(dep_ep.comm.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = run([sys.executable, "-c", probe], wheels, 120, env=env).stdout.split()
    assert len(out) == 2 and all(Path(f).is_relative_to(target) for f in out), out
