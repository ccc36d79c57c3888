"""What a step of dep_ep needs from vLLM's forward context: the step's common token count T and
the ids with vLLM's padding rows made "no expert". Both read vLLM 0.33.0's ForwardContext
(`dp_metadata`, `is_padding`) and DPMetadata (`num_tokens_across_dp_cpu`, `local_sizes`) as
docs/integrations.md ("vLLM") describes them; the arithmetic is dep_ep.integrations.common's."""

from __future__ import annotations

from typing import Any

import torch

from dep_ep.integrations.common import common_tokens, padding_to_no_expert


def sequence_parallel_size(parallel_config: Any) -> int:
    """The ranks one data-parallel rank's tokens are split over in Kimi K3's MoE layers: vLLM
    0.33.0's KimiLinearModel shards the tokens over the TP ranks (`sp_shard`: padded to a
    multiple of TP, ceil(n / TP) rows each) when PP = 1, expert parallelism is on, TP > 1 and
    the MoE backend is deep_gemm_mega_moe (the only one this adapter replaces) or DP > 1; else 1.
    `parallel_config`: vLLM's ParallelConfig (pipeline_parallel_size, tensor_parallel_size,
    enable_expert_parallel)."""
    tp = int(parallel_config.tensor_parallel_size)
    sharded = (
        int(parallel_config.pipeline_parallel_size) == 1
        and bool(parallel_config.enable_expert_parallel)
        and tp > 1
    )
    return tp if sharded else 1


def step_tokens(context: Any | None, rows: int, sequence_parallel: int = 1) -> int:
    """T, the token count every EP rank passes for this step (>= 1), from the forward context:

    - no context or no `dp_metadata` (DP = 1: every EP rank holds the same rows, sp_shard's
      chunks included): `rows` (this rank's), at least 1;
    - `dp_metadata.local_sizes` set (inside DPMetadata.sp_local_sizes, as vLLM's generic MoE
      runner enters it): the largest of those per-rank sizes;
    - else the largest ceil(n / sequence_parallel) over `num_tokens_across_dp_cpu` (int [DP],
      on the host: eager steps hold each DP rank's own count, CUDA-graph steps the padded one).
    """
    dp = None if context is None else context.dp_metadata
    if dp is None:
        return max(int(rows), 1)
    local = getattr(dp, "local_sizes", None)
    if local is not None:
        return common_tokens(local)
    return common_tokens(dp.num_tokens_across_dp_cpu.tolist(), sequence_parallel)


def no_expert_ids(context: Any | None, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """ids int32|int64 [rows, K] with the rows the context's `is_padding` (bool [>= rows], True
    for padding; vLLM keeps it in a persistent buffer, so a captured graph reads the live mask)
    marks set to -1: padding rows reach no rank. No context or no mask: the ids as they are."""
    mask = None if context is None else context.is_padding
    return padding_to_no_expert(ids, mask, rows)
