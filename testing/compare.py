"""Checks of routed outputs (bf16) against float64 references within the modelled tolerances
(dep_ep.testing.tolerance): for tests, benchmarks and examples alike."""

from __future__ import annotations

import torch

from dep_ep.testing.tolerance import ELEMENT_REL, ELEMENT_ROW, ROUTED_REL_L2


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """The relative L2 error |got - want| / |want| in float64 (|want| taken as at least 1e-30)."""
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp(min=1e-30))


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
    rel = rel_l2(got, want)
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
    rel = rel_l2(got, want)
    if rel > bound:
        failures.append(f"{label}: rel L2 {rel:.2e} > bound {bound:.2e}")
    return failures
