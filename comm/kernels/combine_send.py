"""CombineSendKernel: push each expert output row back to its source rank's partials, then signal."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from comm.kernels.mxfp8_block import gmem_words
from comm.kernels.signals import load_i32, load_i64, overlap, signal_arrival

CHUNK_WORDS = 4  # 16 bytes: 8 bf16


class CombineSendKernel:
    """Static geometry: num_ranks N, latent L, topk K. T is runtime.

    Rows r = s*T + t of this rank's expert output (bf16 [N*T, L]) whose received ids hold a local
    expert go to rank s's partials row rank*T + t (16-byte copies, a CTA's threads over one row).
    CTAs take contiguous row chunks; afterwards each CTA fences at system scope and release-adds,
    for every source s, the number of s's rows it handled (sent or not) to s's combine counter for
    this rank: every source receives exactly T per step from every rank.
    """

    def __init__(self, num_ranks: int, latent: int, topk: int, threads: int = 128):
        assert 1 <= num_ranks <= 32 and latent % 8 == 0 and threads >= num_ranks
        self.num_ranks, self.latent, self.topk, self.threads = num_ranks, latent, topk, threads

    @cute.jit
    def __call__(self, out: Int64, recv_ids: Int64, peers: Int64, partials_off: Int64,
                 sig_off: Int64, tokens: Int32, rank: Int32, grid: Int32,
                 stream: cuda.CUstream):  # fmt: skip
        self.kernel(out, recv_ids, peers, partials_off, sig_off, tokens, rank).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(self, out: Int64, recv_ids: Int64, peers: Int64, partials_off: Int64,
               sig_off: Int64, tokens: Int32, rank: Int32):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        N, K, row_bytes = self.num_ranks, self.topk, self.latent * 2
        rows = tokens * N
        chunk = (rows + grid - 1) // grid
        r_begin = cutlass.min(bidx * chunk, rows)
        r_end = cutlass.min(r_begin + chunk, rows)
        rBuf = cute.make_rmem_tensor(cute.make_layout(CHUNK_WORDS), Uint32)
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
                for c in cutlass.range(tidx, row_bytes // 16, self.threads):
                    cute.autovec_copy(gmem_words(src + c * 16, CHUNK_WORDS), rBuf)
                    cute.autovec_copy(rBuf, gmem_words(dst + c * 16, CHUNK_WORDS))
        cute.arch.fence_acq_rel_sys()
        cute.arch.barrier()
        if tidx < N:
            count = overlap(r_begin, r_end, tidx * tokens, (tidx + 1) * tokens)
            if count > 0:
                signal_arrival(load_i64(peers + tidx * 8) + sig_off + Int64(rank) * 8,
                               Int64(count))  # fmt: skip
