"""What a step of dep_ep needs from vLLM's forward context: the step's common token count T and
vLLM's padding mask (EpRouted's `padding=`: those rows reach no rank). Both read vLLM 0.33.0's
ForwardContext (`dp_metadata`, `is_padding`) and DPMetadata (`num_tokens_across_dp_cpu`,
`local_sizes`) as docs/integrations.md ("vLLM") describes them; the arithmetic is
dep_ep.integrations.common's."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from dep_ep.integrations.common import common_tokens


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


class _StepTokens(NamedTuple):
    """T of the last forward's steps and what it was computed from: that forward's DPMetadata
    (held: while this entry lives no other object has its address), its `local_sizes` list at
    the time and the sequence-parallel width."""

    dp: object
    local: object
    sequence_parallel: int
    tokens: int


# The last forward's T: every MoE layer of a forward reads the same DPMetadata, which vLLM makes
# anew for each forward (DPMetadata.make) and never writes in place; only `local_sizes` is set
# and cleared inside one (sp_local_sizes, a new list each time). Reading the counts again took
# 2.7 us a layer call on the slower of two H200 machines' hosts.
_LAST_TOKENS: _StepTokens | None = None


def step_tokens(context: Any | None, rows: int, sequence_parallel: int = 1) -> int:
    """T, the token count every EP rank passes for this step (>= 1), from the forward context:

    - no context or no `dp_metadata` (DP = 1: every EP rank holds the same rows, sp_shard's
      chunks included): `rows` (this rank's), at least 1;
    - `dp_metadata.local_sizes` set (inside DPMetadata.sp_local_sizes, as vLLM's generic MoE
      runner enters it): the largest of those per-rank sizes;
    - else the largest ceil(n / sequence_parallel) over `num_tokens_across_dp_cpu` (int [DP],
      on the host: eager steps hold each DP rank's own count, CUDA-graph steps the padded one).

    The later layers of a forward get the first one's T (the same DPMetadata and local_sizes
    objects and sequence_parallel). A T that counts written in place would give differently
    could not pass silently: the ranks' T disagree (EpTokenCountError on every rank) or a
    rank's rows exceed it (ValueError, the step rejected on every rank)."""
    global _LAST_TOKENS
    dp = None if context is None else context.dp_metadata
    if dp is None:
        return max(int(rows), 1)
    local = getattr(dp, "local_sizes", None)
    last = _LAST_TOKENS
    if (
        last is not None
        and last.dp is dp
        and last.local is local
        and last.sequence_parallel == sequence_parallel
    ):
        return last.tokens
    if local is not None:
        tokens = common_tokens(local)
    else:
        tokens = common_tokens(dp.num_tokens_across_dp_cpu.tolist(), sequence_parallel)
    _LAST_TOKENS = _StepTokens(dp, local, sequence_parallel, tokens)
    return tokens


def padding_mask(context: Any | None) -> torch.Tensor | None:
    """The context's `is_padding` (bool [>= rows], True for padding), for EpRouted's `padding=`:
    vLLM keeps it in a persistent buffer, so a captured graph reads the live mask at each
    replay, and EpRouted applies it where it stages the ids (no launch of its own). None
    without a context or a mask."""
    return None if context is None else context.is_padding
