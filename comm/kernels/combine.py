"""CombineKernel: return expert output rows to their sources, wait, sum over ranks, RMSNorm.

Two phases, compiled as one launch (mode "fused") or two (modes "send" then "reduce"):
1. send: CTAs take contiguous chunks of the rows r = s*T + t of this rank's expert output (bf16
   [N*T, L]), PASS_ROWS at a time: warp 0 finds the rows whose received ids hold a local expert
   (one id load per lane and row, a ballot) and lists them in shared memory; then every thread
   copies 16-byte vectors of the listed rows, `vectors_in_flight` loads before their stores, row
   s*T + t going to rank s's partials row rank*T + t. The CTA then signals (`signal_after_cta`:
   one fence; the last CTA stores this rank's combine flag (call, T, tag) into every source and
   marks the call done in the device state).
2. reduce: every CTA waits (acquire) for every rank's combine flag of this call; warp w of CTA b
   then takes tokens t = 8b + w, 8b + w + 8G, ...: the partials of the ranks owning one of the
   token's experts are summed in fp32 in rank order, and, when `normalize` is set, RMSNorm is
   applied in the exact order of comm/reference.py `rms_norm` (lane l owns the 8-element chunks
   l, l+32, ...; per-lane sums in chunk and element order; tree 16, 8, 4, 2, 1; a row whose
   squares overflow is summed again scaled by a power of two from its largest magnitude). When
   the call failed on any rank (a rank rejected its input, or the ranks disagree on T or the
   tag: the dispatch or a combine flag says so) every output row is NaN instead.
Fused, the grid must be co-resident (waiting CTAs would otherwise hold the SMs the senders need):
the host launches at most one CTA per SM. That saves a launch and a flag hop at small T (8.7 us
against 12.5 us at T = 1, EP = 1) but caps the reduce phase at 8 warps per SM, which costs at
large T; there the host launches "send" (any grid: it never waits) and then "reduce" (one CTA of
8 warps per 8 tokens: its waits only depend on the peers' send launches, never on a CTA of its
own that is not yet resident). comm/device_transport.py picks by T. With `tuning.pdl` every
launch waits for the kernels before it (griddepcontrol.wait) before it reads, and lets the next
one launch early.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.memory import SmemAllocator

from dep_ep.comm.kernels.launch_args import KernelTuning, RankControl, Step, SymmetricRegions
from dep_ep.comm.kernels.ptx import (
    add_rn,
    barrier_or,
    bf16_round,
    bits_f32,
    div_rn,
    f32_bits,
    mul_rn,
    sqrt_rn,
)
from dep_ep.comm.kernels.signals import (
    check_step,
    chunk_begin,
    chunk_end,
    flag_slot,
    id_vector,
    signal_after_cta,
    token_destinations,
)
from dep_ep.comm.kernels.tensors import (
    BF16_PER_WORD,
    MAX_L1_CARVEOUT,
    VECTOR_WORDS,
    ReceiveRegions,
    gmem_tensor,
    peer_base,
    receive_regions,
    row_major,
    state_words,
    vectors,
)
from dep_ep.constants import (
    COMBINE_WARPS,
    CTAS_PER_SM,
    MAX_RANKS,
    NORM_CHUNK,
    NORM_LANES,
    NORM_SCALE_MAX_EXP,
    NORM_SCALE_MIN_EXP,
    PHASE_COMBINE,
    STATE_CALL,
    STATE_DONE_COMBINE,
    STATE_STEP_STATUS,
    WARP_LANES,
)

LANES = NORM_LANES  # one warp per token in the reduce phase
THREADS = COMBINE_WARPS * WARP_LANES
CHUNK = NORM_CHUNK  # bf16 elements per 16-byte vector
assert CHUNK == VECTOR_WORDS * BF16_PER_WORD
PASS_ROWS = WARP_LANES  # rows the send phase lists at a time: one per lane of warp 0
BF16_NAN_PAIR = 0x7FC07FC0  # two bf16 quiet NaNs: the mark of an output row of a failed call


def _lo(word):
    return bits_f32(word << 16)


def _hi(word):
    return bits_f32(word & Uint32(0xFFFF0000))


MODES = ("fused", "send", "reduce")


class CombineKernel:
    """Static geometry: num_ranks N (<= 32), latent L, topk K, experts_per_rank; `mode` one of
    MODES (which phases the launch runs; same arguments in every mode). T is runtime."""

    def __init__(
        self,
        num_ranks: int,
        latent: int,
        topk: int,
        experts_per_rank: int,
        mode: str,
        tuning: KernelTuning,
    ):
        assert 1 <= num_ranks <= MAX_RANKS and latent % CHUNK == 0 and mode in MODES
        self.mode = mode
        self.pdl, self.vectors_in_flight = tuning.pdl, tuning.combine_vectors_in_flight
        self.num_ranks, self.latent, self.topk = num_ranks, latent, topk
        self.experts_per_rank = experts_per_rank
        self.chunks = latent // CHUNK  # 16-byte vectors per row
        self.chunks_per_lane = (self.chunks + LANES - 1) // LANES
        self.id_vector = id_vector(topk)

    @cute.jit
    def __call__(
        self,
        expert_out: Int64,
        ids: Int64,
        norm_weight: Int64,
        normed: Int64,
        regions: SymmetricRegions,
        control: RankControl,
        step: Step,
        eps: Float32,
        normalize: Int32,
        grid: Int32,
        stream: cuda.CUstream,
    ):
        """expert_out: bf16 [N*T, L] (rows with a local id); ids: int32 [T, K] as dispatched;
        norm_weight: bf16 [L] (read when `normalize`); normed: bf16 [T, L], the output. All
        16-byte aligned."""
        T, W = step.tokens, self.latent // BF16_PER_WORD
        mOut = gmem_tensor(Uint32, expert_out, row_major(T * self.num_ranks, W))
        mIds = gmem_tensor(Int32, ids, row_major(T, self.topk))
        mNormWeight = gmem_tensor(Uint32, norm_weight, row_major(1, W))
        mNormed = gmem_tensor(Uint32, normed, row_major(T, W))
        # The send launch may fill every SM with CTAS_PER_SM CTAs (launch bounds); the others
        # run one CTA an SM and keep a token's row in registers.
        bounds = {}
        if cutlass.const_expr(self.mode == "send"):
            bounds = {
                "max_number_threads": [THREADS, 1, 1],
                "min_blocks_per_mp": CTAS_PER_SM,
                "preferred_smem_carveout": MAX_L1_CARVEOUT,
            }
        self.kernel(
            mOut, mIds, mNormWeight, mNormed, regions, control, step, eps, normalize
        ).launch(
            grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl, **bounds
        )

    @cute.kernel
    def kernel(
        self,
        mOut: cute.Tensor,
        mIds: cute.Tensor,
        mNormWeight: cute.Tensor,
        mNormed: cute.Tensor,
        regions: SymmetricRegions,
        control: RankControl,
        step: Step,
        eps: Float32,
        normalize: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        N, L, K = self.num_ranks, self.latent, self.topk
        T = step.tokens
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        own = receive_regions(regions.own, regions, T * N, L, K, N)
        mState = state_words(control)
        # The dispatch of this call read STATE_CALL = call - 1; the send phase stores `call`.
        call = mState[STATE_CALL]
        # What the dispatch of this call found (stream-ordered before this launch).
        dispatch_failed = mState[STATE_STEP_STATUS]
        if cutlass.const_expr(self.mode != "reduce"):
            call = call + 1
            self.send(mOut, own, regions, control.rank, T, tidx, bidx, grid)
            if (
                signal_after_cta(
                    regions, control, step, call, PHASE_COMBINE, STATE_DONE_COMBINE, N, tidx, grid
                )
                != 0
            ):
                # Every CTA of this launch read STATE_CALL before it counted itself done.
                mState[STATE_CALL] = call
        if cutlass.const_expr(self.mode != "send"):
            # Wait for every rank's flag of this call, then reduce (or mark a failed call).
            kind = Int32(0)
            if tidx < N:
                kind = check_step(
                    flag_slot(own.flags, PHASE_COMBINE, tidx),
                    call,
                    step,
                    control,
                    PHASE_COMBINE,
                    tidx,
                    False,
                )
            failed = barrier_or(kind | Int32(dispatch_failed != 0))
            lane, warp = tidx % LANES, tidx // LANES
            for t in cutlass.range(bidx * COMBINE_WARPS + warp, T, grid * COMBINE_WARPS):
                if failed != 0:
                    self.mark_token(mNormed, t, lane)
                else:
                    self.reduce_token(
                        mIds, mNormWeight, mNormed, own.partials, eps, normalize, T, t, lane
                    )

    @cute.jit
    def send(
        self,
        mOut: cute.Tensor,
        own: ReceiveRegions,
        regions: SymmetricRegions,
        rank: Int32,
        tokens: Int32,
        tidx: Int32,
        bidx: Int32,
        grid: Int32,
    ):
        """Phase 1: this CTA's contiguous share of the rows r = s*T + t goes to the sources'
        partials (the rows whose received ids hold a local expert)."""
        N, L, K, C = self.num_ranks, self.latent, self.topk, self.chunks
        V = self.id_vector
        smem = SmemAllocator()
        # The pass's rows that hold a local id, their source rank and their partials row there.
        sRow = smem.allocate_tensor(Int32, cute.make_layout(PASS_ROWS), byte_alignment=16)
        sSource = smem.allocate_tensor(Int32, cute.make_layout(PASS_ROWS), byte_alignment=16)
        sDestRow = smem.allocate_tensor(Int32, cute.make_layout(PASS_ROWS), byte_alignment=16)
        sCount = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        gOut = vectors(mOut)  # ((1, 4), (N*T, C)): 16-byte vectors
        gRecvIds = vectors(own.ids, V)  # ((1, V), (N*T, K / V))
        rIds = cute.make_rmem_tensor(cute.make_layout(V), Int32)
        rBuf = cute.make_rmem_tensor(
            cute.make_layout((self.vectors_in_flight, VECTOR_WORDS), stride=(VECTOR_WORDS, 1)),
            Uint32,
        )
        rows = tokens * N
        r_begin, r_end = chunk_begin(rows, bidx, grid), chunk_end(rows, bidx, grid)
        for r0 in cutlass.range(r_begin, r_end, PASS_ROWS):
            if tidx < WARP_LANES:  # warp 0 lists the pass's rows that hold a local id
                r = r0 + tidx
                hit = Int32(0)
                if r < r_end:
                    for g in cutlass.range_constexpr(K // V):
                        cute.autovec_copy(gRecvIds[(0, None), (r, g)], rIds)
                        for i in cutlass.range_constexpr(V):
                            if rIds[i] >= 0:
                                hit = Int32(1)
                listed = cute.arch.vote_ballot_sync(hit != 0)
                if hit != 0:
                    at = cute.arch.popc(listed & ((Int32(1) << tidx) - 1))
                    source = r // tokens
                    sRow[at] = r
                    sSource[at] = source
                    sDestRow[at] = rank * tokens + r - source * tokens
                if tidx == 0:
                    sCount[0] = cute.arch.popc(listed)
            cute.arch.barrier()
            items = sCount[0] * C
            for first in cutlass.range(tidx, items, THREADS * self.vectors_in_flight):
                for u in cutlass.range_constexpr(self.vectors_in_flight):
                    item = first + u * THREADS
                    if item < items:
                        cute.autovec_copy(
                            gOut[(0, None), (sRow[item // C], item % C)], rBuf[u, None]
                        )
                for u in cutlass.range_constexpr(self.vectors_in_flight):
                    item = first + u * THREADS
                    if item < items:
                        dst = receive_regions(
                            peer_base(regions, sSource[item // C], N), regions, rows, L, K, N
                        )
                        cute.autovec_copy(
                            rBuf[u, None],
                            vectors(dst.partials)[(0, None), (sDestRow[item // C], item % C)],
                        )
            cute.arch.barrier()  # the lists are rewritten by the next pass

    @cute.jit
    def mark_token(self, mNormed: cute.Tensor, t: Int32, lane: Int32):
        """One warp: token t's output row all NaN (the call failed on some rank)."""
        rWords = cute.make_rmem_tensor(cute.make_layout(VECTOR_WORDS), Uint32)
        for j in cutlass.range_constexpr(VECTOR_WORDS):
            rWords[j] = Uint32(BF16_NAN_PAIR)
        gNormed = vectors(mNormed)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            c = lane + LANES * i
            if c < self.chunks:
                cute.autovec_copy(rWords, gNormed[(0, None), (t, c)])

    @cute.jit
    def sum_chunk(
        self,
        mPartials: cute.Tensor,
        tokens: Int32,
        t: Int32,
        c: Int32,
        hits: Uint32,
        i: int,
        rH: cute.Tensor,
        rWords: cute.Tensor,
        acc: cute.Tensor,
        sumsq: Float32,
    ) -> Float32:
        """Chunk c (8 elements) of token t: rank-ordered fp32 sum of the hit ranks' partials, BF16
        rounded into rH[8i:8i+8]; returns sumsq plus their squares, in element order."""
        gPartials = vectors(mPartials)  # ((1, 4), (N*T, L/8))
        for j in cutlass.range_constexpr(CHUNK):
            acc[j] = Float32(0.0)
        for d in cutlass.range_constexpr(self.num_ranks):
            if (hits >> d) & 1:
                cute.autovec_copy(gPartials[(0, None), (d * tokens + t, c)], rWords)
                for j in cutlass.range_constexpr(VECTOR_WORDS):
                    acc[2 * j] = add_rn(acc[2 * j], _lo(rWords[j]))
                    acc[2 * j + 1] = add_rn(acc[2 * j + 1], _hi(rWords[j]))
        for j in cutlass.range_constexpr(CHUNK):
            h = bits_f32(bf16_round(acc[j]) << 16)
            rH[i * CHUNK + j] = h
            sumsq = add_rn(sumsq, mul_rn(h, h))
        return sumsq

    @cute.jit
    def lane_sumsq(self, rH: cute.Tensor, lane: Int32) -> Float32:
        """This lane's sum of squares of rH, in chunk and element order (as sum_chunk)."""
        sumsq = Float32(0.0)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            if lane + LANES * i < self.chunks:
                for j in cutlass.range_constexpr(CHUNK):
                    h = rH[i * CHUNK + j]
                    sumsq = add_rn(sumsq, mul_rn(h, h))
        return sumsq

    @cute.jit
    def warp_total(self, sumsq: Float32) -> Float32:
        """The tree x[i] += x[i + o], o = 16, 8, 4, 2, 1 over the lanes, on every lane."""
        for step in cutlass.range_constexpr(5):
            sumsq = add_rn(sumsq, cute.arch.shuffle_sync_down(sumsq, 16 >> step))
        return cute.arch.shuffle_sync(sumsq, 0)

    @cute.jit
    def rescale(self, rH: cute.Tensor, eps: Float32, lane: Int32) -> Float32:
        """The rare path of a row whose squares overflow: multiply rH by the power of two
        2^(127 - clamp(E, 127, 253)), E the biased exponent of the row's largest magnitude (the
        max is exact in any order); returns eps times the square of that scale."""
        amax = Uint32(0)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            # A lane's last chunk may not exist (L not a multiple of 256): its registers were
            # never written and must not reach the max.
            if lane + LANES * i < self.chunks:
                for j in cutlass.range_constexpr(CHUNK):
                    amax = cutlass.max(amax, f32_bits(rH[i * CHUNK + j]) & Uint32(0x7FFFFFFF))
        for step in cutlass.range_constexpr(5):
            amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, 16 >> step))
        exponent = cutlass.min(
            cutlass.max((amax >> 23) & Uint32(0xFF), Uint32(NORM_SCALE_MIN_EXP)),
            Uint32(NORM_SCALE_MAX_EXP),
        )
        scale = bits_f32((Uint32(254) - exponent) << 23)
        for k in cutlass.range_constexpr(self.chunks_per_lane * CHUNK):
            rH[k] = mul_rn(rH[k], scale)
        return mul_rn(mul_rn(eps, scale), scale)

    @cute.jit
    def reduce_token(
        self,
        mIds: cute.Tensor,
        mNormWeight: cute.Tensor,
        mNormed: cute.Tensor,
        mPartials: cute.Tensor,
        eps: Float32,
        normalize: Int32,
        tokens: Int32,
        t: Int32,
        lane: Int32,
    ):
        """One warp: token t's rank-ordered fp32 sum of partials, rounded to BF16, then (when
        `normalize`) RMSNorm with norm_weight, to `normed`."""
        L = self.latent
        hits = token_destinations(mIds, t, lane, self.topk, self.experts_per_rank, self.num_ranks)
        rH = cute.make_rmem_tensor(cute.make_layout(self.chunks_per_lane * CHUNK), Float32)
        rWords = cute.make_rmem_tensor(cute.make_layout(VECTOR_WORDS), Uint32)
        acc = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
        sumsq = Float32(0.0)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            c = lane + LANES * i
            if cutlass.const_expr(self.chunks % LANES == 0):  # every lane has chunk i: no guard
                sumsq = self.sum_chunk(mPartials, tokens, t, c, hits, i, rH, rWords, acc, sumsq)
            else:
                if c < self.chunks:
                    sumsq = self.sum_chunk(mPartials, tokens, t, c, hits, i, rH, rWords, acc, sumsq)
        inv = Float32(1.0)
        if normalize != 0:
            total = self.warp_total(sumsq)
            eps_row = eps
            # Squares that overflow (the total is Inf or NaN; the same on every lane): scale the
            # row by a power of two and sum again (docs/design.md, "RMSNorm").
            if (f32_bits(total) & Uint32(0x7F800000)) == Uint32(0x7F800000):
                eps_row = self.rescale(rH, eps, lane)
                total = self.warp_total(self.lane_sumsq(rH, lane))
            inv = div_rn(Float32(1.0), sqrt_rn(add_rn(div_rn(total, Float32(L)), eps_row)))
        gNormWeight, gNormed = vectors(mNormWeight), vectors(mNormed)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            c = lane + LANES * i
            if c < self.chunks:
                if normalize != 0:
                    cute.autovec_copy(gNormWeight[(0, None), (0, c)], rWords)
                    for j in cutlass.range_constexpr(VECTOR_WORDS):
                        y0 = bits_f32(bf16_round(mul_rn(rH[i * CHUNK + 2 * j], inv)) << 16)
                        y1 = bits_f32(bf16_round(mul_rn(rH[i * CHUNK + 2 * j + 1], inv)) << 16)
                        z0 = bf16_round(mul_rn(y0, _lo(rWords[j])))
                        z1 = bf16_round(mul_rn(y1, _hi(rWords[j])))
                        rWords[j] = z0 | (z1 << 16)
                else:
                    for j in cutlass.range_constexpr(VECTOR_WORDS):
                        z0 = bf16_round(rH[i * CHUNK + 2 * j])
                        z1 = bf16_round(rH[i * CHUNK + 2 * j + 1])
                        rWords[j] = z0 | (z1 << 16)
                cute.autovec_copy(rWords, gNormed[(0, None), (t, c)])
