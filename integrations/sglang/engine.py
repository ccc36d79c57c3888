"""The seam between dep_ep's SGLang hooks and SGLang itself: every engine object the hooks use is
reached by one method of `SglangEngine`, which imports its SGLang module inside the call
(`_module`), so importing dep_ep needs no SGLang and the CPU tests put stand-ins of the same
module shapes behind the same calls (`use_engine`). The module paths and attributes are those of
SGLang 0.5.23 (`SGLANG_VERSIONS`); docs/integrations.md ("SGLang") restates each fact used.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from types import ModuleType

import torch
import torch.distributed as dist

from dep_ep.config import EpConfig
from dep_ep.experts.base import ExpertsBackend
from dep_ep.experts.select import default_experts
from dep_ep.experts.weights import ExpertWeights

# The SGLang releases whose internals the hooks were written against and checked with
# (tests/integrations/test_sglang_real.py reads that release's files).
SGLANG_VERSIONS = ("0.5.23",)

# EpConfig.timeout_s under a server: the first steps after load wait for the slowest rank's
# weight processing and kernel compilation, which take minutes at Kimi K3's size; a timeout
# needs a rebuild of the EpRouted, which a running engine cannot do.
SERVER_TIMEOUT_S = 600.0

_PARALLEL = "sglang.srt.runtime_context"
_ENVIRON = "sglang.srt.environ"


class SglangEngine:
    """SGLang's objects as the hooks need them. Each method is one read of SGLang state (no
    caching: the engine sets most of it per forward)."""

    def _module(self, name: str) -> ModuleType:
        """The SGLang module `name` (tests map the names to stand-ins). An imported module is
        taken from sys.modules directly: import_module's own lookup took ~1 us a call, and the
        hook makes three a layer call."""
        module = sys.modules.get(name)
        return importlib.import_module(name) if module is None else module

    def version(self) -> str:
        """The installed SGLang's version string (its distribution metadata; a source checkout
        without metadata: `sglang.__version__`)."""
        try:
            return importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            return self._module("sglang").__version__

    def check_version(self, fn: str) -> str:
        """The version, or ImportError naming `fn`, the version found and the ones the hooks
        were written against: they patch private SGLang internals that change between
        releases, so another release must not run them unchecked."""
        found = self.version()
        if found not in SGLANG_VERSIONS:
            raise ImportError(
                f"{fn}: sglang {found} is installed; dep_ep's SGLang integration was written"
                f" against sglang {', '.join(SGLANG_VERSIONS)} (KimiK3MoE._forward_mega_experts,"
                " Mxfp4MoEMethod.process_weights_after_loading, create_moe_dispatcher):"
                f" install sglang=={SGLANG_VERSIONS[-1]} or unset DEP_EP_SGLANG"
            )
        return found

    # ------------------------------------------------------------------------- parallel state
    def ep_group(self) -> dist.ProcessGroup:
        """The gloo group of SGLang's MoE expert-parallel ranks (`get_parallel().moe_ep_group`,
        a GroupCoordinator, `.cpu_group`): the group EpRouted's host barriers run on."""
        return self._module(_PARALLEL).get_parallel().moe_ep_group.cpu_group

    def attn_tp_size(self) -> int:
        """Attention tensor-parallel width: each data-parallel rank's tokens are split over
        this many ranks before the MoE (sequence-parallel MoE)."""
        return self._module(_PARALLEL).get_parallel().attn_tp_size

    def dp_global_num_tokens(self) -> list[int] | None:
        """Every data-parallel rank's token count of this forward (padded per SGLang's DP
        padding mode; the capture batch's during CUDA-graph capture), None outside DP."""
        return self._module("sglang.srt.layers.dp_attention").get_dp_global_num_tokens()

    def forward_context(self) -> object | None:
        """The running forward's ForwardContext, None outside a forward. SGLang publishes a fresh
        frozen one for every forward (ModelRunner, and each warm-up and capture run of its
        graph runners, through `forward_context(...)`, which always builds a new object), so
        its identity scopes one forward."""
        context = self._module("sglang.srt.model_executor.forward_context")
        return context.get_forward_context() if context.has_forward_context() else None

    def num_token_non_padded(self, forward: object | None = None) -> torch.Tensor | None:
        """The device scalar bounding this rank's real MoE rows (rows at or past it are padding:
        a CUDA-graph bucket's tail) of `forward` (a ForwardContext; None: the running one),
        None when there is no forward or it publishes no bound. The getter returns a tensor
        the forward batch holds (a graph runner's static buffer under capture)."""
        if forward is None:
            forward = self.forward_context()
            if forward is None:
                return None
        bound = forward.moe_num_token_non_padded
        return None if bound is None else bound()

    def a2a_backend(self) -> object:
        """`--moe-a2a-backend` as SGLang's MoeA2ABackend (`is_megamoe()`, `is_flashinfer()`)."""
        return self._module("sglang.srt.layers.moe.utils").get_moe_a2a_backend()

    # ------------------------------------------------------------------------- token budgets
    def mega_moe_max_tokens(self) -> int:
        """SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK (SGLang's default 8192): the
        per-rank rows SGLang's megamoe path takes in one step; the Kimi K3 EpRouted's
        max_tokens."""
        envs = self._module(_ENVIRON).envs
        return envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK.get()

    def dispatch_max_tokens(self) -> int | None:
        """SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK (unset: None): the per-rank rows of
        one FlashInfer all-to-all dispatch; the dispatcher's max_tokens."""
        envs = self._module(_ENVIRON).envs
        return envs.SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK.get()

    # ------------------------------------------------------------------------- EPLB recorder
    def expert_distribution_recording(self) -> bool:
        """Whether SGLang runs an expert-distribution recorder
        (`--expert-distribution-recorder-mode`): only then are received pairs counted."""
        moe = self._module(_PARALLEL).get_exec().moe
        return moe.expert_distribution_recorder_mode is not None

    def record_expert_load(self, counts: torch.Tensor) -> None:
        """Hand this rank's received (token, k) pairs per local expert of the current layer
        (int32 [E_local]) to the recorder (`on_deepep_dispatch_low_latency`): its per-rank
        gatherers add them up, the gatherer SGLang picks under megamoe ignores them (it counts
        at top-k selection, so nothing is counted twice)."""
        recorders = self._module("sglang.srt.eplb.expert_distribution")
        recorders.get_global_expert_distribution_recorder().on_deepep_dispatch_low_latency(counts)

    # ------------------------------------------------------------------------- types
    def hook_registry(self) -> tuple[type, type]:
        """(HookRegistry, HookType) of SGLang's plugin framework."""
        module = self._module("sglang.srt.plugins.hook_registry")
        return module.HookRegistry, module.HookType

    def dispatcher_types(self) -> tuple[type, type, type, type]:
        """(BaseDispatcher, FlashinferDispatchOutput, FlashinferCombineInput,
        StandardTopKOutput): the classes a dispatcher derives from and returns."""
        base = self._module("sglang.srt.layers.moe.token_dispatcher.base")
        flashinfer = self._module("sglang.srt.layers.moe.token_dispatcher.flashinfer")
        topk = self._module("sglang.srt.layers.moe.topk")
        return (
            base.BaseDispatcher,
            flashinfer.FlashinferDispatchOutput,
            flashinfer.FlashinferCombineInput,
            topk.StandardTopKOutput,
        )

    # ------------------------------------------------------------------------- dep_ep side
    def ep_config(self, *, count_experts: bool) -> EpConfig:
        """The EpConfig of a server's EpRouted (tests shorten the timeout)."""
        return EpConfig(timeout_s=SERVER_TIMEOUT_S, count_experts=count_experts)

    def build_experts(self, weights: ExpertWeights) -> ExpertsBackend:
        """The experts backend of one layer's checkpoint-layout weights: `default_experts`
        (HopperExperts on SM90, TrtllmExperts on SM100/103, ReferenceExperts elsewhere).
        HopperExperts takes the triton engine beside SGLang 0.5.23, whose humming-kernels 0.1.12
        is not the release the humming engine wraps."""
        return default_experts(weights)

    def device(self) -> torch.device:
        """Where a dispatcher built at model construction puts its buffers: the current CUDA
        device (SGLang binds one per rank before building the model), else the CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


_ENGINE: SglangEngine = SglangEngine()


def engine() -> SglangEngine:
    """The seam the hooks use now."""
    return _ENGINE


def use_engine(replacement: SglangEngine) -> SglangEngine:
    """Put `replacement` behind the hooks (tests: stand-ins); returns the one it replaces."""
    global _ENGINE
    if not isinstance(replacement, SglangEngine):
        raise TypeError(
            f"use_engine: replacement is {type(replacement).__name__}; expected a SglangEngine"
        )
    previous, _ENGINE = _ENGINE, replacement
    return previous
