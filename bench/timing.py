"""CUDA-graph timing shared by the benchmarks: capture a function's launches, time replays."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def capture(fn: Callable[[], object], launches: int) -> torch.cuda.CUDAGraph:
    """A graph of `launches` back-to-back calls of `fn`, after one warm-up call on the capture's
    side stream (lazy initialisation, e.g. of NCCL communicators, happens outside the graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return graph


def time_us(run: Callable[[], object], launches: int, samples: int = 30,
            before: Callable[[], object] | None = None) -> float:  # fmt: skip
    """Median microseconds per launch of `run()` (which issues `launches` launches, e.g. a graph
    replay) over `samples` CUDA-event-timed calls, after 3 warm-up calls; `before()` runs ahead
    of each timed call, outside the timing (e.g. a host barrier lining ranks up)."""
    for _ in range(3):
        run()
    times = []
    for _ in range(samples):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def replay_us(graph: torch.cuda.CUDAGraph, launches: int, samples: int = 30) -> float:
    """Median microseconds per launch over `samples` timed replays of a graph of `launches`."""
    return time_us(graph.replay, launches, samples)


def timed_us(fn: Callable[[], object], group, reps: int, samples: int) -> tuple[float, str]:
    """(median us per call, "graph" | "eager"): `fn` captured `reps` times in a CUDA graph and
    replayed, ranks of `group` lined up by a host barrier before each sample; eager when capture
    fails (e.g. an NCCL collective that cannot be captured)."""
    import torch.distributed as dist

    try:
        run, mode = capture(fn, reps).replay, "graph"
    except RuntimeError:
        torch.cuda.synchronize()
        mode = "eager"

        def run():
            for _ in range(reps):
                fn()

    return time_us(run, reps, samples, before=lambda: dist.barrier(group)), mode
