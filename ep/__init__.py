"""The EP facade (EpRouted), geometry presets, the router, and the all-gather reference."""

from dep_ep.config import K3, PRESETS, TINY, MoeGeometry
from dep_ep.ep.allgather_reference import allgather_reference
from dep_ep.ep.layer import EpMoeLayer
from dep_ep.ep.routed import EpRouted, ReceiveRows
from dep_ep.ep.router import route
from dep_ep.ep.synthetic import SyntheticLayer

__all__ = [
    "K3",
    "PRESETS",
    "TINY",
    "EpMoeLayer",
    "EpRouted",
    "MoeGeometry",
    "ReceiveRows",
    "SyntheticLayer",
    "allgather_reference",
    "route",
]
