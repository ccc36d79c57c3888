"""EpRouted's API: a context manager that closes on exit, a callable equal to `routed`, and
EpConfig's validation."""

from __future__ import annotations

import math

import pytest
import torch

from dep_ep.config import EpConfig
from dep_ep.ep import TINY, EpRouted
from dep_ep.testing import SyntheticLayer

from helpers.cases import agreed_seed, make_case
from helpers.collective import collective_assert, expect_raises
from helpers.reference_check import make_experts

MAX_TOKENS = 16


def build(dep, config=None) -> EpRouted:
    return EpRouted(
        dep.cpu_group,
        MAX_TOKENS,
        "cpu",
        num_experts=TINY.experts,
        latent=TINY.latent,
        topk=TINY.topk,
        config=config,
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.mpi(min_size=2)
def test_context_manager_closes_on_exit(dep):
    seeds = {"layer": agreed_seed(dep.cpu_group, 0), "case": agreed_seed(dep.cpu_group, 1)}
    layer = SyntheticLayer(TINY, seeds["layer"])
    experts = make_experts(layer, dep.rank, dep.size)
    case = make_case(TINY, dep.size, 5, seeds["case"])
    args = (case.latent[dep.rank], case.ids[dep.rank], case.weights[dep.rank])
    norm = layer.norm_weight()
    failures = []
    with build(dep) as ep:
        if ep.closed:
            failures.append("closed inside the with block")
        out = ep(*args, norm, experts=experts)
        if out.shape != (5, TINY.latent) or not out.isfinite().all():
            failures.append(f"inside the block: output {tuple(out.shape)} {out.flatten()[:4]}")
    if not ep.closed:
        failures.append("not closed after the with block")
    calls = {
        "ep(...)": lambda: ep(*args, norm, experts=experts),
        "ep.routed(...)": lambda: ep.routed(*args, norm, experts=experts),
        "ep.dispatch(...)": lambda: ep.dispatch(*args),
        "ep.combine(...)": lambda: ep.combine(norm),
    }
    for label, call in calls.items():
        expect_raises(failures, f"{label} after the with block", RuntimeError, "closed", call)
    ep.close()  # idempotent

    # An exception inside the block (on every rank) closes it too, and propagates.
    try:
        with build(dep) as inner:
            raise KeyError("inside")
    except KeyError:
        pass
    else:
        failures.append("the with block swallowed the exception")
    if not inner.closed:
        failures.append("not closed after an exception in the with block")
    collective_assert(dep.cpu_group, failures, seeds=seeds)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("routing", ["random", "padded"])
def test_call_equals_routed_bit_for_bit(dep, routing):
    seeds = {"layer": agreed_seed(dep.cpu_group, 0), "case": agreed_seed(dep.cpu_group, 1)}
    layer = SyntheticLayer(TINY, seeds["layer"])
    experts = make_experts(layer, dep.rank, dep.size)
    case = make_case(TINY, dep.size, 11, seeds["case"], routing)
    args = (case.latent[dep.rank], case.ids[dep.rank], case.weights[dep.rank], layer.norm_weight())
    failures = []
    with build(dep) as ep:
        called = ep(*args, experts=experts, eps=1e-5).clone()
        routed = ep.routed(*args, experts=experts, eps=1e-5)
        other_eps = ep(*args, experts=experts, eps=0.5)
    if not torch.equal(bits(called), bits(routed)):
        differ = int((bits(called) != bits(routed)).sum())
        failures.append(f"{routing}: ep(...) and ep.routed(...) differ in {differ} elements")
    if torch.equal(bits(called), bits(other_eps)):
        failures.append(f"{routing}: eps=0.5 gave the bits of eps=1e-5 (eps not passed on)")
    collective_assert(dep.cpu_group, failures, seeds=seeds)


@pytest.mark.mpi(min_size=2)
def test_config_must_be_an_epconfig(dep):
    failures = []
    for config in (5, {"timeout_s": 5.0}, "EpConfig()"):
        expect_raises(
            failures, f"config={config!r}", TypeError, "config", lambda: build(dep, config)
        )
    with build(dep, EpConfig(timeout_s=7.5)) as ep:
        if ep.config.timeout_s != 7.5:
            failures.append(f"config not kept: {ep.config}")
    collective_assert(dep.cpu_group, failures, seeds=None)


@pytest.mark.parametrize("value", [0, -1, 0.0, math.nan, math.inf, -math.inf, "5", True, None])
def test_epconfig_rejects_bad_timeout(value):
    with pytest.raises((ValueError, TypeError), match="timeout_s"):
        EpConfig(timeout_s=value)


@pytest.mark.parametrize("value", [0.001, 1, 5, 60.0, 3600])
def test_epconfig_takes_positive_finite_timeout(value):
    assert EpConfig(timeout_s=value).timeout_s == value


def test_epconfig_is_frozen():
    config = EpConfig()
    with pytest.raises(AttributeError):
        config.timeout_s = 1.0  # type: ignore[misc]
