"""Stand-ins for the vLLM 0.33.0 objects dep_ep.integrations.vllm uses, with the signatures and
module shapes of the real ones, so that the adapter's own code runs on CPU ranks without vLLM.

Each mirrored callable carries SIGNATURE: the real one's parameters as `bare_signature` renders
them (names, kinds, defaults; no annotations), copied from vLLM 0.33.0. tests/integrations/
test_vllm_mpi.py checks that every stand-in (and the adapter's own DepEpKimiExperts) has the
signature it claims; tests/integrations/test_vllm_real.py checks that the real classes have it.
Where a stand-in keeps a real function's logic (the weight-name mapping, RMSNorm, KimiMoE's
forward sequence, load_weights' expert loop), the real code is restated in its docstring.
"""

from __future__ import annotations

import enum
import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torch import nn

VERSION = "0.33.0"


def bare_signature(fn: Any) -> str:
    """`inspect.signature(fn)` without annotations (the stand-ins annotate less than vLLM):
    "(self, a, *, b=1)"."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


# ------------------------------------------------------------------ vllm.forward_context
@dataclass
class DPMetadata:
    """vllm.forward_context.DPMetadata: num_tokens_across_dp_cpu int [DP] on the host (each DP
    rank's token count this step); local_sizes set only inside sp_local_sizes."""

    SIGNATURE = "(self, num_tokens_across_dp_cpu, local_sizes=None)"
    num_tokens_across_dp_cpu: torch.Tensor
    local_sizes: list[int] | None = None

    SP_LOCAL_SIZES = "(self, sequence_parallel_size, pcp_size=1, use_ep=False)"

    @contextmanager
    def sp_local_sizes(self, sequence_parallel_size, pcp_size=1, use_ep=False):
        """As 0.33.0 (pcp_size 1): each DP count split over sp ranks, ceil(n / sp) each,
        repeated sp times."""
        sp = sequence_parallel_size
        sizes = ((self.num_tokens_across_dp_cpu + sp - 1) // sp).repeat_interleave(sp)
        self.local_sizes = sizes.tolist()
        try:
            yield self.local_sizes
        finally:
            self.local_sizes = None

    def get_chunk_sizes_across_dp_rank(self):
        assert self.local_sizes is not None
        return self.local_sizes


@dataclass
class ForwardContext:
    """vllm.forward_context.ForwardContext, the fields the adapter reads (the real one has more,
    each with a default): dp_metadata (None with DP = 1), is_padding (bool [>= n], True for
    padding rows; None when the producer does not set it)."""

    FIELDS = {"dp_metadata": None, "is_padding": None}
    dp_metadata: DPMetadata | None = None
    is_padding: torch.Tensor | None = None


_forward_context: list[ForwardContext | None] = [None]


def get_forward_context() -> ForwardContext:
    assert _forward_context[-1] is not None, "Forward context is not set."
    return _forward_context[-1]


def is_forward_context_available() -> bool:
    return _forward_context[-1] is not None


@contextmanager
def override_forward_context(forward_context: ForwardContext | None) -> Iterator[None]:
    """As vllm.forward_context.override_forward_context."""
    _forward_context.append(forward_context)
    try:
        yield
    finally:
        _forward_context.pop()


# ------------------------------------------------------ vllm.models.common.ops.sequence_parallel
def sp_shard(x: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """As 0.33.0's sp_shard (which reads the TP size and rank from vLLM's groups): rows padded
    with zeros to a multiple of tp_size, TP rank r keeps chunk r of ceil(n / tp_size) rows."""
    pad = (-x.shape[0]) % tp_size
    if pad:
        x = torch.nn.functional.pad(x, (0, 0) * (x.ndim - 1) + (0, pad))
    chunk = x.shape[0] // tp_size
    return x[tp_rank * chunk : (tp_rank + 1) * chunk]


def sp_padding_mask(is_padding, num_tokens: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    """As 0.33.0's sp_padding_mask: the mask (all False when None) padded with True to a
    multiple of tp_size, TP rank r's chunk of it."""
    if is_padding is None:
        is_padding = torch.zeros(num_tokens, dtype=torch.bool)
    pad = (-num_tokens) % tp_size
    if pad:
        is_padding = torch.nn.functional.pad(is_padding, (0, pad), value=True)
    chunk = is_padding.shape[0] // tp_size
    return is_padding[tp_rank * chunk : (tp_rank + 1) * chunk]


# ------------------------------------------------------------------ vllm.distributed
@dataclass
class GroupCoordinator:
    """vllm.distributed.parallel_state.GroupCoordinator, the fields the adapter reads: cpu_group
    (a gloo torch.distributed group of the ranks), world_size, rank_in_group."""

    FIELDS = ("cpu_group", "world_size", "rank_in_group")
    cpu_group: Any
    world_size: int
    rank_in_group: int


_ep_group: list[GroupCoordinator] = []


def get_ep_group() -> GroupCoordinator:
    assert _ep_group, "stand-in EP group not initialised (VllmStandin)"
    return _ep_group[-1]


class EplbLayerState:
    """vllm.distributed.eplb.eplb_state.EplbLayerState (no EPLB for Kimi K3 in 0.33.0)."""

    expert_load_view = None
    logical_to_physical_map = None
    logical_replica_count = None


# ------------------------------------------------------------------ fused_moe.deep_gemm_mega_moe
@dataclass(frozen=True)
class MegaMoEActivation:
    """vllm...deep_gemm_mega_moe.MegaMoEActivation ("situ": alpha is SiTU's gate tanh scale,
    beta its linear tanh scale)."""

    SIGNATURE = "(self, name='swiglu', clamp=None, alpha=1.0, beta=0.0)"
    name: Literal["swiglu", "situ"] = "swiglu"
    clamp: float | None = None
    alpha: float = 1.0
    beta: float = 0.0


@dataclass(frozen=True)
class MegaMoEWeightFormat:
    """vllm...deep_gemm_mega_moe.MegaMoEWeightFormat, its name only."""

    name: str


MEGA_MOE_MXFP4 = MegaMoEWeightFormat("mxfp4")
MEGA_MOE_BF16 = MegaMoEWeightFormat("bf16")


class DeepGemmMegaMoEExperts(nn.Module):
    """vllm...deep_gemm_mega_moe.DeepGemmMegaMoEExperts: what the adapter replaces. Building it
    fails as the real one does off SM100, so a model built with it cannot pass a test."""

    SIGNATURE = (
        "(self, vllm_config, *, num_experts, num_local_experts, experts_start_idx, top_k,"
        " hidden_size, intermediate_size, activation, weight_format, shared_experts=None,"
        " num_logical_experts=None, fast_math=True, prefix='')"
    )
    FORWARD = "(self, hidden_states, topk_weights, topk_ids, shared_experts=None)"
    WEIGHT_LOADER = (
        "(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False)"
    )
    # Attributes the adapter's module has too (the real class sets them in __init__).
    ATTRIBUTES = (
        "prefix",
        "capture_fn",
        "num_experts",
        "num_local_experts",
        "experts_start_idx",
        "experts_end_idx",
        "num_logical_experts",
        "top_k",
        "hidden_size",
        "intermediate_size",
        "max_num_tokens",
        "weight_format",
        "activation",
        "fast_math",
        "eplb_state",
        "num_shared_experts",
        "shared_spec",
    )
    METHODS = (
        "forward",
        "weight_loader",
        "set_eplb_state",
        "get_expert_weights",
        "update_expert_map",
        "_map_global_expert_id",
        "has_fused_shared_experts",
        "layer_id",
    )

    def __init__(self, vllm_config, **kwargs):
        super().__init__()
        raise NotImplementedError("DeepGEMM MegaMoE requires SM100 GPUs.")


# ------------------------------------------------------ vllm.models.kimi_k3.nvidia.model
def make_kimi_k3_mega_moe_expert_params_mapping(num_experts):
    """As 0.33.0: (param name, checkpoint name, expert id, shard id) for every expert, shard
    (w1, w2, w3) and suffix (weight_packed -> <p>_weight, weight_scale -> <p>_weight_scale, with
    p = w13 for w1 and w3, w2 for w2)."""
    mapping = []
    for expert_id in range(num_experts):
        for shard_id in ("w1", "w2", "w3"):
            param_prefix = "w13" if shard_id in ("w1", "w3") else "w2"
            for suffix in ("weight_packed", "weight_scale"):
                param_suffix = "weight" if suffix == "weight_packed" else suffix
                mapping.append(
                    (
                        f"experts.{param_prefix}_{param_suffix}",
                        f"experts.{expert_id}.{shard_id}.{suffix}",
                        expert_id,
                        shard_id,
                    )
                )
    return mapping


class RMSNorm(nn.Module):
    """vllm.model_executor.layers.layernorm.RMSNorm: weight bf16 [L], variance_epsilon; its
    native forward (vllm.ir.ops.rms_norm): x in fp32, x * rsqrt(mean(x^2) + eps), cast to the
    weight's dtype, times the weight, cast to x's dtype."""

    SIGNATURE = "(self, hidden_size, eps=1e-06, var_hidden_size=None, has_weight=True, dtype=None)"

    def __init__(self, hidden_size, eps=1e-6, var_hidden_size=None, has_weight=True, dtype=None):
        super().__init__()
        self.variance_epsilon = eps
        weight = torch.ones(hidden_size, dtype=dtype or torch.bfloat16)
        self.weight = nn.Parameter(weight, requires_grad=False)  # vLLM serves in inference mode
        self.calls = 0  # how often it ran (the tests check the norm runs exactly once)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        x = x.to(self.weight.dtype) * self.weight
        return x.to(orig_dtype)


class ReplicatedLinear(nn.Module):
    """vllm...linear.ReplicatedLinear, unquantized: weight bf16 [out, in]."""

    def __init__(self, input_size, output_size, bias=False, quant_config=None, prefix=""):
        super().__init__()
        weight = torch.zeros(output_size, input_size, dtype=torch.bfloat16)
        self.weight = nn.Parameter(weight, requires_grad=False)


class KimiRoutedOutputTransform(nn.Module):
    """vllm.models.kimi_k3.nvidia.model.KimiRoutedOutputTransform, unquantized up projection:
    forward(h, residual) = residual.addmm_(norm(h) if norm else h, up_proj.weight.t())."""

    SIGNATURE = "(self, norm, up_proj)"
    FORWARD = "(self, hidden_states, residual=None)"

    def __init__(self, norm, up_proj):
        super().__init__()
        self.norm = norm
        self.up_proj = up_proj

    def forward(self, hidden_states, residual=None):
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        if residual is not None:
            return residual.addmm_(hidden_states, self.up_proj.weight.t())
        return hidden_states @ self.up_proj.weight.t()


class KimiMoE(nn.Module):
    """vllm.models.kimi_k3.nvidia.model.KimiMoE in its mega branch (moe_backend
    deep_gemm_mega_moe): the latent norm and up projection, and the experts built from this
    module's global DeepGemmMegaMoEExperts with 0.33.0's keywords (num_local_experts = E / EP
    size, experts_start_idx = EP rank * that, MegaMoEActivation("situ", alpha=situ beta,
    beta=situ linear beta), MEGA_MOE_MXFP4, prefix + ".experts")."""

    SIGNATURE = (
        "(self, config, vllm_config, quant_config=None, prefix='', layer_idx=0,"
        " use_sequence_parallel=False, run_gemm_rs_ar=False)"
    )

    def __init__(
        self,
        config,
        vllm_config,
        quant_config=None,
        prefix="",
        layer_idx=0,
        use_sequence_parallel=False,
        run_gemm_rs_ar=False,
    ):
        super().__init__()
        latent = config.routed_expert_hidden_size
        self.routed_expert_norm = (
            RMSNorm(latent, eps=config.rms_norm_eps) if config.latent_moe_use_norm else None
        )
        self.routed_expert_up_proj = ReplicatedLinear(latent, config.hidden_size)
        self.routed_output_transform = KimiRoutedOutputTransform(
            self.routed_expert_norm, self.routed_expert_up_proj
        )
        ep_group = get_ep_group()
        num_local_experts = config.num_experts // ep_group.world_size
        self.experts = DeepGemmMegaMoEExperts(
            vllm_config,
            num_experts=config.num_experts,
            num_local_experts=num_local_experts,
            experts_start_idx=ep_group.rank_in_group * num_local_experts,
            top_k=config.num_experts_per_token,
            hidden_size=latent,
            intermediate_size=config.moe_intermediate_size,
            activation=MegaMoEActivation(
                "situ",
                alpha=config.activation_situ_beta or 1.0,
                beta=config.activation_situ_linear_beta or 0.0,
            ),
            weight_format=MEGA_MOE_MXFP4,
            prefix=f"{prefix}.experts",
        )

    def forward_after_router(self, routed_hidden_states, router_output, topk_ids, shared_output):
        """0.33.0's KimiMoE.forward from the router on (mega branch): the experts on the
        down-projected latent, then routed_output_transform(experts' output,
        residual=shared_output) (the norm, then the up projection added into the shared
        output). bf16 [n, H]."""
        final_hidden_states = self.experts(routed_hidden_states, router_output, topk_ids)
        return self.routed_output_transform(final_hidden_states, residual=shared_output)


class KimiDecoderLayer(nn.Module):
    """A decoder layer of the stand-in model: its MoE block (named block_sparse_moe, as 0.33.0)."""

    def __init__(self, config, vllm_config, prefix, layer_idx):
        super().__init__()
        self.block_sparse_moe = KimiMoE(
            config, vllm_config, prefix=f"{prefix}.block_sparse_moe", layer_idx=layer_idx
        )


class KimiK3ForConditionalGeneration(nn.Module):
    """vllm.models.kimi_k3.nvidia.model.KimiK3ForConditionalGeneration, reduced to its MoE
    layers at 0.33.0's module paths (language_model.model.layers.{i}.block_sparse_moe, the
    checkpoint's names after the model's hf_to_vllm_mapper) and load_weights' expert loop."""

    SIGNATURE = "(self, vllm_config, prefix='')"

    def __init__(self, vllm_config, prefix=""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        layers = nn.ModuleList(
            KimiDecoderLayer(config, vllm_config, f"language_model.model.layers.{i}", i)
            for i in range(config.num_hidden_layers)
        )
        self.language_model = nn.Module()
        self.language_model.model = nn.Module()
        self.language_model.model.layers = layers

    def moe_layers(self) -> list[KimiMoE]:
        return [layer.block_sparse_moe for layer in self.language_model.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """0.33.0's expert loop: for each checkpoint tensor, the first mapping entry whose
        checkpoint name is a substring of its name rewrites the name to the parameter's, and
        param.weight_loader(param, tensor, name, expert_id=, shard_id=) loads it."""
        mapping = make_kimi_k3_mega_moe_expert_params_mapping(self.config.num_experts)
        params = dict(self.named_parameters())
        loaded = set()
        for name, loaded_weight in weights:
            for param_name, weight_name, expert_id, shard_id in mapping:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = params[name]
                param.weight_loader(
                    param, loaded_weight, name, expert_id=expert_id, shard_id=shard_id
                )
                break
            else:
                raise KeyError(f"stand-in load_weights: {name} is not an expert tensor")
            loaded.add(name)
        return loaded


# ------------------------------------------------------------------ fused_moe.modular_kernel
class FusedMoEActivationFormat(enum.Enum):
    Standard = ("standard",)
    BatchedExperts = ("batched_experts",)


class FusedMoEPrepareAndFinalizeModular(ABC):
    """vllm...modular_kernel.FusedMoEPrepareAndFinalizeModular: the abstract methods and the
    optional allocate_fused_expert_output, with 0.33.0's signatures."""

    ABSTRACT = (
        "activation_format",
        "finalize",
        "max_num_tokens_per_rank",
        "num_dispatchers",
        "output_is_reduced",
        "prepare",
        "topk_indices_dtype",
    )
    PREPARE = (
        "(self, a1, topk_weights, topk_ids, num_experts, expert_map,"
        " apply_router_weight_on_input, quant_config, defer_input_quant)"
    )
    FINALIZE = (
        "(self, output, fused_expert_output, topk_weights, topk_ids,"
        " apply_router_weight_on_input, weight_and_reduce_impl)"
    )
    ALLOCATE = "(self, shape, dtype, device, weight_and_reduce_impl)"

    def allocate_fused_expert_output(self, shape, dtype, device, weight_and_reduce_impl):
        return None

    @property
    @abstractmethod
    def activation_format(self): ...

    @abstractmethod
    def topk_indices_dtype(self): ...

    @abstractmethod
    def max_num_tokens_per_rank(self): ...

    @abstractmethod
    def num_dispatchers(self): ...

    @abstractmethod
    def output_is_reduced(self): ...

    @abstractmethod
    def prepare(
        self,
        a1,
        topk_weights,
        topk_ids,
        num_experts,
        expert_map,
        apply_router_weight_on_input,
        quant_config,
        defer_input_quant,
    ): ...

    @abstractmethod
    def finalize(
        self,
        output,
        fused_expert_output,
        topk_weights,
        topk_ids,
        apply_router_weight_on_input,
        weight_and_reduce_impl,
    ): ...


# ------------------------------------------------------------------ vllm.v1.worker.gpu_worker
class Worker:
    """vllm.v1.worker.gpu_worker.Worker's two step methods."""

    EXECUTE_MODEL = "(self, scheduler_output)"
    EXECUTE_DUMMY_BATCH = "(self)"

    def __init__(self, step=None):
        self.step = step  # what a step runs (the test's MoE layers)

    def execute_model(self, scheduler_output):
        return self.step(scheduler_output)

    def execute_dummy_batch(self):
        self.step(None)


# ------------------------------------------------------------------ config and the seam
@dataclass
class KimiK3TextConfig:
    """The Kimi K3 text config fields KimiMoE reads (TINY geometry by default in the tests)."""

    hidden_size: int
    routed_expert_hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    num_hidden_layers: int = 2
    latent_moe_use_norm: bool = True
    rms_norm_eps: float = 1e-5
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0


def vllm_config(
    text: KimiK3TextConfig,
    *,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    max_num_batched_tokens: int = 64,
    capture_sizes: tuple[int, ...] = (),
    additional_config: dict | None = None,
) -> SimpleNamespace:
    """A VllmConfig with the fields the adapter reads: scheduler_config.max_num_batched_tokens,
    parallel_config (tensor/pipeline/data parallel sizes, enable_expert_parallel),
    compilation_config (static_forward_context, cudagraph_capture_sizes),
    kernel_config.moe_backend, model_config.hf_config, additional_config."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=1,
            data_parallel_size=data_parallel_size,
            enable_expert_parallel=True,
        ),
        compilation_config=SimpleNamespace(
            static_forward_context={}, cudagraph_capture_sizes=list(capture_sizes)
        ),
        kernel_config=SimpleNamespace(moe_backend="deep_gemm_mega_moe"),
        model_config=SimpleNamespace(hf_config=text),
        additional_config=dict(additional_config or {}),
    )


@dataclass
class VllmStandin:
    """The engine seam (dep_ep.integrations.vllm.engine.VllmEngine's methods) over the stand-ins:
    the EP group is `group` (the test's gloo group), the model module is this module, and
    register_model records its calls."""

    group: Any = None  # None: no EP group (single-process tests)
    version_string: str = VERSION
    registered: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        import torch.distributed as dist

        if self.group is None:
            return
        coordinator = GroupCoordinator(
            self.group, dist.get_world_size(self.group), dist.get_rank(self.group)
        )
        _ep_group.append(coordinator)

    def close(self) -> None:
        _ep_group.clear()

    def version(self) -> str:
        return self.version_string

    def forward_context(self) -> ForwardContext | None:
        return get_forward_context() if is_forward_context_available() else None

    def ep_group(self) -> GroupCoordinator:
        return get_ep_group()

    def register_model(self, architecture: str, target: str) -> None:
        self.registered.append((architecture, target))

    def kimi_k3_module(self):
        import sys

        return sys.modules[__name__]

    def eplb_layer_state(self) -> EplbLayerState:
        return EplbLayerState()

    def prepare_finalize_base(self):
        return FusedMoEPrepareAndFinalizeModular, FusedMoEActivationFormat.Standard

    def worker_class(self) -> type:
        return Worker
