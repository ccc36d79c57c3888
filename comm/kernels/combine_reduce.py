"""CombineReduceKernel: wait for every rank's partials, sum them in fp32 in rank order, RMSNorm.

Bit-exact with comm/reference.py `combine_reduce` (same additions in the same order): one warp per
token; lane l owns the 8-element chunks l, l+32, l+64, ...; the sum of squares is accumulated per
lane in chunk and element order, then reduced by the tree (16, 8, 4, 2, 1) of lane 0.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from comm.kernels.mxfp8_block import gmem_words
from comm.kernels.ptx import add_rn, bf16_round, bits_f32, div_rn, f32_bits, mul_rn, sqrt_rn
from comm.kernels.signals import PHASE_COMBINE, load_i32, load_i64, wait_arrivals

LANES = 32
CHUNK = 8  # bf16 elements per 16-byte chunk


def _lo(word):
    return bits_f32(word << 16)


def _hi(word):
    return bits_f32(word & Uint32(0xFFFF0000))


class CombineReduceKernel:
    """Static geometry: num_ranks N, latent L, topk K, experts_per_rank. T is runtime; grid = T."""

    def __init__(self, num_ranks: int, latent: int, topk: int, experts_per_rank: int):
        assert 1 <= num_ranks <= 32 and latent % CHUNK == 0
        self.num_ranks, self.latent, self.topk = num_ranks, latent, topk
        self.experts_per_rank = experts_per_rank
        self.chunks = latent // CHUNK
        self.chunks_per_lane = (self.chunks + LANES - 1) // LANES

    @cute.jit
    def __call__(self, ids: Int64, norm_weight: Int64, normed: Int64, own: Int64, state: Int64,
                 error: Int64, partials_off: Int64, sig_off: Int64, eps: Float32, tokens: Int32,
                 rank: Int32, timeout_ns: Int64, stream: cuda.CUstream):  # fmt: skip
        self.kernel(ids, norm_weight, normed, own, state, error, partials_off, sig_off, eps,
                    tokens, rank, timeout_ns).launch(
            grid=[tokens, 1, 1], block=[LANES, 1, 1], stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(self, ids: Int64, norm_weight: Int64, normed: Int64, own: Int64, state: Int64,
               error: Int64, partials_off: Int64, sig_off: Int64, eps: Float32, tokens: Int32,
               rank: Int32, timeout_ns: Int64):  # fmt: skip
        lane, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        N, K, L = self.num_ranks, self.topk, self.latent
        if lane < N:
            target = load_i64(state + (N + lane) * 8)  # advanced by this step's dispatch
            wait_arrivals(own + sig_off + lane * 8, target, state + 2 * N * 8, error, rank,
                          PHASE_COMBINE, lane, timeout_ns)  # fmt: skip
        cute.arch.barrier()
        hits = Uint32(0)
        for k in cutlass.range_constexpr(K):
            e = load_i32(ids + (Int64(t) * K + k) * 4)
            if e >= 0:
                hits = hits | (Uint32(1) << Uint32(e // self.experts_per_rank))
        rH = cute.make_rmem_tensor(cute.make_layout(self.chunks_per_lane * CHUNK), Float32)
        rWords = cute.make_rmem_tensor(cute.make_layout(4), Uint32)
        sumsq = Float32(0.0)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            c = lane + LANES * i
            if c < self.chunks:
                acc = cute.make_rmem_tensor(cute.make_layout(CHUNK), Float32)
                for j in cutlass.range_constexpr(CHUNK):
                    acc[j] = Float32(0.0)
                for d in cutlass.range_constexpr(N):
                    if (hits >> d) & 1:
                        row = Int64(d) * tokens + t
                        src = own + partials_off + (row * L + c * CHUNK) * 2
                        cute.autovec_copy(gmem_words(src, 4), rWords)
                        for j in cutlass.range_constexpr(4):
                            acc[2 * j] = add_rn(acc[2 * j], _lo(rWords[j]))
                            acc[2 * j + 1] = add_rn(acc[2 * j + 1], _hi(rWords[j]))
                for j in cutlass.range_constexpr(CHUNK):
                    h = bits_f32(bf16_round(acc[j]) << 16)
                    rH[i * CHUNK + j] = h
                    sumsq = add_rn(sumsq, mul_rn(h, h))
        for offset in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_down(sumsq, 16 >> offset)
            sumsq = add_rn(sumsq, other)
        total = cute.arch.shuffle_sync(sumsq, 0)
        inv = div_rn(Float32(1.0), sqrt_rn(add_rn(div_rn(total, Float32(L)), eps)))
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            c = lane + LANES * i
            if c < self.chunks:
                cute.autovec_copy(gmem_words(norm_weight + c * CHUNK * 2, 4), rWords)
                for j in cutlass.range_constexpr(4):
                    y0 = bits_f32(bf16_round(mul_rn(rH[i * CHUNK + 2 * j], inv)) << 16)
                    y1 = bits_f32(bf16_round(mul_rn(rH[i * CHUNK + 2 * j + 1], inv)) << 16)
                    z0 = bf16_round(mul_rn(y0, _lo(rWords[j])))
                    z1 = bf16_round(mul_rn(y1, _hi(rWords[j])))
                    rWords[j] = z0 | (z1 << 16)
                cute.autovec_copy(rWords, gmem_words(normed + (Int64(t) * L + c * CHUNK) * 2, 4))
