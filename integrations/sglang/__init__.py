"""dep_ep under SGLang 0.5.23 (docs/integrations.md, "SGLang"): the routed experts of SGLang's own
Kimi K3 model run on dep_ep through SGLang's plugin hooks (`kimi_k3.py`), other models'
experts through a `BaseDispatcher` (`dispatcher.py`), both registered by `plugin.register`, the
`sglang.srt.plugins` entry point, when DEP_EP_SGLANG=1. Every SGLang object is reached through
`engine.py`'s seam, which imports SGLang inside its methods: importing this package needs no
SGLang."""
