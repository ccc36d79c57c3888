"""HopperExperts: MXFP4 experts on SM90 over device-grouped pairs, with its engines as classes
(HummingEngine: humming-kernels' GEMMs; TritonEngine: ours), the tiles they launch with, the
grouping and the pair counts humming tunes for.

Files: hopper_experts.py (the backend, default_engine), engine.py (HopperEngine, tuning_pairs),
humming_engine.py and humming_gemm.py (HummingEngine and its humming-kernels wrapper),
humming_layout.py (humming's prepared weights read back to values),
triton_engine.py (TritonEngine, fused_experts), kernels.py (the Triton kernels), chunks.py and
chunk_kernels.py (the humming engine's calls in chunks of pairs: the plan, its kernels), tiles.py
(HopperTiles), grouping.py and grouping_kernel.py (the pairs grouped by expert, torch and Triton).
"""

from dep_ep.experts.hopper.engine import HopperEngine, tuning_pairs
from dep_ep.experts.hopper.grouping import Grouping, grouped, routed_tilings
from dep_ep.experts.hopper.hopper_experts import HopperExperts, default_engine
from dep_ep.experts.hopper.humming_engine import HummingEngine
from dep_ep.experts.hopper.tiles import HopperTiles
from dep_ep.experts.hopper.triton_engine import TritonEngine

__all__ = [
    "Grouping",
    "HopperEngine",
    "HopperExperts",
    "HopperTiles",
    "HummingEngine",
    "TritonEngine",
    "default_engine",
    "grouped",
    "routed_tilings",
    "tuning_pairs",
]
