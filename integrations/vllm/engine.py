"""The one seam between the adapter and vLLM: every vLLM object the adapter reads is looked up
here, inside a method, so importing dep_ep.integrations.vllm imports no vLLM, and the CPU tests
run the same adapter code against stand-ins (`replaced(standin)`) that the engine runs against
vLLM 0.33.0. The engine facts each method relies on are restated in docs/integrations.md
("vLLM")."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

# The vLLM releases this integration was written against and checked with
# (tests/integrations/test_vllm_real.py compares their classes with the stand-ins).
WRITTEN_AGAINST = ("0.33.0",)

_FORWARD_CONTEXT = "vllm.forward_context"


class VllmEngine:
    """The real engine. Each method imports what it returns from vLLM when called."""

    def version(self) -> str:
        """vLLM's version string (`vllm.version.__version__`)."""
        from vllm.version import __version__

        return __version__

    def forward_context(self) -> Any | None:
        """The current `vllm.forward_context.ForwardContext` (dp_metadata, is_padding), or None
        outside a forward pass."""
        # Called once a MoE layer: an imported module is taken from sys.modules directly (a
        # `from ... import` inside the call took about 3 us of the adapter's host time a layer
        # call on an x86 host, docs/integrations.md).
        module = sys.modules.get(_FORWARD_CONTEXT)
        if module is None:
            module = importlib.import_module(_FORWARD_CONTEXT)
        return module.get_forward_context() if module.is_forward_context_available() else None

    def ep_group(self) -> Any:
        """`vllm.distributed.get_ep_group()`: the EP GroupCoordinator (cpu_group: a gloo
        torch.distributed group of the EP ranks; world_size; rank_in_group)."""
        from vllm.distributed import get_ep_group

        return get_ep_group()

    def register_model(self, architecture: str, target: str) -> None:
        """`ModelRegistry.register_model(architecture, "module:Class")` (lazy: vLLM imports the
        module when it builds the model)."""
        from vllm.model_executor.models.registry import ModelRegistry

        ModelRegistry.register_model(architecture, target)

    def kimi_k3_module(self) -> ModuleType:
        """`vllm.models.kimi_k3.nvidia.model`: KimiK3ForConditionalGeneration, KimiMoE, and the
        module global DeepGemmMegaMoEExperts that KimiMoE.__init__ builds its experts with."""
        import vllm.models.kimi_k3.nvidia.model as kimi_k3

        return kimi_k3

    def eplb_layer_state(self) -> Any:
        """A fresh `EplbLayerState()` (DeepGemmMegaMoEExperts.eplb_state's type)."""
        from vllm.distributed.eplb.eplb_state import EplbLayerState

        return EplbLayerState()

    def prepare_finalize_base(self) -> tuple[type, Any]:
        """(FusedMoEPrepareAndFinalizeModular, FusedMoEActivationFormat.Standard) of
        vllm.model_executor.layers.fused_moe.modular_kernel."""
        from vllm.model_executor.layers.fused_moe import modular_kernel as mk

        return mk.FusedMoEPrepareAndFinalizeModular, mk.FusedMoEActivationFormat.Standard

    def worker_class(self) -> type:
        """`vllm.v1.worker.gpu_worker.Worker`, whose execute_model and execute_dummy_batch run
        one engine step each (a real batch, or an idle data-parallel rank's dummy batch)."""
        from vllm.v1.worker.gpu_worker import Worker

        return Worker


_current: list[Any] = [VllmEngine()]


def engine() -> Any:
    """The engine the adapter talks to: vLLM, or the stand-in a test installed."""
    return _current[-1]


@contextmanager
def replaced(standin: Any) -> Iterator[Any]:
    """Talk to `standin` (an object with VllmEngine's methods) instead of vLLM inside the block."""
    _current.append(standin)
    try:
        yield standin
    finally:
        _current.remove(standin)


def check_version(fn: str, found: str) -> str:
    """`found` when it is a release this integration was written against, else ValueError naming
    `fn`, the version found and the ones supported (an engine's internals move between releases:
    the classes this adapter replaces were renamed and changed layout before 0.33.0)."""
    if found not in WRITTEN_AGAINST:
        raise ValueError(
            f"{fn}: vLLM {found} is installed; dep_ep.integrations.vllm was written against vLLM"
            f" {', '.join(WRITTEN_AGAINST)} and checked with it (docs/integrations.md): install"
            f" vllm=={WRITTEN_AGAINST[-1]}, or unset DEP_EP_VLLM to run vLLM without dep_ep"
        )
    return found
