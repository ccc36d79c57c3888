"""The benchmarks' results pages (docs/results/): the header every page starts with, markdown
tables and plots, written by `Page`.

The header says what the page is for, the exact command that produced it (launcher, module,
arguments), the hardware and software versions it ran on, and the date; the pages are generated,
so a changed page comes from rerunning that command. Plots need matplotlib (in the test extra,
not a dependency of the library): without it the page says its plot is missing (its numbers
are all in its tables).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dep_ep.launch import read_launch_env
from dep_ep.version import __version__

# Distributions a header names where installed (Python, torch and dep-ep always): the kernels'
# compilers and the libraries some benchmarks time.
SOFTWARE = (
    "triton",
    "nvidia-cutlass-dsl",
    "cuda-python",
    "nvshmem4py-cu13",
    "humming-kernels",
    "flashinfer-python",
)
# The launchers' names in a command, by dep_ep.launch.read_launch_env's launcher.
MPI_LAUNCHERS = {"openmpi": "mpirun", "mpich": "mpiexec"}
PLOT_DPI = 110
PANEL_SIZE = (5.5, 4.2)  # inches per panel: width, height


def summary(doc: str) -> str:
    """The first paragraph of a docstring on one line (a benchmark's "what this page is for")."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def words(items: Sequence[str]) -> str:
    """items in a sentence: "a", "a and b", "a, b and c" ("" for none)."""
    items = list(items)
    return " and ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + " and " + items[-1]


def main_module() -> str | None:
    """The module this process runs as `python -m`, e.g. "bench.bench_dep" (None: a file)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name.removesuffix(".__main__") if spec is not None and spec.name else None


def command_line(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    module: str | None = None,
) -> str:
    """The command that started this process, as a shell would take it: CUDA_VISIBLE_DEVICES when
    set, the launcher (torchrun with its process count, mpirun or mpiexec with the rank count, or
    python), `-m` and the module (`module`, default this process's), the arguments quoted."""
    argv = sys.argv if argv is None else argv
    environ = os.environ if environ is None else environ
    module = module or main_module()
    launch = read_launch_env(environ)
    if launch.launcher == "torchrun":
        launcher = f"torchrun --nproc-per-node {launch.local_world_size}"
        if launch.world_size != launch.local_world_size:
            launcher += f" --nnodes {launch.world_size // launch.local_world_size}"
        launcher += " -m" if module else ""
    elif launch.launcher in MPI_LAUNCHERS:
        launcher = f"{MPI_LAUNCHERS[launch.launcher]} -n {launch.world_size} python"
        launcher += " -m" if module else ""
    else:
        launcher = "python -m" if module else "python"
    words = [module or argv[0], *argv[1:]]
    devices = environ.get("CUDA_VISIBLE_DEVICES")
    prefix = f"CUDA_VISIBLE_DEVICES={shlex.quote(devices)} " if devices is not None else ""
    return f"{prefix}{launcher} {shlex.join(words)}"


def hardware(ranks: int = 1) -> str:
    """`{ranks} x {this process's GPU}` (one GPU a rank), or the CPU when no GPU is visible."""
    if torch.cuda.is_available():
        return f"{ranks} x {torch.cuda.get_device_name()}"
    return f"no GPU; CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def software() -> str:
    """Python, torch (and the CUDA it was built for), dep-ep, and the SOFTWARE installed."""
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    names = [f"Python {platform.python_version()}", f"torch {torch.__version__}{cuda}"]
    names.append(f"dep-ep {__version__}")
    for name in SOFTWARE:
        try:
            names.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(names)


@dataclass(frozen=True)
class Run:
    """What produced a page: `command` (command_line), `hardware`, `software`, `date` (ISO)."""

    command: str
    hardware: str
    software: str
    date: str

    @classmethod
    def this_process(cls, ranks: int = 1) -> Run:
        """This process's run; `ranks`: the processes of the run, one GPU each."""
        return cls(command_line(), hardware(ranks), software(), datetime.date.today().isoformat())


def table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table's lines: the header, the separator, a line per row (cells as str)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"table: a row of {len(row)} cells under {len(columns)} columns")
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return lines


@dataclass
class Series:
    """One line of a panel: `y` against `x`, in matplotlib's format `style` ("o-", "s--", ...).
    bold: drawn wider; color_of_previous: in the colour of the series before it (a floor drawn
    beside what it bounds)."""

    label: str
    x: Sequence[float]
    y: Sequence[float]
    style: str = "o-"
    bold: bool = False
    color_of_previous: bool = False


@dataclass
class Panel:
    """One set of axes. x_log, y_log: the base of a logarithmic axis, None for a linear one;
    reference: (y, label) of a dashed horizontal line (a ceiling)."""

    xlabel: str
    ylabel: str
    series: list[Series]
    title: str = ""
    x_log: int | None = 10
    y_log: int | None = None
    reference: tuple[float, str] | None = None


@dataclass
class Figure:
    """A row of panels under one title."""

    title: str
    panels: list[Panel] = field(default_factory=list)
    legend_size: float = 7


def draw(figure: Figure, path: Path) -> bool:
    """Draw `figure` into the PNG `path`; False (nothing written) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: files only
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    width, height = PANEL_SIZE
    size = (width * len(figure.panels), height)
    fig, axes = plt.subplots(1, len(figure.panels), figsize=size, squeeze=False)
    for axis, panel in zip(axes[0], figure.panels):
        color = None
        for series in panel.series:
            options = {"label": series.label, "linewidth": 2.5 if series.bold else 1.5}
            if series.color_of_previous and color is not None:
                options["color"] = color
            (line,) = axis.plot(series.x, series.y, series.style, **options)
            color = line.get_color()
        if panel.reference is not None:
            axis.axhline(panel.reference[0], color="k", ls="--", label=panel.reference[1])
        if panel.x_log:
            axis.set_xscale("log", base=panel.x_log)
        if panel.y_log:
            axis.set_yscale("log", base=panel.y_log)
        axis.set_title(panel.title)
        axis.set_xlabel(panel.xlabel)
        axis.set_ylabel(panel.ylabel)
        axis.legend(fontsize=figure.legend_size)
        axis.grid(True, which="both", alpha=0.3)
    fig.suptitle(figure.title)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return True


class Page:
    """One results page at `path` (markdown): the header, then what `text`, `section`, `table`
    and `plot` add, in that order; `write` writes it. `purpose`: what the page is for (one
    paragraph; `summary(__doc__)` of the benchmark)."""

    def __init__(self, path: Path, title: str, purpose: str, run: Run) -> None:
        self.path = Path(path)
        self.lines = [f"# {title}", "", " ".join(purpose.split()), ""]
        self.lines += [f"- Command: `{run.command}`", f"- Hardware: {run.hardware}"]
        self.lines += [f"- Software: {run.software}", f"- Date: {run.date}", ""]

    def text(self, *sentences: str) -> None:
        """A paragraph of `sentences` (joined by spaces)."""
        self.lines += [" ".join(sentences), ""]

    def section(self, title: str) -> None:
        self.lines += [f"## {title}", ""]

    def table(self, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
        self.lines += [*table(columns, rows), ""]

    def plot(self, figure: Figure, name: str | None = None) -> bool:
        """Draw `figure` beside the page as `name` (default: the page's name with .png) and show
        it here; without matplotlib, a line saying the plot is missing. True when drawn."""
        name = name or self.path.with_suffix(".png").name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if draw(figure, self.path.parent / name):
            self.lines += [f"![{figure.title}]({name})", ""]
            return True
        print(f"{self.path}: no plot, matplotlib is not importable", file=sys.stderr)
        self.lines += ["No plot: matplotlib was not importable where this ran.", ""]
        return False

    def write(self) -> Path:
        """Write the page (its folder made if missing); returns its path."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(self.lines))
        return self.path
