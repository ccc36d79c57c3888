"""Host time the engine integrations add to a MoE layer's call, one process: the vLLM adapter's
per-layer forward, the SGLang hook and the custom op `torch.ops.dep_ep.routed`, each against
`EpRouted.routed` called directly with the same arguments (what each wraps), with `EpMoeLayer`
called directly for scale; eager (host time per call) and under CUDA-graph replay (GPU time per
call), in one run.

    torchrun --nproc-per-node 1 -m bench.bench_integration    # docs/results/bench_integration.md
    torchrun --nproc-per-node 1 -m bench.bench_integration --preset tiny --tokens 1 4  # on a CPU

The model: --layers MoE layers of the --preset geometry (K3 by default: H 7168, L 3584, E 896,
K 16, every expert on the one rank), each an EpMoeLayer with synthetic dense weights, all sharing
one EpRouted (`integrations.common.shared_routed`, max_tokens the largest T) and one experts
backend (`default_experts` of one synthetic layer's weights: HopperExperts on SM90; one copy of
K3's 896 experts is 15.7 GB). Per layer i and T: x_i bf16 [T, H] random; latent_i (contiguous),
ids_i and weights_i from layer i's own front GEMM and router on x_i. The paths, one call per layer:

- EpMoeLayer: `layer_i(x_i, tokens=T)` (its default schedule).
- EpRouted.routed: `routed(latent_i, ids_i, weights_i, None, experts=, tokens=T, tag=i)`, what
  the three below wrap.
- vLLM: `DepEpKimiExperts.forward(latent_i, weights_i, ids_i)` of a module built with vLLM
  0.33.0's constructor keywords (prefix `model.layers.{i}.mlp.experts`; its checkpoint-layout
  parameters on the meta device, as they are released after loading) holding the backend and
  the EpRouted `finish_loading` gives it. T and the padding rows come through the adapter's
  seam (`engine.VllmEngine`, as it runs under vLLM) from stand-in modules registered as
  `vllm.forward_context` for this process: a forward context with `dp_metadata`
  (`num_tokens_across_dp_cpu` = [T]) and `is_padding` (a persistent bool [max T] on the
  device, no padding row). No vLLM is imported.
- SGLang: `kimi_k3.forward_mega_experts(moe_i, latent_i, topk_output_i)`, the REPLACE hook of
  `KimiK3MoE._forward_mega_experts`, on a layer holding what `build_experts` sets; T and the
  real-row bound come through the seam (`engine.SglangEngine`) from stand-in modules registered
  under SGLang 0.5.23's names: `get_dp_global_num_tokens()` = [T], attn_tp_size 1,
  `moe_num_token_non_padded` a device scalar T, a new ForwardContext for every model step (as
  SGLang publishes one a forward); routed_scaling_factor 1.0 (K3's). No SGLang is imported.
- custom op: `custom_op.routed_op(latent_i, ids_i, weights_i, None, handle, tokens=T, tag=i)`,
  which calls `torch.ops.dep_ep.routed`.

Own: the host time of each integration's own code, the same calls with the shared EpRouted's
`routed` replaced (on the instance) by a stub that returns a preallocated output at once:
what the path adds on top of the call it wraps, free of that call's noise; the stub's own
call (EpRouted.routed through the stub) is subtracted. Reported as the medians of a step's first
layer call and of its later ones, and their mean over a step of --layers calls, which the target
is read against. Every call runs under torch.no_grad(), as SGLang's scheduler runs its forwards.
Eager: the host time of each call, perf_counter around the Python call (its kernels
queued, no device sync inside); --reps model steps (one call per layer each) per batch, the device
synchronised before and after each batch, the paths' batches interleaved so that every path
runs under the same conditions, --samples batches per path and T, the garbage collector off
while timing; median and p90 over the calls. Added: the path's median (p90) minus
EpRouted.routed's. Before timing: `warm_buckets` for every T (the integrations' warm-up), then
two untimed steps of every path. Graph (CUDA only): per path and T, --reps steps captured in one
CUDA graph after one warm-up step on the capture's stream; the median over --samples
CUDA-event-timed replays, per layer call. Each integration's outputs are compared bit for bit
with EpRouted.routed's, eager and replayed (where the experts backend reruns bitwise, its
`deterministic`). One process only: the numbers are one rank's host and GPU times.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

from bench import cli, report
from bench.timing import capture, time_us
from dep_ep.config import DEFAULT_ROUTED_SCALING_FACTOR, PRESETS, EpConfig
from dep_ep.ep import EpMoeLayer
from dep_ep.ep.custom_op import register_routed, routed_op, unregister_routed
from dep_ep.experts import default_experts
from dep_ep.integrations.common import close_shared, shared_routed, warm_buckets
from dep_ep.integrations.sglang import kimi_k3 as sglang_k3
from dep_ep.integrations.vllm.kimi_k3 import DepEpKimiExperts
from dep_ep.launch import init_rank_context, new_dep_group, teardown
from dep_ep.testing import SyntheticLayer
from dep_ep.testing.layer_reference import synthetic_dense

TOKENS = [1, 4, 16, 64, 256]
LAYERS = 4
REPS = 2  # model steps per batch (eager) and per graph
SAMPLES = 100  # batches per path and T (eager), timed replays (graph)
WARMUP_STEPS = 2
TARGET_US = 5.0  # the bound on the host time an integration adds per layer call
SEED = 1234

LAYER = "EpMoeLayer"
DIRECT = "EpRouted.routed"
VLLM = "vLLM DepEpKimiExperts.forward"
SGLANG = "SGLang forward_mega_experts"
OP = "torch.ops.dep_ep.routed"
PATHS = (LAYER, DIRECT, VLLM, SGLANG, OP)
INTEGRATIONS = (VLLM, SGLANG, OP)
# vLLM 0.33.0's MegaMoEActivation("situ", alpha=beta, beta=linear_beta) and MEGA_MOE_MXFP4, as
# the attributes the adapter reads.
SITU = SimpleNamespace(name="situ", clamp=None, alpha=4.0, beta=25.0)
MXFP4 = SimpleNamespace(name="mxfp4")


# ------------------------------------------------------------------------ the engines' modules
def module(name: str, **attributes: object) -> ModuleType:
    made = ModuleType(name)
    made.__dict__.update(attributes)
    return made


@contextlib.contextmanager
def registered_modules(modules: dict[str, ModuleType]) -> Iterator[None]:
    """`modules` in sys.modules under their names inside the block (what was there, restored),
    so the integrations' seams import them as they import the engine's."""
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


class EngineState:
    """The per-step state the stand-in engine modules publish: vLLM's forward context, SGLang's
    DP counts and real-row bound."""

    def __init__(self, device: torch.device, max_tokens: int) -> None:
        self.vllm_context: SimpleNamespace | None = None
        self.sglang_counts: list[int] | None = None
        self.sglang_bound: torch.Tensor | None = None
        # SGLang's ForwardContext: a fresh object for every forward (`new_forward`).
        self.sglang_forward: SimpleNamespace | None = None
        # vLLM's is_padding: a persistent buffer of the model runner, filled before each step.
        self.is_padding = torch.zeros(max_tokens, dtype=torch.bool, device=device)
        self.device = device

    def step(self, tokens: int) -> None:
        """A step of T = `tokens` on this (the only) DP rank, no padding rows."""
        dp = SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor([tokens]), local_sizes=None)
        self.vllm_context = SimpleNamespace(dp_metadata=dp, is_padding=self.is_padding)
        self.sglang_counts = [tokens]
        self.sglang_bound = torch.tensor([tokens], dtype=torch.int32, device=self.device)
        self.new_forward()

    def new_forward(self) -> None:
        """The start of a model forward: SGLang publishes a new ForwardContext (whose identity
        scopes the hook's per-forward padding mask); vLLM's stand-in context stays (the adapter
        keeps nothing across its calls)."""
        bound = self.sglang_bound
        self.sglang_forward = SimpleNamespace(moe_num_token_non_padded=lambda: bound)

    def modules(self) -> dict[str, ModuleType]:
        """Stand-ins of the engine modules the seams import per call (vLLM 0.33.0's
        forward_context, SGLang 0.5.23's dp_attention, runtime_context and forward_context)
        and at construction (vLLM's eplb_state)."""

        def get_forward_context():  # vLLM: asserts a context is set, returns it
            assert self.vllm_context is not None, "Forward context is not set."
            return self.vllm_context

        parallel = SimpleNamespace(attn_tp_size=1)
        return {
            "vllm": module("vllm"),
            "vllm.forward_context": module(
                "vllm.forward_context",
                get_forward_context=get_forward_context,
                is_forward_context_available=lambda: self.vllm_context is not None,
            ),
            "vllm.distributed": module("vllm.distributed"),
            "vllm.distributed.eplb": module("vllm.distributed.eplb"),
            "vllm.distributed.eplb.eplb_state": module(
                "vllm.distributed.eplb.eplb_state", EplbLayerState=SimpleNamespace
            ),
            "sglang": module("sglang"),
            "sglang.srt": module("sglang.srt"),
            "sglang.srt.layers": module("sglang.srt.layers"),
            "sglang.srt.layers.dp_attention": module(
                "sglang.srt.layers.dp_attention",
                get_dp_global_num_tokens=lambda: self.sglang_counts,
            ),
            "sglang.srt.runtime_context": module(
                "sglang.srt.runtime_context", get_parallel=lambda: parallel
            ),
            "sglang.srt.model_executor": module("sglang.srt.model_executor"),
            "sglang.srt.model_executor.forward_context": module(
                "sglang.srt.model_executor.forward_context",
                has_forward_context=lambda: self.sglang_forward is not None,
                get_forward_context=lambda: self.sglang_forward,
            ),
        }


def vllm_config(max_tokens: int) -> SimpleNamespace:
    """The VllmConfig fields DepEpKimiExperts' constructor reads (one DP rank, no TP)."""
    parallel = SimpleNamespace(
        tensor_parallel_size=1, pipeline_parallel_size=1, enable_expert_parallel=True
    )
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_tokens),
        parallel_config=parallel,
        compilation_config=SimpleNamespace(static_forward_context={}, cudagraph_capture_sizes=[]),
        additional_config={},
    )


def vllm_experts(config, index: int, geometry, routed, experts) -> DepEpKimiExperts:
    """Layer `index`'s DepEpKimiExperts with vLLM's constructor keywords, its parameters on the
    meta device, holding what finish_loading sets (the backend, the shared EpRouted)."""
    with torch.device("meta"):  # vLLM builds its model under a device context too
        made = DepEpKimiExperts(
            config,
            num_experts=geometry.experts,
            num_local_experts=geometry.experts,
            experts_start_idx=0,
            top_k=geometry.topk,
            hidden_size=geometry.latent,
            intermediate_size=geometry.intermediate,
            activation=SITU,
            weight_format=MXFP4,
            prefix=f"model.layers.{index}.mlp.experts",
        )
    made.backend, made.routed = experts, routed
    return made


def sglang_moe(index: int, routed, experts) -> SimpleNamespace:
    """Layer `index`'s KimiK3MoE as the hook reads it: layer_idx, routed_scaling_factor, and the
    experts module (a FusedMoE) holding what build_experts sets."""
    layer = SimpleNamespace(should_fuse_routed_scaling_factor_in_topk=False)
    setattr(layer, sglang_k3.ROUTED, routed)
    setattr(layer, sglang_k3.EXPERTS, experts)
    return SimpleNamespace(
        experts=layer, layer_idx=index, routed_scaling_factor=DEFAULT_ROUTED_SCALING_FACTOR
    )


# ------------------------------------------------------------------------------- timing
def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def host_times(
    steps: dict[str, list[Callable[[], object]]],
    batches: int,
    reps: int,
    sync: Callable[[], object],
    begin: Callable[[], object],
) -> dict[str, list[float]]:
    """{path: host seconds of each call, in call order (call i is layer i % layers)}: `batches`
    rounds, each running every path's batch of `reps` steps (a step: `begin()`, untimed, then
    its calls in order) between two syncs; outputs kept until the batch's sync, so that no
    free lands inside a timed call; the garbage collector off."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    clock = time.perf_counter
    gc.collect()
    gc.disable()
    try:
        for _ in range(batches):
            for name, calls in steps.items():
                record, kept = times[name], []
                sync()
                for _ in range(reps):
                    begin()
                    for call in calls:
                        start = clock()
                        out = call()
                        took = clock() - start
                        record.append(took)
                        kept.append(out)
                sync()
                del kept
    finally:
        gc.enable()
    return times


@contextlib.contextmanager
def routed_stubbed(routed, latent: int, device: torch.device) -> Iterator[None]:
    """Inside the block `routed.routed` (on the instance) returns a preallocated bf16 [n, L]
    at once, whatever it is given: the paths around it run their own code alone."""
    outputs: dict[int, torch.Tensor] = {}

    def stub(x, *args, **kwargs):
        n = x.shape[0]
        out = outputs.get(n)
        if out is None:
            out = outputs[n] = torch.zeros(n, latent, dtype=torch.bfloat16, device=device)
        return out

    routed.routed = stub
    try:
        yield
    finally:
        del routed.routed


def capture_step(calls: list[Callable[[], torch.Tensor]], reps: int, begin: Callable[[], object]):
    """(graph, the last step's outputs): `reps` steps (each `begin()`, then `calls`) captured in
    one CUDA graph, after one step on the capture's stream (bench.timing.capture)."""
    outs: list[torch.Tensor] = []

    def step() -> None:
        begin()
        outs[:] = [call() for call in calls]

    return capture(step, reps), outs


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))


# ------------------------------------------------------------------------------- the run
def parse_args(argv=None):
    page = "bench_integration.md and bench_integration.png"
    p = cli.parser(__doc__, page=page, tokens=TOKENS)
    text = "model steps (a call per layer each) per timed batch (eager) and per graph"
    p.add_argument("--reps", type=cli.positive_int, default=REPS, help=text)
    text = "timed batches per path and T (eager), timed replays (graph)"
    p.add_argument("--samples", type=cli.positive_int, default=SAMPLES, help=text)
    p.add_argument("--preset", choices=list(PRESETS), default="k3", help="MoE geometry")
    p.add_argument("--layers", type=int, default=LAYERS, help="MoE layers, one call each a step")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args(argv)
    if args.layers < 1 or args.reps < 1 or args.samples < 1:
        p.error("--layers, --reps and --samples must be >= 1")
    if min(args.tokens) < 1:
        p.error(f"--tokens {args.tokens}: every T must be >= 1")
    args.tokens = sorted(set(args.tokens))
    return args


def main() -> int:
    args = parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and args.preset == "k3":
        raise SystemExit(
            "bench.bench_integration: --preset k3 on the CPU would hold 896 K3 experts (15.7 GB)"
            " in the reference backend; pass --preset tiny, or run on a GPU"
        )
    ctx = init_rank_context(device, timeout_s=300.0)
    if ctx.world_size != 1:
        teardown(ctx)
        raise SystemExit(
            f"bench.bench_integration: runs as one process (torchrun --nproc-per-node 1); this"
            f" job has {ctx.world_size}"
        )
    dep = new_dep_group(ctx, 1)
    try:
        with torch.no_grad():  # as SGLang's scheduler runs its forwards
            results, meta = run(args, dep, ctx.device)
    finally:
        close_shared()
    path = write_report(args.out, results, meta)
    print(path.read_text(), flush=True)
    teardown(ctx)
    return 0


def run(args, dep, device: torch.device) -> tuple[list[dict], dict]:
    geometry = PRESETS[args.preset]
    on_gpu = device.type == "cuda"
    max_tokens = max(args.tokens)
    routed = shared_routed(
        dep.cpu_group,
        device,
        num_experts=geometry.experts,
        latent=geometry.latent,
        topk=geometry.topk,
        max_tokens=max_tokens,
        config=EpConfig(timeout_s=60.0),
    )
    weights = SyntheticLayer(geometry, SEED, device).local_weights(0, geometry.experts)
    experts = default_experts(weights)
    del weights  # the backend keeps what it prepared
    deterministic = bool(getattr(experts, "deterministic", True))
    layers = []
    for index in range(args.layers):
        synthetic = SyntheticLayer(geometry, SEED + 1 + index, device)
        dense = synthetic_dense(geometry, synthetic, SEED + 1 + index, device)
        layers.append(EpMoeLayer(dense, routed, experts, topk=geometry.topk, layer_index=index))
    state = EngineState(device, max_tokens)
    config = vllm_config(max_tokens)
    handle = register_routed(routed, experts)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(SEED)
    results = []
    with registered_modules(state.modules()):
        vllm = [vllm_experts(config, i, geometry, routed, experts) for i in range(args.layers)]
        sglang = [sglang_moe(i, routed, experts) for i in range(args.layers)]
        warm_buckets(routed, experts, args.tokens)  # compiles per row count, before any timing
        for tokens in args.tokens:
            state.step(tokens)
            xs, routed_args = [], []
            for layer in layers:
                x = torch.randn(tokens, geometry.hidden, generator=gen, device=device)
                x = x.to(torch.bfloat16)
                ids, probs = layer.router(x)
                latent = layer.latent_of(layer.front(x)).contiguous()
                xs.append(x)
                routed_args.append((latent, ids, probs))
            topk = [SimpleNamespace(topk_ids=ids, topk_weights=w) for _, ids, w in routed_args]

            def bind(index: int) -> dict[str, Callable[[], torch.Tensor]]:
                x, (latent, ids, probs), T = xs[index], routed_args[index], tokens
                return {
                    LAYER: lambda: layers[index](x, tokens=T),
                    DIRECT: lambda: routed.routed(
                        latent, ids, probs, None, experts=experts, tokens=T, tag=index
                    ),
                    VLLM: lambda: vllm[index].forward(latent, probs, ids),
                    SGLANG: lambda: sglang_k3.forward_mega_experts(
                        sglang[index], latent, topk[index]
                    ),
                    OP: lambda: routed_op(latent, ids, probs, None, handle, tokens=T, tag=index),
                }

            bound = [bind(i) for i in range(args.layers)]
            steps = {name: [calls[name] for calls in bound] for name in PATHS}
            for _ in range(WARMUP_STEPS):  # untimed: first calls of every path
                for calls in steps.values():
                    state.new_forward()
                    for call in calls:
                        call()
            sync()
            routed.synchronize()
            eager_outs = {}
            for name in PATHS:
                state.new_forward()
                eager_outs[name] = [call().clone() for call in steps[name]]
            sync()
            row = {
                "tokens": tokens,
                "eager": {},
                "own": {},
                "graph": {},
                "same_eager": {},
                "same_graph": {},
            }
            for name in INTEGRATIONS:
                same = same_bits(eager_outs[name], eager_outs[DIRECT])
                row["same_eager"][name] = same if deterministic else None
            times = host_times(steps, args.samples, args.reps, sync, state.new_forward)
            routed.synchronize()
            for name, values in times.items():
                us = [1e6 * v for v in values]
                row["eager"][name] = (statistics.median(us), nearest_rank(us, 0.9), len(us))
            with routed_stubbed(routed, geometry.latent, device):
                own = {name: steps[name] for name in (DIRECT, *INTEGRATIONS)}
                for calls in own.values():  # untimed: the stub's first outputs
                    state.new_forward()
                    for call in calls:
                        call()
                times = host_times(own, args.samples, args.reps, sync, state.new_forward)
            for name, values in times.items():
                us = [1e6 * v for v in values]
                first, later = us[:: args.layers], [v for i, v in enumerate(us) if i % args.layers]
                row["own"][name] = {
                    "median": statistics.median(us),
                    "p90": nearest_rank(us, 0.9),
                    "calls": len(us),
                    "first": statistics.median(first),
                    "later": statistics.median(later) if later else None,
                }
            if on_gpu:
                replayed = {}
                for name in PATHS:
                    graph, outs = capture_step(steps[name], args.reps, state.new_forward)
                    launches = args.reps * args.layers
                    row["graph"][name] = time_us(graph.replay, launches, args.samples)
                    routed.synchronize()
                    replayed[name] = [out.clone() for out in outs]
                    del graph, outs
                for name in INTEGRATIONS:
                    same = same_bits(replayed[name], eager_outs[DIRECT])
                    row["same_graph"][name] = same if deterministic else None
            results.append(row)
            print(summary_line(row, args.layers), flush=True)
    unregister_routed(handle)
    meta = {
        "preset": geometry.name,
        "geometry": geometry,
        "layers": args.layers,
        "backend": backend_name(experts),
        "deterministic": deterministic,
        "reps": args.reps,
        "samples": args.samples,
        "device": device.type,
    }
    return results, meta


def backend_name(experts) -> str:
    engine = getattr(experts, "engine", None)
    name = type(experts).__name__
    return f"{name} ({type(engine).__name__})" if engine is not None else name


def summary_line(row: dict, layers: int) -> str:
    eager = ", ".join(f"{name} {row['eager'][name][0]:.1f}" for name in PATHS)
    text = f"T={row['tokens']}: host us per call (median): {eager}"
    own = ", ".join(f"{name} {added_own(row, name, layers)['layer']:.1f}" for name in INTEGRATIONS)
    text += f"; own host us a layer call: {own}"
    if row["graph"]:
        text += "; replay us per call: " + ", ".join(
            f"{name} {row['graph'][name]:.1f}" for name in PATHS
        )
    return text


def added_own(row: dict, name: str, layers: int) -> dict[str, float]:
    """Host us of path `name`'s own code (its time with the stub less the stub's own call's):
    "first" and "later", the medians of a forward's first layer call and of its later ones
    (SGLang's hook makes its padding mask in the first); "layer", their mean over a forward
    of `layers` calls, what the target is read against; "p90" over every call."""
    own, stub = row["own"][name], row["own"][DIRECT]
    first = own["first"] - stub["first"]
    later = first if layers == 1 else own["later"] - stub["later"]
    layer = (first + (layers - 1) * later) / layers
    return {"first": first, "later": later, "layer": layer, "p90": own["p90"] - stub["p90"]}


# ------------------------------------------------------------------------------- the page
def bits(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def write_report(out: Path, results: list[dict], meta: dict, run: report.Run | None = None) -> Path:
    """OUTDIR/bench_integration.md and .png from the rows of `run`."""
    run = run or report.Run.this_process(1)
    g = meta["geometry"]
    title = "Integration overhead per MoE layer call, one process: vLLM, SGLang, custom op"
    page = report.Page(out / "bench_integration.md", title, report.summary(__doc__), run)
    page.text(
        f"Geometry {meta['preset']} (H {g.hidden}, L {g.latent}, E {g.experts}, K {g.topk}, I"
        f" {g.intermediate}), {meta['layers']} layers sharing one EpRouted and one experts"
        f" backend: {meta['backend']}. Calls per path and T: {meta['samples']} batches of"
        f" {meta['reps']} steps of {meta['layers']} calls.",
        "The paths, the stand-in engine state and the timing are in the module's docstring"
        " (`python -m bench.bench_integration --help`).",
    )
    page.text(
        f"Target (issue 23): an integration adds at most {TARGET_US:g} us of host time per layer"
        " call in eager mode, and nothing under graph replay, against the call it wraps"
        " (EpRouted.routed with the same arguments). Own: the integration's own code, timed"
        " around a stub of EpRouted.routed (the stub's call subtracted), as the medians of a"
        " forward's first layer call and of its later ones (the SGLang hook makes its padding"
        " mask once a forward, in the first); the target is read against their mean over a"
        f" forward of {meta['layers']} layer calls. Every call runs under torch.no_grad(), as"
        " SGLang's scheduler runs its forwards (vLLM runs them under inference_mode). Added:"
        " the path's time minus EpRouted.routed's, both real, in the same run: the same quantity"
        " plus the difference of two noisy host times of about a"
        " millisecond. EpMoeLayer (the whole layer: projections, router, shared experts and the"
        " routed path) is there for scale. Same bits: the path's outputs equal EpRouted.routed's"
        " bit for bit"
        + (
            "."
            if meta["deterministic"]
            else " (-: not compared, the experts backend's reruns are not bitwise equal)."
        ),
    )
    page.section("Eager: the integration's own host time per layer call (us)")
    rows = []
    for r in results:
        for name in INTEGRATIONS:
            own = added_own(r, name, meta["layers"])
            met = "yes" if own["layer"] <= TARGET_US else "NO"
            numbers = [f"{own[key]:.1f}" for key in ("first", "later", "layer", "p90")]
            rows.append([r["tokens"], name, *numbers, met])
    columns = ["T", "path", "first layer", "later layers", "a layer call", "p90", "target"]
    page.table(columns, rows)
    page.section("Eager: host time per layer call (us)")
    columns = ["T", "path", "median", "p90", "added median", "added p90", "same bits"]
    rows = []
    for r in results:
        direct_median, direct_p90, _ = r["eager"][DIRECT]
        for name in PATHS:
            median, p90, _ = r["eager"][name]
            if name in INTEGRATIONS:
                added = median - direct_median
                extra = [f"{added:.1f}", f"{p90 - direct_p90:.1f}", bits(r["same_eager"][name])]
            else:
                extra = ["-", "-", "-"]
            rows.append([r["tokens"], name, f"{median:.1f}", f"{p90:.1f}", *extra])
    page.table(columns, rows)
    graphed = [r for r in results if r["graph"]]
    page.section("CUDA-graph replay: GPU time per layer call (us)")
    if graphed:
        rows = []
        for r in graphed:
            direct = r["graph"][DIRECT]
            for name in PATHS:
                us = r["graph"][name]
                added = f"{us - direct:.1f}" if name in INTEGRATIONS else "-"
                same = bits(r["same_graph"][name]) if name in INTEGRATIONS else "-"
                rows.append([r["tokens"], name, f"{us:.1f}", added, same])
        page.table(["T", "path", "replay", "added", "same bits"], rows)
        page.text(
            "The replay runs no Python: what an integration adds there is the device work of its"
            " padding path and of nothing else (vLLM: none, its is_padding goes to EpRouted's"
            " `padding=`, which stages the ids with it in the one kernel that copies them either"
            " way; SGLang: one comparison of the row indices with the real-row bound a forward,"
            " made in its first layer call)."
        )
    else:
        page.text(f"Not run: CUDA graphs need a CUDA device (this run: {meta['device']}).")
    page.plot(figure(results, run, meta["layers"]))
    return page.write()


def figure(results: list[dict], run: report.Run, layers: int) -> report.Figure:
    ts = [r["tokens"] for r in results]
    host = [
        report.Series(name, ts, [r["eager"][name][0] for r in results], bold=name == DIRECT)
        for name in PATHS
    ]
    added = [
        report.Series(name, ts, [added_own(r, name, layers)["layer"] for r in results])
        for name in INTEGRATIONS
    ]
    panels = [
        report.Panel(
            "tokens per rank T", "us", host, title="eager: host time per call, median", x_log=2
        ),
        report.Panel(
            "tokens per rank T",
            "us",
            added,
            title="eager: the integration's own host time a layer call",
            x_log=2,
            reference=(TARGET_US, f"target {TARGET_US:g} us"),
        ),
    ]
    if all(r["graph"] for r in results):
        graph = [
            report.Series(name, ts, [r["graph"][name] for r in results], bold=name == DIRECT)
            for name in PATHS
        ]
        panels.append(
            report.Panel(
                "tokens per rank T", "us", graph, title="graph replay: GPU us per call", x_log=2
            )
        )
    return report.Figure(f"Integration overhead, {run.hardware}, {run.date}", panels)


if __name__ == "__main__":
    sys.exit(main())
