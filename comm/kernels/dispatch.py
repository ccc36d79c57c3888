"""DispatchKernel: quantize each token to MXFP8 once and push it to every rank owning one of its
experts (the row contract of docs/design.md), then wait until every source has delivered."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8, Uint32

from dep_ep.comm.kernels.mxfp8_block import BLOCK_WORDS_OUT, gmem_words, quantize_block
from dep_ep.comm.kernels.signals import (
    PHASE_DISPATCH,
    STATE_CALL,
    STATE_DONE_DISPATCH,
    STATE_STEP_STATUS,
    STATUS_OK,
    check_step,
    chunk_begin,
    chunk_end,
    destination_mask,
    flag_slot,
    gmem_ptr,
    is_last_cta,
    load_i32,
    load_i64,
    signal_step,
    store_i64,
)  # fmt: skip
from dep_ep.constants import MAX_RANKS, SCALE_BLOCK


class DispatchKernel:
    """Static geometry: num_ranks N (<= 32), latent L, topk K, experts_per_rank. T is runtime.

    Grid: CTAs take contiguous chunks of tokens; a CTA's threads quantize one token's L/32 blocks
    (one block of 32 per thread at a time) and store each block to every destination rank that owns
    one of the token's experts (16-byte stores); threads < K write the ids row to every rank (-1
    for experts it does not own) and the weights to the ranks the token goes to. After its tokens,
    each CTA fences at system scope; the last CTA to finish stores this source's step flag (call,
    T, tag) into every destination. CTA 0 then waits for every source's flag of this call and
    checks its T and tag (signals.py); a mismatch or a rejecting source is recorded, never waited
    out.
    """

    def __init__(self, num_ranks: int, latent: int, topk: int, experts_per_rank: int,
                 threads: int = 128):  # fmt: skip
        assert (
            1 <= num_ranks <= MAX_RANKS
            and latent % SCALE_BLOCK == 0
            and threads >= max(num_ranks, topk)
        )
        self.num_ranks, self.latent, self.topk = num_ranks, latent, topk
        self.experts_per_rank, self.threads = experts_per_rank, threads
        self.blocks_per_row = latent // SCALE_BLOCK

    @cute.jit
    def __call__(
        self, latent: Int64, ids: Int64, weights: Int64, peers: Int64, own: Int64, state: Int64,
        error: Int64, x_off: Int64, sf_off: Int64, ids_off: Int64, w_off: Int64, flags_off: Int64,
        tokens: Int32, rank: Int32, tag: Int64, timeout_ns: Int64, grid: Int32,
        stream: cuda.CUstream,
    ):  # fmt: skip
        self.kernel(latent, ids, weights, peers, own, state, error, x_off, sf_off, ids_off, w_off,
                    flags_off, tokens, rank, tag, timeout_ns).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self, latent: Int64, ids: Int64, weights: Int64, peers: Int64, own: Int64, state: Int64,
        error: Int64, x_off: Int64, sf_off: Int64, ids_off: Int64, w_off: Int64, flags_off: Int64,
        tokens: Int32, rank: Int32, tag: Int64, timeout_ns: Int64,
    ):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        N, K, L, NB = self.num_ranks, self.topk, self.latent, self.blocks_per_row
        t_begin, t_end = chunk_begin(tokens, bidx, grid), chunk_end(tokens, bidx, grid)
        rOut = cute.make_rmem_tensor(cute.make_layout(BLOCK_WORDS_OUT), Uint32)
        call = load_i64(state + STATE_CALL * 8) + 1  # combine stores it when the call is done
        for t in cutlass.range(t_begin, t_end):
            hits = destination_mask(ids, t, K, self.experts_per_rank)  # bit d: goes to rank d
            row = Int64(rank) * tokens + t  # receive row on every destination
            if hits != 0:  # a token with no expert (padding) is never read: it may not exist
                for b in cutlass.range(tidx, NB, self.threads):
                    scale = quantize_block(latent + (Int64(t) * NB + b) * 64, rOut)
                    for d in cutlass.range_constexpr(N):
                        if (hits >> d) & 1:
                            base = load_i64(peers + d * 8)
                            dst = gmem_words(base + x_off + row * L + b * 32, BLOCK_WORDS_OUT)
                            cute.autovec_copy(rOut, dst)
                            cute.arch.store(gmem_ptr(Uint8, base + sf_off + row * NB + b, 1),
                                            Uint8(scale))  # fmt: skip
            for k in cutlass.range(tidx, K, self.threads):
                e = load_i32(ids + (Int64(t) * K + k) * 4)
                w = cute.arch.load(gmem_ptr(Uint32, weights + (Int64(t) * K + k) * 4), Uint32)
                for d in cutlass.range_constexpr(N):
                    base = load_i64(peers + d * 8)
                    mine = Int32(-1)
                    if e >= 0 and e // self.experts_per_rank == d:
                        mine = e
                    cute.arch.store(gmem_ptr(Int32, base + ids_off + (row * K + k) * 4), mine)
                    if (hits >> d) & 1:
                        cute.arch.store(gmem_ptr(Uint32, base + w_off + (row * K + k) * 4), w)
        if bidx == 0 and tidx == 0:
            store_i64(state + STATE_STEP_STATUS * 8, Int64(0))  # read only after the barrier
        # Every thread's payload stores are ordered before its fence; the CTA barrier then orders
        # all of them before thread 0's acquire-release count, and the last CTA's release stores
        # of the flags come after every CTA's count (signals.is_last_cta).
        cute.arch.fence_acq_rel_sys()
        cute.arch.barrier()
        if tidx == 0:
            if is_last_cta(state + STATE_DONE_DISPATCH * 8, grid) != 0:
                for d in cutlass.range_constexpr(N):
                    slot = flag_slot(load_i64(peers + d * 8), flags_off, PHASE_DISPATCH, N, rank)
                    signal_step(slot, call, STATUS_OK, tokens, tag)
        if bidx == 0 and tidx < N:
            check_step(flag_slot(own, flags_off, PHASE_DISPATCH, N, tidx), call, tokens, tag,
                       state, error, rank, PHASE_DISPATCH, tidx, timeout_ns, True)  # fmt: skip
