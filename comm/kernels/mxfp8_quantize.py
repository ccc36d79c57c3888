"""Mxfp8QuantizeKernel: BF16 [rows, L] -> MXFP8 bytes [rows, L] + E8M0 scales [rows, L/32].

Used by the tests (bit-exact against comm/mxfp8.py) and the benchmark, through
Mxfp8QuantizeLaunch; dispatch quantizes in-kernel with the same device function
(comm/kernels/mxfp8_block.py).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8, Uint32

from dep_ep.comm.kernels.launcher import compile_kernel
from dep_ep.comm.kernels.mxfp8_block import BLOCK_WORDS_IN, BLOCK_WORDS_OUT, quantize_block
from dep_ep.comm.kernels.tensors import (
    BF16_PER_WORD,
    E4M3_PER_WORD,
    gmem_tensor,
    row_major_layout,
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
        mSrc = gmem_tensor(Uint32, src, row_major_layout((rows, L // BF16_PER_WORD)))
        mQ = gmem_tensor(Uint32, q, row_major_layout((rows, L // E4M3_PER_WORD)))
        mSf = gmem_tensor(Uint8, sf, row_major_layout((rows, self.blocks_per_row)), align=1)
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


class Mxfp8QuantizeLaunch:
    """Mxfp8QuantizeKernel's launch for one latent width L: its compile (not cached: the tests
    and the benchmark compile it once each) and its launch.

    Constraints (stated here once): L a multiple of SCALE_BLOCK (asserted by the kernel);
    rows >= 1 (the grid is one CTA a row; an empty grid is refused by CUDA); src bf16
    [rows, L] and q uint8 [rows, L] contiguous and 16-byte aligned, sf uint8 [rows, L / 32]
    contiguous. The writers of src come before the launch on its stream. No CTA waits for
    another: no co-residency, and kernels beside it only delay it.
    """

    def __init__(self, latent: int, arch: str | None = None):
        """Compile for `arch` (None: this process's GPU)."""
        self.latent = latent
        z = Int64(0)
        self.compiled = compile_kernel(
            lambda: (Mxfp8QuantizeKernel(latent), (z, z, z, Int32(1))), arch
        )

    @staticmethod
    def grid(rows: int) -> int:
        """CTAs for `rows` rows: one a row."""
        return rows

    def __call__(self, src, q, sf, stream: int) -> None:
        """Launch on `stream` (a CUstream handle): src bf16 [rows, L] -> q uint8 [rows, L]
        (e4m3 bytes), sf uint8 [rows, L / 32] (E8M0), torch tensors on this process's GPU.
        ValueError for another L (the kernel would read its rows at its own width)."""
        if src.dim() != 2 or src.shape[1] != self.latent:
            shape, latent = tuple(src.shape), self.latent
            raise ValueError(
                f"Mxfp8QuantizeLaunch: src shape {shape}; compiled for [rows, {latent}]"
            )
        self.compiled(
            src.data_ptr(),
            q.data_ptr(),
            sf.data_ptr(),
            self.grid(src.shape[0]),
            cuda.CUstream(stream),
        )
