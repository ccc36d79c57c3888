"""The kernels' global-memory tensors: views made from a base address and a layout, one rank's
receive regions, and pointers to single words for the accesses that carry a memory order.

Bulk data is viewed in 32-bit words (bf16 pairs, e4m3 quads, fp32 bits): the kernels copy and
bit-manipulate it, and a 16-byte vector is 4 words whatever the element type.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8, Uint32

from dep_ep.comm.kernels.launch_args import RankControl, SymmetricRegions
from dep_ep.constants import (
    ERROR_WORDS,
    FLAG_PHASES,
    FLAG_WORDS,
    SCALE_BLOCK,
    STATE_WORDS,
    VECTOR_BYTES,
)

WORD_BYTES = 4
VECTOR_WORDS = VECTOR_BYTES // WORD_BYTES
BF16_PER_WORD = 2
E4M3_PER_WORD = 4
# Shared-memory carveout of the kernels that use a few hundred bytes of it: 0 % (the most L1,
# for the ids and peer bases every thread reads). Naming it also spares CuTeDSL a device query
# at compile time, so the kernels compile on a machine without a GPU.
MAX_L1_CARVEOUT = 0


def gmem_tensor(dtype, address: Int64, layout, align: int = VECTOR_BYTES) -> cute.Tensor:
    """The global memory at `address` (aligned to `align` bytes) as a tensor of `layout`."""
    ptr = cute.make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)
    return cute.make_tensor(ptr, layout)


def row_major_layout(shape: tuple) -> cute.Layout:
    """`shape` with the strides of a row-major array: (rows, cols):(cols, 1) in two dimensions.
    The first extent may be a runtime value."""
    strides, stride = [], 1
    for extent in reversed(shape[1:]):
        strides.append(stride)
        stride *= extent
    strides.append(stride)
    return cute.make_layout(shape, stride=tuple(reversed(strides)))


def element_ptr(tensor: cute.Tensor, coord) -> cute.Pointer:
    """The address of one element, for loads, stores and atomics with a memory order."""
    return tensor.iterator + cute.crd2idx(coord, tensor.layout)


def vectors(tensor: cute.Tensor, words: int = VECTOR_WORDS) -> cute.Tensor:
    """A row-major word tensor [rows, W] cut into vectors of `words` along the row:
    ((1, words), (rows, W / words)); element ((0, None), (r, c)) is vector c of row r."""
    return cute.zipped_divide(tensor, (1, words))


class ReceiveRegions(NamedTuple):
    """One rank's receive regions (comm/layout.py EpLayout) for `rows` = N * T receive rows;
    row s*T + t holds token t of source rank s."""

    x: cute.Tensor  # Uint32 [rows, L/4]: MXFP8 e4m3 bytes, four to a word
    sf: cute.Tensor  # Uint8 [rows, L/32]: E8M0 scale bytes
    ids: cute.Tensor  # Int32 [rows, K]: global ids this rank owns, -1 elsewhere
    weights: cute.Tensor  # Uint32 [rows, K]: fp32 routing weights, as bits (only copied)
    out: cute.Tensor  # Uint32 [rows, L/2]: bf16 pairs, this rank's expert sum for row s*T + t
    flags: cute.Tensor  # Int64 [FLAG_PHASES, N, FLAG_WORDS]: step flags per phase and source


def receive_regions(
    base: Int64, regions: SymmetricRegions, rows: Int32, latent: int, topk: int, num_ranks: int
) -> ReceiveRegions:
    """The receive regions of the symmetric allocation at `base` (this rank's or a peer's)."""
    return ReceiveRegions(
        x=gmem_tensor(Uint32, base + regions.x, row_major_layout((rows, latent // E4M3_PER_WORD))),
        sf=gmem_tensor(Uint8, base + regions.sf, row_major_layout((rows, latent // SCALE_BLOCK))),
        ids=gmem_tensor(Int32, base + regions.ids, row_major_layout((rows, topk))),
        weights=gmem_tensor(Uint32, base + regions.weights, row_major_layout((rows, topk))),
        out=gmem_tensor(
            Uint32, base + regions.out, row_major_layout((rows, latent // BF16_PER_WORD))
        ),
        flags=flag_slots(base, regions, num_ranks),
    )


def flag_slots(base: Int64, regions: SymmetricRegions, num_ranks: int) -> cute.Tensor:
    """Int64 [FLAG_PHASES, N, FLAG_WORDS]: the step flags of the allocation at `base`."""
    layout = cute.make_layout(
        (FLAG_PHASES, num_ranks, FLAG_WORDS), stride=(num_ranks * FLAG_WORDS, FLAG_WORDS, 1)
    )
    return gmem_tensor(Int64, base + regions.flags, layout)


def peer_base(regions: SymmetricRegions, rank, num_ranks: int) -> Int64:
    """The allocation base of `rank` (a load from the device array of every rank's base)."""
    mPeers = gmem_tensor(Int64, regions.peers, cute.make_layout(num_ranks), align=8)
    return mPeers[rank]


def state_words(control: RankControl) -> cute.Tensor:
    """Int64 [STATE_WORDS]: this rank's device state (constants.STATE_*)."""
    return gmem_tensor(Int64, control.state, cute.make_layout(STATE_WORDS), align=8)


def error_words(control: RankControl) -> cute.Tensor:
    """Int64 [ERROR_WORDS]: this rank's host-mapped error record (constants.ERROR_*)."""
    return gmem_tensor(Int64, control.error, cute.make_layout(ERROR_WORDS), align=8)
