"""DispatchKernel: quantize each token to MXFP8 once and push it to every rank owning one of its
experts (the row contract of docs/design.md), then wait until every source has delivered.
DispatchLaunch: its compile, grid rule and launch (the host side)."""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8, Uint32
from cutlass.memory import SmemAllocator

from dep_ep.comm.kernels.host_params import STREAM, HostParams
from dep_ep.comm.kernels.launch_args import KernelTuning, RankControl, Step, SymmetricRegions
from dep_ep.comm.kernels.launcher import (
    KernelGeometry,
    TransportParams,
    compile_cached,
    placeholder_structs,
)
from dep_ep.comm.kernels.mxfp8_block import BLOCK_WORDS_IN, BLOCK_WORDS_OUT, quantize_block
from dep_ep.comm.kernels.signals import (
    check_own_step,
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
    gmem_tensor,
    peer_base,
    receive_regions,
    row_major_layout,
    state_words,
    vectors,
)
from dep_ep.constants import (
    CTAS_PER_SM,
    DISPATCH_THREADS,
    MAX_RANKS,
    PHASE_DISPATCH,
    SCALE_BLOCK,
    STATE_ABORT,
    STATE_CALL,
    STATE_DONE_DISPATCH,
    STATE_OPEN_CALL,
    STATE_STEP_STATUS,
    STATUS_OK,
    WARP_LANES,
)

WARPS = DISPATCH_THREADS // WARP_LANES
PASS_TOKENS = WARPS  # tokens a CTA takes at a time: one per warp for the ids and weights


class DispatchKernel:
    """Static geometry: num_ranks N (<= 32), latent L, topk K, experts_per_rank. T is runtime.

    Grid: CTAs take contiguous chunks of tokens, PASS_TOKENS at a time. In a pass, warp w takes
    token w of the pass: it finds the token's destination ranks (one load of the ids per lane,
    then a warp OR) and stores the ids row into every rank (-1 for the experts a rank does not
    own) and the weights row into the ranks the token goes to, in 16-byte vectors when K is a
    multiple of 4; lane 0 leaves the destinations in shared memory. After a CTA barrier every
    thread takes (token, block) items of the pass, `blocks_in_flight` at a time: it loads the
    blocks, quantizes each to MXFP8 and stores its 32 bytes (two 16-byte stores) and scale byte
    into every destination. After its tokens the CTA signals (`signal_after_cta`: one fence, the
    last CTA stores this source's step flag (call, T, tag) into every other rank); CTA 0 then
    waits for every other source's flag of this call and checks its T and tag (this rank's own:
    `check_own_step`). A mismatch or a rejecting source is recorded, never waited out. One rank
    alone stores and waits for no flag.

    With `tuning.pdl` (programmatic dependent launch) the kernel waits for the kernels before it
    (griddepcontrol.wait) before it reads anything, and lets the next kernel start its launch
    right away (griddepcontrol.launch_dependents); a dependent kernel still waits for this grid
    to complete before it reads.
    """

    def __init__(
        self, num_ranks: int, latent: int, topk: int, experts_per_rank: int, tuning: KernelTuning
    ):
        assert 1 <= num_ranks <= MAX_RANKS and latent % SCALE_BLOCK == 0
        self.num_ranks, self.latent, self.topk = num_ranks, latent, topk
        self.pdl, self.blocks_in_flight = tuning.pdl, tuning.dispatch_blocks_in_flight
        self.experts_per_rank = experts_per_rank
        self.blocks_per_row = latent // SCALE_BLOCK
        self.id_vector = id_vector(topk)
        self.id_groups = topk // self.id_vector  # id vectors per row

    @cute.jit
    def __call__(
        self,
        latent: Int64,
        latent_row_words: Int32,
        ids: Int64,
        weights: Int64,
        regions: SymmetricRegions,
        control: RankControl,
        step: Step,
        grid: Int32,
        stream: cuda.CUstream,
    ):
        """latent: bf16 [T, L] whose rows start `latent_row_words` 32-bit words apart (L / 2 for
        a contiguous latent; more for a column slice of a wider GEMM output; a multiple of 4, so
        every row starts on a 16-byte boundary); rows of tokens without an expert are never
        read. ids: int32 [T, K] (-1 = none), weights: fp32 [T, K], both 16-byte aligned."""
        T, L, K = step.tokens, self.latent, self.topk
        mLatent = gmem_tensor(
            Uint32,
            latent,
            cute.make_layout((T, L // BF16_PER_WORD), stride=(latent_row_words, 1)),
        )
        mIds = gmem_tensor(Int32, ids, row_major_layout((T, K)))
        mWeights = gmem_tensor(Uint32, weights, row_major_layout((T, K)))
        self.kernel(mLatent, mIds, mWeights, regions, control, step).launch(
            grid=[grid, 1, 1],
            block=[DISPATCH_THREADS, 1, 1],
            max_number_threads=[DISPATCH_THREADS, 1, 1],
            min_blocks_per_mp=CTAS_PER_SM,
            preferred_smem_carveout=MAX_L1_CARVEOUT,
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(
        self,
        mLatent: cute.Tensor,
        mIds: cute.Tensor,
        mWeights: cute.Tensor,
        regions: SymmetricRegions,
        control: RankControl,
        step: Step,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        N, L, K, NB = self.num_ranks, self.latent, self.topk, self.blocks_per_row
        T = step.tokens
        rows = T * N
        warp, lane = tidx // WARP_LANES, tidx % WARP_LANES
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        smem = SmemAllocator()
        sHits = smem.allocate_tensor(Uint32, cute.make_layout(PASS_TOKENS), byte_alignment=16)
        gLatent = vectors(mLatent, BLOCK_WORDS_IN)  # ((1, 16), (T, NB)): one block each
        rIn = cute.make_rmem_tensor(
            cute.make_layout((self.blocks_in_flight, BLOCK_WORDS_IN), stride=(BLOCK_WORDS_IN, 1)),
            Uint32,
        )
        rOut = cute.make_rmem_tensor(cute.make_layout(BLOCK_WORDS_OUT), Uint32)
        mState = state_words(control)
        call = mState[STATE_CALL] + 1  # combine stores it when the call is done
        if cutlass.const_expr(N == 1):
            # One CTA: nothing in this launch reads the word (stores of every CTA to one address
            # cost the launch of 1024 CTAs 0.4 us, bench_ep at T = 1024, one H200).
            if bidx == 0 and tidx == 0:
                mState[STATE_OPEN_CALL] = call
        # The abort word, for this rank's own step check at the end (check_own_step), loaded
        # here, off the launch's tail.
        aborted = Int64(0)
        if bidx == 0 and tidx == control.rank:
            aborted = mState[STATE_ABORT]
        t_begin, t_end = chunk_begin(T, bidx, grid), chunk_end(T, bidx, grid)
        for t0 in cutlass.range(t_begin, t_end, PASS_TOKENS):
            if t0 + warp < t_end:  # the whole warp: send_ids reduces over its lanes
                hits = self.send_ids(mIds, mWeights, t0 + warp, lane, regions, control.rank, T)
                if lane == 0:
                    sHits[warp] = hits
            cute.arch.barrier()
            items = cutlass.min(t_end - t0, PASS_TOKENS) * NB
            for first in cutlass.range(tidx, items, DISPATCH_THREADS * self.blocks_in_flight):
                for u in cutlass.range_constexpr(self.blocks_in_flight):
                    item = first + u * DISPATCH_THREADS
                    if item < items:
                        # A token with no expert (padding) is never read: its row may not exist.
                        if sHits[item // NB] != 0:
                            cute.autovec_copy(
                                gLatent[(0, None), (t0 + item // NB, item % NB)], rIn[u, None]
                            )
                for u in cutlass.range_constexpr(self.blocks_in_flight):
                    item = first + u * DISPATCH_THREADS
                    if item < items:
                        hits = sHits[item // NB]
                        if hits != 0:
                            scale = quantize_block(rIn[u, None], rOut)
                            row = control.rank * T + t0 + item // NB  # receive row, every rank
                            for d in cutlass.range_constexpr(N):
                                if (hits >> d) & 1:
                                    # The base is loaded where it is used (an L1 hit): kept for
                                    # every rank across the loop it took 40 more registers at
                                    # N = 8 and cost the grid its one wave.
                                    dst = receive_regions(
                                        peer_base(regions, d, N), regions, rows, L, K, N
                                    )
                                    gX = vectors(dst.x, BLOCK_WORDS_OUT)
                                    cute.autovec_copy(rOut, gX[(0, None), (row, item % NB)])
                                    dst.sf[row, item % NB] = Uint8(scale)
            cute.arch.barrier()  # sHits is rewritten by the next pass
        if bidx == 0 and tidx == 0:
            mState[STATE_STEP_STATUS] = Int64(0)  # read only after the barrier below
        signal_after_cta(
            regions, control, step, call, PHASE_DISPATCH, STATE_DONE_DISPATCH, N, tidx, grid
        )
        if bidx == 0 and tidx < N:
            if tidx == control.rank:
                # This rank's own flag would say STATUS_OK, this call, this T and tag.
                check_own_step(Int32(STATUS_OK), aborted, call, control, PHASE_DISPATCH)
            else:
                own = receive_regions(regions.own, regions, rows, L, K, N)
                check_step(
                    flag_slot(own.flags, PHASE_DISPATCH, tidx),
                    call,
                    step,
                    control,
                    PHASE_DISPATCH,
                    tidx,
                    True,
                )

    @cute.jit
    def send_ids(
        self,
        mIds: cute.Tensor,
        mWeights: cute.Tensor,
        t: Int32,
        lane: Int32,
        regions: SymmetricRegions,
        rank: Int32,
        tokens: Int32,
    ) -> Uint32:
        """One warp, token t: store its ids row into every rank (-1 for the experts a rank
        does not own) and its weights row into the ranks it goes to; return (on every lane) the
        mask of those ranks. Lane q takes (destination, id vector) pairs q, q + 32, ..."""
        N, L, K = self.num_ranks, self.latent, self.topk
        V, G = self.id_vector, self.id_groups
        gIds, gWeights = vectors(mIds, V), vectors(mWeights, V)  # ((1, V), (T, K / V))
        rIds = cute.make_rmem_tensor(cute.make_layout(V), Int32)
        rWeights = cute.make_rmem_tensor(cute.make_layout(V), Uint32)
        rMine = cute.make_rmem_tensor(cute.make_layout(V), Int32)
        hits = token_destinations(mIds, t, lane, K, self.experts_per_rank, N)
        row = rank * tokens + t
        for p in cutlass.range_constexpr((N * G + WARP_LANES - 1) // WARP_LANES):
            q = lane + WARP_LANES * p
            if q < N * G:
                d, g = q // G, q % G
                cute.autovec_copy(gIds[(0, None), (t, g)], rIds)
                for i in cutlass.range_constexpr(V):
                    rMine[i] = Int32(-1)
                    if rIds[i] >= 0 and rIds[i] // self.experts_per_rank == d:
                        rMine[i] = rIds[i]
                dst = receive_regions(peer_base(regions, d, N), regions, tokens * N, L, K, N)
                cute.autovec_copy(rMine, vectors(dst.ids, V)[(0, None), (row, g)])
                if (hits >> Uint32(d)) & 1:
                    cute.autovec_copy(gWeights[(0, None), (t, g)], rWeights)
                    cute.autovec_copy(rWeights, vectors(dst.weights, V)[(0, None), (row, g)])
        return hits


class DispatchLaunch:
    """DispatchKernel's launch, for one geometry and one transport: its compile (cached per
    geometry, tuning and arch), its grid rule, its launch parameters in HostParams written in
    place, and the launch.

    Constraints (stated here once; the callers that check them are named):
    - Geometry: KernelGeometry's bounds (L a multiple of SCALE_BLOCK asserted by
      DispatchKernel).
    - T: 1 <= T <= max_tokens (EpRouted, check_tokens; T = 0 would be an empty grid, which CUDA
      refuses). Every rank launches the call with the same T and tag (a difference is recorded,
      never waited out).
    - Tensors: latent bf16 [n, L], n <= T, 16-byte aligned, its rows 16 bytes apart (its row
      stride a multiple of 8 elements; contiguous or a column slice); ids int32 [T, K] and
      weights fp32 [T, K] contiguous, 16-byte aligned. The latent row of a token without an
      expert (ids all -1: the padding tokens n..T-1) is never read.
    - Stream order: the writers of latent, ids and weights, and this rank's previous call (its
      combine or RejectKernel: the dispatch reads the call index it stored), come before the
      launch on its stream. With `tuning.pdl` the kernel may start while the kernel before it
      finishes; it waits for that grid (griddepcontrol.wait) before it reads anything.
    - Co-residency: none needed. CTA 0 waits (bounded) for every other source's dispatch flag,
      not for this rank's own (`check_own_step`), so no CTA waits for another of its launch:
      they run on whatever SM slots are free, in several waves if need be, and only CTA 0 holds
      a slot while it waits.
    - Beside other streams (the layer's side stream runs SiTU and the shared down GEMM
      concurrently with the routed path, docs/layer.md): a GEMM's CTAs holding SMs only
      delay the dispatch CTAs not yet started; they complete without waiting for the dispatch,
      so the dispatch completes. What the grid rule guarantees: at most CTAS_PER_SM x SMs CTAs
      in all, and the kernel is compiled so that CTAS_PER_SM fit on an SM (its launch bounds),
      so on an otherwise idle GPU the grid is one wave. This holds while the kernels beside it
      complete without waiting for this rank's dispatch or combine (a collective of another
      stream or another transport that waits for a peer can wait, in the worst case, for a
      peer whose dispatch waits for this one).
    - A kernel launched after it with programmatic dependent launch (with `tuning.pdl`) can
      start only once every dispatch CTA has run its griddepcontrol.launch_dependents (among the
      kernel's first instructions): every dispatch CTA then holds a slot or is done, so the
      dependent's waiting CTAs cannot keep a dispatch CTA from starting.
    """

    NAME = "dispatch"

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
        self.max_ctas = CTAS_PER_SM * num_sms
        # The call's tensors' addresses, the latent's row stride (32-bit words), the step, the
        # grid and the stream: written at each launch.
        self.latent, self.ids, self.weights = (
            HostParams(Int64),
            HostParams(Int64),
            HostParams(Int64),
        )
        self.latent_row_words = HostParams(Int32)
        self.step = HostParams(*(f.type for f in dataclasses.fields(Step)))
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
            kernel = DispatchKernel(
                geometry.num_ranks,
                geometry.latent,
                geometry.topk,
                geometry.experts_per_rank,
                tuning,
            )
            z = Int64(0)
            # latent, its row stride in words, ids, weights, the structs, the grid
            args = (z, Int32(geometry.latent // 2), z, z, *placeholder_structs(), Int32(1))
            return kernel, args

        return compile_cached(geometry, DispatchLaunch.NAME, arch, tuning, build, keep_ptx_dir)

    def grid(self, tokens: int) -> int:
        """CTAs for T = `tokens`: one a token, at most CTAS_PER_SM an SM (one wave)."""
        return min(tokens, self.max_ctas)

    def __call__(self, latent, ids, weights, tokens: int, tag: int, stream: int) -> None:
        """Launch on `stream` (a CUstream handle) the dispatch of T = `tokens` with `tag`:
        latent bf16 [n <= T, L], ids int32 [T, K], weights fp32 [T, K] (torch tensors on this
        rank's GPU, as the class's constraints say)."""
        row_words = latent.stride(0) // 2 if latent.shape[0] > 1 else latent.shape[1] // 2
        self.compiled(
            self.latent.set(latent.data_ptr()),
            self.latent_row_words.set(row_words),
            self.ids.set(ids.data_ptr()),
            self.weights.set(weights.data_ptr()),
            self.transport.regions,
            self.transport.control,
            self.step.set(tokens, tag),
            self.grid_size.set(self.grid(tokens)),
            self.stream.set(stream),
        )
