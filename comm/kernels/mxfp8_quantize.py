"""Mxfp8QuantizeKernel: BF16 [rows, L] -> MXFP8 bytes [rows, L] + E8M0 scales [rows, L/32].

Used by the tests (bit-exact against comm/mxfp8.py) and the benchmark; dispatch quantizes
in-kernel with the same device function (comm/kernels/mxfp8_block.py).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8

from dep_ep.comm.kernels.mxfp8_block import BLOCK_WORDS_OUT, gmem_words, quantize_block
from dep_ep.constants import SCALE_BLOCK


class Mxfp8QuantizeKernel:
    """One CTA per row; thread j quantizes the row's blocks j, j+threads, ... (L is static)."""

    def __init__(self, latent: int, threads: int = 128):
        self.latent, self.threads = latent, threads
        self.blocks_per_row = latent // SCALE_BLOCK

    @cute.jit
    def __call__(self, src: Int64, q: Int64, sf: Int64, rows: Int32, stream: cuda.CUstream):
        self.kernel(src, q, sf, rows).launch(grid=[rows, 1, 1], block=[self.threads, 1, 1],
                                             stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(self, src: Int64, q: Int64, sf: Int64, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        nb = self.blocks_per_row
        rOut = cute.make_rmem_tensor(cute.make_layout(BLOCK_WORDS_OUT), cutlass.Uint32)
        for b in cutlass.range(tidx, nb, self.threads):
            block = Int64(row) * nb + b
            scale = quantize_block(src + block * 64, rOut)
            cute.autovec_copy(rOut, gmem_words(q + block * 32, BLOCK_WORDS_OUT))
            ptr = cute.make_ptr(Uint8, sf + block, cute.AddressSpace.gmem)
            cute.arch.store(ptr.llvm_ptr, Uint8(scale))
