"""EpRouted: dispatch -> experts -> combine (+ latent RMSNorm) for one rank of a DEP group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from comm.buffers import EpBuffers, resolve_device
from comm.errors import EpPeerError
from comm.host_sync import bounded_barrier
from comm.layout import HEADER_SEQ, HEADER_STATUS, HEADER_TOKENS
from comm.mxfp8 import mxfp8_quantize
from comm.reference import combine_reduce, combine_write, dispatch_write
from ep.checks import check_ids, check_tensor, check_tokens, check_weights_finite
from experts.base import ExpertsBackend

_OK, _REJECTED = 0, 1
# Header slot per phase. One slot for both would race: after the dispatch barrier a fast rank may
# already write its combine status while a slow rank still reads the dispatch statuses. A phase's
# slot is rewritten only after the other phase's next barrier, which every reader passes first.
_SLOT = {"dispatch": 0, "combine": 1}


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
    `combine`, `routed`, `close`. On CPU each blocks the host and completes before it returns; on
    CUDA (NVSHMEM buffers, CuTeDSL kernels) dispatch/combine/routed are stream-ordered, never sync
    the host and can be captured in a CUDA graph; `synchronize()` waits and reports a timeout.
    group: gloo group of the EP ranks (it carries the CPU barriers, or the NVSHMEM bootstrap);
    max_tokens: the most tokens a rank passes in a step; experts: E (divisible by the rank count;
    rank r owns [r*E/N, (r+1)*E/N)); latent: L; topk: K. timeout_s bounds every wait; expiry
    raises EpTimeoutError naming rank, phase and peer. check_values: check ids range and finite
    weights (reads the tensors; default on for CPU, off for CUDA where it would sync the host).
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
        experts: int,
        latent: int,
        topk: int,
        timeout_s: float = 60.0,
        check_values: bool | None = None,
    ) -> None:
        num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        if experts < 1 or experts % num_ranks:
            raise ValueError(
                f"EpRouted: experts={experts} must be a positive multiple of the rank count"
                f" {num_ranks}"
            )
        if not 1 <= topk <= experts:
            raise ValueError(f"EpRouted: topk={topk} outside 1..{experts} (experts)")
        if max_tokens < 1:
            raise ValueError(f"EpRouted: max_tokens={max_tokens} must be >= 1")
        self.device = resolve_device(device)
        self.num_experts, self.latent, self.topk = experts, latent, topk
        self.num_ranks, self.rank, self.max_tokens = num_ranks, rank, max_tokens
        self.experts_per_rank = experts // num_ranks
        self.first_expert = rank * self.experts_per_rank
        self.buffers = EpBuffers(
            group, num_ranks, rank, max_tokens, self.device,
            latent=latent, topk=topk, timeout_s=timeout_s,
        )  # fmt: skip
        self._group, self._timeout_s = group, timeout_s
        self.on_gpu = self.device.type == "cuda"
        # Value checks (ids range, finite weights) read the tensors: a host sync on GPU.
        self.check_values = (not self.on_gpu) if check_values is None else check_values
        self._exchange = None
        if self.on_gpu:
            from comm.device_exchange import DeviceExchange

            self._exchange = DeviceExchange(self.buffers, self.experts_per_rank, timeout_s)
        self._expert_out = torch.empty(
            self.buffers.layout.max_rows, latent, dtype=torch.bfloat16, device=self.device
        )
        self._seq = 0
        self._dispatched: torch.Tensor | None = None  # ids of the dispatch awaiting combine

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

    # ----------------------------------------------------------------------------- host protocol
    def _agree(self, phase: str, error: Exception | None, tokens: int) -> None:
        """Publish this rank's status and T, wait for every rank, and raise on every rank if any
        rank rejected its input or the ranks' T differ. The barrier is the completion of `phase`:
        every write made before it (peers' rows) is visible after it."""
        self._seq += 1
        slot = _SLOT[phase]
        header = self.buffers.header[slot]
        header[HEADER_SEQ] = self._seq
        header[HEADER_TOKENS] = tokens if error is None else -1
        header[HEADER_STATUS] = _OK if error is None else _REJECTED
        bounded_barrier(self._group, self.rank, phase, self._timeout_s)
        headers = [peer.header[slot].clone() for peer in self.buffers.peers]
        stale = [r for r, h in enumerate(headers) if int(h[HEADER_SEQ]) != self._seq]
        assert not stale, f"rank {self.rank}: {phase} headers of {stale} are from another call"
        rejected = [r for r, h in enumerate(headers) if int(h[HEADER_STATUS]) != _OK]
        counts = [int(h[HEADER_TOKENS]) for h in headers]
        if not rejected and len(set(counts)) == 1:
            return
        # Everyone has read the headers before anyone may start the next call and rewrite them.
        bounded_barrier(self._group, self.rank, phase + "-abort", self._timeout_s)
        if error is not None:
            raise error
        if rejected:
            raise EpPeerError(
                f"EpRouted.{phase}: rank(s) {rejected} rejected their input; nothing was used"
            )
        raise ValueError(
            f"EpRouted.{phase}: ranks passed different token counts {counts}; every rank must"
            " pass the same T (pad with rows of -1 ids)"
        )

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
        _fn: str = "EpRouted.dispatch",
    ) -> ReceiveRows:
        """Quantize each token to MXFP8 once and deliver it to every rank owning one of its experts.

        latent bf16 [T, L]; ids int32|int64 [T, K] global expert ids, -1 = none (padding rows);
        weights fp32 [T, K]. Collective; on CPU it blocks until every rank has delivered. Returns
        this rank's receive rows. `experts`, when given, is validated with the inputs.
        """
        self._check_open(_fn)
        if self._dispatched is not None:
            raise RuntimeError(f"{_fn}: the previous dispatch was not combined yet")
        if self.on_gpu:
            self._exchange.check()
            tokens = self._check_inputs(_fn, latent, ids, weights, experts)
            ids = ids if ids.dtype == torch.int32 else ids.int()
            self._exchange.dispatch(latent, ids, weights)
            self._dispatched = ids
            return self.receive(tokens)
        error, tokens = None, 0
        try:
            tokens = self._check_inputs(_fn, latent, ids, weights, experts)
        except (TypeError, ValueError) as err:
            error = err
        if error is None:
            q, sf = mxfp8_quantize(latent)
            dispatch_write(self.buffers, q, sf, ids, weights, self.experts_per_rank)
        self._agree("dispatch", error, tokens)
        self._dispatched = ids
        return self.receive(tokens)

    def combine(
        self,
        norm_weight: torch.Tensor,
        *,
        eps: float = 1e-5,
        _fn: str = "EpRouted.combine",
        _error: Exception | None = None,
    ) -> torch.Tensor:
        """Return the expert sums (`receive(T).out`, rows with a local id) to their sources, sum per
        token over ranks in fp32 in rank order, RMSNorm with `norm_weight` (bf16 [L]) and `eps`.

        Collective; on CPU it blocks until every rank has delivered. Returns bf16 [T, L].
        """
        self._check_open(_fn)
        ids = self._dispatched
        if ids is None:
            raise RuntimeError(f"{_fn}: no dispatch to combine")
        tokens = ids.shape[0]
        if self.on_gpu:
            if _error is not None:
                raise _error
            self._check_norm(_fn, norm_weight, eps)
            normed = torch.empty(tokens, self.latent, dtype=torch.bfloat16, device=self.device)
            self._exchange.combine(self.receive(tokens).out, ids, norm_weight, float(eps), normed)
            self._dispatched = None
            return normed
        error = _error
        if error is None:
            try:
                self._check_norm(_fn, norm_weight, eps)
            except (TypeError, ValueError) as err:
                error = err
        if error is None:
            combine_write(self.buffers, self.receive(tokens).out, tokens)
        self._dispatched = None
        self._agree("combine", error, tokens)
        return combine_reduce(self.buffers, ids, self.experts_per_rank, norm_weight, eps)

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
        rows = self.dispatch(latent, ids, weights, experts=experts, _fn=fn)
        error = None
        try:
            experts.forward(rows.x, rows.sf, rows.ids, rows.weights, rows.out)
        except Exception as err:  # every rank must still reach combine's barrier
            error = err
        return self.combine(norm_weight, eps=eps, _fn=fn, _error=error)

    def synchronize(self) -> None:
        """Wait for this rank's queued work and raise EpTimeoutError if a kernel recorded a timeout.
        On CPU every call completes before it returns and this only checks the state."""
        if self.on_gpu:
            torch.cuda.current_stream(self.device).synchronize()
            self._exchange.check()

    def close(self) -> None:
        """Release the buffers. Collective by contract; idempotent."""
        if not self.buffers.closed:
            self.buffers.close()
        self._dispatched = None
