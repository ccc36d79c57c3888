"""NVSHMEM symmetric allocation for CUDA ranks: one allocation per rank, every peer's mapped."""

from __future__ import annotations

import torch

from dep_ep.comm.host_channel import ObjectBarriers
from dep_ep.launch.nvshmem import acquire_nvshmem, import_nvshmem, release_nvshmem


def allocate_nvshmem(
    barriers: ObjectBarriers,
    rank: int,
    num_ranks: int,
    nbytes: int,
    device: torch.device,
    timeout_s: float,
) -> list[torch.Tensor]:
    """Collective: uint8 tensors of `nbytes`, entry r = rank r's allocation as this process sees
    it (entry `rank` is its own). Zero-filled once here (the step flags start at call 0). The
    bootstrap's unique id travels in one of the object's host barriers (bounded by
    `timeout_s`)."""

    def share(uid: bytes | None) -> bytes:
        payload = {"uid": None if uid is None else uid.hex()}
        messages = barriers.exchange("nvshmem-bootstrap", payload, timeout_s)
        return bytes.fromhex(messages[0]["uid"] or "")

    pes = acquire_nvshmem(barriers.channel.group, device, share)
    nvshmem = import_nvshmem()
    try:
        own = nvshmem.tensor((nbytes,), dtype=torch.uint8)
        own.zero_()
        torch.cuda.synchronize(device)
        nvshmem.barrier_all(torch.cuda.current_stream(device))
        torch.cuda.synchronize(device)
        peers = [
            own if r == rank else nvshmem.get_peer_tensor(own, pes[r]) for r in range(num_ranks)
        ]
    except BaseException:
        release_nvshmem()
        raise
    if any(p is None for p in peers):
        raise RuntimeError("allocate_nvshmem: a peer's memory is not reachable by load/store")
    return peers


def free_nvshmem(own: torch.Tensor) -> None:
    """Collective: free this rank's allocation and drop one NVSHMEM user."""
    nvshmem = import_nvshmem()
    torch.cuda.synchronize(own.device)
    nvshmem.free_tensor(own)
    release_nvshmem()
