"""Process launch: rank context, device binding, DEP groups, teardown. Only this package reads the
environment."""

from launch.context import DepGroup, RankContext, init_rank_context, new_dep_group, teardown
from launch.env import LaunchEnv, read_launch_env

__all__ = [
    "DepGroup",
    "LaunchEnv",
    "RankContext",
    "init_rank_context",
    "new_dep_group",
    "read_launch_env",
    "teardown",
]
