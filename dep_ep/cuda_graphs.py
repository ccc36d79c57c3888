"""capture_graph: `torch.cuda.graph` with Python's cyclic garbage collector kept out of the capture.

Why. A CUDA graph, or a loaded kernel module, that sits in a reference cycle (the graph of a
failed capture held by the exception's traceback, for instance) is destroyed only when the
cyclic collector next runs. When that run falls inside another capture, the destruction
(cudaGraphExecDestroy, cuModuleUnload) is an operation not permitted while a stream captures in
CUDA's global capture mode, and the capture fails with cudaErrorStreamCaptureInvalidated.
`torch.cuda.graph` ran `gc.collect()` before each capture until torch 2.8; from torch 2.9 it
does so only under `torch.compiler.config.force_cudagraph_gc`, so the collector can fire inside
a capture whenever the capture's own Python code allocates enough objects.

What. `capture_graph` collects first (the stray objects go before the capture begins), then
turns the automatic collector off until the capture ends and restores its previous state.
Reference counting still frees every object outside a cycle during the capture; cycles made
during it wait for the next collection after it. A server that captures the library's calls
needs the same, from this helper or its own equivalent (docs/integrations.md, "CUDA graphs").
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def held_collector(collect: bool = True) -> Iterator[None]:
    """The block runs with the automatic cyclic collector off; with `collect`, one full
    collection first. The collector's state before the block (enabled or not) is restored after
    it, also when the block raises; a block inside another one leaves it off. The collector is
    the process's: blocks of two threads that overlap without nesting turn it back on when the
    first ends: capture from one thread."""
    was_enabled = gc.isenabled()
    if collect:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def capture_graph(graph, *, collect: bool = True, **graph_args) -> Iterator[None]:
    """`with capture_graph(graph): ...` captures like `with torch.cuda.graph(graph, **graph_args)`
    (`pool`, `stream`, `capture_error_mode` as there), inside `held_collector(collect)`.
    `collect=False` skips the collection before the capture (a server that collected already, or
    captures many graphs in a row) and still keeps the collector off during it."""
    with held_collector(collect), torch.cuda.graph(graph, **graph_args):
        yield
