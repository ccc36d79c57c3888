"""CombineKernel: return expert output rows to their sources, wait, sum over ranks, RMSNorm.

Two phases, compiled as one launch (mode "fused") or two (modes "send" then "reduce"):
1. send: CTAs take contiguous chunks of the rows r = s*T + t of this rank's expert output (bf16
   [N*T, L]); a row whose received ids hold a local expert goes to rank s's partials row
   rank*T + t (16-byte copies). Each CTA then fences at system scope; the last CTA to finish
   stores this rank's combine flag (call, T, tag) into every source (signals.py) and marks the
   call done in the device state.
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
own that is not yet resident). comm/device_transport.py picks by T.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from dep_ep.comm.kernels.mxfp8_block import gmem_words
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
    PHASE_COMBINE,
    STATE_CALL,
    STATE_DONE_COMBINE,
    STATE_STEP_STATUS,
    STATUS_OK,
    check_step,
    chunk_begin,
    chunk_end,
    destination_mask,
    flag_slot,
    is_last_cta,
    load_i32,
    load_i64,
    signal_step,
    store_i64,
)
from dep_ep.constants import (
    MAX_RANKS,
    NORM_CHUNK,
    NORM_LANES,
    NORM_SCALE_MAX_EXP,
    NORM_SCALE_MIN_EXP,
)

LANES = NORM_LANES  # one warp per token in the reduce phase
WARPS = 8  # 256 threads: the reduce phase's tokens in flight per CTA (one CTA per SM)
CHUNK = NORM_CHUNK  # bf16 elements per 16-byte chunk
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
        self, num_ranks: int, latent: int, topk: int, experts_per_rank: int, mode: str = "fused"
    ):
        assert 1 <= num_ranks <= MAX_RANKS and latent % CHUNK == 0 and mode in MODES
        self.mode = mode
        self.num_ranks, self.latent, self.topk = num_ranks, latent, topk
        self.experts_per_rank = experts_per_rank
        self.chunks = latent // CHUNK
        self.chunks_per_lane = (self.chunks + LANES - 1) // LANES

    @cute.jit
    def __call__(
        self, out: Int64, recv_ids: Int64, ids: Int64, norm_weight: Int64, normed: Int64,
        peers: Int64, own: Int64, state: Int64, error: Int64, partials_off: Int64,
        flags_off: Int64, eps: Float32, normalize: Int32, tokens: Int32, rank: Int32, tag: Int64,
        timeout_ns: Int64, grid: Int32, stream: cuda.CUstream,
    ):  # fmt: skip
        self.kernel(out, recv_ids, ids, norm_weight, normed, peers, own, state, error,
                    partials_off, flags_off, eps, normalize, tokens, rank, tag,
                    timeout_ns).launch(
            grid=[grid, 1, 1], block=[LANES * WARPS, 1, 1], stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self, out: Int64, recv_ids: Int64, ids: Int64, norm_weight: Int64, normed: Int64,
        peers: Int64, own: Int64, state: Int64, error: Int64, partials_off: Int64,
        flags_off: Int64, eps: Float32, normalize: Int32, tokens: Int32, rank: Int32, tag: Int64,
        timeout_ns: Int64,
    ):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        N = self.num_ranks
        # The dispatch of this call read STATE_CALL = call - 1; the send phase stores `call`.
        call = load_i64(state + STATE_CALL * 8)
        # What the dispatch of this call found (stream-ordered before this launch).
        dispatch_failed = load_i64(state + STATE_STEP_STATUS * 8)
        if cutlass.const_expr(self.mode != "reduce"):
            call = call + 1
            self.send(out, recv_ids, peers, partials_off, tokens, rank, tidx, bidx, grid)
            # Every thread's partials stores are ordered before its fence; the barrier and the
            # last-CTA count order them before the flags (as in the dispatch).
            cute.arch.fence_acq_rel_sys()
            cute.arch.barrier()
            if tidx == 0:
                if is_last_cta(state + STATE_DONE_COMBINE * 8, grid) != 0:
                    for s in cutlass.range_constexpr(N):
                        slot = flag_slot(load_i64(peers + s * 8), flags_off, PHASE_COMBINE, N,
                                         rank)  # fmt: skip
                        signal_step(slot, call, STATUS_OK, tokens, tag)
                    # Every CTA of this launch read STATE_CALL before it counted itself done.
                    store_i64(state + STATE_CALL * 8, call)
        if cutlass.const_expr(self.mode != "send"):
            # Wait for every rank's flag of this call, then reduce (or mark a failed call).
            kind = Int32(0)
            if tidx < N:
                kind = check_step(flag_slot(own, flags_off, PHASE_COMBINE, N, tidx), call, tokens,
                                  tag, state, error, rank, PHASE_COMBINE, tidx, timeout_ns,
                                  False)  # fmt: skip
            failed = barrier_or(kind | Int32(dispatch_failed != 0))
            lane = tidx % LANES
            warp = tidx // LANES
            for t in cutlass.range(bidx * WARPS + warp, tokens, grid * WARPS):
                if failed != 0:
                    self.mark_token(normed, t, lane)
                else:
                    self.reduce_token(ids, norm_weight, normed, own + partials_off, eps,
                                      normalize, tokens, t, lane)  # fmt: skip

    @cute.jit
    def send(self, out: Int64, recv_ids: Int64, peers: Int64, partials_off: Int64,
             tokens: Int32, rank: Int32, tidx: Int32, bidx: Int32, grid: Int32):  # fmt: skip
        """Phase 1: this CTA's contiguous share of the rows r = s*T + t goes to the sources'
        partials (the rows whose received ids hold a local expert)."""
        N, K, row_bytes = self.num_ranks, self.topk, self.latent * 2
        rows = tokens * N
        r_begin, r_end = chunk_begin(rows, bidx, grid), chunk_end(rows, bidx, grid)
        rBuf = cute.make_rmem_tensor(cute.make_layout(4), Uint32)
        for r in cutlass.range(r_begin, r_end):
            hit = Int32(0)
            for k in cutlass.range_constexpr(K):
                if load_i32(recv_ids + (Int64(r) * K + k) * 4) >= 0:
                    hit = Int32(1)
            if hit != 0:
                source = r // tokens
                t = r - source * tokens
                dst = load_i64(peers + source * 8) + partials_off
                dst = dst + (Int64(rank) * tokens + t) * row_bytes
                src = out + Int64(r) * row_bytes
                for c in cutlass.range(tidx, row_bytes // 16, LANES * WARPS):
                    cute.autovec_copy(gmem_words(src + c * 16, 4), rBuf)
                    cute.autovec_copy(rBuf, gmem_words(dst + c * 16, 4))

    @cute.jit
    def mark_token(self, normed: Int64, t: Int32, lane: Int32):
        """One warp: token t's output row all NaN (the call failed on some rank)."""
        rWords = cute.make_rmem_tensor(cute.make_layout(4), Uint32)
        for j in cutlass.range_constexpr(4):
            rWords[j] = Uint32(BF16_NAN_PAIR)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            c = lane + LANES * i
            if c < self.chunks:
                dst = normed + (Int64(t) * self.latent + c * CHUNK) * 2
                cute.autovec_copy(rWords, gmem_words(dst, 4))

    @cute.jit
    def sum_chunk(self, partials: Int64, tokens: Int32, t: Int32, c: Int32, hits: Uint32, i: int,
                  rH: cute.Tensor, rWords: cute.Tensor, acc: cute.Tensor,
                  sumsq: Float32) -> Float32:  # fmt: skip
        """Chunk c (8 elements) of token t: rank-ordered fp32 sum of the hit ranks' partials, BF16
        rounded into rH[8i:8i+8]; returns sumsq plus their squares, in element order."""
        for j in cutlass.range_constexpr(CHUNK):
            acc[j] = Float32(0.0)
        for d in cutlass.range_constexpr(self.num_ranks):
            if (hits >> d) & 1:
                src = partials + ((Int64(d) * tokens + t) * self.latent + c * CHUNK) * 2
                cute.autovec_copy(gmem_words(src, 4), rWords)
                for j in cutlass.range_constexpr(4):
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
        for k in cutlass.range_constexpr(self.chunks_per_lane * CHUNK):
            amax = cutlass.max(amax, f32_bits(rH[k]) & Uint32(0x7FFFFFFF))
        for step in cutlass.range_constexpr(5):
            amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, 16 >> step))
        exponent = cutlass.min(cutlass.max((amax >> 23) & Uint32(0xFF),
                                           Uint32(NORM_SCALE_MIN_EXP)),
                               Uint32(NORM_SCALE_MAX_EXP))  # fmt: skip
        scale = bits_f32((Uint32(254) - exponent) << 23)
        for k in cutlass.range_constexpr(self.chunks_per_lane * CHUNK):
            rH[k] = mul_rn(rH[k], scale)
        return mul_rn(mul_rn(eps, scale), scale)

    @cute.jit
    def reduce_token(self, ids: Int64, norm_weight: Int64, normed: Int64, partials: Int64,
                     eps: Float32, normalize: Int32, tokens: Int32, t: Int32,
                     lane: Int32):  # fmt: skip
        """One warp: token t's rank-ordered fp32 sum of partials, rounded to BF16, then (when
        `normalize`) RMSNorm with norm_weight, to `normed`."""
        K, L = self.topk, self.latent
        hits = destination_mask(ids, t, K, self.experts_per_rank)
        rH = cute.make_rmem_tensor(cute.make_layout(self.chunks_per_lane * CHUNK), Float32)
        rWords = cute.make_rmem_tensor(cute.make_layout(4), Uint32)
        acc = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
        sumsq = Float32(0.0)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            c = lane + LANES * i
            if cutlass.const_expr(self.chunks % LANES == 0):  # every lane has chunk i: no guard
                sumsq = self.sum_chunk(partials, tokens, t, c, hits, i, rH, rWords, acc, sumsq)
            else:
                if c < self.chunks:
                    sumsq = self.sum_chunk(partials, tokens, t, c, hits, i, rH, rWords, acc, sumsq)
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
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            c = lane + LANES * i
            if c < self.chunks:
                if normalize != 0:
                    cute.autovec_copy(gmem_words(norm_weight + c * CHUNK * 2, 4), rWords)
                    for j in cutlass.range_constexpr(4):
                        y0 = bits_f32(bf16_round(mul_rn(rH[i * CHUNK + 2 * j], inv)) << 16)
                        y1 = bits_f32(bf16_round(mul_rn(rH[i * CHUNK + 2 * j + 1], inv)) << 16)
                        z0 = bf16_round(mul_rn(y0, _lo(rWords[j])))
                        z1 = bf16_round(mul_rn(y1, _hi(rWords[j])))
                        rWords[j] = z0 | (z1 << 16)
                else:
                    for j in cutlass.range_constexpr(4):
                        z0 = bf16_round(rH[i * CHUNK + 2 * j])
                        z1 = bf16_round(rH[i * CHUNK + 2 * j + 1])
                        rWords[j] = z0 | (z1 << 16)
                cute.autovec_copy(rWords, gmem_words(normed + (Int64(t) * L + c * CHUNK) * 2, 4))
