"""dep_ep's dispatch and combine as an SGLang `BaseDispatcher`, for MoE models other than Kimi K3:
under `--moe-a2a-backend flashinfer` (and DEP_EP_SGLANG=1) `create_moe_dispatcher` builds it
instead of SGLang's FlashinferDispatcher. Its dispatch returns this rank's receive rows in the
FlashInfer dispatcher's output shape (MXFP8 rows, StandardTopKOutput, the output buffer for the
runner), and its combine returns the runner's row sums to their tokens.

The class derives from SGLang's BaseDispatcher, so it is made at the first call
(`dispatcher_class`), from the engine seam's types; this module imports no SGLang.
"""

from __future__ import annotations

import torch

from dep_ep.integrations.common import shared_routed
from dep_ep.integrations.sglang.engine import engine
from dep_ep.integrations.sglang.steps import step_inputs

# BaseDispatcher (SGLang's or a stand-in) -> the dispatcher class derived from it.
_CLASSES: dict[type, type] = {}


def create_moe_dispatcher(original, moe_runner_config: object, quant_method: object) -> object:
    """AROUND hook of `create_moe_dispatcher(moe_runner_config, quant_method)`
    (`sglang.srt.layers.moe.fused_moe_triton.layer`, called by every FusedMoE's constructor):
    dep_ep's dispatcher under `--moe-a2a-backend flashinfer`, SGLang's for every other
    backend (megamoe gets its no-op StandardDispatcher: K3's hook does the work there)."""
    if not engine().a2a_backend().is_flashinfer():
        return original(moe_runner_config, quant_method)
    return dispatcher_class()(moe_runner_config)


def dispatcher_class() -> type:
    """The dispatcher class derived from the engine's BaseDispatcher (made once per base)."""
    base, output, combine_input, topk_output = engine().dispatcher_types()
    cls = _CLASSES.get(base)
    if cls is None:
        types = {"_output": output, "_combine_input": combine_input, "_topk_output": topk_output}
        cls = type("DepEpDispatcher", (DepEpDispatch, base), types)
        _CLASSES[base] = cls
    return cls


class DepEpDispatch:
    """The methods of the dispatcher (`dispatcher_class` puts SGLang's BaseDispatcher behind
    them). One per FusedMoE layer, all sharing the process's EpRouted; built at model
    construction, collective at the first layer (every rank builds its layers in order).

    moe_runner_config: the layer's MoeRunnerConfig (num_experts E, top_k K, hidden_size, the
    EpRouted's latent L, layer_id, the call's tag, runner_backend). max_tokens: SGLang's
    SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK, which must be set: dep_ep sends every
    step, prefill included, through the one all-to-all."""

    _output: type
    _combine_input: type
    _topk_output: type

    def __init__(self, moe_runner_config: object) -> None:
        super().__init__()
        fn = "dep_ep.integrations.sglang.dispatcher.DepEpDispatcher"
        eng = engine()
        config = moe_runner_config
        self.runner_backend = config.runner_backend
        self.num_experts, self.layer_id = config.num_experts, config.layer_id
        max_tokens = eng.dispatch_max_tokens()
        if max_tokens is None:
            raise ValueError(
                f"{fn}: SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK is not set; dep_ep's"
                " dispatcher sizes its buffers from it: set it to the most tokens a rank passes"
                " in one step (the prefill chunk per rank included)"
            )
        self.routed = shared_routed(
            eng.ep_group(),
            eng.device(),
            num_experts=config.num_experts,
            latent=config.hidden_size,
            topk=config.top_k,
            max_tokens=max_tokens,
            config=eng.ep_config(count_experts=False),
        )
        # The "no expert" id the runner expects, as SGLang's FlashInfer dispatcher gives it:
        # -1 for the DeepGEMM and TRT-LLM runners, E for the others (dep_ep writes -1).
        backend = self.runner_backend
        takes_minus_one = backend is not None and (
            backend.is_deep_gemm()
            or backend.is_flashinfer_trtllm()
            or backend.is_flashinfer_trtllm_routed()
        )
        self.invalid_expert_id = -1 if takes_minus_one else config.num_experts

    def dispatch(self, hidden_states: torch.Tensor, topk_output: object) -> object:
        """hidden_states bf16 [n, H] (n = 0 on an idle rank); topk_output: StandardTopKOutput.
        Collective (every EP rank, the same T: `step_tokens`). Returns
        FlashinferDispatchOutput(hidden_states e4m3 [R, H] (MXFP8 codes), hidden_states_scale
        uint8 [R, H/32] (E8M0, linear), StandardTopKOutput(weights fp32 [R, K], ids int32
        [R, K]: global ids this rank owns, the runner's "no expert" id elsewhere,
        router_logits), moe_output bf16 [R, H] (where the runner writes each row's weighted
        sum over its local experts), output_dtype): this rank's R = N T receive rows, rank-major
        (docs/design.md, "The row contract"). Valid until the combine. A rank whose top-k
        output or step counts are malformed rejects the step: its ValueError here, EpPeerError
        on its peers. A rank whose previous dispatch (this class's, any layer's) was never
        combined (SGLang raised between the two) aborts that step first
        (`EpRouted.abort_stale_step`): RuntimeError here, EpPeerError on the peers."""
        fn = "dep_ep.integrations.sglang.dispatcher.DepEpDispatcher.dispatch"
        self.routed.abort_stale_step(fn, DepEpDispatch)  # every layer's dispatcher
        ids, weights, padding, tokens = step_inputs(
            fn, engine(), self.routed, topk_output, hidden_states, self.layer_id
        )
        received = self.routed.dispatch(
            hidden_states,
            ids,
            weights,
            tokens=tokens,
            tag=self.layer_id,
            padding=padding,
            owner=DepEpDispatch,
        )
        local_ids = received.ids
        if self.invalid_expert_id != -1:
            local_ids = torch.where(local_ids < 0, self.invalid_expert_id, local_ids)
        logits = getattr(topk_output, "router_logits", None)
        return self._output(
            received.x.view(torch.float8_e4m3fn),
            received.sf,
            self._topk_output(received.weights, local_ids, logits),
            received.out,
            hidden_states.dtype,
        )

    def combine(self, combine_input: object) -> torch.Tensor:
        """combine_input: the runner's CombineInput, `hidden_states` [R, H] of a floating dtype
        (the dispatch's moe_output itself, or a tensor of its shape copied there, converted to
        bf16). Collective: a runner output that cannot be taken (not a tensor, another shape, a
        copy torch refuses, such as one partly overlapping moe_output) fails the step on every
        rank (this rank raises its error, the peers EpPeerError). Returns bf16 [n, H]: each
        token's sums from every rank, summed in rank order (no norm)."""
        fn = "dep_ep.integrations.sglang.dispatcher.DepEpDispatcher.combine"
        rows = self.routed.receive()
        try:
            out = combine_input.hidden_states
            if out is not rows.out:
                if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(rows.out.shape):
                    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out)
                    raise ValueError(
                        f"{fn}: the runner's output is {shape}; expected the receive rows'"
                        f" {tuple(rows.out.shape)}"
                    )
                if not out.is_floating_point():
                    raise ValueError(f"{fn}: the runner's output is {out.dtype}; expected floats")
                # A view of moe_output (another dtype included) is copied too: same-address
                # views are not the rows unless they are the rows' own tensor.
                rows.out.copy_(out)
        except Exception as err:  # every rank must still complete the step
            self.routed.abort_step(err)
        return self.routed.combine(None)
