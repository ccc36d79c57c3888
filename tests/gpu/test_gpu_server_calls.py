"""The server calls on a GPU: after `EpRouted.warmup(T, experts)` capturing a routed call of T in a
CUDA graph compiles nothing (no eager call in between) and its replay equals the eager call;
`torch.ops.dep_ep.routed` equals `EpRouted.routed` bit for bit, eager and in graph replay; a
persistent `padding=` mask is read live at each replay (int32 and int64 ids); SGLang's per-forward
padding mask is shared within one capture only.

Compilations counted while the capture runs: CuTeDSL's (`device_transport.compiled_count()`, the
library's cache of the dispatch and combine kernels), triton's (its JIT's post-compile hook,
where the installed triton has one), humming's kernel runtimes (`humming.jit.runtime.
KernelRuntime._instances`, where humming is installed) and HopperExperts' humming kernel choices
(the library's per-pair-count cache, `HummingGemm.tunings`). Experts: K3's widths over 32 experts
(the humming engine's shapes), every HopperExperts engine that runs here and the device's
default backend. Runs under mpirun with any number of processes (tests/gpu/conftest.py);
importable on a machine without CUDA, where the folder is not collected.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.distributed as dist

from dep_ep.comm.device_transport import compiled_count
from dep_ep.cuda_graphs import capture_graph
from dep_ep.ep.custom_op import register_routed, routed_op, unregister_routed
from dep_ep.experts import default_experts
from dep_ep.experts.hopper import HopperExperts, HummingEngine, TritonEngine
from dep_ep.experts.hopper.humming_engine import humming_installed
from dep_ep.testing import SyntheticLayer, allgather_reference
from dep_ep.testing.compare import compare_rel_l2

from helpers.cases import agreed_seed, make_case
from helpers.collective import collective_assert
from helpers.k3_32 import K3_32, MAX_TOKENS, bound_of, build_routed

BUCKETS = (1, 5, MAX_TOKENS)  # T of each capture; 5: a receive-row count no other T gives
TAG = 7
# The experts a test builds: the device's default backend, and HopperExperts' engines by name.
BACKENDS = ("default", "hopper-triton", "hopper-humming-deterministic")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def backend_gap(name: str) -> str | None:
    """Why backend `name` cannot run here, or None."""
    if name == "default":
        return None
    reason = HopperExperts.unsupported_reason(torch.device("cuda"))
    if reason is not None:
        return f"HopperExperts: {reason}"
    if name == "hopper-humming-deterministic" and not humming_installed():
        return "the humming-kernels release HummingEngine wraps is not installed"
    return None


def build(name: str, weights):
    if name == "default":
        return default_experts(weights)
    if name == "hopper-triton":
        return HopperExperts(weights, engine=TritonEngine())
    return HopperExperts(weights, engine=HummingEngine(deterministic=True))


@pytest.fixture(scope="module")
def routed_k3(gpu_dep):
    routed = build_routed(gpu_dep)
    yield routed
    routed.close()


@contextlib.contextmanager
def triton_compiles():
    """A list that gets one entry per triton kernel this process compiles inside the block (its
    JIT's post-compile hook; a cache hit calls nothing); None where this triton has no such
    hook or triton is missing."""
    try:
        import triton

        runtime = triton.knobs.runtime
        previous = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        yield None
        return
    compiled: list[str] = []

    def hook(*args, **kwargs):
        compiled.append(str(kwargs.get("repr", kwargs.get("key", "a kernel"))))
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    try:
        yield compiled
    finally:
        runtime.jit_post_compile_hook = previous


def library_caches(experts) -> dict[str, int]:
    """The caches that grow when something is compiled: CuTeDSL's kernels, humming's kernel
    runtimes (where humming is installed) and the backend's humming kernel choices."""
    sizes = {"CuTeDSL kernels": compiled_count()}
    if importlib.util.find_spec("humming") is not None:
        from humming.jit.runtime import KernelRuntime

        sizes["humming kernel runtimes"] = len(KernelRuntime._instances)
    prepared = getattr(experts, "prepared", None)
    for name in ("fc1", "fc2"):
        tunings = getattr(getattr(prepared, name, None), "tunings", None)
        if tunings is not None:
            sizes[f"HopperExperts {name} humming choices"] = len(tunings)
    return sizes


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def case_on_gpu(rank: int, n: int, tokens: int, seed: int):
    case = make_case(K3_32, n, tokens, seed, "random")
    return tuple(t.cuda() for t in (case.latent[rank], case.ids[rank], case.weights[rank]))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", BACKENDS)
def test_capture_after_warmup_compiles_nothing_and_replays_the_eager_call(
    gpu_dep, routed_k3, backend
):
    gap = backend_gap(backend)
    if gap is not None:
        pytest.skip(gap)
    n, rank, group = gpu_dep.size, gpu_dep.rank, gpu_dep.cpu_group
    seed = agreed_seed(group, 53)
    layer = SyntheticLayer(K3_32, seed)
    per_rank = K3_32.experts // n
    experts = build(backend, layer.local_weights(rank * per_rank, per_rank).to("cuda"))
    deterministic = getattr(experts, "deterministic", True)
    norm = layer.norm_weight().cuda()
    label = f"{backend}: {type(experts).__name__} {type(getattr(experts, 'engine', None)).__name__}"
    failures = []
    for tokens in BUCKETS:
        latent, ids, probs = case_on_gpu(rank, n, tokens, seed + tokens)
        routed_k3.warmup(tokens, experts)  # local: all that runs before the capture
        torch.cuda.synchronize()
        before = library_caches(experts)
        dist.barrier(group)
        graph, compiled, refused = torch.cuda.CUDAGraph(), None, None
        try:
            with triton_compiles() as compiled, capture_graph(graph):
                captured = routed_k3.routed(latent, ids, probs, norm, experts=experts, tag=TAG)
        except Exception as err:  # a compile inside a capture often fails the capture itself
            refused = err
        captures = torch.tensor([0 if refused is not None else 1])
        dist.all_reduce(captures, op=dist.ReduceOp.MIN, group=group)
        if refused is not None:
            failures.append(f"{label}, T={tokens}: the capture failed: {refused!r}")
        if not int(captures):  # no rank replays a graph that one rank lacks
            break
        after = library_caches(experts)
        grown = {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
        if grown:
            failures.append(f"{label}, T={tokens}: the capture compiled: {grown}")
        if compiled:
            failures.append(f"{label}, T={tokens}: triton compiled in the capture: {compiled[:3]}")
        graph.replay()
        routed_k3.synchronize()
        replayed = captured.clone()
        eager = routed_k3.routed(latent, ids, probs, norm, experts=experts, tag=TAG)
        routed_k3.synchronize()
        eager = eager.clone()
        ref = allgather_reference(group, latent, ids, probs, norm, layer.expert)
        where = f"{label}, T={tokens}"
        failures += compare_rel_l2(replayed.cpu(), ref.cpu(), bound_of(experts), f"{where} replay")
        if deterministic and not bitwise_equal(replayed, eager):
            failures.append(f"{where}: the replay differs from the eager call")
        del graph, captured
    collective_assert(group, failures, seeds={"layer and cases": seed})


def deterministic_experts(weights):
    """Experts whose reruns on the same rows are bitwise equal: HopperExperts' triton engine on
    SM90, else the device's default backend (None when it says it is not)."""
    if backend_gap("hopper-triton") is None:
        return HopperExperts(weights, engine=TritonEngine())
    experts = default_experts(weights)
    return experts if getattr(experts, "deterministic", True) else None


def deterministic_case(gpu_dep, routed_k3, tokens: int, salt: int):
    """(seed, experts, latent, ids, probs, norm) of a routed call of T = `tokens` on this rank:
    K3_32's experts of this rank on a backend that reruns bitwise (the test skips where none
    does), warmed for T, and the rank's rows of a random case; the seed agreed from `salt`."""
    n, rank = gpu_dep.size, gpu_dep.rank
    seed = agreed_seed(gpu_dep.cpu_group, salt)
    layer = SyntheticLayer(K3_32, seed)
    per_rank = K3_32.experts // n
    experts = deterministic_experts(layer.local_weights(rank * per_rank, per_rank).to("cuda"))
    if experts is None:
        pytest.skip("the device's default experts backend does not rerun bitwise")
    routed_k3.warmup(tokens, experts)
    latent, ids, probs = case_on_gpu(rank, n, tokens, seed + tokens)
    return seed, experts, latent, ids, probs, layer.norm_weight().cuda()


def capture_after_one_step(step, group):
    """(graph, step()'s outputs in it): one step on the capture's side stream first (outside the
    graph), every rank lined up at a host barrier, then the step captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier(group)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        outputs = step()
    return graph, outputs


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tokens", [1, 9, MAX_TOKENS])
def test_custom_op_equals_the_routed_call_eager_and_replayed(gpu_dep, routed_k3, tokens):
    group = gpu_dep.cpu_group
    seed, experts, latent, ids, probs, norm = deterministic_case(gpu_dep, routed_k3, tokens, 59)
    handle = register_routed(routed_k3, experts)
    failures = []

    def direct() -> torch.Tensor:
        return routed_k3.routed(latent, ids, probs, norm, experts=experts, tokens=tokens, tag=TAG)

    def op() -> torch.Tensor:
        return routed_op(latent, ids, probs, norm, handle, tokens=tokens, tag=TAG)

    try:
        eager_direct = direct().clone()
        eager_op = op().clone()
        routed_k3.synchronize()
        if not bitwise_equal(eager_op, eager_direct):
            failures.append(f"T={tokens}: torch.ops.dep_ep.routed differs from EpRouted.routed")
        # Both calls in one graph, after one step of each on the capture's stream.
        graph, (graph_direct, graph_op) = capture_after_one_step(lambda: (direct(), op()), group)
        graph.replay()
        routed_k3.synchronize()
        if not bitwise_equal(graph_op, graph_direct):
            failures.append(f"T={tokens}: in graph replay the op differs from EpRouted.routed")
        if not bitwise_equal(graph_op, eager_op):
            failures.append(f"T={tokens}: the op's replay differs from its eager call")
        if not torch.isfinite(eager_op.float()).all():
            failures.append(f"T={tokens}: the eager outputs are not finite")
    finally:
        unregister_routed(handle)
    collective_assert(group, failures, seeds={"layer and case": seed})


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_padding_mask_is_read_live_under_graph_replay(gpu_dep, routed_k3, ids_dtype):
    """routed(..., padding=mask) with a persistent mask (as vLLM's is_padding): eager, its bits
    equal the call with the masked rows' ids set to -1, whatever those rows' ids and weights
    hold (other rows' ids, NaN weights); captured once and replayed after the mask changed in
    place, the replay equals the eager call with the new mask (the graph reads the live mask);
    int32 and int64 ids (int64: the mask applied to the clamp's copy)."""
    rank, group, tokens = gpu_dep.rank, gpu_dep.cpu_group, 9
    seed, experts, latent, ids, probs, norm = deterministic_case(gpu_dep, routed_k3, tokens, 61)
    ids = ids.to(ids_dtype)
    gen = torch.Generator().manual_seed(seed + 100 * rank)
    masks = [(torch.rand(tokens + 3, generator=gen) < 0.4).cuda() for _ in range(2)]
    for m in masks:
        m[rank % tokens] = True  # every mask marks a row on every rank
    mask = masks[0].clone()  # the persistent buffer the graph reads
    failures = []

    def dirty(m):  # the masked rows hold other rows' ids and NaN weights
        rows = m[:tokens, None]
        return torch.where(rows, ids.flip(0), ids), torch.where(rows, float("nan"), probs)

    def clean_call(m):
        clean = torch.where(m[:tokens, None], -1, ids)
        return routed_k3.routed(latent, clean, probs, norm, experts=experts, tokens=tokens, tag=TAG)

    dirty_ids, dirty_probs = dirty(mask)  # rewritten in place before each replay

    def masked_call():
        return routed_k3.routed(
            latent,
            dirty_ids,
            dirty_probs,
            norm,
            experts=experts,
            tokens=tokens,
            tag=TAG,
            padding=mask,
        )

    want = [clean_call(m).clone() for m in masks]
    eager = masked_call().clone()
    routed_k3.synchronize()
    if not bitwise_equal(eager, want[0]):
        failures.append(f"{ids_dtype}: eager padding= differs from the ids set to -1")
    graph, replayed = capture_after_one_step(masked_call, group)
    for index, m in enumerate(masks):
        mask.copy_(m)
        # The dirty rows follow the mask: rows it marks hold other rows' ids and NaN weights.
        new_ids, new_probs = dirty(m)
        dirty_ids.copy_(new_ids)
        dirty_probs.copy_(new_probs)
        replayed.fill_(float("nan"))  # poisoned: the replay must write every row
        graph.replay()
        routed_k3.synchronize()
        if not bitwise_equal(replayed, want[index]):
            failures.append(f"{ids_dtype}: replay {index} differs from the ids set to -1")
    collective_assert(group, failures, seeds={"layer and case": seed})


class OneForward:
    """The SglangEngine reads `padding_mask` makes: one ForwardContext object (a stand-in: only
    its identity matters) and its real-row bound."""

    def __init__(self, bound: torch.Tensor) -> None:
        self.forward, self.bound = object(), bound

    def forward_context(self) -> object:
        return self.forward

    def num_token_non_padded(self, forward: object) -> torch.Tensor:
        assert forward is self.forward
        return self.bound


def test_sglang_padding_mask_is_shared_within_one_capture_only():
    """SGLang's hook makes one padding mask a forward. Captured, the layers of one capture share
    it (one comparison a replay); two captures made in the same ForwardContext (SGLang makes a
    new one for each, a custom runner might not) each get their own, so each graph's replay
    reads the bound as it is at that replay, and neither writes the other's mask."""
    from dep_ep.integrations.sglang.steps import capture_id, padding_mask

    device = torch.device("cuda", torch.cuda.current_device())
    rows = 8
    bound = torch.full((1,), rows, dtype=torch.int32, device=device)
    engine = OneForward(bound)
    assert capture_id(device) is None
    graphs, masks = [], []
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph, stream=stream):
                assert capture_id(device) not in (None, -1)
                first = padding_mask(engine, rows, device)
                assert padding_mask(engine, rows, device) is first  # a later layer
            graphs.append(graph)
            masks.append(first)
    assert masks[0] is not masks[1]
    for count in (3, 6):
        bound.fill_(count)
        graphs[0].replay()
        torch.cuda.synchronize()
        assert masks[0].tolist() == [i >= count for i in range(rows)]
        bound.fill_(count - 2)
        graphs[1].replay()
        torch.cuda.synchronize()
        assert masks[1].tolist() == [i >= count - 2 for i in range(rows)]
        assert masks[0].tolist() == [i >= count for i in range(rows)]
    eager = padding_mask(engine, rows, device)  # outside any capture: not a graph's mask
    assert eager is not masks[0] and eager is not masks[1]
    assert eager.tolist() == [i >= 4 for i in range(rows)]
