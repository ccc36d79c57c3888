"""One HopperExperts kernel case in Triton's CPU interpreter, run in its own process:

    TRITON_INTERPRET=1 python -m helpers.hopper_interpreter_case CASE SEED   (from tests/)

The interpreter must be chosen before triton is imported, hence the separate process. Runs the
three kernels (math "fp32": the interpreter has no dot_scaled and multiplies BF16 wrongly) on fresh
random rows at a small geometry, output poisoned with NaN, and compares with the all-gather
reference's float64 expert sums. Exits 0 and prints "ok ..." when every check holds, else raises.

CASE: "mixed" (rows without a local id, -1 slots, one NaN input row), "hot" (every row's first
id is the same local expert; the other local experts have no rows), "single" (one row),
"hot-grouping-kernel" ("hot" grouped by experts/hopper/grouping_kernel.py; the others group in
torch), "budget" (the pair budget, `budget`: the "mixed" rows grouped by the kernel, with a budget
of exactly their pairs bitwise equal to no budget, and one pair less NaN in every row with a local
id and nowhere else, the overflow record the most pairs seen; the bytes the call allocates equal
`workspace_parts`; with a StepFailure an overflowing call stores KIND_EXPERTS and the first
failure [code, pairs, budget, tag, call] until the host zeroes it, a fitting one nothing).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dep_ep.comm.failure import FAILURE_PAIR_BUDGET, StepFailure, new_record
from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.config import MoeGeometry
from dep_ep.constants import KIND_EXPERTS
from dep_ep.experts.hopper import Grouping, HopperTiles
from dep_ep.experts.hopper.triton_engine import fused_experts, workspace_parts
from dep_ep.testing.allgather_reference import expert_sums
from dep_ep.testing.synthetic import SyntheticLayer
from dep_ep.testing.tolerance import EXPERTS_REL_L2

GEOMETRY = MoeGeometry("interp", hidden=256, latent=128, experts=24, topk=4, intermediate=64)
FIRST, COUNT = 8, 6  # this rank's experts 8..13
# Small blocks so that several tiles, M blocks and K steps run; block_n 16 with 40 rows cuts the
# hot expert's pairs into three tiles.
TILES = HopperTiles(
    block_n=16,
    fc1_block_m=32,
    fc1_block_k=64,
    fc2_block_m=64,
    fc2_block_k=64,
    finalize_block_l=64,
    math="fp32",
    grouping=Grouping.TORCH,
)
PROGRAMS = 5
KERNEL_GROUPING = "-grouping-kernel"  # case suffix: grouped by experts/hopper/grouping_kernel.py


def rows_for(case: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [R, K], weights fp32 [R, K]) of the case."""
    g, rows = GEOMETRY, {"mixed": 24, "hot": 40, "single": 1}[case]
    ids = torch.stack([torch.randperm(g.experts, generator=gen)[: g.topk] for _ in range(rows)])
    if case == "mixed":
        ids[::4] = torch.where((ids[::4] >= FIRST) & (ids[::4] < FIRST + COUNT), -1, ids[::4])
        ids[1::5, -1] = -1
    elif case == "hot":
        others = ids[:, 1:]
        ids[:, 1:] = torch.where((others >= FIRST) & (others < FIRST + COUNT), -1, others)
        ids[:, 0] = FIRST + 2
    else:
        ids[0, 1] = FIRST + COUNT - 1
        ids[0, 2] = -1
    return ids.int(), torch.rand(rows, g.topk, generator=gen)


def main(case: str, seed: int) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    name, tiles = case, TILES
    if case.endswith(KERNEL_GROUPING):
        case, tiles = (
            case.removesuffix(KERNEL_GROUPING),
            dataclasses.replace(TILES, grouping=Grouping.TRITON),
        )
    gen = torch.Generator().manual_seed(seed)
    layer = SyntheticLayer(GEOMETRY, seed)
    w13, s13, w2, s2 = layer.local(FIRST, COUNT)
    ids, weights = rows_for(case, gen)
    latent = torch.randn(ids.shape[0], GEOMETRY.latent, generator=gen).to(torch.bfloat16)
    x, sf = mxfp8_quantize(latent)
    local = (ids >= FIRST) & (ids < FIRST + COUNT)
    nan_row = int(local.any(dim=1).nonzero()[-1]) if case == "mixed" else None
    if nan_row is not None:
        sf[nan_row, 1] = 255  # an E8M0 NaN: the block of elements 32..63 is NaN
    out = torch.full((ids.shape[0], GEOMETRY.latent), float("nan"), dtype=torch.bfloat16)
    fused_experts(w13, s13, w2, s2, FIRST, x, sf, ids, weights, out, tiles, PROGRAMS)

    written = local.any(dim=1)
    assert out[~written].isnan().all(), f"{name} seed {seed}: a row without a local id changed"
    finite = written.clone()
    if nan_row is not None:
        assert out[nan_row].isnan().all(), f"{name} seed {seed}: the NaN row's output is finite"
        finite[nan_row] = False
    got = out[finite].double()
    assert not got.isnan().any(), f"{name} seed {seed}: NaN in a row with a local id"
    want = expert_sums(latent, torch.where(local, ids, -1), weights, layer.expert)[finite]
    err = float((got - want).norm() / want.norm())
    assert err < EXPERTS_REL_L2, f"{name} seed {seed}: relative L2 {err:.2e} > {EXPERTS_REL_L2:.2e}"
    print(f"ok {name} seed {seed}: {int(finite.sum())} rows, relative L2 {err:.2e}")


class CountAllocations(TorchDispatchMode):
    """Sums the bytes of the tensors torch's empty/zeros/full factories make while active."""

    FACTORIES = ("empty", "empty_strided", "zeros", "full", "empty_like", "zeros_like")

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.FACTORIES:
            self.bytes += out.numel() * out.element_size()
        return out


def budget(seed: int) -> None:
    """The "budget" case (module docstring)."""
    tiles = dataclasses.replace(TILES, grouping=Grouping.TRITON)
    gen = torch.Generator().manual_seed(seed)
    layer = SyntheticLayer(GEOMETRY, seed)
    w13, s13, w2, s2 = layer.local(FIRST, COUNT)
    ids, weights = rows_for("mixed", gen)
    latent = torch.randn(ids.shape[0], GEOMETRY.latent, generator=gen).to(torch.bfloat16)
    x, sf = mxfp8_quantize(latent)
    local = (ids >= FIRST) & (ids < FIRST + COUNT)
    written, pairs = local.any(dim=1), int(local.sum())
    rows, topk = ids.shape
    where = f"budget seed {seed}, {pairs} pairs"

    def call(max_pairs, record, failure=None):
        out = torch.full((rows, GEOMETRY.latent), 7.0, dtype=torch.bfloat16)
        args = (w13, s13, w2, s2, FIRST, x, sf, ids, weights, out, tiles, PROGRAMS)
        counted = CountAllocations()
        with counted:
            fused_experts(*args, max_pairs=max_pairs, pairs_over_budget=record, failure=failure)
        parts = workspace_parts(rows, topk, GEOMETRY.latent, GEOMETRY.intermediate, COUNT, tiles)
        if max_pairs is not None:
            parts = workspace_parts(
                rows, topk, GEOMETRY.latent, GEOMETRY.intermediate, COUNT, tiles, max_pairs
            )
        assert counted.bytes == sum(parts.values()), f"{where}: {counted.bytes} bytes != {parts}"
        assert (out[~written] == 7.0).all(), f"{where}: a row without a local id changed"
        return out

    record = torch.zeros(1, dtype=torch.int32)
    free = call(None, record)
    assert not free[written].isnan().any(), f"{where}: NaN in a row with a local id"
    exact = call(pairs, record)
    same = torch.equal(exact.view(torch.int16), free.view(torch.int16))
    assert same and int(record) == 0, f"{where}: a budget of exactly the pairs changed the call"
    over = call(pairs - 1, record)
    assert over[written].isnan().all(), f"{where}: budget {pairs - 1}: a local row is not NaN"
    assert int(record) == pairs, f"{where}: overflow record {int(record)}"
    call(1, record)  # overflows by as many pairs: the record keeps the most seen
    call(pairs, record)  # fits: the record stays
    assert int(record) == pairs, f"{where}: overflow record {int(record)} after a fitting call"
    # With a StepFailure (comm/failure.py): a fitting call stores nothing; an overflowing one
    # KIND_EXPERTS into the status word and [code, pairs, budget, tag, call] into the record
    # (call: the transport's calls done + 1), whose first failure stays until the host zeroes it,
    # a later call's included.
    status, failed = torch.zeros(1, dtype=torch.int64), new_record(pinned=False)
    calls_done = torch.tensor([11])
    tag = -(1 << 62) + seed % 1000  # an EpMoeLayer tag: needs 64 bits
    failure = StepFailure(status, failed, tag, calls_done)
    call(pairs, record, failure)
    assert not status.any() and not failed.any(), f"{where}: a fitting call failed the step"
    over = call(pairs - 1, record, failure)
    assert over[written].isnan().all(), f"{where}: a failed step's local row is not NaN"
    want = [FAILURE_PAIR_BUDGET, pairs, pairs - 1, tag, 12]
    assert int(status) == KIND_EXPERTS, f"{where}: status {status.tolist()}"
    assert failed.tolist() == want, f"{where}: failure record {failed.tolist()} != {want}"
    status.zero_()
    call(1, record, StepFailure(status, failed, 5, calls_done))
    assert int(status) == KIND_EXPERTS, f"{where}: the second overflow left status {status}"
    assert failed.tolist() == want, f"{where}: the second overflow replaced the first's record"
    calls_done += 1
    call(1, record, StepFailure(status, failed, 5, calls_done))
    assert failed.tolist() == want, f"{where}: call 13 replaced call 12's record"
    failed.zero_()  # the host read it
    call(1, record, StepFailure(status, failed, 5, calls_done))
    later = [FAILURE_PAIR_BUDGET, pairs, 1, 5, 13]
    assert failed.tolist() == later, f"{where}: call 13's record {failed.tolist()}"
    print(f"ok budget seed {seed}: {pairs} pairs, {int(written.sum())} rows")


if __name__ == "__main__":
    if sys.argv[1] == "budget":
        budget(int(sys.argv[2]))
    else:
        main(sys.argv[1], int(sys.argv[2]))
