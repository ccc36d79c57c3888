"""dep_ep: expert-parallel MoE under data-parallel attention (DEP) over NVLink symmetric memory.

Subpackages, imported one way (each may import those before it and the leaf modules
`dep_ep.constants`, `dep_ep.config`, `dep_ep.checks`, `dep_ep.cuda_graphs`):
  dep_ep.launch   environment -> rank context, DEP groups, NVSHMEM bootstrap
  dep_ep.comm     layout, symmetric buffers, MXFP8, the host and device transports
  dep_ep.experts  routed-expert backends, MXFP4 formats, checkpoint loading
  dep_ep.ep       EpRouted, EpMoeLayer, the router
  dep_ep.integrations  what serving engines need (engine-free helpers; engine adapters)
and beside them dep_ep.testing (the all-gather reference, synthetic weights and routing, the
tolerance model), which no library module imports.
"""

from dep_ep.comm import (
    EpDesyncError,
    EpError,
    EpPairBudgetError,
    EpPeerError,
    EpPeerLostError,
    EpPeerTimeoutError,
    EpResetDuringCallError,
    EpTimeoutError,
    EpTokenCountError,
    EpUnwrittenRowsError,
)
from dep_ep.config import K3, PRESETS, TINY, EpConfig, MoeGeometry
from dep_ep.cuda_graphs import capture_graph
from dep_ep.ep import EpMoeLayer, EpRouted, ReceiveRows
from dep_ep.experts import (
    DenseExperts,
    ExpertsBackend,
    ExpertWeights,
    HopperExperts,
    ReferenceExperts,
    TrtllmExperts,
    default_experts,
)
from dep_ep.launch import DepGroup, RankContext, init_rank_context, new_dep_group, teardown
from dep_ep.version import __version__

__all__ = [
    "K3",
    "PRESETS",
    "TINY",
    "DenseExperts",
    "DepGroup",
    "EpConfig",
    "EpDesyncError",
    "EpError",
    "EpMoeLayer",
    "EpPairBudgetError",
    "EpPeerError",
    "EpPeerLostError",
    "EpPeerTimeoutError",
    "EpResetDuringCallError",
    "EpRouted",
    "EpTimeoutError",
    "EpTokenCountError",
    "EpUnwrittenRowsError",
    "ExpertWeights",
    "ExpertsBackend",
    "HopperExperts",
    "MoeGeometry",
    "RankContext",
    "ReceiveRows",
    "ReferenceExperts",
    "TrtllmExperts",
    "__version__",
    "capture_graph",
    "default_experts",
    "init_rank_context",
    "new_dep_group",
    "teardown",
]
