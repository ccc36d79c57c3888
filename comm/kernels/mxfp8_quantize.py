"""Mxfp8QuantizeKernel: BF16 [rows, L] -> MXFP8 bytes [rows, L] + E8M0 scales [rows, L/32].

Used by the tests (bit-exact against comm/mxfp8.py) and the benchmark; dispatch quantizes
in-kernel with the same device function (comm/kernels/mxfp8_block.py).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8, Uint32

from dep_ep.comm.kernels.mxfp8_block import BLOCK_WORDS_IN, BLOCK_WORDS_OUT, quantize_block
from dep_ep.comm.kernels.tensors import (
    BF16_PER_WORD,
    E4M3_PER_WORD,
    gmem_tensor,
    row_major,
    vectors,
)
from dep_ep.constants import SCALE_BLOCK

THREADS = 128


class Mxfp8QuantizeKernel:
    """One CTA per row; thread j quantizes the row's blocks j, j+THREADS, ... (L is static)."""

    def __init__(self, latent: int):
        assert latent % SCALE_BLOCK == 0
        self.latent = latent
        self.blocks_per_row = latent // SCALE_BLOCK

    @cute.jit
    def __call__(self, src: Int64, q: Int64, sf: Int64, rows: Int32, stream: cuda.CUstream):
        """src: bf16 [rows, L]; q: uint8 [rows, L] (e4m3 bytes); sf: uint8 [rows, L/32] (E8M0);
        src and q 16-byte aligned."""
        L = self.latent
        mSrc = gmem_tensor(Uint32, src, row_major(rows, L // BF16_PER_WORD))
        mQ = gmem_tensor(Uint32, q, row_major(rows, L // E4M3_PER_WORD))
        mSf = gmem_tensor(Uint8, sf, row_major(rows, self.blocks_per_row), align=1)
        self.kernel(mSrc, mQ, mSf).launch(grid=[rows, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mSrc: cute.Tensor, mQ: cute.Tensor, mSf: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        gSrc, gQ = vectors(mSrc, BLOCK_WORDS_IN), vectors(mQ, BLOCK_WORDS_OUT)
        rIn = cute.make_rmem_tensor(cute.make_layout(BLOCK_WORDS_IN), Uint32)
        rOut = cute.make_rmem_tensor(cute.make_layout(BLOCK_WORDS_OUT), Uint32)
        for b in cutlass.range(tidx, self.blocks_per_row, THREADS):
            cute.autovec_copy(gSrc[(0, None), (row, b)], rIn)
            scale = quantize_block(rIn, rOut)
            cute.autovec_copy(rOut, gQ[(0, None), (row, b)])
            mSf[row, b] = Uint8(scale)
