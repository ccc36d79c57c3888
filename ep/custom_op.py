"""`torch.ops.dep_ep.routed`: EpRouted.routed as a torch.library custom operator, so that
`torch.compile` (and a server's piecewise CUDA graphs) treat the whole routed path as one opaque
call instead of tracing into the transport's Python.

The operator takes tensors and numbers only; the EpRouted and its experts backend are named by
a handle `register_routed(routed, experts)` returns. Its fake (meta) implementation gives the
output's shape and dtype, bf16 [n, L], without running anything. `routed_op(...)` is the call
to put in a model:

    handle = register_routed(ep, experts)                       # once, at load
    normed = routed_op(latent, ids, weights, norm, handle, tokens=T, tag=layer, padding=mask)

The operator declares no mutation, so a compiler may drop a call whose output is unused: use
every call's output (the call is collective, and a rank that skips it leaves its peers waiting
until their timeout). It has no backward (inference only).

Registered with `torch.library.Library` (the schema, a CompositeExplicitAutograd kernel and a
fake), not the `torch.library.custom_op` decorator: the decorator's Python autograd and dispatch
wrappers took 11-16 us of host time a call on a 2-core x86 machine, the plain registration 4
(bench/bench_integration.py, own host time; the target is 5 us a layer call). Eager, `routed_op`
calls the operator's kernel itself: torch's dispatcher into a Python kernel alone took 7-8 us a
call on the H200 machine's host, in every grad mode and for every dispatch key the kernel was
registered under. Where a compiler or tracer sees the call (`torch.compiler.is_compiling()`,
tensors that are not plain torch.Tensor: fake, functional or proxy tensors, a torch dispatch mode
such as make_fx's real-tensor tracing, or torch.jit.trace's tracing state) it calls the operator,
so the traced graph holds the one opaque node.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from dep_ep.checks import check_eps, check_step_tokens, check_tag
from dep_ep.config import DEFAULT_NORM_EPS
from dep_ep.constants import NO_TAG
from dep_ep.ep.routed import EpRouted, check_experts_match, step_total
from dep_ep.experts.base import ExpertsBackend

# handle -> (EpRouted, its experts backend); handles are never reused within a process.
_REGISTERED: dict[int, tuple[EpRouted, ExpertsBackend]] = {}
# handle -> the EpRouted it named, for handles unregistered while their EpRouted lives: a call
# with one fails its step through that EpRouted on every rank (`_unregistered`).
_UNREGISTERED: dict[int, weakref.ref[EpRouted]] = {}
_HANDLES = itertools.count(1)


def register_routed(routed: EpRouted, experts: ExpertsBackend) -> int:
    """A handle for `routed_op` naming this EpRouted and experts backend (local)."""
    fn = "register_routed"
    if not isinstance(routed, EpRouted):
        raise TypeError(f"{fn}: routed is {type(routed).__name__}; expected an EpRouted")
    check_experts_match(fn, routed, experts)
    handle = next(_HANDLES)
    _REGISTERED[handle] = (routed, experts)
    return handle


def unregister_routed(handle: int) -> None:
    """Forget a handle (the EpRouted is not closed). A later call with it fails its step on
    every rank while the EpRouted lives (`routed_op`'s docstring)."""
    entry = _REGISTERED.pop(handle, None)
    if entry is not None:
        _UNREGISTERED[handle] = weakref.ref(entry[0])


def _unregistered(fn: str, handle: object, tokens: object, latent: object) -> ValueError:
    """The error of a call with a handle that is not registered. One unregistered while its
    EpRouted lives rejects the step through that EpRouted first (every piece of it when T is
    above max_tokens), so every rank raises and no peer's call pairs with this rank's next one
    (before, this rank raised alone, and its next call paired with its peers' waiting call of
    another layer: rows of the other layer, no error, for untagged calls). A handle never
    registered, or whose EpRouted is gone, names no EpRouted to reject through: this rank
    raises alone."""
    error = ValueError(f"{fn}: handle {handle!r} is not registered (register_routed)")
    reference = _UNREGISTERED.get(handle) if isinstance(handle, int) else None
    routed = None if reference is None else reference()
    if routed is None or routed.closed:
        return error
    error = ValueError(
        f"{fn}: handle {handle!r} was unregistered (unregister_routed) while its EpRouted lives;"
        " the step failed on every rank"
    )
    routed.reject_step(error, tag=None, tokens=step_total(tokens, latent))
    return error  # not reached: reject_step raises `error` once the step failed everywhere


# FRAGMENT: another module may define operators in the dep_ep namespace too ("DEF" claims it).
_LIBRARY = torch.library.Library("dep_ep", "FRAGMENT")
_LIBRARY.define(
    "routed(Tensor latent, Tensor ids, Tensor weights, Tensor? norm_weight, int handle,"
    " int? tokens, int tag, float eps, Tensor? padding) -> Tensor"
)


def _routed(latent, ids, weights, norm_weight, handle, tokens, tag, eps, padding) -> torch.Tensor:
    """The operator's kernel: EpRouted.routed of the handle's EpRouted and backend."""
    entry = _REGISTERED.get(handle)
    if entry is None:
        raise _unregistered("dep_ep::routed", handle, tokens, latent)
    routed, experts = entry
    return routed.routed(
        latent,
        ids,
        weights,
        norm_weight,
        experts=experts,
        eps=eps,
        tokens=tokens,
        tag=None if tag == NO_TAG else tag,
        padding=padding,
    )


_LIBRARY.impl("routed", _routed, "CompositeExplicitAutograd")


@torch.library.register_fake("dep_ep::routed", lib=_LIBRARY)
def _routed_fake(latent, ids, weights, norm_weight, handle, tokens, tag, eps, padding):
    return latent.new_empty(latent.shape[0], latent.shape[1], dtype=torch.bfloat16)


_OPERATOR = torch.ops.dep_ep.routed.default  # its one overload, resolved once
_is_compiling = torch.compiler.is_compiling
# Tracers of plain tensors (make_fx's real mode pushes a dispatch mode; torch.jit.trace sets a
# tracing state): each check is a C call of ~0.1 us.
_dispatch_modes = torch._C._len_torch_dispatch_stack
_jit_tracing = torch._C._get_tracing_state


def routed_op(
    latent: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    norm_weight: torch.Tensor | None,
    handle: int,
    *,
    tokens: int | None = None,
    tag: int | None = None,
    eps: float = DEFAULT_NORM_EPS,
    padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """`torch.ops.dep_ep.routed` with EpRouted.routed's arguments (tokens None: n; tag None: no
    tag; padding None: no padding mask). Returns bf16 [n, L]; collective, like EpRouted.routed:
    a `tokens` or `tag` that is not an int in range, an `eps` EpRouted.routed refuses, or a
    `padding` that is not a tensor, fails the step on every rank (this rank raises its error,
    the others EpPeerError). A handle unregistered (unregister_routed) while its EpRouted lives
    fails the step on every rank too (ValueError here); a handle never registered raises
    ValueError on this rank alone (it names no EpRouted to fail the step through)."""
    fn = "routed_op"
    if handle not in _REGISTERED:
        raise _unregistered(fn, handle, tokens, latent)
    try:
        tokens = None if tokens is None else check_step_tokens(fn, tokens)
        tag = check_tag(fn, tag)
        eps = check_eps(fn, eps)
        if padding is not None and not isinstance(padding, torch.Tensor):
            # The operator's schema takes a Tensor or None: anything else would fail in torch's
            # dispatcher on this rank alone. Its dtype and shape are EpRouted's to check.
            raise TypeError(f"{fn}: padding is {type(padding).__name__}; expected a torch.Tensor")
    except (TypeError, ValueError) as err:
        # Rejected in every piece the peers run when T (None: the latent's rows) is above
        # max_tokens; the tag of a rank that rejects is not compared.
        _REGISTERED[handle][0].reject_step(err, tag=None, tokens=step_total(tokens, latent))
    if (
        type(latent) is torch.Tensor
        and not _is_compiling()
        and not _dispatch_modes()
        and _jit_tracing() is None
    ):
        # Eager: the operator's kernel without the dispatcher (module docstring).
        wire_tag = NO_TAG if tag is None else tag
        return _routed(latent, ids, weights, norm_weight, handle, tokens, wire_tag, eps, padding)
    return _OPERATOR(
        latent,
        ids,
        weights,
        norm_weight,
        handle,
        tokens,
        NO_TAG if tag is None else tag,
        eps,
        padding,
    )
