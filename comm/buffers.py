"""EpBuffers: one symmetric allocation per rank (sized by EpLayout for max_tokens) and views of
every rank's regions. CPU: POSIX shared memory (comm/shm.py); CUDA: NVSHMEM
(comm/nvshmem_alloc.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dep_ep.comm.agreement import Agreement, agree_on_construction
from dep_ep.comm.layout import EpLayout, Region
from dep_ep.comm.nvshmem_alloc import allocate_nvshmem, free_nvshmem
from dep_ep.comm.shm import allocate_shm


def resolve_device(fn: str, device: object) -> torch.device:
    """The torch.device `device` names, in the form tensors report theirs: "cpu" for any CPU
    spelling ("cpu:0" included), "cuda:<index>" for CUDA ("cuda" -> the current device).
    ValueError for a device this process cannot use (CUDA in a torch without it, an index past
    the devices, another kind); TypeError for what is not a device."""
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"{fn}: device={device!r}; expected a torch.device or a string")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"{fn}: device={device!r} is not a device ({err})") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"{fn}: device={device}; allowed: cpu, cuda")
    if not torch.cuda.is_available():
        raise ValueError(f"{fn}: device={device}, but this torch has no usable CUDA device")
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(
            f"{fn}: device={device}; this process sees {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", index)


class RankRegions:
    """Typed views of one rank's allocation (own or a peer's). Row-count arguments are receive
    rows (`layout.rows(T)`); each view is the first `rows` rows of the region."""

    def __init__(self, segment: torch.Tensor, layout: EpLayout) -> None:
        self._segment = segment
        self._layout = layout
        # Each region typed and shaped at capacity, once: a call then takes one slice of it (the
        # three view ops a region took per call were most of an eager step's host time).
        self._full = {name: self._typed(region) for name, region in layout.regions.items()}

    def _typed(self, region: Region) -> torch.Tensor:
        raw = self._segment[region.offset : region.offset + region.nbytes]
        return raw.view(region.dtype).view(region.shape)

    def _view(self, name: str, rows: int | None) -> torch.Tensor:
        full = self._full[name]
        if rows is None:
            return full
        if not 0 <= rows <= self._layout.max_rows:
            raise ValueError(f"EpBuffers.{name}: rows={rows} outside 0..{self._layout.max_rows}")
        return full[:rows]

    @property
    def base_address(self) -> int:
        """Address of the allocation's first byte in this process (regions at layout offsets)."""
        return self._segment.data_ptr()

    def span(self, name: str) -> tuple[int, int]:
        """[first, end) byte addresses of region `name` at capacity in this process."""
        region = self._layout.regions[name]
        start = self._segment.data_ptr() + region.offset
        return start, start + region.nbytes

    @property
    def segment(self) -> torch.Tensor:
        """uint8 [layout.total_bytes]: the whole allocation as this process maps it (every
        region's bytes)."""
        return self._segment

    def x(self, rows: int) -> torch.Tensor:
        """uint8 [rows, L]: MXFP8 e4m3 bytes."""
        return self._view("x", rows)

    def sf(self, rows: int) -> torch.Tensor:
        """uint8 [rows, L/32]: E8M0 scale bytes, linear layout."""
        return self._view("sf", rows)

    def ids(self, rows: int) -> torch.Tensor:
        """int32 [rows, K]: global expert ids owned by this rank, -1 elsewhere."""
        return self._view("ids", rows)

    def weights(self, rows: int) -> torch.Tensor:
        """fp32 [rows, K]: routing weights as the source sent them."""
        return self._view("weights", rows)

    @property
    def flags(self) -> torch.Tensor:
        """int64 [3, N, 4]: GPU step flags per phase (dispatch, combine, combine-end) and source
        rank."""
        return self._view("flags", None)

    def out(self, rows: int) -> torch.Tensor:
        """bf16 [rows, L]: the expert output rows, row s*S + t = this rank's sum over its local
        experts for token t of source s (written by the experts, read by the sources' combine)."""
        return self._view("out", rows)


class EpBuffers(RankRegions):
    """Symmetric receive buffers of one rank of an EP group of `ranks` ranks.

    Collective: construction and `close()` are called by every rank of `group` in the same order.
    Construction blocks the host (allocation, mapping and bounded host barriers: on CPU
    `shm-check`, `shm-create` and `shm-map`; on CUDA `nvshmem-bootstrap`, then NVSHMEM's
    `barrier_all`; before them `construction` when no `agreement` is given). The views `x(rows)`,
    `sf(rows)`, `ids(rows)`, `weights(rows)`, `out(rows)` are this rank's; `peers[r]` gives the
    same views of rank r's allocation (writes land in rank r's memory).

    group: a gloo group (CPU: its ranks map each other's shared memory; CUDA: it carries the NVSHMEM
    bootstrap and host barriers). On CUDA every rank's allocation is reachable through NVLink (or
    the same GPU) and `peer_addresses` holds their base addresses for the kernels.
    ranks: group size; rank: this process's rank in `group`.
    max_tokens: tokens per rank per step, at most; latent: L (multiple of 32); topk: K.
    timeout_s bounds every wait of the construction. agreement: what the ranks agreed on at
    construction (EpRouted passes its own: the object's id, which names the shared-memory files,
    and its host barriers); None runs the agreement here, which also checks that every rank asks
    for the same layout and device kind. `barriers` (comm/host_channel.py) carries the object's
    host barriers from then on (the CPU transport's steps, reset).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        ranks: int,
        rank: int,
        max_tokens: int,
        device: torch.device | str,
        *,
        latent: int,
        topk: int,
        timeout_s: float = 60.0,
        agreement: Agreement | None = None,
    ) -> None:
        device = resolve_device("EpBuffers", device)
        if dist.get_world_size(group) != ranks or dist.get_rank(group) != rank:
            raise ValueError(
                f"EpBuffers: ranks={ranks} rank={rank}, but the group has"
                f" {dist.get_world_size(group)} ranks and this process is {dist.get_rank(group)}"
            )
        layout = EpLayout(ranks, max_tokens, latent, topk)
        own = agreement is None  # EpRouted agrees on more and passes its own
        if own:
            fingerprint = {"layout": layout, "device": device.type}
            agreement = agree_on_construction("EpBuffers", group, fingerprint, timeout_s)
        self.barriers = agreement.barriers
        try:
            segments = self._allocate(group, rank, ranks, layout, device, agreement, timeout_s)
        except BaseException:
            self.barriers.close()
            raise
        try:
            super().__init__(segments[rank], layout)
            self.group, self.rank, self.num_ranks = group, rank, ranks
            self.device, self.layout, self.timeout_s = device, layout, timeout_s
            self._peers = [RankRegions(seg, layout) for seg in segments]
            # int64 [N] on the device: base address of every rank's allocation, for the kernels.
            self.peer_addresses = torch.tensor(
                [seg.data_ptr() for seg in segments], dtype=torch.int64, device=device
            )
        except BaseException:  # a KeyboardInterrupt, say: leave as close() would
            self.barriers.close()
            if device.type == "cuda":
                free_nvshmem(segments[rank])
            raise
        self._closed = False
        if own:
            self.barriers.built()

    @staticmethod
    def _allocate(group, rank, ranks, layout, device, agreement, timeout_s):
        """Every rank's segment of `layout.total_bytes`, as this process maps it."""
        if device.type == "cpu":
            if dist.get_backend(group) != "gloo":
                raise ValueError(
                    f"EpBuffers: CPU buffers need a gloo group, got {dist.get_backend(group)}"
                )
            return allocate_shm(
                agreement.barriers,
                rank,
                ranks,
                layout.total_bytes,
                job=agreement.job,
                timeout_s=timeout_s,
            )
        return allocate_nvshmem(
            agreement.barriers, rank, ranks, layout.total_bytes, device, timeout_s
        )

    def _view(self, name: str, rows: int | None) -> torch.Tensor:
        if self._closed:
            raise RuntimeError(f"EpBuffers.{name}: the buffers were closed")
        return super()._view(name, rows)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peers(self) -> list[RankRegions]:
        """Every rank's regions as this process maps them, in rank order (this rank's among
        them). RuntimeError once closed: a close() that lands inside a call (a signal handler's)
        must fail that call, not leave it an empty list of ranks to sum (rows of zeros)."""
        if self._closed:
            raise RuntimeError("EpBuffers.peers: the buffers were closed")
        return self._peers

    def close(self) -> None:
        """Release this rank's mappings. Collective by contract (NVSHMEM's free is); on CPU it is
        local and views handed out earlier keep their mapping alive until they are dropped."""
        if self._closed:
            return
        # The peers are told first (the barriers' closed mark): a close() interrupted there is
        # still open, and a retry tells them.
        self.barriers.close()
        self._closed = True  # before the peers go: `peers` raises from here on
        own, self._segment = self._segment, torch.empty(0, dtype=torch.uint8)
        self._full = {}
        self._peers = []
        if self.device.type == "cuda":
            free_nvshmem(own)
