"""Stand-ins for the SGLang 0.5.23 objects that dep_ep.integrations.sglang reaches, with the real
ones' signatures and module shapes, so the integration's own logic runs on CPU ranks without
SGLang. Each stand-in of a real function or method carries SIGNATURE, the real one's parameters
as they read in SGLang 0.5.23's source (test_sglang_standins.py checks that the stand-in's own
definition reads the same; test_sglang_real.py that the installed SGLang's does).

`SglangStandin` is one SGLang process: its parallel state, per-forward state, environment
variables, recorder, hook registry and fresh subclasses of the stand-in classes (hooks patch
those, never the base classes, so tests do not leak patches into one another), reachable by the
real module names (`modules`). `StandinEngine` puts it behind the integration's seam.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch import nn

from dep_ep.config import EpConfig
from dep_ep.integrations.sglang.engine import SglangEngine

_UE8M0_ONE = 127  # mxfp4.py: the E8M0 byte of 1.0, create_weights' scale fill


# ------------------------------------------------------------ sglang.srt.plugins.hook_registry
class HookType(Enum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"


def _wrap_fn(original_fn, hook, hook_type):
    """hook_registry._wrap_fn's wrappers: the call each hook type makes."""
    if hook_type == HookType.REPLACE:

        def wrapper(*args, **kwargs):
            return hook(*args, **kwargs)

    elif hook_type == HookType.BEFORE:

        def wrapper(*args, **kwargs):
            result = hook(*args, **kwargs)
            if result is not None:
                args, kwargs = result
            return original_fn(*args, **kwargs)

    elif hook_type == HookType.AFTER:

        def wrapper(*args, **kwargs):
            result = original_fn(*args, **kwargs)
            modified = hook(result, *args, **kwargs)
            return modified if modified is not None else result

    else:

        def wrapper(*args, **kwargs):
            return hook(original_fn, *args, **kwargs)

    wrapper.__wrapped__ = original_fn
    return wrapper


class HookRegistry:
    """HookRegistry's class-level register/apply_hooks (each process's subclass holds its own
    hooks and stand-in modules; the real one resolves targets with pkgutil.resolve_name):
    function targets only, REPLACE hooks applied before the others, each target patched once."""

    SIGNATURES = {
        "register": "(cls, target, hook, hook_type=HookType.AFTER, *, source=None)",
        "apply_hooks": "(cls)",
    }
    modules: dict[str, object] = {}
    _hooks: dict[str, list[tuple[HookType, object]]] = {}
    _patched: set[str] = set()

    @classmethod
    def register(cls, target, hook, hook_type=HookType.AFTER, *, source=None):
        if isinstance(hook, type) and hook_type != HookType.REPLACE:
            raise TypeError(f"Class {hook.__name__} can only be used with HookType.REPLACE")
        cls._hooks.setdefault(target, []).append((hook_type, hook))

    @classmethod
    def _resolve(cls, path: str):
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):
            head = ".".join(parts[:cut])
            if head in cls.modules:
                obj = cls.modules[head]
                for name in parts[cut:]:
                    obj = getattr(obj, name)
                return obj
        raise ImportError(f"stand-in HookRegistry: no stand-in module for {path}")

    @classmethod
    def apply_hooks(cls):
        for target, hooks in cls._hooks.items():
            if target in cls._patched:
                continue
            owner_path, attr = target.rsplit(".", 1)
            owner = cls._resolve(owner_path)
            wrapped = getattr(owner, attr)
            ordered = sorted(hooks, key=lambda h: 0 if h[0] == HookType.REPLACE else 1)
            for hook_type, hook in ordered:
                wrapped = _wrap_fn(wrapped, hook, hook_type)
            setattr(owner, attr, wrapped)
            cls._patched.add(target)


# ------------------------------------------------------------ sglang.srt.plugins
GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"


# ------------------------------------------------------------ sglang.srt.runtime_context
class GroupCoordinator:
    """parallel_state.GroupCoordinator's fields the integration reads: the gloo `cpu_group`."""

    def __init__(self, cpu_group):
        import torch.distributed as dist

        self.cpu_group = cpu_group
        alone = cpu_group is None  # a single-process test: one rank, no group
        self.world_size = 1 if alone else dist.get_world_size(cpu_group)
        self.rank_in_group = 0 if alone else dist.get_rank(cpu_group)


@dataclass
class ParallelContext:
    """get_parallel()'s widths and groups the integration reads."""

    attn_tp_size: int
    moe_ep_group: GroupCoordinator
    moe_ep_rank: int
    moe_ep_size: int
    moe_tp_size: int = 1


# ------------------------------------------------------------ sglang.srt.environ
class EnvInt:
    """environ.EnvInt: `get()` returns the value (here: the stand-in's, not the environment's)."""

    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


# ------------------------------------------------------------ sglang.srt.layers.moe.utils
class MoeA2ABackend(Enum):
    NONE = "none"
    FLASHINFER = "flashinfer"
    MEGAMOE = "megamoe"

    def is_flashinfer(self):
        return self == MoeA2ABackend.FLASHINFER

    def is_megamoe(self):
        return self == MoeA2ABackend.MEGAMOE


class MoeRunnerBackend(Enum):
    AUTO = "auto"
    DEEP_GEMM = "deep_gemm"
    FLASHINFER_TRTLLM = "flashinfer_trtllm"
    FLASHINFER_TRTLLM_ROUTED = "flashinfer_trtllm_routed"
    FLASHINFER_CUTLASS = "flashinfer_cutlass"

    def is_deep_gemm(self):
        return self == MoeRunnerBackend.DEEP_GEMM

    def is_flashinfer_trtllm(self):
        return self == MoeRunnerBackend.FLASHINFER_TRTLLM

    def is_flashinfer_trtllm_routed(self):
        return self == MoeRunnerBackend.FLASHINFER_TRTLLM_ROUTED


# ------------------------------------------------------------ sglang.srt.layers.moe.topk
class StandardTopKOutput(NamedTuple):
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor


# ------------------------------------------------------------ sglang.srt.model_executor
@dataclass(frozen=True)
class ForwardContext:
    """forward_context.ForwardContext: `moe_num_token_non_padded` is a getter of the device
    scalar bounding the real MoE rows."""

    attn_backend: object
    moe_num_token_non_padded: object = None


# ------------------------------------------------------------ sglang.srt.layers.layernorm
class RMSNorm(nn.Module):
    """layernorm.RMSNorm.forward_native without residual: fp32 x * rsqrt(mean(x^2) + eps) times
    the weight, rounded to the input's dtype."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        # requires_grad off: SGLang runs its forward without autograd.
        weight = torch.ones(hidden_size, dtype=torch.bfloat16)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = eps
        self.calls = 0  # how often the norm ran: the tests check it runs once a step

    def forward(self, x):
        self.calls += 1
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return (x * self.weight).to(orig_dtype)


# ------------------------------------------------------------ token_dispatcher.base / flashinfer
class BaseDispatcher(ABC):
    """token_dispatcher.base.BaseDispatcher: two abstract methods, and the pre-dispatch hook
    that replaces `dispatch` by a wrapper calling the original with keywords."""

    SIGNATURES = {
        "__init__": "(self)",
        "dispatch": "(self, hidden_states, topk_output)",
        "combine": "(self, combine_input)",
    }

    def __init__(self):
        self.quant_config: dict = {}
        self.runner_backend = None
        self._pre_dispatch_hooks: list | None = None
        self._original_dispatch_func = None

    @abstractmethod
    def dispatch(self, hidden_states, topk_output):
        pass

    @abstractmethod
    def combine(self, combine_input):
        pass

    def _dispatch_with_hook(self, hidden_states, topk_output):
        for hook in self._pre_dispatch_hooks:
            result = hook(self, hidden_states, topk_output)
            if result is not None:
                hidden_states, topk_output = result
        return self._original_dispatch_func(hidden_states=hidden_states, topk_output=topk_output)

    def register_pre_dispatch_hook(self, hook):
        if self._pre_dispatch_hooks is None:
            self._pre_dispatch_hooks = []
            self._original_dispatch_func = self.dispatch
            self.dispatch = self._dispatch_with_hook
        self._pre_dispatch_hooks.append(hook)


class FlashinferDispatchOutput(NamedTuple):
    hidden_states: torch.Tensor
    hidden_states_scale: torch.Tensor | None
    topk_output: StandardTopKOutput
    moe_output: torch.Tensor | None = None
    output_dtype: torch.dtype | None = None


class FlashinferCombineInput(NamedTuple):
    hidden_states: torch.Tensor


class StandardDispatcher(BaseDispatcher):
    """What create_moe_dispatcher gives under megamoe: a pass-through K3 never calls."""

    def __init__(self, moe_runner_config):
        super().__init__()
        self.moe_runner_config = moe_runner_config

    def dispatch(self, hidden_states, topk_output):
        raise AssertionError("StandardDispatcher.dispatch: megamoe never dispatches here")

    def combine(self, combine_input):
        raise AssertionError("StandardDispatcher.combine: megamoe never combines here")


# ------------------------------------------------------------ layers.moe.fused_moe_triton.layer
@dataclass
class MoeRunnerConfig:
    num_experts: int | None = None
    num_local_experts: int | None = None
    hidden_size: int | None = None
    intermediate_size_per_partition: int | None = None
    layer_id: int | None = None
    top_k: int | None = None
    runner_backend: object = None
    activation: str = "silu"
    routed_scaling_factor: float | None = None
    gemm1_alpha: float | None = None
    gemm1_clamp_limit: float | None = None
    gate_up_interleaved: bool = True


def create_moe_dispatcher(moe_runner_config, quant_method):
    """StandardDispatcher for megamoe; the stand-in has no FlashinferDispatcher (the tests run
    dep_ep's in its place)."""
    return StandardDispatcher(moe_runner_config)


create_moe_dispatcher.SIGNATURE = "(moe_runner_config, quant_method)"


class FusedMoE(nn.Module):
    """fused_moe_triton.layer.FusedMoE's parts the integration reads: its EP placement, the
    quant method's parameters (create_weights called as the real constructor calls it), the
    runner config, the dispatcher from the module's create_moe_dispatcher (quant_method by
    keyword, as the real one passes it) and forward's dispatch -> runner -> combine."""

    SIGNATURES = {
        "weight_loader": "(self, param, loaded_weight, weight_name, shard_id, expert_id)",
        "forward": "(self, hidden_states, topk_output, pre_quant_input=None)",
    }
    sglang: SglangStandin  # set on each process's subclass

    def __init__(
        self,
        num_experts,
        hidden_size,
        intermediate_size,
        layer_id,
        top_k=None,
        quant_config=None,
        prefix="",
        activation="silu",
        routed_scaling_factor=None,
        gemm1_alpha=None,
        gemm1_clamp_limit=None,
        gate_up_interleaved=True,
    ):
        super().__init__()
        parallel = self.sglang.parallel
        self.layer_id, self.top_k, self.hidden_size = layer_id, top_k, hidden_size
        self.num_experts = num_experts
        self.num_fused_shared_experts = 0
        self.moe_ep_size, self.moe_ep_rank = parallel.moe_ep_size, parallel.moe_ep_rank
        self.moe_tp_size = parallel.moe_tp_size
        self.num_local_experts = num_experts // self.moe_ep_size
        self.intermediate_size_per_partition = intermediate_size // self.moe_tp_size
        self.moe_runner_config = MoeRunnerConfig(
            num_experts=num_experts,
            num_local_experts=self.num_local_experts,
            hidden_size=hidden_size,
            intermediate_size_per_partition=self.intermediate_size_per_partition,
            layer_id=layer_id,
            top_k=top_k,
            runner_backend=self.sglang.runner_backend,
            activation=activation,
            routed_scaling_factor=routed_scaling_factor,
            gemm1_alpha=gemm1_alpha,
            gemm1_clamp_limit=gemm1_clamp_limit,
            gate_up_interleaved=gate_up_interleaved,
        )
        self.quant_method = self.sglang.Mxfp4MoEMethod(prefix)
        self.quant_method.create_weights(
            layer=self,
            num_experts=self.num_local_experts,
            hidden_size=hidden_size,
            intermediate_size_per_partition=self.intermediate_size_per_partition,
            params_dtype=torch.bfloat16,
            with_bias=False,
            moe_intermediate_size=intermediate_size,
        )
        # _fuses_routed_scaling_factor_in_topk: the runners that take the factor into their
        # top-k weights (the tests set it either way).
        self.should_fuse_routed_scaling_factor_in_topk = False
        layer_module = self.sglang.modules["sglang.srt.layers.moe.fused_moe_triton.layer"]
        self.dispatcher = layer_module.create_moe_dispatcher(
            self.moe_runner_config, quant_method=self.quant_method
        )
        self.runner = None  # the tests' stand-in of the quant method's apply (experts rows)

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id):
        """The per-expert load as the real loader makes it without an expert-location map: a
        global expert id another rank owns is skipped; w1 fills the first half of the w13 rows,
        w3 the second (no `load_up_proj_weight_first` on Mxfp4MoEMethod), w2 the whole."""
        local = expert_id - self.moe_ep_rank * self.num_local_experts
        if not 0 <= local < self.num_local_experts:
            return
        expert_data = param.data[local]
        if shard_id in ("w1", "w3"):
            half = expert_data.shape[0] // 2
            rows = slice(0, half) if shard_id == "w1" else slice(half, 2 * half)
            expert_data[rows].copy_(loaded_weight)
        else:
            expert_data.copy_(loaded_weight)

    def forward(self, hidden_states, topk_output, pre_quant_input=None):
        dispatch_output = self.dispatcher.dispatch(
            hidden_states=hidden_states, topk_output=topk_output
        )
        combine_input = self.runner(dispatch_output)
        return self.dispatcher.combine(combine_input=combine_input)


# ------------------------------------------------------------ layers.quantization.mxfp4
class Mxfp4MoEMethod:
    """quantization.mxfp4.Mxfp4MoEMethod: create_weights' checkpoint-layout parameters (no
    padding under megamoe), and a process_weights_after_loading standing in for the DeepGEMM
    conversion (weights viewed as int8, scales replaced by another layout, the parameters
    repointed, `_mega_moe_weights_built` set), so a test sees whether it ran."""

    SIGNATURES = {
        "__init__": "(self, prefix)",
        "create_weights": (
            "(self, layer, num_experts, hidden_size, intermediate_size_per_partition,"
            " params_dtype, with_bias=False, **extra_weight_attrs)"
        ),
        "process_weights_after_loading": "(self, layer)",
    }
    sglang: SglangStandin  # set on each process's subclass

    def __init__(self, prefix):
        self.prefix = prefix
        self.use_mega_moe = self.sglang.a2a.is_megamoe()

    def create_weights(
        self,
        layer,
        num_experts,
        hidden_size,
        intermediate_size_per_partition,
        params_dtype,
        with_bias=False,
        **extra_weight_attrs,
    ):
        inter, block = intermediate_size_per_partition, 32
        shapes = {
            "w13_weight": ((num_experts, 2 * inter, hidden_size // 2), 0),
            "w13_weight_scale": ((num_experts, 2 * inter, hidden_size // block), _UE8M0_ONE),
            "w2_weight": ((num_experts, hidden_size, inter // 2), 0),
            "w2_weight_scale": ((num_experts, hidden_size, inter // block), _UE8M0_ONE),
        }
        for name, (shape, fill) in shapes.items():
            data = torch.full(shape, fill, dtype=torch.uint8)
            layer.register_parameter(name, nn.Parameter(data, requires_grad=False))
        # Not on HIP the real one makes zero bf16 biases too (K3 loads none).
        bias = torch.zeros(num_experts, 2 * inter, dtype=torch.bfloat16)
        layer.register_parameter("w13_weight_bias", nn.Parameter(bias, requires_grad=False))
        bias = torch.zeros(num_experts, hidden_size, dtype=torch.bfloat16)
        layer.register_parameter("w2_weight_bias", nn.Parameter(bias, requires_grad=False))

    def process_weights_after_loading(self, layer):
        layer.w13_weight.data = layer.w13_weight.data.view(torch.int8)
        layer.w2_weight.data = layer.w2_weight.data.view(torch.int8)
        for name in ("w13_weight_scale", "w2_weight_scale"):
            scale = getattr(layer, name)
            scale.data = scale.data.transpose(1, 2).contiguous().to(torch.float32)
        layer.mega_l1_weights = (layer.w13_weight.data, layer.w13_weight_scale.data)
        layer.mega_l2_weights = (layer.w2_weight.data, layer.w2_weight_scale.data)
        layer._mega_moe_weights_built = True


# ------------------------------------------------------------ models.kimi_k3
class KimiK3MoE(nn.Module):
    """models.kimi_k3.KimiK3MoE's routed part: the experts (a FusedMoE with K3's SiTU constants
    and gate_up_interleaved=False), the latent norm, the megamoe flag, and `forward_routed`,
    the latent tail of `_forward_unfused` as 0.5.23 runs it: an idle rank enters with a [0, L]
    latent, the experts' output is norm-ed by `_reduce_latent` unless it has no rows."""

    SIGNATURES = {
        "__init__": "(self, config, quant_config=None, prefix='', layer_idx=0, alt_stream=None)",
        "_forward_mega_experts": "(self, routed_input, topk_output)",
        "_latent_norm": "(self, latent)",
        "_reduce_latent": "(self, latent)",
    }
    sglang: SglangStandin  # set on each process's subclass

    def __init__(self, config, quant_config=None, prefix="", layer_idx=0, alt_stream=None):
        super().__init__()
        self.routed_scaling_factor = config.routed_scaling_factor
        self.layer_idx = layer_idx
        self.moe_hidden_size = config.routed_expert_hidden_size
        self.experts = self.sglang.FusedMoE(
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_token,
            hidden_size=self.moe_hidden_size,
            intermediate_size=config.moe_intermediate_size,
            layer_id=layer_idx,
            quant_config=quant_config,
            routed_scaling_factor=self.routed_scaling_factor,
            activation=config.hidden_act,
            gemm1_alpha=config.activation_situ_beta,
            gemm1_clamp_limit=config.activation_situ_linear_beta,
            gate_up_interleaved=False,
            prefix=f"{prefix}.experts",
        )
        self._use_mega_moe = self.sglang.a2a.is_megamoe()
        self._mega_top_k = config.num_experts_per_token
        self.routed_expert_norm = RMSNorm(self.moe_hidden_size, eps=config.rms_norm_eps)

    def _forward_mega_experts(self, routed_input, topk_output):
        raise AssertionError("KimiK3MoE._forward_mega_experts: DeepGEMM's mega kernel ran")

    def _latent_norm(self, latent):
        if self.routed_expert_norm is None:
            return latent
        return self.routed_expert_norm(latent)

    def _reduce_latent(self, latent):
        return self._latent_norm(latent)

    def forward_routed(self, routed_input, topk_output):
        """bf16 [n, L]: _forward_unfused's latent after the routed experts (before the up
        projection, which is the caller's)."""
        if self._use_mega_moe:
            expert_output = self._forward_mega_experts(routed_input, topk_output)
        else:
            expert_output = self.experts(routed_input, topk_output)
        if expert_output.shape[0] == 0:
            return routed_input.new_empty((0, self.moe_hidden_size))
        return self._reduce_latent(expert_output)


# ------------------------------------------------------------ eplb.expert_distribution
class ExpertDistributionRecorder:
    """The recorder's per-rank-count hook as the low-latency gatherer takes it: the counts of
    the current layer (`with_current_layer`) added into its [layers, E_local] int32 data."""

    SIGNATURES = {"on_deepep_dispatch_low_latency": "(self, local_physical_count_of_layer)"}

    def __init__(self, num_layers: int, num_local_experts: int):
        self.data = torch.zeros(num_layers, num_local_experts, dtype=torch.int32)
        self.current_layer: int | None = None

    @contextlib.contextmanager
    def with_current_layer(self, layer_idx):
        self.current_layer = layer_idx
        try:
            yield
        finally:
            self.current_layer = None

    def on_deepep_dispatch_low_latency(self, local_physical_count_of_layer):
        self.data[self.current_layer, :] += local_physical_count_of_layer


# ------------------------------------------------------------ managers.scheduler
class Scheduler:
    SIGNATURES = {"process_batch_result": "(self, batch, result)"}

    def process_batch_result(self, batch, result):
        return None


# ------------------------------------------------------------ module-level functions
# The SGLang functions SglangStandin's modules answer with its own state (closures, so they have
# no definitions of their own here), by module: the real ones' parameters.
FUNCTION_SIGNATURES = {
    "sglang.srt.layers.dp_attention": {"get_dp_global_num_tokens": "()"},
    "sglang.srt.model_executor.forward_context": {
        "has_forward_context": "()",
        "get_forward_context": "()",
    },
    "sglang.srt.layers.moe.utils": {"get_moe_a2a_backend": "()"},
    "sglang.srt.eplb.expert_distribution": {"get_global_expert_distribution_recorder": "()"},
    "sglang.srt.runtime_context": {"get_parallel": "()", "get_exec": "()"},
}


# ------------------------------------------------------------ one process
class SglangStandin:
    """One SGLang process's state and stand-in modules, keyed by the real module names.

    group: the test's gloo group (SGLang's moe_ep_group.cpu_group); a2a: the
    `--moe-a2a-backend`; attn_tp_size; mega_max_tokens and dispatch_max_tokens: the token
    budget variables; recording: whether an expert-distribution recorder runs; version: what
    the engine reports as SGLang's version."""

    def __init__(
        self,
        group,
        *,
        a2a: str = "megamoe",
        attn_tp_size: int = 1,
        mega_max_tokens: int = 8192,
        dispatch_max_tokens: int | None = None,
        recording: bool = False,
        num_layers: int = 4,
        runner_backend: MoeRunnerBackend | None = None,
        version: str = "0.5.23",
    ):
        coordinator = GroupCoordinator(group)
        ranks, rank = coordinator.world_size, coordinator.rank_in_group
        self.version = version
        self.a2a = MoeA2ABackend(a2a)
        self.runner_backend = runner_backend
        self.parallel = ParallelContext(attn_tp_size, coordinator, rank, ranks)
        self.dp_global_num_tokens: list[int] | None = None
        self.forward: ForwardContext | None = None
        self.recorder = None
        self.recording = recording
        self.num_layers = num_layers
        fields = dict(sglang=self)
        self.KimiK3MoE = type("KimiK3MoE", (KimiK3MoE,), dict(fields))
        self.FusedMoE = type("FusedMoE", (FusedMoE,), dict(fields))
        self.Mxfp4MoEMethod = type("Mxfp4MoEMethod", (Mxfp4MoEMethod,), dict(fields))
        self.Scheduler = type("Scheduler", (Scheduler,), {})
        recorder_mode = "stat" if recording else None
        moe_config = SimpleNamespace(expert_distribution_recorder_mode=recorder_mode)
        exec_config = SimpleNamespace(moe=moe_config)
        envs = SimpleNamespace(
            SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK=EnvInt(mega_max_tokens),
            SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK=EnvInt(dispatch_max_tokens),
        )
        self.modules = {
            "sglang.srt.runtime_context": SimpleNamespace(
                get_parallel=lambda: self.parallel, get_exec=lambda: exec_config
            ),
            "sglang.srt.environ": SimpleNamespace(envs=envs),
            "sglang.srt.layers.dp_attention": SimpleNamespace(
                get_dp_global_num_tokens=lambda: self.dp_global_num_tokens
            ),
            "sglang.srt.model_executor.forward_context": SimpleNamespace(
                has_forward_context=lambda: self.forward is not None,
                get_forward_context=lambda: self.forward,
            ),
            "sglang.srt.layers.moe.utils": SimpleNamespace(get_moe_a2a_backend=lambda: self.a2a),
            "sglang.srt.eplb.expert_distribution": SimpleNamespace(
                get_global_expert_distribution_recorder=lambda: self.recorder
            ),
            "sglang.srt.layers.moe.token_dispatcher.base": SimpleNamespace(
                BaseDispatcher=BaseDispatcher
            ),
            "sglang.srt.layers.moe.token_dispatcher.flashinfer": SimpleNamespace(
                FlashinferDispatchOutput=FlashinferDispatchOutput,
                FlashinferCombineInput=FlashinferCombineInput,
            ),
            "sglang.srt.layers.moe.topk": SimpleNamespace(StandardTopKOutput=StandardTopKOutput),
            "sglang.srt.layers.moe.fused_moe_triton.layer": SimpleNamespace(
                create_moe_dispatcher=create_moe_dispatcher, FusedMoE=self.FusedMoE
            ),
            "sglang.srt.models.kimi_k3": SimpleNamespace(KimiK3MoE=self.KimiK3MoE),
            "sglang.srt.layers.quantization.mxfp4": SimpleNamespace(
                Mxfp4MoEMethod=self.Mxfp4MoEMethod
            ),
            "sglang.srt.managers.scheduler": SimpleNamespace(Scheduler=self.Scheduler),
        }
        hooks = dict(modules=self.modules, _hooks={}, _patched=set())
        self.registry = type("HookRegistry", (HookRegistry,), hooks)
        self.modules["sglang.srt.plugins.hook_registry"] = SimpleNamespace(
            HookRegistry=self.registry, HookType=HookType
        )

    def start_recorder(self, num_local_experts: int) -> ExpertDistributionRecorder:
        self.recorder = ExpertDistributionRecorder(self.num_layers, num_local_experts)
        return self.recorder

    @contextlib.contextmanager
    def step(self, counts: list[int] | None, num_token_non_padded: torch.Tensor | None = None):
        """One forward: the DP counts `set_dp_buffer_len` publishes and the ForwardContext
        with its real-row bound (None: no bound)."""
        bound = None if num_token_non_padded is None else (lambda: num_token_non_padded)
        self.dp_global_num_tokens = counts
        self.forward = ForwardContext(attn_backend=None, moe_num_token_non_padded=bound)
        try:
            yield
        finally:
            self.dp_global_num_tokens, self.forward = None, None


def scattered_source_token_counts(dp_global_num_tokens, attn_tp_size):
    """token_dispatcher/flashinfer.py's _scattered_source_token_counts: each DP rank's tokens
    split over its attention-TP ranks, the first `remainder` ranks taking one more."""
    counts = []
    for num_tokens in dp_global_num_tokens:
        base, remainder = divmod(num_tokens, attn_tp_size)
        counts.extend(base + int(rank < remainder) for rank in range(attn_tp_size))
    return counts


scattered_source_token_counts.SIGNATURE = "(dp_global_num_tokens, attn_tp_size)"


def k3_config(geometry, *, routed_scaling_factor: float = 1.0, situ=(4.0, 25.0)):
    """The K3 config fields KimiK3MoE reads, for `geometry` (a dep_ep MoeGeometry)."""
    return SimpleNamespace(
        n_routed_experts=geometry.experts,
        num_experts_per_token=geometry.topk,
        routed_expert_hidden_size=geometry.latent,
        moe_intermediate_size=geometry.intermediate,
        routed_scaling_factor=routed_scaling_factor,
        hidden_act="situ",
        activation_situ_beta=situ[0],
        activation_situ_linear_beta=situ[1],
        rms_norm_eps=1e-5,
    )


class StandinEngine(SglangEngine):
    """The integration's seam over a SglangStandin: the real seam's methods, with the module
    names mapped to the stand-in modules; a short EpRouted timeout; experts built by `factory`
    (default: the real default_experts) with every ExpertWeights recorded in `built`."""

    def __init__(self, sglang: SglangStandin, factory=None):
        self.sglang, self.factory, self.built = sglang, factory, []

    def _module(self, name):
        return self.sglang.modules[name]

    def version(self):
        return self.sglang.version

    def ep_config(self, *, count_experts):
        return EpConfig(timeout_s=10.0, count_experts=count_experts)

    def build_experts(self, weights):
        self.built.append(weights)
        if self.factory is None:
            return super().build_experts(weights)
        return self.factory(weights)
