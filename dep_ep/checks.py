"""Argument validation for EpRouted: every message names the call, the argument, the value and
what is allowed."""

from __future__ import annotations

import torch


def check_tensor(
    fn: str,
    name: str,
    t: object,
    dtypes: tuple[torch.dtype, ...],
    shape: tuple[int, ...],
    device: torch.device,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} is {type(t).__name__}; expected a torch.Tensor")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{fn}: {name} dtype {t.dtype}; expected {allowed}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{fn}: {name} shape {tuple(t.shape)}; expected {shape}")
    if t.device != device:
        raise ValueError(f"{fn}: {name} on {t.device}; expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous (row-major); call .contiguous()")
    return t


VECTOR_ALIGN = 16  # bytes: the GPU kernels move rows in 16-byte vectors


def check_aligned(fn: str, name: str, t: torch.Tensor) -> None:
    """A tensor the GPU kernels read in 16-byte vectors must start on a 16-byte boundary (every
    torch allocation does; a view at an odd offset may not)."""
    if t.numel() and t.data_ptr() % VECTOR_ALIGN:
        raise ValueError(
            f"{fn}: {name} starts at an address that is not a multiple of {VECTOR_ALIGN} bytes"
            f" (data_ptr() % {VECTOR_ALIGN} = {t.data_ptr() % VECTOR_ALIGN}); pass a tensor of"
            " its own (.clone())"
        )


def check_tokens(fn: str, tokens: int, max_tokens: int) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= max_tokens:
        raise ValueError(f"{fn}: tokens={tokens!r} outside 1..{max_tokens} (max_tokens)")
    return tokens


def check_eps(fn: str, eps: object) -> float:
    """A finite number > 0 (int or float), returned as a float."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
        raise ValueError(f"{fn}: eps={eps!r}; expected a finite number > 0")
    return float(eps)


TAG_MIN, TAG_MAX = -(2**63) + 1, 2**63 - 1  # -2**63 means "no tag" on the wire


def check_tag(fn: str, tag: object) -> None:
    if tag is None:
        return
    if isinstance(tag, bool) or not isinstance(tag, int) or not TAG_MIN <= tag <= TAG_MAX:
        raise ValueError(f"{fn}: tag={tag!r}; expected None or an int in {TAG_MIN}..{TAG_MAX}")


def check_ids(fn: str, ids: torch.Tensor, num_experts: int) -> None:
    """Values in -1..num_experts-1 (reads the tensor: a host sync on GPU)."""
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < -1 or high >= num_experts:
        bad = low if low < -1 else high
        raise ValueError(f"{fn}: ids hold {bad}; allowed -1 (no expert) or 0..{num_experts - 1}")


def check_weights_finite(fn: str, weights: torch.Tensor, ids: torch.Tensor) -> None:
    """Routing weights of real (id != -1) selections must be finite."""
    bad = (~torch.isfinite(weights)) & (ids >= 0)
    if bool(bad.any()):
        token, k = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"{fn}: weights[{token}, {k}]={float(weights[token, k])} is not finite for expert"
            f" {int(ids[token, k])}; routing weights must be finite"
        )
