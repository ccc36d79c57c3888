"""Process launch: rank context, device binding, DEP groups, teardown. Only this package reads the
environment."""

from dep_ep.launch.context import DepGroup, RankContext, init_rank_context, new_dep_group, teardown
from dep_ep.launch.env import LaunchEnv, integration_enabled, read_launch_env

__all__ = [
    "DepGroup",
    "LaunchEnv",
    "integration_enabled",
    "RankContext",
    "init_rank_context",
    "new_dep_group",
    "read_launch_env",
    "teardown",
]
