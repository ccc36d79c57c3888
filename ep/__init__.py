"""The EP facade (EpRouted), the MoE layer around it (EpMoeLayer), geometry presets, the router."""

from dep_ep.config import K3, PRESETS, TINY, MoeGeometry
from dep_ep.ep.custom_op import register_routed, routed_op
from dep_ep.ep.layer import EpMoeLayer
from dep_ep.ep.routed import EpRouted, ReceiveRows
from dep_ep.ep.router import route, route_into

__all__ = [
    "K3",
    "PRESETS",
    "TINY",
    "EpMoeLayer",
    "EpRouted",
    "MoeGeometry",
    "ReceiveRows",
    "register_routed",
    "route",
    "routed_op",
    "route_into",
]
