"""NarrowGemmKernel: an expert GEMM for tiles of a few pairs (8, or up to 32 in the wgmma form),
MXFP4 weights times MXFP8 rows, the pairs on the MMA's N side; NarrowGemmLaunch compiles and
launches it.

out[j, n] = BF16( sum over k32 blocks b of 2^(sw[e, n, b] + sx[j, b]) * sum_{k in b} w[e, n, k]
x[row(j), k] ), for the pairs j of each tile (PairGroups' tiles of block_n = NarrowTuning.pairs),
e the tile's local expert, n < N. The weights come in experts/hopper/narrow_layout.py's layout
(NarrowTuning.weights "narrow") or as humming-kernels' prepared tensors ("humming",
experts/hopper/humming_layout.py: no copy of our own beside the humming engine's); a warp owns 16
output columns of one tile over the whole K: per k32 block one MMA from zero (e4m3, fp32;
NarrowTuning.wgmma: mma.sync.m16n8k32 a warp on tiles of 8, or a chunk's four wgmma.m64nPk32 a
warpgroup on tiles of P = 8, 16, 24 or 32 with the tile's rows in shared memory), its partials
scaled by the block scales and added into fp32 accumulators (exact MX scaling: a Hopper MMA
takes no block scales): "narrow", the weight row's and the pair's (an FMUL and an FFMA an
element); "humming", the pair's only (one FFMA), the weights' scales folded into their e4m3
bytes by the expansion and the output scaled by 2^6 * weight_scale_2[e]. Each weight byte is
read once per tile, 1 KiB a warp ("narrow") or 4 KiB a warpgroup ("humming") per 128 of K, into
registers or (the default) through a ring in shared memory, the warp's or the warpgroup's,
filled by bulk copies.

Why narrow: at decode sizes an expert holds a few pairs (1-8 at T <= 16 tokens a rank on a DEP16
shard of K3), so the GEMM is a stream of weight bytes with a little arithmetic on each; the
bound is the copy bandwidth (docs/experts.md). An expert with more pairs than a tile holds runs
as several tiles, each reading the expert's weights again (from L2 when they run together);
tiles of 16-32 pairs (an expert holds about 19 pairs at T = 64 on a DEP16 shard, 37 at 128) read
them once for up to 32 pairs. Measured on one H200 (docs/results/bench_narrow_gemm.md), tiles
of 8 on the code before the ring's first stages moved ahead of the rows' staging and the rows
were staged rows fastest: the default form at 0.87-1.22x the time of humming's GEMMs on the
same pairs (T = 1..16); at that speed no engine uses it (docs/experts.md, "The narrow GEMM").
The narrow form passed its GPU tests at every width on one H200 (2026-12-05); tiles of 16, 24
and 32 took 1.2-4.5x the time of humming's GEMMs at T = 16..256 on the same pairs
(docs/results/bench_narrow_gemm_wide.md). The humming form: docs/experts.md, "The narrow GEMM
on humming's prepared weights". The specialized form (NarrowTuning.expanded_slots: one warpgroup
expands the weights into shared memory, the others run the MMAs from there and promote) passed
its GPU tests on one H100 and took 1.5-12x humming's time (docs/experts.md, "The specialized
narrow GEMM").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint16, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

from dep_ep.comm.kernels.launcher import compile_kernel
from dep_ep.comm.kernels.ptx import bf16_round, bits_f32
from dep_ep.comm.kernels.tensors import gmem_tensor, row_major_layout
from dep_ep.constants import SCALE_BLOCK, VECTOR_BYTES
from dep_ep.experts.hopper.humming_layout import (
    E4M3_TABLE_HIGH,
    E4M3_TABLE_HIGH_STEP,
    E4M3_TABLE_LOW,
    E4M3_TABLE_LOW_STEP,
    HUMMING_BLOCK_ROWS,
    MAGNITUDE_NIBBLE_BITS,
    SIGN_NIBBLE_BITS,
)
from dep_ep.experts.hopper.narrow_layout import (
    MAGNITUDE_BITS,
    NARROW_CHUNK_K,
    NARROW_PAIRS,
    NARROW_ROWS,
    NARROW_STEPS,
    NARROW_TILE_PAIRS,
    SIGN_BITS,
    WORDS_PER_LANE,
    narrow_fits,
)

WARP_LANES = 32
WARPGROUP_WARPS = 4
# The staged rows' shared-memory descriptor (wgmma, K-major, no swizzle; CuTe's INTERLEAVE
# ((8, P/8), (16 bytes, 2)) : ((16 bytes, SBO), (1, LBO))), its fields in 16-byte units: the start
# address (14 bits); the leading byte offset LBO between core matrices along K (a core column, 16
# bytes of K of the tile's P rows: 16 * P bytes); the stride byte offset SBO between 8-row groups
# (one core matrix, 8 rows of 16 bytes: 128 bytes). One k32 block is two core columns.
DESC_ADDRESS_MASK = 0x3FFF
DESC_UNIT_SHIFT = 4
CORE_ROW_BYTES = 16
CORE_GROUP_BYTES = 8 * CORE_ROW_BYTES


def staged_rows_shape(k: int, pairs: int) -> tuple[int, int, int]:
    """The staged rows' shape, in 32-bit words, row-major: (core column c, row n, word i), a core
    column 16 bytes of K (2 K / 32 of them at K = k)."""
    return 2 * (k // SCALE_BLOCK), pairs, CORE_ROW_BYTES // 4


def staged_rows_strides(pairs: int) -> tuple[int, int, int]:
    """(LBO, SBO, a k32 block's bytes) of a tile's `pairs` rows staged by stage_rows: core column
    c (16 bytes of K) of row n at byte 16 * pairs * c + 16 * n, two core columns a k32 block."""
    core_column = CORE_ROW_BYTES * pairs
    return core_column, CORE_GROUP_BYTES, 2 * core_column


E8M0_MANTISSA_BITS = 23  # an E8M0 byte shifted here is the fp32 bits of 2^(byte - 127)
# One chunk (128 of K) of a warp's 16 weight rows in narrow_layout's layout: 32 lanes x 8 words
# of codes, and 8 x 2 words of scales, each contiguous (chunks follow one another).
CHUNK_WORD_BYTES = WARP_LANES * WORDS_PER_LANE * 4
CHUNK_SCALE_BYTES = 8 * 2 * 4
BYTE_MASK = 0xFF
# humming's prepared weights (humming_layout.py): a 64-row block of a k32 group is 1 KiB of words;
# lane 4g + t of warp w of a warpgroup takes words 128 (w // 2) + 16 g + 4 t + 2 (w % 2) + r (r = 0:
# row 16 w + g, r = 1: row 16 w + g + 8), 8 contiguous bytes: the block as 128 word pairs, and its
# 64 scale bytes (s' of row 16 w + g + 8 r at byte 8 g + 2 w + r) as 32 byte pairs.
HUMMING_BLOCK_WORDS = 256
HUMMING_BLOCK_BYTES = 4 * HUMMING_BLOCK_WORDS
HUMMING_WORD_PAIRS = HUMMING_BLOCK_WORDS // 2
HUMMING_SCALE_PAIRS = HUMMING_BLOCK_ROWS // 2
# A chunk (128 of K) of a warpgroup's 64 rows in humming's layout: four blocks and their scales.
HUMMING_CHUNK_BYTES = NARROW_STEPS * (HUMMING_BLOCK_BYTES + HUMMING_BLOCK_ROWS)
# humming's bytes hold E2M1 * 2^(s' - 6): the output is scaled by 2^6 * weight_scale_2 (fp32).
HUMMING_OUTPUT_SCALE = 64.0
WEIGHT_FORMS = ("narrow", "humming")
# The warpgroups' named barriers (bar.sync 0 is the CTA's): warpgroup i takes barrier 1 + i.
FIRST_WARPGROUP_BARRIER = 1
# The specialized form (NarrowTuning.expanded_slots): its consumer warpgroups' barrier after they
# stage the tile's rows and before they add their sums (the expanding warpgroups take
# FIRST_WARPGROUP_BARRIER for their ring).
CONSUMERS_BARRIER = FIRST_WARPGROUP_BARRIER + 1
# A chunk of a warpgroup's 64 weight rows expanded to e4m3 in shared memory, as wgmma's A operand
# (K-major, no swizzle): per k32 block s, core column h (16 bytes of K), row r at byte
# 2048 s + 1024 h + 16 r, so 8-row groups 128 bytes apart (SBO) and core columns 1024 (LBO). As
# words: (block, core column, 8-row group, row, word).
EXPANDED_SHAPE = (NARROW_STEPS, 2, HUMMING_BLOCK_ROWS // 8, 8, CORE_ROW_BYTES // 4)
EXPANDED_CHUNK_BYTES = NARROW_STEPS * HUMMING_BLOCK_ROWS * SCALE_BLOCK
EXPANDED_LBO = HUMMING_BLOCK_ROWS * CORE_ROW_BYTES
EXPANDED_SBO = CORE_GROUP_BYTES
EXPANDED_BLOCK_BYTES = 2 * EXPANDED_LBO
# The same chunk as the A words of wgmma from registers (NarrowTuning.register_a): per k32 block
# s, thread i of the warpgroup's 4 words (expand_humming's) at word 4 (128 s + i).
REGISTER_A_SHAPE = (NARROW_STEPS, WARPGROUP_WARPS * WARP_LANES, 4)
# The activations' dtypes the kernel reads as e4m3 bytes.
E4M3_BYTE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
# What one CTA may take on SM90 (227 KiB), less the allocator's alignment padding.
SMEM_LIMIT = 227 * 1024 - 256
# A CTA's threads at most (CUDA's limit).
MAX_CTA_THREADS = 1024
# The grid's second axis (tile slots) is at most this (CUDA's limit on gridDim.y).
MAX_TILE_SLOTS = 65535
# N at most this: the kernel computes its columns in 32-bit integers (and the grid's first axis,
# N / tuning.columns(), then fits gridDim.x).
MAX_N = 2**31 - 1


def f32_asm(args, text: str, constraints: str, side_effects: bool, loc, ip, count: int = 4):
    """Inline PTX `text` on the ir values `args`, returning `count` fp32 results ($0..)."""
    result = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * count),
        args,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return tuple(
        Float32(llvm.extractvalue(T.f32(), result, [i], loc=loc, ip=ip)) for i in range(count)
    )


@dsl_user_op
def mma_e4m3(a0, a1, a2, a3, b0, b1, *, loc=None, ip=None):
    """One mma.sync.m16n8k32 of e4m3 A (four words) and B (two words) from zero: the fp32
    partials (d0, d1, d2, d3) of rows (g, g, g + 8, g + 8) and columns (2t, 2t + 1, 2t, 2t + 1)
    of lane 4g + t."""
    text = (
        "{ .reg .f32 z; mov.f32 z, 0f00000000;"
        " mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"
        " {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {z, z, z, z}; }"
    )
    args = [Uint32(v).ir_value(loc=loc, ip=ip) for v in (a0, a1, a2, a3, b0, b1)]
    return f32_asm(args, text, "=f,=f,=f,=f,r,r,r,r,r,r", False, loc, ip)


@dsl_user_op
def wgmma_e4m3_chunk(a, descs, pairs: int, wait: bool = True, *, loc=None, ip=None):
    """One chunk's four wgmma.m64nPk32 (P = `pairs`, a multiple of 8) of the warpgroup, each from
    zero (scale-d 0), issued together as one group and, with `wait`, waited for (without, the
    partials may be read only once wgmma_wait_keeping has returned them): `a` the 16 words of A,
    four a k32 block (e4m3, each warp its 16 rows in the layout of mma_e4m3's A), `descs` the
    four blocks' shared-memory descriptors (Int64) of B, the tile's P rows x 32 bytes; fenced
    before (A was just written). Returns the 4 * P / 2 fp32 partials block by block, P / 2 a
    block: for each 8 pairs c, (d0, d1, d2, d3) as mma_e4m3's with pairs 8c + 2t and 8c + 2t +
    1, rows 16 w + ... for warp w of the warpgroup. Side effects: the wgmma reads shared memory
    (and, with `wait`, waits on its group); it must stay in place."""
    per = pairs // 2  # fp32 partials a thread a block
    a0 = NARROW_STEPS * per  # the first A operand
    d0 = a0 + 16  # the first descriptor operand

    def outputs(b: int) -> str:
        return ", ".join(f"${per * b + i}" for i in range(per))

    mmas = " ".join(
        f"wgmma.mma_async.sync.aligned.m64n{pairs}k32.f32.e4m3.e4m3 {{{outputs(b)}}},"
        f" {{${a0 + 4 * b}, ${a0 + 4 * b + 1}, ${a0 + 4 * b + 2}, ${a0 + 4 * b + 3}}},"
        f" ${d0 + b}, 0, 1, 1;"
        for b in range(NARROW_STEPS)
    )
    text = f"wgmma.fence.sync.aligned; {mmas} wgmma.commit_group.sync.aligned;"
    if wait:
        text += " wgmma.wait_group.sync.aligned 0;"
    args = [Uint32(v).ir_value(loc=loc, ip=ip) for v in a]
    args += [Int64(d).ir_value(loc=loc, ip=ip) for d in descs]
    count = NARROW_STEPS * per
    constraints = ",".join(["=f"] * count + ["r"] * 16 + ["l"] * NARROW_STEPS)
    return f32_asm(args, text, constraints, True, loc, ip, count=count)


@dsl_user_op
def wgmma_wait_keeping(values, pending: int, *, loc=None, ip=None):
    """wgmma.wait_group `pending`: every MMA group of the warpgroup but the last `pending`
    complete. `values` (fp32, the partials of an earlier group) pass through the wait as tied
    operands and are returned, so that no read of them is placed above it."""
    count = len(values)
    constraints = ",".join(["=f"] * count + [str(i) for i in range(count)])
    args = [Float32(v).ir_value(loc=loc, ip=ip) for v in values]
    text = f"wgmma.wait_group.sync.aligned {pending};"
    return f32_asm(args, text, constraints, True, loc, ip, count=count)


@dsl_user_op
def wgmma_e4m3_chunk_ss(a_descs, b_descs, pairs: int, *, loc=None, ip=None):
    """One chunk's four wgmma.m64nPk32 (P = `pairs`) of the warpgroup with both operands in
    shared memory, each from zero (scale-d 0), issued as one group and waited for: `a_descs` the
    four k32 blocks' descriptors (Int64) of A, the expanded weights' 64 rows x 32 bytes
    (EXPANDED_SHAPE), `b_descs` those of B, the tile's P rows x 32 bytes. Returns the 4 * P / 2
    fp32 partials in wgmma_e4m3_chunk's order. Side effects: the wgmma read shared memory and
    the thread waits on its group; it must stay in place (after the wait for the expanded
    chunk, before the slot's release)."""
    per = pairs // 2  # fp32 partials a thread a block
    count = NARROW_STEPS * per

    def outputs(b: int) -> str:
        return ", ".join(f"${per * b + i}" for i in range(per))

    mmas = " ".join(
        f"wgmma.mma_async.sync.aligned.m64n{pairs}k32.f32.e4m3.e4m3 {{{outputs(b)}}},"
        f" ${count + b}, ${count + NARROW_STEPS + b}, 0, 1, 1;"
        for b in range(NARROW_STEPS)
    )
    text = (
        f"wgmma.fence.sync.aligned; {mmas} wgmma.commit_group.sync.aligned;"
        " wgmma.wait_group.sync.aligned 0;"
    )
    args = [Int64(d).ir_value(loc=loc, ip=ip) for d in (*a_descs, *b_descs)]
    constraints = ",".join(["=f"] * count + ["l"] * (2 * NARROW_STEPS))
    return f32_asm(args, text, constraints, True, loc, ip, count=count)


def statement_asm(args: list, text: str, constraints: str) -> None:
    """Inline PTX `text` with side effects and no result on the ir values `args` ($0..)."""
    llvm.inline_asm(
        None,
        args,
        text,
        constraints,
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def fence_proxy_async_shared(*, loc=None, ip=None) -> None:
    """Order this thread's shared-memory stores before the async proxy's reads (wgmma)."""
    statement_asm([], "fence.proxy.async.shared::cta;", "")


@dsl_user_op
def bulk_copy_to_shared(dst, src, size, barrier, *, loc=None, ip=None) -> None:
    """cp.async.bulk of `size` bytes (a multiple of 16) from global address `src` (Int64) to
    shared address `dst` (both 16-byte aligned), completing `size` transaction bytes on the
    mbarrier at shared address `barrier`."""
    args = [
        Int32(dst).ir_value(loc=loc, ip=ip),
        Int64(src).ir_value(loc=loc, ip=ip),
        Int32(size).ir_value(loc=loc, ip=ip),
        Int32(barrier).ir_value(loc=loc, ip=ip),
    ]
    text = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];"
    statement_asm(args, text, "r,l,r,r")


@dsl_user_op
def copy_16_async(dst, src, src_bytes, *, loc=None, ip=None) -> None:
    """cp.async of 16 bytes from global address `src` (Int64) to shared address `dst` (both
    16-byte aligned), reading `src_bytes` of them (16, or 0: the 16 shared bytes are zeroed),
    through L2 only (.cg); complete after cp_async_wait_all."""
    args = [
        Int32(dst).ir_value(loc=loc, ip=ip),
        Int64(src).ir_value(loc=loc, ip=ip),
        Int32(src_bytes).ir_value(loc=loc, ip=ip),
    ]
    statement_asm(args, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r")


@dsl_user_op
def cp_async_wait_all(*, loc=None, ip=None) -> None:
    """Wait for every cp.async this thread issued (their shared-memory writes done)."""
    statement_asm([], "cp.async.wait_all;", "")


@cute.jit
def smem_desc(address: Int32, leading_bytes: int, stride_bytes: int) -> Int64:
    """A wgmma shared-memory descriptor, K-major without swizzle, of the operand at shared
    address `address`: core matrices `leading_bytes` apart along K (LBO) and 8-row groups
    `stride_bytes` apart (SBO), both static multiples of 16."""
    low = ((address >> DESC_UNIT_SHIFT) & Int32(DESC_ADDRESS_MASK)) | Int32(
        (leading_bytes >> DESC_UNIT_SHIFT) << 16
    )
    return Int64(Uint32(low)) | (Int64(stride_bytes >> DESC_UNIT_SHIFT) << 32)


@cute.jit
def e4m3_from_low(word: Uint32) -> Uint32:
    """The low nibble of each byte (E2M1 s e1 e0 m) -> that byte as e4m3 s 0 0 e1 e0 m 0 0."""
    return ((word << 4) & Uint32(SIGN_BITS)) | ((word << 2) & Uint32(MAGNITUDE_BITS))


@cute.jit
def e4m3_from_high(word: Uint32) -> Uint32:
    """The high nibble of each byte -> that byte as e4m3 (the sign already at bit 7)."""
    return (word & Uint32(SIGN_BITS)) | ((word >> 2) & Uint32(MAGNITUDE_BITS))


@cute.jit
def e8m0_byte(word: Uint32, index: int) -> Float32:
    """2^(byte - 127) of byte `index` (static) of `word`; byte 0 gives 0."""
    return bits_f32(((word >> (8 * index)) & Uint32(BYTE_MASK)) << E8M0_MANTISSA_BITS)


def humming_lane_pairs(warp: int, g: int, t: int) -> tuple:
    """(word pair, scale pair) of lane 4g + t of warp `warp` (0..3) of a warpgroup in each of
    its 64-row block's k32 groups of humming's prepared weights: words 2 wp and 2 wp + 1 of the
    block's 256 hold rows 16 warp + g and 16 warp + g + 8 at k 4t..4t+3 and 16 + 4t.. (A
    registers of wgmma from registers), and scale bytes 2 sp and 2 sp + 1 of its 64 their s'.
    Plain arithmetic: the kernel calls it on its indices, the tests on ints (against
    humming_layout.prepared_index)."""
    word_pair = (HUMMING_WORD_PAIRS // 2) * (warp // 2) + 8 * g + 2 * t + warp % 2
    return word_pair, 4 * g + warp


def staged_row_offset(column, n, pairs: int):
    """The byte offset in a tile's staged rows (stage_rows' layout, `staged_rows_strides`) of
    core column `column` (16 bytes of K) of row n: 16 P column + 16 n. Plain arithmetic, as
    humming_lane_pairs."""
    return CORE_ROW_BYTES * pairs * column + CORE_ROW_BYTES * n


@dsl_user_op
def permute_bytes(low, high, selectors, *, loc=None, ip=None) -> Uint32:
    """prmt.b32 (default mode): byte i of the result is byte selectors[4i:4i+4] of (high, low);
    humming_layout.permute_bytes in torch. No side effects, so the compiler may schedule it."""
    args = [Uint32(v).ir_value(loc=loc, ip=ip) for v in (low, high, selectors)]
    result = llvm.inline_asm(
        T.i32(),
        args,
        "prmt.b32 $0, $1, $2, $3;",
        "=r,r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Uint32(result)


@cute.jit
def humming_e4m3(word: Uint32, exponent: Uint32) -> tuple:
    """One prepared word's 8 elements (one row, k 4t + j and 16 + 4t + j) as two words of e4m3
    bytes, E2M1 * 2^(s' - 6) with s' = `exponent` the row's and group's small exponent:
    humming_layout.expanded_e4m3_words, whose CPU test is this expansion's specification."""
    low = Uint32(E4M3_TABLE_LOW) + exponent * Uint32(E4M3_TABLE_LOW_STEP)
    high = Uint32(E4M3_TABLE_HIGH) + exponent * Uint32(E4M3_TABLE_HIGH_STEP)
    magnitudes = word & Uint32(MAGNITUDE_NIBBLE_BITS)
    signs = word & Uint32(SIGN_NIBBLE_BITS)
    half0 = permute_bytes(low, high, magnitudes) | ((signs << 4) & Uint32(SIGN_BITS))
    half1 = permute_bytes(low, high, magnitudes >> 16) | (signs & Uint32(SIGN_BITS))
    return half0, half1


@dataclass(frozen=True, kw_only=True)
class NarrowTuning:
    """The kernel's launch shape and form.

    warps: a CTA's warps, 16 output columns each (N must be a multiple of 16 * warps).
    wgmma: False, one mma.sync.m16n8k32 a warp and k32 block, its rows read from global memory;
      True, a chunk's four wgmma.m64nPk32 a warpgroup issued together and waited for once
      (warps a multiple of 4), its rows staged once per tile in shared memory (P * K bytes:
      28 KiB at K = 3584 and P = 8, 112 KiB at P = 32).
    pairs: P, the pairs a tile (PairGroups' block_n): NARROW_PAIRS (8), or with wgmma one of
      NARROW_TILE_PAIRS (8, 16, 24, 32). Wider tiles read an expert's weights once for more of
      its pairs, and hold P / 2 accumulators and 2 P partials a thread.
    stages, stage_chunks: 0, each warp loads a chunk (128 of K) into registers and computes it,
      its loop unrolled `unroll` times, the weights' loads skipping L1 or not
      (`weights_skip_l1`); > 0, each warp streams its weights through a ring in shared memory of
      `stages` slots of `stage_chunks` chunks, filled by bulk copies on the slots' mbarriers
      (`ring_bytes`: 34 KiB at the default 8 warps, 2 slots of 2 chunks).
    weights: "narrow", the weights in narrow_layout.py's layout (the kernel's own copy), each
      row's block scale applied to its partials (an FMUL and an FFMA an output element and k32
      block); "humming", humming's prepared tensors as HummingGemm.prepare keeps them
      (humming_layout.py: no copy of its own), their scales folded into the e4m3 bytes by the
      expansion (one FFMA an output element and k32 block) and the output scaled by 2^6 *
      weight_scale_2. The humming form needs wgmma; its ring (stages > 0) is a warpgroup's, not a
      warp's (humming's 64-row blocks interleave a warpgroup's warps), refilled after the
      warpgroup's named barrier.
    ahead: False, each chunk's MMAs waited for before its partials are promoted; True (the
      humming form through its ring, stage_chunks >= 2), within a stage chunk c + 1's MMAs
      issued before chunk c's partials are waited for and promoted, so that a warp's MMAs run
      under its promotion (a thread holds two chunks' partials, 4 P, and two chunks' activation
      scales); a stage's last chunk is waited for before the stage ends.
    stage_scales: False, each chunk's activation scales (16 bytes a pair) read from global
      memory beside its MMAs; True (the humming form), the tile's scales staged in shared memory
      with its rows (P * K / 8 bytes more a CTA), each chunk's read from there.
    expanded_slots: 0, every warpgroup expands its own weights into registers (wgmma's A from
      registers); > 0, the warp-specialized form (humming's weights through a ring): a CTA of
      `warps` warps computes 64 * blocks output columns; warpgroups 0 .. expanders - 1 stream them
      through their ring and expand each chunk to e4m3 into a ring of `expanded_slots` chunks in
      shared memory (8 KiB a block, EXPANDED_SHAPE), and the other warps / 4 - expanders warpgroups
      (the consumers) take the chunks in turn (with one block, consumer c the chunks q = c mod
      consumers): four wgmma with both operands in shared memory (register_a: A loaded into
      registers first), waited for, the slot released, the partials promoted into its own
      accumulators; at the end a block's consumers' sums are added in turn order. At least as many
      slots as a block's consumers (specialized_problems). So a chunk's expansion, its MMAs and
      another chunk's promotion run in different warps at once, where the other forms chain them
      in each warp (docs/experts.md, "What bounds the narrow GEMM past decode").
    blocks: the specialized form's 64-column blocks a CTA (1 in the other forms): the CTA stages
      its tile's rows once for 64 * blocks columns, its ring and expanded slots hold `blocks`
      blocks a chunk (humming's adjacent blocks: one bulk copy of words and one of scales a k32
      group), and consumer c takes block c % blocks and the chunks q = c // blocks mod
      (consumers / blocks), so consumers must be a multiple of blocks.
    copy_warp: the specialized form's ring copies issued by a warp of their own, the CTA's last
      (warps + 1 warps a CTA), instead of the expanding warpgroup's first thread. The expanding
      threads' fence for the async proxy compiles to MEMBAR.ALL.CTA (ptxas 13.0); if that fence
      waits for the issuing thread's bulk copies in flight, the expanding warpgroup stalls on
      its ring's refills every stage (docs/experts.md, "The specialized narrow GEMM").
    register_a: the specialized form's consumers load each chunk's expanded A words from the
      slot into registers (wgmma's A from registers, as the chained forms) instead of reading
      them through a descriptor: the slot holds each thread's 16 words (REGISTER_A_SHAPE, 16
      bytes a thread and k32 block, consecutive threads 16 bytes apart), only the generic proxy
      touches it, so the expanders store without the async-proxy fence, and a consumer
      releases the slot once its words are loaded, before its MMAs.
    expanders: the specialized form's expanding warpgroups (warps 0 .. 4 * expanders - 1), all
      reading the one ring: chunk c of each stage is expanded by warpgroup c % expanders into
      slots of its own (stage_chunks and expanded_slots multiples of it), so each expands
      1 / expanders of the chunks. Under Nsight Compute one expanding warpgroup (a warp a
      scheduler) left the consumers waiting on `full` for 81% of their loop's samples; two
      took only 3-5% off on one H100, the consumers still waiting (docs/experts.md, "The
      specialized narrow GEMM").
    The default (wgmma, a ring of 2 x 2) was the fastest form in 19 of the 30 rows of
    docs/results/bench_narrow_gemm.md (fields by keyword only)."""

    warps: int = 8
    unroll: int = 2
    wgmma: bool = True
    stages: int = 2
    stage_chunks: int = 2
    weights_skip_l1: bool = False
    pairs: int = NARROW_PAIRS
    weights: str = "narrow"
    ahead: bool = False
    stage_scales: bool = False
    expanded_slots: int = 0
    blocks: int = 1
    copy_warp: bool = False
    register_a: bool = False
    expanders: int = 1

    def threads(self) -> int:
        """A CTA's threads: 32 * warps, and the copy warp's 32 (copy_warp)."""
        return WARP_LANES * (self.warps + int(self.copy_warp))

    def columns(self) -> int:
        """Output columns a CTA: 16 * warps, or 64 * blocks in the specialized form
        (expanded_slots)."""
        if self.expanded_slots > 0:
            return HUMMING_BLOCK_ROWS * self.blocks
        return NARROW_ROWS * self.warps

    def turns(self) -> int:
        """The specialized form's consumers a block, which take its chunks in turn (0 for a
        tuning the form refuses: no blocks)."""
        return self.consumers() // self.blocks if self.blocks > 0 else 0

    def consumers(self) -> int:
        """The specialized form's consumer warpgroups: all but the `expanders` expanding ones."""
        return self.warps // WARPGROUP_WARPS - self.expanders

    def ring_threads(self) -> int:
        """The threads that read a "humming" ring and meet at its barrier before each refill: a
        warpgroup's (the specialized form's `expanders` warpgroups'), and the copy warp's."""
        return (WARPGROUP_WARPS * self.expanders + int(self.copy_warp)) * WARP_LANES

    def expanded_bytes(self) -> int:
        """Shared memory of the specialized form beside the ring and the staged rows: the
        expanded chunks (8 KiB a block), their full and empty mbarriers (16 bytes a slot), and
        the sums of every consumer but each block's first (P / 2 fp32 a thread); 0 in the other
        forms."""
        if self.expanded_slots <= 0:
            return 0
        # At least one row of sums is reserved, used or not.
        others = max(self.consumers() - self.blocks, 1)
        sums = others * WARPGROUP_WARPS * WARP_LANES * self.pairs * 2
        return self.expanded_slots * (EXPANDED_CHUNK_BYTES * self.blocks + 16) + sums

    def ring_bytes(self) -> int:
        """Shared memory of the rings of weight chunks (stages > 0): a warp's chunk of 1 KiB of
        codes and 64 bytes of scales ("narrow"), or a warpgroup's of four times that
        ("humming"; `blocks` times that in the specialized form), stage_chunks a stage,
        `stages` a ring."""
        chunk = HUMMING_CHUNK_BYTES * self.blocks
        if self.weights != "humming":
            chunk = CHUNK_WORD_BYTES + CHUNK_SCALE_BYTES
        return self.rings() * self.stages * self.stage_chunks * chunk

    def rings(self) -> int:
        """The rings a CTA: one a warp ("narrow"), a warpgroup ("humming") or the expanding
        warpgroups' (the specialized form)."""
        if self.expanded_slots > 0:
            return 1
        return self.warps // WARPGROUP_WARPS if self.weights == "humming" else self.warps


class NarrowGemmKernel:
    """Grid (N / tuning.columns(), tile capacity); CTA (cb, t) runs tile t (nothing when
    t >= num_tiles) for columns [tuning.columns() * cb, ...). The column blocks are the grid's
    fast axis so that the tiles in use (t < num_tiles) are launched first and the empty tile
    slots (most of the capacity at decode: E_local of its pair_capacity / tuning.pairs +
    E_local) come last, where they exit while the last tiles run (with the tile slots the fast
    axis, the ring form's FC1 took 66.8 us at 448 local experts and T = 1, 62.0 this way:
    docs/experts.md, "The narrow GEMM"). N, K and
    indexed (whether pair j reads row pair_row[j] of x or row j) are static."""

    def __init__(self, n: int, k: int, indexed: bool, tuning: NarrowTuning = NarrowTuning()):
        assert narrow_fits(n, k) and n % tuning.columns() == 0
        assert not tuning.wgmma or tuning.warps % WARPGROUP_WARPS == 0
        assert tuning.pairs in NARROW_TILE_PAIRS and (tuning.wgmma or tuning.pairs == NARROW_PAIRS)
        assert tuning.weights in WEIGHT_FORMS and (tuning.weights == "narrow" or tuning.wgmma)
        assert not tuning.ahead or (
            tuning.weights == "humming" and tuning.stages > 0 and tuning.stage_chunks > 1
        )
        assert not tuning.stage_scales or tuning.weights == "humming"
        assert (
            specialized_fits(tuning)
            if tuning.expanded_slots
            else tuning.blocks == 1
            and tuning.expanders == 1
            and not tuning.copy_warp
            and not tuning.register_a
        )
        self.n, self.k, self.indexed, self.tuning = n, k, indexed, tuning
        self.humming = tuning.weights == "humming"
        self.blocks = n // NARROW_ROWS
        self.chunks = k // NARROW_CHUNK_K
        # A lane's pairs in the MMA's C: 8c + 2t and 8c + 2t + 1 of each 8 pairs c of the tile.
        self.lane_pairs = tuning.pairs // 4
        # The ring's stages over K (stage_chunks chunks each, the last may hold fewer).
        self.ring_stages = -(-self.chunks // tuning.stage_chunks)

    @cute.jit
    def __call__(
        self,
        words: Int64,
        scales: Int64,
        expert_scale: Int64,
        x: Int64,
        x_scales: Int64,
        pair_row: Int64,
        tile_expert: Int64,
        tile_start: Int64,
        tile_rows: Int64,
        num_tiles: Int64,
        out: Int64,
        num_local: Int32,
        rows_in: Int32,
        rows_out: Int32,
        tiles: Int32,
        stream: cuda.CUstream,
    ):
        """words int32 [E, N/16, K/128, 32, 8], scales int32 [E, N/16, K/128, 8, 2]
        (narrow_weights; expert_scale unread), or with tuning.weights "humming" humming's
        prepared weight int32 [E, K/32, 4N], weight_scale bytes [E, K/32, N] and weight_scale_2
        fp32 [E] (expert_scale); x e4m3 [rows_in, K] and x_scales fp32 [rows_in, K/32];
        pair_row int32 (read when indexed); tile_expert, tile_start, tile_rows int32 [tiles],
        num_tiles int32 [1] (PairGroups); out bf16 [rows_out, N]. All 16-byte aligned."""
        cb, q = self.blocks, self.chunks
        steps = self.k // SCALE_BLOCK
        if cutlass.const_expr(self.humming):
            # A block's words as 128 pairs and its scale bytes as 32 pairs (a lane's, r = 0, 1).
            blocks = (num_local, steps, self.n // HUMMING_BLOCK_ROWS)
            mW = gmem_tensor(Uint32, words, row_major_layout((*blocks, HUMMING_WORD_PAIRS, 2)))
            mS = gmem_tensor(
                Uint16, scales, row_major_layout((*blocks, HUMMING_SCALE_PAIRS)), align=2
            )
        else:
            mW = gmem_tensor(Uint32, words, row_major_layout((num_local, cb, q, WARP_LANES, 8)))
            mS = gmem_tensor(Uint32, scales, row_major_layout((num_local, cb, q, 8, 2)))
        mExpertScale = gmem_tensor(Float32, expert_scale, cute.make_layout(num_local), align=4)
        # x as words: row, chunk, step s, lane t: two words (k 8t .. 8t + 7 of block s)
        mX = gmem_tensor(Uint32, x, row_major_layout((rows_in, q, NARROW_STEPS, 4, 2)))
        mXs = gmem_tensor(Float32, x_scales, row_major_layout((rows_in, q, NARROW_STEPS)))
        vector = cute.make_layout(tiles)
        mPairRow = gmem_tensor(Int32, pair_row, cute.make_layout(rows_out), align=4)
        mTileExpert = gmem_tensor(Int32, tile_expert, vector, align=4)
        mTileStart = gmem_tensor(Int32, tile_start, vector, align=4)
        mTileRows = gmem_tensor(Int32, tile_rows, vector, align=4)
        mNumTiles = gmem_tensor(Int32, num_tiles, cute.make_layout(1), align=4)
        mOut = gmem_tensor(Uint16, out, row_major_layout((rows_out, self.n)))
        self.kernel(
            mW,
            mS,
            mExpertScale,
            mX,
            mXs,
            mPairRow,
            mTileExpert,
            mTileStart,
            mTileRows,
            mNumTiles,
            mOut,
        ).launch(
            grid=[self.n // self.tuning.columns(), tiles, 1],
            block=[self.tuning.threads(), 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mW: cute.Tensor,
        mS: cute.Tensor,
        mExpertScale: cute.Tensor,
        mX: cute.Tensor,
        mXs: cute.Tensor,
        mPairRow: cute.Tensor,
        mTileExpert: cute.Tensor,
        mTileStart: cute.Tensor,
        mTileRows: cute.Tensor,
        mNumTiles: cute.Tensor,
        mOut: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bx, tile, _ = cute.arch.block_idx()
        warp, lane = tidx // WARP_LANES, tidx % WARP_LANES
        g, t = lane // 4, lane % 4
        if tile < mNumTiles[0]:
            expert = mTileExpert[tile]
            start = mTileStart[tile]
            rows = mTileRows[tile]
            tensors = (mW, mS, mExpertScale, mX, mXs, mPairRow, mOut)
            thread = (tidx, warp, lane, g, t)
            if cutlass.const_expr(self.tuning.expanded_slots > 0):
                self.specialized_tile(tensors, expert, start, rows, bx, thread)
            else:
                self.chained_tile(tensors, expert, start, rows, bx, thread)

    @cute.jit
    def chained_tile(self, tensors, expert, start, rows, bx, thread):
        """The tile's columns of CTA bx in the forms that chain each chunk in one warp (all but
        the specialized one): each warp streams its weights (directly or through its ring),
        expands them, runs the MMAs and promotes their partials, chunk after chunk. `thread`:
        (thread index, warp, lane, lane // 4, lane % 4)."""
        mW, mS, mExpertScale, mX, mXs, mPairRow, mOut = tensors
        tidx, warp, lane, g, t = thread
        block = bx * self.tuning.warps + warp
        last = rows - 1
        # B (mma.sync): this lane reads pair g's row. C: its partials are its lane pairs,
        # 8c + 2t + h (h = 0, 1) of each 8 pairs c, lane pair 2c + h. Pairs past the tile's
        # read its last pair (their partials are never stored).
        rb = self.x_row(mPairRow, start, last, g)
        pair_rows = [
            self.x_row(mPairRow, start, last, 8 * (i // 2) + 2 * t + i % 2)
            for i in range(self.lane_pairs)
        ]
        # One chunk's registers: the lane's weight words and scale words (humming: per k32
        # block s, the words of rows g and g + 8 and their two s' bytes), its B words
        # (mma.sync) and its lane pairs' block scales.
        rW = cute.make_rmem_tensor(cute.make_layout(WORDS_PER_LANE), Uint32)
        rS = cute.make_rmem_tensor(cute.make_layout(2), Uint32)
        if cutlass.const_expr(self.humming):
            rS = cute.make_rmem_tensor(cute.make_layout(NARROW_STEPS), Uint16)
        rX = cute.make_rmem_tensor(cute.make_layout((2, NARROW_STEPS)), Uint32)
        rXs = []
        for i in cutlass.range_constexpr(self.lane_pairs):
            rXs.append(cute.make_rmem_tensor(cute.make_layout(NARROW_STEPS), Float32))
        # Accumulators 4c + (0, 1, 2, 3): rows g, g, g + 8, g + 8 of lane pairs 2c, 2c + 1,
        # 2c, 2c + 1.
        rAcc = cute.make_rmem_tensor(cute.make_layout(self.tuning.pairs // 2), Float32)
        rAcc.fill(0.0)
        regs = (rW, rS, rX, rXs)
        # humming: the warpgroup's 64-row block, and this lane's word pair and scale pair in
        # each of its k32 blocks (HUMMING_BLOCK_WORDS above).
        w = warp % WARPGROUP_WARPS
        block64 = block // WARPGROUP_WARPS
        word_pair, scale_pair = humming_lane_pairs(w, g, t)
        humming_at = (block64, word_pair, scale_pair)
        source = (mW, mS, mX, mXs, expert, block, lane, g, t, rb, pair_rows, humming_at)
        smem = SmemAllocator()
        rows_desc = Int64(0)
        # The ring's first stages are in flight while the CTA stages the tile's rows.
        ring = None
        if cutlass.const_expr(self.tuning.stages > 0):
            ring = self.ring_start(smem, source, *self.ring_role(warp, lane))
        if cutlass.const_expr(self.tuning.stage_scales):
            # load_chunk reads the lane pairs' scales from the tile's staged copy instead.
            sXs, tile_pairs = self.stage_scales(smem, mXs, mPairRow, start, rows, tidx, t, last)
            source = (mW, mS, mX, sXs, expert, block, lane, g, t, rb, tile_pairs, humming_at)
        if cutlass.const_expr(self.tuning.wgmma):
            rows_desc = self.stage_rows(smem, mX, mPairRow, start, rows, tidx)
        if cutlass.const_expr(self.tuning.ahead):
            self.ring_loop_ahead(ring, source, regs, rows_desc, rAcc)
        elif cutlass.const_expr(self.tuning.stages > 0):
            self.ring_loop(ring, source, regs, rows_desc, rAcc)
        else:
            for q in cutlass.range(self.chunks, unroll=self.tuning.unroll):
                self.load_chunk(source, regs, q)
                self.mma_chunk(regs, q, rows_desc, rAcc)
        self.store_tile(mExpertScale, mOut, rAcc, expert, start, rows, block * NARROW_ROWS + g, t)

    @cute.jit
    def store_tile(self, mExpertScale, mOut, rAcc, expert, start, rows, n0, t):
        """rAcc (lane pairs 2c, 2c + 1 of rows n0 and n0 + 8, mma_e4m3's C order) as BF16 into
        the tile's pair rows of out, pairs past its `rows` not stored; humming's weights scaled by
        2^6 * weight_scale_2[expert] first."""
        output_scale = Float32(1.0)
        if cutlass.const_expr(self.humming):
            output_scale = mExpertScale[expert] * Float32(HUMMING_OUTPUT_SCALE)
        for i in cutlass.range_constexpr(self.lane_pairs):
            c, h = i // 2, i % 2
            pair = 8 * c + 2 * t + h
            if pair < rows:
                row_g = rAcc[4 * c + h] * output_scale
                row_g8 = rAcc[4 * c + 2 + h] * output_scale
                mOut[start + pair, n0] = Uint16(bf16_round(row_g))
                mOut[start + pair, n0 + 8] = Uint16(bf16_round(row_g8))

    @cute.jit
    def specialized_tile(self, tensors, expert, start, rows, bx, thread):
        """The tile's 64 * blocks columns of CTA bx in the specialized form
        (NarrowTuning.expanded_slots): warpgroups 0 .. expanders - 1 expand (expand_chunks), the
        others consume (consume_tile: the consumers stage the tile's rows and scales among
        themselves, behind CONSUMERS_BARRIER, run their chunks, add their sums and the first of
        a block stores them). One CTA barrier after the mbarriers' initialisation publishes it;
        after it the warpgroups synchronise only through the mbarriers, the expanders' ring
        barrier and CONSUMERS_BARRIER, so the expanders start on the ring's first stages while
        the consumers stage (under Nsight Compute, every warp waiting for the staging at a CTA
        barrier took about a quarter of a CTA's time at 56 local experts and T = 16)."""
        mW, mS, mExpertScale, mX, mXs, mPairRow, mOut = tensors
        tidx, warp, lane, g, t = thread
        last = rows - 1
        w = warp % WARPGROUP_WARPS
        word_pair, scale_pair = humming_lane_pairs(w, g, t)
        # The lane's pairs in the MMA's C (a consumer's): 8c + 2t + h of each 8 pairs c.
        pair_rows = [
            self.x_row(mPairRow, start, last, 8 * (i // 2) + 2 * t + i % 2)
            for i in range(self.lane_pairs)
        ]
        humming_at = (bx * self.tuning.blocks, word_pair, scale_pair)
        source = (mW, mS, mX, mXs, expert, bx, lane, g, t, 0, pair_rows, humming_at)
        smem = SmemAllocator()
        # The ring's first stages are in flight while the consumers stage the tile's rows.
        copier = self.tuning.warps if self.tuning.copy_warp else 0
        ring = self.ring_start(smem, source, 0, (warp == copier) & (lane == 0))
        expanded = self.expanded_start(smem, tidx)
        cute.arch.sync_threads()
        expanding = WARPGROUP_WARPS * self.tuning.expanders
        if warp < expanding:
            self.expand_chunks(ring, source, expanded, w, warp // WARPGROUP_WARPS)
        else:
            # The consumers' threads stage the tile's rows (and scales) among themselves.
            stagers = (tidx - expanding * WARP_LANES, self.consumer_threads())
            consuming = (tensors, expert, start, rows, bx, thread, source, expanded, smem, stagers)
            if cutlass.const_expr(self.tuning.copy_warp):
                if warp == self.tuning.warps:
                    # The copy warp: each stage's refill once the expanders have read its slot.
                    for i in cutlass.range(self.ring_stages):
                        self.release_slot(ring, i, i % self.tuning.stages, self.ring_stages)
                else:
                    self.consume_tile(*consuming)
            else:
                self.consume_tile(*consuming)

    def consumer_threads(self) -> int:
        """The specialized form's consumers' threads (CONSUMERS_BARRIER's count)."""
        return self.tuning.consumers() * WARPGROUP_WARPS * WARP_LANES

    @cute.jit
    def consume_tile(
        self, tensors, expert, start, rows, bx, thread, source, expanded, smem, stagers
    ):
        """A consumer warpgroup's part of specialized_tile: the tile's rows (and scales) staged
        with the other consumers (`stagers`: this thread's index among them and their count),
        its chunks (consume_chunks), then its block's sums added in turn order and stored by the
        block's first consumer."""
        mW, mS, mExpertScale, mX, mXs, mPairRow, mOut = tensors
        tidx, warp, lane, g, t = thread
        if cutlass.const_expr(self.tuning.stage_scales):
            sXs, tile_pairs = self.stage_scales(
                smem, mXs, mPairRow, start, rows, stagers[0], t, rows - 1, stagers[1]
            )
            mW, mS, mX, _, expert, bx, lane, g, t, rb, _, humming_at = source
            source = (mW, mS, mX, sXs, expert, bx, lane, g, t, rb, tile_pairs, humming_at)
        rows_desc = self.stage_rows(smem, mX, mPairRow, start, rows, stagers[0], stagers[1])
        w = warp % WARPGROUP_WARPS
        consumer = warp // WARPGROUP_WARPS - self.tuning.expanders
        block, turn = consumer % self.tuning.blocks, consumer // self.tuning.blocks
        rAcc = cute.make_rmem_tensor(cute.make_layout(self.tuning.pairs // 2), Float32)
        rAcc.fill(0.0)
        member = tidx % (WARPGROUP_WARPS * WARP_LANES)  # the thread's index in its warpgroup
        self.consume_chunks(block, turn, source, expanded, rows_desc, rAcc, member)
        # A block's sums in turn order: the consumer of turn u > 0 leaves its own in shared
        # memory (row consumer - blocks), the block's first adds them and stores the tile.
        sSums = expanded[3]
        if turn > 0:
            for i in cutlass.range_constexpr(self.tuning.pairs // 2):
                sSums[consumer - self.tuning.blocks, member, i] = rAcc[i]
        cute.arch.barrier(
            barrier_id=CONSUMERS_BARRIER,
            number_of_threads=self.consumer_threads(),
        )
        if turn == 0:
            for u in cutlass.range_constexpr(1, self.tuning.turns()):
                other = (u - 1) * self.tuning.blocks + block
                for i in cutlass.range_constexpr(self.tuning.pairs // 2):
                    rAcc[i] = rAcc[i] + sSums[other, member, i]
            column = (bx * self.tuning.blocks + block) * HUMMING_BLOCK_ROWS
            n0 = column + w * NARROW_ROWS + g
            self.store_tile(mExpertScale, mOut, rAcc, expert, start, rows, n0, t)

    @cute.jit
    def expanded_start(self, smem, tidx):
        """The specialized form's shared memory beside the ring and the rows: the expanded chunks
        (uint32 [expanded_slots, blocks, *EXPANDED_SHAPE], or with register_a the same bytes as
        [..., *REGISTER_A_SHAPE]), each slot's `full` mbarrier (the 128 threads of the slot's
        expanding warpgroup, e % expanders, arrive when their stores are done) and `empty` one (the
        128 threads of each of the chunk's `blocks` consumers arrive when they have read the slot:
        after their MMAs, or with register_a after their loads), thread 0 initialising both, and the
        consumers' sums (fp32 [consumers - blocks (at least 1), 128, P / 2]). Returns (chunks, full,
        empty, sums)."""
        slots = self.tuning.expanded_slots
        threads = WARPGROUP_WARPS * WARP_LANES
        blocks = self.tuning.blocks
        sA = smem.allocate_tensor(
            Uint32, row_major_layout((slots, blocks, *EXPANDED_SHAPE)), byte_alignment=128
        )
        full = smem.allocate_array(Int64, slots, byte_alignment=8)
        empty = smem.allocate_array(Int64, slots, byte_alignment=8)
        others = max(self.tuning.consumers() - blocks, 1)
        sSums = smem.allocate_tensor(
            Float32, row_major_layout((others, threads, self.tuning.pairs // 2)), byte_alignment=16
        )
        if tidx == 0:
            for s in cutlass.range_constexpr(slots):
                cute.arch.mbarrier_init(full + s, threads)
                cute.arch.mbarrier_init(empty + s, threads * blocks)
            cute.arch.mbarrier_init_fence()
        return sA, full, empty, sSums

    @cute.jit
    def expand_chunks(self, ring_state, source, expanded, w, group):
        """Expanding warpgroup `group` (warp w of it): every stage through the ring (ring_loop's
        slots and refills), chunk c of each stage its own when c % expanders == group, each
        thread's word pairs and s' expanded to e4m3 (expand_humming,
        the A words of the register form) and stored where wgmma's A reads them (register_a:
        where the consumer thread of its position loads them), into expanded slot q %
        expanded_slots once its consumers have released it (the `empty` mbarrier's previous
        phase; the first round passes at once), then fenced for the async proxy (not with
        register_a: only the generic proxy reads the slot) and arrived on the slot's `full`
        mbarrier. The waits are on the consumers of this CTA,
        which take every chunk the expander fills (the same static trip counts), and on the
        ring's own copies (ring_loop)."""
        rW = cute.make_rmem_tensor(cute.make_layout(WORDS_PER_LANE), Uint32)
        rS = cute.make_rmem_tensor(cute.make_layout(NARROW_STEPS), Uint16)
        regs = (rW, rS, None, None)
        sA, full, empty, sSums = expanded
        sW, sS, bars, words_at, scales_at, ring, issuer = ring_state
        g, t = source[7], source[8]
        member, rQuad = None, None
        if cutlass.const_expr(self.tuning.register_a):
            member = WARP_LANES * w + source[6]  # the thread's index in its warpgroup
            rQuad = cute.make_rmem_tensor(cute.make_layout(4), Uint32)
        # Block b of a slot: its word pairs and scale pairs 128 b and 32 b on.
        first, word_pair, scale_pair = source[11]
        block_sources = [
            (
                *source[:11],
                (first, word_pair + b * HUMMING_WORD_PAIRS, scale_pair + b * HUMMING_SCALE_PAIRS),
            )
            for b in range(self.tuning.blocks)
        ]
        slots, per = self.tuning.stages, self.tuning.stage_chunks
        expanded_slots = self.tuning.expanded_slots
        groups = self.ring_stages
        for i in cutlass.range(groups):
            slot = i % slots
            cute.arch.mbarrier_wait(bars + slot, (i // slots) & 1)
            for c in cutlass.range_constexpr(per):
                q = i * per + c
                mine = q < self.chunks
                if cutlass.const_expr(self.tuning.expanders > 1):
                    mine = mine & (group == c % self.tuning.expanders)
                if mine:
                    a = []
                    for b in cutlass.range_constexpr(self.tuning.blocks):
                        self.read_slot(ring_state, block_sources[b], regs, slot, c)
                        for s in cutlass.range_constexpr(NARROW_STEPS):
                            a += self.expand_humming(rW[2 * s], rW[2 * s + 1], rS[s])
                    e = q % expanded_slots
                    cute.arch.mbarrier_wait(empty + e, ((q // expanded_slots) + 1) & 1)
                    if cutlass.const_expr(self.tuning.register_a):
                        self.store_register_a(sA, e, a, rQuad, member)
                    else:
                        for b in cutlass.range_constexpr(self.tuning.blocks):
                            for s in cutlass.range_constexpr(NARROW_STEPS):
                                # A words (rows g, g + 8) x (k 4t.., 16 + 4t..): core columns
                                # 0, 1.
                                for h in cutlass.range_constexpr(2):
                                    for r in cutlass.range_constexpr(2):
                                        word = a[16 * b + 4 * s + 2 * h + r]
                                        sA[e, b, s, h, 2 * w + r, g, t] = word
                        fence_proxy_async_shared()
                    cute.arch.mbarrier_arrive(full + e)
            self.release_slot(ring_state, i, slot, groups)

    @cute.jit
    def register_a_view(self, sA):
        """The expanded slots (expanded_start's) as register_a lays them out: uint32
        [expanded_slots, blocks, *REGISTER_A_SHAPE], the same bytes."""
        return cute.make_tensor(
            sA.iterator,
            row_major_layout((self.tuning.expanded_slots, self.tuning.blocks, *REGISTER_A_SHAPE)),
        )

    @cute.jit
    def store_register_a(self, sA, e, a, rQuad, member):
        """register_a: the expanding thread `member`'s A words `a` (expand_humming's, 16 a
        block) into slot e, block b's k32 block s at [e, b, s, member] of the slots' tensor of
        REGISTER_A_SHAPE (one 16-byte store each, consecutive threads 16 bytes apart)."""
        view = self.register_a_view(sA)
        for b in cutlass.range_constexpr(self.tuning.blocks):
            for s in cutlass.range_constexpr(NARROW_STEPS):
                for i in cutlass.range_constexpr(4):
                    rQuad[i] = a[16 * b + 4 * s + i]
                cute.autovec_copy(rQuad, view[e, b, s, member, None])

    @cute.jit
    def load_register_a(self, sA, e, block, member) -> list:
        """register_a: the consumer thread `member`'s 16 A words of block `block` from slot e
        (store_register_a's layout), four 16-byte loads."""
        view = self.register_a_view(sA)
        rA = cute.make_rmem_tensor(cute.make_layout((4, NARROW_STEPS)), Uint32)
        for s in cutlass.range_constexpr(NARROW_STEPS):
            cute.autovec_copy(view[e, block, s, member, None], rA[None, s])
        return [rA[i, s] for s in range(NARROW_STEPS) for i in range(4)]

    @cute.jit
    def consume_chunks(self, block, turn, source, expanded, rows_desc, rAcc, member):
        """A consumer warpgroup, of 64-row block `block` and turn `turn`: chunks q = turn, turn +
        turns, ..., each its lane pairs' activation scales loaded (load_chunk), its expanded
        slot waited for (`full`), its block's four MMAs from shared memory run and waited for,
        the slot released (`empty`) and the partials promoted into rAcc. register_a: the
        thread (`member` of its warpgroup) loads its A words, releases the slot, then runs the
        MMAs with A from registers."""
        sA, full, empty, sSums = expanded
        rXs = []
        for i in cutlass.range_constexpr(self.lane_pairs):
            rXs.append(cute.make_rmem_tensor(cute.make_layout(NARROW_STEPS), Float32))
        regs = (None, None, None, rXs)
        slots = self.tuning.expanded_slots
        a_first = smem_desc(sA.iterator.toint(), EXPANDED_LBO, EXPANDED_SBO)
        for q in cutlass.range(turn, self.chunks, self.tuning.turns()):
            e = q % slots
            self.load_chunk(source, regs, q, weights=False)
            cute.arch.mbarrier_wait(full + e, (q // slots) & 1)
            if cutlass.const_expr(self.tuning.register_a):
                b_descs = self.rows_descs(rows_desc, q)
                # The words in registers, the slot is free before the MMAs.
                a = self.load_register_a(sA, e, block, member)
                cute.arch.mbarrier_arrive(empty + e)
                partials = wgmma_e4m3_chunk(a, b_descs, self.tuning.pairs)
            else:
                slot_block = e * self.tuning.blocks + block
                slot_units = slot_block * (EXPANDED_CHUNK_BYTES >> DESC_UNIT_SHIFT)
                a_descs = [
                    a_first + Int64(slot_units + s * (EXPANDED_BLOCK_BYTES >> DESC_UNIT_SHIFT))
                    for s in range(NARROW_STEPS)
                ]
                b_descs = self.rows_descs(rows_desc, q)
                partials = wgmma_e4m3_chunk_ss(a_descs, b_descs, self.tuning.pairs)
                cute.arch.mbarrier_arrive(empty + e)
            self.promote_chunk(list(partials), None, rXs, rAcc)

    @cute.jit
    def x_row(self, mPairRow, start, last, n):
        """The row of x that pair n of the tile reads (the tile's pairs start.., its last pair
        `last` on: pairs past the tile read the last's): the pair's own number, or with
        `indexed` its pair_row."""
        row = start + cutlass.min(n, last)
        if cutlass.const_expr(self.indexed):
            row = mPairRow[row]
        return row

    @cute.jit
    def load_chunk(self, source, regs, q, weights: bool = True):
        """Chunk q's loads into `regs`: the lane's weights, unless `weights` is False (the ring
        brought them): "narrow", its 32 weight bytes and its rows' two scale words; "humming",
        per k32 block its word pair (8 bytes) and its rows' two s' bytes; and (mma.sync) its B
        words and its lane pairs' block scales (from L1 or L2: every warp of the CTA reads
        them)."""
        mW, mS, mX, mXs, expert, block, lane, g, t, rb, pair_rows, humming_at = source
        rW, rS, rX, rXs = regs
        weights_cache = cute.nvgpu.CacheEvictionPriority.EVICT_NORMAL
        if cutlass.const_expr(self.tuning.weights_skip_l1):
            weights_cache = cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE
        if cutlass.const_expr(weights and self.humming):
            block64, word_pair, scale_pair = humming_at
            view = cute.make_tensor(rW.iterator, cute.make_layout((2, NARROW_STEPS)))
            for s in cutlass.range_constexpr(NARROW_STEPS):
                at = q * NARROW_STEPS + s
                cute.autovec_copy(
                    mW[expert, at, block64, word_pair, None],
                    view[None, s],
                    l1c_evict_priority=weights_cache,
                )
                rS[s] = mS[expert, at, block64, scale_pair]
        elif cutlass.const_expr(weights):
            cute.autovec_copy(
                mW[expert, block, q, lane, None], rW, l1c_evict_priority=weights_cache
            )
            cute.autovec_copy(mS[expert, block, q, g, None], rS)
        if cutlass.const_expr(not self.tuning.wgmma):
            for s in cutlass.range_constexpr(NARROW_STEPS):
                cute.autovec_copy(mX[rb, q, s, t, None], rX[None, s])
        for i in cutlass.range_constexpr(self.lane_pairs):
            cute.autovec_copy(mXs[pair_rows[i], q, None], rXs[i])

    @cute.jit
    def mma_chunk(self, regs, q, rows_desc, rAcc):
        """Chunk q from `regs`: its MMAs (issue_chunk), waited for, then promoted into rAcc
        (promote_chunk)."""
        rW, rS, rX, rXs = regs
        self.promote_chunk(self.issue_chunk(regs, q, rows_desc, True), rS, rXs, rAcc)

    @cute.jit
    def issue_chunk(self, regs, q, rows_desc, wait: bool) -> list:
        """Chunk q's MMAs from `regs`: per k32 block s, the weights expanded to e4m3 and one MMA
        from zero (the wgmma form: the chunk's four issued together as one group, waited for
        when `wait`; mma.sync always completes). Returns the 4 * P / 2 partials, block by
        block."""
        rW, rS, rX, rXs = regs
        pairs = self.tuning.pairs
        parts = []
        if cutlass.const_expr(self.tuning.wgmma):
            descs = self.rows_descs(rows_desc, q)
            a = []
            for s in cutlass.range_constexpr(NARROW_STEPS):
                if cutlass.const_expr(self.humming):
                    a += self.expand_humming(rW[2 * s], rW[2 * s + 1], rS[s])
                else:
                    a += self.expand(rW[2 * s], rW[2 * s + 1])
            parts = list(wgmma_e4m3_chunk(a, descs, pairs, wait))
        else:
            for s in cutlass.range_constexpr(NARROW_STEPS):
                a = self.expand(rW[2 * s], rW[2 * s + 1])
                parts += list(mma_e4m3(*a, rX[0, s], rX[1, s]))
        return parts

    def rows_descs(self, rows_desc, q) -> list:
        """The descriptors (Int64) of chunk q's four k32 blocks of the staged rows (block q * 4
        + s: two core columns, 2 * 16 * P bytes, a block), from `rows_desc` (stage_rows')."""
        block_units = staged_rows_strides(self.tuning.pairs)[2] >> DESC_UNIT_SHIFT
        return [
            rows_desc + Int64((q * NARROW_STEPS + s) * block_units) for s in range(NARROW_STEPS)
        ]

    @cute.jit
    def promote_chunk(self, partials: list, rS, rXs, rAcc):
        """A chunk's partials (issue_chunk's, complete) scaled by the row's block scales (`rS`,
        "narrow" only: humming's are in the bytes) and the pair's (`rXs`), and added into rAcc
        in block order (for each 8 pairs c: rows g, g, g + 8, g + 8; lane pairs 2c, 2c + 1, 2c,
        2c + 1)."""
        pairs = self.tuning.pairs
        per = pairs // 2  # a thread's partials a block
        parts = [partials[per * s : per * (s + 1)] for s in range(NARROW_STEPS)]
        if cutlass.const_expr(self.humming):
            # The weights' scales are in their bytes: one FFMA an element (exact MX scaling).
            for s in cutlass.range_constexpr(NARROW_STEPS):
                for c in cutlass.range_constexpr(pairs // NARROW_PAIRS):
                    d0, d1, d2, d3 = parts[s][4 * c : 4 * c + 4]
                    xs0, xs1 = rXs[2 * c][s], rXs[2 * c + 1][s]
                    rAcc[4 * c] = rAcc[4 * c] + d0 * xs0
                    rAcc[4 * c + 1] = rAcc[4 * c + 1] + d1 * xs1
                    rAcc[4 * c + 2] = rAcc[4 * c + 2] + d2 * xs0
                    rAcc[4 * c + 3] = rAcc[4 * c + 3] + d3 * xs1
        else:
            for s in cutlass.range_constexpr(NARROW_STEPS):
                sg, sg8 = e8m0_byte(rS[0], s), e8m0_byte(rS[1], s)
                for c in cutlass.range_constexpr(pairs // NARROW_PAIRS):
                    d0, d1, d2, d3 = parts[s][4 * c : 4 * c + 4]
                    xs0, xs1 = rXs[2 * c][s], rXs[2 * c + 1][s]
                    rAcc[4 * c] = rAcc[4 * c] + d0 * (sg * xs0)
                    rAcc[4 * c + 1] = rAcc[4 * c + 1] + d1 * (sg * xs1)
                    rAcc[4 * c + 2] = rAcc[4 * c + 2] + d2 * (sg8 * xs0)
                    rAcc[4 * c + 3] = rAcc[4 * c + 3] + d3 * (sg8 * xs1)

    @staticmethod
    def expand(row_g, row_g8) -> list:
        """A k32 block's four A words (rows g and g + 8) from the rows' two code words."""
        return [
            e4m3_from_low(row_g),
            e4m3_from_low(row_g8),
            e4m3_from_high(row_g),
            e4m3_from_high(row_g8),
        ]

    @staticmethod
    def expand_humming(word_g, word_g8, exponents: Uint16) -> list:
        """A k32 block's four A words (rows g and g + 8: k 4t..4t+3, then 16 + 4t..) from the
        rows' prepared words and their s' bytes (row g's the low byte)."""
        bytes_ = Uint32(exponents)
        g0, g1 = humming_e4m3(word_g, bytes_ & Uint32(BYTE_MASK))
        g80, g81 = humming_e4m3(word_g8, bytes_ >> 8)
        return [g0, g80, g1, g81]

    def ring_role(self, warp, lane) -> tuple:
        """(ring, issuer) of a thread in the chained forms: its warp's ring ("narrow") or its
        warpgroup's ("humming"), and whether it issues the ring's copies (lane 0 of the warp,
        or of the warpgroup's first warp)."""
        if self.humming:
            return warp // WARPGROUP_WARPS, (lane == 0) & (warp % WARPGROUP_WARPS == 0)
        return warp, lane == 0

    @cute.jit
    def ring_start(self, smem, source, ring, issuer):
        """The rings in shared memory, one a warp ("narrow") or a warpgroup ("humming"; the
        specialized form has one, its expanding warpgroup's), each `stages` slots of
        stage_chunks chunks, codes and scales: the slots and mbarriers allocated, and ring
        `ring`'s initialised and its first `stages` stages issued as bulk copies on the slots'
        mbarriers by its issuing thread (`issuer` true in that thread only; ring_role).
        Returns what ring_loop takes. The initialisation is seen by the other warps of a
        warpgroup through a CTA barrier before any waits (stage_rows', or the specialized
        form's own)."""
        mW, mS, mX, mXs, expert, block, lane, g, t, rb, pair_rows, humming_at = source
        slots, per = self.tuning.stages, self.tuning.stage_chunks
        rings = self.tuning.rings()
        groups = self.ring_stages
        if cutlass.const_expr(self.humming):
            sW = smem.allocate_tensor(
                Uint32,
                row_major_layout(
                    (rings, slots, per, NARROW_STEPS, self.tuning.blocks * HUMMING_WORD_PAIRS, 2)
                ),
                byte_alignment=128,
            )
            sS = smem.allocate_tensor(
                Uint16,
                row_major_layout(
                    (rings, slots, per, NARROW_STEPS, self.tuning.blocks * HUMMING_SCALE_PAIRS)
                ),
                byte_alignment=16,
            )
            # The warpgroup's block 0 of group 0 in global memory; group i is i * 4N words
            # (16 N bytes) and i * N scale bytes on.
            first = Int64(expert) * (self.k // SCALE_BLOCK)
            block64 = humming_at[0]
            words_at = mW.iterator.toint() + (
                first * (4 * self.n) + Int64(block64) * HUMMING_BLOCK_WORDS
            ) * Int64(4)
            scales_at = mS.iterator.toint() + first * self.n + Int64(block64) * HUMMING_BLOCK_ROWS
        else:
            sW = smem.allocate_tensor(
                Uint32,
                row_major_layout((rings, slots, per, WARP_LANES, WORDS_PER_LANE)),
                byte_alignment=128,
            )
            sS = smem.allocate_tensor(
                Uint32, row_major_layout((rings, slots, per, 8, 2)), byte_alignment=16
            )
            # This warp's codes and scales in global memory: chunk q at words_at + q * 1 KiB.
            first = (Int64(expert) * self.blocks + Int64(block)) * self.chunks
            words_at = mW.iterator.toint() + first * CHUNK_WORD_BYTES
            scales_at = mS.iterator.toint() + first * CHUNK_SCALE_BYTES
        bars = smem.allocate_array(Int64, rings * slots, byte_alignment=8)
        mine = ring * slots
        if issuer:
            for s in cutlass.range_constexpr(slots):
                cute.arch.mbarrier_init(bars + (mine + s), 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_warp()
        if issuer:
            for s in cutlass.range_constexpr(min(slots, groups)):
                self.issue_stage(sW, sS, bars, mine, ring, s, s, words_at, scales_at)
        return sW, sS, bars, words_at, scales_at, ring, issuer

    @cute.jit
    def ring_loop(self, ring_state, source, regs, rows_desc, rAcc):
        """The chunks through the ring (ring_start): the ring's threads wait for a slot, read
        their chunks into registers and compute them, then the issuing thread refills the slot
        with the stage `stages` on, once every thread of the ring has read it (a warp's
        sync_warp, or the warpgroup's named barrier). No CTA barrier is needed. The waits are on
        the ring's own copies from global memory, which the hardware completes (a faulting copy
        fails the launch), so they carry no timeout."""
        mW, mS, mX, mXs, expert, block, lane, g, t, rb, pair_rows, humming_at = source
        rW, rS, rX, rXs = regs
        sW, sS, bars, words_at, scales_at, ring, issuer = ring_state
        slots, per = self.tuning.stages, self.tuning.stage_chunks
        groups = self.ring_stages
        mine = ring * slots
        for i in cutlass.range(groups):
            slot = i % slots
            cute.arch.mbarrier_wait(bars + (mine + slot), (i // slots) & 1)
            for c in cutlass.range_constexpr(per):
                q = i * per + c
                if q < self.chunks:
                    self.read_slot(ring_state, source, regs, slot, c)
                    self.load_chunk(source, regs, q, weights=False)
                    self.mma_chunk(regs, q, rows_desc, rAcc)
            self.release_slot(ring_state, i, slot, groups)

    @cute.jit
    def ring_loop_ahead(self, ring_state, source, regs, rows_desc, rAcc):
        """ring_loop with each stage's MMAs one chunk ahead of its promotions (`ahead`): chunk
        c + 1's MMAs are issued before chunk c's are waited for (wgmma.wait_group 1) and
        promoted, so they run under its promotion. A stage's last chunk is waited for (group 0)
        before the stage ends: no MMA is in flight across the loop's back edge, where ptxas
        serializes every wgmma of the loop (C7514: its outputs read in the pipeline stage). The
        activations' scales of two chunks alternate between two register sets. The stages are
        the full ones in the loop and a part one (K / 128 % stage_chunks chunks) after it."""
        rW, rS, rX, rXs = regs
        per = self.tuning.stage_chunks
        full, tail = self.chunks // per, self.chunks % per
        groups = full + (1 if tail else 0)
        rXsOther = []
        for i in cutlass.range_constexpr(self.lane_pairs):
            rXsOther.append(cute.make_rmem_tensor(cute.make_layout(NARROW_STEPS), Float32))
        scale_sets = (rXs, rXsOther)
        for i in cutlass.range(full):
            self.ahead_stage(ring_state, source, regs, scale_sets, rows_desc, rAcc, i, per, groups)
        if cutlass.const_expr(tail > 0):
            self.ahead_stage(
                ring_state, source, regs, scale_sets, rows_desc, rAcc, full, tail, groups
            )

    @cute.jit
    def ahead_stage(self, ring_state, source, regs, scale_sets, rows_desc, rAcc, i, count, groups):
        """Stage i of ring_loop_ahead: its `count` chunks (a Python int), each issued before
        the previous one's wait and promotion, the last waited for at the end."""
        rW, rS, rX, rXs = regs
        sW, sS, bars, words_at, scales_at, ring, issuer = ring_state
        slots, per = self.tuning.stages, self.tuning.stage_chunks
        slot = i % slots
        cute.arch.mbarrier_wait(bars + (ring * slots + slot), (i // slots) & 1)
        previous = None
        for c in cutlass.range_constexpr(count):
            q = i * per + c
            chunk_regs = (rW, rS, rX, scale_sets[c % 2])
            self.read_slot(ring_state, source, chunk_regs, slot, c)
            self.load_chunk(source, chunk_regs, q, weights=False)
            issued = self.issue_chunk(chunk_regs, q, rows_desc, False)
            # No row scales (None): humming's are in the bytes (`ahead` is its form only).
            if cutlass.const_expr(c > 0):
                done = wgmma_wait_keeping(previous[0], 1)
                self.promote_chunk(done, None, previous[1], rAcc)
            previous = (issued, scale_sets[c % 2])
        done = wgmma_wait_keeping(previous[0], 0)
        self.promote_chunk(done, None, previous[1], rAcc)
        self.release_slot(ring_state, i, slot, groups)

    @cute.jit
    def read_slot(self, ring_state, source, regs, slot, c):
        """Chunk c of the ring's slot `slot` into this thread's weight registers: "humming", per
        k32 block its word pair and its rows' s' pair (source's humming_at: the specialized
        form's slots hold `blocks` 64-row blocks, its word and scale pairs 128 and 32 on a
        block); "narrow", its lane's 32 bytes and its rows' scale words."""
        mW, mS, mX, mXs, expert, block, lane, g, t, rb, pair_rows, humming_at = source
        rW, rS, rX, rXs = regs
        sW, sS, bars, words_at, scales_at, ring, issuer = ring_state
        if cutlass.const_expr(self.humming):
            word_pair, scale_pair = humming_at[1], humming_at[2]
            view = cute.make_tensor(rW.iterator, cute.make_layout((2, NARROW_STEPS)))
            for s in cutlass.range_constexpr(NARROW_STEPS):
                cute.autovec_copy(sW[ring, slot, c, s, word_pair, None], view[None, s])
                rS[s] = sS[ring, slot, c, s, scale_pair]
        else:
            cute.autovec_copy(sW[ring, slot, c, lane, None], rW)
            cute.autovec_copy(sS[ring, slot, c, g, None], rS)

    @cute.jit
    def release_slot(self, ring_state, i, slot, groups):
        """After stage i: every thread's reads of the slot done (their values used), the
        issuing thread refills it with stage i + stages, if there is one."""
        sW, sS, bars, words_at, scales_at, ring, issuer = ring_state
        slots = self.tuning.stages
        if cutlass.const_expr(self.humming):
            # The copy warp (copy_warp) waits here too, then issues.
            cute.arch.barrier(
                barrier_id=FIRST_WARPGROUP_BARRIER + ring,
                number_of_threads=self.tuning.ring_threads(),
            )
        else:
            cute.arch.sync_warp()
        if issuer and i + slots < groups:
            mine = ring * slots
            self.issue_stage(sW, sS, bars, mine, ring, i + slots, slot, words_at, scales_at)

    @cute.jit
    def issue_stage(self, sW, sS, bars, mine, ring, stage, slot, words_at, scales_at):
        """The issuing thread: expect stage `stage`'s bytes on slot `slot`'s mbarrier and copy
        its chunks' codes and scales there (the last stage may hold fewer chunks): a warp's
        contiguous chunks in two copies ("narrow"), or per chunk and k32 block one 1 KiB block
        of words and its 64 scale bytes ("humming": blocks 16 N bytes apart in global memory;
        the specialized form's `blocks` adjacent blocks in each copy)."""
        per = self.tuning.stage_chunks
        count = cutlass.min(per, self.chunks - stage * per)
        barrier = bars + (mine + slot)
        if cutlass.const_expr(self.humming):
            blocks = self.tuning.blocks
            cute.arch.mbarrier_arrive_and_expect_tx(barrier, count * HUMMING_CHUNK_BYTES * blocks)
            for c in cutlass.range_constexpr(per):
                if c < count:
                    for s in cutlass.range_constexpr(NARROW_STEPS):
                        group = Int64((stage * per + c) * NARROW_STEPS + s)
                        bulk_copy_to_shared(
                            sW[ring, slot, c, s, 0, None].iterator.toint(),
                            words_at + group * (16 * self.n),
                            HUMMING_BLOCK_BYTES * blocks,
                            barrier.toint(),
                        )
                        bulk_copy_to_shared(
                            sS[ring, slot, c, s, None].iterator.toint(),
                            scales_at + group * self.n,
                            HUMMING_BLOCK_ROWS * blocks,
                            barrier.toint(),
                        )
        else:
            cute.arch.mbarrier_arrive_and_expect_tx(
                barrier, count * (CHUNK_WORD_BYTES + CHUNK_SCALE_BYTES)
            )
            at = Int64(stage * per)
            bulk_copy_to_shared(
                sW[ring, slot, 0, 0, None].iterator.toint(),
                words_at + at * CHUNK_WORD_BYTES,
                count * CHUNK_WORD_BYTES,
                barrier.toint(),
            )
            bulk_copy_to_shared(
                sS[ring, slot, 0, 0, None].iterator.toint(),
                scales_at + at * CHUNK_SCALE_BYTES,
                count * CHUNK_SCALE_BYTES,
                barrier.toint(),
            )

    @cute.jit
    def stage_scales(self, smem, mXs, mPairRow, start, rows, tidx, t, last, threads=None):
        """Copy the tile's P rows of activation scales (fp32 [K / 128, 4] each; zeros past its
        `rows` pairs) into shared memory by 16-byte cp.async, one a (pair, chunk). Returns them
        as a tensor [P, K / 128, 4] that load_chunk reads as it reads x_scales, and the rows of
        it this lane's pairs read (pair 8c + 2t + h of the tile for lane pair 2c + h; pairs past
        the tile its last pair's, `last` = rows - 1, as pair_rows). Complete after stage_rows'
        wait and barrier, which follow before any chunk. `tidx` of `threads` staging threads
        (None: the CTA's)."""
        pairs = self.tuning.pairs
        threads = self.tuning.threads() if threads is None else threads
        sXs = smem.allocate_tensor(
            Float32, row_major_layout((pairs, self.chunks, NARROW_STEPS)), byte_alignment=16
        )
        scales_at = mXs.iterator.toint()
        staged_at = sXs.iterator.toint()
        # A chunk's four scales of a pair are one 16-byte copy; a row's K / 32 scales follow on.
        # Consecutive threads copy consecutive chunks of one row: contiguous reads and stores
        # (pairs fastest put the stores K / 8 bytes apart, all in the same four banks at FC2).
        row_bytes = self.chunks * VECTOR_BYTES
        for task in cutlass.range(tidx, pairs * self.chunks, threads):
            q, n = task % self.chunks, task // self.chunks
            row = self.x_row(mPairRow, start, rows - 1, n)
            src = scales_at + Int64(row) * row_bytes + Int64(q * VECTOR_BYTES)
            size = cutlass.select_(n < rows, VECTOR_BYTES, 0)
            copy_16_async(staged_at + n * row_bytes + q * VECTOR_BYTES, src, size)
        lane_rows = [
            cutlass.min(8 * (i // 2) + 2 * t + i % 2, last) for i in range(self.lane_pairs)
        ]
        return sXs, lane_rows

    @cute.jit
    def stage_rows(self, smem, mX, mPairRow, start, rows, tidx, threads=None) -> Int64:
        """Copy the tile's P rows of x (zeros past its `rows` pairs) into shared memory in the
        wgmma's K-major layout without swizzle, and return the descriptor of its first k32 block.
        Layout (`staged_rows_strides`): core column c (16 bytes of K) of row n at byte 16 P c +
        16 n, so 8-row groups 128 bytes apart (SBO) and core columns 16 P (LBO); within each
        32-byte block of K the words are permuted as the weights' k order (narrow_layout.py): the
        MMA's words 0-3 are the row's words 0, 2, 4, 6 and its words 4-7 the row's 1, 3, 5, 7
        ("narrow": each thread loads a block and stores its words, one block at a time), or in
        the row's order ("humming": each core column one 16-byte cp.async, a thread's issued
        before one wait; rows past the tile's zero-filled, though no output of theirs is
        stored). `tidx` of `threads` staging threads: None, the CTA's, which meet at a CTA
        barrier after; else the specialized form's consumers, at CONSUMERS_BARRIER."""
        pairs = self.tuning.pairs
        blocks = self.k // SCALE_BLOCK
        staged_by_cta = threads is None
        threads = self.tuning.threads() if staged_by_cta else threads
        sRows = smem.allocate_tensor(
            Uint32, row_major_layout(staged_rows_shape(self.k, pairs)), byte_alignment=128
        )
        if cutlass.const_expr(self.humming):
            # Thread pairs take the two core columns of one row's k32 block (one 32-byte sector
            # of x), consecutive pairs consecutive rows (a warp's writes are runs of contiguous
            # bytes). The narrow form's loop (one block a thread at a time, each load waited
            # for) is what the wider tiles ran at 2.2-4.5x humming's time (docs/experts.md,
            # "Wider tiles"); here every copy of a thread is issued before one wait.
            x_at = mX.iterator.toint()
            rows_at = sRows.iterator.toint()
            tasks = 2 * pairs * blocks
            if cutlass.const_expr(threads % (2 * pairs) == 0):
                # Each thread keeps its row and half (P = 8, 16, 32 with 8 warps): one row
                # lookup, then only addresses in the loop.
                half, n = tidx % 2, (tidx // 2) % pairs
                row = self.x_row(mPairRow, start, rows - 1, n)
                row_at = x_at + Int64(row) * self.k
                size = cutlass.select_(n < rows, CORE_ROW_BYTES, 0)
                for task in cutlass.range(tidx, tasks, threads):
                    column = 2 * (task // (2 * pairs)) + half
                    src = row_at + Int64(CORE_ROW_BYTES * column)
                    copy_16_async(rows_at + staged_row_offset(column, n, pairs), src, size)
            else:
                for task in cutlass.range(tidx, tasks, threads):
                    half, n, b = task % 2, (task // 2) % pairs, task // (2 * pairs)
                    row = self.x_row(mPairRow, start, rows - 1, n)
                    column = 2 * b + half
                    src = x_at + Int64(row) * self.k + Int64(CORE_ROW_BYTES * column)
                    size = cutlass.select_(n < rows, CORE_ROW_BYTES, 0)
                    copy_16_async(rows_at + staged_row_offset(column, n, pairs), src, size)
            cp_async_wait_all()
        else:
            mBlocks = cute.make_tensor(
                mX.iterator, row_major_layout((mX.shape[0], blocks, WORDS_PER_LANE))
            )
            rBlock = cute.make_rmem_tensor(cute.make_layout(WORDS_PER_LANE), Uint32)
            # Consecutive threads take consecutive rows of one block: their 16-byte stores are
            # 16 bytes apart (with the blocks fastest they were 32 P apart, all in the same four
            # banks).
            for task in cutlass.range(tidx, pairs * blocks, threads):
                n, b = task % pairs, task // pairs
                rBlock.fill(0)
                if n < rows:
                    row = start + n
                    if cutlass.const_expr(self.indexed):
                        row = mPairRow[row]
                    cute.autovec_copy(mBlocks[row, b, None], rBlock)
                for i in cutlass.range_constexpr(4):
                    sRows[2 * b, n, i] = rBlock[2 * i]
                    sRows[2 * b + 1, n, i] = rBlock[2 * i + 1]
        fence_proxy_async_shared()
        if cutlass.const_expr(staged_by_cta):
            cute.arch.sync_threads()
        else:
            cute.arch.barrier(barrier_id=CONSUMERS_BARRIER, number_of_threads=threads)
        leading, stride, _ = staged_rows_strides(pairs)
        return smem_desc(sRows.iterator.toint(), leading, stride)


def specialized_problems(tuning: NarrowTuning) -> list[str]:
    """What keeps the specialized form (expanded_slots > 0) from running `tuning`, one phrase
    each (empty when it can run): it needs humming's weights, wgmma, a ring (stages > 0) and
    not `ahead`; at least one expanding warpgroup, stage_chunks and expanded_slots multiples of
    their count; consumers (the warpgroups beside the expanding ones) a positive multiple of
    `blocks`; at least as many expanded slots as a block's consumers (turns): a consumer
    waits on chunk q's slot for the phase after the one chunk q - turns completed, which
    passes at once unless chunk q - expanded_slots was filled before; and with several
    expanders, expanded_slots a multiple of turns or turns a multiple of expanders: otherwise
    chunk q - turns and chunk q - expanded_slots belong to different expanders, which nothing
    orders within a ring stage, and the wait can pass a phase early (a review's model of the
    barriers under random interleavings found it with 3 expanders, 3 slots and 2 turns, and
    with 2 expanders, 4 slots and 3 turns)."""
    problems = []
    if tuning.weights != "humming" or not tuning.wgmma:
        problems.append("weights='humming' with wgmma")
    if tuning.stages < 1 or tuning.ahead:
        problems.append("a ring (stages > 0) without `ahead`")
    if tuning.expanders < 1:
        # The consumers are the warpgroups beside the expanders: without a count of expanders
        # there is nothing right to say about them or the slots.
        return [*problems, "expanders >= 1"]
    if tuning.stage_chunks % tuning.expanders or tuning.expanded_slots % tuning.expanders:
        problems.append(
            f"stage_chunks and expanded_slots multiples of expanders={tuning.expanders} (each"
            " expanding warpgroup its own chunks of a stage and its own slots)"
        )
    if tuning.warps % WARPGROUP_WARPS or tuning.consumers() < 1:
        problems.append(
            f"warps a multiple of {WARPGROUP_WARPS}, at least {WARPGROUP_WARPS} more than the"
            f" expanders' {WARPGROUP_WARPS * tuning.expanders}"
        )
    elif tuning.blocks < 1 or tuning.consumers() % tuning.blocks:
        problems.append(
            f"blocks={tuning.blocks} dividing the {tuning.consumers()} consumer warpgroups"
        )
    elif tuning.expanded_slots < tuning.turns():
        problems.append(
            f"expanded_slots at least the consumers a block ({tuning.turns()}: a consumer's wait"
            " on a slot would pass before the slot is filled)"
        )
    elif tuning.expanded_slots % tuning.turns() and tuning.turns() % tuning.expanders:
        problems.append(
            f"expanded_slots a multiple of the consumers a block ({tuning.turns()}), or those a"
            f" multiple of expanders={tuning.expanders} (else a consumer's wait on a slot whose"
            " chunk another expander has not yet filled passes a phase early)"
        )
    return problems


def specialized_fits(tuning: NarrowTuning) -> bool:
    """Whether the specialized form can run `tuning` (specialized_problems has none)."""
    return not specialized_problems(tuning)


# NarrowTuning's annotations (strings: the module's annotations are postponed) and the check of a
# value of each: a flag is a bool, a count an int and not a bool, a form's name a str.
TUNING_FIELD_TYPES = {
    "bool": lambda value: type(value) is bool,
    "int": lambda value: type(value) is int,
    "str": lambda value: isinstance(value, str),
}


def smem_bytes(k: int, tuning: NarrowTuning) -> int:
    """Shared memory a CTA takes at K = k: the tile's staged rows (wgmma: P * K bytes) and
    scales (stage_scales: P * K / 8 bytes), the rings (NarrowTuning.ring_bytes) and their
    mbarriers (8 bytes a slot), and the specialized form's expanded chunks and sums
    (NarrowTuning.expanded_bytes), before the allocator's alignment (at most 128 + 16 + 16 + 8
    bytes more; in the specialized form at most 120 before its expanded chunks and 112 before
    the rows, 232: within SMEM_LIMIT's margin of 256)."""
    rows = tuning.pairs * k if tuning.wgmma else 0
    scales = tuning.pairs * (k // SCALE_BLOCK) * 4 if tuning.stage_scales else 0
    ring = tuning.ring_bytes() + 8 * tuning.rings() * tuning.stages
    return rows + scales + ring + tuning.expanded_bytes()


class NarrowGemmLaunch:
    """NarrowGemmKernel's launch for one (N, K, indexed): its compile (once, at construction) and
    its launch on torch tensors.

    Constraints (stated here once): every NarrowTuning field of its annotated type (a flag a bool, a
    count an int; indexed a bool); N a multiple of tuning.columns() (128 by default), K of 128;
    unroll >= 1; the wgmma forms for sm_90a only; with tuning.wgmma, warps a multiple of 4;
    tuning.pairs 8, or with wgmma 16, 24 or 32; `ahead` only on humming's weights through a ring of
    2 chunks a stage or more, `stage_scales` only on humming's weights; the specialized form
    (expanded_slots > 0, with `blocks`, `expanders`, `copy_warp` and `register_a` its only) as
    specialized_problems says; N at most MAX_N; at most 1024 threads a CTA; shared memory a CTA
    (`smem_bytes`: the staged rows, P * K bytes with wgmma, the staged scales, P * K / 8 bytes with
    stage_scales, the ring, and the expanded chunks and sums) at most SMEM_LIMIT; at most
    MAX_TILE_SLOTS tile slots (the grid's second axis); the tiles of
    block_n tuning.pairs; words and scales from narrow_weights of [E, N, K/2] weights, or
    with tuning.weights "humming" (wgmma only) humming's prepared weight, weight_scale and
    weight_scale_2 (HummingGemm.prepare's tensors, or humming_layout.prepared_weights'); x
    e4m3 (or uint8) [rows_in, K] and x_scales fp32 [rows_in, K/32] contiguous; out bf16
    [rows_out, N] contiguous, rows_out >= every pair number of a tile; all 16-byte aligned;
    indexed: pair j reads row pair_row[j] (int32 [rows_out]) of x, else row j. The grid is one
    CTA per (columns, tile slot): no CTA waits for another, so no co-residency; a tile slot past
    num_tiles exits at once. The writers of every input come before the launch on its
    stream. Capturable: no host synchronisation, and no allocation.
    """

    def __init__(
        self,
        n: int,
        k: int,
        indexed: bool,
        tuning: NarrowTuning = NarrowTuning(),
        arch: str | None = None,
    ):
        """Compile for `arch` (None: this process's GPU). ValueError when (N, K) or the tuning
        do not fit."""
        if not isinstance(tuning, NarrowTuning):
            raise ValueError(f"NarrowGemmLaunch: tuning {tuning!r}; expected a NarrowTuning")
        for field in dataclasses.fields(NarrowTuning):
            # Each field of its annotated type (TUNING_FIELD_TYPES: every annotation a field
            # may have); a numpy int or bool is refused as N and K are.
            value = getattr(tuning, field.name)
            if not TUNING_FIELD_TYPES[field.type](value):
                raise ValueError(
                    f"NarrowGemmLaunch: NarrowTuning.{field.name}={value!r}; expected {field.type}"
                )
        if type(indexed) is not bool:
            raise ValueError(f"NarrowGemmLaunch: indexed={indexed!r}; expected a bool")
        if tuning.wgmma and arch not in (None, "sm_90a"):
            raise ValueError(
                f"NarrowGemmLaunch: arch {arch!r} with {tuning}; the wgmma forms are SM90's"
                " (sm_90a); the mma.sync form (wgmma=False) compiles for others"
            )
        if tuning.unroll < 1:
            raise ValueError(f"NarrowGemmLaunch: {tuning}; unroll >= 1")
        if tuning.expanded_slots < 0:
            raise ValueError(
                f"NarrowGemmLaunch: {tuning}; expanded_slots >= 0 (0: not specialized)"
            )
        if (
            tuning.blocks != 1 or tuning.expanders != 1 or tuning.copy_warp or tuning.register_a
        ) and not tuning.expanded_slots:
            raise ValueError(
                f"NarrowGemmLaunch: {tuning}; blocks and expanders other than 1, copy_warp and"
                " register_a are forms of the specialized form (expanded_slots > 0)"
            )
        if tuning.warps < 1 or tuning.threads() > MAX_CTA_THREADS:
            raise ValueError(
                f"NarrowGemmLaunch: {tuning}; a CTA of 1 to {MAX_CTA_THREADS // WARP_LANES}"
                " warps, the copy warp counted"
            )
        if tuning.expanded_slots and not specialized_fits(tuning):
            raise ValueError(
                f"NarrowGemmLaunch: {tuning}; the specialized form (expanded_slots > 0) needs "
                + "; ".join(specialized_problems(tuning))
            )
        sizes = all(type(size) is int and size > 0 for size in (n, k))
        if not sizes or not narrow_fits(n, k) or n % tuning.columns():
            raise ValueError(
                f"NarrowGemmLaunch: N={n!r}, K={k!r}; need positive ints with N %"
                f" {tuning.columns()} == 0 and K % {NARROW_CHUNK_K} == 0"
            )
        if n > MAX_N:
            raise ValueError(
                f"NarrowGemmLaunch: N={n}; at most {MAX_N} (the kernel's column arithmetic is"
                " 32-bit)"
            )
        if tuning.wgmma and tuning.warps % WARPGROUP_WARPS:
            raise ValueError(
                f"NarrowGemmLaunch: {tuning}; the wgmma form needs warps in whole warpgroups"
                f" ({WARPGROUP_WARPS})"
            )
        if tuning.pairs not in NARROW_TILE_PAIRS or not (
            tuning.wgmma or tuning.pairs == NARROW_PAIRS
        ):
            raise ValueError(
                f"NarrowGemmLaunch: {tuning}; tiles of {NARROW_PAIRS} pairs, or with wgmma one of"
                f" {NARROW_TILE_PAIRS}"
            )
        if tuning.weights not in WEIGHT_FORMS or (tuning.weights == "humming" and not tuning.wgmma):
            raise ValueError(
                f"NarrowGemmLaunch: {tuning}; weights one of {WEIGHT_FORMS}, and humming's only"
                " with wgmma (its A operand from registers)"
            )
        if tuning.stages < 0 or tuning.stage_chunks < 1:
            raise ValueError(
                f"NarrowGemmLaunch: {tuning}; need stages >= 0 (0: no ring) and stage_chunks >= 1"
            )
        if tuning.ahead and (
            tuning.weights != "humming" or tuning.stages == 0 or tuning.stage_chunks < 2
        ):
            raise ValueError(
                f"NarrowGemmLaunch: {tuning}; `ahead` is a form of the humming weights' ring"
                " (weights='humming', stages > 0) whose stages hold 2 chunks or more (its MMAs"
                " run ahead within a stage)"
            )
        if tuning.stage_scales and tuning.weights != "humming":
            raise ValueError(
                f"NarrowGemmLaunch: {tuning}; stage_scales is a form of the humming weights'"
                " (weights='humming'), whose rows it is staged with"
            )
        smem = smem_bytes(k, tuning)
        if smem > SMEM_LIMIT:
            raise ValueError(
                f"NarrowGemmLaunch: {tuning} at K={k} takes {smem} bytes of shared memory a CTA;"
                f" at most {SMEM_LIMIT} (fewer warps, stages, stage_chunks, expanded_slots,"
                " blocks or pairs, or stage_scales off)"
            )
        self.n, self.k, self.indexed, self.tuning = n, k, indexed, tuning
        z = Int64(0)
        self.compiled = compile_kernel(
            lambda: (NarrowGemmKernel(n, k, indexed, tuning), (z,) * 11 + (Int32(1),) * 4), arch
        )

    def grid(self, tiles: int) -> tuple[int, int]:
        """CTAs for `tiles` tile slots: (N / tuning.columns(), tiles)."""
        return self.n // self.tuning.columns(), tiles

    def __call__(
        self, words, scales, x, x_scales, pair_row, groups, out, stream: int, expert_scale=None
    ) -> torch.Tensor:
        """Launch on `stream` (a CUstream handle) for the tiles of `groups` (a PairGroups of
        block_n tuning.pairs): out[j] for every pair j of its tiles; other rows untouched.
        With tuning.weights "humming": words, scales, expert_scale are humming's weight int32
        [E, K/32, 4N], weight_scale (1-byte) [E, K/32, N] and weight_scale_2 fp32 [E]."""
        humming = self.tuning.weights == "humming"
        if humming and not isinstance(expert_scale, (torch.Tensor, type(None))):
            raise ValueError(
                f"NarrowGemmLaunch: expert_scale {type(expert_scale).__name__}; expected"
                " humming's weight_scale_2, fp32 [E]"
            )
        if humming and expert_scale is not None and expert_scale.dim() != 1:
            raise ValueError(
                f"NarrowGemmLaunch: expert_scale {tuple(expert_scale.shape)}; expected"
                " humming's weight_scale_2, fp32 [E]"
            )
        if humming != (expert_scale is not None):
            raise ValueError(
                f"NarrowGemmLaunch: expert_scale {'missing' if humming else 'given'}; the"
                f" {self.tuning.weights} weights {'take' if humming else 'take no'} expert_scale"
                " (humming's weight_scale_2)"
            )
        if groups.block_n != self.tuning.pairs:
            raise ValueError(
                f"NarrowGemmLaunch: tiles of {groups.block_n} pairs; expected"
                f" {self.tuning.pairs} (tuning.pairs)"
            )
        groups_k = self.k // SCALE_BLOCK
        expected = {
            "words": (words, (self.n // NARROW_ROWS, self.k // NARROW_CHUNK_K, WARP_LANES, 8)),
            "scales": (scales, (self.n // NARROW_ROWS, self.k // NARROW_CHUNK_K, 8, 2)),
            "x": (x, (self.k,)),
            "x_scales": (x_scales, (self.k // SCALE_BLOCK,)),
            "out": (out, (self.n,)),
        }
        if humming:
            expected["words"] = (words, (groups_k, 4 * self.n))
            expected["scales"] = (scales, (groups_k, self.n))
            expected["expert_scale"] = (expert_scale.unsqueeze(1), (1,))
        for name, (tensor, tail) in expected.items():
            if tuple(tensor.shape[1:]) != tail or not tensor.is_contiguous():
                raise ValueError(
                    f"NarrowGemmLaunch: {name} {tuple(tensor.shape)}; expected a contiguous"
                    f" [*, {', '.join(map(str, tail))}] (compiled for N={self.n}, K={self.k})"
                )
        if (
            x.dtype not in E4M3_BYTE_DTYPES
            or x_scales.dtype != torch.float32
            or out.dtype != torch.bfloat16
        ):
            raise ValueError(
                f"NarrowGemmLaunch: x {x.dtype}, x_scales {x_scales.dtype}, out {out.dtype};"
                " expected e4m3 (float8_e4m3fn or its uint8 bytes), fp32 scales and bf16"
            )
        routes = {
            "pair_row": pair_row,
            "tile_expert": groups.tile_expert,
            "tile_start": groups.tile_start,
            "tile_rows": groups.tile_rows,
            "num_tiles": groups.num_tiles,
        }
        if humming:
            bad_scales = scales.element_size() != 1 or expert_scale.dtype != torch.float32
        else:
            bad_scales = scales.dtype != torch.int32
        wrong = [
            f"{name} {t.dtype}{'' if t.is_contiguous() else ' (not contiguous)'}"
            for name, t in {"words": words, **routes}.items()
            if t.dtype != torch.int32 or not t.is_contiguous()
        ]
        if wrong:
            raise ValueError(
                f"NarrowGemmLaunch: {', '.join(wrong)}; words, pair_row and the tiles must be"
                " contiguous int32"
            )
        if pair_row.numel() < out.shape[0] or out.shape[0] < groups.pair_capacity:
            raise ValueError(
                f"NarrowGemmLaunch: out {tuple(out.shape)}, pair_row {tuple(pair_row.shape)},"
                f" the groups' {groups.pair_capacity} pair slots; out needs a row for every pair"
                " slot and pair_row at least out's rows"
            )
        if not self.indexed and x.shape[0] < groups.pair_capacity:
            raise ValueError(
                f"NarrowGemmLaunch: x {tuple(x.shape)}; compiled not indexed, pair j reads row j"
                f" of x: it needs the groups' {groups.pair_capacity} rows"
            )
        if bad_scales:
            raise ValueError(
                f"NarrowGemmLaunch: scales {scales.dtype}"
                + (f", expert_scale {expert_scale.dtype}" if humming else "")
                + "; expected "
                + ("1-byte s' and fp32 weight_scale_2" if humming else "int32 (narrow_weights)")
            )
        experts_match = scales.shape[0] == words.shape[0] and (
            not humming or expert_scale.shape[0] == words.shape[0]
        )
        if x_scales.shape[0] != x.shape[0] or not experts_match:
            extra = f", expert_scale {tuple(expert_scale.shape)}" if humming else ""
            raise ValueError(
                f"NarrowGemmLaunch: x {tuple(x.shape)} with x_scales {tuple(x_scales.shape)},"
                f" words {tuple(words.shape)} with scales {tuple(scales.shape)}{extra}: the rows"
                " and the experts must match"
            )
        if groups.expert_pairs.shape[0] > words.shape[0]:
            raise ValueError(
                f"NarrowGemmLaunch: the groups are of {groups.expert_pairs.shape[0]} local"
                f" experts, the weights hold {words.shape[0]}"
            )
        # Every tensor the kernel reads or writes, with the alignment it reads it at.
        accessed = {"words": words, "scales": scales, "x": x, "x_scales": x_scales, "out": out}
        accessed = {name: (t, VECTOR_BYTES) for name, t in accessed.items()}
        accessed |= {name: (t, 4) for name, t in routes.items()}
        if humming:
            accessed["expert_scale"] = (expert_scale, 4)
        for name, (tensor, align) in accessed.items():
            if tensor.data_ptr() % align:
                raise ValueError(
                    f"NarrowGemmLaunch: {name} at address {tensor.data_ptr():#x}; the kernel"
                    f" reads it {align}-byte aligned"
                )
        if groups.tile_capacity > MAX_TILE_SLOTS:
            raise ValueError(
                f"NarrowGemmLaunch: {groups.tile_capacity} tile slots; at most {MAX_TILE_SLOTS}"
                " (the grid's second axis): the narrow GEMM is for decode sizes"
            )
        if len({t.device for t, _ in accessed.values()}) != 1 or words.device.type != "cuda":
            raise ValueError("NarrowGemmLaunch: every tensor must be on one CUDA device")
        self.compiled(
            words.data_ptr(),
            scales.data_ptr(),
            expert_scale.data_ptr() if humming else words.data_ptr(),
            x.data_ptr(),
            x_scales.data_ptr(),
            pair_row.data_ptr(),
            groups.tile_expert.data_ptr(),
            groups.tile_start.data_ptr(),
            groups.tile_rows.data_ptr(),
            groups.num_tiles.data_ptr(),
            out.data_ptr(),
            words.shape[0],
            x.shape[0],
            out.shape[0],
            groups.tile_capacity,
            cuda.CUstream(stream),
        )
        return out
