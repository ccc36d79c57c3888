"""The per-step poll under vLLM: after every engine step of a worker (vLLM 0.33.0's
`Worker.execute_model`, and `Worker.execute_dummy_batch`, the step an idle data-parallel rank
runs) every shared EpRouted is polled (`dep_ep.integrations.common.poll_all`). Under CUDA-graph
replay no Python of the MoE layers runs: a failed step leaves NaN rows, and this poll, outside
any capture, is what raises its error (on every rank, at that step or the next)."""

from __future__ import annotations

import functools
from typing import Any, Callable

from dep_ep.integrations.common import poll_all
from dep_ep.integrations.vllm.engine import engine

STEP_METHODS = ("execute_model", "execute_dummy_batch")
_WRAPPED = "__dep_ep_polled__"


def polled(step: Callable[..., Any]) -> Callable[..., Any]:
    """`step` followed by poll_all() (the step's own result returned; its exception, if any,
    raised without a poll)."""

    @functools.wraps(step)
    def step_then_poll(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        poll_all()
        return result

    setattr(step_then_poll, _WRAPPED, True)
    return step_then_poll


def install_step_poll() -> type:
    """Wrap the worker class's step methods with `polled` (once per process; later calls change
    nothing). Returns the worker class. Called where only worker processes get: when the model
    or a prepare/finalize is built."""
    worker = engine().worker_class()
    for name in STEP_METHODS:
        method = getattr(worker, name)
        if not getattr(method, _WRAPPED, False):
            setattr(worker, name, polled(method))
    return worker
