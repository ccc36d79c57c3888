"""The torch backends (any device): ReferenceExperts, the numerics every backend meets, and
DenseExperts, every local expert on every row (CUDA-graph capturable)."""

from dep_ep.experts.reference.dense_experts import DenseExperts
from dep_ep.experts.reference.reference_experts import ReferenceExperts

__all__ = ["DenseExperts", "ReferenceExperts"]
