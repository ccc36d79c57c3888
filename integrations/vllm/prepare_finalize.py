"""dep_ep as vLLM 0.33.0's modular prepare/finalize (FusedMoEPrepareAndFinalizeModular), for MoE
models other than Kimi K3 whose experts take MXFP8 activations (e4m3 bytes, one E8M0 scale
byte per 32) and global expert ids with -1 for "not on this rank":

    prepare   -> EpRouted.dispatch: the receive rows (x viewed as float8_e4m3fn [R, L], sf uint8
                 [R, L/32], no token metadata, ids int32 [R, K], weights fp32 [R, K])
    allocate_fused_expert_output -> the receive rows' out (bf16 [R, L]), so the experts write
                 where combine reads
    finalize  -> EpRouted.combine(None, out=output): the plain sum over ranks into the engine's
                 output (vLLM's norm and projections stay the model's)

The class is made by `prepare_finalize_class()` from the engine seam's base class, so importing
this module imports no vLLM. Installing it under a model is the engine's choice of
prepare/finalize (docs/integrations.md, "vLLM").
"""

from __future__ import annotations

from typing import Any

import torch

from dep_ep.ep.routed import EpRouted
from dep_ep.integrations.common import reject_bad_step
from dep_ep.integrations.vllm.engine import engine
from dep_ep.integrations.vllm.step_poll import install_step_poll
from dep_ep.integrations.vllm.steps import padding_mask, step_tokens

CLASS_NAME = "DepEpPrepareAndFinalize"
_CLASSES: dict[type, type] = {}


def _refusal(
    fn: str,
    apply_router_weight_on_input: object,
    defer_input_quant: object,
    routed: EpRouted,
    num_experts: object,
) -> Exception | None:
    """Why this rank cannot dispatch these inputs, or None."""
    if apply_router_weight_on_input:
        return ValueError(
            f"{fn}: apply_router_weight_on_input=True; dep_ep's experts apply the routing weights"
            " to their outputs"
        )
    if defer_input_quant:
        return ValueError(
            f"{fn}: defer_input_quant=True; dep_ep's dispatch sends MXFP8 rows, never the"
            " unquantized input"
        )
    if num_experts != routed.num_experts:
        return ValueError(
            f"{fn}: num_experts={num_experts!r}; the EpRouted routes {routed.num_experts} experts"
        )
    return None


def prepare_finalize_class() -> type:
    """DepEpPrepareAndFinalize(routed, *, sequence_parallel=1, num_dispatchers=1,
    layer_index=None), a subclass of the engine's FusedMoEPrepareAndFinalizeModular (made once
    per base class)."""
    base, standard_format = engine().prepare_finalize_base()
    made = _CLASSES.get(base)
    if made is not None:
        return made

    class DepEpPrepareAndFinalize(base):
        """routed: the EpRouted the layer's steps run on (its E, L, K are the layer's);
        sequence_parallel: the ranks a DP rank's tokens are split over, for T when the forward
        context gives the DP counts without per-rank sizes; num_dispatchers: vLLM's count of
        the ranks that dispatch to this one's experts; layer_index: the tag of this layer's
        steps (`EpRouted.register_layer`: None takes the next index in construction order).
        One instance per MoE layer, built in the same order on every rank (or each given the
        model's layer number): the tag makes a rank whose call is another layer's than its
        peers' raise EpDesyncError on every rank instead of pairing with it."""

        def __init__(
            self,
            routed: EpRouted,
            *,
            sequence_parallel: int = 1,
            num_dispatchers: int = 1,
            layer_index: int | None = None,
        ) -> None:
            super().__init__()
            if not isinstance(routed, EpRouted):
                raise TypeError(
                    f"{CLASS_NAME}: routed is {type(routed).__name__}; expected an EpRouted"
                )
            self.routed = routed
            self.sequence_parallel = sequence_parallel
            self.num_dispatchers_ = num_dispatchers
            self.layer_index = routed.register_layer(self, layer_index)

        def restart_steps(self) -> None:
            """EpRouted.reset's call to its registered layers: nothing to restart (the tag is
            the layer index alone)."""

        @property
        def activation_format(self) -> Any:
            return standard_format

        def topk_indices_dtype(self) -> torch.dtype | None:
            return torch.int32

        def max_num_tokens_per_rank(self) -> int | None:
            return None

        def num_dispatchers(self) -> int:
            return self.num_dispatchers_

        def output_is_reduced(self) -> bool:
            return True

        def prepare(
            self,
            a1: torch.Tensor,
            topk_weights: torch.Tensor,
            topk_ids: torch.Tensor,
            num_experts: int,
            expert_map: torch.Tensor | None,
            apply_router_weight_on_input: bool,
            quant_config: Any,
            defer_input_quant: bool = False,
        ) -> tuple:
            """Dispatch a1 bf16 [n, L] with its ids and weights [n, K] (padding rows' ids -1)
            for a step of T tokens (the forward context's), tagged with the layer index.
            Collective: a rank that refuses its arguments, or cannot read T from its forward
            context, takes part without payload (its peers raise EpPeerError); a rank whose
            previous prepare was never finalized aborts that step first
            (`EpRouted.abort_stale_step`)."""
            fn = f"{CLASS_NAME}.prepare"
            tag = self.layer_index
            # vLLM raised between an earlier prepare (any layer's) and its finalize:
            self.routed.abort_stale_step(fn, CLASS_NAME)
            refusal = _refusal(
                fn, apply_router_weight_on_input, defer_input_quant, self.routed, num_experts
            )
            if refusal is not None:
                self.routed.reject_step(refusal, tag=tag)
            try:
                context = engine().forward_context()
                tokens = step_tokens(context, a1.shape[0], self.sequence_parallel)
                padding = padding_mask(context)
            except Exception as err:  # on this rank alone: every rank must raise
                reject_bad_step(self.routed, fn, tag, "the forward context", err)
            got = self.routed.dispatch(
                a1,
                topk_ids,
                topk_weights,
                tokens=tokens,
                tag=tag,
                padding=padding,
                owner=CLASS_NAME,
            )
            return got.x.view(torch.float8_e4m3fn), got.sf, None, got.ids, got.weights

        def allocate_fused_expert_output(
            self,
            shape: tuple[int, ...],
            dtype: torch.dtype,
            device: torch.device,
            weight_and_reduce_impl: Any,
        ) -> torch.Tensor | None:
            """The pending step's receive rows' out when the engine asks for bf16 [R, L] (the
            experts then write where combine reads); else None (vLLM allocates, finalize
            copies)."""
            out = self.routed.receive().out
            if tuple(shape) == tuple(out.shape) and dtype == out.dtype:
                return out
            return None

        def finalize(
            self,
            output: torch.Tensor,
            fused_expert_output: torch.Tensor,
            topk_weights: torch.Tensor,
            topk_ids: torch.Tensor,
            apply_router_weight_on_input: bool,
            weight_and_reduce_impl: Any,
        ) -> None:
            """Combine the experts' rows into `output` (bf16 [n, L], written in place). Rows
            [R, L] are taken as weighted sums already; rows [R, K, L] are reduced first with
            `weight_and_reduce_impl` over the receive rows' ids and weights. Collective: an
            error here still completes the step on every rank (abort_step)."""
            fn = f"{CLASS_NAME}.finalize"
            out = self.routed.receive().out
            try:
                if fused_expert_output.dim() == 3:
                    rows = self.routed.receive()
                    weight_and_reduce_impl.apply(
                        output=out,
                        fused_expert_output=fused_expert_output,
                        topk_weights=rows.weights,
                        topk_ids=rows.ids,
                        apply_router_weight_on_input=False,
                    )
                elif fused_expert_output is not out:
                    if tuple(fused_expert_output.shape) != tuple(out.shape):
                        raise ValueError(
                            f"{fn}: fused_expert_output shape {tuple(fused_expert_output.shape)};"
                            f" expected the receive rows' {tuple(out.shape)} or [R, K, L]"
                        )
                    out.copy_(fused_expert_output)
            except Exception as err:  # every rank must still complete the step
                self.routed.abort_step(err)
            self.routed.combine(None, out=output)

    DepEpPrepareAndFinalize.__module__ = __name__
    DepEpPrepareAndFinalize.__qualname__ = CLASS_NAME
    _CLASSES[base] = DepEpPrepareAndFinalize
    return DepEpPrepareAndFinalize


def make_prepare_finalize(
    routed: EpRouted,
    *,
    sequence_parallel: int = 1,
    num_dispatchers: int = 1,
    layer_index: int | None = None,
) -> Any:
    """A DepEpPrepareAndFinalize on `routed` for one MoE layer, with the per-step poll installed
    (it is built in a worker process)."""
    install_step_poll()
    return prepare_finalize_class()(
        routed,
        sequence_parallel=sequence_parallel,
        num_dispatchers=num_dispatchers,
        layer_index=layer_index,
    )
