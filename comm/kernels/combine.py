"""CombineKernel: pull each token's expert sums from the ranks that hold them, sum over ranks in
rank order, RMSNorm.

Every rank's experts write their output rows into its symmetric `out` region (row s*T + t: this
rank's weighted sum over its local experts for token t of source rank s). One launch per rank:
1. ready: the first CTA to start (`is_first_cta`) stores this rank's combine flag (call, T,
   tag) into every other rank (`signal_all`: one fence, then the flags): its `out` rows of the
   call are written (the experts ran before this launch on the stream).
2. wait: every CTA waits (acquire, bounded) for every other rank's combine flag of this call,
   takes its own rank's status from the device state (`check_own_step`: what its own flag would
   say), and votes across the CTA on the outcome (a rank rejected its input or failed in its
   experts, or the dispatch found the ranks out of step: every output row of the call is NaN
   instead). One rank alone signals nothing and waits for nothing.
3. pull and reduce: a group of NORM_WARPS (4) warps takes one token at a time (group g of CTA b
   with G groups a CTA: tokens Gb + g, Gb + g + G grid, ...); thread m of the group's 128 holds
   the 16-byte chunks m, m + 128, ... of the row (4 at L = 3584: 32 fp32 sums). It reads
   row rank*T + t of the `out` region of each rank that owns one of the token's experts (local
   loads for this rank, NVLink loads for a peer), sums them in fp32 in rank order, and when
   `normalize` is set applies RMSNorm in the exact order of comm/reference.py `rms_norm` (per
   thread in chunk and element order; the tree 16, 8, 4, 2, 1 over a warp's lanes; the tree 2, 1
   over the group's 4 warps, their totals exchanged through shared memory behind the group's
   named barrier; a row whose squares overflow is summed again scaled by a power of two from its
   largest magnitude). The norm weight is staged once per CTA in shared memory as fp32.
4. done: with several ranks the launch's last CTA (`is_last_cta`) stores the call as done in
   the device state, then stores this rank's combine-end flag ("I have read your rows") into
   every other rank and waits (bounded) for every other rank's, so the launch completes only
   when no rank reads this rank's rows any more: whatever runs after it on the stream may
   rewrite them. One rank alone: CTA 0 stores the call its dispatch opened (STATE_OPEN_CALL) as
   done, and no CTA counts itself.

Each byte of an expert output row is read once, where it lies, and each output row is written
once (at EP = 1 and T = 4096: 58.7 MB, against 117 MB for returning the rows to their sources
first and summing them there). No CTA waits for another CTA of its launch, so the grid need not
be co-resident (`is_first_cta`). CombineLaunch, at the end, is the host side: the compile, the
grid rule and the launch.

Why a reader may load a peer's rows after its flag, and why the owner may overwrite them later:
the owner's experts wrote the rows in launches that completed before its combine launch stored
the flag after a system-scope fence (release, cumulative); the reader's acquire of the flag,
then the CTA barrier, order its loads after those writes. A reader's loads have returned their
values before its CTA counts itself done (the values were summed and stored); the count, then
the last CTA's fence and flag store, order them before its combine-end flag, which the owner
acquires before its launch completes. A rank's own rows need no flag: its experts' launches
completed before this launch read anything, and it reads them before its own launch completes.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.memory import SmemAllocator

from dep_ep.comm.kernels.host_params import STREAM, HostParams
from dep_ep.comm.kernels.launch_args import KernelTuning, RankControl, Step, SymmetricRegions
from dep_ep.comm.kernels.launcher import (
    KernelGeometry,
    TransportParams,
    compile_cached,
    placeholder_structs,
)
from dep_ep.comm.kernels.ptx import (
    add_rn,
    barrier_or,
    bf16x2_round,
    bits_f32,
    div_rn,
    f32_bits,
    mul_rn,
    sqrt_rn,
)
from dep_ep.comm.kernels.signals import (
    check_own_step,
    check_step,
    destinations,
    flag_slot,
    is_first_cta,
    is_last_cta,
    load_token_ids,
    signal_all,
    token_ids_tensor,
    wait_flag,
)
from dep_ep.comm.kernels.tensors import (
    BF16_PER_WORD,
    VECTOR_WORDS,
    WORD_BYTES,
    gmem_tensor,
    peer_base,
    receive_regions,
    row_major_layout,
    state_words,
    vectors,
)
from dep_ep.config import DEFAULT_NORM_EPS
from dep_ep.constants import (
    CTA_RESERVED_SHARED_BYTES,
    MAX_RANKS,
    NORM_CHUNK,
    NORM_LANES,
    NORM_SCALE_MAX_EXP,
    NORM_SCALE_MIN_EXP,
    NORM_WARPS,
    PHASE_COMBINE,
    PHASE_COMBINE_END,
    SM_SHARED_BYTES,
    STATE_ABORT,
    STATE_CALL,
    STATE_DONE_COMBINE,
    STATE_OPEN_CALL,
    STATE_READY_COMBINE,
    STATE_STEP_STATUS,
    STATUS_OK,
    STATUS_UNUSABLE,
    VECTOR_BYTES,
    WARP_LANES,
)

GROUP = NORM_LANES  # threads that reduce one token: a group of NORM_WARPS warps
CHUNK = NORM_CHUNK  # bf16 elements per 16-byte vector
assert CHUNK == VECTOR_BYTES // 2 and GROUP == NORM_WARPS * WARP_LANES
BF16_NAN_PAIR = 0x7FC07FC0  # two bf16 quiet NaNs: the mark of an output row of a failed call
# Shared-memory slots of a group's exchanges, per token: the warps' sums of squares, their
# largest magnitudes (the rescaled path) and the rescaled sums of squares; two sets, by the
# parity of the group's token.
SLOT_SUMSQ, SLOT_AMAX, SLOT_RESCALED, SLOTS = 0, 1, 2, 3
FIRST_GROUP_BARRIER = 1  # named barrier 1 + g: the group g's warps; barrier 0 is the CTA's


def _lo(word):
    return bits_f32(word << 16)


def _hi(word):
    return bits_f32(word & Uint32(0xFFFF0000))


class CombineKernel:
    """Static geometry: num_ranks N (<= 32), latent L, topk K, experts_per_rank; the CTA's warps
    W (`tuning.combine_warps`, a multiple of NORM_WARPS): G = W / NORM_WARPS groups of
    NORM_WARPS warps, each taking one token at a time. T is runtime. Grid: any size (group g of
    CTA b takes tokens Gb + g, Gb + g + G grid, ...); the host's rule is CombineLaunch.grid."""

    def __init__(
        self, num_ranks: int, latent: int, topk: int, experts_per_rank: int, tuning: KernelTuning
    ):
        assert 1 <= num_ranks <= MAX_RANKS and latent % CHUNK == 0
        assert tuning.combine_warps % NORM_WARPS == 0
        self.pdl, self.warps = tuning.pdl, tuning.combine_warps
        self.groups = self.warps // NORM_WARPS
        # Launch bounds: the kernel is compiled so that `combine_ctas_per_sm` CTAs fit an SM.
        self.ctas_per_sm = tuning.combine_ctas_per_sm
        self.num_ranks, self.latent, self.topk = num_ranks, latent, topk
        self.experts_per_rank = experts_per_rank
        self.chunks = latent // CHUNK  # 16-byte vectors per row
        self.chunks_per_lane = (self.chunks + GROUP - 1) // GROUP

    @cute.jit
    def __call__(
        self,
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
        """ids: int32 [T, K] as dispatched; norm_weight: bf16 [L] (read when `normalize`);
        normed: bf16 [T, L], the output. All 16-byte aligned. The expert output rows are every
        rank's `out` region (SymmetricRegions.out)."""
        T, W = step.tokens, self.latent // BF16_PER_WORD
        mIds = gmem_tensor(Int32, ids, row_major_layout((T, self.topk)))
        mNormWeight = gmem_tensor(Uint32, norm_weight, row_major_layout((1, W)))
        mNormed = gmem_tensor(Uint32, normed, row_major_layout((T, W)))
        threads = self.warps * WARP_LANES
        bounds = {"min_blocks_per_mp": self.ctas_per_sm} if self.ctas_per_sm else {}
        # Enough shared memory for `combine_ctas_per_sm` CTAs an SM (CuTeDSL would ask the GPU).
        self.kernel(mIds, mNormWeight, mNormed, regions, control, step, eps, normalize).launch(
            grid=[grid, 1, 1],
            block=[threads, 1, 1],
            max_number_threads=[threads, 1, 1],
            **bounds,
            preferred_smem_carveout=self.smem_carveout(),
            stream=stream,
            use_pdl=self.pdl,
        )

    def smem_bytes(self) -> int:
        """Shared memory of a CTA: the norm weight in fp32, the groups' exchange slots."""
        return WORD_BYTES * (self.latent + 2 * SLOTS * self.groups * NORM_WARPS) + VECTOR_BYTES

    def smem_carveout(self) -> int:
        """The shared-memory carveout (percent of SM_SHARED_BYTES) that fits
        `combine_ctas_per_sm` CTAs (each with the driver's CTA_RESERVED_SHARED_BYTES); all of it
        when the grid is not capped (0)."""
        if not self.ctas_per_sm:
            return 100
        need = self.ctas_per_sm * (self.smem_bytes() + CTA_RESERVED_SHARED_BYTES)
        return min(100, -(-100 * need // SM_SHARED_BYTES))

    @cute.kernel
    def kernel(
        self,
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
        N = self.num_ranks
        T = step.tokens
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        mState = state_words(control)
        # The election's atomic first, in flight with the state words' loads below. One rank
        # alone has no other rank to signal.
        signals = Int32(0)  # 1 on thread 0 of the launch's first CTA
        if cutlass.const_expr(N > 1):
            if tidx == 0:
                signals = is_first_cta(control, STATE_READY_COMBINE)
        # The dispatch of this call read STATE_CALL = call - 1. Several ranks: the last CTA here
        # stores `call`. One rank alone: the dispatch stored `call` in STATE_OPEN_CALL, and CTA 0
        # here stores it into STATE_CALL (no CTA of this launch reads that word), so no CTA
        # counts itself: the count's acquire-release atomic cost a launch of more than one CTA
        # 0.4-0.8 us (bench_ep, T = 4 to 1024, one H200; docs/perf_notes.md).
        if cutlass.const_expr(N == 1):
            call = mState[STATE_OPEN_CALL]
        else:
            call = mState[STATE_CALL] + 1
        # What the dispatch of this call found (stream-ordered before this launch).
        dispatch_failed = mState[STATE_STEP_STATUS]
        aborted = mState[STATE_ABORT]
        # Rows computed after a failed dispatch may hold a late peer's half-written input: the
        # ready flag says so, and every rank then marks its output instead of using them.
        status = Int32(STATUS_OK)
        if dispatch_failed != 0 or aborted != 0:
            status = Int32(STATUS_UNUSABLE)
        if signals != 0:
            signal_all(regions, control, step, call, PHASE_COMBINE, status, N)
        # The norm weight, once per CTA into shared memory, widened to fp32 (no unpacking per
        # token): read from global memory after the output stores of a token, its loads could
        # not be hoisted above them (the tensors may alias).
        smem = SmemAllocator()
        sNormWeight = smem.allocate_tensor(
            Uint32, row_major_layout((1, self.latent)), byte_alignment=16
        )
        # The groups' exchanges: fp32 bits [2 (token parity), SLOTS, G, NORM_WARPS].
        G, NW = self.groups, NORM_WARPS
        sExchange = smem.allocate_tensor(
            Uint32,
            cute.make_layout((2, SLOTS, G, NW), stride=(SLOTS * G * NW, G * NW, NW, 1)),
            byte_alignment=16,
        )
        if normalize != 0:
            gNormWeight, gStaged = vectors(mNormWeight), vectors(sNormWeight)
            rPair = cute.make_rmem_tensor(cute.make_layout(VECTOR_WORDS), Uint32)
            rWide = cute.make_rmem_tensor(cute.make_layout(2 * VECTOR_WORDS), Uint32)
            for c in cutlass.range(tidx, self.chunks, self.warps * WARP_LANES):
                cute.autovec_copy(gNormWeight[(0, None), (0, c)], rPair)
                for j in cutlass.range_constexpr(VECTOR_WORDS):
                    rWide[2 * j] = rPair[j] << 16
                    rWide[2 * j + 1] = rPair[j] & Uint32(0xFFFF0000)
                for h in cutlass.range_constexpr(2):
                    for j in cutlass.range_constexpr(VECTOR_WORDS):
                        rPair[j] = rWide[h * VECTOR_WORDS + j]
                    cute.autovec_copy(rPair, gStaged[(0, None), (0, 2 * c + h)])
        lane, warp = tidx % WARP_LANES, tidx // WARP_LANES
        group, member = warp // NORM_WARPS, tidx % GROUP
        first, stride = bidx * self.groups + group, grid * self.groups
        # The first token's ids (the caller's, ready since the dispatch): the load is in flight
        # while the CTA waits for the flags. Each warp of a group reads them (the same 64 bytes).
        rIds = token_ids_tensor(self.topk)
        load_token_ids(mIds, first, T, lane, self.topk, rIds)
        own = receive_regions(regions.own, regions, T * N, self.latent, self.topk, N)
        kind = Int32(0)
        if tidx < N:
            if tidx == control.rank:
                kind = check_own_step(status, aborted, call, control, PHASE_COMBINE)
            else:
                kind = check_step(
                    flag_slot(own.flags, PHASE_COMBINE, tidx),
                    call,
                    step,
                    control,
                    PHASE_COMBINE,
                    tidx,
                    False,
                )
        failed = barrier_or(kind | Int32(dispatch_failed != 0))  # also: sNormWeight is filled
        if cutlass.const_expr(N == 1):
            if bidx == 0 and tidx == 0:  # one CTA: stores to one address serialize
                mState[STATE_CALL] = call
        for t in cutlass.range(first, T, stride):
            if failed != 0:
                self.mark_token(mNormed, t, member)
            else:
                hits = destinations(rIds, self.topk, self.experts_per_rank, N)
                # The next token's ids, in flight with this token's rows (one memory round trip
                # a token instead of two).
                load_token_ids(mIds, t + stride, T, lane, self.topk, rIds)
                # This group's exchange slots for token t: first < stride, so t // stride counts
                # the group's tokens.
                sSlots = sExchange[(t // stride) % 2, None, group, None]
                self.reduce_token(
                    hits,
                    sNormWeight,
                    sSlots,
                    mNormed,
                    regions,
                    control.rank,
                    eps,
                    normalize,
                    T,
                    t,
                    group,
                    member,
                )
        if cutlass.const_expr(N > 1):
            cute.arch.barrier()
            last = Int32(0)
            if tidx == 0:
                last = is_last_cta(control, STATE_DONE_COMBINE, grid)
                if last != 0:
                    # Every CTA read STATE_CALL and counted its arrival before it counted itself
                    # done.
                    mState[STATE_READY_COMBINE] = Int64(0)
                    mState[STATE_CALL] = call
            # The last CTA: every read of the peers' rows is done; tell them, and complete only
            # once every rank is done reading this rank's rows (so that anything stream-ordered
            # after this launch may rewrite them). One rank alone reads only its own rows.
            if barrier_or(last) != 0:
                if tidx == 0:
                    signal_all(regions, control, step, call, PHASE_COMBINE_END, STATUS_OK, N)
                cute.arch.barrier()
                if tidx < N and tidx != control.rank:  # this rank's own reads are done
                    wait_flag(
                        flag_slot(own.flags, PHASE_COMBINE_END, tidx),
                        call << 2,
                        control,
                        PHASE_COMBINE_END,
                        tidx,
                    )

    @cute.jit
    def mark_token(self, mNormed: cute.Tensor, t: Int32, member: Int32):
        """One group: token t's output row all NaN (the call failed on some rank)."""
        rWords = cute.make_rmem_tensor(cute.make_layout(VECTOR_WORDS), Uint32)
        for j in cutlass.range_constexpr(VECTOR_WORDS):
            rWords[j] = Uint32(BF16_NAN_PAIR)
        gNormed = vectors(mNormed)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            c = member + GROUP * i
            if c < self.chunks:
                cute.autovec_copy(rWords, gNormed[(0, None), (t, c)])

    @cute.jit
    def pull_rows(
        self,
        regions: SymmetricRegions,
        rank: Int32,
        tokens: Int32,
        t: Int32,
        hits: Uint32,
        member: Int32,
        rH: cute.Tensor,
    ):
        """Token t's row, this thread's chunks: rH[8i + j] = the fp32 sum, in rank order from
        +0.0, of element j of chunk member + 128i of row rank*T + t in the `out` region of every
        rank d whose bit is set in `hits`. Per rank, the thread loads all its chunks before it
        adds any: a row's loads are in flight together (one memory round trip per rank)."""
        N, L, K = self.num_ranks, self.latent, self.topk
        rWords = cute.make_rmem_tensor(
            cute.make_layout((self.chunks_per_lane, VECTOR_WORDS), stride=(VECTOR_WORDS, 1)),
            Uint32,
        )
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            for j in cutlass.range_constexpr(CHUNK):
                rH[i * CHUNK + j] = Float32(0.0)
        row = rank * tokens + t
        for d in cutlass.range_constexpr(N):
            if (hits >> d) & 1:
                src = receive_regions(peer_base(regions, d, N), regions, tokens * N, L, K, N)
                gOut = vectors(src.out)  # ((1, 4), (N*T, L/8)): 16-byte vectors
                for i in cutlass.range_constexpr(self.chunks_per_lane):
                    c = member + GROUP * i
                    if c < self.chunks:
                        cute.autovec_copy(gOut[(0, None), (row, c)], rWords[i, None])
                for i in cutlass.range_constexpr(self.chunks_per_lane):
                    if member + GROUP * i < self.chunks:
                        for j in cutlass.range_constexpr(VECTOR_WORDS):
                            k = i * CHUNK + 2 * j
                            rH[k] = add_rn(rH[k], _lo(rWords[i, j]))
                            rH[k + 1] = add_rn(rH[k + 1], _hi(rWords[i, j]))

    @cute.jit
    def lane_sumsq(self, rH: cute.Tensor, member: Int32) -> Float32:
        """This thread's sum of squares of rH, in chunk and element order."""
        sumsq = Float32(0.0)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            if member + GROUP * i < self.chunks:
                for j in cutlass.range_constexpr(CHUNK):
                    h = rH[i * CHUNK + j]
                    sumsq = add_rn(sumsq, mul_rn(h, h))
        return sumsq

    @cute.jit
    def group_total(
        self, sumsq: Float32, sSlots: cute.Tensor, slot: int, group: Int32, member: Int32
    ) -> Float32:
        """The group's sum of its threads' `sumsq`, on every thread: the tree x[i] += x[i + o],
        o = 16, 8, 4, 2, 1 over each warp's lanes, then the same tree over the warps' totals
        (o = 2, 1 for 4 warps), exchanged through `slot` of sSlots (shared memory)."""
        for step in cutlass.range_constexpr(5):
            sumsq = add_rn(sumsq, cute.arch.shuffle_sync_down(sumsq, 16 >> step))
        rTotals = self.exchange(f32_bits(sumsq), sSlots, slot, group, member)
        for level in cutlass.range_constexpr(NORM_WARPS.bit_length() - 1):
            width = NORM_WARPS >> (level + 1)
            for w in cutlass.range_constexpr(width):
                rTotals[w] = f32_bits(add_rn(bits_f32(rTotals[w]), bits_f32(rTotals[w + width])))
        return bits_f32(rTotals[0])

    @cute.jit
    def exchange(
        self, word: Uint32, sSlots: cute.Tensor, slot: int, group: Int32, member: Int32
    ) -> cute.Tensor:
        """Every warp's lane 0 stores `word` into `slot`; after the group's named barrier, every
        thread holds the group's NORM_WARPS words in warp order (a register tensor). The slot
        is written again two tokens later, after the group's barrier of the token between: by
        then every thread has read it."""
        if member % WARP_LANES == 0:
            sSlots[slot, member // WARP_LANES] = word
        # A barrier id known at compile time per group: a runtime id makes ptxas reserve all 16.
        for g in cutlass.range_constexpr(self.groups):
            if group == g:
                cute.arch.barrier(barrier_id=FIRST_GROUP_BARRIER + g, number_of_threads=GROUP)
        rWords = cute.make_rmem_tensor(cute.make_layout(NORM_WARPS), Uint32)
        cute.autovec_copy(sSlots[slot, None], rWords)
        return rWords

    @cute.jit
    def rescale(
        self, rH: cute.Tensor, eps: Float32, sSlots: cute.Tensor, group: Int32, member: Int32
    ) -> Float32:
        """The rare path of a row whose squares overflow: multiply rH by the power of two
        2^(127 - clamp(E, 127, 253)), E the biased exponent of the row's largest magnitude (the
        max is exact in any order); returns eps times the square of that scale."""
        amax = Uint32(0)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            # A thread's last chunk may not exist (L not a multiple of 1024): its registers hold
            # the +0.0 pull_rows started from, which must not reach the max either way.
            if member + GROUP * i < self.chunks:
                for j in cutlass.range_constexpr(CHUNK):
                    amax = cutlass.max(amax, f32_bits(rH[i * CHUNK + j]) & Uint32(0x7FFFFFFF))
        for step in cutlass.range_constexpr(5):
            amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, 16 >> step))
        rAmax = self.exchange(amax, sSlots, SLOT_AMAX, group, member)
        for w in cutlass.range_constexpr(NORM_WARPS):
            amax = cutlass.max(amax, rAmax[w])
        exponent = cutlass.min(
            cutlass.max((amax >> 23) & Uint32(0xFF), Uint32(NORM_SCALE_MIN_EXP)),
            Uint32(NORM_SCALE_MAX_EXP),
        )
        scale = bits_f32((Uint32(254) - exponent) << 23)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            for j in cutlass.range_constexpr(CHUNK):
                rH[i * CHUNK + j] = mul_rn(rH[i * CHUNK + j], scale)
        return mul_rn(mul_rn(eps, scale), scale)

    @cute.jit
    def reduce_token(
        self,
        hits: Uint32,
        sNormWeight: cute.Tensor,
        sSlots: cute.Tensor,
        mNormed: cute.Tensor,
        regions: SymmetricRegions,
        rank: Int32,
        eps: Float32,
        normalize: Int32,
        tokens: Int32,
        t: Int32,
        group: Int32,
        member: Int32,
    ):
        """One group: token t's rank-ordered fp32 sum of the rows pulled from the ranks in `hits`
        (bit d: rank d owns one of its experts), rounded to BF16, then (when `normalize`)
        RMSNorm with the norm weight (sNormWeight, fp32 in shared memory), to `normed`."""
        L = self.latent
        rH = cute.make_rmem_tensor(cute.make_layout(self.chunks_per_lane * CHUNK), Float32)
        self.pull_rows(regions, rank, tokens, t, hits, member, rH)
        # The sum rounded to BF16 (kept as fp32: exact), as the reference does before its norm;
        # two values an instruction.
        for k in cutlass.range_constexpr(self.chunks_per_lane * CHUNK // 2):
            pair = bf16x2_round(rH[2 * k + 1], rH[2 * k])
            rH[2 * k], rH[2 * k + 1] = _lo(pair), _hi(pair)
        inv = Float32(1.0)
        if normalize != 0:
            total = self.group_total(self.lane_sumsq(rH, member), sSlots, SLOT_SUMSQ, group, member)
            eps_row = eps
            # Squares that overflow (the total is Inf or NaN; the same on every thread of the
            # group): scale the row by a power of two and sum again (docs/design.md, "RMSNorm").
            if (f32_bits(total) & Uint32(0x7F800000)) == Uint32(0x7F800000):
                eps_row = self.rescale(rH, eps, sSlots, group, member)
                total = self.group_total(
                    self.lane_sumsq(rH, member), sSlots, SLOT_RESCALED, group, member
                )
            inv = div_rn(Float32(1.0), sqrt_rn(add_rn(div_rn(total, Float32(L)), eps_row)))
        rWords = cute.make_rmem_tensor(cute.make_layout(VECTOR_WORDS), Uint32)
        rWeight = cute.make_rmem_tensor(
            cute.make_layout((2, VECTOR_WORDS), stride=(VECTOR_WORDS, 1)), Uint32
        )
        sWeight, gNormed = vectors(sNormWeight), vectors(mNormed)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            c = member + GROUP * i
            if c < self.chunks:
                if normalize != 0:
                    for h in cutlass.range_constexpr(2):
                        cute.autovec_copy(sWeight[(0, None), (0, 2 * c + h)], rWeight[h, None])
                    for j in cutlass.range_constexpr(VECTOR_WORDS):
                        k = i * CHUNK + 2 * j
                        y = bf16x2_round(mul_rn(rH[k + 1], inv), mul_rn(rH[k], inv))
                        z0 = mul_rn(_lo(y), bits_f32(rWeight[(2 * j) // 4, (2 * j) % 4]))
                        z1 = mul_rn(_hi(y), bits_f32(rWeight[(2 * j + 1) // 4, (2 * j + 1) % 4]))
                        rWords[j] = bf16x2_round(z1, z0)
                else:
                    for j in cutlass.range_constexpr(VECTOR_WORDS):
                        k = i * CHUNK + 2 * j
                        rWords[j] = bf16x2_round(rH[k + 1], rH[k])
                cute.autovec_copy(rWords, gNormed[(0, None), (t, c)])


class CombineLaunch:
    """CombineKernel's launch, for one geometry and one transport: its compile (cached per
    geometry, tuning and arch), its grid rule, its launch parameters in HostParams written in
    place, and the launch.

    Constraints (stated here once; the callers that check them are named):
    - Geometry: KernelGeometry's bounds (the kernel itself asserts only L a multiple of CHUNK,
      8).
    - T: 1 <= T, the T of this call's dispatch, which ran before it on this rank (so T and the
      tag are the same on every rank: the dispatch checked them).
    - Tensors: ids int32 [T, K] as dispatched, contiguous; norm_weight bf16 [L] (read only when
      given); normed bf16 [T, L] contiguous, the output. All 16-byte aligned (EpRouted checks
      the caller's norm weight and output and stages its ids).
    - Stream order: this call's dispatch, then the experts that wrote this rank's rows into its
      `out` region, come before the launch on its stream (with `tuning.pdl` the kernel may
      start while the kernel before it finishes; it waits for that grid, griddepcontrol.wait,
      before it reads anything). Once it completes, no rank reads this rank's rows any more
      (the combine-end flags): whatever follows it on the stream may rewrite them.
    - Co-residency: none needed. No CTA waits for another CTA of its launch: every CTA waits
      (bounded) for every other rank's combine flag, none for this rank's own (stored by the
      first CTA of the launch to start, which is resident by definition: is_first_cta); the
      last CTA to finish waits for the peers' combine-end flags, after every CTA of its launch
      is done. The groups of a CTA wait only for one another (a named barrier a group, within a
      token).
    - Beside other streams (the layer's side stream runs SiTU and the shared down GEMM
      concurrently with the routed path, docs/layer.md): a GEMM's CTAs holding SMs only delay
      the combine CTAs not yet started, and they complete without waiting for the combine. The
      other way, a combine CTA holds its SM while it waits for the slowest rank's flag: with
      the default tuning a CTA at K3's L is 8 warps of 96-100 registers a thread (ptxas, sm_90a)
      and 15 KB of shared memory, about two fifths of the SM's register file: once T >= 4 x SMs
      the combine holds four fifths of every SM's registers from its start until it completes,
      and at smaller T GEMM CTAs fit beside its CTAs.
      That costs the side stream time, never progress. As for the dispatch (DispatchLaunch),
      this holds while the kernels beside it complete without waiting for this rank's dispatch
      or combine, and a kernel launched after it with programmatic dependent launch cannot keep a
      combine CTA from starting (it starts once every combine CTA has run its first
      instructions, griddepcontrol.launch_dependents among them).
    """

    NAME = "combine"

    def __init__(
        self,
        geometry: KernelGeometry,
        tuning: KernelTuning,
        transport: TransportParams,
        num_sms: int,
        arch: str | None = None,
    ):
        """Compile (or take from the cache) the kernel for `arch` (None: this process's GPU);
        `transport`: the transport's regions and control words; `num_sms`: the GPU's SM count (the
        grid rule)."""
        self.compiled = self.compile(geometry, tuning, arch)
        self.transport = transport
        self.groups = tuning.combine_warps // NORM_WARPS
        self.max_ctas = tuning.combine_ctas_per_sm * num_sms  # 0: no cap
        # The call's tensors' addresses, the step, eps, the normalize flag, the grid and the
        # stream: written at each launch.
        self.ids, self.norm_weight, self.normed = (HostParams(Int64) for _ in range(3))
        self.step = HostParams(*(f.type for f in dataclasses.fields(Step)))
        self.eps, self.normalize = HostParams(Float32), HostParams(Int32)
        self.grid_size = HostParams(Int32)
        self.stream = HostParams(STREAM)

    @staticmethod
    def compile(
        geometry: KernelGeometry,
        tuning: KernelTuning,
        arch: str | None = None,
        keep_ptx_dir: str | None = None,
    ):
        """The compiled kernel of `geometry` and `tuning` for `arch` (None: this process's GPU),
        from the process's cache (comm/kernels/launcher.py, compile_cached)."""

        def build():
            kernel = CombineKernel(
                geometry.num_ranks,
                geometry.latent,
                geometry.topk,
                geometry.experts_per_rank,
                tuning,
            )
            z, one = Int64(0), Int32(1)
            # ids, norm_weight, normed, the structs, eps, normalize, the grid
            args = (z, z, z, *placeholder_structs(), Float32(DEFAULT_NORM_EPS), one, one)
            return kernel, args

        return compile_cached(geometry, CombineLaunch.NAME, arch, tuning, build, keep_ptx_dir)

    def grid(self, tokens: int) -> int:
        """CTAs for T = `tokens`: ceil(T / G), G = combine_warps / NORM_WARPS groups a CTA (one
        token a group at a time), at most combine_ctas_per_sm an SM when that is > 0 (the groups
        then loop over the tokens; the kernel is compiled so that that many CTAs fit an SM)."""
        grid = -(-tokens // self.groups)
        return min(grid, self.max_ctas) if self.max_ctas else grid

    def __call__(
        self, ids, norm_weight, normed, eps: float, tokens: int, tag: int, stream: int
    ) -> None:
        """Launch on `stream` (a CUstream handle) the combine of T = `tokens` with `tag`: ids
        int32 [T, K] as dispatched, norm_weight bf16 [L] or None (the plain sum, rounded to
        BF16), normed bf16 [T, L] (the output), torch tensors on this rank's GPU; `eps` the
        norm's (added in fp32)."""
        self.compiled(
            self.ids.set(ids.data_ptr()),
            self.norm_weight.set(0 if norm_weight is None else norm_weight.data_ptr()),
            self.normed.set(normed.data_ptr()),
            self.transport.regions,
            self.transport.control,
            self.step.set(tokens, tag),
            self.eps.set(float(eps)),
            self.normalize.set(0 if norm_weight is None else 1),
            self.grid_size.set(self.grid(tokens)),
            self.stream.set(stream),
        )
