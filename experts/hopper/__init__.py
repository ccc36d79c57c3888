"""HopperExperts: MXFP4 experts on SM90 over device-grouped pairs."""

from dep_ep.experts.hopper.hopper_experts import (
    GROUPINGS,
    SITU_MAX_BLOCK_I,
    SITU_PROGRAMS_PER_SM,
    SITU_ROWS,
    WIDEN_BLOCK,
    HopperExperts,
    HopperTiles,
    default_engine,
    fused_experts,
    grouped,
    routed_tilings,
    tuning_pairs,
    workspace_bytes,
)

__all__ = [
    "GROUPINGS",
    "SITU_MAX_BLOCK_I",
    "SITU_PROGRAMS_PER_SM",
    "SITU_ROWS",
    "WIDEN_BLOCK",
    "HopperExperts",
    "HopperTiles",
    "default_engine",
    "fused_experts",
    "grouped",
    "routed_tilings",
    "tuning_pairs",
    "workspace_bytes",
]
