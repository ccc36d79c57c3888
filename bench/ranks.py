"""Numbers agreed over a benchmark's ranks (the CPU group): the slowest rank's, the mean."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduced(value: float, group, op=dist.ReduceOp.SUM) -> float:
    """`value` reduced by `op` over the ranks of `group` (each rank gets the result)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return float(t)


def slowest(value: float, group) -> float:
    """The largest `value` over the ranks of `group` (a time: the slowest rank's)."""
    return all_reduced(value, group, dist.ReduceOp.MAX)


def mean(value: float, group) -> float:
    """The mean of `value` over the ranks of `group`."""
    return all_reduced(value, group) / dist.get_world_size(group)
