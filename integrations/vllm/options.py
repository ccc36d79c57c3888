"""The adapter's options, from vLLM's `--additional-config` (VllmConfig.additional_config, a dict
vLLM hands to plugins untouched): the object under the key "dep_ep", e.g.
`--additional-config '{"dep_ep": {"fused_norm": true}}'`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from dep_ep.checks import check_int
from dep_ep.config import EpConfig

CONFIG_KEY = "dep_ep"
# A server's first steps (profiling, compilation, graph capture) can keep one rank away for
# minutes: a bound that covers them (docs/integrations.md).
SERVER_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class VllmOptions:
    """fused_norm: dep_ep's combine applies the latent RMSNorm (the model's routed_expert_norm
    weight and eps) and the model's own norm is skipped; False (default): combine returns the
    plain sum and vLLM's RMSNorm runs as in the model. max_tokens: the shared EpRouted's
    max_tokens (a step of more tokens runs in pieces); None: the scheduler's
    max_num_batched_tokens over the sequence-parallel size. timeout_s: EpConfig.timeout_s."""

    fused_norm: bool = False
    max_tokens: int | None = None
    timeout_s: float = SERVER_TIMEOUT_S

    def ep_config(self) -> EpConfig:
        return EpConfig(timeout_s=self.timeout_s)


def options_from(fn: str, vllm_config: Any) -> VllmOptions:
    """The options in `vllm_config.additional_config["dep_ep"]` (absent: the defaults);
    TypeError/ValueError naming `fn`, the key and the rule for anything else."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    given = extra.get(CONFIG_KEY, {}) if isinstance(extra, dict) else {}
    where = f"{fn}: additional_config[{CONFIG_KEY!r}]"
    if not isinstance(given, dict):
        raise TypeError(f"{where} is {type(given).__name__}; expected a JSON object")
    known = {f.name for f in fields(VllmOptions)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed {sorted(known)}")
    fused_norm = given.get("fused_norm", False)
    if not isinstance(fused_norm, bool):
        raise TypeError(f"{where}['fused_norm']={fused_norm!r}; expected true or false")
    max_tokens = given.get("max_tokens")
    if max_tokens is not None:
        max_tokens = check_int(fn, f"{CONFIG_KEY}.max_tokens", max_tokens)
        if max_tokens < 1:
            raise ValueError(f"{where}['max_tokens']={max_tokens}; expected an int >= 1")
    timeout_s = given.get("timeout_s", SERVER_TIMEOUT_S)
    options = VllmOptions(fused_norm, max_tokens, timeout_s)
    options.ep_config()  # EpConfig validates the timeout (finite, > 0) and names it
    return options
