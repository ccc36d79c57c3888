"""Checks of routed outputs against the all-gather reference, within the modelled tolerances
(helpers/tolerance.py), and the experts a rank holds in the tests."""

from __future__ import annotations

import torch

from dep_ep.ep import SyntheticLayer
from dep_ep.experts import ReferenceExperts

from helpers.cases import real_tokens
from helpers.tolerance import ELEMENT_REL, ELEMENT_ROW, ROUTED_REL_L2


def make_experts(layer: SyntheticLayer, rank: int, num_ranks: int) -> ReferenceExperts:
    """ReferenceExperts of the experts `rank` owns among `num_ranks` (CPU)."""
    per_rank = layer.geometry.experts // num_ranks
    return ReferenceExperts(*layer.local(rank * per_rank, per_rank), first_expert=rank * per_rank)


def finite_rows(out: torch.Tensor, ref: torch.Tensor, label: str):
    """(failures, output rows as float64, reference rows) of the rows whose reference is finite:
    failures when a non-finite reference row came out finite or a finite one did not; the rows
    are None when there is nothing more to compare (non-finite output, or no finite row)."""
    bad_rows = ~ref.isfinite().all(dim=1)
    failures = []
    if not (~out[bad_rows].isfinite()).any(dim=1).all():
        failures.append(f"{label}: a non-finite reference row came out finite")
    got, want = out[~bad_rows].double(), ref[~bad_rows]
    if not got.isfinite().all():
        failures.append(f"{label}: non-finite output in rows with a finite reference")
        return failures, None, None
    if want.numel() == 0:
        return failures, None, None
    return failures, got, want


def compare(out: torch.Tensor, ref: torch.Tensor, label: str) -> list[str]:
    """Failures of the routed output `out` (bf16 [T, L], CPU) against the all-gather reference
    `ref` (float64 [T, L]): rows whose reference is non-finite must be non-finite; the others need
    relative L2 <= ROUTED_REL_L2 over all of them and every element within
    ELEMENT_ROW * rms(reference row) + ELEMENT_REL * |ref|."""
    failures, got, want = finite_rows(out, ref, label)
    if want is None:
        return failures
    diff = got - want
    rel = float(diff.norm() / want.norm().clamp(min=1e-30))
    row_rms = want.square().mean(dim=1, keepdim=True).sqrt()
    excess = diff.abs() - (ELEMENT_ROW * row_rms + ELEMENT_REL * want.abs())
    if rel > ROUTED_REL_L2 or excess.max() > 0:
        failures.append(
            f"{label}: rel L2 {rel:.2e} (bound {ROUTED_REL_L2:.2e}), worst element excess"
            f" {float(excess.max()):.3g}"
        )
    return failures


def compare_rel_l2(out: torch.Tensor, ref: torch.Tensor, bound: float, label: str) -> list[str]:
    """`compare` for numerics whose element errors have no per-element bound worth checking
    (MXFP8 activations: 2.65e-2 rms per element): rows whose reference is non-finite must be
    non-finite, the others finite with relative L2 <= bound over all of them."""
    failures, got, want = finite_rows(out, ref, label)
    if want is None:
        return failures
    rel = float((got - want).norm() / want.norm().clamp(min=1e-30))
    if rel > bound:
        failures.append(f"{label}: rel L2 {rel:.2e} > bound {bound:.2e}")
    return failures


def check_ragged(out: torch.Tensor, ref: torch.Tensor, rank: int, num_ranks: int) -> list[str]:
    """Real rows within tolerance of the reference; padding rows exactly +0.0 (docs/design.md)."""
    tokens = out.shape[0]
    real = real_tokens(tokens, num_ranks)[rank]
    failures = compare(out, ref, f"ragged T={tokens} real={real}")
    padding = out[real:].cpu()
    if not torch.equal(padding.view(torch.int16), torch.zeros_like(padding.view(torch.int16))):
        failures.append(f"ragged: padding rows {real}..{tokens - 1} are not all +0.0")
    return failures
