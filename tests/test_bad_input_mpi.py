"""Bad input raises the documented error on every rank (never a hang); the buffers stay usable."""

from __future__ import annotations

import re

import pytest
import torch

from dep_ep.comm import EpPeerError
from dep_ep.config import EpConfig
from dep_ep.ep import TINY, EpRouted
from dep_ep.experts import ExpertWeights, ReferenceExperts
from dep_ep.testing import SyntheticLayer, allgather_reference
from dep_ep.testing.compare import compare

from helpers.cases import agreed_seed, make_case
from helpers.collective import collective_assert, expect_raises
from helpers.reference_check import make_experts

MAX_TOKENS = 24
T = 6


def corrupt(case_name, latent, ids, weights, experts, norm, rank, num_ranks, layer):
    """Return the bad rank's (latent, ids, weights, experts, norm_weight) and the message."""
    L, E = TINY.latent, TINY.experts
    if case_name == "tokens_zero":
        return latent[:0], ids[:0], weights[:0], experts, norm, "latent has 0 rows and tokens=None"
    if case_name == "id_high":
        ids = ids.clone()
        ids[2, 1] = E
        return latent, ids, weights, experts, norm, f"ids hold {E}; allowed -1"
    if case_name == "id_low":
        ids = ids.clone()
        ids[0, 0] = -2
        return latent, ids, weights, experts, norm, "ids hold -2"
    if case_name == "latent_dtype":
        return latent.float(), ids, weights, experts, norm, "latent dtype torch.float32"
    if case_name == "latent_width":
        wide = torch.zeros(T, L + 32, dtype=torch.bfloat16)
        return wide, ids, weights, experts, norm, f"latent shape \\({T}, {L + 32}\\)"
    if case_name == "ids_dtype":
        return latent, ids.short(), weights, experts, norm, "ids dtype torch.int16"
    if case_name == "weights_shape":
        return latent, ids, weights[:, :-1], experts, norm, "weights shape"
    if case_name == "noncontiguous":
        strided = torch.empty(L, T, dtype=torch.bfloat16).t()
        strided.copy_(latent)
        return strided, ids, weights, experts, norm, "latent's rows must be contiguous"
    if case_name == "latent_misaligned":
        # A flat buffer viewed from 2 bytes in: contiguous, but not on a 16-byte boundary.
        flat = torch.empty(T * L + 1, dtype=torch.bfloat16)
        view = flat[1:].view(T, L)
        view.copy_(latent)
        return view, ids, weights, experts, norm, "latent starts at an address that is not a"
    if case_name == "norm_misaligned":
        flat = torch.empty(L + 1, dtype=torch.bfloat16)
        flat[1:].copy_(norm)
        return latent, ids, weights, experts, flat[1:], "norm_weight starts at an address"
    if case_name == "device":
        return latent.to("meta"), ids, weights, experts, norm, "latent on meta"
    if case_name == "weights_nan":
        weights = weights.clone()
        weights[1, 2] = float("nan")
        return latent, ids, weights, experts, norm, "weights\\[1, 2\\]=nan is not finite"
    if case_name == "foreign_experts":
        other = make_experts(layer, (rank + 1) % num_ranks, num_ranks)
        return latent, ids, weights, other, norm, f"rank {rank} owns experts"
    if case_name == "other_model_experts":
        # this rank's experts, of a model with twice the experts (its ExpertWeights' num_experts)
        per_rank = E // num_ranks
        tensors = layer.local(rank * per_rank, per_rank)
        other = ReferenceExperts(
            ExpertWeights(*tensors, first_expert=rank * per_rank, num_experts=2 * E)
        )
        return latent, ids, weights, other, norm, f"experts were built for num_experts={2 * E}"
    if case_name == "norm_dtype":
        return latent, ids, weights, experts, norm.float(), "norm_weight dtype"
    raise AssertionError(case_name)


# T above max_tokens is no mistake for routed (it runs in pieces): tests/test_server_calls_mpi.py.
CASES = [
    "tokens_zero",
    "id_high",
    "id_low",
    "latent_dtype",
    "latent_width",
    "ids_dtype",
    "weights_shape",
    "noncontiguous",
    "latent_misaligned",
    "norm_misaligned",
    "device",
    "weights_nan",
    "foreign_experts",
    "other_model_experts",
    "norm_dtype",
]


def build(dep, config: EpConfig) -> EpRouted:
    return EpRouted(
        dep.cpu_group,
        MAX_TOKENS,
        "cpu",
        num_experts=TINY.experts,
        latent=TINY.latent,
        topk=TINY.topk,
        config=config,
    )


@pytest.fixture
def setup(dep):
    seed = agreed_seed(dep.cpu_group, 0)
    layer = SyntheticLayer(TINY, seed)
    routed = build(dep, EpConfig(timeout_s=60.0))
    yield layer, routed, make_experts(layer, dep.rank, dep.size), seed
    routed.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case_name", CASES)
def test_one_rank_bad_input(dep, setup, case_name):
    layer, routed, experts, layer_seed = setup
    rank, bad_rank = dep.rank, dep.size - 1
    seeds = {"layer": layer_seed, "bad call": agreed_seed(dep.cpu_group, 0)}
    case = make_case(TINY, dep.size, T, seeds["bad call"])
    args = (case.latent[rank], case.ids[rank], case.weights[rank], experts, layer.norm_weight())
    message = None
    if rank == bad_rank:
        *args, message = corrupt(case_name, *args, rank, dep.size, layer)
    latent, ids, weights, ex, norm = args
    failures = []
    expected = (TypeError, ValueError) if rank == bad_rank else EpPeerError
    try:
        routed.routed(latent, ids, weights, norm, experts=ex)
        failures.append(f"{case_name}: no error raised")
    except expected as err:
        if message and not re.search(message, str(err)):
            failures.append(f"{case_name}: message {str(err)!r} lacks {message!r}")
        if message and "EpRouted.routed" not in str(err):
            failures.append(f"{case_name}: message {str(err)!r} does not name the call")
    except Exception as err:  # report the wrong type on every rank
        failures.append(f"{case_name}: {type(err).__name__}: {err}")
    # The buffers stay usable: the next correct call matches the reference.
    seeds["good call"] = agreed_seed(dep.cpu_group, 1)
    good = make_case(TINY, dep.size, T, seeds["good call"])
    out = routed.routed(
        good.latent[rank], good.ids[rank], good.weights[rank], layer.norm_weight(), experts=experts
    )
    ref = allgather_reference(
        dep.cpu_group,
        good.latent[rank],
        good.ids[rank],
        good.weights[rank],
        layer.norm_weight(),
        layer.expert,
    )
    failures += compare(out, ref, f"after {case_name}")
    collective_assert(dep.cpu_group, failures, seeds=seeds)


@pytest.mark.mpi(min_size=2)
def test_token_counts_differ(dep, setup):
    layer, routed, experts, layer_seed = setup
    tokens = T - 1 if dep.rank == 0 else T
    seed = agreed_seed(dep.cpu_group, 0)
    case = make_case(TINY, dep.size, tokens, seed)
    r = dep.rank
    failures = []
    expect_raises(
        failures,
        f"rank 0 with T={T - 1}, others T={T}",
        ValueError,
        "different token counts",
        lambda: routed.routed(
            case.latent[r], case.ids[r], case.weights[r], layer.norm_weight(), experts=experts
        ),
    )
    collective_assert(dep.cpu_group, failures, seeds={"layer": layer_seed, "case": seed})


@pytest.mark.mpi(min_size=2)
def test_construction_errors(dep):
    failures = []
    for kwargs, match in [
        (dict(num_experts=4 * dep.size + 1), "multiple of the rank count"),
        (dict(topk=TINY.experts + 1), "topk="),
        (dict(max_tokens=0), "max_tokens=0"),
    ]:
        args = dict(max_tokens=8, num_experts=TINY.experts, latent=TINY.latent, topk=TINY.topk)
        args.update(kwargs)
        max_tokens = args.pop("max_tokens")
        expect_raises(
            failures,
            f"EpRouted({kwargs})",
            ValueError,
            match,
            lambda: EpRouted(dep.cpu_group, max_tokens, "cpu", **args),
        )
    expect_raises(
        failures,
        "ExpertWeights(first_expert=-3)",
        ValueError,
        "first_expert",
        lambda: ExpertWeights(
            *SyntheticLayer(TINY, 0).local(0, 1), first_expert=-3, num_experts=TINY.experts
        ),
    )
    collective_assert(dep.cpu_group, failures, seeds=None)


@pytest.mark.mpi(min_size=2)
def test_slow_reader_is_not_confused_by_the_next_phase(dep, monkeypatch):
    """Rank 0 reads the dispatch statuses late, while the last rank already rejected its combine
    input: rank 0 must still see the dispatch as accepted, and every rank must raise in combine."""
    import time

    from dep_ep.comm.host_channel import ObjectBarriers

    exchange = ObjectBarriers.exchange

    def slow_after_dispatch(self, phase, payload, timeout_s, since=None, last=False):
        messages = exchange(self, phase, payload, timeout_s, since, last)
        if self.channel.rank == 0 and phase == "dispatch":
            time.sleep(0.5)
        return messages

    monkeypatch.setattr(ObjectBarriers, "exchange", slow_after_dispatch)
    seeds = {"layer": agreed_seed(dep.cpu_group, 0)}
    layer = SyntheticLayer(TINY, seeds["layer"])
    routed = build(dep, EpConfig(timeout_s=10.0))
    experts = make_experts(layer, dep.rank, dep.size)
    failures = []
    try:
        for step in range(3):
            seeds[f"step {step}"] = agreed_seed(dep.cpu_group, step)
            case = make_case(TINY, dep.size, T, seeds[f"step {step}"])
            r = dep.rank
            norm = layer.norm_weight()
            bad = dep.rank == dep.size - 1 and step != 1
            expected = TypeError if bad else EpPeerError
            try:
                routed.routed(
                    case.latent[r],
                    case.ids[r],
                    case.weights[r],
                    norm.float() if bad else norm,
                    experts=experts,
                )
                if step != 1:
                    failures.append(f"step {step}: no error")
            except expected as err:
                if step == 1 or "combine" not in str(err) and not bad:
                    failures.append(f"step {step}: {type(err).__name__}: {err}")
            except Exception as err:
                failures.append(f"step {step}: {type(err).__name__}: {err}")
    finally:
        routed.close()
    collective_assert(dep.cpu_group, failures, seeds=seeds)
