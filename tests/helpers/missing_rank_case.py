"""Two CPU ranks; rank MISSING (argv[1]) constructs its EpRouted only after the other rank's
timeout_s: the other rank must raise EpTimeoutError naming the construction and the missing rank
within timeout_s + 1 s, and the late rank EpPeerTimeoutError at once; both with recovery
"rebuild" and the construction's remedy (no object to reset). Prints one RESULT line per rank.

    cd tests && mpiexec -n 2 python -m helpers.missing_rank_case 1
"""

import sys
import time

from dep_ep.comm import EpPeerTimeoutError, EpTimeoutError
from dep_ep.launch import init_rank_context, new_dep_group

from helpers.cases import tiny_routed

TIMEOUT_S = 2.0
missing = int(sys.argv[1])

ctx = init_rank_context("cpu", timeout_s=30.0)
dep = new_dep_group(ctx, ctx.world_size)


def build_and_report(how: str, expected: type[EpTimeoutError]) -> None:
    """Construct this rank's EpRouted and print its RESULT line: "no error", or `expected`'s
    name, the seconds it took, its recovery and its text; `how` precedes them ("late, ")."""
    start = time.monotonic()
    try:
        tiny_routed(dep.cpu_group, 4, "cpu", TIMEOUT_S)
        print(f"RESULT rank {dep.rank}: {how}no error", flush=True)
    except expected as err:
        took = time.monotonic() - start
        print(
            f"RESULT rank {dep.rank}: {how}{type(err).__name__} after {took:.2f}s,"
            f" recovery {err.recovery}: {err}",
            flush=True,
        )


if dep.rank == missing:
    time.sleep(TIMEOUT_S + 3.0)  # arrives after the others' timeout
    build_and_report("late, ", EpPeerTimeoutError)
else:
    build_and_report("", EpTimeoutError)
