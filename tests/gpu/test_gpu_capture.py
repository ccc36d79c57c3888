"""`dep_ep.capture_graph` on a GPU: a captured CUDA graph that becomes cyclic garbage inside
another capture, with the collector's thresholds at 1 (it would run at almost every allocation),
does not invalidate that capture, and the capture replays what it recorded. Without the held
collector the garbage graph's destructor (cudaGraphExecDestroy) runs inside the capture, which
CUDA's global capture mode refuses: cudaErrorStreamCaptureInvalidated (torch >= 2.9 no longer
collects before a capture). Runs under mpirun with any number of processes."""

from __future__ import annotations

import gc

import pytest
import torch

from dep_ep.cuda_graphs import capture_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Holder:
    """Keeps `graph` in a reference cycle: only the cyclic collector frees it."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.me = graph, self


@pytest.mark.mpi(min_size=1)
def test_a_graph_turned_garbage_inside_a_capture_does_not_invalidate_it(gpu_dep):
    values = torch.full((1024,), float("nan"), device="cuda")
    stray = torch.cuda.CUDAGraph()
    with capture_graph(stray):
        values.mul_(3.0)
    holder = Holder(stray)
    del stray
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph):
            values.fill_(2.0)
            holder = None  # the stray graph is cyclic garbage from here on
            junk = [[i] for i in range(20000)]  # would run the collector many times were it on
            values.add_(5.0)
            del junk
    finally:
        gc.set_threshold(*thresholds)
    assert holder is None
    gc.collect()  # the stray graph goes now, outside any capture
    values.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(values, torch.full_like(values, 7.0))
