"""What a server around dep_ep needs whatever the engine: the step's common token count from the
per-rank counts, one EpRouted per process and group for every MoE layer, the warm-up of every
CUDA-graph bucket, and the per-step poll. (Padding rows reach no rank through the routed call's
`padding=` mask: EpRouted.dispatch.)

Engine-free: the vLLM and SGLang integrations and examples/dp_server.py use these functions,
so the logic a test checks on CPU ranks is the logic an engine runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NoReturn

import torch
import torch.distributed as dist

from dep_ep.checks import check_int
from dep_ep.comm.buffers import resolve_device
from dep_ep.config import EpConfig
from dep_ep.ep.routed import EpRouted
from dep_ep.experts.base import ExpertsBackend


def common_tokens(counts: Sequence[int], sequence_parallel: int = 1) -> int:
    """T of a step: the most tokens any rank passes, at least 1 (an idle rank runs a step of
    padding rows). `counts`: every data-parallel rank's token count; `sequence_parallel`: the
    ranks a DP rank's tokens are split over (vLLM's sequence-parallel MoE shards each DP rank's
    tokens over its TP ranks, ceil(n / sp) each)."""
    sp = sequence_parallel
    if type(sp) is not int:  # the per-layer fast path; a bool (a subclass) is checked
        sp = check_int("common_tokens", "sequence_parallel", sp)
    if sp < 1:
        raise ValueError(f"common_tokens: sequence_parallel={sp}; expected >= 1")
    # Called once a MoE layer: plain ints (an engine's tolist()) take the short path.
    # Anything else (an iterator included: read once) is checked element by element.
    if isinstance(counts, (list, tuple)) and all(type(c) is int for c in counts):
        values = counts
    else:
        values = [check_int("common_tokens", "counts[i]", c) for c in counts]
    if values and min(values) < 0:
        raise ValueError(f"common_tokens: counts {list(values)} hold a negative count")
    most = max(values, default=0)
    return max(-(-most // sp), 1)


def reject_bad_step(
    routed: EpRouted, fn: str, tag: int | None, what: str, err: Exception
) -> NoReturn:
    """Reject the step `err` kept this rank from entering, on every rank: ValueError naming
    `fn`, the layer's `tag` and `what` was read (caused by `err`) here, EpPeerError on the peers
    (EpRouted.reject_step, tagged `tag`), instead of this rank raising alone and its peers
    pairing their call with its next one. Never returns."""
    error = ValueError(f"{fn}: layer {tag}: {what}: {err}")
    error.__cause__ = err
    routed.reject_step(error, tag=tag)  # takes part in the step, then raises `error`
    raise error  # not reached


# (group, device, E, L, K, max_tokens) -> the EpRouted every MoE layer of the process shares.
_SHARED: dict[tuple, EpRouted] = {}


def shared_routed(
    group: dist.ProcessGroup,
    device: torch.device | str,
    *,
    num_experts: int,
    latent: int,
    topk: int,
    max_tokens: int,
    config: EpConfig | None = None,
) -> EpRouted:
    """The process's EpRouted for this group and geometry, built at the first call (collective
    then: every rank of `group` makes its first call for a geometry together, as models build
    their layers in the same order) and the same object at every later call (local). A later
    call with another `config` (None: EpConfig()) raises ValueError."""
    config = EpConfig() if config is None else config
    try:
        spelled = str(resolve_device("shared_routed", device))  # "cpu:0" is "cpu"
    except (TypeError, ValueError):
        spelled = repr(device)  # the construction refuses it, on every rank
    sizes = {"num_experts": num_experts, "latent": latent, "topk": topk, "max_tokens": max_tokens}
    key = (group, spelled, *(_key_int(name, v) for name, v in sizes.items()))
    routed = _SHARED.get(key)
    if routed is not None and not routed.closed and routed.config != config:
        raise ValueError(
            f"shared_routed: the process's EpRouted for this group and geometry was built with"
            f" {routed.config}; this call asks for {config} (one EpRouted serves every layer:"
            " give every layer the same config)"
        )
    if routed is None or routed.closed:
        routed = EpRouted(
            group,
            max_tokens,
            device,
            num_experts=num_experts,
            latent=latent,
            topk=topk,
            config=config,
        )
        _SHARED[key] = routed
    return routed


def _key_int(name: str, value: object) -> object:
    """An integer argument of shared_routed as its cache key holds it: a Python int for an
    integer of any kind (a 0-dim tensor hashes by identity: each call would build a new object),
    else its repr (the construction refuses it, on every rank)."""
    try:
        return check_int("shared_routed", name, value)
    except Exception:  # not an int, or a tensor without a value (meta): refused by the build
        return repr(value)


def close_shared() -> None:
    """Close every shared EpRouted (collective by contract: every rank, at shutdown). Every one
    is closed even when one's close raises; the first such error is raised after them."""
    first = None
    while _SHARED:
        _, routed = _SHARED.popitem()
        try:
            routed.close()
        except Exception as err:
            first = first or err
    if first is not None:
        raise first


def warm_buckets(routed: EpRouted, experts: ExpertsBackend, tokens: Iterable[int]) -> None:
    """`routed.warmup(T, experts)` for every CUDA-graph bucket's T (local): a backend that
    compiles per row count compiles before any capture."""
    for t in sorted(set(tokens)):
        routed.warmup(t, experts)


def poll_all() -> None:
    """`poll()` of every shared EpRouted: a server calls it once per engine step, outside any
    capture (a failed step under CUDA-graph replay gives NaN rows and nothing else)."""
    for routed in list(_SHARED.values()):
        if not routed.closed:
            routed.poll()
