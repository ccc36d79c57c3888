"""The routed path at K3's widths over 32 experts, as the GPU tests of HopperExperts inside
EpRouted build it (tests/gpu/test_gpu_hopper_routed.py, tests/gpu/test_gpu_server_calls.py):
the geometry, the EpRouted and the bound its output is compared with."""

from __future__ import annotations

import pytest
import torch

from dep_ep.config import EpConfig
from dep_ep.ep import K3, EpRouted, MoeGeometry
from dep_ep.testing.tolerance import EXPERTS_REL_L2, ROUTED_HUMMING_REL_L2, ROUTED_REL_L2

# K3's widths (L 3584, I 3072: the humming engine's shapes, where it is the default) over 32
# experts, so that the float64 reference (on the GPU) stays quick: 16 local experts a rank at
# N = 2, 4 at N = 8.
K3_32 = MoeGeometry(
    "k3-32",
    hidden=K3.hidden,
    latent=K3.latent,
    experts=32,
    topk=K3.topk,
    intermediate=K3.intermediate,
)
MAX_TOKENS = 16


def build_routed(gpu_dep) -> EpRouted:
    """The EpRouted of K3_32 over every rank, sized for MAX_TOKENS (skips where 32 experts do
    not split over the ranks)."""
    if K3_32.experts % gpu_dep.size:
        pytest.skip(f"{K3_32.experts} experts do not split over {gpu_dep.size} ranks")
    return EpRouted(
        gpu_dep.cpu_group,
        MAX_TOKENS,
        torch.device("cuda"),
        num_experts=K3_32.experts,
        latent=K3_32.latent,
        topk=K3_32.topk,
        config=EpConfig(timeout_s=60.0),
    )


def bound_of(experts) -> float:
    """The modelled relative L2 bound of the routed output with this backend's numerics."""
    if getattr(experts, "activation_format", "bf16") == "mxfp8":
        return ROUTED_HUMMING_REL_L2
    return max(ROUTED_REL_L2, EXPERTS_REL_L2)
