"""What one MoE step under SGLang takes from the engine's per-forward state, for the Kimi K3 hook
and the dispatcher alike: the common token count T, the routing as EpRouted takes it, and the
padding mask (EpRouted's `padding=`: those rows reach no rank)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dep_ep.integrations.common import common_tokens
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
    """(ids int32|int64 [rows, K], weights fp32 [rows, K]) from SGLang's StandardTopKOutput
    (`topk_ids` int32 or int64, -1 = no expert; `topk_weights` fp32 or bf16); empty [0, K]
    tensors for an idle rank, whose top-k output may hold nothing usable (SGLang's megamoe path
    builds them so too)."""
    if rows == 0:
        ids = torch.empty(0, topk, dtype=torch.int32, device=device)
        return ids, torch.empty(0, topk, dtype=torch.float32, device=device)
    ids, weights = topk_output.topk_ids, topk_output.topk_weights
    # EpRouted takes int32 and int64 ids as they are (int64 clamped where it stages them);
    # a conversion of what needs none still cost ~1 us of host time each.
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int32)
    if weights.dtype != torch.float32:
        weights = weights.to(torch.float32)
    return ids, weights


# device -> int64 [m]: 0..m-1, so that a step's padding mask is one comparison (one launch).
_ROW_INDEX: dict[torch.device, torch.Tensor] = {}


def padding_mask(engine: SglangEngine, rows: int, device: torch.device) -> torch.Tensor | None:
    """bool [rows] on `device`, True for the rows at or past the forward's real-row bound
    (`num_token_non_padded`, a device scalar: the tail of a CUDA-graph bucket), for EpRouted's
    `padding=`; None when the forward publishes no bound or the rank has no rows. SGLang's
    top-k masks those rows' ids itself, but its fused K3 front (`_ep_front`) hands ids it did
    not mask. Graph-safe: the bound is read on the device at every replay. The row indices are
    kept per device (made outside any capture: a tensor a capture fills holds nothing until
    the graph runs)."""
    bound = engine.num_token_non_padded()
    if bound is None or rows == 0:
        return None
    index = _ROW_INDEX.get(device)
    if index is None or index.shape[0] < rows:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return torch.arange(rows, device=device) >= bound
        index = _ROW_INDEX[device] = torch.arange(max(rows, 256), device=device)
    return index[:rows] >= bound


def step_inputs(fn: str, engine: SglangEngine, routed, topk_output: object, latent, tag: int):
    """(ids, weights, padding, T) of one MoE step on `latent` ([n, L], n = 0 on an idle rank):
    `routing`, `padding_mask` and `step_tokens` from the engine's per-forward state. A
    malformed top-k output or step counts (any error of those, torch's RuntimeError included)
    rejects the step through `routed` (EpRouted.reject_step, tagged `tag`): ValueError naming
    `fn` and the layer here, EpPeerError on the peers, instead of this rank raising alone."""
    rows = latent.shape[0]
    try:
        ids, weights = routing(topk_output, rows, routed.topk, latent.device)
        padding = padding_mask(engine, rows, latent.device)
        tokens = step_tokens(engine.dp_global_num_tokens(), engine.attn_tp_size(), rows)
    except (AttributeError, TypeError, ValueError, RuntimeError) as err:
        error = ValueError(f"{fn}: layer {tag}: the top-k output or the step's counts: {err}")
        error.__cause__ = err
        routed.reject_step(error, tag=tag)  # takes part in the step, then raises `error`
        raise error  # not reached
    return ids, weights, padding, tokens
