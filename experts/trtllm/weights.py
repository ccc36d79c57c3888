"""Checkpoint-layout MXFP4 experts -> the weight layout of FlashInfer's trtllm-gen MoE kernels.

docs/formats.md: FC1 rows go [up (w3); gate (w1)] (the checkpoint has [w1; w3]), are reordered for
the gated GEMM (up and gate rows alternate) and shuffled for the epilogue tile (epilogue_tile_m =
128); FC2 rows are shuffled the same way. Scale rows follow their weight rows and are then
interleaved into the kernels' 128x4 layout. Every permutation comes from FlashInfer's own helpers
(flashinfer.utils / flashinfer.fused_moe.core), the same chain as FlashInfer's
`prepare_trtllm_fp4_weights` and `shuffle_matrix_sf_a`, one expert at a time.

The permutations are plain torch and run anywhere; the interleave is FlashInfer's
`block_scale_interleave`, a CUDA kernel JIT-compiled at first use. `interleave` can be replaced
(tests pass a torch model of the 128x4 layout to check the row order on a CPU).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from dep_ep.experts.weights import ExpertWeights, expect_expert_weights

EPILOGUE_TILE_M = 128  # trtllm-gen's epilogue tile; its shuffle moves rows in blocks of 32
MXFP4_ALIGNMENT = 128  # L and I of FlashInfer's MXFP4 MoE kernels
FLASHINFER_PIP = "pip install 'dep-ep[trtllm]' (flashinfer-python)"


def import_flashinfer():
    """The flashinfer module, or ImportError saying how to install it."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as err:
        raise ImportError(f"TrtllmExperts needs FlashInfer: {FLASHINFER_PIP} ({err})") from err


@dataclass
class TrtllmWeights:
    """Prepared weights (E_local experts, latent L, intermediate I).

    gemm1_weights uint8 [E_local, 2I, L/2], gemm1_weights_scale float8_e4m3fn view of E8M0 bytes
    [E_local, 2I, L/32] (128x4 layout), gemm2_weights uint8 [E_local, L, I/2],
    gemm2_weights_scale float8_e4m3fn [E_local, L, I/32] (128x4 layout).
    """

    gemm1_weights: torch.Tensor
    gemm1_weights_scale: torch.Tensor
    gemm2_weights: torch.Tensor
    gemm2_weights_scale: torch.Tensor


def up_gate_order(w13: torch.Tensor) -> torch.Tensor:
    """[..., 2I, C] rows [w1 (gate); w3 (up)] -> rows [w3 (up); w1 (gate)] (the kernels' FC1)."""
    inter = w13.shape[-2] // 2
    return torch.cat((w13[..., inter:, :], w13[..., :inter, :]), dim=-2)


def fc1_row_order(rows: int, cols: int) -> torch.Tensor:
    """int64 [2I]: source row (of [up; gate]) of each prepared FC1 row: FlashInfer's gated-GEMM
    reorder followed by its epilogue-tile shuffle."""
    core = importlib.import_module("flashinfer.fused_moe.core")
    utils = importlib.import_module("flashinfer.utils")
    shape_only = torch.empty(rows, cols, dtype=torch.uint8)
    gated = core.get_reorder_rows_for_gated_act_gemm_row_indices(shape_only)
    return gated[utils.get_shuffle_matrix_a_row_indices(shape_only, EPILOGUE_TILE_M)]


def fc2_row_order(rows: int, cols: int) -> torch.Tensor:
    """int64 [L]: source row of each prepared FC2 row (FlashInfer's epilogue-tile shuffle)."""
    utils = importlib.import_module("flashinfer.utils")
    shape_only = torch.empty(rows, cols, dtype=torch.uint8)
    return utils.get_shuffle_matrix_a_row_indices(shape_only, EPILOGUE_TILE_M)


def prepare_trtllm_weights(
    weights: ExpertWeights,
    *,
    interleave: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> TrtllmWeights:
    """The checkpoint layout (an ExpertWeights, experts/weights.py) -> TrtllmWeights on the
    weights' device. `interleave(sf uint8 [rows, cols]) -> uint8 [rows * cols]` defaults to
    FlashInfer's block_scale_interleave (CUDA). L and I must be multiples of 128 (FlashInfer's
    MXFP4 alignment: whole 128-row epilogue tiles, whole 4-column scale tiles)."""
    expect_expert_weights("prepare_trtllm_weights", weights)
    fi = import_flashinfer()  # also the index helpers below: fail early if it is missing
    if interleave is None:
        interleave = fi.block_scale_interleave
    w13, s13, w2, s2 = weights.tensors
    num_local, two_i, _ = w13.shape
    latent = w2.shape[1]
    for name, size in (("L", latent), ("I", two_i // 2)):
        if size % MXFP4_ALIGNMENT:
            raise ValueError(
                f"prepare_trtllm_weights: {name}={size}; FlashInfer's MXFP4 kernels need a"
                f" multiple of {MXFP4_ALIGNMENT}"
            )
    device = w13.device
    order1 = fc1_row_order(two_i, w13.shape[2]).to(device)
    order2 = fc2_row_order(latent, w2.shape[2]).to(device)
    w13_up_gate, s13_up_gate = up_gate_order(w13), up_gate_order(s13)
    g1w, g1s, g2w, g2s = [], [], [], []
    for e in range(num_local):
        g1w.append(w13_up_gate[e][order1])
        g1s.append(interleave(s13_up_gate[e][order1].contiguous()).view(s13.shape[1:]))
        g2w.append(w2[e][order2])
        g2s.append(interleave(s2[e][order2].contiguous()).view(s2.shape[1:]))
    return TrtllmWeights(
        gemm1_weights=torch.stack(g1w),
        gemm1_weights_scale=torch.stack(g1s).view(torch.float8_e4m3fn),
        gemm2_weights=torch.stack(g2w),
        gemm2_weights_scale=torch.stack(g2s).view(torch.float8_e4m3fn),
    )
