"""The benchmarks' option forcing the combine path (one launch or two, comm/device_exchange.py)."""

from __future__ import annotations

import argparse


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--combine-split-min-tokens", type=int, default=None,
        help="force the combine path: 0 = always two launches, a huge value = always one"
        " (default: the library's choice); the report's name gets a suffix",
    )  # fmt: skip


def apply(args: argparse.Namespace, exchange) -> str:
    """Set the forced path on `exchange` (a DeviceExchange); the report-name suffix ("" if none)."""
    if args.combine_split_min_tokens is None:
        return ""
    exchange.combine_split_min_tokens = args.combine_split_min_tokens
    return f"_split{args.combine_split_min_tokens}"


def forced_line(suffix: str) -> str:
    """The report line saying which path was forced (for a non-empty suffix)."""
    forced = suffix[len("_split") :]
    return (f"Combine path forced: `--combine-split-min-tokens {forced}` (0: two launches at every"
            " T; huge: one launch at every T).\n")  # fmt: skip
