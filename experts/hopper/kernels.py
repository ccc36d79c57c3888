"""Triton kernels of HopperExperts over the tiles of group_pairs: the triton engine's FC1 with
SiTU and FC2, the humming engine's SiTU -> MXFP8, and both engines' finalize.

Swap-AB: the expert's weight rows are the MMA's M side and the tile's pairs (receive rows) its N
side, so an expert with 1..16 pairs reads its weights once and no MMA rows go to padding tokens.
The GEMM kernels walk a work list (tile, M block) whose length `num_tiles * M blocks` they read
from device memory, so the launch shape never depends on the data (CUDA-graph capturable, one
compilation per block shape): PERSISTENT, a fixed grid of programs each takes items pid, pid +
programs, ...; else one program per item, the grid covering the list's capacity. Work item w
takes tile w % num_tiles and M block w // num_tiles: the tiles of one expert run side by side
and share its weight block through L2. On an H200 they reach 5-25% of the weight-read floor
(docs/results/bench_experts_engines.md); the decode is not the bound (a bf16x2 PTX decode
changed nothing).

Operands, per K block of BLOCK_K:
  weights  uint8 [BLOCK_M, BLOCK_K/2] MXFP4 codes (low nibble = even element), scales uint8
           [BLOCK_M, BLOCK_K/32] E8M0 (the checkpoint layout, read as it is);
  FC1 rhs  the pairs' MXFP8 rows: uint8 [BLOCK_K, BLOCK_N] e4m3 bytes (x transposed by the
           pointer layout), scales uint8 [BLOCK_N, BLOCK_K/32];
  FC2 rhs  the pairs' BF16 SiTU activations [BLOCK_K, BLOCK_N].
MATH selects how a block is multiplied, after MXFP4 and MXFP8 are decoded exactly to BF16 in
registers:
  "bf16"  tl.dot on BF16 operands (the MMA), fp32 accumulation;
  "fp32"  an fp32 (IEEE) tl.dot of the same values: for Triton's CPU interpreter, which multiplies
          BF16 operands wrongly.
Both are fp32-accumulated products of exact BF16 values: only the order of the fp32 sums differs
from ReferenceExperts.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dep_ep.comm.failure import FAILURE_PAIR_BUDGET
from dep_ep.comm.failure_kernel import store_failure
from dep_ep.constants import E4M3_MAX, KIND_EXPERTS, RCP_448, SCALE_BLOCK
from dep_ep.experts.hopper.pdl import wait_then_release
from dep_ep.experts.situ import SITU_BETA, SITU_LINEAR_BETA

SCALE_BLOCK_C = tl.constexpr(SCALE_BLOCK)
SITU_BETA_C = tl.constexpr(SITU_BETA)
SITU_LINEAR_BETA_C = tl.constexpr(SITU_LINEAR_BETA)
KIND_EXPERTS_C = tl.constexpr(KIND_EXPERTS)
FAILURE_PAIR_BUDGET_C = tl.constexpr(FAILURE_PAIR_BUDGET)
# E2M1 code bits placed in an fp32's top bits: sign (code bit 3) to bit 31, exponent and mantissa
# (code bits 2..0) to bits 24..22. That fp32 is the E2M1 value times 2^-126, subnormal codes 0.5
# and -0.5 included; the E8M0 factor and TWO_POW_126 restore it exactly.
E2M1_SIGN_SHIFT = tl.constexpr(28)
E2M1_BITS_SHIFT = tl.constexpr(22)
TWO_POW_126 = tl.constexpr(2.0**126)
E8M0_ZERO_BITS = tl.constexpr(0x00400000)  # scale byte 0: 2^-127, an fp32 subnormal
E8M0_NAN_BITS = tl.constexpr(0x7FC00000)  # scale byte 255: NaN
# comm/mxfp8.py's quantization recipe: rcp.approx.ftz(448.0) as an exact fp32, and e4m3's max.
RCP_448_C = tl.constexpr(RCP_448)
E4M3_MAX_C = tl.constexpr(E4M3_MAX)
BF16_HALF_ULP_BITS = tl.constexpr(0x7FFF)  # fp32 bits below BF16's last kept bit, less one
BF16_KEPT_BITS = tl.constexpr(0xFFFF0000)


@triton.jit
def _e8m0_to_fp32(scale):
    """uint8 E8M0 bytes -> fp32 2^(byte - 127) (byte 0: 2^-127, byte 255: NaN)."""
    bits = scale.to(tl.uint32) << 23
    bits = tl.where(scale == 0, E8M0_ZERO_BITS, bits)
    bits = tl.where(scale == 255, E8M0_NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scaled_bf16(values, scale, ROWS: tl.constexpr, COLS: tl.constexpr):
    """fp32 values [ROWS, COLS] times their block's E8M0 factor (scale uint8 [ROWS, COLS/32]),
    to BF16."""
    blocks = values.reshape(ROWS, COLS // SCALE_BLOCK_C, SCALE_BLOCK_C)
    scaled = blocks * _e8m0_to_fp32(scale)[:, :, None]
    return scaled.reshape(ROWS, COLS).to(tl.bfloat16)


@triton.jit
def _mxfp4_to_bf16(packed, scale, ROWS: tl.constexpr, COLS: tl.constexpr):
    """MXFP4 packed uint8 [ROWS, COLS/2] + scale uint8 [ROWS, COLS/32] -> exact BF16
    [ROWS, COLS]."""
    codes = tl.join(packed & 0xF, packed >> 4).reshape(ROWS, COLS).to(tl.uint32)
    bits = ((codes & 8) << E2M1_SIGN_SHIFT) | ((codes & 7) << E2M1_BITS_SHIFT)
    values = bits.to(tl.float32, bitcast=True) * TWO_POW_126
    return _scaled_bf16(values, scale, ROWS, COLS)


@triton.jit
def _mxfp8_cols_to_bf16(q_cols, scale, COLS: tl.constexpr, ROWS: tl.constexpr):
    """MXFP8 rows given transposed, e4m3 bytes [COLS (K), ROWS (N)] + scale uint8 [ROWS, COLS/32]
    -> exact BF16 [COLS, ROWS]."""
    values = tl.trans(q_cols.to(tl.float8e4nv, bitcast=True).to(tl.float32))  # [ROWS, COLS]
    return tl.trans(_scaled_bf16(values, scale, ROWS, COLS))


@triton.jit
def _round_bf16(values):
    """fp32 -> BF16, round to nearest even (NaN and Inf kept), done on the bits: Triton's CPU
    interpreter truncates in .to(tl.bfloat16); the rounded fp32 converts exactly everywhere."""
    bits = values.to(tl.uint32, bitcast=True)
    bits = (bits + (BF16_HALF_ULP_BITS + ((bits >> 16) & 1))) & BF16_KEPT_BITS
    # A NaN's mantissa may carry into the sign (the GPU's NaN is 0x7FFFFFFF): keep NaNs as they are.
    rounded = tl.where(values != values, values, bits.to(tl.float32, bitcast=True))
    return rounded.to(tl.bfloat16)


@triton.jit
def _tanh(z):
    """fp32 tanh(z) = sign(z) (1 - e) / (1 + e), e = exp(-2|z|) in (0, 1]: no overflow; absolute
    error a few fp32 ulps of 1 (relative below 1e-4 for |z| > 1e-3, where SiTU's BF16 rounding,
    2^-9 relative, dominates). Written out: Triton's interpreter has no libdevice.tanh."""
    e = tl.exp(-2.0 * tl.abs(z))
    magnitude = (1.0 - e) / (1.0 + e)
    return tl.where(z < 0, -magnitude, magnitude)


@triton.jit
def _situ(gate, up):
    """SiTU in fp32 (experts/situ.py): [b tanh(g/b) sigmoid(g)] * [lb tanh(u/lb)]."""
    gated = SITU_BETA_C * _tanh(gate / SITU_BETA_C) * tl.sigmoid(gate)
    return gated * (SITU_LINEAR_BETA_C * _tanh(up / SITU_LINEAR_BETA_C))


@triton.jit
def _weight_block_dot(
    acc,
    w_rows,
    s_rows,
    k0,
    rhs,
    rhs_scale,
    RHS_FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MATH: tl.constexpr,
):
    """acc fp32 [BLOCK_M, BLOCK_N] += weights [BLOCK_M, BLOCK_K] @ rhs [BLOCK_K, BLOCK_N].
    w_rows / s_rows: pointers [BLOCK_M, 1] to the weight rows' packed codes and scale bytes;
    k0: first K element of the block; rhs: e4m3 bytes with rhs_scale [BLOCK_N, BLOCK_K/32]
    (RHS_FORMAT "e4m3") or BF16 with rhs_scale None (RHS_FORMAT "bf16")."""
    # arange first: in Triton's interpreter a Python int + a tensor stays a constexpr.
    packed = tl.load(w_rows + (tl.arange(0, BLOCK_K // 2) + k0 // 2)[None, :])
    scale = tl.load(
        s_rows + (tl.arange(0, BLOCK_K // SCALE_BLOCK_C) + k0 // SCALE_BLOCK_C)[None, :]
    )
    weights = _mxfp4_to_bf16(packed, scale, BLOCK_M, BLOCK_K)
    if RHS_FORMAT == "e4m3":
        rhs = _mxfp8_cols_to_bf16(rhs, rhs_scale, BLOCK_K, BLOCK_N)
    if MATH == "fp32":
        acc = tl.dot(weights.to(tl.float32), rhs.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(weights, rhs, acc)
    return acc


@triton.jit
def _tile(w, tile_expert_ptr, tile_start_ptr, tile_rows_ptr, num_tiles, BLOCK_N: tl.constexpr):
    """Work item w -> (local expert int64, first pair, mask [BLOCK_N] of the tile's pairs,
    M block)."""
    tile = w % num_tiles
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    in_tile = tl.arange(0, BLOCK_N) < tl.load(tile_rows_ptr + tile)
    return expert, start, in_tile, w // num_tiles


@triton.jit
def _fc1_item(
    w,
    num_tiles,
    x_ptr,
    sf_ptr,
    w13_ptr,
    s13_ptr,
    act_ptr,
    pair_row_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_rows_ptr,
    LATENT: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MATH: tl.constexpr,
):
    """One FC1 work item (fc1_situ_kernel)."""
    expert, start, in_tile, m_block = _tile(
        w, tile_expert_ptr, tile_start_ptr, tile_rows_ptr, num_tiles, BLOCK_N
    )
    n = tl.arange(0, BLOCK_N)
    rows = tl.load(pair_row_ptr + start + n, mask=in_tile, other=0).to(tl.int64)
    cols = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    gate_row = expert * (2 * INTER) + cols[:, None]  # [BLOCK_M, 1] rows of w13
    up_row = gate_row + INTER
    gate_w, up_w = w13_ptr + gate_row * (LATENT // 2), w13_ptr + up_row * (LATENT // 2)
    gate_s = s13_ptr + gate_row * (LATENT // SCALE_BLOCK_C)
    up_s = s13_ptr + up_row * (LATENT // SCALE_BLOCK_C)
    x_cols = x_ptr + rows[None, :] * LATENT  # [1, BLOCK_N]: each pair's row
    sf_rows = sf_ptr + rows[:, None] * (LATENT // SCALE_BLOCK_C)  # [BLOCK_N, 1]
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, LATENT, BLOCK_K):
        k = tl.arange(0, BLOCK_K) + k0
        # Pairs past the tile's end read zeros (scale byte 127: factor 1); their columns are not
        # stored.
        x = tl.load(x_cols + k[:, None], mask=in_tile[None, :], other=0)
        kb = tl.arange(0, BLOCK_K // SCALE_BLOCK_C) + k0 // SCALE_BLOCK_C
        x_scale = tl.load(sf_rows + kb[None, :], mask=in_tile[:, None], other=127)
        gate = _weight_block_dot(
            gate, gate_w, gate_s, k0, x, x_scale, "e4m3", BLOCK_M, BLOCK_N, BLOCK_K, MATH
        )
        up = _weight_block_dot(
            up, up_w, up_s, k0, x, x_scale, "e4m3", BLOCK_M, BLOCK_N, BLOCK_K, MATH
        )
    act = _round_bf16(_situ(gate, up))  # [BLOCK_M (columns of act), BLOCK_N (pairs)]
    pairs = (start + n).to(tl.int64)
    tl.store(act_ptr + pairs[None, :] * INTER + cols[:, None], act, mask=in_tile[None, :])


# finalize_kernel's pointers it accesses one element at a time (see its decorator).
FINALIZE_SCALAR_POINTERS = (
    "pair_slot_ptr",
    "weights_ptr",
    "num_pairs_ptr",
    "over_ptr",
    "status_ptr",
    "record_ptr",
    "calls_done_ptr",
)


# pair_cap follows T: specialising on it (its value 1, or divisible by 16) would compile
# again for a new T, mid-serving or inside a capture.
@triton.jit(do_not_specialize=["pair_cap"])
def fc1_situ_kernel(
    x_ptr,
    sf_ptr,
    w13_ptr,
    s13_ptr,
    act_ptr,
    pair_row_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_rows_ptr,
    num_tiles_ptr,
    num_pairs_ptr,
    pair_cap,
    LATENT: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MATH: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """act bf16 [pair_cap, I] = SiTU(x @ w1^T, x @ w3^T) of each pair's row and expert.

    x uint8 [R, L] e4m3, sf uint8 [R, L/32]; w13 uint8 [E, 2I, L/2] rows [w1; w3], s13 uint8
    [E, 2I, L/32]. A work item is (tile, BLOCK_M intermediate columns): it reads the gate rows
    [m0, m0 + BLOCK_M) and the up rows I + [m0, m0 + BLOCK_M), so SiTU runs in the epilogue on two
    fp32 accumulators and only the BF16 activation is written. PERSISTENT: each program walks work
    items w = pid, pid + programs, ...; else one item per program (the grid covers the capacity).
    More pairs than pair_cap (the rows of act; num_pairs int32 [1] on the device): no work item
    runs (the finalize writes NaN rows), so no pair past act's rows is written. PDL: launched
    with programmatic dependent launch (experts/hopper/pdl.py).
    """
    wait_then_release(PDL)
    num_tiles = tl.load(num_tiles_ptr)
    work = tl.where(tl.load(num_pairs_ptr) > pair_cap, 0, num_tiles * (INTER // BLOCK_M))
    w = tl.program_id(0)
    # Persistent: items pid, pid + programs, ...; one-shot: item pid alone (a step past the end).
    step = tl.num_programs(0) if PERSISTENT else work
    while w < work:
        _fc1_item(
            w,
            num_tiles,
            x_ptr,
            sf_ptr,
            w13_ptr,
            s13_ptr,
            act_ptr,
            pair_row_ptr,
            tile_expert_ptr,
            tile_start_ptr,
            tile_rows_ptr,
            LATENT,
            INTER,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            MATH,
        )
        w += step


@triton.jit
def _fc2_item(
    w,
    num_tiles,
    act_ptr,
    w2_ptr,
    s2_ptr,
    y_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_rows_ptr,
    LATENT: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MATH: tl.constexpr,
):
    """One FC2 work item (fc2_kernel)."""
    expert, start, in_tile, m_block = _tile(
        w, tile_expert_ptr, tile_start_ptr, tile_rows_ptr, num_tiles, BLOCK_N
    )
    pairs = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    w_row = expert * LATENT + cols[:, None]
    w_rows = w2_ptr + w_row * (INTER // 2)
    s_rows = s2_ptr + w_row * (INTER // SCALE_BLOCK_C)
    act_cols = act_ptr + pairs[None, :] * INTER
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k = tl.arange(0, BLOCK_K) + k0
        act = tl.load(act_cols + k[:, None], mask=in_tile[None, :], other=0.0)
        acc = _weight_block_dot(
            acc, w_rows, s_rows, k0, act, None, "bf16", BLOCK_M, BLOCK_N, BLOCK_K, MATH
        )
    tl.store(
        y_ptr + pairs[None, :] * LATENT + cols[:, None], _round_bf16(acc), mask=in_tile[None, :]
    )


# pair_cap follows T: specialising on it (its value 1, or divisible by 16) would compile
# again for a new T, mid-serving or inside a capture.
@triton.jit(do_not_specialize=["pair_cap"])
def fc2_kernel(
    act_ptr,
    w2_ptr,
    s2_ptr,
    y_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_rows_ptr,
    num_tiles_ptr,
    num_pairs_ptr,
    pair_cap,
    LATENT: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MATH: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """y bf16 [pair_cap, L] = act [pair_cap, I] @ w2^T of each pair's expert (fp32 sums, one
    rounding).

    w2 uint8 [E, L, I/2], s2 uint8 [E, L, I/32]. A work item is (tile, BLOCK_M output columns);
    PERSISTENT, pair_cap and PDL as in fc1_situ_kernel."""
    wait_then_release(PDL)
    num_tiles = tl.load(num_tiles_ptr)
    work = tl.where(tl.load(num_pairs_ptr) > pair_cap, 0, num_tiles * (LATENT // BLOCK_M))
    w = tl.program_id(0)
    step = tl.num_programs(0) if PERSISTENT else work  # as in fc1_situ_kernel
    while w < work:
        _fc2_item(
            w,
            num_tiles,
            act_ptr,
            w2_ptr,
            s2_ptr,
            y_ptr,
            tile_expert_ptr,
            tile_start_ptr,
            tile_rows_ptr,
            LATENT,
            INTER,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            MATH,
        )
        w += step


@triton.jit
def _mxfp8_blocks(values, ROWS: tl.constexpr, COLS: tl.constexpr):
    """fp32 [ROWS, COLS] -> (e4m3 [ROWS, COLS], fp32 factors 2^(scale - 127) [ROWS, COLS/32]) by
    comm/mxfp8.py's recipe (scale byte from amax * rcp(448) rounded up; 255 for a non-finite
    amax, whose block then decodes to NaN)."""
    blocks = values.reshape(ROWS, COLS // SCALE_BLOCK_C, SCALE_BLOCK_C)
    amax = tl.max(tl.abs(blocks), axis=2)
    # tl.max skips NaNs; the recipe needs a NaN amax (scale byte 255) for a block holding one.
    has_nan = tl.max((blocks != blocks).to(tl.int32), axis=2) > 0
    amax = tl.where(has_nan, float("nan"), amax)
    v_bits = (amax * RCP_448_C).to(tl.uint32, bitcast=True)
    exponent = (v_bits >> 23) & 0xFF
    mantissa = v_bits & 0x7FFFFF
    round_up = (mantissa != 0) & (exponent != 254) & ~((exponent == 0) & (mantissa <= 0x400000))
    scale = tl.minimum(exponent + round_up.to(tl.uint32), 255)
    usable = (scale > 0) & (scale < 254)
    inv = tl.where(usable, ((254 - scale) << 23).to(tl.float32, bitcast=True), 0.0)
    scaled = blocks * inv[:, :, None]
    scaled = tl.clamp(scaled, -E4M3_MAX_C, E4M3_MAX_C, propagate_nan=tl.PropagateNan.ALL)
    return scaled.reshape(ROWS, COLS).to(tl.float8e4nv), _e8m0_to_fp32(scale)


@triton.jit
def widen_scales_kernel(sf_ptr, out_ptr, count, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out fp32 [count] = 2^(byte - 127) of the E8M0 bytes sf uint8 [count] (byte 0: 2^-127,
    255: NaN; comm/mxfp8.e8m0_to_fp32 bit for bit): the per-32 factors humming reads, in one
    launch where torch's table lookup took two (7.5 us at T=64 on a DEP16 shard). PDL as in
    fc1_situ_kernel."""
    wait_then_release(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < count
    scale = tl.load(sf_ptr + offs, mask=inside, other=0)
    tl.store(out_ptr + offs, _e8m0_to_fp32(scale), mask=inside)


# num_pairs_ptr of a chunk points at element c of ChunkRoutes.pairs (4-byte aligned): not
# specialised on alignment, so every chunk runs one compilation.
@triton.jit(do_not_specialize_on_alignment=["num_pairs_ptr"])
def situ_mxfp8_kernel(
    gate_up_ptr,
    pair_flat_ptr,
    num_pairs_ptr,
    act_ptr,
    act_scale_ptr,
    INTER: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_I: tl.constexpr,
    INDEXED: tl.constexpr = True,
    PDL: tl.constexpr = False,
):
    """For pairs j < num_pairs: act[j] = MXFP8 of SiTU(gate, up) in fp32, where gate_up bf16
    [R * K, 2I] row pair_flat[j] holds [gate | up] (humming's FC1 output on the receive slots);
    INDEXED False: row j of gate_up [pairs, 2I] (a chunk's FC1 output, experts/hopper/chunks.py;
    pair_flat is not read). act e4m3 [pairs, I], act_scale fp32 [pairs, I/32] (2^(scale - 127),
    the per-32 factors humming's FC2 reads). Grid (programs, I / BLOCK_I); program p takes rows
    p * ROWS, (p + programs) * ROWS, ... PDL as in fc1_situ_kernel."""
    wait_then_release(PDL)
    num_pairs = tl.load(num_pairs_ptr)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    scale_cols = tl.program_id(1) * (BLOCK_I // SCALE_BLOCK_C) + tl.arange(
        0, BLOCK_I // SCALE_BLOCK_C
    )
    first = tl.program_id(0) * ROWS
    while first < num_pairs:
        pairs = first + tl.arange(0, ROWS)
        ok = pairs < num_pairs
        if INDEXED:
            src = tl.load(pair_flat_ptr + pairs, mask=ok, other=0).to(tl.int64)
        else:
            src = pairs.to(tl.int64)
        row = gate_up_ptr + src[:, None] * (2 * INTER) + cols[None, :]
        gate = tl.load(row, mask=ok[:, None], other=0.0).to(tl.float32)
        up = tl.load(row + INTER, mask=ok[:, None], other=0.0).to(tl.float32)
        q, factor = _mxfp8_blocks(_situ(gate, up), ROWS, BLOCK_I)
        dst = pairs.to(tl.int64)[:, None]
        tl.store(act_ptr + dst * INTER + cols[None, :], q, mask=ok[:, None])
        tl.store(
            act_scale_ptr + dst * (INTER // SCALE_BLOCK_C) + scale_cols[None, :],
            factor,
            mask=ok[:, None],
        )
        first += tl.num_programs(0) * ROWS


# pair_cap follows T: specialising on it (its value 1, or divisible by 16) would compile
# again for a new T, mid-serving or inside a capture.
# The tag's halves vary per step (comm/failure.py, StepFailure.tag_halves): not specialised either.
# The pointers read or written one element at a time are not specialised on 16-byte alignment:
# the step status word is the device transport's state word 1 (8 bytes in), where a warm-up's
# scratch word is a fresh allocation, so a capture after warmup compiled this kernel again (one
# H200, triton engine, T = 1); the alignment buys no vector access there.
@triton.jit(
    do_not_specialize=["pair_cap", "tag_high", "tag_low"],
    do_not_specialize_on_alignment=FINALIZE_SCALAR_POINTERS,
)
def finalize_kernel(
    y_ptr,
    pair_slot_ptr,
    weights_ptr,
    out_ptr,
    num_pairs_ptr,
    pair_cap,
    over_ptr,
    LATENT: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    FAIL_STEP: tl.constexpr = False,
    status_ptr=None,
    record_ptr=None,
    tag_high=0,
    tag_low=0,
    calls_done_ptr=None,
    HAS_CALL: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """out[row] = BF16(sum over k in order of weights[row, k] * y[pair of (row, k)]) in fp32, for
    rows with a local id; rows without one are left as they are. Grid (R, L / BLOCK_L).

    pair_slot int32 [R, K] (-1: not local), weights fp32 [R, K], y bf16 [pair_cap, L], out bf16
    [R, L]. The pair budget: when the call holds more pairs than y's pair_cap rows (num_pairs
    int32 [1] on the device), the GEMMs computed nothing and every row with a local id gets NaN
    instead (no y row is read), and program (0, 0) raises over_ptr int32 [1] to num_pairs when
    that is larger (a sticky record of the overflow for the host to read later; one program
    writes it, so no atomics). With FAIL_STEP (a StepFailure given, comm/failure.py), program
    (0, 0) of an overflowing call also fails the step: KIND_EXPERTS into status int64 [1] (the
    transport's step status word, which the step's combine reads) and, when record int64
    [FAILURE_WORDS]'s code word is 0, [FAILURE_PAIR_BUDGET, num_pairs, pair_cap, tag, call] into
    it, the code last (comm/failure_kernel.py's store_failure: the tag from its int32 halves, the
    call from calls_done int64 [1] with HAS_CALL).
    The branch per k skips the loads of non-local slots (15 of 16 on a DEP16 shard): a branch-free
    variant with masked loads took 1.9x as long at T=64 there (9.2 against 4.8 us, BLOCK_L 512 over
    2 warps, H200). PDL as in fc1_situ_kernel.
    """
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    num_pairs = tl.load(num_pairs_ptr)
    fits = num_pairs <= pair_cap
    total = tl.zeros([BLOCK_L], dtype=tl.float32)
    found = 0
    for k in tl.static_range(TOPK):
        pair = tl.load(pair_slot_ptr + row * TOPK + k)
        if pair >= 0:
            if fits:
                weight = tl.load(weights_ptr + row * TOPK + k)
                y = tl.load(y_ptr + pair.to(tl.int64) * LATENT + cols).to(tl.float32)
                total += weight * y
            found += 1
    if found > 0:
        tl.store(out_ptr + row * LATENT + cols, _round_bf16(tl.where(fits, total, float("nan"))))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(over_ptr, tl.maximum(tl.where(fits, 0, num_pairs), tl.load(over_ptr)))
        if FAIL_STEP:
            if num_pairs > pair_cap:
                tl.store(status_ptr, KIND_EXPERTS_C)
                store_failure(
                    record_ptr,
                    FAILURE_PAIR_BUDGET_C,
                    num_pairs,
                    pair_cap,
                    tag_high,
                    tag_low,
                    calls_done_ptr,
                    HAS_CALL,
                )
