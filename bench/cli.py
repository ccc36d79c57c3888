"""The command-line options the benchmarks share, added by `parser`: the folder a results page
goes to, the token counts, the routings, and the timing's calls per sample and samples. Each
benchmark asks for the ones it takes (with its own defaults) and adds its own
options to the parser it gets. KERNEL_TUNINGS: the kernel tunings a benchmark can be asked to
time, by name."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from bench.report import main_module
from dep_ep.testing.synthetic import ROUTINGS

# Relative to the repository root, where the benchmarks run (`python -m bench.<name>`).
RESULTS = Path("docs/results")
# Kernel tunings by name: KernelTuning's fields that differ from its defaults (the results do
# not depend on them; "default" is KernelTuning()).
KERNEL_TUNINGS = {
    "default": {},
    "no-pdl": {"pdl": False},
    "blocks-1": {"dispatch_blocks_in_flight": 1},
    "waves": {"combine_ctas_per_sm": 0},
    "ctas-4": {"combine_ctas_per_sm": 4},
    "ctas-6": {"combine_ctas_per_sm": 6},
    "warps-4": {"combine_warps": 4, "combine_ctas_per_sm": 8},
    "warps-8": {"combine_warps": 8, "combine_ctas_per_sm": 2},
    "warps-8-ctas-4": {"combine_warps": 8, "combine_ctas_per_sm": 4},
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The benchmark's docstring as written, then each option with its default (where it has one:
    a None default's meaning is in the option's help)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """An argparse type: an int of at least 1 (a token count, a repetition or a sample count)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an int >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: expected an int >= 1")
    return value


def local_tokens(text: str) -> tuple[int, int]:
    """ "LOCAL:T" -> (local experts, T per rank), both positive integers."""
    local, colon, tokens = text.partition(":")
    try:
        row = int(local), int(tokens)
    except ValueError:
        row = None
    if not colon or row is None or min(row) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected LOCAL:T, two positive integers, e.g. 56:64"
        )
    return row


def parser(
    doc: str,
    *,
    page: str | None = None,
    tokens: Sequence[int] | None = None,
    routing: Sequence[str] | None = None,
    timing: tuple[int, int] | None = None,
) -> argparse.ArgumentParser:
    """The argument parser of a benchmark whose docstring is `doc` (the help's description).

    page: the names of what the benchmark writes, for the help ("bench_ep1.md and .png"): adds
        --out, the folder (Path, default RESULTS).
    tokens: the default token counts: adds --tokens (ints, tokens per rank T).
    routing: the default routings: adds --routing (synthetic_ids' patterns, each at every T).
    timing: the defaults (calls per sample, samples): adds --reps (calls captured in one CUDA
        graph and timed as one sample) and --samples (timed samples, the median reported).
    """
    module = main_module()
    p = argparse.ArgumentParser(
        prog=f"python -m {module}" if module else None,
        description=doc,
        formatter_class=HelpFormatter,
    )
    if page is not None:
        p.add_argument("--out", type=Path, default=RESULTS, help=f"folder for {page}")
    if tokens is not None:
        text = "tokens per rank T, one step each"
        p.add_argument("--tokens", type=positive_int, nargs="+", default=list(tokens), help=text)
    if routing is not None:
        text = "synthetic_ids routings, each at every T"
        p.add_argument("--routing", nargs="+", choices=ROUTINGS, default=list(routing), help=text)
    if timing is not None:
        reps, samples = timing
        text = "calls captured in one CUDA graph, timed as one sample"
        p.add_argument("--reps", type=positive_int, default=reps, help=text)
        text = "timed samples, the median reported"
        p.add_argument("--samples", type=positive_int, default=samples, help=text)
    return p


def tuning_text(name: str) -> str:
    """How a results page names a tuning of KERNEL_TUNINGS: "warps-8 (KernelTuning(combine_warps=8,
    combine_ctas_per_sm=2))"."""
    fields = ", ".join(f"{k}={v}" for k, v in KERNEL_TUNINGS[name].items())
    return f"{name} (KernelTuning({fields}))"
