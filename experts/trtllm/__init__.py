"""TrtllmExperts: FlashInfer's trtllm-gen MXFP4 x MXFP8 routed MoE (Blackwell SM100/103), and the
preparation of the checkpoint-layout weights for it."""

from dep_ep.experts.trtllm.trtllm_experts import TrtllmExperts, routed_moe_arguments
from dep_ep.experts.trtllm.weights import TrtllmWeights, prepare_trtllm_weights

__all__ = ["TrtllmExperts", "TrtllmWeights", "prepare_trtllm_weights", "routed_moe_arguments"]
