"""Programmatic dependent launch between HopperExperts' kernels (experts/hopper/pdl.py).

On CPU: every Triton kernel the engines launch (the list checked against the modules), compiled
for SM90 with PDL, waits for the kernel before it (griddepcontrol.wait) before its first global
memory access and then releases the kernel after it (griddepcontrol.launch_dependents); without
PDL it has neither. Where PDL is off (CPU, the interpreter, HopperTiles(pdl=False)), the
requests' checks, and humming's GEMMs never launching with it. On an SM90 GPU: a kernel that
lets the next launch at once and writes the call's routing ids 200 us later, then a call of each
engine (on the slots, in chunks, with the torch grouping, over one to seven grouping chunks,
without a local pair) launched right behind it, bitwise equal to the same call without PDL;
beside it, a control kernel launched with PDL that does not wait reads the stale values (so the
GPU does launch early, and the test could see a kernel that read too soon).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import replace

import pytest
import torch

from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.config import K3, TINY
from dep_ep.cuda_graphs import capture_graph
from dep_ep.experts.hopper import (
    Grouping,
    HopperExperts,
    HopperTiles,
    HummingEngine,
    TritonEngine,
    humming_gemm,
)
from dep_ep.experts.hopper.humming_gemm import HummingGemm
from dep_ep.experts.hopper.pdl import launches_pdl, pdl_options
from dep_ep.testing.synthetic import SyntheticLayer

from helpers import ptx
from helpers.interpreter import HAVE_TRITON, NO_TRITON
from helpers.k3_32 import K3_32

SM90 = 90
# PTX instructions that may touch global memory: loads, stores, atomics, reductions, copies and
# prefetches, predicated or not, in the global state space or in none named (generic addresses).
MEMORY_OP = re.compile(r"^\s*(@!?%p\d+\s+)?(ld|ldu|st|atom|red|cp|prefetch)\.([\w.:]+)")
OTHER_SPACES = (".param", ".shared", ".local", ".const")
WAIT = "griddepcontrol.wait"
RELEASE = "griddepcontrol.launch_dependents"


def kernel_cases() -> list[tuple[str, object, dict, dict]]:
    """(name, kernel, signature of its non-constant parameters, its constants) for every Triton
    kernel HopperExperts launches, with the dtypes its launches pass (K3-like sizes)."""
    from dep_ep.experts.hopper import chunk_kernels, grouping_kernel, kernels

    i32, i64, u8, f32, bf16 = "*i32", "*i64", "*u8", "*fp32", "*bf16"
    route_outputs = {
        "pair_row_ptr": i32,
        "pair_flat_ptr": i32,
        "pair_slot_ptr": i32,
        "num_pairs_ptr": i32,
        "expert_pairs_ptr": i64,
    }
    for suffix in ("", "_b"):
        for name in ("tile_expert", "tile_start", "tile_rows", "num_tiles"):
            route_outputs[f"{name}{suffix}_ptr"] = i32
        for name in ("route_flat", "route_pair", "num_padded"):
            route_outputs[f"{name}{suffix}_ptr"] = i32
    scalars = ("num_slots", "topk", "first_expert", "num_local", "tile_cap", "tile_cap_b")
    tiles = {n: i32 for n in ("tile_expert_ptr", "tile_start_ptr", "tile_rows_ptr")}
    gemm = {
        "LATENT": 512,
        "INTER": 256,
        "BLOCK_M": 64,
        "BLOCK_N": 16,
        "BLOCK_K": 128,
        "MATH": "bf16",
        "PERSISTENT": True,
    }
    base = [
        (
            "widen_scales_kernel",
            kernels.widen_scales_kernel,
            {"sf_ptr": u8, "out_ptr": f32, "count": "i32"},
            {"BLOCK": 1024},
        ),
        (
            "situ_mxfp8_kernel",
            kernels.situ_mxfp8_kernel,
            {
                "gate_up_ptr": bf16,
                "pair_flat_ptr": i32,
                "num_pairs_ptr": i32,
                "act_ptr": "*fp8e4nv",
                "act_scale_ptr": f32,
            },
            {"INTER": 3072, "ROWS": 8, "BLOCK_I": 256, "INDEXED": True},
        ),
        (
            "finalize_kernel",
            kernels.finalize_kernel,
            {
                "y_ptr": bf16,
                "pair_slot_ptr": i32,
                "weights_ptr": f32,
                "out_ptr": bf16,
                "num_pairs_ptr": i32,
                "pair_cap": "i32",
                "over_ptr": i32,
                "status_ptr": i64,
                "record_ptr": i64,
                "tag_high": "i32",
                "tag_low": "i32",
                "calls_done_ptr": i64,
            },
            {"LATENT": 3584, "TOPK": 16, "BLOCK_L": 512, "FAIL_STEP": True, "HAS_CALL": True},
        ),
        (
            "fc1_situ_kernel",
            kernels.fc1_situ_kernel,
            {
                "x_ptr": u8,
                "sf_ptr": u8,
                "w13_ptr": u8,
                "s13_ptr": u8,
                "act_ptr": bf16,
                "pair_row_ptr": i32,
                **tiles,
                "num_tiles_ptr": i32,
                "num_pairs_ptr": i32,
                "pair_cap": "i32",
            },
            gemm,
        ),
        (
            "fc2_kernel",
            kernels.fc2_kernel,
            {
                "act_ptr": bf16,
                "w2_ptr": u8,
                "s2_ptr": u8,
                "y_ptr": bf16,
                **tiles,
                "num_tiles_ptr": i32,
                "num_pairs_ptr": i32,
                "pair_cap": "i32",
            },
            gemm,
        ),
        (
            "chunk_histogram_kernel",
            grouping_kernel.chunk_histogram_kernel,
            {
                "ids_ptr": i32,
                "hist_ptr": i32,
                "num_slots": "i32",
                "first_expert": "i32",
                "num_local": "i32",
            },
            {"BINS": 64, "BLOCK_S": grouping_kernel.BLOCK_S},
        ),
        (
            "chunk_prefix_kernel",
            grouping_kernel.chunk_prefix_kernel,
            {"hist_ptr": i32, "num_chunks": "i32"},
            {"BINS": 64, "BLOCK_B": 64, "BLOCK_C": 16},
        ),
        (
            "group_route_kernel",
            grouping_kernel.group_route_kernel,
            {
                "ids_ptr": i32,
                "hist_ptr": i32,
                **route_outputs,
                **{n: "i32" for n in scalars},
            },
            {
                "BLOCK_N": 24,
                "LANES": 32,
                "BLOCK_N_B": 32,
                "LANES_B": 32,
                "TWO_TILINGS": True,
                "BINS": 64,
                "BLOCK_S": grouping_kernel.BLOCK_S,
                "CHUNKED": True,
                "BLOCK_T": grouping_kernel.BLOCK_T,
            },
        ),
        (
            "chunk_routes_kernel",
            chunk_kernels.chunk_routes_kernel,
            {
                **tiles,
                "num_tiles_ptr": i32,
                "route_pair_ptr": i32,
                "num_pairs_ptr": i32,
                "routes_ptr": i32,
                "experts_ptr": i32,
                "num_padded_ptr": i32,
                "pairs_ptr": i32,
                "chunk": "i32",
                "num_local": "i32",
            },
            {"SLOTS": 2048, "TILES": 128, "BLOCK_N": 32, "BLOCK": chunk_kernels.ROUTE_BLOCK},
        ),
        (
            "gather_rows_kernel",
            chunk_kernels.gather_rows_kernel,
            {
                "x_ptr": u8,
                "sf_ptr": u8,
                "pair_row_ptr": i32,
                "first_pair": "i32",
                "chunk_pairs_ptr": i32,
                "xg_ptr": u8,
                "xs_ptr": f32,
            },
            {"LATENT": 3584, "ROWS": 8, "BLOCK_L": 512},
        ),
    ]
    # The other specialisations the launches compile (each its own code).
    variants = {
        "situ_mxfp8_kernel": [("chunk rows", {"INDEXED": False})],
        "finalize_kernel": [
            ("no step failure", {"FAIL_STEP": False, "HAS_CALL": False}),
            ("no call index", {"HAS_CALL": False}),
        ],
        "group_route_kernel": [("one chunk, one tiling", {"CHUNKED": False, "TWO_TILINGS": False})],
        "fc1_situ_kernel": [("one-shot, fp32", {"PERSISTENT": False, "MATH": "fp32"})],
        "fc2_kernel": [("one-shot, fp32", {"PERSISTENT": False, "MATH": "fp32"})],
    }
    more = [
        (f"{name}, {label}", kernel, signature, {**constants, **change})
        for name, kernel, signature, constants in base
        for label, change in variants.get(name, [])
    ]
    return base + more


def sm90_ptx(kernel, signature: dict, constants: dict, pdl: bool) -> str:
    """The kernel's PTX for SM90 (Triton compiles it here, no GPU needed) with PDL as given."""
    return ptx.sm90_ptx(kernel, signature, {**constants, "PDL": pdl})


def ptx_order(ptx: str) -> tuple[int | None, int | None, int]:
    """(line of the first griddepcontrol.wait, of the first launch_dependents, of the first
    global access) in the PTX's instruction lines; None where there is none."""
    wait = release = None
    access = None
    for n, line in enumerate(ptx.splitlines()):
        if wait is None and WAIT in line:
            wait = n
        if release is None and RELEASE in line:
            release = n
        op = MEMORY_OP.match(line)
        spaces = "." + op.group(3) if op else ""
        is_global = ".global" in spaces or not any(space in spaces for space in OTHER_SPACES)
        if access is None and op and is_global:
            access = n
    assert access is not None, "no global access in the PTX: the pattern no longer matches"
    return wait, release, access


@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter's kernels are not JIT ones"
)
def test_every_kernel_of_the_engines_is_checked():
    """kernel_cases lists every Triton kernel of the modules the engines launch from (a new one
    must be added there, with its PDL wait)."""
    import triton

    from dep_ep.experts.hopper import chunk_kernels, grouping_kernel, kernels

    found = {
        name
        for module in (kernels, grouping_kernel, chunk_kernels)
        for name, value in vars(module).items()
        if name.endswith("_kernel") and isinstance(value, triton.runtime.jit.JITFunction)
    }
    assert found, "no kernel found: the search no longer matches"
    assert found == {kernel.fn.__name__ for _, kernel, *_ in kernel_cases()}


@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter compiles nothing"
)
@pytest.mark.parametrize("case", kernel_cases() if HAVE_TRITON else [], ids=lambda c: c[0])
def test_kernel_waits_before_its_first_global_access(case):
    """With PDL the kernel's first instruction touching memory comes after griddepcontrol.wait,
    and it releases the next kernel after waiting (humming's GEMMs read their routes before
    their own wait: pdl.py); without PDL it has no griddepcontrol at all."""
    name, kernel, signature, constants = case
    wait, release, access = ptx_order(sm90_ptx(kernel, signature, constants, True))
    assert wait is not None and wait < access, f"{name}: global access before the wait"
    assert release is not None and wait < release, f"{name}: releases before it waits"
    plain = sm90_ptx(kernel, signature, constants, False)
    assert WAIT not in plain and RELEASE not in plain, name


def test_pdl_is_off_on_cpu_and_for_interpreted_kernels():
    """launches_pdl: never for a CPU device or a kernel Triton's interpreter runs (it has no
    griddepcontrol), never when not wanted; pdl_options sets the constant and the launch
    attribute together, so a caller asking for PDL there gets a launch without it."""
    assert not launches_pdl(True, torch.device("cpu"), object())
    assert not launches_pdl(False, torch.device("cuda", 0), object())
    if HAVE_TRITON:
        from triton.runtime.interpreter import InterpretedFunction

        def body():
            pass

        interpreted = InterpretedFunction(body)
        assert not launches_pdl(True, torch.device("cuda", 0), interpreted)
        assert pdl_options(True, torch.device("cpu"), interpreted) == {
            "PDL": False,
            "launch_pdl": False,
        }


def test_pdl_requests_must_be_bools():
    """A launch's request (the grouping's and chunk kernels' `pdl`): a TypeError naming the
    value, not a truthiness guess."""
    for value in (None, 1, "no", torch.tensor(True)):
        with pytest.raises(TypeError, match="pdl=.*; expected a bool"):
            launches_pdl(value, torch.device("cpu"), object())
    assert not launches_pdl(True, "cpu", object())  # a device's name is taken


def test_tiles_pdl_must_be_a_bool():
    """Checked with the other tiles when HopperExperts is built, before the device."""
    weights = SyntheticLayer(TINY, 0).local_weights(0, 4)
    for engine in (TritonEngine, HummingEngine):
        with pytest.raises(TypeError, match="HopperTiles: pdl=1; expected a bool"):
            HopperExperts(weights, engine=engine(tiles=HopperTiles(pdl=1)))
    assert HopperTiles().pdl is True


def test_humming_gemms_never_launch_with_pdl(monkeypatch):
    """HummingGemm.tuning sets humming's use_pdl off over any heuristic choice: its CTAs without
    a tile would exit without waiting (experts/hopper/pdl.py)."""

    def heuristic(self, pairs):
        return {"block_shape": (16, 128, 256), "use_pdl": True}

    monkeypatch.setattr(HummingGemm, "heuristic", heuristic)
    gemm = HummingGemm(None, {}, torch.zeros(1), {}, False)
    for pairs in (16, 512, 4096):
        assert gemm.tuning(pairs)["use_pdl"] is False, pairs
    assert gemm.tuning(512)["use_stream_k"] is False  # TUNING_UPDATES still applied


def test_humming_decode_changes_apply_only_to_the_kernel_they_were_measured_on(monkeypatch):
    """FC1_UPDATES / FC2_UPDATES change humming's choice for 16, 32 and 64 pairs only where it
    is DECODE_KERNEL (a list or a tuple block shape); another choice (the deterministic
    engine's, without stream-K; another block) stays humming's. TUNING_UPDATES' changes at 512
    and 1024 pairs hold for any choice."""
    decode = {**humming_gemm.DECODE_KERNEL, "block_shape": [8, 128, 256], "use_pdl": True}
    choices = {
        "decode": decode,
        "decode, a tuple block": {**decode, "block_shape": (8, 128, 256)},
        "no stream-K": {**decode, "use_stream_k": False},
        "wider": {**decode, "block_shape": (16, 128, 256)},
    }
    for label, choice in choices.items():
        monkeypatch.setattr(HummingGemm, "heuristic", lambda self, pairs, c=choice: dict(c))
        for name, updates, change in (
            ("fc1", humming_gemm.FC1_UPDATES, {"num_stages": 3, "use_stream_k": False}),
            ("fc2", humming_gemm.FC2_UPDATES, {"num_stages": 3}),
        ):
            gemm = HummingGemm(None, {}, torch.zeros(1), {}, False, updates)
            for pairs in (16, 32, 64):
                applies = label.startswith("decode")
                want = {**choice, **(change if applies else {}), "use_pdl": False}
                assert gemm.tuning(pairs) == want, (label, name, pairs)
            assert gemm.tuning(128) == {**choice, "use_pdl": False}, (label, name)
            assert gemm.tuning(512)["use_stream_k"] is False, (label, name)
    # A GEMM prepared without updates (the benchmarks' baseline) keeps humming's decode kernel.
    monkeypatch.setattr(HummingGemm, "heuristic", lambda self, pairs: dict(decode))
    assert HummingGemm(None, {}, torch.zeros(1), {}, False).tuning(16)["num_stages"] == 4


def test_humming_engine_takes_the_decode_changes_at_k3_widths_only(monkeypatch):
    """HummingEngine.prepare hands FC1_UPDATES / FC2_UPDATES to its GEMMs for K3's widths (where
    they were measured) and humming's own choices (the default, TUNING_UPDATES) for others."""
    from dep_ep.experts.hopper import humming_engine

    given = []

    def prepare(weights, scales, deterministic, bf16_inputs=False, updates=None):
        given.append(updates)
        return HummingGemm(None, {}, torch.zeros(1), {}, deterministic)

    monkeypatch.setattr(humming_engine, "humming_installed", lambda: True)
    monkeypatch.setattr(HummingGemm, "prepare", staticmethod(prepare))
    for geometry, want in (
        (K3, [humming_gemm.FC1_UPDATES, humming_gemm.FC2_UPDATES]),
        (TINY, [None, None]),
    ):
        given.clear()
        small = replace(geometry, experts=max(4, geometry.topk))
        weights = SyntheticLayer(small, 0).local_weights(0, 2)
        HummingEngine().prepare("test", weights, 1)
        assert given == want, geometry.name


def sm90_here() -> str | None:
    """None on an SM90 GPU with Triton, else why the GPU case cannot run."""
    if not HAVE_TRITON:
        return NO_TRITON
    if not torch.cuda.is_available():
        return "no CUDA device here"
    if torch.cuda.get_device_capability()[0] != SM90 // 10:
        return "needs an SM90 GPU"
    return None


@functools.cache
def late_writer():
    """A Triton kernel of one program that lets the next kernel launch at once, spins `spin_ns`
    of the GPU's global timer, then copies src into dst (both int32, n elements); made once, so
    every case launches one compiled kernel."""
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents

    @triton.jit
    def globaltimer():
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )

    @triton.jit
    def late_copy_kernel(src_ptr, dst_ptr, n, spin_ns, BLOCK: tl.constexpr):
        gdc_launch_dependents()
        start = globaltimer()
        while globaltimer() - start < spin_ns:
            pass
        for first in range(0, n, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)

    return late_copy_kernel


LATE_NS = 200_000  # the writer's delay: far longer than a launch, short beside a test
LOCAL = 8  # experts 0..7 of K3_32's 32 are local
TORCH_GROUPING = HopperTiles(grouping=Grouping.TORCH)
# (id, engine, rows, routing): the engines' paths. 48 rows x 16 slots fit one grouping chunk of
# 1024 slots; 80 rows take two (the histogram and torch's cumsum), 400 rows seven (the prefix
# kernel). "none local": no row has a local id, so humming's GEMMs get no tile and our kernels
# have no pair (they still wait); its stale ids are local, so a call reading them would write
# rows.
CASES = [
    ("triton", TritonEngine(), 48, "mixed"),
    ("triton-torch-grouping", TritonEngine(tiles=TORCH_GROUPING), 48, "mixed"),
    ("humming-slots", HummingEngine(deterministic=True), 48, "mixed"),
    ("humming-slots-80", HummingEngine(deterministic=True), 80, "mixed"),
    ("humming-slots-400", HummingEngine(deterministic=True), 400, "mixed"),
    ("humming-slots-none-local", HummingEngine(deterministic=True), 48, "none local"),
    (
        "humming-torch-grouping",
        HummingEngine(deterministic=True, tiles=TORCH_GROUPING),
        48,
        "mixed",
    ),
    # Chunks of 64 pairs: a 48-row call runs in chunks (gathers, chunk routes), most of them
    # without a pair.
    ("humming-chunks", HummingEngine(deterministic=True, chunk_pairs=64), 48, "mixed"),
    (
        "humming-chunks-none-local",
        HummingEngine(deterministic=True, chunk_pairs=64),
        48,
        "none local",
    ),
]


def call_rows(rows: int, seed: int, routing: str):
    """(x, sf, fresh ids, stale ids, weights) on the GPU: MXFP8 rows, 16 distinct ids of 32 a
    row ("none local": of experts LOCAL..31 and -1), fp32 weights; stale: ids the call must not
    see (-1 everywhere, or every row's local experts for "none local")."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(32, generator=gen)[: K3.topk] for _ in range(rows)]).int()
    stale = torch.full_like(ids, -1)
    if routing == "none local":
        stale = torch.where(ids < LOCAL, ids, -1)
        ids = torch.where(ids < LOCAL, -1, ids)
    latent = torch.randn(rows, K3.latent, generator=gen).to(torch.bfloat16)
    weights = torch.rand(rows, K3.topk, generator=gen)
    x, sf = mxfp8_quantize(latent)
    return x.cuda(), sf.cuda(), ids.cuda(), stale.cuda(), weights.cuda()


@pytest.mark.skipif(sm90_here() is not None, reason=str(sm90_here()))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_a_call_behind_a_late_writer_reads_what_it_wrote_on_gpu(case):
    """The routing ids of a call written by a kernel that releases the next launch at once and
    writes them 200 us later: the call (its kernels with PDL) equals, bit for bit, the same call
    without PDL once the writer is done, eager, queued behind another call, and in a graph that
    replays both. A control
    kernel launched with PDL that does not wait (widen_scales_kernel with PDL False) reads the
    ids before the writer wrote them: this GPU launches early, so the comparison could fail."""
    name, engine, rows, routing = case
    if isinstance(engine, HummingEngine):
        from dep_ep.experts.hopper.humming_engine import humming_installed

        if not humming_installed():
            pytest.skip("humming-kernels not installed")
    from dep_ep.experts.hopper import kernels

    write = late_writer()
    seed = int.from_bytes(os.urandom(4), "little")
    weights = SyntheticLayer(K3_32, seed).local_weights(0, LOCAL).to("cuda")
    with_pdl = HopperExperts(weights, engine=engine)
    no_pdl = replace(engine, tiles=replace(engine.tiles, pdl=False))
    without = HopperExperts(weights, engine=no_pdl)
    x, sf, fresh, stale, route_weights = call_rows(rows, seed, routing)
    want = without.forward(x, sf, fresh, route_weights, poisoned(rows))
    written = ((fresh >= 0) & (fresh < LOCAL)).any(dim=1)
    assert not want[written].isnan().any() and want[~written].isnan().all()
    assert routing != "none local" or not written.any()

    # Control: the first id's 4 bytes read by a kernel that does not wait, behind the writer.
    # Bytes of -1 (0xFF) widen to NaN; a written id's (an expert < 32, then zeros) to finite
    # values. Each kernel runs once first: a launch that compiles starts after the writer is done.
    control = torch.full_like(fresh, -1)
    written_ids = torch.full_like(fresh, 5)
    seen = torch.zeros(4, dtype=torch.float32, device="cuda")
    write[(1,)](written_ids, control, fresh.numel(), 0, BLOCK=1024)
    kernels.widen_scales_kernel[(1,)](control.view(torch.uint8), seen, 4, 1024, launch_pdl=True)
    with_pdl.forward(x, sf, fresh, route_weights, poisoned(rows))
    control.fill_(-1)
    torch.cuda.synchronize()
    write[(1,)](written_ids, control, fresh.numel(), LATE_NS, BLOCK=1024)
    kernels.widen_scales_kernel[(1,)](control.view(torch.uint8), seen, 4, 1024, launch_pdl=True)
    torch.cuda.synchronize()
    assert torch.equal(control, written_ids), "the writer did not write"
    assert seen.isnan().all(), f"seed {seed}: the control read {seen.tolist()}: no early launch"

    ids = stale.clone()
    for attempt in range(3):
        ids.copy_(stale)
        got = poisoned(rows)
        torch.cuda.synchronize()
        write[(1,)](fresh, ids, fresh.numel(), LATE_NS, BLOCK=1024)
        with_pdl.forward(x, sf, ids, route_weights, got)
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
            f"{name} seed {seed}, eager call {attempt}: differs from the call without PDL"
        )
    # Two calls queued back to back, the second's ids written late: the second may reuse the
    # first's freed workspace blocks while nothing has synchronised.
    first, second = poisoned(rows), poisoned(rows)
    ids.copy_(stale)
    torch.cuda.synchronize()
    with_pdl.forward(x, sf, fresh, route_weights, first)
    write[(1,)](fresh, ids, fresh.numel(), LATE_NS, BLOCK=1024)
    with_pdl.forward(x, sf, ids, route_weights, second)
    torch.cuda.synchronize()
    for got in (first, second):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
            f"{name} seed {seed}: a call queued behind another differs from the call without PDL"
        )
    # Both in one graph: the replay's call waits for the replay's writer.
    got = poisoned(rows)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with_pdl.forward(x, sf, fresh, route_weights, got)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        write[(1,)](fresh, ids, fresh.numel(), LATE_NS, BLOCK=1024)
        with_pdl.forward(x, sf, ids, route_weights, got)
    for attempt in range(3):
        ids.copy_(stale)
        got.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
            f"{name} seed {seed}, replay {attempt}: differs from the call without PDL"
        )


def poisoned(rows: int) -> torch.Tensor:
    return torch.full((rows, K3.latent), float("nan"), dtype=torch.bfloat16, device="cuda")
