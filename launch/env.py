"""Read who-am-I from the launcher's environment (torchrun, Open MPI, MPICH (Hydra), or none),
and the opt-in flags of the engine integrations (`DEP_EP_<ENGINE>=1`).

This file and `launch/context.py` are the only places in the library that read `os.environ`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process.

    launcher: "torchrun" | "openmpi" | "mpich" | "single" (no launcher: one process).
    master_addr / master_port: the rendezvous torchrun gives (or the user set); None under mpirun
    without them, in which case `init_rank_context` agrees on a port through mpi4py.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"LaunchEnv: rank={self.rank} world_size={self.world_size} from {self.launcher}:"
                " need 0 <= rank < world_size"
            )
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"LaunchEnv: local_rank={self.local_rank} local_world_size="
                f"{self.local_world_size} from {self.launcher}: need 0 <= local_rank < local size"
            )


# (launcher, rank, size, local rank, local size): the first launcher whose rank variable is set
# wins.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"read_launch_env: {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"read_launch_env: {name}={value!r} is not an integer") from None


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Parse the launcher variables of `environ` (default `os.environ`).

    Local rank and size fall back to (rank, world size) when a launcher does not set them (one
    node).
    """
    environ = os.environ if environ is None else environ
    port = environ.get("MASTER_PORT")
    addr = environ.get("MASTER_ADDR")
    for launcher, rank_var, size_var, local_var, local_size_var in _LAUNCHERS:
        if rank_var not in environ:
            continue
        rank = _int(environ, rank_var)
        size = _int(environ, size_var)
        return LaunchEnv(
            launcher=launcher,
            rank=rank,
            world_size=size,
            local_rank=_int(environ, local_var, rank),
            local_world_size=_int(environ, local_size_var, size),
            master_addr=addr,
            master_port=_int(environ, "MASTER_PORT") if port is not None else None,
        )
    return LaunchEnv("single", 0, 1, 0, 1, addr, _int(environ, "MASTER_PORT") if port else None)


def integration_enabled(engine: str, environ: Mapping[str, str] | None = None) -> bool:
    """True when `DEP_EP_<ENGINE>=1` is set (e.g. DEP_EP_VLLM=1): an engine plugin of dep_ep
    stays a no-op without it, so installing dep_ep beside an engine changes nothing until the
    operator asks for it."""
    environ = os.environ if environ is None else environ
    return environ.get(f"DEP_EP_{engine.upper()}", "") == "1"
