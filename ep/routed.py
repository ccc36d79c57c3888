"""EpRouted: dispatch -> experts -> combine (+ latent RMSNorm) for one rank of a DEP group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from dep_ep.comm.buffers import EpBuffers, resolve_device
from dep_ep.comm.transport import Transport, open_transport
from dep_ep.experts.base import ExpertsBackend

from dep_ep.checks import check_ids, check_tensor, check_tokens, check_weights_finite
from dep_ep.config import EpConfig


@dataclass(frozen=True)
class ReceiveRows:
    """This rank's receive rows for a step of T tokens (R = num_ranks * stride(T) rows):
    x uint8 [R, L], sf uint8 [R, L/32], ids int32 [R, K] (-1 = not for this rank), weights fp32
    [R, K]; out bf16 [R, L] is where an experts backend writes its sums for combine."""

    x: torch.Tensor
    sf: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor


class EpRouted:
    """The routed-expert path of every MoE layer of one rank: buffers shared by all layers.

    Collective calls (every rank of `group`, same order, same T): construction, `dispatch`,
    `combine`, `routed` (the object is callable: `ep(...)` is `ep.routed(...)`), `close`. On CPU
    each blocks the host and completes before it returns; on CUDA (NVSHMEM buffers, CuTeDSL
    kernels) dispatch/combine/routed are stream-ordered, never sync the host and can be captured
    in a CUDA graph; `synchronize()` waits and reports a timeout. A context manager:
    `with EpRouted(...) as ep:` closes on exit.

    group: gloo group of the EP ranks (it carries the CPU barriers, or the NVSHMEM bootstrap);
    max_tokens: the most tokens a rank passes in a step; device: "cpu" or a CUDA device;
    num_experts: E (divisible by the rank count; rank r owns [r*E/N, (r+1)*E/N)); latent: L
    (a multiple of 32); topk: K; config: runtime settings (timeouts, value checks, combine path).
    On CPU a call whose input one rank rejects raises on every rank (ValueError/TypeError on the
    rejecting rank, EpPeerError elsewhere) and the buffers stay usable; on CUDA the rejecting rank
    raises and the others time out (docs/design.md, "Errors").
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        max_tokens: int,
        device: torch.device | str,
        *,
        num_experts: int,
        latent: int,
        topk: int,
        config: EpConfig | None = None,
    ) -> None:
        config = EpConfig() if config is None else config
        if not isinstance(config, EpConfig):
            raise TypeError(f"EpRouted: config is {type(config).__name__}; expected an EpConfig")
        num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        for name, value in (("num_experts", num_experts), ("latent", latent), ("topk", topk),
                            ("max_tokens", max_tokens)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"EpRouted: {name}={value!r}; expected an int")
        if num_experts < 1 or num_experts % num_ranks:
            raise ValueError(
                f"EpRouted: num_experts={num_experts} must be a positive multiple of the rank"
                f" count {num_ranks}"
            )
        if not 1 <= topk <= num_experts:
            raise ValueError(f"EpRouted: topk={topk} outside 1..{num_experts} (num_experts)")
        if max_tokens < 1:
            raise ValueError(f"EpRouted: max_tokens={max_tokens} must be >= 1")
        self.config = config
        self.device = resolve_device(device)
        self.num_experts, self.latent, self.topk = num_experts, latent, topk
        self.num_ranks, self.rank, self.max_tokens = num_ranks, rank, max_tokens
        self.experts_per_rank = num_experts // num_ranks
        self.first_expert = rank * self.experts_per_rank
        self.buffers = EpBuffers(
            group, num_ranks, rank, max_tokens, self.device,
            latent=latent, topk=topk, timeout_s=config.timeout_s,
        )  # fmt: skip
        try:
            self._transport = open_transport(self.buffers, self.experts_per_rank, config)
        except BaseException:
            self.buffers.close()
            raise
        # Value checks (ids range, finite weights) read the tensors: free where calls complete on
        # return, a host sync where they are stream-ordered.
        check = config.check_values
        self.check_values = self._transport.completes_on_return if check is None else check
        self._expert_out = torch.empty(
            self.buffers.layout.max_rows, latent, dtype=torch.bfloat16, device=self.device
        )
        self._dispatched: torch.Tensor | None = None  # int32 ids of the dispatch awaiting combine

    # ----------------------------------------------------------------------------- lifetime
    def __enter__(self) -> EpRouted:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def transport(self) -> Transport:
        """The transport under this EpRouted (HostTransport or DeviceTransport). For benchmarks
        that time one phase alone: its calls skip validation and the dispatch/combine pairing."""
        return self._transport

    # ----------------------------------------------------------------------------- geometry
    def prepare(self, tokens: int) -> int:
        """Check `tokens` and get ready for steps of that size; returns stride(T). Local, cheap."""
        check_tokens("EpRouted.prepare", tokens, self.max_tokens)
        return self.buffers.layout.stride(tokens)

    def receive(self, tokens: int) -> ReceiveRows:
        """This rank's receive rows for a step of `tokens` tokens (valid after dispatch)."""
        rows = self.buffers.layout.rows(check_tokens("EpRouted.receive", tokens, self.max_tokens))
        b = self.buffers
        out = self._expert_out[:rows]
        return ReceiveRows(b.x(rows), b.sf(rows), b.ids(rows), b.weights(rows), out)

    # ----------------------------------------------------------------------------- validation
    def _check_inputs(self, fn, latent, ids, weights, experts) -> int:
        if not isinstance(latent, torch.Tensor) or latent.dim() != 2:
            shape = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent)
            raise ValueError(f"{fn}: latent {shape}; expected a 2-D tensor [T, {self.latent}]")
        tokens = check_tokens(fn, latent.shape[0], self.max_tokens)
        check_tensor(fn, "latent", latent, (torch.bfloat16,), (tokens, self.latent), self.device)
        shape = (tokens, self.topk)
        check_tensor(fn, "ids", ids, (torch.int32, torch.int64), shape, self.device)
        check_tensor(fn, "weights", weights, (torch.float32,), shape, self.device)
        if self.check_values:
            check_ids(fn, ids, self.num_experts)
            check_weights_finite(fn, weights, ids)
        if experts is not None:
            self._check_experts(fn, experts)
        return tokens

    def _check_experts(self, fn: str, experts: ExpertsBackend) -> None:
        if not isinstance(experts, ExpertsBackend):
            raise TypeError(
                f"{fn}: experts is {type(experts).__name__}; expected an ExpertsBackend"
            )
        mine = (self.first_expert, self.experts_per_rank, self.latent)
        theirs = (experts.first_expert, experts.num_local_experts, experts.latent)
        if theirs != mine:
            raise ValueError(
                f"{fn}: experts hold first_expert={theirs[0]}, {theirs[1]} experts, latent"
                f" {theirs[2]}; rank {self.rank} owns experts {mine[0]}..{mine[0] + mine[1] - 1}"
                f" (first_expert={mine[0]}, {mine[1]} experts) of latent {mine[2]}"
            )

    def _check_norm(self, fn: str, norm_weight: torch.Tensor, eps: float) -> None:
        check_tensor(fn, "norm_weight", norm_weight, (torch.bfloat16,), (self.latent,), self.device)
        if not (isinstance(eps, float) and eps > 0):
            raise ValueError(f"{fn}: eps={eps!r}; expected a float > 0")

    def _check_open(self, fn: str) -> None:
        if self.buffers.closed:
            raise RuntimeError(f"{fn}: this EpRouted was closed")

    # ----------------------------------------------------------------------------- the path
    def dispatch(
        self,
        latent: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        *,
        experts: ExpertsBackend | None = None,
    ) -> ReceiveRows:
        """Quantize each token to MXFP8 once and deliver it to every rank owning one of its experts.

        latent bf16 [T, L]; ids int32|int64 [T, K] global expert ids, -1 = none (padding rows);
        weights fp32 [T, K]. Collective; on CPU it blocks until every rank has delivered. Returns
        this rank's receive rows. `experts`, when given, is validated with the inputs.
        """
        return self._dispatch("EpRouted.dispatch", latent, ids, weights, experts)

    def _dispatch(self, fn, latent, ids, weights, experts) -> ReceiveRows:
        self._check_open(fn)
        if self._dispatched is not None:
            raise RuntimeError(f"{fn}: the previous dispatch was not combined yet")
        error, tokens = None, 0
        try:
            tokens = self._check_inputs(fn, latent, ids, weights, experts)
        except (TypeError, ValueError) as err:
            error = err
        if error is None:
            # A copy, never a reference: combine reads the ids again, and the caller may reuse
            # its tensor in between.
            ids = ids.to(torch.int32, copy=True)
        self._transport.dispatch(latent, ids, weights, tokens=tokens, rejected=error)
        self._dispatched = ids
        return self.receive(tokens)

    def combine(self, norm_weight: torch.Tensor, *, eps: float = 1e-5) -> torch.Tensor:
        """Return the expert sums (`receive(T).out`, rows with a local id) to their sources, sum per
        token over ranks in fp32 in rank order, RMSNorm with `norm_weight` (bf16 [L]) and `eps`.

        Collective; on CPU it blocks until every rank has delivered. Returns bf16 [T, L].
        """
        return self._combine("EpRouted.combine", norm_weight, eps, None)

    def _combine(self, fn, norm_weight, eps, error) -> torch.Tensor:
        self._check_open(fn)
        ids = self._dispatched
        if ids is None:
            raise RuntimeError(f"{fn}: no dispatch to combine")
        self._dispatched = None
        if error is None:
            try:
                self._check_norm(fn, norm_weight, eps)
            except (TypeError, ValueError) as err:
                error = err
        out = self.receive(ids.shape[0]).out
        return self._transport.combine(out, ids, norm_weight, float(eps), rejected=error)

    def routed(
        self,
        latent: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        norm_weight: torch.Tensor,
        *,
        experts: ExpertsBackend,
        eps: float = 1e-5,
    ) -> torch.Tensor:
        """dispatch -> experts.forward on the receive rows -> combine. Returns bf16 [T, L] =
        RMSNorm(sum over the token's experts of weight * expert(latent)). Collective."""
        fn = "EpRouted.routed"
        rows = self._dispatch(fn, latent, ids, weights, experts)
        error = None
        try:
            experts.forward(rows.x, rows.sf, rows.ids, rows.weights, rows.out)
        except Exception as err:  # every rank must still reach combine's barrier
            error = err
        return self._combine(fn, norm_weight, eps, error)

    __call__ = routed

    def synchronize(self) -> None:
        """Wait for this rank's queued work and raise EpTimeoutError if a kernel recorded a timeout.
        On CPU every call completes before it returns and this only checks the state."""
        self._transport.synchronize()

    def close(self) -> None:
        """Release the buffers. Collective by contract; idempotent."""
        if not self.buffers.closed:
            self.buffers.close()
        self._dispatched = None
