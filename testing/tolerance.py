"""Tolerances of the BF16 outputs against the float64 references, from an error model of the
roundings the path makes and the reference does not.

The references (dep_ep.testing: `expert_sums`, `allgather_reference`) reproduce the MXFP8
rounding of the latent exactly, decode the same MXFP4 weights exactly, and do everything
after that in float64. The path under test differs from them only by

- its roundings to BF16 (listed below, each in the order the path makes it), and
- fp32 arithmetic (2^-24 relative per operation; sums of at most L = 3584 terms stay below
  1e-5 relative, SiTU's fp32 tanh/sigmoid near 1e-7): neglected.

One round-to-nearest to a format with p significant bits (BF16: p = 8) of a value m * 2^e
(1 <= m < 2) adds an absolute error uniform in +-ulp/2, ulp = 2^(1-p) * 2^e. At the bottom of a
binade that is a relative rms of u/sqrt(3) with u = 2^-p, the unit roundoff; averaged over a
binade whose mantissas are log-uniformly distributed (what products and sums of random data give)
the mean of 1/m^2 is 3/(8 ln 2), which multiplies that by sqrt(3/(8 ln 2)) = 0.736.

Every map after a rounding keeps relative L2 errors in expectation for independent errors: a
GEMM against random weights, weighted sums of uncorrelated expert outputs and rank partials, and
RMSNorm, which is scale invariant. So the roundings' relative errors add in quadrature to the
relative L2 error of the whole output: rms = sqrt(sum of their squares).
"""

from __future__ import annotations

import math


def rounding_rms(significant_bits: int) -> float:
    """Relative rms error of one round-to-nearest to `significant_bits` bits (module docstring)."""
    u = 2.0**-significant_bits
    return u / math.sqrt(3) * math.sqrt(3 / (8 * math.log(2)))


BF16_UNIT_ROUNDOFF = 2.0**-8
BF16 = rounding_rms(8)  # 1.66e-3
E4M3 = rounding_rms(4)  # 2.65e-2: an MXFP8 element (the E8M0 block scale is a power of two)

# The roundings of the expert backends, per output row of the receive rows.
EXPERT_ROUNDINGS = {
    "SiTU activation, fp32 -> BF16 (FC1 and SiTU run in fp32; FC2's input)": BF16,
    "expert output (FC2 with fp32 sums) -> BF16": BF16,
    "weighted sum over the row's local ids (fp32, k in order) -> BF16": BF16,
}
# FlashInfer's trtllm-gen kernel runs both GEMMs as MXFP8 x MXFP4: its SiTU epilogue rounds the
# activation to MXFP8 (e4m3 elements) instead of BF16.
TRTLLM_ROUNDINGS = {
    "SiTU activation -> MXFP8 (e4m3 elements, FC2's input)": E4M3,
    "expert output -> BF16": BF16,
    "finalize: weighted sum over the row's local ids -> BF16": BF16,
}
# HopperExperts' humming engine: FC1's output in BF16, SiTU's in MXFP8 (the dispatch's recipe).
HUMMING_ROUNDINGS = {
    "FC1 output (fp32 sums) -> BF16 (SiTU's input)": BF16,
    "SiTU activation -> MXFP8 (e4m3 elements, FC2's input)": E4M3,
    "expert output -> BF16": BF16,
    "finalize: weighted sum over the row's local ids -> BF16": BF16,
}
# The routed path (EpRouted: dispatch -> experts -> combine + RMSNorm), per output token.
ROUTED_ROUNDINGS = {
    **EXPERT_ROUNDINGS,  # the last one is the rank's partial that combine sends back
    "sum of the rank partials (fp32, rank order) -> BF16 before the norm": BF16,
    "y = h * inv -> BF16": BF16,
    "z = y * norm_weight -> BF16": BF16,
}

# The routed path with HopperExperts' humming engine: its roundings, then combine's.
ROUTED_HUMMING_ROUNDINGS = {
    **HUMMING_ROUNDINGS,  # the last one is the rank's partial that combine sends back
    "sum of the rank partials (fp32, rank order) -> BF16 before the norm": BF16,
    "y = h * inv -> BF16": BF16,
    "z = y * norm_weight -> BF16": BF16,
}


def model_rms(roundings: dict[str, float]) -> float:
    """Expected relative L2 error of an output from independent roundings (module docstring)."""
    return math.sqrt(sum(rms * rms for rms in roundings.values()))


# The bound is SAFETY times the model's rms. A single comparison's relative L2 is a norm over at
# least 256 elements (one token of L = 256) with independent errors: chi-distributed with relative
# spread 1/sqrt(2 * 256) = 4.4%, so 5 spreads are +22%. The rest covers what the model assumes
# without bounding it: tokens whose expert outputs (or rank partials) partly cancel amplify the
# roundings made before the cancellation, and the maps keep norms only in expectation.
# The model against the CPU suite (TINY, 2-4 ranks, 1,350 comparisons): relative L2 mean 3.98e-3,
# largest 4.66e-3 (model 4.06e-3); ReferenceExperts' rows (150 seeds): mean 2.87e-3 (model
# 2.87e-3). What the bound catches: SiTU with sigmoid(1.03 g) for sigmoid(g) fails (relative L2
# ~9.4e-3), sigmoid(1.01 g) passes; one local expert computed with its neighbour's weights fails.
SAFETY = 2.0
# The routed path's expected relative L2 error (4.06e-3), for bounds that add other roundings.
ROUTED_RMS = model_rms(ROUTED_ROUNDINGS)
ROUTED_REL_L2 = SAFETY * ROUTED_RMS  # 2 * 4.06e-3 = 8.1e-3
EXPERTS_REL_L2 = SAFETY * model_rms(EXPERT_ROUNDINGS)  # 2 * 2.87e-3 = 5.7e-3
TRTLLM_REL_L2 = SAFETY * model_rms(TRTLLM_ROUNDINGS)  # 2 * 2.66e-2 = 5.3e-2
HUMMING_REL_L2 = SAFETY * model_rms(HUMMING_ROUNDINGS)  # 2 * 2.66e-2 = 5.3e-2
ROUTED_HUMMING_REL_L2 = SAFETY * model_rms(ROUTED_HUMMING_ROUNDINGS)  # 2 * 2.69e-2 = 5.4e-2

# Per element of the routed output, a bound rather than an rms: each rounding errs by at most
# BF16_UNIT_ROUNDOFF times the value it rounds (to first order). Three of them round the
# element itself (h, y, z): at most 3u |ref|. The other three (activation, expert output,
# partial) round addends of the element; an addend is at most the largest element of a
# row-scale vector, ADDEND_MAX times the reference row's rms s (a row of L <= 3584 roughly
# Gaussian elements has its largest below 4.5 rms except with probability ~2e-2 per row, and then
# only a rounding at its worst costs the difference): at most 3u * ADDEND_MAX * s.
ADDEND_MAX = 4.5
ELEMENT_ROW = 3 * BF16_UNIT_ROUNDOFF * ADDEND_MAX  # 0.053, times the row's rms
ELEMENT_REL = 3 * BF16_UNIT_ROUNDOFF  # 0.012, times |ref|

# The bound of a routed output by the experts backend's activation format (ExpertsBackend
# .activation_format): BF16 activations, or MXFP8 ones (FC2's input in e4m3).
ROUTED_REL_L2_BY_ACTIVATION = {"bf16": ROUTED_REL_L2, "mxfp8": ROUTED_HUMMING_REL_L2}
# A whole EpMoeLayer's output (tests/test_layer_mpi.py derives the expected error per case: about
# 4.2e-3 with BF16 activations when the routed and shared parts are of one size, bound 2x that):
# one fixed bound for checks that do not evaluate the model per case (examples/dep_layer.py).
LAYER_REL_L2_BY_ACTIVATION = {"bf16": 1e-2, "mxfp8": ROUTED_HUMMING_REL_L2}
