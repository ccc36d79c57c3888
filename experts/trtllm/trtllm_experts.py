"""TrtllmExperts: FlashInfer's trtllm-gen MXFP4 x MXFP8 routed MoE (Blackwell SM100/103 only).

The call follows docs/formats.md ("FlashInfer trtllm-gen routed MoE"): receive rows go in as they
are (MXFP8 bytes viewed float8_e4m3fn, E8M0 scale bytes in the linear layout), ids stay global with
the rank's expert offset, SiTU with gemm1_alpha = 4.0 (gate) and gemm1_beta = 25.0 (linear) per
local expert, do_finalize, the caller's output buffer. FlashInfer is imported lazily.
"""

from __future__ import annotations

import torch

from dep_ep.experts.base import ExpertsBackend, check_receive_rows, cuda_capability_reason
from dep_ep.experts.situ import SITU_BETA, SITU_LINEAR_BETA
from dep_ep.experts.trtllm.weights import TrtllmWeights, import_flashinfer, prepare_trtllm_weights
from dep_ep.experts.weights import ExpertWeights


def routed_moe_arguments(
    weights_prepared: TrtllmWeights,
    x: torch.Tensor,
    sf: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    *,
    first_expert: int,
    num_experts: int,
    gemm1_alpha: torch.Tensor,
    gemm1_beta: torch.Tensor,
    output_scales: torch.Tensor,
) -> dict:
    """Keyword arguments of flashinfer.trtllm_fp4_block_scale_routed_moe for receive rows
    (x uint8 [R, L], sf uint8 [R, L/32], ids int32 [R, K] global (-1 = none), weights fp32
    [R, K], out bf16 [R, L]). gemm1_alpha / gemm1_beta / output_scales: fp32 [E_local]."""
    fi = import_flashinfer()
    num_local, two_i, _ = weights_prepared.gemm1_weights.shape
    return dict(
        topk_ids=(ids, weights),
        routing_bias=None,
        hidden_states=x.view(torch.float8_e4m3fn),
        hidden_states_scale=sf.view(torch.float8_e4m3fn),
        hidden_states_scale_layout=fi.SfLayout.layout_linear,
        gemm1_weights=weights_prepared.gemm1_weights,
        gemm1_weights_scale=weights_prepared.gemm1_weights_scale,
        gemm1_bias=None,
        gemm1_alpha=gemm1_alpha,
        gemm1_beta=gemm1_beta,
        gemm1_clamp_limit=None,
        gemm2_weights=weights_prepared.gemm2_weights,
        gemm2_weights_scale=weights_prepared.gemm2_weights_scale,
        gemm2_bias=None,
        output1_scale_scalar=output_scales,
        output1_scale_gate_scalar=output_scales,
        output2_scale_scalar=output_scales,
        num_experts=num_experts,
        top_k=ids.shape[1],
        n_group=None,
        topk_group=None,
        intermediate_size=two_i // 2,
        local_expert_offset=first_expert,
        local_num_experts=num_local,
        routed_scaling_factor=None,
        routing_method_type=int(fi.RoutingMethodType.Renormalize),
        do_finalize=True,
        activation_type=int(fi.ActivationType.Situ),
        output=out,
    )


class TrtllmExperts(ExpertsBackend):
    """The rank's experts on FlashInfer's trtllm-gen kernel, from an ExpertWeights.

    weights: the checkpoint layout (experts/weights.py), prepared once at construction with
    FlashInfer's helpers (experts/trtllm/weights.py); the prepared copy has the checkpoint's size
    (17.5 MB per K3 expert) and the weights' tensors are not kept. The kernel's routing reads the
    weights' num_experts (the model's total). gate_scale / linear_scale: SiTU's beta and
    linear_beta.

    Numerics (FlashInfer's): MXFP8 x MXFP4 GEMMs, SiTU in the FC1 epilogue, expert outputs and
    the finalize sum as the kernel rounds them; compare with ReferenceExperts by tolerance.
    """

    requires = "an NVIDIA Blackwell GPU of compute capability 10.x and flashinfer-python"
    activation_format = "mxfp8"

    @classmethod
    def unsupported_reason(cls, device: torch.device) -> str | None:
        reason = cuda_capability_reason(device, 10)
        if reason is not None:
            return reason
        try:
            import_flashinfer()
        except ImportError as err:
            return str(err)
        return None

    def __init__(
        self,
        weights: ExpertWeights,
        *,
        gate_scale: float = SITU_BETA,
        linear_scale: float = SITU_LINEAR_BETA,
    ) -> None:
        self._take_weights(weights)
        self.check_device(weights.device)
        self.prepared = prepare_trtllm_weights(weights)
        per_expert = dict(size=(self.num_local_experts,), dtype=torch.float32, device=self.device)
        self.gemm1_alpha = torch.full(fill_value=gate_scale, **per_expert)
        self.gemm1_beta = torch.full(fill_value=linear_scale, **per_expert)
        self.output_scales = torch.ones(**per_expert)
        self._routed_moe = import_flashinfer().trtllm_fp4_block_scale_routed_moe

    def forward(
        self,
        x: torch.Tensor,
        sf: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        check_receive_rows(type(self).__name__, x, sf, ids, weights, out, self.latent)
        args = routed_moe_arguments(
            self.prepared,
            x,
            sf,
            ids,
            weights,
            out,
            first_expert=self.first_expert,
            num_experts=self.num_experts,
            gemm1_alpha=self.gemm1_alpha,
            gemm1_beta=self.gemm1_beta,
            output_scales=self.output_scales,
        )
        self._routed_moe(**args)
        return out
