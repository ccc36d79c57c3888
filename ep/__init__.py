"""The EP facade (EpRouted), geometry presets, the router, and the all-gather reference."""

from ep.allgather_reference import allgather_reference
from ep.geometry import K3, PRESETS, TINY, MoeGeometry
from ep.routed import EpRouted, ReceiveRows
from ep.router import route
from ep.synthetic import SyntheticLayer

__all__ = [
    "K3",
    "PRESETS",
    "TINY",
    "EpRouted",
    "MoeGeometry",
    "ReceiveRows",
    "SyntheticLayer",
    "allgather_reference",
    "route",
]
