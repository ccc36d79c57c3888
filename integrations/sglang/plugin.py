"""SGLang's entry point into dep_ep (`[project.entry-points."sglang.srt.plugins"]`): SGLang's
`load_plugins()` calls `register()` in each of its processes, then applies the registered hooks.
Without DEP_EP_SGLANG=1 it does nothing; with it, it checks the SGLang version and registers
`HOOKS` with SGLang's HookRegistry."""

from __future__ import annotations

from typing import NamedTuple

from dep_ep.integrations import common
from dep_ep.integrations.sglang import dispatcher, kimi_k3
from dep_ep.integrations.sglang.engine import engine
from dep_ep.launch import integration_enabled


def poll_after_step(result: object, *args, **kwargs) -> None:
    """AFTER hook of `Scheduler.process_batch_result(self, batch, result)`, which both of
    SGLang's scheduler loops call once per engine step once the step's outputs are on the host:
    `poll_all()` raises what a kernel recorded in that step (a peer's failure, differing tags or
    token counts, a timeout) and a lost peer, which under CUDA-graph replay nothing else reports
    (the failed step's rows are NaN). Returns None: the result stands."""
    common.poll_all()


class Hook(NamedTuple):
    """One registration: SGLang's dotted target, the hook, and its HookType's name."""

    target: str
    hook: object
    kind: str


_K3 = "sglang.srt.models.kimi_k3.KimiK3MoE"
HOOKS = (
    Hook(f"{_K3}.__init__", kimi_k3.mark_k3_experts, "AFTER"),
    Hook(
        "sglang.srt.layers.quantization.mxfp4.Mxfp4MoEMethod.process_weights_after_loading",
        kimi_k3.process_weights_after_loading,
        "AROUND",
    ),
    Hook(f"{_K3}._forward_mega_experts", kimi_k3.forward_mega_experts, "REPLACE"),
    Hook(
        "sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher",
        dispatcher.create_moe_dispatcher,
        "AROUND",
    ),
    Hook("sglang.srt.managers.scheduler.Scheduler.process_batch_result", poll_after_step, "AFTER"),
)


def register() -> None:
    """The `sglang.srt.plugins` entry point. A no-op unless DEP_EP_SGLANG=1
    (`dep_ep.launch.integration_enabled`); then ImportError unless the installed SGLang is one
    the hooks were written against (0.5.23), else every hook of `HOOKS` registered with
    SGLang's HookRegistry, which `load_plugins()` applies next. SGLang logs an exception raised
    here and goes on without the plugin: the error is in every process's log."""
    if not integration_enabled("sglang"):
        return
    eng = engine()
    eng.check_version("dep_ep.integrations.sglang.plugin.register")
    registry, hook_type = eng.hook_registry()
    for hook in HOOKS:
        registry.register(hook.target, hook.hook, getattr(hook_type, hook.kind))
