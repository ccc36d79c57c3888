"""The hooks that put dep_ep's routed experts under SGLang 0.5.23's Kimi K3 model
(`sglang.srt.models.kimi_k3.KimiK3MoE`) when it runs with `--moe-a2a-backend megamoe`:

- `mark_k3_experts`, AFTER `KimiK3MoE.__init__`: marks the layer's experts module (a FusedMoE)
  with the model's layer index, so the weight hook knows a K3 routed layer from any other MXFP4
  MoE layer.
- `process_weights_after_loading`, AROUND `Mxfp4MoEMethod.process_weights_after_loading`: for a
  marked layer, builds dep_ep's experts backend from the four checkpoint-layout parameters and
  joins the process's EpRouted, instead of the original (which converts the weights for
  DeepGEMM's mega kernel and repoints the parameters at the converted tensors).
- `forward_mega_experts`, REPLACE `KimiK3MoE._forward_mega_experts`: the routed experts on
  dep_ep, returning the plain sum over ranks; the model's `_reduce_latent` then applies the
  latent norm, once.

Engine objects come from `engine()` (engine.py); this module imports no SGLang.
"""

from __future__ import annotations

import torch

from dep_ep.experts.base import ExpertsBackend
from dep_ep.experts.weights import ExpertWeights
from dep_ep.integrations.common import shared_routed
from dep_ep.integrations.sglang.engine import engine
from dep_ep.integrations.sglang.steps import step_inputs

# Attributes dep_ep sets on a K3 layer's experts module (SGLang's FusedMoE).
LAYER_INDEX = "_dep_ep_layer_index"  # int: KimiK3MoE.layer_idx, set at construction
EXPERTS = "_dep_ep_experts"  # ExpertsBackend of the rank's experts, set at weight processing
ROUTED = "_dep_ep_routed"  # the process's shared EpRouted
COUNTS = "_dep_ep_counts"  # int32 [E_local]: the last step's received pairs, for the recorder

# Mxfp4MoEMethod.create_weights' checkpoint-layout parameters, in ExpertWeights' order:
# w13_weight uint8 [E_local, 2I, L/2] (rows [w1 (gate); w3 (up)]: K3 loads them so,
# gate_up_interleaved=False), w13_weight_scale uint8 [E_local, 2I, L/32] (E8M0),
# w2_weight uint8 [E_local, L, I/2], w2_weight_scale uint8 [E_local, L, I/32].
CHECKPOINT_PARAMETERS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")


def mark_k3_experts(result: None, moe: torch.nn.Module, *args, **kwargs) -> None:
    """AFTER hook of `KimiK3MoE.__init__(self, config, quant_config=None, prefix="",
    layer_idx=0, alt_stream=None)`: under megamoe (`moe._use_mega_moe`, the condition on which
    K3 calls `_forward_mega_experts`), mark `moe.experts` with `moe.layer_idx`. Other backends
    leave K3 to SGLang (under `--moe-a2a-backend flashinfer` its experts go through dep_ep's
    dispatcher). Returns None: the constructor's result stands."""
    if getattr(moe, "_use_mega_moe", False):
        setattr(moe.experts, LAYER_INDEX, moe.layer_idx)


def process_weights_after_loading(original, method: object, layer: torch.nn.Module) -> None:
    """AROUND hook of `Mxfp4MoEMethod.process_weights_after_loading(self, layer)`: a K3 routed
    layer under megamoe (marked by `mark_k3_experts`) gets dep_ep's experts (`build_experts`)
    and the original is skipped; any other layer runs the original."""
    if getattr(layer, LAYER_INDEX, None) is None or not getattr(method, "use_mega_moe", False):
        return original(method, layer)
    build_experts(layer)
    return None


def checkpoint_weights(fn: str, layer: torch.nn.Module) -> ExpertWeights:
    """The layer's four checkpoint-layout parameters as an ExpertWeights (views: nothing is
    copied) of experts [moe_ep_rank * E_local, (moe_ep_rank + 1) * E_local) of num_experts.
    ValueError for a layout dep_ep's ranks cannot own: fused shared experts, MoE tensor
    parallelism (split intermediate), or local experts that do not tile the model's experts
    (EPLB redundant experts)."""
    shared = layer.num_fused_shared_experts
    if shared:
        raise ValueError(
            f"{fn}: layer {layer.layer_id} has num_fused_shared_experts={shared}; dep_ep runs"
            " routed experts only (K3's shared experts stay with SGLang)"
        )
    if layer.moe_tp_size != 1:
        raise ValueError(
            f"{fn}: layer {layer.layer_id} has moe_tp_size={layer.moe_tp_size}; dep_ep needs"
            " whole experts per rank (moe_tp_size 1: --ep-size equal to --tp-size)"
        )
    local, ranks, total = layer.num_local_experts, layer.moe_ep_size, layer.num_experts
    if local * ranks != total:
        raise ValueError(
            f"{fn}: layer {layer.layer_id} holds {local} experts on each of {ranks} ranks for"
            f" num_experts={total}; dep_ep needs E_local * ranks == E (no redundant experts)"
        )
    tensors = (getattr(layer, name).data for name in CHECKPOINT_PARAMETERS)
    return ExpertWeights(*tensors, first_expert=layer.moe_ep_rank * local, num_experts=total)


def build_experts(layer: torch.nn.Module) -> ExpertsBackend:
    """Join the process's EpRouted (built at the first K3 layer: collective, every rank
    processes its layers in the model's order) and build this rank's experts backend from the
    checkpoint-layout parameters, before any DeepGEMM conversion; then point the four
    parameters at empty tensors, as SGLang's own mega path repoints them at its converted ones
    (the storage stays alive where the backend keeps it: HopperExperts' triton engine).
    Stores the backend, the EpRouted and a count buffer on the layer; returns the backend.

    The EpRouted comes first: its arguments (E, L, K, the megamoe token budget) are the same on
    every rank, and a rank whose weights are refused then raises its ValueError alone, after
    the collective part, instead of leaving its peers waiting in the construction."""
    fn = "dep_ep.integrations.sglang.kimi_k3.build_experts"
    eng = engine()
    params = [getattr(layer, name) for name in CHECKPOINT_PARAMETERS]
    device = params[0].device
    routed = shared_routed(
        eng.ep_group(),
        device,
        num_experts=layer.num_experts,
        latent=2 * params[0].shape[2],
        topk=layer.top_k,
        max_tokens=eng.mega_moe_max_tokens(),
        config=eng.ep_config(count_experts=eng.expert_distribution_recording()),
    )
    if (routed.rank, routed.num_ranks) != (layer.moe_ep_rank, layer.moe_ep_size):
        raise ValueError(
            f"{fn}: this process is rank {routed.rank} of {routed.num_ranks} in SGLang's"
            f" moe_ep_group but the layer says moe_ep_rank={layer.moe_ep_rank} of"
            f" moe_ep_size={layer.moe_ep_size}; dep_ep's rank r owns experts"
            " [r E/N, (r + 1) E/N)"
        )
    experts = eng.build_experts(checkpoint_weights(fn, layer))
    runner = layer.moe_runner_config
    experts.check_situ(fn, runner.gemm1_alpha, runner.gemm1_clamp_limit)
    for param in params:
        param.data = torch.empty(0, dtype=param.dtype, device=device)
    setattr(layer, EXPERTS, experts)
    setattr(layer, ROUTED, routed)
    counts = torch.zeros(routed.experts_per_rank, dtype=torch.int32, device=device)
    setattr(layer, COUNTS, counts)
    return experts


def forward_mega_experts(
    moe: torch.nn.Module, routed_input: torch.Tensor, topk_output: object
) -> torch.Tensor:
    """REPLACE of `KimiK3MoE._forward_mega_experts(self, routed_input, topk_output)`.

    routed_input bf16 [n, L] (n = 0 on an idle data-parallel rank, which still takes part);
    topk_output: SGLang's StandardTopKOutput (topk_ids [n, K], -1 = none; topk_weights [n, K]).
    Returns bf16 [n, L]: the sum over the token's experts of weight * expert(latent), summed
    over ranks, without the latent norm (the caller's `_reduce_latent` applies it), times
    `routed_scaling_factor` where the original applies it (not fused into the top-k weights).

    Collective over the EP ranks, every rank with the same T (`step_tokens`: ceil(max(DP
    counts) / attn_tp_size)); T above the megamoe token budget runs in pieces. The call's tag is
    the model's layer index, so ranks running different layers raise EpDesyncError on every
    rank; rows past the forward's real-row bound are padding (no expert). A rank whose top-k
    output is malformed rejects the step (its error here, EpPeerError on its peers)."""
    fn = "dep_ep.integrations.sglang.kimi_k3.forward_mega_experts"
    eng = engine()
    layer = moe.experts
    routed, experts = getattr(layer, ROUTED, None), getattr(layer, EXPERTS, None)
    if routed is None or experts is None:
        raise RuntimeError(
            f"{fn}: layer {moe.layer_idx}'s experts were not built by dep_ep (its"
            " Mxfp4MoEMethod.process_weights_after_loading did not run under DEP_EP_SGLANG=1)"
        )
    tag = moe.layer_idx
    ids, weights, padding, tokens = step_inputs(fn, eng, routed, topk_output, routed_input, tag)
    y = routed.routed(
        routed_input, ids, weights, None, experts=experts, tokens=tokens, tag=tag, padding=padding
    )
    if routed.config.count_experts:
        # This step's received pairs per local expert (summed over its pieces) to the recorder.
        counts = getattr(layer, COUNTS)
        eng.record_expert_load(routed.expert_counts(out=counts))
    if not layer.should_fuse_routed_scaling_factor_in_topk:
        factor = moe.routed_scaling_factor
        if factor is not None and factor != 1.0:
            y.mul_(factor)
    return y
