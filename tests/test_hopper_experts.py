"""HopperExperts: the device grouping (torch, on CPU here) against a plain loop, the three Triton
kernels in Triton's CPU interpreter against the float64 reference, the argument checks, and on an
SM90 GPU the properties the backend promises (bitwise reruns, graph replay equal to eager, edge
cases). Fresh random data every run; the seed is in every failure message."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dep_ep.comm.mxfp8 import e8m0_to_fp32, mxfp8_quantize
from dep_ep.config import K3, TINY, MoeGeometry
from dep_ep.cuda_graphs import capture_graph
from dep_ep.experts import ReferenceExperts, default_experts, default_experts_class
from dep_ep.experts.hopper import (
    Grouping,
    HopperEngine,
    HopperExperts,
    HopperTiles,
    HummingEngine,
    TritonEngine,
    default_engine,
    humming_engine,
    humming_gemm,
    humming_layout,
    tuning_pairs,
)
from dep_ep.experts.hopper import chunks as chunks_module
from dep_ep.experts.hopper import engine as engine_module
from dep_ep.experts.hopper.engine import PAIR_BUDGET_LEAST, pair_budget
from dep_ep.experts.hopper.grouping import group_pairs, pair_capacity, tile_capacity, tile_routes
from dep_ep.experts.hopper.triton_engine import fused_experts
from dep_ep.experts.mxfp4 import E2M1_VALUES, mxfp4_dequantize
from dep_ep.testing.allgather_reference import expert_sums
from dep_ep.testing.synthetic import SyntheticLayer
from dep_ep.testing.tolerance import EXPERTS_REL_L2, HUMMING_REL_L2

from helpers.interpreter import HAVE_TRITON, NO_TRITON, run_in_interpreter

TESTS = Path(__file__).resolve().parent


def fresh_seed() -> int:
    return int(torch.randint(0, 2**31, (1,)))


@functools.cache
def interpreter_loop_gap() -> str | None:
    """None when Triton's interpreter runs loops bounded by a kernel argument (the grouping
    kernel's); else the reason it cannot here (helpers/interpreter_loop_probe.py: Triton 3.6 with
    NumPy 2.4). Any other failure of the probe fails the calling test."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "helpers.interpreter_loop_probe"],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if run.returncode == 0 and run.stdout.startswith("ok"):
        return None
    known = "only 0-dimensional arrays can be converted to Python scalars"
    assert known in run.stderr, f"interpreter_loop_probe:\n{run.stdout}\n{run.stderr[-3000:]}"
    import numpy
    import triton

    return (
        f"Triton {triton.__version__}'s interpreter cannot loop to a kernel argument with"
        f" NumPy {numpy.__version__} (triton-lang/triton issue 9171); the compiled kernel is"
        " checked by test_gpu_grouping_kernel_equals_torch"
    )


# tests/run_all.sh (the CPU suite, CI) sets it: there the interpreter must run the grouping kernel.
REQUIRE_INTERPRETER_LOOPS = "DEP_EP_REQUIRE_INTERPRETER_LOOPS"


def skip_without_interpreter_loops() -> None:
    """Skip naming the reason where the interpreter cannot run the grouping kernel; fail instead
    where REQUIRE_INTERPRETER_LOOPS=1."""
    gap = interpreter_loop_gap()
    if gap is not None and os.environ.get(REQUIRE_INTERPRETER_LOOPS) == "1":
        pytest.fail(f"{REQUIRE_INTERPRETER_LOOPS}=1 but {gap}")
    if gap is not None:
        pytest.skip(gap)


def loop_groups(ids: torch.Tensor, first: int, num_local: int, block_n: int):
    """The grouping written as loops: (pairs [(row, k)] in pair order, tiles [(expert, start,
    rows)])."""
    pairs, tiles = [], []
    for e in range(num_local):
        mine = [
            (r, k)
            for r in range(ids.shape[0])
            for k in range(ids.shape[1])
            if int(ids[r, k]) == first + e
        ]
        for cut in range(0, len(mine), block_n):
            tiles.append((e, len(pairs) + cut, min(block_n, len(mine) - cut)))
        pairs += mine
    return pairs, tiles


def check_groups(ids: torch.Tensor, first: int, num_local: int, block_n: int, seed: int) -> None:
    groups = group_pairs(ids, first, num_local, block_n)
    rows, topk = ids.shape
    pairs, tiles = loop_groups(ids, first, num_local, block_n)
    where = f"seed {seed}, R={rows}, K={topk}, E_local={num_local}, block_n={block_n}"
    assert groups.pair_capacity == pair_capacity(rows, topk) >= len(pairs), where
    assert groups.tile_capacity == tile_capacity(rows, topk, num_local, block_n) >= len(tiles)
    assert [int(r) for r in groups.pair_row[: len(pairs)]] == [r for r, _ in pairs], where
    assert groups.pair_flat[: len(pairs)].tolist() == [r * topk + k for r, k in pairs], where
    assert int(groups.num_pairs) == len(pairs), where
    want_slot = torch.full((rows * topk,), -1, dtype=torch.int32)
    for j, (r, k) in enumerate(pairs):
        want_slot[r * topk + k] = j
    assert torch.equal(groups.pair_slot, want_slot), where
    assert int(groups.num_tiles) == len(tiles), where
    got_tiles = list(
        zip(groups.tile_expert.tolist(), groups.tile_start.tolist(), groups.tile_rows.tolist())
    )[: len(tiles)]
    assert got_tiles == tiles, where
    unused = slice(len(tiles), None)
    assert (groups.tile_expert[unused] == num_local).all(), where
    assert (groups.tile_rows[unused] == 0).all(), where
    want_counts = [
        sum(1 for r, k in pairs if int(ids[r, k]) == first + e) for e in range(num_local)
    ]
    assert groups.expert_pairs.tolist() == want_counts, where


@pytest.mark.parametrize(
    "rows,topk,num_local,block_n",
    [(1, 16, 56, 16), (37, 6, 8, 16), (64, 16, 4, 16), (200, 4, 12, 32), (0, 4, 8, 16)],
)
def test_group_pairs_matches_loop(rows, topk, num_local, block_n):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    experts, first = 3 * num_local + topk, num_local
    ids = torch.empty(rows, topk, dtype=torch.int32)
    for r in range(rows):
        ids[r] = torch.randperm(experts, generator=gen)[:topk]
    ids[::3, -1] = -1
    check_groups(ids, first, num_local, block_n, seed)


def test_group_pairs_edges():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    # No local id at all: no tiles.
    none = torch.randint(20, 40, (9, 4), generator=gen).int()
    check_groups(none, 0, 8, 16, seed)
    assert int(group_pairs(none, 0, 8, 16).num_tiles) == 0
    # Every row sends its first choice to local expert 3 (a hot expert cut into 5 tiles).
    hot = torch.full((70, 4), -1, dtype=torch.int32)
    hot[:, 0] = 3
    check_groups(hot, 0, 8, 16, seed)
    assert int(group_pairs(hot, 0, 8, 16).num_tiles) == 5
    # A row repeating a local id (E_local < K): every repeat is a pair, within the capacity.
    repeats = torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1], [1, 0, -1, 1]], dtype=torch.int32)
    check_groups(repeats, 0, 2, 16, seed)
    assert int(group_pairs(repeats, 0, 2, 16).num_pairs) == 11
    # Every slot local: the pair capacity is reached.
    full = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(5)]).int()
    check_groups(full, 0, 8, 16, seed)
    assert int(group_pairs(full, 0, 8, 16).expert_pairs.sum()) == pair_capacity(5, 4)


@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
@pytest.mark.parametrize("case", ["mixed", "hot", "single", "hot-grouping-kernel"])
def test_kernels_in_triton_interpreter(case):
    if case.endswith("grouping-kernel"):
        skip_without_interpreter_loops()
    seed = fresh_seed()
    run_in_interpreter("helpers.hopper_interpreter_case", case, str(seed), expect=f"ok {case}")


@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
def test_pair_budget_in_triton_interpreter():
    """A budget of exactly the pairs changes nothing (bitwise); one pair less gives NaN in every row
    with a local id and the overflow record; the call allocates workspace_parts' bytes exactly."""
    skip_without_interpreter_loops()
    seed = fresh_seed()
    run_in_interpreter("helpers.hopper_interpreter_case", "budget", str(seed), expect="ok budget")


@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
@pytest.mark.parametrize("case", ["chunks", "budget", "pdl"])
def test_humming_engine_in_chunks_in_triton_interpreter(case):
    """The humming engine's call with a torch stand-in for humming's GEMM: in chunks bitwise equal
    to the call on the slots, both equal to the rounding recipe in torch, the pair budget's NaN
    rows and records, workspace_parts exact, and every launch asking for programmatic
    dependent launch as the tiles say (tests/helpers/humming_interpreter_case.py). The call runs
    the grouping kernel, which loops to a kernel argument."""
    skip_without_interpreter_loops()
    seed = fresh_seed()
    run_in_interpreter("helpers.humming_interpreter_case", case, str(seed), expect=f"ok {case}")


@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
def test_grouping_kernel_in_triton_interpreter():
    """experts/hopper/grouping_kernel.py gives group_pairs' and tile_routes' tensors bitwise."""
    skip_without_interpreter_loops()
    seed = fresh_seed()
    run_in_interpreter("helpers.grouping_interpreter_case", str(seed), expect=f"ok seed {seed}")


@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
def test_widen_scales_in_triton_interpreter():
    """The humming engine's scale widening gives comm/mxfp8.e8m0_to_fp32's bits."""
    seed = fresh_seed()
    run_in_interpreter("helpers.widen_interpreter_case", str(seed), expect=f"ok seed {seed}")


@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
def test_grouping_kernel_refuses_bad_arguments():
    """group_and_route refuses tiles past its lanes and ids it cannot read before any launch;
    `grouped` groups such tiles in torch instead (the same tensors)."""
    from dep_ep.experts.hopper.grouping import grouped, routed_tilings
    from dep_ep.experts.hopper.grouping_kernel import (
        MAX_BLOCK_N,
        group_and_route,
        group_and_route_tilings,
    )

    ids = torch.tensor([[0, 2, -1], [2, 2, 0], [5, 1, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_n=32768; expected at most 16384"):
        group_and_route(ids, 0, 4, 1 << 15)
    groups, routes = grouped(ids, 0, 4, 2 * MAX_BLOCK_N, Grouping.TRITON)
    want = group_pairs(ids, 0, 4, 2 * MAX_BLOCK_N)
    assert routes is None and torch.equal(groups.pair_slot, want.pair_slot)
    with pytest.raises(ValueError, match="group_and_route: ids torch.float32"):
        group_and_route(ids.float(), 0, 4, 16)
    with pytest.raises(ValueError, match="grouped: grouping='Triton'; expected one of"):
        grouped(ids, 0, 4, 16, "Triton")
    with pytest.raises(ValueError, match="block_ns=\\(8, 16, 24\\); expected a tuple of one"):
        group_and_route_tilings(ids, 0, 4, (8, 16, 24))
    with pytest.raises(ValueError, match="block_ns=\\[8\\]; expected a tuple"):
        group_and_route_tilings(ids, 0, 4, [8])
    with pytest.raises(ValueError, match="tilings: block_ns=\\(24, 24\\); expected distinct"):
        group_and_route_tilings(ids, 0, 4, (24, 24))
    with pytest.raises(ValueError, match="group_and_route_tilings: block_n=32768; expected at"):
        group_and_route_tilings(ids, 0, 4, (16, 1 << 15))
    with pytest.raises(ValueError, match="routed_tilings: block_n=0"):
        routed_tilings(ids, 0, 4, (16, 0), Grouping.TRITON)
    # In torch: past the kernel's lanes.
    tilings = routed_tilings(ids, 0, 4, (2 * MAX_BLOCK_N, 16), Grouping.TRITON)
    assert [groups.block_n for groups, _ in tilings] == [2 * MAX_BLOCK_N, 16]
    assert torch.equal(tilings[1][1].flat, tile_routes(group_pairs(ids, 0, 4, 16)).flat)
    with pytest.raises(ValueError, match="grouped: block_n=2.0"):
        grouped(ids, 0, 4, 2.0, Grouping.TRITON)
    with pytest.raises(ValueError, match="first_expert \\+ num_local = 2147483652; expected at"):
        group_and_route(ids, 2**31, 4, 16)
    # Found by a careless-user probe: int64 ids, which `grouped` takes, were refused under
    # TRITON by group_and_route; a non-bool pdl was refused without the function's name (or
    # taken, by the torch grouping); block_ns of () or a bare int were an empty list or
    # "'int' object is not iterable".
    groups, routes = grouped(ids.long(), 0, 4, 16, Grouping.TRITON)
    assert routes is None and torch.equal(groups.pair_slot, group_pairs(ids, 0, 4, 16).pair_slot)
    [(groups, routes)] = routed_tilings(ids.long(), 0, 4, (16,), Grouping.TRITON)
    assert torch.equal(routes.flat, tile_routes(group_pairs(ids, 0, 4, 16)).flat)
    for grouping in Grouping:
        with pytest.raises(TypeError, match="grouped: pdl=1; expected a bool"):
            grouped(ids, 0, 4, 16, grouping, pdl=1)
        with pytest.raises(TypeError, match="routed_tilings: pdl='yes'; expected a bool"):
            routed_tilings(ids, 0, 4, (16,), grouping, pdl="yes")
        for block_ns in ((), 16):
            with pytest.raises(TypeError, match="routed_tilings: block_ns=.*; expected a tuple"):
                routed_tilings(ids, 0, 4, block_ns, grouping)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_finalize_kernel_compiles_once_for_any_alignment_of_its_scalar_pointers():
    """The device transport's step status word (the StepFailure a step hands HopperExperts) lies
    8 bytes into its state, where warmup's scratch word is a fresh 16-byte-aligned allocation:
    a finalize kernel specialised on that alignment compiled again inside the first CUDA-graph
    capture after warmup (one H200, triton engine, T = 1). Every pointer it accesses one
    element at a time is declared free of alignment specialisation."""
    from dep_ep.constants import STATE_STEP_STATUS
    from dep_ep.experts.hopper import kernels

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton's interpreter compiles nothing: no specialisation to check")
    assert STATE_STEP_STATUS * 8 % 16 != 0  # why the status word's pointer is not aligned
    params = {p.name: p for p in kernels.finalize_kernel.params}
    scalar = (
        "pair_slot_ptr",
        "weights_ptr",
        "num_pairs_ptr",
        "over_ptr",
        "status_ptr",
        "record_ptr",
        "calls_done_ptr",
    )
    assert [n for n in scalar if not params[n].do_not_specialize_on_alignment] == []
    # The rows it loads and stores whole stay specialised (their vector accesses need it).
    assert not params["y_ptr"].do_not_specialize_on_alignment
    assert not params["out_ptr"].do_not_specialize_on_alignment


def test_tuning_pairs_is_the_nearest_power_of_two_of_the_expected_pairs():
    """The pair counts of the measured table (docs/results/bench_humming_tuning.md): rank 0's
    receive rows on a DEP16 shard (56 of 896 experts, K = 16) at T = 1, 32, 64, 128, 256 hold about
    13, 548, 1034, 2033, 4112 pairs; humming's kernels are chosen for 16, 512, 1024, 2048, 4096."""
    for rows, want in ((9, 16), (339, 512), (666, 1024), (1317, 2048), (2637, 4096)):
        assert tuning_pairs(rows, 16, 56, 896) == want, rows
    assert tuning_pairs(512, 16, 448, 896) == 4096  # DEP2 shard, T = 256: 4105 pairs
    assert tuning_pairs(12, 16, 4, 32) == 32  # 27.2 expected: log2 4.77 rounds up
    assert tuning_pairs(64, 16, 4, 32) == 128  # 145 expected: log2 7.18 rounds down
    assert tuning_pairs(64, 1, 4, 32) == 64  # K = 1: every row's one id is local
    assert tuning_pairs(100, 16, 56, None) == 2048  # without num_experts: the capacity 1600
    assert tuning_pairs(1, 16, 56, 896) == 16  # never below 16


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: tuning_pairs(-1, 16, 56, 896), ValueError, "tuning_pairs: rows=-1, topk=16"),
        (lambda: tuning_pairs(8, 0, 56, 896), ValueError, "rows=8, topk=0; expected"),
        (lambda: tuning_pairs(8, 16, 0, 896), ValueError, "num_local=0; expected >= 1"),
        (lambda: tuning_pairs(8, 16, 60, 48), ValueError, "num_experts=48; expected >= 60"),
        (lambda: tuning_pairs("8", 16, 56, 896), TypeError, "rows='8'; expected an int"),
        (lambda: tuning_pairs(8.5, 16, 56, 896), TypeError, "rows=8.5; expected an int"),
        (
            lambda: TritonEngine().workspace_bytes(8, 6, -256, 128),
            ValueError,
            "TritonEngine.workspace_parts: latent=-256; expected >= 1",
        ),
        (
            lambda: TritonEngine().workspace_bytes(8, 6, 256, 128, max_pairs=-100),
            ValueError,
            "max_pairs=-100; expected >= 1",
        ),
        (
            lambda: TritonEngine().workspace_bytes(-1, 6, 256, 128),
            ValueError,
            "rows=-1, topk=6",
        ),
        (
            lambda: HummingEngine().workspace_bytes(8, 6, 256, 128, max_pairs=-64),
            ValueError,
            "HummingEngine.workspace_parts: max_pairs=-64; expected >= 1",
        ),
        (
            lambda: HummingEngine().workspace_bytes(True, 6, 256, 128),
            TypeError,
            "rows=True; expected an int",
        ),
        (
            lambda: HummingEngine().workspace_bytes(8, 6, 256, 128, num_local=0),
            ValueError,
            "num_local=0; expected >= 1",
        ),
        (
            lambda: TritonEngine().workspace_bytes(8, 6, 256, 128, max_pairs=0),
            ValueError,
            "max_pairs=0; expected >= 1",
        ),
        (
            lambda: ReferenceExperts(SyntheticLayer(TINY, seed=2).local_weights(0, 4)).max_pairs(
                -1, 6
            ),
            ValueError,
            "ReferenceExperts.max_pairs: rows=-1, topk=6",
        ),
    ],
)
def test_sizes_out_of_range_are_refused(call, error, match):
    """The per-row-count sizes refuse what no call has (before, workspace_bytes(-1, 6) gave
    -3888 bytes, a negative latent or max_pairs a negative size, humming's budget was ignored
    below 1, tuning_pairs took more local experts than experts and divided by zero at topk 0:
    found by a careless-user probe); HopperExperts' max_pairs, workspace_bytes and tuning_pairs
    check rows and topk with `check_call_size`, as every backend's max_pairs and warmup do."""
    with pytest.raises(error, match=match):
        call()


def test_forward_refuses_a_failure_that_is_not_a_step_failure():
    """forward's `failure` is None or a StepFailure: anything else is a TypeError naming it
    (before, True raised AttributeError 'tag_halves' from the launch; found by a careless-user
    probe). Checked on CPU before any launch: the object is made without its GPU state, so a
    call that got past the check would fail on the missing `prepared`, not with this error."""
    backend = object.__new__(HopperExperts)
    backend.latent, backend.device, backend.device_failures = TINY.latent, torch.device("cpu"), True
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    x, sf = mxfp8_quantize(torch.randn(4, TINY.latent, generator=gen).bfloat16())
    ids = torch.randint(0, TINY.experts, (4, TINY.topk), generator=gen, dtype=torch.int32)
    weights, out = torch.rand(4, TINY.topk), torch.empty(4, TINY.latent, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="HopperExperts.forward: failure is bool; expected None"):
        backend.forward(x, sf, ids, weights, out, failure=True)


def test_sizes_in_range_are_taken():
    """The refusals above leave every size a call can have: rows 0, integers of any kind."""
    assert tuning_pairs(0, 16, 56, 896) == 16
    assert tuning_pairs(np.int64(9), torch.tensor(16), 56, 896) == 16
    assert TritonEngine().workspace_bytes(0, 6, 256, 128) >= 0
    assert HummingEngine().workspace_bytes(8, 6, 256, 128, max_pairs=np.int64(16)) > 0
    # A call of no row: its budget is 0 (pair_budget), as HopperExperts.workspace_bytes(0, K)
    # passes it to the engines.
    for engine in (TritonEngine(), HummingEngine()):
        budget = pair_budget(0, 6, 4, 48, 2.25)
        assert budget == 0
        assert engine.workspace_bytes(0, 6, 256, 128, num_local=4, max_pairs=budget) >= 0
    reference = ReferenceExperts(SyntheticLayer(TINY, seed=2).local_weights(0, 4))
    assert reference.max_pairs(np.int64(9), 6) == 54


def test_tiles_checked():
    with pytest.raises(ValueError, match="fc1_block_m=48"):
        HopperTiles(fc1_block_m=48).check(256, 128)
    with pytest.raises(ValueError, match="finalize_block_l=24; expected a power of two >= 16"):
        HopperTiles(finalize_block_l=24).check(256, 128)
    with pytest.raises(ValueError, match="finalize_warps=3; expected a power of two"):
        HopperTiles(finalize_warps=3).check(256, 128)
    # A CUDA block holds at most 32 warps (num_warps=64 failed in ptxas, found by a careless-user
    # probe); 32 itself is taken.
    for name in ("num_warps", "finalize_warps"):
        with pytest.raises(ValueError, match=f"{name}=64; expected a power of two <= 32"):
            HopperTiles(**{name: 64}).check(256, 128)
        HopperTiles(**{name: 32}).check(256, 128)
    with pytest.raises(ValueError, match=r"num_stages=0; expected 1\.\.8"):
        HopperTiles(num_stages=0).check(256, 128)
    # Upper bounds (a careless-user probe: block_n=1024 compiled for 190 s, then lacked shared
    # memory; 32768 failed inside Triton). Each bound itself is taken.
    for name, most in (
        ("block_n", 256),
        ("fc1_block_m", 256),
        ("fc2_block_m", 256),
        ("fc1_block_k", 1024),
        ("fc2_block_k", 1024),
    ):
        with pytest.raises(ValueError, match=f"{name}={2 * most}; expected a power of two >= "):
            HopperTiles(**{name: 2 * most}).check(4096, 4096)
        HopperTiles(**{name: most}).check(4096, 4096)
    for name, most in (("num_stages", 8), ("programs_per_sm", 32)):
        with pytest.raises(ValueError, match=rf"{name}={most + 1}; expected 1\.\.{most}"):
            HopperTiles(**{name: most + 1}).check(256, 128)
        HopperTiles(**{name: most}).check(256, 128)
    assert HopperTiles().finalize_columns(256) == 256  # the default 512 does not divide 256
    assert HopperTiles().finalize_columns(3584) == 512 and HopperTiles().finalize_columns(48) == 16
    with pytest.raises(ValueError, match="math='fp16'"):
        HopperTiles(math="fp16").check(256, 128)
    with pytest.raises(ValueError, match="block_n=8"):
        HopperTiles(block_n=8).check(256, 128)
    with pytest.raises(ValueError, match="grouping='cuda'"):
        HopperTiles(grouping="cuda").check(256, 128)
    with pytest.raises(ValueError, match="latent=None; expected an int >= 1"):
        HopperTiles().check(None, 128)
    with pytest.raises(ValueError, match="intermediate=-128"):
        HopperTiles().check(256, -128)
    HopperTiles().check(K3.latent, K3.intermediate)
    # Integers of other kinds become Python ints when the tiles are made; check() changes no
    # field of the frozen object (it normalised them in place before).
    tiles = HopperTiles(block_n=np.int64(32), num_warps=torch.tensor(8))
    assert (type(tiles.block_n), type(tiles.num_warps)) == (int, int)
    assert tiles == HopperTiles(block_n=32, num_warps=8)
    before = dict(vars(tiles))
    tiles.check(K3.latent, K3.intermediate)
    assert vars(tiles) == before


def test_refuses_cpu_after_checking_arguments():
    """Argument mistakes show on any machine (checked before the device); valid arguments on CPU
    get the refusal naming the hardware."""
    weights = SyntheticLayer(TINY, 0).local_weights(0, 4)
    with pytest.raises(
        RuntimeError,
        match="HopperExperts cannot run on cpu: cpu is not a CUDA device; it needs an SM90",
    ):
        HopperExperts(weights)
    for engine in (TritonEngine(), HummingEngine(deterministic=True, tune_for_capacity=True)):
        with pytest.raises(RuntimeError, match="HopperExperts cannot run on cpu"):
            HopperExperts(weights, engine=engine)
    bad = [
        ("triton", TypeError, "HopperExperts: engine is str; expected None or a HopperEngine"),
        (TritonEngine(tiles=HopperTiles(block_n=8)), ValueError, "block_n=8"),
        (
            HummingEngine(tiles=HopperTiles(num_warps=3)),
            ValueError,
            "num_warps=3; expected a power of two",
        ),
        (TritonEngine(tiles=HopperTiles(block_n=16.0)), TypeError, "block_n=16.0; expected an int"),
        (
            TritonEngine(tiles=HopperTiles(persistent=None)),
            TypeError,
            "persistent=None; expected a bool",
        ),
        (
            TritonEngine(tiles=HopperTiles(fc1_block_m=256)),
            ValueError,
            "fc1_block_m=256; expected a power of two >= 16 and <= 256 dividing 128",
        ),  # TINY's I
    ]
    for engine, error, message in bad:
        with pytest.raises(error, match=message):
            HopperExperts(weights, engine=engine)
    with pytest.raises(TypeError, match="HopperExperts: weights is tuple; expected an ExpertW"):
        HopperExperts(SyntheticLayer(TINY, 0).local(0, 4))


def test_pair_budget_arithmetic():
    """pair_budget: the capacity without a skew; else skew x the uniform mean, at least
    PAIR_BUDGET_LEAST, at most the capacity (hand-computed)."""
    assert pair_budget(32768, 16, 56, 896, None) == 524_288  # R * K
    # K3, 16 ranks, T = 2048: mean 32768 * 16 * 56 / 896 = 32,768 pairs; x 2.25 = 73,728.
    assert pair_budget(32768, 16, 56, 896, 2.25) == 73_728
    assert pair_budget(4096, 16, 56, 896, 2.25) == 9_216  # T = 256: mean 4,096
    assert pair_budget(1000, 16, 56, 896, 2.25) == PAIR_BUDGET_LEAST == 4096  # 2,250 < least
    assert pair_budget(256, 16, 56, 896, 2.25) == 4096  # T = 16: the capacity 4,096
    assert pair_budget(10, 16, 56, 896, 2.25) == 160  # the capacity below least
    assert pair_budget(1000, 16, 56, 896, 1.0001) == 4096  # 1,001 pairs: least
    assert pair_budget(9000, 16, 56, 896, 1.5) == 13_500  # ceil(1.5 * 9,000)
    # Hot routing (one expert every token's first choice, here) fits the default skew at K3 on
    # 2..16 ranks and T = 1..4096: R * (1 + (K - 1)(E_local - 1)/(E - 1)) pairs.
    for ranks in (2, 4, 8, 16):
        local = 896 // ranks
        for tokens in (1, 16, 256, 2048, 4096):
            rows = ranks * tokens
            hot = rows * (1 + 15 * (local - 1) / 895)
            assert hot <= pair_budget(rows, 16, local, 896, engine_module.PAIR_BUDGET_SKEW)


def test_triton_workspace_at_the_budget_is_under_a_gib_at_k3_dep16_t2048():
    """TritonEngine.workspace_bytes, term by term (the interpreter case checks the terms against
    what a call allocates): N = 16 ranks, T = 2048, 56 local experts, the default skew."""
    rows, slots, pairs = 32768, 524_288, 73_728
    tiles = slots // 16 + 56  # tile_capacity at block_n 16
    want = pairs * (K3.intermediate + K3.latent) * 2  # BF16 act and y
    want += (3 * slots + 1) * 4 + 56 * 8  # pair tables, num_pairs, expert_pairs
    want += (3 * tiles + 1) * 4 + (2 * tiles * 16 + 1) * 4  # tiles and routes
    want += (slots // 1024) * 64 * 4  # histogram: 512 chunks x 64 bins
    got = TritonEngine().workspace_bytes(
        rows, 16, K3.latent, K3.intermediate, num_local=56, max_pairs=pairs
    )
    assert got == want == 992_485_484 and got < 2**30
    capacity = TritonEngine().workspace_bytes(rows, 16, K3.latent, K3.intermediate, num_local=56)
    assert capacity == want + (slots - pairs) * (K3.intermediate + K3.latent) * 2
    # A budget above the capacity is cut to it.
    assert capacity == TritonEngine().workspace_bytes(
        rows, 16, K3.latent, K3.intermediate, num_local=56, max_pairs=10**9
    )


def test_humming_workspace_at_the_budget_is_under_a_gib_at_k3_dep16_t2048():
    """HummingEngine.workspace_parts, term by term (the interpreter case checks the terms against
    what a call allocates): N = 16 ranks, T = 2048, 56 local experts, the default skew and
    chunk_pairs, humming's tiles of 16 pairs: the budget of 73,728 pairs in 5 chunks of 14,784,
    0.78 GiB, where the capacity in chunks takes 3.81 GiB and the slots' call 12.0 GB."""
    slots_call = HummingEngine(chunk_pairs=1 << 40).workspace_bytes(
        32768, 16, K3.latent, K3.intermediate, num_local=56, block_ns=(16,)
    )
    assert round(slots_call / 1e9, 1) == 12.0
    rows, slots, chunk = 32768, 524_288, 14_784
    engine = HummingEngine()
    plan = engine.plan(rows, 16, 73_728)
    assert plan == chunks_module.ChunkPlan(chunk=chunk, chunks=5, tuning_cap=16_384)
    tiles = slots // 16 + 56  # tile_capacity at block_n 16
    # A chunk's tiles: 924 + 2 * 56 = 1036; its route rows padded to 64: 16,576 slots, 1,088 tiles.
    assert chunks_module.route_row_shape(chunk, 16, 56, tiles) == (16_576, 1_088)
    want = (3 * slots + 1) * 4 + 56 * 8  # pair tables, num_pairs, expert_pairs
    want += (3 * tiles + 1) * 4 + (2 * tiles * 16 + 1) * 4  # tiles and routes
    want += (slots // 1024) * 64 * 4  # the grouping's histogram
    want += 5 * (16_576 + 1_088 + 2) * 4  # chunk routes: slots, experts, num_padded, pairs
    want += chunk * (K3.latent + K3.latent // 32 * 4)  # gathered e4m3 rows and fp32 scales
    want += chunk * 2 * K3.intermediate * 2  # FC1's BF16 output
    want += chunk * (K3.intermediate + K3.intermediate // 32 * 4)  # MXFP8 activation
    want += 5 * chunk * K3.latent * 2  # BF16 expert output of 73,920 pairs
    got = engine.workspace_bytes(
        rows, 16, K3.latent, K3.intermediate, num_local=56, max_pairs=73_728, block_ns=(16,)
    )
    assert got == want and got < 0.78 * 2**30
    # No budget: the chunks cover the capacity (32 of 16,384), the expert output 3.5 GiB of it.
    capacity = engine.workspace_bytes(rows, 16, K3.latent, K3.intermediate, num_local=56)
    assert engine.plan(rows, 16, None) == chunks_module.ChunkPlan(16_384, 32, 16_384)
    assert round(capacity / 2**30, 2) == 3.81
    # A budget past the capacity is the capacity; without num_local the chunk routes are bounded
    # by the chunk's pairs (a tile holds one of them at least), not by every slot.
    assert engine.plan(rows, 16, 10**9) == engine.plan(rows, 16, None)
    rough = engine.workspace_bytes(rows, 16, K3.latent, K3.intermediate, max_pairs=73_728)
    assert got < rough < 0.85 * 2**30
    # A call over at most chunk_pairs slots runs on them (its capacity, never over budget).
    assert engine.plan(1024, 16, 4096) is None and engine.plan(1025, 16, 4096) is not None
    assert HummingEngine(chunk_pairs=64).plan(5, 16, 1) == chunks_module.ChunkPlan(64, 1, 64)


def test_chunk_plan_arithmetic():
    """chunk_plan: on the slots up to chunk_pairs; else the budget (cut to 1..R * K) in as few
    chunks of at most chunk_pairs as it needs, of equal size rounded up to CHUNK_ALIGN, kernels
    tuned for at most the largest power of two <= min(chunk_pairs, the budget rounded up);
    chunk_tile_capacity's bound."""
    plan = chunks_module.chunk_plan
    assert plan(100, 16, 1600, 1600) is None  # 1600 slots fit a chunk of 1600
    assert plan(101, 16, 100, 1600) == chunks_module.ChunkPlan(128, 1, 128)
    # 1616 slots, budget 1616: two chunks of 808 -> 832, not two of 1600.
    assert plan(101, 16, 1616, 1600) == chunks_module.ChunkPlan(832, 2, 1024)
    assert plan(101, 16, 10**9, 1600) == plan(101, 16, 1616, 1600)  # cut to the capacity
    assert plan(101, 16, 0, 1600) == chunks_module.ChunkPlan(64, 1, 64)  # at least one pair
    # K3, N = 16, T = 2048: P exceeds the budget by less than CHUNK_ALIGN a chunk.
    big = plan(32768, 16, 73_728, 16_384)
    assert big.pairs == 73_920 and 0 <= big.pairs - 73_728 < 5 * chunks_module.CHUNK_ALIGN
    # Just past a chunk: two of 8,256, where whole chunks would hold 32,768.
    assert plan(1025, 16, 16_400, 16_384) == chunks_module.ChunkPlan(8_256, 2, 16_384)
    # Tiles a range of C pairs meets: ceil(C / block_n) + 2 * E_local, at most C and the tiling's.
    assert chunks_module.chunk_tile_capacity(64, 16, 6, 1000) == 4 + 12
    assert chunks_module.chunk_tile_capacity(64, 16, 6, 10) == 10
    assert chunks_module.chunk_tile_capacity(64, 16, 100, 10**6) == 64


def test_pair_skew_checked_before_the_device():
    weights = SyntheticLayer(TINY, 0).local_weights(0, 4)
    for skew, error, message in (
        ("2", TypeError, "pair_skew='2'; expected \"auto\", None or a number >= 1"),
        ("AUTO", TypeError, "pair_skew='AUTO'; expected \"auto\", None or a number >= 1"),
        (True, TypeError, "pair_skew=True; expected None or a number >= 1"),
        (0.5, ValueError, "pair_skew=0.5; expected None or a finite number >= 1"),
        (float("inf"), ValueError, "pair_skew=inf"),
        (float("nan"), ValueError, "pair_skew=nan"),
        # Found by a careless-user probe: a bare OverflowError naming nothing.
        (10**400, ValueError, "pair_skew=.{1,40} is outside the float range"),
        (torch.tensor([2.0]), TypeError, r"pair_skew=tensor\(\[2.\]\); expected None or a"),
    ):
        with pytest.raises(error, match=f"HopperExperts: {message}"):
            HopperExperts(weights, engine=TritonEngine(), pair_skew=skew)
    # Valid arguments on CPU: the device refusal.
    # Any real number, NumPy's and 0-dim torch numbers too (torch.tensor(2.0) was refused).
    for skew in (2, 2.5, np.int64(2), np.float32(2.5), torch.tensor(2.0)):
        with pytest.raises(RuntimeError, match="HopperExperts cannot run on cpu"):
            HopperExperts(weights, engine=TritonEngine(), pair_skew=skew)
    assert TritonEngine.takes_pair_budget and HummingEngine.takes_pair_budget
    # The default "auto" and a skew refuse nothing on either engine: the device refusal is all
    # that is left on CPU.
    for engine in (TritonEngine(), HummingEngine()):
        for skew in ("auto", 2.0, None):
            with pytest.raises(RuntimeError, match="HopperExperts cannot run on cpu"):
                HopperExperts(weights, engine=engine, pair_skew=skew)


def test_engines_check_their_options():
    """An engine's options are checked when it is made, on any machine."""
    for make, error, message in (
        (
            lambda: HummingEngine(deterministic="no"),
            TypeError,
            "HummingEngine: deterministic='no'; expected a bool",
        ),
        (
            lambda: HummingEngine(tune_for_capacity=1),
            TypeError,
            "HummingEngine: tune_for_capacity=1; expected a bool",
        ),
        (
            lambda: HummingEngine(tiles={"block_n": 16}),
            TypeError,
            "HummingEngine: tiles is dict; expected HopperTiles",
        ),
        (
            lambda: HummingEngine(chunk_pairs=100),
            ValueError,
            "HummingEngine: chunk_pairs=100; expected a positive multiple of 64",
        ),
        (
            lambda: HummingEngine(chunk_pairs=0),
            ValueError,
            "HummingEngine: chunk_pairs=0; expected a positive multiple of 64",
        ),
        (
            lambda: HummingEngine(chunk_pairs=True),
            TypeError,
            "HummingEngine: chunk_pairs=True; expected an int",
        ),
        (
            lambda: HummingEngine(chunk_pairs=1024.0),
            TypeError,
            "HummingEngine: chunk_pairs=1024.0; expected an int",
        ),
        (
            lambda: TritonEngine(tiles=None),
            TypeError,
            "TritonEngine: tiles is NoneType; expected HopperTiles",
        ),
    ):
        with pytest.raises(error, match=message):
            make()
    # An integer of another kind is kept as a Python int (as HopperTiles' sizes are).
    assert type(HummingEngine(chunk_pairs=np.int64(1024)).chunk_pairs) is int
    assert HummingEngine(chunk_pairs=np.int64(1024)) == HummingEngine(chunk_pairs=1024)
    assert (str(HummingEngine()), str(TritonEngine())) == ("humming", "triton")
    assert (HummingEngine.activation_format, TritonEngine.activation_format) == ("mxfp8", "bf16")
    assert TritonEngine().deterministic and not HummingEngine().deterministic
    assert HummingEngine(deterministic=True).deterministic
    # The tuned pair count: the uniform-routing expectation, or the capacity R * K.
    assert HummingEngine().tuning_pairs(100, 16, 56, 896) == tuning_pairs(100, 16, 56, 896) == 128
    assert HummingEngine(tune_for_capacity=True).tuning_pairs(100, 16, 56, 896) == 2048
    # Workspace: the same formulas as before the engines were classes (docs/experts.md: 189 MB
    # for humming at R = 512, K = 16, K3's widths).
    assert round(HummingEngine().workspace_bytes(512, 16, K3.latent, K3.intermediate) / 1e6) == 189
    assert TritonEngine().workspace_bytes(2, 3, 64, 32) == 2 * 3 * 64 + 6 * (32 + 64) * 2


def test_default_experts_checks_its_arguments():
    weights = SyntheticLayer(TINY, 0).local_weights(4, 4)
    with pytest.raises(TypeError, match="default_experts: weights is tuple; expected an Expert"):
        default_experts(weights.tensors)
    backend = default_experts(weights)
    assert type(backend) is ReferenceExperts and backend.first_expert == 4


def test_group_pairs_checks_its_arguments():
    ids = torch.tensor([[-1, 0], [1, -1]], dtype=torch.int32)
    for kwargs, message in (
        ({"first_expert": -1}, "first_expert=-1"),
        ({"block_n": 1.5}, "block_n=1.5"),
        ({"num_local": True}, "num_local=True"),
    ):
        args = {"first_expert": 0, "num_local": 2, "block_n": 16, **kwargs}
        with pytest.raises(ValueError, match=message):
            group_pairs(ids, **args)
    with pytest.raises(ValueError, match="ids torch.float32"):
        group_pairs(ids.float(), 0, 2, 16)


# ---- SM90 GPU ----------------------------------------------------------------------------------
def hopper_here() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device here"
    return HopperExperts.unsupported_reason(torch.device("cuda"))


GPU = pytest.mark.skipif(hopper_here() is not None, reason=f"HopperExperts: {hopper_here()}")
K3_WIDTHS = MoeGeometry(
    "k3-widths",
    hidden=K3.hidden,
    latent=K3.latent,
    experts=32,
    topk=K3.topk,
    intermediate=K3.intermediate,
)
TORCH_GROUPING = HopperTiles(grouping=Grouping.TORCH)
# Engine settings under test, with the relative L2 bound of their numerics.
ENGINES = {
    "humming": (HummingEngine(), HUMMING_REL_L2),
    "humming-deterministic": (HummingEngine(deterministic=True), HUMMING_REL_L2),
    "humming-capacity": (HummingEngine(tune_for_capacity=True), HUMMING_REL_L2),
    "triton": (TritonEngine(), EXPERTS_REL_L2),
    "humming-grouping-torch": (HummingEngine(tiles=TORCH_GROUPING), HUMMING_REL_L2),
    "triton-grouping-torch": (TritonEngine(tiles=TORCH_GROUPING), EXPERTS_REL_L2),
    # Chunks of 64 pairs: every call over more than 64 slots (rows > 4) runs in chunks, tiles cut
    # by the chunks' edges, most chunks of a 48-row call empty.
    "humming-chunks": (HummingEngine(chunk_pairs=64), HUMMING_REL_L2),
    "humming-chunks-deterministic": (
        HummingEngine(chunk_pairs=64, deterministic=True),
        HUMMING_REL_L2,
    ),
}
# The settings that promise bitwise reruns (humming's default may use stream-K).
DETERMINISTIC = [
    "humming-deterministic",
    "humming-chunks-deterministic",
    "triton",
    "triton-grouping-torch",
]


def engine(name: str) -> tuple[HopperEngine, float]:
    if name.startswith("humming") and importlib.util.find_spec("humming") is None:
        pytest.skip("engine 'humming' needs humming-kernels: pip install -e '.[gpu]'")
    return ENGINES[name]


def gpu_case(rows: int, seed: int, engine: HopperEngine, hot: bool = False):
    """(backend, layer, latent, x, sf, ids, weights) on the GPU: experts 0..7 of 32 are local."""
    gen = torch.Generator().manual_seed(seed)
    layer = SyntheticLayer(K3_WIDTHS, seed)
    backend = HopperExperts(layer.local_weights(0, 8).to("cuda"), engine=engine)
    ids = torch.stack([torch.randperm(32, generator=gen)[:16] for _ in range(rows)]).int()
    if hot:
        ids[:, 1:] = torch.where(ids[:, 1:] < 8, -1, ids[:, 1:])
        ids[:, 0] = 5
    latent = torch.randn(rows, K3.latent, generator=gen).to(torch.bfloat16)
    weights = torch.rand(rows, 16, generator=gen)
    x, sf = mxfp8_quantize(latent)
    return backend, layer, latent, x.cuda(), sf.cuda(), ids.cuda(), weights.cuda()


def poisoned(rows: int) -> torch.Tensor:
    return torch.full((rows, K3.latent), float("nan"), dtype=torch.bfloat16, device="cuda")


@GPU
@pytest.mark.parametrize("name", list(ENGINES))
@pytest.mark.parametrize("rows,hot", [(1, False), (48, False), (40, True)])
def test_gpu_edges_against_reference(name, rows, hot):
    setting, bound = engine(name)
    seed = fresh_seed()
    backend, layer, latent, x, sf, ids, weights = gpu_case(rows, seed, setting, hot)
    ids[0, :] = torch.where(ids[0] < 8, ids[0], -1)  # row 0: local ids and -1 only
    if rows > 2:
        ids[1, :] = torch.where(ids[1] < 8, -1, ids[1])  # row 1: no local id
    out = backend.forward(x, sf, ids, weights, poisoned(rows))
    local = (ids >= 0) & (ids < 8)
    written = local.any(dim=1)
    assert out[~written].isnan().all(), f"{name} seed {seed}: a row without a local id changed"
    want = expert_sums(latent.cuda(), torch.where(local, ids, -1), weights, layer.expert)
    got = out[written].double()
    assert not got.isnan().any(), f"{name} seed {seed}: NaN in a row with a local id"
    err = float((got - want[written]).norm() / want[written].norm())
    assert err < bound, f"{name} seed {seed}: relative L2 {err:.2e} > {bound:.2e}"


@GPU
@pytest.mark.parametrize("name", list(ENGINES))
def test_gpu_nan_rows_stay_in_their_rows(name):
    setting, _ = engine(name)
    seed = fresh_seed()
    backend, _, _, x, sf, ids, weights = gpu_case(48, seed, setting)
    local = ((ids >= 0) & (ids < 8)).any(dim=1)
    rows = local.nonzero().squeeze(1)
    x[rows[0], 7] = 0x7F  # an e4m3 NaN element
    sf[rows[1], 2] = 255  # an E8M0 NaN scale
    out = backend.forward(x, sf, ids, weights, poisoned(48))
    nan_rows = out[rows[:2]].isnan().any(dim=1)
    assert nan_rows.all(), (
        f"{name} seed {seed}: NaN input rows came out finite: {nan_rows.tolist()}"
    )
    assert not out[rows[2:]].isnan().any(), f"{name} seed {seed}: a NaN spread to another row"


@GPU
@pytest.mark.parametrize("name", DETERMINISTIC)
def test_gpu_bitwise_reruns_and_graph_replay(name):
    setting, _ = engine(name)
    seed = fresh_seed()
    backend, _, _, x, sf, ids, weights = gpu_case(64, seed, setting)
    first = backend.forward(x, sf, ids, weights, poisoned(64)).clone()
    again = backend.forward(x, sf, ids, weights, poisoned(64))
    assert torch.equal(first.view(torch.int16), again.view(torch.int16)), f"seed {seed}: rerun"
    out = poisoned(64)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.forward(x, sf, ids, weights, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        backend.forward(x, sf, ids, weights, out)
    # New routing and rows in the same buffers: the replay must follow them.
    _, _, _, x2, sf2, ids2, weights2 = gpu_case(64, seed + 1, TritonEngine())
    for src, dst in ((x2, x), (sf2, sf), (ids2, ids), (weights2, weights)):
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    eager = backend.forward(x, sf, ids, weights, poisoned(64))
    written = ((ids >= 0) & (ids < 8)).any(dim=1)
    assert torch.equal(out[written].view(torch.int16), eager[written].view(torch.int16)), (
        f"{name} seed {seed}: graph replay differs from eager"
    )
    assert out[~written].isnan().all(), f"{name} seed {seed}: replay wrote a row without local id"


@GPU
@pytest.mark.parametrize("name,budget", [("triton", 288), ("humming-chunks-deterministic", 320)])
def test_gpu_pair_budget_fits_overflows_and_replays(monkeypatch, name, budget):
    """An engine with a pair budget (PAIR_BUDGET_LEAST lowered so a small call has one; 1.5 x the
    mean of 192 pairs: 288, which the humming engine in chunks of 64 rounds up to 320): rows
    within it against the float64 reference; rows over it (every row holding all 8 local experts,
    384 pairs) NaN in every row, the overflow record raised by check_pair_budget, in eager and in
    graph replay (no host synchronisation), then a replay on rows within the budget equal to
    eager, bitwise. Outputs poisoned, fresh data."""
    monkeypatch.setattr(engine_module, "PAIR_BUDGET_LEAST", 1)
    setting, bound = engine(name)
    seed = fresh_seed()
    _, layer, latent, x, sf, ids, weights = gpu_case(48, seed, TritonEngine())
    backend = HopperExperts(layer.local_weights(0, 8).to("cuda"), pair_skew=1.5, engine=setting)
    assert backend.max_pairs(48, 16) == budget
    where = f"{name} seed {seed}"
    local = (ids >= 0) & (ids < 8)
    assert int(local.sum()) <= 288, f"{where}: {int(local.sum())} pairs drawn"  # 8 sd above 192
    written = local.any(dim=1)
    out = backend.forward(x, sf, ids, weights, poisoned(48))
    want = expert_sums(latent.cuda(), torch.where(local, ids, -1), weights, layer.expert)
    err = float((out[written].double() - want[written]).norm() / want[written].norm())
    assert err < bound, f"{where}: relative L2 {err:.2e}"
    assert out[~written].isnan().all(), f"{where}: a row without a local id changed"
    backend.check_pair_budget()  # nothing over the budget

    # Every row holds the 8 local experts: 384 pairs, over the budget of 288.
    full = ids.clone()
    full[:, :8] = torch.stack([torch.randperm(8) for _ in range(48)]).int().cuda()
    full[:, 8:] = torch.where(full[:, 8:] < 8, -1, full[:, 8:])
    full[::2, 8:] = -1  # half the rows: only the local ids; all rows still hold one
    finite = torch.full((48, K3.latent), 3.0, dtype=torch.bfloat16, device="cuda")
    over = backend.forward(x, sf, full, weights, finite.clone())
    assert over.isnan().all(), f"{where}: an overflowing call wrote a finite local row"
    with pytest.raises(RuntimeError, match="a call held 384 \\(row, local expert\\) pairs"):
        backend.check_pair_budget()  # 384 pairs: 8 per row
    backend.check_pair_budget()  # zeroed by the check

    # The same in a CUDA graph: capture on fitting rows, replay overflowing ones, then fitting.
    rows = [t.clone() for t in (x, sf, ids, weights)]
    graph_out = poisoned(48)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.forward(*rows, graph_out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        backend.forward(*rows, graph_out)
    rows[2].copy_(full)
    graph_out.fill_(3.0)
    graph.replay()
    assert graph_out.isnan().all(), f"{where}: an overflowing replay wrote a finite local row"
    with pytest.raises(RuntimeError, match="more than its pair budget"):
        backend.check_pair_budget()
    rows[2].copy_(ids)
    graph_out.fill_(float("nan"))
    graph.replay()
    eager = backend.forward(x, sf, ids, weights, poisoned(48))
    same = torch.equal(graph_out[written].view(torch.int16), eager[written].view(torch.int16))
    assert same, f"{where}: replay within the budget differs from eager"
    backend.check_pair_budget()


@GPU
@pytest.mark.parametrize("name", ["triton", "humming-chunks-deterministic"])
def test_gpu_step_failure_records_the_call_read_on_the_device(monkeypatch, name):
    """An overflowing call with a StepFailure as a transport hands it (a host-mapped record, the
    count of calls done on the device): KIND_EXPERTS and [FAILURE_PAIR_BUDGET, pairs, budget,
    tag, calls done + 1] in the record, eager and in graph replay (the replay reads the count on
    the device: call 10, then 11, the host zeroing the record between); a record already there
    stays, whatever its call. The compiled finalize's store_failure, beside the interpreter's
    (tests/helpers/hopper_interpreter_case.py)."""
    from dep_ep.comm.failure import FAILURE_PAIR_BUDGET, StepFailure, new_record
    from dep_ep.constants import KIND_EXPERTS

    monkeypatch.setattr(engine_module, "PAIR_BUDGET_LEAST", 1)
    setting, _ = engine(name)
    seed = fresh_seed()
    _, layer, _, x, sf, ids, weights = gpu_case(48, seed, TritonEngine())
    backend = HopperExperts(layer.local_weights(0, 8).to("cuda"), pair_skew=1.5, engine=setting)
    budget = backend.max_pairs(48, 16)
    assert budget < 384, f"{name}: budget {budget}"
    full = ids.clone()  # every row holds the 8 local experts: 384 pairs, over the budget
    full[:, :8] = torch.stack([torch.randperm(8) for _ in range(48)]).int().cuda()
    full[:, 8:] = torch.where(full[:, 8:] < 8, -1, full[:, 8:])
    status = torch.zeros(1, dtype=torch.int64, device="cuda")
    calls_done = torch.tensor([8], dtype=torch.int64, device="cuda")
    record, tag = new_record(pinned=True), -(1 << 62) + 3
    failure = StepFailure(status, record, tag, calls_done)
    backend.forward(x, sf, full, weights, poisoned(48), failure=failure)
    torch.cuda.synchronize()
    want = [FAILURE_PAIR_BUDGET, 384, budget, tag, 9]
    assert (int(status), record.tolist()) == (KIND_EXPERTS, want), f"{name} seed {seed}"
    record[1] = 7  # a record of call 9 already there stays
    backend.forward(x, sf, full, weights, poisoned(48), failure=failure)
    torch.cuda.synchronize()
    assert record.tolist() == [FAILURE_PAIR_BUDGET, 7, budget, tag, 9], f"{name} seed {seed}"
    rows = [t.clone() for t in (x, sf, full, weights)]
    out = poisoned(48)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.forward(*rows, out, failure=failure)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        backend.forward(*rows, out, failure=failure)
    calls_done.fill_(9)  # call 10 finds call 9's record: it stays
    graph.replay()
    torch.cuda.synchronize()
    assert record.tolist() == [FAILURE_PAIR_BUDGET, 7, budget, tag, 9], f"{name} seed {seed}"
    for done in (9, 10):  # the host read (zeroed) the record: calls 10 and 11 store theirs
        record.zero_()
        calls_done.fill_(done)
        graph.replay()
        torch.cuda.synchronize()
        want = [FAILURE_PAIR_BUDGET, 384, budget, tag, done + 1]
        assert record.tolist() == want, f"{name} seed {seed}: replay at {done} calls done"


@GPU
def test_gpu_fused_experts_budget_of_exactly_the_pairs_is_bitwise_the_capacity():
    """fused_experts with max_pairs = the pairs present equals no budget bitwise; one less gives NaN
    rows and the record (hot routing at K3 widths)."""
    seed = fresh_seed()
    backend, _, _, x, sf, ids, weights = gpu_case(40, seed, TritonEngine(), hot=True)
    p = backend.prepared
    pairs = int(((ids >= 0) & (ids < 8)).sum())
    args = (p.w13, p.s13, p.w2, p.s2, 0, x, sf, ids, weights)
    record = torch.zeros(1, dtype=torch.int32, device="cuda")
    outs = {}
    for budget in (None, pairs, pairs - 1):
        outs[budget] = fused_experts(
            *args, poisoned(40), p.tiles, p.programs, max_pairs=budget, pairs_over_budget=record
        )
    same = torch.equal(outs[None].view(torch.int16), outs[pairs].view(torch.int16))
    assert same, f"seed {seed}: a budget of exactly the {pairs} pairs changed the output"
    assert not outs[None].isnan().any() and outs[pairs - 1].isnan().all(), f"seed {seed}"
    assert int(record) == pairs, f"seed {seed}: record {int(record)}, {pairs} pairs"


@GPU
@pytest.mark.parametrize(
    "rows,topk,num_local,first,block_ns",
    [
        (16, 16, 56, 56, (16,)),
        (4096, 16, 56, 0, (16,)),
        (1024, 16, 448, 448, (64,)),
        (300, 8, 6, 3, (32,)),
        (0, 16, 56, 0, (16,)),
        (666, 16, 56, 0, (24, 32)),
        (1317, 16, 56, 0, (48, 56)),
        (512, 16, 448, 0, (40,)),
        (2637, 16, 56, 0, (56, 48)),
        (4096, 16, 56, 0, (8, 64)),
        # T = 2048 on a DEP16 shard: 332 chunks, whose prefix takes chunk_prefix_kernel 6 steps
        (21235, 16, 56, 0, (64,)),
        # 1024 bins: the prefix in 16 programs of 64 bins
        (4096, 16, 896, 0, (64,)),
    ],
)
def test_gpu_grouping_kernel_equals_torch(rows, topk, num_local, first, block_ns, monkeypatch):
    """group_and_route_tilings on the GPU against group_pairs + tile_routes per tile size on the
    same ids, bitwise, dtypes and shapes included; its outputs start as -7 (torch.empty poisoned
    during the call). One expert is hot (a third of the rows); -1 slots; ids of other ranks."""
    from dep_ep.experts.hopper.grouping_kernel import group_and_route_tilings

    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    experts = max(16 * num_local, first + num_local)
    ids = torch.rand(rows, experts, device="cuda", generator=gen).argsort(dim=1)[:, :topk].int()
    ids[::5, -1] = -1
    ids[1::3, 0] = first + num_local // 2
    ids = ids.contiguous()
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(-7))
    tilings = group_and_route_tilings(ids, first, num_local, block_ns)
    monkeypatch.undo()
    assert len(tilings) == len(block_ns)
    for (got, got_routes), block_n in zip(tilings, block_ns):
        want = group_pairs(ids, first, num_local, block_n)
        want_routes = tile_routes(want)
        pairs = [
            (f, getattr(got, f), getattr(want, f))
            for f in (
                "pair_row",
                "pair_flat",
                "num_pairs",
                "pair_slot",
                "tile_expert",
                "tile_start",
                "tile_rows",
                "num_tiles",
                "expert_pairs",
            )
        ]
        pairs += [
            (f"routes.{f}", getattr(got_routes, f), getattr(want_routes, f))
            for f in ("flat", "pair", "num_padded")
        ]
        for field, a, b in pairs:
            where = f"seed {seed} block_n {block_n}: {field}"
            assert a.dtype == b.dtype and a.shape == b.shape, f"{where} {a.dtype}"
            assert torch.equal(a, b), f"{where} differs"


@GPU
@pytest.mark.parametrize("rows", [3, 666, 4096])  # >= 3 rows of 112 bytes: every byte value
def test_gpu_widen_scales_equals_torch(rows):
    """widen_scales_kernel against comm/mxfp8.e8m0_to_fp32, bit for bit, on random E8M0 bytes
    with every byte value present (0: subnormal, 255: NaN); the output starts as NaN."""
    from dep_ep.experts.hopper.humming_engine import WIDEN_BLOCK
    from dep_ep.experts.hopper.kernels import widen_scales_kernel

    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sf = torch.randint(
        0, 256, (rows, K3.latent // 32), dtype=torch.uint8, device="cuda", generator=gen
    )
    sf.view(-1)[:256] = torch.arange(256, dtype=torch.uint8, device="cuda")
    out = torch.full(sf.shape, float("nan"), device="cuda")
    widen_scales_kernel[(-(-sf.numel() // WIDEN_BLOCK),)](sf, out, sf.numel(), WIDEN_BLOCK)
    want = e8m0_to_fp32(sf)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32)), f"seed {seed}"


@GPU
@pytest.mark.parametrize("rows", [1, 300, 2048])
def test_gpu_finalize_equals_torch(rows):
    """finalize_kernel against torch on values whose weighted sums are exact in fp32 (expert
    outputs small integers, weights multiples of 1/16), so any order gives the same sum and the
    BF16 rounding the same bits: each row's local pairs gathered from the right expert output
    rows with the right weights, bit for bit; rows without a local id keep their NaN."""
    from dep_ep.experts.hopper.kernels import finalize_kernel

    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    topk, num_local, latent = 16, 8, K3.latent
    block_l = HopperTiles().finalize_columns(latent)
    ids = torch.rand(rows, 32, device="cuda", generator=gen).argsort(dim=1)[:, :topk].int()
    ids[::4] = torch.where(ids[::4] < num_local, -1, ids[::4])  # every fourth row: none local
    ids[1::5, 3] = -1
    groups = group_pairs(ids.contiguous(), 0, num_local, 16)
    y = torch.randint(-64, 64, (groups.pair_capacity, latent), device="cuda", generator=gen)
    y = y.to(torch.bfloat16)
    weights = torch.randint(0, 17, (rows, topk), device="cuda", generator=gen).float() / 16
    out = torch.full((rows, latent), float("nan"), dtype=torch.bfloat16, device="cuda")
    record = torch.zeros(1, dtype=torch.int32, device="cuda")
    budget = (groups.num_pairs, groups.pair_capacity, record)  # y holds every pair: no overflow
    slots = groups.pair_slot.reshape(rows, topk)
    finalize_kernel[(rows, latent // block_l)](
        y, slots, weights, out, *budget, latent, topk, block_l
    )
    assert int(record) == 0, f"seed {seed}: overflow recorded within the capacity"
    slot = groups.pair_slot.reshape(rows, topk).long()
    local = slot >= 0
    gathered = y[slot.clamp(min=0)].double() * (weights * local).double()[:, :, None]
    want = gathered.sum(dim=1).float().bfloat16()
    written = local.any(dim=1)
    assert out[~written].isnan().all(), f"seed {seed}: a row without a local id was written"
    assert torch.equal(out[written].view(torch.int16), want[written].view(torch.int16)), (
        f"seed {seed}: finalize differs from torch"
    )


@GPU
def test_gpu_humming_refuses_a_wide_scale_spread():
    engine("humming")
    layer = SyntheticLayer(K3_WIDTHS, 0)
    weights = layer.local_weights(0, 4).to("cuda")
    weights.s13[2, 0, 0] = int(weights.s13[2].max()) - 12
    with pytest.raises(ValueError, match=r"s13 of local expert\(s\) \[2\] spread over \[1[2-9]\]"):
        HopperExperts(weights, engine=HummingEngine())


@GPU
def test_gpu_decode_changes_apply_to_the_kernel_humming_picks_at_k3():
    """The engine's decode changes (humming_gemm.FC1_UPDATES, FC2_UPDATES) apply to humming's
    real picks where they are the kernel the changes were measured on (DECODE_KERNEL: its pick
    for 16, 32 and 64 pairs at 56, 112 and 448 local experts, docs/results/humming_decode_call);
    any other pick (humming's depends on the expert count: over the 4 experts here it picked 1
    CTA an SM for FC2's 16 pairs, and 16-pair blocks for 64 pairs, on one H100) and the
    deterministic engine's picks (no stream-K) stay humming's."""
    engine("humming")
    weights = SyntheticLayer(K3_WIDTHS, 0).local_weights(0, 4).to("cuda")
    for deterministic in (False, True):
        prepared = HopperExperts(
            weights, engine=HummingEngine(deterministic=deterministic)
        ).prepared
        for name, gemm, updates in (
            ("fc1", prepared.fc1, humming_gemm.FC1_UPDATES),
            ("fc2", prepared.fc2, humming_gemm.FC2_UPDATES),
        ):
            for pairs in humming_gemm.DECODE_PAIRS:
                choice = gemm.heuristic(pairs)
                held = {key: choice.get(key) for key in humming_gemm.DECODE_KERNEL}
                held["block_shape"] = tuple(held["block_shape"])
                decode = held == humming_gemm.DECODE_KERNEL
                assert not (decode and deterministic), f"{name}, {pairs} pairs: {choice}"
                change = updates[pairs][1] if decode else {}
                assert gemm.tuning(pairs) == {**choice, **change, "use_pdl": False}, (name, pairs)


def test_humming_layout_index_covers_every_nibble_once():
    """humming_layout.prepared_index over one expert: every nibble of its K/32 x 4N words holds
    one element's magnitude and one element's sign; each 64-row block of a k32 group is one
    contiguous KiB (256 words); each group's scale columns are a permutation of the rows."""
    for rows, k in ((64, 64), (128, 192), (256, 512)):
        index = humming_layout.prepared_index(rows, k)
        words = k // 32 * 4 * rows
        for part in ("magnitude", "sign"):
            nibble = index["word"] * 8 + index[part]
            counts = torch.bincount(nibble.reshape(-1), minlength=8 * words)
            assert counts.numel() == 8 * words and bool((counts == 1).all()), (rows, k, part)
        block = index["word"][:64, :32]
        assert block.min() == 0 and block.max() == 255, (rows, k)
        assert sorted(index["scale"][:, 0].tolist()) == list(range(rows)), (rows, k)
    with pytest.raises(ValueError, match="rows=96"):
        humming_layout.prepared_index(96, 64)


def test_humming_layout_values_read_each_element_from_its_nibbles():
    """prepared_values on words packed element by element through prepared_index (random
    magnitudes, signs and exponents): every value comes back, signed and scaled."""
    gen = torch.Generator().manual_seed(fresh_seed())
    experts, rows, k = 2, 128, 128
    index = humming_layout.prepared_index(rows, k)
    magnitude = torch.randint(0, 8, (experts, rows, k), generator=gen)
    negative = torch.randint(0, 2, (experts, rows, k), generator=gen)
    exponent = torch.randint(1, 13, (experts, k // 32, rows), generator=gen)
    words = torch.zeros(experts, k // 32 * 4 * rows, dtype=torch.int64)
    for e in range(experts):
        for part, bits in (("magnitude", magnitude[e]), ("sign", negative[e] << 3)):
            shifted = bits << (4 * index[part])
            words[e].index_add_(0, index["word"].reshape(-1), shifted.reshape(-1))
    weight = (words - (words >= 2**31) * 2**32).int().reshape(experts, k // 32, 4 * rows)
    scale_bytes = torch.empty(experts, k // 32 * rows, dtype=torch.uint8)
    for e in range(experts):
        flat = exponent[e].transpose(0, 1).reshape(rows, k // 32)
        scale_bytes[e, index["scale"].reshape(-1)] = flat.reshape(-1).to(torch.uint8)
    scale_2 = torch.tensor([2.0**-3, 2.0**2])
    got = humming_layout.prepared_values(weight, scale_bytes.view(experts, k // 32, rows), scale_2)
    table = torch.tensor(E2M1_VALUES[:8])
    per_row = exponent.transpose(1, 2).repeat_interleave(32, dim=2).float()
    want = table[magnitude] * torch.exp2(per_row) * scale_2.view(-1, 1, 1)
    want = torch.where(negative.bool(), -want, want)
    assert torch.equal(got, want)


def test_humming_layout_prepared_weights_hold_the_checkpoint_values():
    """prepared_weights packs checkpoint MXFP4 weights (fresh random codes, scale bytes over the
    largest spread the layout holds) into the prepared tensors' layout: prepared_values reads
    back every value exactly, every s' in 1..12 and the largest 12; a wider spread, a shape the
    layout cannot hold, another dtype of either, a scale byte of 255 and two devices are
    refused."""
    gen = torch.Generator().manual_seed(fresh_seed())
    experts, rows, k = 3, 128, 192
    spread = humming_gemm.FUSED_SCALE_SPREAD
    w = torch.randint(0, 256, (experts, rows, k // 2), dtype=torch.uint8, generator=gen)
    low = torch.randint(100, 130, (experts, 1, 1), generator=gen)
    s = (low + torch.randint(0, spread + 1, (experts, rows, k // 32), generator=gen)).to(
        torch.uint8
    )
    s[:, 0, 0] = (low.flatten() + spread).to(torch.uint8)  # each expert's full spread
    s[:, 1, 0] = low.flatten().to(torch.uint8)
    weight, scale, scale_2 = humming_layout.prepared_weights(w, s)
    assert weight.dtype == torch.int32 and tuple(weight.shape) == (experts, k // 32, 4 * rows)
    assert tuple(scale.shape) == (experts, k // 32, rows) and scale_2.dtype == torch.float32
    assert int(scale.min()) == 1 and int(scale.max()) == 12
    want = torch.stack([mxfp4_dequantize(w[e], s[e], torch.float32) for e in range(experts)])
    assert torch.equal(humming_layout.prepared_values(weight, scale, scale_2), want)
    wide = s.clone()
    wide[1, 2, 3] = int(low[1]) + spread + 1
    with pytest.raises(ValueError, match=r"experts \[1\] spread over more than 11"):
        humming_layout.prepared_weights(w, wide)
    shape = "N, K positive multiples of 64"
    with pytest.raises(ValueError, match=shape):
        humming_layout.prepared_weights(w[:, :96], s[:, :96])
    with pytest.raises(ValueError, match=shape):
        humming_layout.prepared_weights(w[:0], s[:0])
    with pytest.raises(ValueError, match="expected uint8"):
        humming_layout.prepared_weights(w.int(), s)
    # Found by a careless-user probe: signed or float scale bytes gave zero or truncated
    # scales, and a 2-D w an unpacking error.
    for bad_s in (s.view(torch.int8), s.float() + 0.7):
        with pytest.raises(ValueError, match="expected uint8"):
            humming_layout.prepared_weights(w, bad_s)
    with pytest.raises(ValueError, match="expected uint8"):
        humming_layout.prepared_weights(w[0], s[0])
    nan = s.clone()
    nan[0] = 255
    with pytest.raises(ValueError, match="255, E8M0's NaN"):
        humming_layout.prepared_weights(w, nan)
    with pytest.raises(ValueError, match="expected one device"):
        humming_layout.prepared_weights(w.to("meta"), s)


def test_humming_layout_prepared_tensors_take_humming_s_dict_as_prepared_weights_give_them():
    """prepared_tensors hands on humming's weight and weight_scale as they are and its
    weight_scale_2, whatever its dtype and shape, as a contiguous fp32 [E] of the same values."""
    weight = torch.zeros(3, 2, 256, dtype=torch.int32)
    scale = torch.zeros(3, 2, 64, dtype=torch.uint8)
    scale_2 = torch.tensor([[0.5, 2.0, 8.0]], dtype=torch.bfloat16).t()  # [3, 1], not contiguous
    got = humming_layout.prepared_tensors(
        {"weight": weight, "weight_scale": scale, "weight_scale_2": scale_2}
    )
    assert got[0] is weight and got[1] is scale
    assert got[2].dtype == torch.float32 and got[2].is_contiguous()
    assert torch.equal(got[2], torch.tensor([0.5, 2.0, 8.0]))


def test_humming_layout_e4m3_expansion_gives_every_value():
    """expanded_e4m3_words, the word-level expansion the narrow GEMM's humming form runs on
    humming's prepared words (two byte permutes over a table of s', the signs moved in), on words
    packed through prepared_index with every (magnitude, sign, s' in 1..12) drawn at random: each
    element's e4m3 byte times 2^6 * weight_scale_2 equals prepared_values' value, every byte
    finite. Its byte permute against a byte-by-byte selection, and the table against the e4m3
    bytes of E2M1 * 2^(s' - 6) for every s'."""
    gen = torch.Generator().manual_seed(fresh_seed())
    rows, k = 128, 128
    index = humming_layout.prepared_index(rows, k)
    magnitude = torch.randint(0, 8, (rows, k), generator=gen)
    negative = torch.randint(0, 2, (rows, k), generator=gen)
    exponent = torch.randint(1, 13, (k // 32, rows), generator=gen)
    words = torch.zeros(k // 32 * 4 * rows, dtype=torch.int64)
    for part, bits in (("magnitude", magnitude), ("sign", negative << 3)):
        words.index_add_(0, index["word"].reshape(-1), (bits << (4 * index[part])).reshape(-1))
    weight = (words - (words >= 2**31) * 2**32).int().reshape(1, k // 32, 4 * rows)
    scale_bytes = torch.empty(k // 32 * rows, dtype=torch.uint8)
    flat = exponent.transpose(0, 1).reshape(rows, k // 32)
    scale_bytes[index["scale"].reshape(-1)] = flat.reshape(-1).to(torch.uint8)
    scale_2 = torch.tensor([2.0**-5])
    want = humming_layout.prepared_values(weight, scale_bytes.view(1, k // 32, rows), scale_2)[0]
    # Each word's s': the scale of its row and group (every element of a word shares them).
    word_exponent = torch.zeros_like(words)
    word_exponent[index["word"].reshape(-1)] = (
        scale_bytes.long()[index["scale"]].repeat_interleave(32, dim=1).reshape(-1)
    )
    expanded = humming_layout.expanded_e4m3_words(weight.reshape(-1), word_exponent)
    half = (torch.arange(k) % 32 // 16).expand(rows, k)
    byte = (expanded[index["word"], half] >> (8 * (torch.arange(k) % 4))) & 0xFF
    value = byte.to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert bool(value.isfinite().all())
    assert torch.equal(value * 2.0**6 * scale_2[0], want)

    low = torch.randint(0, 2**32, (64,), generator=gen)
    high = torch.randint(0, 2**32, (64,), generator=gen)
    selectors = torch.randint(0, 2**16, (64,), generator=gen) & 0x7777
    got = humming_layout.permute_bytes(low, high, selectors)
    for i in range(4):
        pick = (selectors >> (4 * i)) & 7
        source = torch.stack(
            [(low >> (8 * b)) & 0xFF for b in range(4)]
            + [(high >> (8 * b)) & 0xFF for b in range(4)],
            1,
        )
        assert torch.equal((got >> (8 * i)) & 0xFF, source.gather(1, pick.unsqueeze(1)).squeeze(1))
    for small in humming_layout.SMALL_EXPONENTS:
        low_word, high_word = humming_layout.e4m3_table(torch.tensor(small))
        table = [(int(w) >> (8 * b)) & 0xFF for w in (low_word, high_word) for b in range(4)]
        e4m3 = torch.tensor(table, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        assert torch.equal(e4m3, torch.tensor(E2M1_VALUES[:8]) * 2.0 ** (small - 6)), small


@GPU
def test_gpu_humming_layout_reads_humming_prepared_weights_exactly():
    """prepared_values on the tensors humming prepares (HummingGemm.prepare, FC1 and FC2 of K3's
    widths, fresh random weights within the scale spread) equals the checkpoint's MXFP4 values
    element for element: humming_layout's index map is humming's."""
    engine("humming")
    seed = fresh_seed()
    weights = SyntheticLayer(K3_WIDTHS, seed).local_weights(0, 2).to("cuda")
    prepared = HopperExperts(weights, engine=HummingEngine()).prepared
    for name, gemm, packed, scales in (
        ("fc1", prepared.fc1, weights.w13, weights.s13),
        ("fc2", prepared.fc2, weights.w2, weights.s2),
    ):
        t = gemm.tensors
        got = humming_layout.prepared_values(t["weight"], t["weight_scale"], t["weight_scale_2"])
        want = mxfp4_dequantize(packed, scales, torch.float32)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        wrong = int((got != want).sum())
        assert wrong == 0, f"{name} seed {seed}: {wrong} of {want.numel()} values differ"


def test_default_backend_on_cpu_is_the_reference():
    assert default_experts_class("cpu") is ReferenceExperts


def test_default_engine_needs_humming_and_its_sizes():
    humming = importlib.util.find_spec("humming") is not None
    want = HummingEngine if humming and humming_engine.humming_installed() else TritonEngine
    assert type(default_engine(K3.latent, K3.intermediate)) is want
    assert type(default_engine(256, 128)) is TritonEngine  # TINY: humming has not run at such sizes
    torch_grouping = HopperTiles(grouping=Grouping.TORCH)
    assert default_engine(256, 128, tiles=torch_grouping) == TritonEngine(tiles=torch_grouping)


@pytest.mark.parametrize("release", ["0.1.12", "0.1.19", None])
def test_default_engine_takes_only_the_humming_release_it_wraps(monkeypatch, release):
    """humming-kernels 0.1.12 (SGLang 0.5.23's) lacks API the humming engine calls: only the
    wrapped release (0.1.19) gives HummingEngine; another or none gives TritonEngine, and
    HummingEngine.prepare names the release found."""
    monkeypatch.setattr(humming_engine, "humming_release", lambda: release)
    want = HummingEngine if release == humming_engine.HUMMING_RELEASE else TritonEngine
    assert type(default_engine(K3.latent, K3.intermediate)) is want
    if release == "0.1.12":
        with pytest.raises(RuntimeError, match=r"humming-kernels 0\.1\.19 \(found 0\.1\.12\)"):
            HummingEngine().prepare("t", None, 1)


def test_tile_routes_lay_out_blocks():
    """tile_routes(): slot i of tile t holds pair tile_start + i's flat slot (or pair number), or
    the sentinel R * K; unused tiles lie past num_padded and hold the sentinel."""
    # Experts 0..3 local; pairs: e0 (0,0) (1,2); e1 (2,1); e2 (0,1) (1,0) (1,1) (2,2).
    ids = torch.tensor([[0, 2, -1], [2, 2, 0], [5, 1, 2]], dtype=torch.int32)
    groups = group_pairs(ids, 0, 4, 2)
    routes = tile_routes(groups)
    assert int(routes.num_padded) == 2 * 4 and routes.sentinel == 9  # e0 [2], e1 [1], e2 [2, 2]
    assert routes.flat[:8].tolist() == [0, 5, 7, 9, 1, 3, 4, 8], routes.flat.tolist()
    assert routes.pair[:8].tolist() == [0, 1, 2, 9, 3, 4, 5, 6], routes.pair.tolist()
    assert groups.tile_expert[:4].tolist() == [0, 1, 2, 2], groups.tile_expert.tolist()
    assert routes.flat.shape[0] == groups.tile_capacity * 2 and (routes.flat[8:] == 9).all()
    assert (routes.pair[8:] == 9).all()


@GPU
def test_gpu_default_experts_is_hopper():
    layer = SyntheticLayer(K3_WIDTHS, 0)
    backend = default_experts(layer.local_weights(4, 4).to("cuda"))
    assert type(backend) is HopperExperts, type(backend).__name__
    humming = importlib.util.find_spec("humming") is not None
    assert type(backend.engine) is (HummingEngine if humming else TritonEngine)
    assert backend.first_expert == 4 and backend.num_experts == 32
    # Expected pairs: R x 16 x (4/32) / (1 - (28/32)^16) = 2.27 R; capacity R x min(16, 4).
    assert backend.tuning_pairs(12, 16) == 32  # 27.2 expected
    assert backend.tuning_pairs(64, 16) == 128  # 145 expected


@GPU
@pytest.mark.parametrize("name", ["triton", "humming"])
def test_gpu_default_pair_skew_is_the_budget(name):
    """pair_skew="auto" (the default) on either engine: PAIR_BUDGET_SKEW, with device_failures
    (EpRouted hands it the step's StepFailure); None: neither."""
    setting, _ = engine(name)
    weights = SyntheticLayer(K3_WIDTHS, 0).local_weights(0, 4).to("cuda")
    backend = HopperExperts(weights, engine=setting)
    assert backend.pair_skew == engine_module.PAIR_BUDGET_SKEW and backend.device_failures
    assert HopperExperts(weights, engine=setting, pair_skew=None).device_failures is False


@GPU
@pytest.mark.parametrize("hot", [False, True])
def test_gpu_humming_in_chunks_is_bitwise_the_call_on_the_slots(hot):
    """HummingEngine(deterministic=True) in chunks of 256 pairs (48 rows: 768 slots, 3 chunks, the
    kernels chosen for 256 pairs either way) equals the call on the slots bitwise, on fresh rows
    with outputs poisoned; under hot routing one expert's pairs span the chunks."""
    seed = fresh_seed()
    slots, _ = engine("humming-deterministic")
    backend, _, _, x, sf, ids, weights = gpu_case(48, seed, slots, hot=hot)
    chunked = HopperExperts(
        SyntheticLayer(K3_WIDTHS, seed).local_weights(0, 8).to("cuda"),
        engine=HummingEngine(chunk_pairs=256, deterministic=True),
    )
    assert backend.prepared.plan(48, 16) is None
    assert chunked.prepared.plan(48, 16) == chunks_module.ChunkPlan(256, 3, tuning_cap=256)
    assert backend.tuning_pairs(48, 16) == chunked.prepared.tuning_pairs(48, 16) == 256
    want = backend.forward(x, sf, ids, weights, poisoned(48))
    got = chunked.forward(x, sf, ids, weights, poisoned(48))
    written = ((ids >= 0) & (ids < 8)).any(dim=1)
    assert not want[written].isnan().any(), f"seed {seed}: NaN in a row with a local id"
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
        f"seed {seed} hot={hot}: the call in chunks differs from the call on the slots"
    )


@GPU
@pytest.mark.parametrize(
    "name,chunk_pairs", [("humming", 1024), ("humming", 1 << 40), ("triton", 0)]
)
def test_gpu_workspace_bytes_is_what_a_call_allocates(monkeypatch, name, chunk_pairs):
    """The bytes of the blocks torch's allocator hands out during a call (its memory history)
    sum to workspace_bytes, and the call frees them all: 256 rows of K3 widths, budget 2.25 x the
    mean (PAIR_BUDGET_LEAST lowered), the humming engine in chunks of 1024 pairs and on the slots,
    and the triton engine. (The allocator's peak above its start can exceed the sum by less than
    a 2 MiB segment a large tensor: measured 771 KB for the triton engine's two.)"""
    monkeypatch.setattr(engine_module, "PAIR_BUDGET_LEAST", 1)
    seed = fresh_seed()
    setting, _ = engine(name)
    if name == "humming":
        setting = HummingEngine(chunk_pairs=chunk_pairs)
    backend, _, _, x, sf, ids, weights = gpu_case(256, seed, setting)
    out = poisoned(256)
    backend.forward(x, sf, ids, weights, out)  # compiles
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        backend.forward(x, sf, ids, weights, out)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for trace in snapshot["device_traces"] for e in trace]
    allocated = sum(e["size"] for e in events if e["action"] == "alloc")
    freed = sum(e["size"] for e in events if e["action"] == "free_requested")
    parts = backend.prepared.workspace_parts(256, 16)
    where = f"{name} {chunk_pairs} seed {seed}"
    assert allocated == backend.workspace_bytes(256, 16), f"{where}: {allocated} != {parts}"
    assert freed == allocated, f"{where}: {allocated} allocated, {freed} freed"


def test_the_engines_say_whether_they_copy_the_weights():
    """`copies_weights` (EpMoeLayer watches the tensors of a backend that copies them): the triton
    engine reads the caller's contiguous tensors in place and copies a non-contiguous one; the
    humming engine always keeps its own re-laid copy."""
    weights = SyntheticLayer(TINY, seed=1).local_weights(0, 4)
    assert TritonEngine().prepare("T", weights, 1).copies_weights is False
    w2 = weights.w2.transpose(1, 2).contiguous().transpose(1, 2)  # same values, not contiguous
    strided = type(weights)(
        weights.w13, weights.s13, w2, weights.s2, first_expert=0, num_experts=TINY.experts
    )
    assert TritonEngine().prepare("T", strided, 1).copies_weights is True
    from dep_ep.experts.hopper.humming_engine import HummingPrepared

    assert HummingPrepared.copies_weights is True
