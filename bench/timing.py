"""CUDA-graph timing shared by the benchmarks: capture a function's launches, time replays."""

from __future__ import annotations

import statistics
from typing import Callable

import torch

from dep_ep.cuda_graphs import capture_graph


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
    with capture_graph(graph):
        for _ in range(launches):
            fn()
    return graph


def time_us(
    run: Callable[[], object],
    launches: int,
    samples: int = 30,
    before: Callable[[], object] | None = None,
) -> float:
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


def pair_timed_us(
    first: Callable[[], object], second: Callable[[], object], group, reps: int, samples: int
) -> tuple[float, float, float]:
    """(pair, first, second) median microseconds of `first(); second()` repeated `reps` times in
    a CUDA graph (dispatch then combine: one must follow the other), ranks of `group` lined up by
    a host barrier before each sample.

    pair: a graph of `reps` back-to-back pairs, its replay time over `reps` (what a model step
    pays: launch overlap and programmatic dependent launch included). first, second: a second
    graph of the same pairs with an event recorded before, between and after the calls of each
    pair, means over pairs 2..reps (pair 1 absorbs the ranks' launch skew); an event node between
    two kernels cuts their programmatic overlap, so first + second may exceed pair.
    """
    import torch.distributed as dist

    if reps < 2:
        raise ValueError(f"pair_timed_us: reps must be at least 2 (pair 1 is left out), got {reps}")

    def run_pairs():
        for _ in range(reps):
            first()
            second()

    pair = time_us(capture(run_pairs, 1).replay, reps, samples, before=lambda: dist.barrier(group))
    events = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(2 * reps + 1)]
    for event in events:  # the event handles exist before the capture records them
        event.record()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        for i in range(reps):
            events[2 * i].record()
            first()
            events[2 * i + 1].record()
            second()
        events[2 * reps].record()
    firsts, seconds = [], []
    for sample in range(samples + 3):
        dist.barrier(group)
        graph.replay()
        torch.cuda.synchronize()
        if sample < 3:  # warm-up replays
            continue
        spans = [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(2 * reps)]
        firsts.append(statistics.fmean(spans[2:][0::2]))
        seconds.append(statistics.fmean(spans[2:][1::2]))
    return pair, statistics.median(firsts), statistics.median(seconds)
