"""synthetic_ids: the routing patterns the benchmarks use for skew, on fresh seeds every run."""

from __future__ import annotations

import pytest
import torch

from dep_ep.testing.synthetic import ROUTINGS, synthetic_ids

E, K, T = 896, 16, 4096


def fresh_seed() -> int:
    return int(torch.randint(0, 2**31, (1,)))


def share_of_tokens(ids: torch.Tensor) -> torch.Tensor:
    """fp32 [E]: the fraction of tokens that chose each expert."""
    return torch.bincount(ids.reshape(-1).long(), minlength=E).float() / ids.shape[0]


@pytest.mark.parametrize("routing", ROUTINGS)
def test_ids_are_distinct_in_range_and_reproducible(routing):
    seed = fresh_seed()
    ids = synthetic_ids(T, E, K, routing, torch.Generator().manual_seed(seed))
    assert ids.dtype == torch.int32 and ids.shape == (T, K), f"{routing} seed {seed}"
    assert int(ids.min()) >= 0 and int(ids.max()) < E, f"{routing} seed {seed}"
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all(), f"{routing} seed {seed}: a repeat"
    again = synthetic_ids(T, E, K, routing, torch.Generator().manual_seed(seed))
    assert torch.equal(ids, again), f"{routing} seed {seed}: not reproducible"
    assert synthetic_ids(0, E, K, routing, torch.Generator()).shape == (0, K)


def test_patterns_have_their_skew():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    uniform = share_of_tokens(synthetic_ids(T, E, K, "uniform", gen))
    zipf = share_of_tokens(synthetic_ids(T, E, K, "zipf", gen))
    hot = synthetic_ids(T, E, K, "hot", gen)
    # Uniform: each expert in K / E = 1.8% of the tokens (sd 0.2%); Zipf: the top expert in ~92%.
    assert float(uniform.max()) < 0.03, f"seed {seed}: uniform top share {float(uniform.max())}"
    assert float(zipf.max()) > 0.8, f"seed {seed}: zipf top share {float(zipf.max())}"
    assert float(zipf.median()) < 0.5 * K / E, f"seed {seed}: zipf median {float(zipf.median())}"
    assert (hot[:, 0] == 0).all() and not (hot[:, 1:] == 0).any(), f"seed {seed}: hot"
    assert float(share_of_tokens(hot[:, 1:]).max()) < 0.03, f"seed {seed}: hot's other choices"


def test_zipf_popularity_is_shared_across_generators():
    """Two ranks' generators differ; their popular experts must not (the seed decides them)."""
    seed = fresh_seed()
    a = synthetic_ids(T, E, K, "zipf", torch.Generator().manual_seed(seed), popularity_seed=5)
    b = synthetic_ids(T, E, K, "zipf", torch.Generator().manual_seed(seed + 1), popularity_seed=5)
    c = synthetic_ids(T, E, K, "zipf", torch.Generator().manual_seed(seed), popularity_seed=6)
    top = [set(share_of_tokens(x).topk(8).indices.tolist()) for x in (a, b, c)]
    assert len(top[0] & top[1]) >= 6, f"seed {seed}: {top[0]} {top[1]}"
    assert len(top[0] & top[2]) <= 4, f"seed {seed}: popularity_seed ignored"


def test_arguments_checked():
    gen = torch.Generator()
    for args, message in (
        ((4, E, K, "pareto"), "routing='pareto'"),
        ((4, E, E + 1, "uniform"), "topk=897 > num_experts=896"),
        ((-1, E, K, "zipf"), "tokens=-1"),
        ((4, E, 0, "hot"), "topk=0"),
        ((4.0, E, K, "uniform"), "tokens=4.0"),
    ):
        with pytest.raises(ValueError, match=message):
            synthetic_ids(*args, gen)
    with pytest.raises(TypeError, match="generator is NoneType; expected a torch.Generator"):
        synthetic_ids(4, E, K, "uniform", None)
    with pytest.raises(TypeError, match="popularity_seed=1.5; expected an int"):
        synthetic_ids(4, E, K, "zipf", gen, popularity_seed=1.5)
