"""EpRouted against the all-gather reference on 2-4 ranks: sizes, routings, reuse, determinism."""

from __future__ import annotations

import pytest
import torch

from dep_ep.ep import TINY, EpRouted
from dep_ep.testing import SyntheticLayer, allgather_reference
from dep_ep.testing.compare import compare

from helpers.cases import agreed_seed, make_case
from helpers.collective import collective_assert
from helpers.reference_check import check_ragged, make_experts

MAX_TOKENS = 24


class Harness:
    """One EpRouted and layer on this rank; `step` runs a case with poisoned outputs and checks."""

    def __init__(self, dep, seed: int):
        self.dep, self.seed = dep, seed  # the layer's seed
        self.routed = EpRouted(
            dep.cpu_group,
            MAX_TOKENS,
            "cpu",
            num_experts=TINY.experts,
            latent=TINY.latent,
            topk=TINY.topk,
        )
        self.layer = SyntheticLayer(TINY, seed)
        self.experts = make_experts(self.layer, dep.rank, dep.size)

    def run(self, case, layer=None, experts=None) -> torch.Tensor:
        layer, experts = layer or self.layer, experts or self.experts
        tokens, r = case.latent[0].shape[0], self.dep.rank
        rows = self.routed.receive(tokens)
        rows.out.fill_(float("nan"))  # rows the experts do not write must not reach combine
        return self.routed.routed(
            case.latent[r], case.ids[r], case.weights[r], layer.norm_weight(), experts=experts
        )

    def check(self, case, label, layer=None, experts=None) -> list[str]:
        out = self.run(case, layer, experts)
        layer, r = layer or self.layer, self.dep.rank
        ref = allgather_reference(
            self.dep.cpu_group,
            case.latent[r],
            case.ids[r],
            case.weights[r],
            layer.norm_weight(),
            layer.expert,
        )
        return compare(out, ref, label)


@pytest.fixture
def harness(dep):
    h = Harness(dep, agreed_seed(dep.cpu_group, 0))
    yield h
    h.routed.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "tokens,routing",
    [
        (1, "random"),
        (7, "random"),
        (MAX_TOKENS, "random"),
        (13, "skewed"),
        (12, "padded"),
        (9, "same"),
        (9, "duplicate"),
        (10, "nan"),
    ],
)
def test_routed_matches_allgather_reference(dep, harness, tokens, routing):
    seed = agreed_seed(dep.cpu_group, 0)
    case = make_case(TINY, dep.size, tokens, seed, routing)
    failures = harness.check(case, f"T={tokens} {routing}")
    collective_assert(dep.cpu_group, failures, seeds={"layer": harness.seed, "case": seed})


@pytest.mark.mpi(min_size=2)
def test_ragged_token_counts(dep, harness):
    """Ranks with different real token counts (one idle on >= 3 ranks) padded to one T."""
    seed = agreed_seed(dep.cpu_group, 0)
    case = make_case(TINY, dep.size, 16, seed, "ragged")
    out = harness.run(case)
    r = dep.rank
    ref = allgather_reference(
        dep.cpu_group,
        case.latent[r],
        case.ids[r],
        case.weights[r],
        harness.layer.norm_weight(),
        harness.layer.expert,
    )
    collective_assert(
        dep.cpu_group,
        check_ragged(out, ref, r, dep.size),
        seeds={"layer": harness.seed, "case": seed},
    )


@pytest.mark.mpi(min_size=2)
def test_nan_token_stays_in_its_row(dep, harness):
    seed = agreed_seed(dep.cpu_group, 0)
    case = make_case(TINY, dep.size, 10, seed, "nan")
    out = harness.run(case)
    failures = []
    finite_rows = out.isfinite().all(dim=1)
    expect = torch.ones(10, dtype=torch.bool)
    if dep.rank == 0:
        expect[5] = False
    if not torch.equal(finite_rows, expect):
        failures.append(f"finite rows {finite_rows.tolist()}, expected {expect.tolist()}")
    collective_assert(dep.cpu_group, failures, seeds={"layer": harness.seed, "case": seed})


@pytest.mark.mpi(min_size=2)
def test_two_layers_back_to_back(dep, harness):
    seeds = {"layer A": harness.seed, "layer B": agreed_seed(dep.cpu_group, 1)}
    other = SyntheticLayer(TINY, seeds["layer B"])
    other_experts = make_experts(other, dep.rank, dep.size)
    failures = []
    for step in range(4):
        seeds[f"step {step}"] = agreed_seed(dep.cpu_group, step)
        case = make_case(TINY, dep.size, 11, seeds[f"step {step}"], "random")
        if step % 2:
            failures += harness.check(case, f"layer B step {step}", other, other_experts)
        else:
            failures += harness.check(case, f"layer A step {step}")
    collective_assert(dep.cpu_group, failures, seeds=seeds)


@pytest.mark.mpi(min_size=2)
def test_hundred_steps_fresh_data_same_buffers(dep, harness):
    failures = []
    steps_seed = agreed_seed(dep.cpu_group, 0)  # draws every step's T and case seed
    gen = torch.Generator().manual_seed(steps_seed)
    for step in range(100):
        tokens = int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=gen))
        routing = ("random", "padded", "skewed")[step % 3]
        seed = int(torch.randint(0, 2**31, (1,), generator=gen))
        case = make_case(TINY, dep.size, tokens, seed, routing)
        failures += harness.check(case, f"step {step} T={tokens} {routing} case seed {seed}")
    collective_assert(dep.cpu_group, failures, seeds={"layer": harness.seed, "steps": steps_seed})


@pytest.mark.mpi(min_size=2)
def test_same_inputs_same_bits(dep, harness):
    seed = agreed_seed(dep.cpu_group, 0)
    case = make_case(TINY, dep.size, 17, seed, "random")
    first = harness.run(case)
    second = harness.run(case)
    failures = [] if torch.equal(first, second) else ["the same inputs gave different bits"]
    collective_assert(dep.cpu_group, failures, seeds={"layer": harness.seed, "case": seed})


@pytest.mark.mpi(min_size=2)
def test_out_rows_are_free_once_combine_returns(dep, harness):
    """The peers read this rank's expert output rows where they lie; a combine returns only once
    every rank has read them. Rank 0 overwrites its rows right after each call returns, with no
    collective between the steps: every rank's output stays the reference's. Before the
    combine-end barrier, 9 of 40 such steps gave a peer wrong rows with no error (2 ranks)."""
    seed = agreed_seed(dep.cpu_group, 21)
    cases = [make_case(TINY, dep.size, 8, seed + i, "random") for i in range(3)]
    r, layer = dep.rank, harness.layer
    refs = [
        allgather_reference(
            dep.cpu_group,
            c.latent[r],
            c.ids[r],
            c.weights[r],
            layer.norm_weight(),
            layer.expert,
        )
        for c in cases
    ]
    failures = []
    for step in range(30):
        case = cases[step % len(cases)]
        out = harness.routed.routed(
            case.latent[r],
            case.ids[r],
            case.weights[r],
            layer.norm_weight(),
            experts=harness.experts,
        )
        if r == 0:
            harness.routed.receive(8).out.fill_(1000.0)
        failures += compare(out, refs[step % len(cases)], f"step {step}")
    collective_assert(dep.cpu_group, failures[:3], seeds={"layer": harness.seed, "cases": seed})
