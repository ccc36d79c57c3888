"""The yardsticks the library is measured with, kept out of the library proper (nothing under
dep_ep.launch, comm, experts or ep imports this package): the all-gather reference of the routed
path, deterministic synthetic weights and routing, and the tolerance model with its checks.
Tests, benchmarks and examples import them from here. `dep_ep.testing.internals` reaches EpRouted's
private transport and buffers, bypassing its validation: for tests and benchmarks only."""

from dep_ep.testing.allgather_reference import allgather_reference, expert_sums, routed_reference
from dep_ep.testing.compare import compare, compare_rel_l2, rel_l2
from dep_ep.testing.synthetic import ROUTINGS, SyntheticLayer, synthetic_ids

__all__ = [
    "ROUTINGS",
    "SyntheticLayer",
    "allgather_reference",
    "compare",
    "compare_rel_l2",
    "expert_sums",
    "rel_l2",
    "routed_reference",
    "synthetic_ids",
]
