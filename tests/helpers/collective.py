"""The one assertion of multi-rank tests: every rank collects its failures as strings, and
`collective_assert` fails every rank at once if any rank failed, so no rank runs ahead into the
next collective while another stops at a plain `assert`."""

from __future__ import annotations

import re
from typing import Callable, Mapping

import torch.distributed as dist

Seeds = Mapping[str, int] | int | None


def describe_seeds(seeds: Seeds) -> str:
    if seeds is None:
        return "no random input"
    if isinstance(seeds, int):
        return f"seed {seeds}"
    return "seeds " + ", ".join(f"{name}={value}" for name, value in seeds.items())


def collective_assert(group: dist.ProcessGroup, failures: list[str], *, seeds: Seeds) -> None:
    """Raise AssertionError on every rank of `group` if any rank's `failures` is non-empty.

    Collective (every rank calls it, in the same order). `seeds`: the seed or the named seeds the
    test drew its random inputs from (the same on every rank: `agreed_seed`), None for a test
    without random input; the message names them, with the first failures of every failing rank.
    """
    mine = [str(f) for f in failures[:3]]
    if len(failures) > 3:
        mine.append(f"... {len(failures) - 3} more")
    reports: list[list[str]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(reports, mine, group=group)
    bad = [rank for rank, report in enumerate(reports) if report]
    if bad:
        detail = " | ".join(f"rank {rank}: " + "; ".join(reports[rank]) for rank in bad)
        raise AssertionError(f"failed on rank(s) {bad} ({describe_seeds(seeds)}): {detail}")


def expect_raises(
    failures: list[str],
    label: str,
    expected: type[BaseException] | tuple[type[BaseException], ...],
    match: str | None,
    call: Callable[[], object],
) -> BaseException | None:
    """Run `call()` and append a failure unless it raises `expected` with a message that
    `re.search`es `match` (None: any message). Returns the exception raised, if any. The
    per-rank counterpart of pytest.raises for multi-rank tests."""
    try:
        call()
    except expected as err:
        if match is not None and not re.search(match, str(err)):
            failures.append(f"{label}: {type(err).__name__} {str(err)!r} lacks {match!r}")
        return err
    except Exception as err:  # a wrong type is a failure on this rank only
        failures.append(f"{label}: raised {type(err).__name__}: {err}; expected {expected}")
        return err
    failures.append(f"{label}: no error raised; expected {expected}")
    return None
