"""POSIX shared-memory symmetric allocation for CPU ranks: one file per rank, mapped by every rank.

Each rank creates `/dev/shm/dep-ep-<job>-<rank>`, every rank maps every file, and each rank unlinks
its own file as soon as all ranks have mapped it: the memory lives on in the mappings, and no file
is left behind when a rank dies later (even by SIGKILL). A failed setup unlinks every file of the
job that this rank can see.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dep_ep.comm.host_sync import bounded_barrier

SHM_DIR = "/dev/shm"
SHM_PREFIX = "dep-ep-"


def _path(shm_dir: str, job: str, rank: int) -> str:
    return os.path.join(shm_dir, f"{SHM_PREFIX}{job}-{rank}")


def allocate_shm(
    group: dist.ProcessGroup,
    rank: int,
    num_ranks: int,
    nbytes: int,
    *,
    job: str,
    timeout_s: float,
    shm_dir: str = SHM_DIR,
) -> list[torch.Tensor]:
    """Collective: every rank gets `num_ranks` uint8 tensors of `nbytes`, entry r mapping rank r's
    segment (entry `rank` is this rank's own). Contents start zeroed. Blocks the host. `job` is a
    tag every rank agreed on (comm/agreement.py), unique to this allocation.
    """
    own = _path(shm_dir, job, rank)
    try:
        fd = os.open(own, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        bounded_barrier(group, rank, "shm-create", timeout_s)
        segments = [
            torch.from_file(_path(shm_dir, job, r), shared=True, size=nbytes, dtype=torch.uint8)
            for r in range(num_ranks)
        ]
        bounded_barrier(group, rank, "shm-map", timeout_s)
    except BaseException:
        for r in range(num_ranks):
            try:
                os.unlink(_path(shm_dir, job, r))
            except FileNotFoundError:
                pass
        raise
    os.unlink(own)
    return segments
