"""Across layers: the memory and time of the experts of several layers called one after another on
one stream (one HopperExperts a layer, each with its own weights, the default humming engine), as
a layer sequence calls them, against one layer's call, on one GPU at K3 geometry.

    python -m bench.bench_layer_workspace   # writes docs/results/bench_layer_workspace.md

Each row: --layers layers of `local` experts (rank 0 of K3.experts / local ranks), every layer
called on the same receive rows (drawn as bench_experts draws them, uniform routing), each into
its own output. Memory, above what was allocated once the layers, rows and outputs were built:
"one call": the allocator's peak during one eager call of the first layer; "layers eager": the
peak during one eager call of every layer in turn; "graph pool": the memory the allocator
reserved for a CUDA graph (its private pool, after torch.cuda.empty_cache()) of the first
layer's call, and of every layer's call once; "workspace": HopperExperts.workspace_bytes of one
call. Time: a graph of every layer's call, replayed (median of --samples), per layer, against
a graph of --layers calls of the first layer (its rows and weights then stay in L2 across calls
where they fit, the layers' own weights do not). Output: every layer's rows compared bitwise
with its own eager call (deterministic=True, so a rerun is bitwise equal).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from bench import cli, report
from bench.bench_experts import receive_rows
from bench.timing import capture, replay_us
from dep_ep.ep import K3
from dep_ep.experts.hopper import HopperExperts, HummingEngine
from dep_ep.testing.synthetic import SyntheticLayer

TOKENS = [1, 64, 256, 2048]
LOCAL_EXPERTS = [56]
LAYERS = 4
SAMPLES = 10
MIB = 1 << 20


def captured_with_pool(fn) -> tuple[torch.cuda.CUDAGraph, int]:
    """(graph, bytes): a CUDA graph of one call of `fn` and the memory the allocator reserved for
    it (its private pool, after torch.cuda.empty_cache()), held while the graph lives."""
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    graph = capture(fn, 1)
    torch.cuda.synchronize()
    return graph, torch.cuda.memory_reserved() - reserved


def peak_bytes(fn, base: int) -> int:
    """The allocator's peak above `base` bytes while `fn()` runs (eager, synchronised)."""
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_row(layers: list, local: int, tokens: int, samples: int, gen) -> dict:
    """One (local, T) row: memory and time of every layer's call against the first layer's."""
    ranks = K3.experts // local
    x, sf, ids, weights = receive_rows(ranks, tokens, local, gen)
    rows = ids.shape[0]
    outs = [torch.empty(rows, K3.latent, dtype=torch.bfloat16, device="cuda") for _ in layers]

    def call(i: int):
        return layers[i].forward(x, sf, ids, weights, outs[i])

    for i in range(len(layers)):  # eager first: humming compiles for a new pair count here
        call(i)
    eager = [out.clone() for out in outs]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    one_call = peak_bytes(lambda: call(0), base)
    layers_eager = peak_bytes(lambda: [call(i) for i in range(len(layers))], base)
    one_graph, one_graph_pool = captured_with_pool(lambda: call(0))
    del one_graph  # its pool is freed by the next empty_cache()
    sequence, graph_pool = captured_with_pool(lambda: [call(i) for i in range(len(layers))])
    sequence_us = replay_us(sequence, len(layers), samples)
    alone = capture(lambda: call(0), len(layers))
    alone_us = replay_us(alone, len(layers), samples)
    torch.cuda.synchronize()
    sequence.replay()
    torch.cuda.synchronize()
    bitwise = all(
        torch.equal(o.view(torch.int16), e.view(torch.int16)) for o, e in zip(outs, eager)
    )
    del sequence, alone
    return {
        "local": local,
        "tokens": tokens,
        "rows": rows,
        "pairs": int((ids < local).sum()),
        "workspace": layers[0].workspace_bytes(rows, K3.topk),
        "one call": one_call,
        "layers eager": layers_eager,
        "one call graph pool": one_graph_pool,
        "graph pool": graph_pool,
        "sequence us": sequence_us,
        "alone us": alone_us,
        "bitwise": bitwise,
    }


def write_page(out: Path, results: list[dict], layers: int, run: report.Run | None = None) -> Path:
    """The page bench_layer_workspace.md in folder `out` from the rows of `bench_row`."""
    page = report.Page(
        out / "bench_layer_workspace.md",
        "The experts of a layer sequence: memory and time per layer",
        report.summary(__doc__),
        run or report.Run.this_process(),
    )
    page.text(
        f"One process, {layers} layers, HummingEngine(deterministic=True). Memory in MiB"
        " above the layers' weights, rows and outputs; times in us per layer."
    )
    columns = [
        "local",
        "T",
        "rows",
        "pairs",
        "workspace MiB",
        "one call peak MiB",
        f"{layers} layers eager peak MiB",
        "one call's graph pool MiB",
        f"{layers} layers' graph pool MiB",
        "layers in one graph us",
        "first layer alone us",
        "bitwise",
    ]
    page.table(
        columns,
        [
            [
                r["local"],
                r["tokens"],
                r["rows"],
                r["pairs"],
                f"{r['workspace'] / MIB:.0f}",
                f"{r['one call'] / MIB:.0f}",
                f"{r['layers eager'] / MIB:.0f}",
                f"{r['one call graph pool'] / MIB:.0f}",
                f"{r['graph pool'] / MIB:.0f}",
                f"{r['sequence us']:.1f}",
                f"{r['alone us']:.1f}",
                "yes" if r["bitwise"] else "NO",
            ]
            for r in results
        ],
    )
    return page.write()


def main() -> int:
    parser = cli.parser(
        __doc__, page="bench_layer_workspace.md", tokens=TOKENS, timing=(1, SAMPLES)
    )
    parser.add_argument("--local", type=int, nargs="+", default=LOCAL_EXPERTS)
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_layer_workspace: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.layers < 2:
        print(f"bench_layer_workspace: --layers {args.layers}; expected >= 2", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for local in args.local:
        engine = HummingEngine(deterministic=True)
        layers = [
            HopperExperts(
                SyntheticLayer(K3, seed=1 + n, device="cuda").local_weights(0, local), engine=engine
            )
            for n in range(args.layers)
        ]
        for tokens in args.tokens:
            result = bench_row(layers, local, tokens, args.samples, gen)
            print(result, flush=True)
            results.append(result)
        del layers
        torch.cuda.empty_cache()
    print(write_page(args.out, results, args.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
