"""Kimi K3 under vLLM 0.33.0 with dep_ep's routed experts.

- `DepEpKimiExperts`: a module with the constructor keywords, attributes, `forward` and
  `weight_loader` of vLLM's DeepGemmMegaMoEExperts, holding the checkpoint-layout MXFP4
  parameters (docs/formats.md); after loading it builds the device's experts backend
  (`default_experts`) and takes the process's shared EpRouted on the EP group's CPU group.
- `DepEpKimiK3ForConditionalGeneration` (built by `model_class()`, and reached as this module's
  attribute for vLLM's lazy "module:Class" registration): vLLM's KimiK3ForConditionalGeneration
  built with DepEpKimiExperts in place of DeepGemmMegaMoEExperts, with a model-level
  process_weights_after_loading that finishes every layer's experts.

Importing this module imports no vLLM: the model class is made when first asked for, from the
engine seam (dep_ep.integrations.vllm.engine), and the experts reach vLLM only through it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Callable

import torch
from torch import nn

from dep_ep.checks import check_int, check_positive_int
from dep_ep.config import DEFAULT_NORM_EPS
from dep_ep.constants import SCALE_BLOCK
from dep_ep.experts import ExpertWeights, default_experts
from dep_ep.integrations.common import reject_bad_step, shared_routed, warm_buckets
from dep_ep.integrations.vllm.engine import check_version, engine
from dep_ep.integrations.vllm.options import options_from
from dep_ep.integrations.vllm.step_poll import install_step_poll
from dep_ep.integrations.vllm.steps import padding_mask, sequence_parallel_size, step_tokens

MODEL_CLASS_NAME = "DepEpKimiK3ForConditionalGeneration"
# vLLM's module global that KimiMoE.__init__ builds its mega-MoE experts with.
REPLACED_CLASS = "DeepGemmMegaMoEExperts"
# What the experts compute (dep_ep's backends): MXFP4 weights (vLLM's MEGA_MOE_MXFP4 format) and
# SiTU (vLLM's MegaMoEActivation("situ", alpha=beta, beta=linear_beta)).
WEIGHT_FORMAT = "mxfp4"
ACTIVATION = "situ"
SHARDS = ("w1", "w2", "w3")


def layer_index(fn: str, prefix: str) -> int:
    """The one integer among the dot-separated parts of a module prefix
    ("language_model.model.layers.7.block_sparse_moe.experts" -> 7), as vLLM's
    extract_layer_index reads it; ValueError naming `fn` unless there is exactly one."""
    numbers = [int(part) for part in str(prefix).split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(
            f"{fn}: prefix={prefix!r} holds {len(numbers)} layer numbers; expected one (the"
            " layer index, which tags every call of the layer)"
        )
    return numbers[0]


class DepEpKimiExperts(nn.Module):
    """The routed experts of one Kimi K3 MoE layer, through dep_ep (vLLM's DeepGemmMegaMoEExperts'
    constructor, attributes, forward and weight_loader).

    Parameters (checkpoint layout, uint8, local experts on dim 0; written by `weight_loader`):
      w13_weight        [E_local, 2I, L/2]   rows [w1 (gate); w3 (up)], two E2M1 codes a byte
      w13_weight_scale  [E_local, 2I, L/32]  E8M0 scale bytes
      w2_weight         [E_local, L, I/2]
      w2_weight_scale   [E_local, L, I/32]
    with L = hidden_size (Kimi K3's latent, 3584) and I = intermediate_size. Physical expert p
    of this rank (experts_start_idx <= p < experts_end_idx) holds logical expert
    p % num_logical_experts (redundant experts when num_experts > num_logical_experts).

    After loading (`finish_loading`, from the model's process_weights_after_loading) the
    parameters become an ExpertWeights for `default_experts` (their storage is then released),
    and the layer takes the process's shared EpRouted (one per EP group and geometry for every
    layer). `forward` then runs EpRouted.routed with T from the forward context's DP metadata,
    padding rows' ids -1 and the layer index as the tag.
    """

    def __init__(
        self,
        vllm_config: Any,
        *,
        num_experts: int,
        num_local_experts: int,
        experts_start_idx: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        activation: Any,
        weight_format: Any,
        shared_experts: nn.Module | None = None,
        num_logical_experts: int | None = None,
        fast_math: bool = True,
        prefix: str = "",
    ):
        super().__init__()
        fn = "DepEpKimiExperts"
        if getattr(activation, "name", None) != ACTIVATION:
            raise ValueError(f"{fn}: activation={activation!r}; dep_ep's experts compute SiTU")
        if getattr(weight_format, "name", None) != WEIGHT_FORMAT:
            raise ValueError(
                f"{fn}: weight_format={getattr(weight_format, 'name', weight_format)!r}; dep_ep's"
                f" experts take {WEIGHT_FORMAT!r} (MXFP4) weights"
            )
        num_experts = check_positive_int(fn, "num_experts", num_experts)
        num_local_experts = check_positive_int(fn, "num_local_experts", num_local_experts)
        experts_start_idx = check_int(fn, "experts_start_idx", experts_start_idx)
        if not 0 <= experts_start_idx <= num_experts - num_local_experts:
            raise ValueError(
                f"{fn}: experts {experts_start_idx}..{experts_start_idx + num_local_experts - 1}"
                f" outside the num_experts={num_experts} experts"
            )
        latent = check_positive_int(fn, "hidden_size", hidden_size, SCALE_BLOCK)
        inter = check_positive_int(fn, "intermediate_size", intermediate_size, SCALE_BLOCK)
        self.prefix = prefix
        self.layer_index = layer_index(fn, prefix)
        self.capture_fn: Callable[[torch.Tensor], None] | None = None
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.experts_start_idx = experts_start_idx
        self.experts_end_idx = experts_start_idx + num_local_experts
        logical = num_experts if num_logical_experts is None else num_logical_experts
        self.num_logical_experts = check_positive_int(fn, "num_logical_experts", logical)
        self.top_k = check_positive_int(fn, "top_k", top_k)
        self.hidden_size, self.intermediate_size = latent, inter
        self.max_num_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        self.weight_format, self.activation, self.fast_math = weight_format, activation, fast_math
        self.eplb_state = engine().eplb_layer_state()
        # dep_ep runs the routed experts only: vLLM's KimiMoE calls the shared MLP itself.
        self.num_shared_experts, self.shared_spec = 0, None
        self.options = options_from(fn, vllm_config)
        self.sequence_parallel = sequence_parallel_size(vllm_config.parallel_config)
        self.capture_sizes = list(vllm_config.compilation_config.cudagraph_capture_sizes or [])
        self.backend = None  # the ExpertsBackend, from finish_loading
        self.routed = None  # the shared EpRouted, from finish_loading
        # The model's RMSNorm when dep_ep's combine applies it (fuse_norm); kept out of the
        # module tree so its weight keeps the one checkpoint name it has (routed_expert_norm).
        self.__dict__["fused_norm"] = None
        shapes = {
            "w13_weight": (num_local_experts, 2 * inter, latent // 2),
            "w13_weight_scale": (num_local_experts, 2 * inter, latent // SCALE_BLOCK),
            "w2_weight": (num_local_experts, latent, inter // 2),
            "w2_weight_scale": (num_local_experts, latent, inter // SCALE_BLOCK),
        }
        for name, shape in shapes.items():
            param = nn.Parameter(torch.zeros(shape, dtype=torch.uint8), requires_grad=False)
            param.weight_loader = self.weight_loader  # what vLLM's load_weights calls
            self.register_parameter(name, param)
        # vLLM looks layers up by name in the static forward context (as DeepGemmMegaMoEExperts).
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"{fn}: duplicate layer name {prefix!r} in the static forward context")
        context[prefix] = self

    # ------------------------------------------------------------------------ vLLM's surface
    @property
    def has_fused_shared_experts(self) -> bool:
        return False

    @property
    def layer_id(self) -> int:
        return self.layer_index

    def set_eplb_state(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{self.prefix}: dep_ep's experts do not move between ranks (EPLB); vLLM 0.33.0 runs"
            " no EPLB for Kimi K3"
        )

    def get_expert_weights(self) -> list[torch.Tensor]:
        raise NotImplementedError(
            f"{self.prefix}: dep_ep's backends keep their own copies of the weights (EPLB cannot"
            " move them in place)"
        )

    def update_expert_map(self) -> None:
        pass

    def _map_global_expert_id(self, expert_id: int) -> list[int]:
        """Local slots that logical expert `expert_id` occupies on this rank."""
        first, logical = self.experts_start_idx, self.num_logical_experts
        return [p - first for p in range(first, self.experts_end_idx) if p % logical == expert_id]

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> bool | None:
        """Write one checkpoint tensor of logical expert `expert_id` into every local slot that
        holds it: shard w1 (gate) into rows [0, I) of w13_weight or w13_weight_scale, w3 (up)
        into rows [I, 2I), w2 whole into w2_weight or w2_weight_scale. loaded_weight: uint8 or
        int8 codes, or uint8 / float8_e8m0fnu scale bytes, [I, L/2] | [I, L/32] | [L, I/2] |
        [L, I/32]. Returns (with return_success) True when this rank holds the expert, False
        when not; None without it. ValueError naming the tensor for a shard id or shape that
        does not fit; TypeError for an element wider than one byte."""
        fn = f"{self.prefix}.weight_loader({weight_name!r})"
        if shard_id not in SHARDS:
            raise ValueError(f"{fn}: shard_id={shard_id!r}; expected one of {SHARDS}")
        slots = self._map_global_expert_id(expert_id)
        wanted = "w2_" if shard_id == "w2" else "w13_"
        if not slots or wanted not in weight_name:
            return False if return_success else None
        if loaded_weight.element_size() != 1:
            raise TypeError(
                f"{fn}: dtype {loaded_weight.dtype}; expected one-byte MXFP4 codes or E8M0 scales"
            )
        src = loaded_weight.view(torch.uint8)
        rows = param.shape[1] // 2
        part = {"w1": slice(0, rows), "w3": slice(rows, 2 * rows), "w2": slice(None)}[shard_id]
        for slot in slots:
            dst = param.data[slot][part]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(
                    f"{fn}: expert {expert_id} shard {shard_id} shape {tuple(src.shape)};"
                    f" expected {tuple(dst.shape)}"
                )
            dst.copy_(src)
        return True if return_success else None

    # ------------------------------------------------------------------------ after loading
    def tokens_per_step(self) -> int:
        """The shared EpRouted's max_tokens: the option, else the scheduler's token budget over
        the sequence-parallel size (a rank's share of a step)."""
        if self.options.max_tokens is not None:
            return self.options.max_tokens
        return -(-self.max_num_tokens // self.sequence_parallel)

    def bucket_tokens(self) -> list[int]:
        """T of every CUDA-graph bucket (a bucket of s tokens per DP rank: ceil(s / sp))."""
        sp = self.sequence_parallel
        return sorted({-(-int(s) // sp) for s in self.capture_sizes if int(s) > 0})

    def fuse_norm(self, norm: nn.Module) -> None:
        """Let combine apply `norm` (vLLM's RMSNorm: bf16 `weight` [L], `variance_epsilon`);
        the caller removes it from the model's path."""
        self.__dict__["fused_norm"] = norm

    def finish_loading(self) -> None:
        """Build the experts backend from the loaded parameters, check its SiTU constants
        against the engine's, take the shared EpRouted (collective at its first call: every rank
        finishes its layers in the same order), warm every CUDA-graph bucket, and release the
        parameters' storage (the backend holds what it prepared)."""
        fn = f"{self.prefix}: process_weights_after_loading"
        tensors = [getattr(self, name).data for name in ("w13_weight", "w13_weight_scale")]
        tensors += [getattr(self, name).data for name in ("w2_weight", "w2_weight_scale")]
        weights = ExpertWeights(
            *tensors, first_expert=self.experts_start_idx, num_experts=self.num_experts
        )
        backend = default_experts(weights)
        backend.check_situ(fn, self.activation.alpha, self.activation.beta)
        routed = shared_routed(
            engine().ep_group().cpu_group,
            weights.device,
            num_experts=self.num_experts,
            latent=self.hidden_size,
            topk=self.top_k,
            max_tokens=self.tokens_per_step(),
            config=self.options.ep_config(),
        )
        if routed.first_expert != self.experts_start_idx:
            raise ValueError(
                f"{fn}: vLLM gave this rank experts from {self.experts_start_idx}, but it is rank"
                f" {routed.rank} of the EP group's CPU group, which owns experts from"
                f" {routed.first_expert}"
            )
        warm_buckets(routed, backend, self.bucket_tokens())
        self.backend, self.routed = backend, routed
        for param in self.parameters(recurse=False):
            param.data = torch.empty(0, dtype=torch.uint8, device=weights.device)

    # ------------------------------------------------------------------------ the step
    def forward(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: nn.Module | None = None,
    ) -> torch.Tensor:
        """bf16 [n, L]: the routed experts' weighted sum of this rank's n tokens (hidden_states
        bf16 [n, L], topk_weights fp32 [n, K], topk_ids int32 [n, K] logical ids), RMS-normed
        only when the norm is fused, plus `shared_experts(hidden_states)` when given.
        Collective over the EP group (every rank runs every MoE layer of every step). A
        forward context this rank cannot read T or the padding rows from, or an error of the
        engine's top-k capture, rejects the step on every rank (ValueError naming the layer
        here, EpPeerError on the peers)."""
        if self.routed is None:
            raise RuntimeError(
                f"{self.prefix}.forward: called before process_weights_after_loading built the"
                " experts"
            )
        try:
            context = engine().forward_context()
            tokens = step_tokens(context, hidden_states.shape[0], self.sequence_parallel)
            padding = padding_mask(context)
            if self.capture_fn is not None:
                self.capture_fn(topk_ids)
        except Exception as err:  # on this rank alone: every rank must raise
            fn = f"{self.prefix}.forward"
            what = "the forward context or the engine's top-k capture"
            reject_bad_step(self.routed, fn, self.layer_index, what, err)
        norm = self.fused_norm
        out = self.routed.routed(
            hidden_states,
            topk_ids,
            topk_weights,
            None if norm is None else norm.weight,
            experts=self.backend,
            eps=DEFAULT_NORM_EPS if norm is None else norm.variance_epsilon,
            tokens=tokens,
            tag=self.layer_index,
            padding=padding,
        )
        if shared_experts is not None:
            out += shared_experts(hidden_states)
        return out


DepEpKimiExperts.weight_loader.supports_moe_loading = True  # as vLLM marks its MoE loaders


@contextmanager
def experts_replaced(module: ModuleType) -> Iterator[None]:
    """`module.DeepGemmMegaMoEExperts` is DepEpKimiExperts inside the block (the model's
    KimiMoE layers look the name up in their module when they are built)."""
    original = getattr(module, REPLACED_CLASS)
    setattr(module, REPLACED_CLASS, DepEpKimiExperts)
    try:
        yield
    finally:
        setattr(module, REPLACED_CLASS, original)


def dep_ep_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` whose `experts` are DepEpKimiExperts (vLLM's KimiMoE layers)."""
    return [m for m in model.modules() if isinstance(getattr(m, "experts", None), DepEpKimiExperts)]


_MODEL_CLASSES: dict[type, type] = {}


def model_class() -> type:
    """DepEpKimiK3ForConditionalGeneration: a subclass of the engine's
    KimiK3ForConditionalGeneration (made once per base class) whose construction builds the
    MoE layers with DepEpKimiExperts, fuses the latent norm into combine when the options say
    so, and installs the per-step poll; its process_weights_after_loading (vLLM calls the
    model's after every layer's own) finishes every layer's experts, in model order."""
    module = engine().kimi_k3_module()
    base = module.KimiK3ForConditionalGeneration
    made = _MODEL_CLASSES.get(base)
    if made is not None:
        return made

    class DepEpKimiK3ForConditionalGeneration(base):
        __doc__ = model_class.__doc__

        def __init__(self, vllm_config: Any, prefix: str = "") -> None:
            fn = MODEL_CLASS_NAME
            check_version(fn, engine().version())
            options = options_from(fn, vllm_config)
            with experts_replaced(module):
                super().__init__(vllm_config=vllm_config, prefix=prefix)
            layers = dep_ep_layers(self)
            if not layers:
                raise ValueError(
                    f"{fn}: no MoE layer was built with dep_ep's experts; run vLLM with"
                    " --enable-expert-parallel --moe-backend deep_gemm_mega_moe"
                )
            if options.fused_norm:
                for moe in layers:
                    fuse_latent_norm(fn, moe)
            install_step_poll()

        def process_weights_after_loading(self) -> None:
            for moe in dep_ep_layers(self):
                moe.experts.finish_loading()

    DepEpKimiK3ForConditionalGeneration.__module__ = __name__
    _MODEL_CLASSES[base] = DepEpKimiK3ForConditionalGeneration
    return DepEpKimiK3ForConditionalGeneration


def fuse_latent_norm(fn: str, moe: nn.Module) -> None:
    """Move a KimiMoE layer's routed_expert_norm from its routed_output_transform (which then
    runs the up projection alone) into dep_ep's combine."""
    norm = getattr(moe, "routed_expert_norm", None)
    if norm is None:
        raise ValueError(
            f"{fn}: fused_norm is set but layer {moe.experts.prefix!r} has no routed_expert_norm"
            " (the model's latent_moe_use_norm is off)"
        )
    moe.routed_output_transform.norm = None
    moe.experts.fuse_norm(norm)


def __getattr__(name: str) -> Any:
    """The model class as a module attribute (vLLM's lazy registration imports this module and
    reads the class from it)."""
    if name == MODEL_CLASS_NAME:
        return model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
