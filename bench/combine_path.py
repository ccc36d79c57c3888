"""The benchmarks' option forcing the combine path (one launch or two; EpConfig)."""

from __future__ import annotations

import argparse

from dep_ep.config import EpConfig


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--combine-split-min-tokens",
        type=int,
        default=None,
        help="force the combine path: 0 = always two launches, a huge value = always one"
        " (default: the library's choice); the report's name gets a suffix",
    )


def config(args: argparse.Namespace) -> EpConfig:
    """The EpConfig the option asks for (the library's choice when it is not given)."""
    return EpConfig(combine_split_min_tokens=args.combine_split_min_tokens)


def suffix(args: argparse.Namespace) -> str:
    """The report-name suffix of a forced path ("" if none)."""
    if args.combine_split_min_tokens is None:
        return ""
    return f"_split{args.combine_split_min_tokens}"


def forced_line(suffix: str) -> str:
    """The report's sentence saying which path was forced (for a non-empty suffix)."""
    forced = suffix[len("_split") :]
    return (
        f"Combine path forced: `--combine-split-min-tokens {forced}` (0: two launches at every"
        " T; huge: one launch at every T)."
    )
