"""The humming engine's call (experts/hopper/humming_engine.py: on the slots and in chunks) in
Triton's CPU interpreter, its two GEMMs replaced by a torch stand-in, in its own process:

    TRITON_INTERPRET=1 python -m helpers.humming_interpreter_case CASE SEED   (from tests/)

`IndexedGemm` does what humming's indexed MoE GEMM is documented to do (experts/hopper/
humming_gemm.py): for each slot p below num_padded whose id is below the output's rows, output
row id = input row id // top_k (e4m3 times its fp32 factor per 32) times the MXFP4 weights of
expert expert_ids[p // block_m], summed in float64 (exact for these values, so a row's result
does not depend on which call computed it) and rounded to BF16. It also checks what humming
assumes: every id of a call at most once, every used tile's expert local. Everything else is the
engine's own code: the grouping kernel, chunk_routes_kernel, gather_rows_kernel, widen_scales,
SiTU -> MXFP8 and the finalize.

CASE:
  "chunks"  fresh random rows (dense: every id local, 192 pairs; hot: one expert in every row;
            mixed: -1 slots, rows without a local id and a NaN row), FC1 tiles of 16 pairs and
            FC2 tiles of 24 (two tilings): in chunks of 64 pairs (tiles cut by a chunk's edge)
            bitwise equal to the call on the slots, both within RECIPE_REL_L2 of `recipe_sums`
            (the engine's roundings applied in torch), rows without a local id untouched, output
            poisoned with NaN; each call allocates `workspace_parts`' bytes exactly.
  "budget"  the dense rows under pair budgets (PAIR_BUDGET_LEAST lowered): a budget of 3 chunks
            (192 pairs, all of them) bitwise equal to no budget; 2 chunks (128): NaN in every row
            with a local id, the overflow record 192, and with a StepFailure [FAILURE_PAIR_BUDGET,
            192, 128, tag] and KIND_EXPERTS; the bytes allocated equal `workspace_parts`. Then
            128 and 129 pairs against the budget of 128: the first bitwise as no budget, the
            second NaN in every row with a local id, the rows without one untouched, no GEMM tile
            computed and the record [FAILURE_PAIR_BUDGET, 129, 128, tag].
  "pdl"     every Triton launch of a call on the slots and in chunks (dense rows, and rows
            without a local pair) asks for programmatic dependent launch as the tiles say
            (HopperTiles.pdl True, the default, and False: experts/hopper/pdl.py), both GEMMs
            called; the interpreter runs each launch without it, so outputs are the same.
Prints "ok CASE ..." when every check holds, else raises naming the seed.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

from dep_ep.comm.failure import FAILURE_PAIR_BUDGET, StepFailure, new_record
from dep_ep.comm.mxfp8 import e8m0_to_fp32, mxfp8_quantize
from dep_ep.config import MoeGeometry
from dep_ep.constants import KIND_EXPERTS, SCALE_BLOCK
from dep_ep.experts.mxfp4 import mxfp4_dequantize
from dep_ep.testing.synthetic import SyntheticLayer

GEOMETRY = MoeGeometry("interp", hidden=256, latent=256, experts=24, topk=4, intermediate=256)
FIRST, COUNT = 8, 6  # this rank's experts 8..13
FC1_BLOCK, FC2_BLOCK = 16, 24  # humming's tiles take 8..64 pairs; two sizes: two tilings
CHUNK = 64  # chunks.CHUNK_ALIGN: the smallest chunk
SMS = 2
# Against recipe_sums: the same roundings, FC1 and FC2 in float64 both (exact here), so only the
# fp32 sums' order in the finalize could differ (it does not: k in order). A row computed with
# another expert's weights, a pair dropped or counted twice is off by order 1.
RECIPE_REL_L2 = 1e-6


class IndexedGemm:
    """humming's indexed MoE GEMM (module docstring) in torch, for the CPU."""

    def __init__(self, weights: torch.Tensor, scales: torch.Tensor, block: int) -> None:
        self.w = mxfp4_dequantize(weights, scales, torch.float64)  # [E, n, k], exact
        self.tiles_run = 0  # tiles computed by every call so far
        self.block = block

    def block_m(self, pairs: int) -> int:
        return self.block

    def __call__(self, inputs, input_scale, sorted_ids, expert_ids, num_padded, top_k, out, _):
        used = int(num_padded)
        assert used % self.block == 0, f"num_padded {used} is not whole tiles of {self.block}"
        assert used <= sorted_ids.numel(), f"num_padded {used} past the {sorted_ids.numel()} ids"
        tiles = used // self.block
        assert tiles <= expert_ids.numel(), f"{tiles} tiles, more than the tile experts"
        assert out.shape[0] == inputs.shape[0] * top_k, "humming needs [inputs * top_k, n] outputs"
        self.tiles_run += used // self.block
        ids = sorted_ids[:used].long()
        real = ids[ids < out.shape[0]]
        assert real.unique().numel() == real.numel(), "an id is routed twice"
        factors = input_scale.double().repeat_interleave(SCALE_BLOCK, dim=1)
        a = inputs.double() * factors
        for p0 in range(0, used, self.block):
            expert = int(expert_ids[p0 // self.block])
            tile = ids[p0 : p0 + self.block]
            rows = tile[tile < out.shape[0]]
            if rows.numel():
                assert 0 <= expert < self.w.shape[0], f"tile {p0 // self.block}: expert {expert}"
                out[rows] = (a[rows // top_k] @ self.w[expert].T).to(out.dtype)
        return out


def prepared(layer: SyntheticLayer, chunk_pairs: int, skew: float | None, pdl: bool = True):
    """A HummingPrepared on the CPU with IndexedGemm for humming (pdl: HopperTiles.pdl)."""
    from dep_ep.experts.hopper import Grouping, HopperTiles, HummingEngine
    from dep_ep.experts.hopper.humming_engine import HummingPrepared

    w13, s13, w2, s2 = layer.local(FIRST, COUNT)
    tiles = HopperTiles(grouping=Grouping.TRITON, pdl=pdl)
    engine = HummingEngine(chunk_pairs=chunk_pairs, tiles=tiles)
    return HummingPrepared(
        fc1=IndexedGemm(w13, s13, FC1_BLOCK),
        fc2=IndexedGemm(w2, s2, FC2_BLOCK),
        engine=engine,
        first_expert=FIRST,
        num_local_experts=COUNT,
        num_experts=GEOMETRY.experts,
        latent=GEOMETRY.latent,
        intermediate=GEOMETRY.intermediate,
        sms=SMS,
        skew=skew,
        situ_block_i=GEOMETRY.intermediate,
        pairs_over_budget=torch.zeros(1, dtype=torch.int32),
    )


def situ_mxfp8(h: torch.Tensor) -> torch.Tensor:
    """fp32 [n, I]: SiTU of BF16 [gate | up] [n, 2I] rounded to MXFP8 by situ_mxfp8_kernel and
    decoded. The engine's kernel, not torch: the interpreter's fp32 -> e4m3 conversion drops the
    carry of a rounding that crosses a binade (-15.65 came out -8, not -16), which a torch
    recipe would not share (tests/gpu run the kernel against torch on the GPU)."""
    from dep_ep.experts.hopper import kernels

    rows, inter = h.shape[0], h.shape[1] // 2
    act = torch.empty(rows, inter, dtype=torch.float8_e4m3fn)
    factors = torch.empty(rows, inter // SCALE_BLOCK)
    count = torch.tensor([rows], dtype=torch.int32)
    kernels.situ_mxfp8_kernel[(1, 1)](
        h, count, count, act, factors, inter, 8, inter, False, num_warps=4
    )
    return act.float() * factors.repeat_interleave(SCALE_BLOCK, dim=1)


def recipe_sums(x, sf, ids, weights, layer) -> torch.Tensor:
    """BF16 [R, L]: the humming engine's rounding recipe (the W4A8 model), pair by pair in torch:
    FC1 of the decoded row in float64 -> BF16, SiTU -> MXFP8 (`situ_mxfp8`), FC2 in float64 ->
    BF16; per row the fp32 sum over k in order of weight * expert output -> BF16 (rows without
    a local id: 0)."""
    rows = x.view(torch.float8_e4m3fn).double()
    rows = rows * e8m0_to_fp32(sf).double().repeat_interleave(SCALE_BLOCK, dim=1)
    total = torch.zeros(ids.shape[0], GEOMETRY.latent)
    for k in range(ids.shape[1]):
        for expert in range(FIRST, FIRST + COUNT):
            r = (ids[:, k] == expert).nonzero().squeeze(1)
            if not r.numel():
                continue
            w13, s13, w2, s2 = layer.expert(expert)
            w13 = mxfp4_dequantize(w13, s13, torch.float64)
            w2 = mxfp4_dequantize(w2, s2, torch.float64)
            h = (rows[r] @ w13.T).to(torch.bfloat16)
            act = situ_mxfp8(h.to(torch.bfloat16)).double()
            y = (act @ w2.T).to(torch.bfloat16).float()
            total[r] += weights[r, k : k + 1] * y
    return total.to(torch.bfloat16)


def rows_for(kind: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [R, K], weights fp32 [R, K]) of the routing kind."""
    g = GEOMETRY
    if kind == "dense":  # every id local: 48 rows x 4 = 192 pairs
        ids = torch.stack([torch.randperm(COUNT, generator=gen)[: g.topk] for _ in range(48)])
        ids = ids + FIRST
    else:
        rows = {"hot": 100, "mixed": 40}[kind]
        ids = torch.stack([torch.randperm(g.experts, generator=gen)[: g.topk] for _ in range(rows)])
        local = (ids >= FIRST) & (ids < FIRST + COUNT)
        if kind == "hot":  # expert FIRST + 2 in every row, no other local id: 100 pairs
            ids[:, 1:] = torch.where(local[:, 1:], -1, ids[:, 1:])
            ids[:, 0] = FIRST + 2
        else:
            ids[::4] = torch.where(local[::4], -1, ids[::4])  # rows without a local id
            ids[1::5, -1] = -1
    return ids.int(), torch.rand(ids.shape[0], g.topk, generator=gen)


def run(call, x, sf, ids, weights, failure=None, fill=float("nan")):
    """(out, bytes allocated) of one call on rows poisoned with `fill`."""
    from helpers.hopper_interpreter_case import CountAllocations

    out = torch.full((ids.shape[0], GEOMETRY.latent), fill, dtype=torch.bfloat16)
    counted = CountAllocations()
    with counted:
        call(x, sf, ids, weights, out, failure=failure)
    return out, counted.bytes


def chunks(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    layer = SyntheticLayer(GEOMETRY, seed)
    on_slots, in_chunks = prepared(layer, 1024, None), prepared(layer, CHUNK, None)
    done = []
    for kind in ("dense", "hot", "mixed"):
        ids, weights = rows_for(kind, gen)
        rows, topk = ids.shape
        where = f"chunks seed {seed} {kind}"
        assert on_slots.plan(rows, topk) is None and in_chunks.plan(rows, topk).chunks >= 2, where
        latent = torch.randn(rows, GEOMETRY.latent, generator=gen).to(torch.bfloat16)
        x, sf = mxfp8_quantize(latent)
        local = (ids >= FIRST) & (ids < FIRST + COUNT)
        written = local.any(dim=1)
        finite = written.clone()
        if kind == "mixed":
            nan_row = int(written.nonzero()[-1])
            sf[nan_row, 1] = 255  # an E8M0 NaN: elements 32..63 of the row are NaN
            finite[nan_row] = False
        outs = {}
        for name, call in (("slots", on_slots), ("chunks", in_chunks)):
            out, allocated = run(call, x, sf, ids, weights)
            parts = call.workspace_parts(rows, topk)
            assert allocated == sum(parts.values()), f"{where} {name}: {allocated} != {parts}"
            assert out[~written].isnan().all(), f"{where} {name}: a row without a local id changed"
            assert out[written & ~finite].isnan().all(), f"{where} {name}: NaN row came out finite"
            got = out[finite].double()
            assert not got.isnan().any(), f"{where} {name}: NaN in a row with a local id"
            want = recipe_sums(x, sf, ids, weights, layer)[finite].double()
            err = float((got - want).norm() / want.norm())
            assert err < RECIPE_REL_L2, f"{where} {name}: relative L2 {err:.2e} to the recipe"
            outs[name] = out
        same = torch.equal(outs["slots"].view(torch.int16), outs["chunks"].view(torch.int16))
        assert same, f"{where}: the chunked call differs from the call on the slots"
        plan = in_chunks.plan(rows, topk)
        done.append(f"{kind} {int(local.sum())} pairs in {plan.chunks} chunks")
    print(f"ok chunks seed {seed}: " + ", ".join(done))


def budget(seed: int) -> None:
    from dep_ep.experts.hopper import engine as engine_module

    engine_module.PAIR_BUDGET_LEAST = 1  # budgets of a few chunks at this size
    gen = torch.Generator().manual_seed(seed)
    layer = SyntheticLayer(GEOMETRY, seed)
    ids, weights = rows_for("dense", gen)
    rows, topk = ids.shape
    pairs = int(((ids >= FIRST) & (ids < FIRST + COUNT)).sum())
    where = f"budget seed {seed}"
    assert pairs == 192, where
    latent = torch.randn(rows, GEOMETRY.latent, generator=gen).to(torch.bfloat16)
    x, sf = mxfp8_quantize(latent)
    free = prepared(layer, CHUNK, None)
    fits = prepared(layer, CHUNK, 4.0)  # 4 x the mean 48 = 192: 3 chunks
    over = prepared(layer, CHUNK, 2.0)  # 96 pairs, 2 chunks: 128
    assert (fits.max_pairs(rows, topk), over.max_pairs(rows, topk)) == (192, 128), where
    want, _ = run(free, x, sf, ids, weights)
    for call, name in ((fits, "fits"), (over, "over")):
        status, record = torch.zeros(1, dtype=torch.int64), new_record(pinned=False)
        tag = -(1 << 62) + seed % 1000  # an EpMoeLayer tag: 64 bits
        out, allocated = run(call, x, sf, ids, weights, StepFailure(status, record, tag), 3.0)
        parts = call.workspace_parts(rows, topk)
        assert allocated == sum(parts.values()), f"{where} {name}: {allocated} != {parts}"
        if name == "fits":
            same = torch.equal(out.view(torch.int16), want.view(torch.int16))
            assert same, f"{where}: a budget of every pair changed the call"
            assert not status.any() and not record.any(), f"{where}: a fitting call failed"
            assert int(call.pairs_over_budget) == 0, f"{where}: a fitting call set the record"
        else:
            assert out.isnan().all(), f"{where}: an overflowing call wrote a finite row"
            assert int(call.pairs_over_budget) == 192, f"{where}: {call.pairs_over_budget}"
            assert int(status) == KIND_EXPERTS, f"{where}: status {status.tolist()}"
            failure = [FAILURE_PAIR_BUDGET, 192, 128, tag, 0]  # no call index given
            assert record.tolist() == failure, f"{where}: record {record.tolist()}"
    # The same rows with 128 and 129 pairs left (slots -1 from the first row on: rows 0..14 hold
    # no local id), against the budget of 128: the first fits bitwise, the second overflows by
    # one pair, computes nothing and leaves the rows without a local id as they were.
    for left in (128, 129):
        cut = ids.clone()
        cut.view(-1)[: 192 - left] = -1
        free_out, _ = run(free, x, sf, cut, weights, fill=3.0)
        over.pairs_over_budget.zero_()
        tiles_before = over.fc1.tiles_run + over.fc2.tiles_run
        status, record = torch.zeros(1, dtype=torch.int64), new_record(pinned=False)
        out, _ = run(over, x, sf, cut, weights, StepFailure(status, record, 7), 3.0)
        label = f"{where} {left} pairs against 128"
        if left == 128:
            same = torch.equal(out.view(torch.int16), free_out.view(torch.int16))
            assert same and not status.any(), f"{label}: the fitting call changed"
            continue
        written = ((cut >= FIRST) & (cut < FIRST + COUNT)).any(dim=1)
        assert out[written].isnan().all(), f"{label}: a row with a local id is not NaN"
        assert (out[~written] == 3.0).all() and (~written).sum() == 15, f"{label}: rows changed"
        ran = over.fc1.tiles_run + over.fc2.tiles_run - tiles_before
        assert ran == 0, f"{label}: the GEMMs computed {ran} tiles of an overflowing call"
        assert record.tolist() == [FAILURE_PAIR_BUDGET, 129, 128, 7, 0], f"{label}: {record}"
    print(f"ok budget seed {seed}: {pairs} pairs, then 128 and 129 against 128")


class LoggedGemm:
    """An IndexedGemm that appends ("gemm", name) to `events` at each call."""

    def __init__(self, gemm: IndexedGemm, name: str, events: list) -> None:
        self.gemm, self.name, self.events = gemm, name, events

    def block_m(self, pairs: int) -> int:
        return self.gemm.block_m(pairs)

    def __call__(self, *args):
        self.events.append(("gemm", self.name))
        return self.gemm(*args)


def pdl(seed: int) -> None:
    from dep_ep.experts.hopper import chunk_kernels, grouping_kernel
    from dep_ep.experts.hopper import pdl as pdl_module

    events = []  # ("gemm", name) and ("launch", kernel, wanted), in call order
    real = pdl_module.pdl_options

    def recorded(wanted, device, kernel):
        events.append(("launch", kernel.fn.__name__, wanted))
        return real(wanted, device, kernel)

    for module in (pdl_module, chunk_kernels, grouping_kernel):
        module.pdl_options = recorded
    gen = torch.Generator().manual_seed(seed)
    layer = SyntheticLayer(GEOMETRY, seed)
    done = []
    for chunk_pairs, wanted in ((1024, True), (1024, False), (CHUNK, True), (CHUNK, False)):
        call = prepared(layer, chunk_pairs, None, wanted)
        call = dataclasses.replace(
            call, fc1=LoggedGemm(call.fc1, "fc1", events), fc2=LoggedGemm(call.fc2, "fc2", events)
        )
        for kind in ("dense", "none local"):
            ids, weights = rows_for("dense", gen)
            if kind == "none local":
                ids = torch.where(ids >= 0, FIRST + COUNT, ids)  # a remote expert everywhere
            latent = torch.randn(ids.shape[0], GEOMETRY.latent, generator=gen).to(torch.bfloat16)
            x, sf = mxfp8_quantize(latent)
            events.clear()
            out = torch.full((ids.shape[0], GEOMETRY.latent), float("nan"), dtype=torch.bfloat16)
            call(x, sf, ids, weights, out)
            where = f"pdl seed {seed}, chunk_pairs {chunk_pairs}, pdl {wanted}, {kind}"
            gemms = {e[1] for e in events if e[0] == "gemm"}
            launches = [e for e in events if e[0] == "launch"]
            assert gemms == {"fc1", "fc2"} and launches, f"{where}: {events}"
            names = {e[1] for e in launches}
            expected = {"group_route_kernel", "situ_mxfp8_kernel", "finalize_kernel"}
            expected |= {"widen_scales_kernel"} if chunk_pairs == 1024 else set()
            expected |= (
                {"chunk_routes_kernel", "gather_rows_kernel"} if chunk_pairs == CHUNK else set()
            )
            assert names == expected, f"{where}: launched {sorted(names)}"
            asked = [e for e in launches if e[2] is not wanted]
            assert not asked, f"{where}: {asked} ask otherwise than the tiles"
            if kind == "none local":
                assert out.isnan().all(), f"{where}: a row without a local id changed"
            done.append(f"{where.split(', ', 1)[1]}: {len(launches)} launches")
    print(f"ok pdl seed {seed}: " + "; ".join(done))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    {"chunks": chunks, "budget": budget, "pdl": pdl}[sys.argv[1]](int(sys.argv[2]))
