"""dep_ep.cuda_graphs: `held_collector` runs one collection first, keeps the automatic cyclic
collector off inside its block and restores the collector's state after it (also when the block
raises, and when the capture cannot even start); every CUDA-graph capture written in the
repository goes through `capture_graph` (or, for a hand-made capture_begin, `held_collector`).
The capture itself is tested on a GPU: tests/gpu/test_gpu_capture.py."""

from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import pytest
import torch

from dep_ep import capture_graph
from dep_ep.cuda_graphs import held_collector

from helpers.source_files import python_files

ROOT = Path(__file__).resolve().parents[1]


class Node:
    """An object in a reference cycle with itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def garbage_cycle() -> weakref.ref:
    """A weak reference to a self-cycle that is garbage already (made with the collector off, so
    no collection has freed it by the time the caller looks)."""
    was = gc.isenabled()
    gc.disable()
    ref = weakref.ref(Node())
    if was:
        gc.enable()
    return ref


@pytest.fixture
def low_thresholds():
    """Collector thresholds of 1: the automatic collector would run at almost every allocation
    of a container while it is on."""
    before = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    yield
    gc.set_threshold(*before)


def test_the_cycles_made_before_are_collected_first():
    stray = garbage_cycle()
    assert stray() is not None
    with held_collector():
        assert stray() is None


def test_without_the_first_collection_the_cycles_made_before_wait():
    stray = garbage_cycle()
    with held_collector(collect=False):
        assert stray() is not None
    gc.collect()
    assert stray() is None


def test_no_automatic_collection_inside_the_block(low_thresholds):
    with held_collector():
        assert not gc.isenabled()
        inside = weakref.ref(Node())  # garbage from here on
        junk = [[i] for i in range(20000)]  # would run the collector many times were it on
        assert inside() is not None, "the collector ran inside the block"
        del junk
    gc.collect()
    assert inside() is None


def test_the_same_allocations_collect_the_cycle_without_the_block(low_thresholds):
    """The control of the test above: with the collector on, the same allocations free it."""
    assert gc.isenabled()
    inside = weakref.ref(Node())
    junk = [[i] for i in range(20000)]
    del junk
    assert inside() is None


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_collector_state_is_restored(enabled_before):
    (gc.enable if enabled_before else gc.disable)()
    try:
        with held_collector():
            with held_collector(collect=False):  # nested: the outer block's state stays
                pass
            assert not gc.isenabled()
        assert gc.isenabled() is enabled_before
        with pytest.raises(KeyError), held_collector():
            raise KeyError("inside")
        assert gc.isenabled() is enabled_before
    finally:
        gc.enable()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: no CUDA device")
def test_a_capture_that_cannot_start_restores_the_collector():
    assert gc.isenabled()
    with pytest.raises((RuntimeError, AssertionError, AttributeError, TypeError)):
        with capture_graph(object()):
            pass
    assert gc.isenabled()


def _call_name(node: ast.expr) -> str:
    return ast.unparse(node.func) if isinstance(node, ast.Call) else ""


# torch's capture helpers that do not hold the collector.
BYPASSES = {"graph", "make_graphed_callables"}


def uncollected_captures(path: Path) -> list[str]:
    """ "line: call" of every capture in `path` that does not hold the collector: a
    `torch.cuda.graph(...)` or `torch.cuda.make_graphed_callables(...)` anywhere, either of them
    imported from torch.cuda, or a `.capture_begin()` outside a `with` whose items call
    `held_collector`."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def held(node: ast.AST) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.With) and any(
                _call_name(item.context_expr).endswith("held_collector") for item in node.items
            ):
                return True
        return False

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("torch.cuda", "torch.cuda.graphs"):
            names = {alias.name for alias in node.names} & BYPASSES
            found += [(node.lineno, f"from {node.module} import {n}") for n in sorted(names)]
        name = _call_name(node) if isinstance(node, ast.Call) else ""
        if name in {f"torch.cuda.{n}" for n in BYPASSES} or (
            name.endswith(".capture_begin") and not held(node)
        ):
            found.append((node.lineno, name))
    return [f"{line}: {name}" for line, name in sorted(found)]


def test_every_capture_in_the_repository_holds_the_collector():
    files = [p for p in python_files(ROOT) if p != ROOT / "dep_ep" / "cuda_graphs.py"]
    assert any(p.name == "test_gpu_server_calls.py" for p in files), "the listing missed tests/gpu"
    offenders = {
        str(p.relative_to(ROOT)): found for p in files if (found := uncollected_captures(p))
    }
    assert not offenders, f"captures without dep_ep.capture_graph / held_collector: {offenders}"


def test_the_source_check_finds_an_unheld_capture(tmp_path):
    """The check above can fail: it finds each form, and passes the held one."""
    source = tmp_path / "case.py"
    source.write_text(
        "import torch\n"
        "from dep_ep.cuda_graphs import held_collector\n"
        "g = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(g):\n    pass\n"
        "g.capture_begin()\n"
        "with held_collector():\n    g.capture_begin()\n"
        "from torch.cuda import graph\n"
        "torch.cuda.make_graphed_callables(f, (x,))\n"
    )
    assert uncollected_captures(source) == [
        "4: torch.cuda.graph",
        "6: g.capture_begin",
        "9: from torch.cuda import graph",
        "10: torch.cuda.make_graphed_callables",
    ]
