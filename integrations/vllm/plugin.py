"""The `vllm.general_plugins` entry point (pyproject.toml: `dep_ep =
"dep_ep.integrations.vllm.plugin:register"`). vLLM 0.33.0's `load_general_plugins()` calls it in
every vLLM process (the API server, the engine cores, the workers) before any model is built."""

from __future__ import annotations

from dep_ep.integrations.vllm.engine import check_version, engine
from dep_ep.launch import integration_enabled

# The architecture (config.json "architectures") whose class the plugin replaces, and the lazy
# "module:Class" vLLM imports when it builds that model (no import of it here: the API server
# process never builds a model).
KIMI_K3_ARCHITECTURE = "KimiK3ForConditionalGeneration"
KIMI_K3_MODEL = "dep_ep.integrations.vllm.kimi_k3:DepEpKimiK3ForConditionalGeneration"


def register() -> bool:
    """Without DEP_EP_VLLM=1: nothing (returns False), so installing dep_ep beside vLLM changes
    nothing. With it: ValueError naming the versions this integration was written against unless
    the installed vLLM is one of them, then register KIMI_K3_MODEL for KIMI_K3_ARCHITECTURE with
    vLLM's ModelRegistry (which overrides the built-in entry) and return True. Safe to call more
    than once (vLLM may load plugins once per process, in several processes)."""
    if not integration_enabled("vllm"):
        return False
    seam = engine()
    check_version("dep_ep.integrations.vllm.plugin.register", seam.version())
    seam.register_model(KIMI_K3_ARCHITECTURE, KIMI_K3_MODEL)
    return True
