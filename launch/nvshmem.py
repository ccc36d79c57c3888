"""NVSHMEM bootstrap from a unique id group rank 0 draws and the caller shares, reused when the
host process initialised NVSHMEM itself; finalized only when we initialised it and the last user
is gone.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

GPU_EXTRA = "pip install 'nvshmem4py-cu13>=0.4' 'nvidia-cutlass-dsl[cu13]>=4.8' 'cuda-python>=13'"

_state = {"users": 0, "created": False}


def import_nvshmem():
    """nvshmem.core, or an ImportError that gives the pip line."""
    try:
        import nvshmem.core as nvshmem
    except ImportError as err:
        raise ImportError(
            f"GPU symmetric buffers need NVSHMEM's Python bindings: {GPU_EXTRA}"
        ) from err
    return nvshmem


def _device(index: int):
    try:
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device
    dev = Device(index)
    dev.set_current()
    return dev


def acquire_nvshmem(
    group: dist.ProcessGroup, device: torch.device, share: Callable[[bytes | None], bytes]
) -> list[int]:
    """Make NVSHMEM usable by this process; returns the NVSHMEM PE of every rank of `group`.

    Collective over `group`: group rank 0 draws a unique id, `share(its bytes)` on rank 0 and
    `share(None)` on the others return rank 0's bytes on every rank (the caller's bounded host
    barrier), and every rank initialises with PE = its group rank. Every rank calls `share`, even
    when NVSHMEM is initialised already. When the host initialised NVSHMEM, PEs are taken as world
    ranks (the host's job must span the world with PE = world rank). Pair every call with
    `release_nvshmem`.
    """
    nvshmem = import_nvshmem()
    import numpy as np

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    initialised = int(nvshmem.init_status()) >= 2  # by us or by the host
    uid = None if initialised else nvshmem.get_unique_id(empty=rank != 0)
    raw = None if uid is None else uid._data.view(np.int8)
    shared = share(raw.tobytes() if raw is not None and rank == 0 else None)
    if initialised:
        if _state["created"]:
            pes = list(range(dist.get_world_size(group)))
        else:
            if nvshmem.n_pes() != dist.get_world_size():
                raise RuntimeError(
                    f"acquire_nvshmem: the host initialised NVSHMEM with {nvshmem.n_pes()} PEs;"
                    f" reuse needs one PE per world rank ({dist.get_world_size()})"
                )
            pes = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        _state["users"] += 1
        return pes
    if len(shared) != raw.nbytes:
        raise RuntimeError(
            "acquire_nvshmem: group rank 0 has NVSHMEM initialised already and this rank does not;"
            " initialise it on every rank of the group or on none"
        )
    raw[:] = np.frombuffer(shared, dtype=np.int8)
    nvshmem.init(
        device=_device(device.index), uid=uid, rank=rank, nranks=size, initializer_method="uid"
    )
    _state["created"] = True
    _state["users"] += 1
    return list(range(size))


def release_nvshmem() -> None:
    """Drop one user; finalize NVSHMEM when we initialised it and nobody uses it any more."""
    _state["users"] -= 1
    if _state["users"] == 0 and _state["created"]:
        import_nvshmem().finalize()
        _state["created"] = False
