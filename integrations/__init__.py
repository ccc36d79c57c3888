"""dep_ep under serving engines: the engine-free pieces every integration uses
(`dep_ep.integrations.common`), and one subpackage per engine (vLLM, SGLang), which import their
engine only inside functions, so importing dep_ep.integrations needs no engine. The layer after
`dep_ep.ep` in the import order: nothing of the library imports it."""
