"""dep_ep under vLLM 0.33.0 (docs/integrations.md, "vLLM").

- `plugin.register`: the `vllm.general_plugins` entry point; a no-op unless DEP_EP_VLLM=1, then
  it checks the vLLM version and registers `KimiK3ForConditionalGeneration` as
  `kimi_k3.DepEpKimiK3ForConditionalGeneration`, whose routed experts are
  `kimi_k3.DepEpKimiExperts`.
- `prepare_finalize`: a modular prepare/finalize for other MoE models whose experts take -1 ids.
- `engine`: the one seam through which the adapter reaches vLLM's objects (replaced by stand-ins
  in the CPU tests); `steps`: the step's T and the padding ids from vLLM's forward context.

Importing this package, or any module of it, imports no vLLM: every vLLM import sits inside a
function of `engine`."""
