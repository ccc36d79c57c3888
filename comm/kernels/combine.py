"""CombineKernel: pull each token's expert sums from the ranks that hold them, sum over ranks in
rank order, RMSNorm.

Every rank's experts write their output rows into its symmetric `out` region (row s*T + t: this
rank's weighted sum over its local experts for token t of source rank s). One launch per rank:
1. ready: the first CTA to start stores this rank's combine flag (call, T, tag) into every rank
   (`signal_first_cta`): its `out` rows of the call are written (the experts ran before this
   launch on the stream).
2. wait: every CTA waits (acquire, bounded) for every rank's combine flag of this call and votes
   across the CTA on the outcome (a rank rejected its input or failed in its experts, or the
   dispatch found the ranks out of step: every output row of the call is NaN instead).
3. pull and reduce: warp w of CTA b takes this rank's tokens t = Wb + w, Wb + w + WG, ...: it
   reads row rank*T + t of the `out` region of each rank that owns one of the token's experts
   (local loads for this rank, NVLink loads for a peer), sums them in fp32 in rank order, and
   when `normalize` is set applies RMSNorm in the exact order of comm/reference.py `rms_norm`
   (lane l owns the 8-element chunks l, l+32, ...; per-lane sums in chunk and element order; tree
   16, 8, 4, 2, 1; a row whose squares overflow is summed again scaled by a power of two from its
   largest magnitude).
4. done: the launch's last CTA stores the call as done in the device state; with several ranks
   it then stores this rank's combine-end flag ("I have read your rows") into every rank and
   waits (bounded) for every rank's, so the launch completes only when no rank reads this rank's
   rows any more: whatever runs after it on the stream may rewrite them.

Each byte of an expert output row is read once, where it lies, and each output row is written
once (at EP = 1 and T = 4096: 58.7 MB, against 117 MB for returning the rows to their sources
first and summing them there). No CTA waits for another CTA of its launch, so the grid need not
be co-resident (`signal_first_cta`). CombineLaunch, at the end, is the host side: the compile, the
grid rule and the launch.

Why a reader may load a peer's rows after its flag, and why the owner may overwrite them later:
the owner's experts wrote the rows in launches that completed before its combine launch stored
the flag after a system-scope fence (release, cumulative); the reader's acquire of the flag,
then the CTA barrier, order its loads after those writes. A reader's loads have returned their
values before its CTA counts itself done (the values were summed and stored); the count, then
the last CTA's fence and release store, order them before its combine-end flag, which the owner
acquires before its launch completes.
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
    bf16_round,
    bits_f32,
    div_rn,
    f32_bits,
    mul_rn,
    sqrt_rn,
)
from dep_ep.comm.kernels.signals import (
    check_step,
    destinations,
    flag_slot,
    is_last_cta,
    load_token_ids,
    signal_all,
    signal_first_cta,
    token_ids_tensor,
    wait_flag,
)
from dep_ep.comm.kernels.tensors import (
    BF16_PER_WORD,
    VECTOR_WORDS,
    gmem_tensor,
    peer_base,
    receive_regions,
    row_major,
    state_words,
    vectors,
)
from dep_ep.config import DEFAULT_NORM_EPS
from dep_ep.constants import (
    MAX_RANKS,
    NORM_CHUNK,
    NORM_LANES,
    NORM_SCALE_MAX_EXP,
    NORM_SCALE_MIN_EXP,
    PHASE_COMBINE,
    PHASE_COMBINE_END,
    STATE_ABORT,
    STATE_CALL,
    STATE_DONE_COMBINE,
    STATE_READY_COMBINE,
    STATE_STEP_STATUS,
    STATUS_OK,
    STATUS_UNUSABLE,
    WARP_LANES,
)

LANES = NORM_LANES  # one warp per token
CHUNK = NORM_CHUNK  # bf16 elements per 16-byte vector
assert CHUNK == VECTOR_WORDS * BF16_PER_WORD
BF16_NAN_PAIR = 0x7FC07FC0  # two bf16 quiet NaNs: the mark of an output row of a failed call


def _lo(word):
    return bits_f32(word << 16)


def _hi(word):
    return bits_f32(word & Uint32(0xFFFF0000))


class CombineKernel:
    """Static geometry: num_ranks N (<= 32), latent L, topk K, experts_per_rank; the CTA's warps
    W (`tuning.combine_warps`). T is runtime. Grid: any size (CTA b takes tokens Wb + w,
    Wb + w + WG, ...); the host's rule is CombineLaunch.grid."""

    def __init__(
        self, num_ranks: int, latent: int, topk: int, experts_per_rank: int, tuning: KernelTuning
    ):
        assert 1 <= num_ranks <= MAX_RANKS and latent % CHUNK == 0
        self.pdl, self.warps = tuning.pdl, tuning.combine_warps
        self.num_ranks, self.latent, self.topk = num_ranks, latent, topk
        self.experts_per_rank = experts_per_rank
        self.chunks = latent // CHUNK  # 16-byte vectors per row
        self.chunks_per_lane = (self.chunks + LANES - 1) // LANES

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
        mIds = gmem_tensor(Int32, ids, row_major(T, self.topk))
        mNormWeight = gmem_tensor(Uint32, norm_weight, row_major(1, W))
        mNormed = gmem_tensor(Uint32, normed, row_major(T, W))
        self.kernel(mIds, mNormWeight, mNormed, regions, control, step, eps, normalize).launch(
            grid=[grid, 1, 1],
            block=[self.warps * WARP_LANES, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

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
        # The dispatch of this call read STATE_CALL = call - 1; the last CTA here stores `call`.
        call = mState[STATE_CALL] + 1
        # What the dispatch of this call found (stream-ordered before this launch).
        dispatch_failed = mState[STATE_STEP_STATUS]
        # Rows computed after a failed dispatch may hold a late peer's half-written input: the
        # ready flag says so, and every rank then marks its output instead of using them.
        status = Int32(STATUS_OK)
        if dispatch_failed != 0 or mState[STATE_ABORT] != 0:
            status = Int32(STATUS_UNUSABLE)
        signal_first_cta(
            regions, control, step, call, PHASE_COMBINE, status, STATE_READY_COMBINE, N, tidx
        )
        # The norm weight, once per CTA into shared memory: read from global memory after the
        # output stores of a token, its loads could not be hoisted above them (the tensors may
        # alias), and a lane's 14 chunks at L = 3584 cost 14 L2 round trips a token.
        smem = SmemAllocator()
        sNormWeight = smem.allocate_tensor(
            Uint32, row_major(1, self.latent // BF16_PER_WORD), byte_alignment=16
        )
        if normalize != 0:
            gNormWeight, gStaged = vectors(mNormWeight), vectors(sNormWeight)
            for c in cutlass.range(tidx, self.chunks, self.warps * WARP_LANES):
                cute.autovec_copy(gNormWeight[(0, None), (0, c)], gStaged[(0, None), (0, c)])
        lane, warp = tidx % LANES, tidx // LANES
        first, stride = bidx * self.warps + warp, grid * self.warps
        # The first token's ids (the caller's, ready since the dispatch): the load is in flight
        # while the CTA waits for the flags.
        rIds = token_ids_tensor(self.topk)
        load_token_ids(mIds, first, T, lane, self.topk, rIds)
        own = receive_regions(regions.own, regions, T * N, self.latent, self.topk, N)
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
        failed = barrier_or(kind | Int32(dispatch_failed != 0))  # also: sNormWeight is filled
        for t in cutlass.range(first, T, stride):
            if failed != 0:
                self.mark_token(mNormed, t, lane)
            else:
                hits = destinations(rIds, self.topk, self.experts_per_rank, N)
                # The next token's ids, in flight with this token's rows (one memory round trip
                # a token instead of two).
                load_token_ids(mIds, t + stride, T, lane, self.topk, rIds)
                self.reduce_token(
                    hits, sNormWeight, mNormed, regions, control.rank, eps, normalize, T, t, lane
                )
        cute.arch.barrier()
        last = Int32(0)
        if tidx == 0:
            last = is_last_cta(control, STATE_DONE_COMBINE, grid)
            if last != 0:
                # Every CTA read STATE_CALL and counted its arrival before it counted itself done.
                mState[STATE_READY_COMBINE] = Int64(0)
                mState[STATE_CALL] = call
        if cutlass.const_expr(N > 1):
            # The last CTA: every read of the peers' rows is done; tell them, and complete only
            # once every rank is done reading this rank's rows (so that anything stream-ordered
            # after this launch may rewrite them). One rank alone reads only its own rows.
            if barrier_or(last) != 0:
                if tidx == 0:
                    cute.arch.fence_acq_rel_sys()
                    signal_all(regions, control, step, call, PHASE_COMBINE_END, STATUS_OK, N)
                cute.arch.barrier()
                if tidx < N:
                    wait_flag(
                        flag_slot(own.flags, PHASE_COMBINE_END, tidx),
                        call << 2,
                        control,
                        PHASE_COMBINE_END,
                        tidx,
                    )

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
    def pull_rows(
        self,
        regions: SymmetricRegions,
        rank: Int32,
        tokens: Int32,
        t: Int32,
        hits: Uint32,
        lane: Int32,
        rH: cute.Tensor,
    ):
        """Token t's row, this lane's chunks: rH[8i + j] = the fp32 sum, in rank order from +0.0,
        of element j of chunk lane + 32i of row rank*T + t in the `out` region of every rank d
        whose bit is set in `hits`. Per rank, the lane loads all its chunks before it adds
        any: a row's loads are in flight together (one memory round trip per rank)."""
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
                    c = lane + LANES * i
                    if c < self.chunks:
                        cute.autovec_copy(gOut[(0, None), (row, c)], rWords[i, None])
                for i in cutlass.range_constexpr(self.chunks_per_lane):
                    if lane + LANES * i < self.chunks:
                        for j in cutlass.range_constexpr(VECTOR_WORDS):
                            k = i * CHUNK + 2 * j
                            rH[k] = add_rn(rH[k], _lo(rWords[i, j]))
                            rH[k + 1] = add_rn(rH[k + 1], _hi(rWords[i, j]))

    @cute.jit
    def lane_sumsq(self, rH: cute.Tensor, lane: Int32) -> Float32:
        """This lane's sum of squares of rH, in chunk and element order."""
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
            # A lane's last chunk may not exist (L not a multiple of 256): its registers hold
            # the +0.0 pull_rows started from, which must not reach the max either way.
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
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            for j in cutlass.range_constexpr(CHUNK):
                rH[i * CHUNK + j] = mul_rn(rH[i * CHUNK + j], scale)
        return mul_rn(mul_rn(eps, scale), scale)

    @cute.jit
    def reduce_token(
        self,
        hits: Uint32,
        sNormWeight: cute.Tensor,
        mNormed: cute.Tensor,
        regions: SymmetricRegions,
        rank: Int32,
        eps: Float32,
        normalize: Int32,
        tokens: Int32,
        t: Int32,
        lane: Int32,
    ):
        """One warp: token t's rank-ordered fp32 sum of the rows pulled from the ranks in `hits`
        (bit d: rank d owns one of its experts), rounded to BF16, then (when `normalize`)
        RMSNorm with the norm weight (sNormWeight, shared memory), to `normed`."""
        L = self.latent
        rH = cute.make_rmem_tensor(cute.make_layout(self.chunks_per_lane * CHUNK), Float32)
        self.pull_rows(regions, rank, tokens, t, hits, lane, rH)
        # The sum rounded to BF16 (kept as fp32: exact), as the reference does before its norm.
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            for j in cutlass.range_constexpr(CHUNK):
                rH[i * CHUNK + j] = bits_f32(bf16_round(rH[i * CHUNK + j]) << 16)
        inv = Float32(1.0)
        if normalize != 0:
            total = self.warp_total(self.lane_sumsq(rH, lane))
            eps_row = eps
            # Squares that overflow (the total is Inf or NaN; the same on every lane): scale the
            # row by a power of two and sum again (docs/design.md, "RMSNorm").
            if (f32_bits(total) & Uint32(0x7F800000)) == Uint32(0x7F800000):
                eps_row = self.rescale(rH, eps, lane)
                total = self.warp_total(self.lane_sumsq(rH, lane))
            inv = div_rn(Float32(1.0), sqrt_rn(add_rn(div_rn(total, Float32(L)), eps_row)))
        rWords = cute.make_rmem_tensor(cute.make_layout(VECTOR_WORDS), Uint32)
        sWeight, gNormed = vectors(sNormWeight), vectors(mNormed)
        for i in cutlass.range_constexpr(self.chunks_per_lane):
            c = lane + LANES * i
            if c < self.chunks:
                if normalize != 0:
                    cute.autovec_copy(sWeight[(0, None), (0, c)], rWords)
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
      (bounded) for every rank's combine flag, and this rank's is stored by the first CTA of
      the launch to start, which is resident by definition (signal_first_cta); the last CTA to
      finish waits for the peers' combine-end flags, after every CTA of its launch is done.
    - Beside other streams (the layer's side stream runs SiTU and the shared down GEMM
      concurrently with the routed path, docs/layer.md): a GEMM's CTAs holding SMs only delay
      the combine CTAs not yet started, and they complete without waiting for the combine. The
      other way, a combine CTA holds its SM while it waits for the slowest rank's flag: with
      the default tuning a CTA at K3's L is 8 warps of 255 registers a thread
      (docs/perf_notes.md), the SM's whole register file, so no GEMM CTA fits beside it, and
      once ceil(T / 8) >= SMs the combine holds every SM from its start until it completes.
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
        self.warps = tuning.combine_warps
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
        """CTAs for T = `tokens`: ceil(T / combine_warps) (one warp a token), at most
        combine_ctas_per_sm an SM when that is > 0 (the warps then loop over the tokens)."""
        grid = -(-tokens // self.warps)
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
