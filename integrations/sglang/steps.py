"""What one MoE step under SGLang takes from the engine's per-forward state, for the Kimi K3 hook
and the dispatcher alike: the common token count T, the routing as EpRouted takes it, and the
padding rows turned into "no expert"."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dep_ep.integrations.common import common_tokens, padding_to_no_expert
from dep_ep.integrations.sglang.engine import SglangEngine


def step_tokens(counts: Sequence[int] | None, attn_tp_size: int, rows: int) -> int:
    """T of a step, SGLang's rule (its FlashInfer all-to-all's, whose buffers are shaped like
    ours): with every data-parallel rank's count (`get_dp_global_num_tokens()`, more than one
    entry) ceil(max(counts) / attn_tp_size), since each DP rank's tokens are split over its
    attention-TP ranks; otherwise this rank's `rows` (sequence-parallel attention gives every
    EP rank the same count). At least 1: an idle rank still runs a step of padding rows."""
    if counts is not None and len(counts) > 1:
        return common_tokens(counts, attn_tp_size)
    return max(rows, 1)


def routing(topk_output: object, rows: int, topk: int, device: torch.device):
    """(ids int32 [rows, K], weights fp32 [rows, K]) from SGLang's StandardTopKOutput
    (`topk_ids` int32 or int64, -1 = no expert; `topk_weights` fp32 or bf16); empty [0, K]
    tensors for an idle rank, whose top-k output may hold nothing usable (SGLang's megamoe path
    builds them so too)."""
    if rows == 0:
        ids = torch.empty(0, topk, dtype=torch.int32, device=device)
        return ids, torch.empty(0, topk, dtype=torch.float32, device=device)
    return topk_output.topk_ids.to(torch.int32), topk_output.topk_weights.to(torch.float32)


def mask_padding(engine: SglangEngine, ids: torch.Tensor) -> torch.Tensor:
    """ids with the rows at or past the forward's real-row bound (`num_token_non_padded`, a
    device scalar: the tail of a CUDA-graph bucket) set to -1, so padding reaches no rank.
    SGLang's top-k masks them itself, but its fused K3 front (`_ep_front`) hands ids it did not
    mask. Graph-safe: the bound is read on the device at every replay."""
    bound = engine.num_token_non_padded()
    if bound is None or ids.shape[0] == 0:
        return ids
    rows = torch.arange(ids.shape[0], device=ids.device)
    return padding_to_no_expert(ids, rows >= bound)
