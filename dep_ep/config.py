"""Model geometry of one MoE layer and its named presets (a leaf module: every layer imports it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dep_ep.checks import check_flag, check_real_between
from dep_ep.constants import SCALE_BLOCK


@dataclass(frozen=True)
class MoeGeometry:
    """hidden: model width (router input); latent: routed-expert width L (dispatch payload);
    experts: E routed experts; topk: K per token; intermediate: I of each expert."""

    name: str
    hidden: int
    latent: int
    experts: int
    topk: int
    intermediate: int

    def __post_init__(self) -> None:
        for field in ("hidden", "latent", "experts", "topk", "intermediate"):
            if getattr(self, field) < 1:
                raise ValueError(f"MoeGeometry {self.name}: {field} must be >= 1")
        for field in ("latent", "intermediate"):
            if getattr(self, field) % SCALE_BLOCK:
                raise ValueError(
                    f"MoeGeometry {self.name}: {field}={getattr(self, field)} must be a multiple"
                    f" of {SCALE_BLOCK}"
                )
        if self.topk > self.experts:
            raise ValueError(f"MoeGeometry {self.name}: topk={self.topk} > experts={self.experts}")


# Kimi K3's MoE layer (the released checkpoint's text_config; docs/formats.md).
K3 = MoeGeometry("k3", hidden=7168, latent=3584, experts=896, topk=16, intermediate=3072)
# Small enough for 4 CPU ranks in seconds; 48 experts divide over 1, 2, 3, 4, 6, 8, 12, 16 ranks.
TINY = MoeGeometry("tiny", hidden=512, latent=256, experts=48, topk=6, intermediate=128)

PRESETS = {g.name: g for g in (K3, TINY)}


# The latent RMSNorm's eps: Kimi K3's (docs/formats.md), the default of every eps= of EpRouted
# and EpMoeLayer.
DEFAULT_NORM_EPS = 1e-5
# Kimi K3's routed_scaling_factor (docs/formats.md): the default of the router's and EpMoeLayer's.
DEFAULT_ROUTED_SCALING_FACTOR = 1.0
DEFAULT_TIMEOUT_S = 60.0
# A dead peer's waits end within this (plus HOST_ABORT_POLL_NS); ten reads of /proc a second.
DEFAULT_PEER_WATCH_S = 0.1


@dataclass(frozen=True)
class EpConfig:
    """Runtime settings of one EpRouted (the geometry is its constructor's arguments).

    timeout_s: bounds every wait of the library (barriers, step flags, the construction's
      exchanges); expiry raises EpTimeoutError naming the rank, the phase and the peers.
      Above 0 and below 1e9 (the kernels hold it in int64 nanoseconds).
    check_values: read the ids (range) and the weights (finite) of every dispatch. Reading them
      syncs the host with a GPU, so None means on for CPU ranks and off for CUDA ranks.
    check_expert_rows: None means on for CPU ranks and off for CUDA ranks (where it cost 4.1 us
      on a 119.9 us K3 routed step at EP=1, T = 1, HopperExperts (humming), one H200; larger T
      not measured). On, dispatch marks the expert output rows, and before the combine a check
      fails the step on every rank when a row that holds a local expert id was not written since
      the dispatch (experts skipped or writing elsewhere): EpUnwrittenRowsError on this rank,
      EpPeerError on the others (on GPU at the next call, poll() or synchronize(), every output
      of the step NaN). No host sync: on GPU a fill at dispatch and one check launch at combine
      (ep/unwritten_rows.py), captured in a CUDA graph as well.
      A row counts as written once its element 0 changed: a backend that fills `out` first
      (zeros, say) and then skips rows, or writes element 0 alone, is not caught. Off, such a
      combine returns sums of whatever the rows hold (the previous call's, for instance).
    peer_watch_s: on CUDA ranks, how often a thread looks at the peers' processes (those on this
      host) and at the peers' reset() rounds (in the group's store), and, when a peer is gone or
      in a reset() this rank has not called, ends the kernels' waits (comm/peer_watch.py); None:
      no thread (poll() and synchronize() look instead; else the kernels' timeout is the bound).
    count_experts: every dispatch counts the (token, k) pairs this rank received per local
      expert, for EpRouted.expert_counts(). The count is taken right after the dispatch (one
      scatter-add on the device, stream-ordered): after the combine a peer's next dispatch may
      already be overwriting the receive rows.
    """

    timeout_s: float = DEFAULT_TIMEOUT_S
    check_values: bool | None = None
    check_expert_rows: bool | None = None
    peer_watch_s: float | None = DEFAULT_PEER_WATCH_S
    count_experts: bool = False

    def __post_init__(self) -> None:
        timeout = check_real_between(
            "EpConfig", "timeout_s", self.timeout_s, 0, 1e9, "seconds above 0 and below 1e9"
        )
        object.__setattr__(self, "timeout_s", timeout)
        if self.check_expert_rows is not None and not isinstance(self.check_expert_rows, bool):
            raise TypeError(
                f"EpConfig: check_expert_rows={self.check_expert_rows!r}; expected None or a bool"
            )
        check_flag("EpConfig", "count_experts", self.count_experts)
        if self.check_values not in (None, True, False):
            raise TypeError(f"EpConfig: check_values={self.check_values!r}; expected bool or None")
        if self.peer_watch_s is not None:
            check_real_between(
                "EpConfig", "peer_watch_s", self.peer_watch_s, 0, math.inf, "None or seconds > 0"
            )
