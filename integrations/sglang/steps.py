"""What one MoE step under SGLang takes from the engine's per-forward state, for the Kimi K3 hook
and the dispatcher alike: the common token count T, the routing as EpRouted takes it, and the
padding mask (EpRouted's `padding=`: those rows reach no rank)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from dep_ep.integrations.common import common_tokens, reject_bad_step
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
    (`topk_ids` of an integer dtype, -1 = no expert; `topk_weights` fp32 or another floating
    dtype; TypeError for float or bool ids, or weights that are not floating); empty [0, K]
    tensors for an idle rank, whose top-k output may hold nothing usable (SGLang's megamoe path
    builds them so too)."""
    if rows == 0:
        ids = torch.empty(0, topk, dtype=torch.int32, device=device)
        return ids, torch.empty(0, topk, dtype=torch.float32, device=device)
    ids, weights = topk_output.topk_ids, topk_output.topk_weights
    # EpRouted takes int32 and int64 ids as they are (int64 clamped where it stages them);
    # a conversion of what needs none still cost ~1 us of host time each.
    if ids.dtype not in (torch.int32, torch.int64):
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            # A cast would truncate 3.7 to expert 3: no expert id is a fraction.
            raise TypeError(f"topk_ids dtype {ids.dtype}; expected integer expert ids")
        ids = ids.to(torch.int32)
    if weights.dtype != torch.float32:
        if not weights.is_floating_point():
            raise TypeError(f"topk_weights dtype {weights.dtype}; expected floating weights")
        weights = weights.to(torch.float32)
    return ids, weights


# (device, dtype) -> [m] of that dtype: 0..m-1, so that a step's padding mask is one comparison
# (one launch), in the bound's dtype (a comparison that promotes costs ~1 us more host time).
_ROW_INDEX: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
# (device, dtype, rows) -> the first `rows` of _ROW_INDEX's: the slice cost as much host time as
# the comparison's launch on the H200 machine's host (~4 us). Cleared past _MAX_ROW_VIEWS.
_ROW_VIEWS: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}
_MAX_ROW_VIEWS = 1024
# Row indices _ROW_INDEX held before it grew, kept for the life of the process: a CUDA graph
# captured with a mask of them reads their memory at every replay, and freed memory handed out
# again would make that mask compare garbage with the bound (real rows dropped as padding).
# Each index at least doubles the last, so these hold less than the current one.
_RETIRED_ROW_INDEX: list[torch.Tensor] = []


def row_index(rows: int, dtype: torch.dtype, device: torch.device, capturing: bool) -> torch.Tensor:
    """[rows] of `dtype` on `device`, 0..rows-1: a view of the indices kept per device, made
    outside any capture (a tensor a capture fills holds nothing until the graph runs) and never
    freed (`_RETIRED_ROW_INDEX`); while capturing with too few kept, a new one the capture
    records."""
    view = _ROW_VIEWS.get((device, dtype, rows))
    if view is not None:
        return view
    index = _ROW_INDEX.get((device, dtype))
    if index is None or index.shape[0] < rows:
        if capturing:
            return torch.arange(rows, dtype=dtype, device=device)
        grown = 256 if index is None else 2 * index.shape[0]
        if index is not None:
            _RETIRED_ROW_INDEX.append(index)
        index = torch.arange(max(rows, grown), dtype=dtype, device=device)
        _ROW_INDEX[(device, dtype)] = index
    if len(_ROW_VIEWS) >= _MAX_ROW_VIEWS:
        _ROW_VIEWS.clear()
    view = _ROW_VIEWS[(device, dtype, rows)] = index[:rows]
    return view


class _ForwardMask(NamedTuple):
    """The padding mask of one forward's MoE layers, and what it was made for. The forward and
    the bound are held (not their ids): while this entry lives, no later forward can be
    another object at the same address. Holding the forward keeps its forward batch (the
    bound's getter belongs to it) alive until a later forward's first MoE layer with rows and a
    bound replaces the entry (an idle rank keeps one old forward until then)."""

    forward: object  # SGLang's ForwardContext
    bound: torch.Tensor  # the forward's real-row bound the mask compares against
    version: int | None  # the bound's version counter then (`bound_version`)
    rows: int
    device: torch.device
    capture: int | None  # the id of the CUDA-graph capture it was recorded in; None: eager
    mask: torch.Tensor  # bool [rows]


class _ForwardTokens(NamedTuple):
    """T of one forward's MoE steps and what it was computed from (held, as in _ForwardMask)."""

    forward: object  # SGLang's ForwardContext
    counts: object  # the DP counts list (that object)
    rows: int
    tokens: int


# The last forward's mask and T: every MoE layer of a forward has the same rows, bound and
# counts, so the first makes the mask and T and the others reuse them (one comparison a forward
# instead of one a layer: its launch took 6-10 us of host time on the H200 machines' hosts, and
# 1.3 us a layer under graph replay; reading the counts for T again took up to 0.9 us a layer).
# T is kept on every rank alike, idle or without a bound, so that ranks never differ in
# whether they read the counts again.
_FORWARD_MASK: _ForwardMask | None = None
_FORWARD_TOKENS: _ForwardTokens | None = None

# torch's C test behind torch.cuda.is_current_stream_capturing, whose Python wrapper took
# 0.3-0.6 us a call on the H200 machines' hosts. A CPU-only torch has a stand-in that raises
# when called: it is called for CUDA devices only.
_IS_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def capture_id(device: torch.device) -> int | None:
    """The id of the CUDA-graph capture running on `device`'s current stream (unique in the
    process), None when none runs. -1 when a capture runs but its id cannot be read (no
    cuda-python): the caller must then not share tensors between calls."""
    if device.type != "cuda" or not _IS_CAPTURING():
        return None
    try:
        from cuda.bindings import driver
    except ImportError:
        return -1
    stream = torch.cuda.current_stream(device).cuda_stream
    result, status, capture, *_ = driver.cuStreamGetCaptureInfo(stream)
    if result != driver.CUresult.CUDA_SUCCESS or (
        status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
    ):
        return -1
    return int(capture)


def bound_version(bound: torch.Tensor) -> int | None:
    """The bound's version counter, which torch's in-place operations on it or its views
    raise (a `copy_` or `fill_` of the same tensor with another count; not writes through
    `.data`, numpy or a kernel given its pointer); None for an inference tensor, which keeps
    none (SGLANG_ENABLE_TORCH_INFERENCE_MODE; reading it there raised, at ~12 us)."""
    return None if bound.is_inference() else bound._version


def _index_dtype(bound: torch.dtype) -> torch.dtype:
    """The row indices' dtype for a bound of dtype `bound`: the bound's own when it holds every
    row index exactly (int32, int64, float32 up to 2^24 rows, float64), so the comparison does not
    promote; else int64 (narrower ints and bool: an index in int8 wraps past row 127) or float64
    (half floats round row indices past 256 onto their neighbours; the comparison promotes)."""
    if bound in (torch.int32, torch.int64, torch.float32, torch.float64):
        return bound
    return torch.float64 if bound.is_floating_point else torch.int64


def _forward_mask(
    engine: SglangEngine, forward: object | None, rows: int, device: torch.device
) -> torch.Tensor | None:
    """`padding_mask` of the running forward `forward` (None: outside a forward)."""
    global _FORWARD_MASK
    if rows == 0 or forward is None:
        return None
    bound = engine.num_token_non_padded(forward)
    if bound is None:
        return None
    capture = capture_id(device)
    last = _FORWARD_MASK
    if (
        last is not None
        and last.forward is forward
        and last.bound is bound
        and last.rows == rows
        and last.device == device
        and (last.version is None or bound._version == last.version)
        and last.capture == capture
        and capture != -1
    ):
        return last.mask
    mask = row_index(rows, _index_dtype(bound.dtype), device, capture is not None) >= bound
    version = bound_version(bound)
    _FORWARD_MASK = _ForwardMask(forward, bound, version, rows, device, capture, mask)
    return mask


def padding_mask(engine: SglangEngine, rows: int, device: torch.device) -> torch.Tensor | None:
    """bool [rows] on `device`, True for the rows at or past the forward's real-row bound
    (`num_token_non_padded`, a device scalar: the tail of a CUDA-graph bucket), for EpRouted's
    `padding=`; None when the forward publishes no bound or the rank has no rows. SGLang's
    top-k masks those rows' ids itself, but its fused K3 front (`_ep_front`) hands ids it did
    not mask. Graph-safe: the bound is read on the device at every replay.

    One mask a forward: a later layer of the same forward (the same ForwardContext object,
    which SGLang makes fresh for each forward, the same bound tensor, not written in place
    since (`bound_version`), rows and device) gets the first layer's mask, made in the same
    stream order after the bound was written. Inside a CUDA-graph capture the mask is shared
    only within that capture (its id, `capture_id`), so a graph never reads a mask another
    graph or an eager call made. The row indices: `row_index`."""
    return _forward_mask(engine, engine.forward_context(), rows, device)


def forward_step(
    engine: SglangEngine, rows: int, device: torch.device
) -> tuple[torch.Tensor | None, int]:
    """(padding, T) of a MoE step on `rows` rows: `padding_mask`, and `step_tokens` of the
    engine's DP counts, kept for the forward's later layers (the same forward context, counts
    list object and rows; SGLang assigns a new list when it sets a forward's counts) on every
    rank alike. A T that counts changed in place would give differently cannot pass silently:
    the ranks' T disagree (EpTokenCountError or EpDesyncError on every rank) or the rows
    exceed it (ValueError)."""
    global _FORWARD_TOKENS
    forward = engine.forward_context()
    counts = engine.dp_global_num_tokens()
    last = _FORWARD_TOKENS
    if (
        forward is not None
        and last is not None
        and last.forward is forward
        and last.counts is counts
        and last.rows == rows
    ):
        tokens = last.tokens
    else:
        tokens = step_tokens(counts, engine.attn_tp_size(), rows)
        if forward is not None:
            _FORWARD_TOKENS = _ForwardTokens(forward, counts, rows, tokens)
    return _forward_mask(engine, forward, rows, device), tokens


def step_inputs(fn: str, engine: SglangEngine, routed, topk_output: object, latent, tag: int):
    """(ids, weights, padding, T) of one MoE step on `latent` ([n, L], n = 0 on an idle rank):
    `routing`, and `forward_step` (the padding mask and T) from the engine's per-forward state. A
    malformed top-k output or step counts (any Exception reading them, torch's included)
    rejects the step through `routed` (EpRouted.reject_step, tagged `tag`): ValueError naming
    `fn` and the layer here, EpPeerError on the peers, instead of this rank raising alone."""
    try:
        rows, device = latent.shape[0], latent.device
        ids, weights = routing(topk_output, rows, routed.topk, device)
        padding, tokens = forward_step(engine, rows, device)
    except Exception as err:  # on this rank alone: every rank must raise
        reject_bad_step(routed, fn, tag, "the top-k output or the step's counts", err)
    return ids, weights, padding, tokens
