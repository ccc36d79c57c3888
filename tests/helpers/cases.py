"""One seeded case builder for the multi-rank tests: every rank builds every rank's inputs from
the same generator (so each can compute any reference locally) and keeps its own."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dep_ep.config import TINY, EpConfig, MoeGeometry
from dep_ep.ep import EpRouted

ROUTINGS = ("random", "skewed", "padded", "same", "duplicate", "nan", "ragged")


@dataclass
class Case:
    latent: list[torch.Tensor]  # per source rank: bf16 [T, L]
    ids: list[torch.Tensor]  # int32 [T, K], -1 = none
    weights: list[torch.Tensor]  # fp32 [T, K]


def make_case(
    geometry: MoeGeometry, num_ranks: int, tokens: int, seed: int, routing: str = "random"
) -> Case:
    """routing: random (distinct experts per token); skewed (every id on rank N-1's experts);
    padded (every third token all -1, some tokens with a few -1 slots); same (every rank's tokens
    pick the same K experts); duplicate (each token lists its first expert twice); nan (random,
    with NaN in one element of token T//2 on rank 0); ragged (random, but rank s has only
    real_tokens(T, N)[s] real tokens and pads the rest of its T rows with all -1 ids)."""
    if routing not in ROUTINGS:
        raise ValueError(f"make_case: routing={routing!r}; allowed {ROUTINGS}")
    gen = torch.Generator().manual_seed(seed)
    E, K, L = geometry.experts, geometry.topk, geometry.latent
    per_rank = E // num_ranks
    case = Case([], [], [])
    for source in range(num_ranks):
        latent = torch.randn(tokens, L, generator=gen).to(torch.bfloat16)
        if routing == "skewed":
            pool = torch.arange(E - per_rank, E)
            pick = torch.stack([torch.randperm(per_rank, generator=gen)[:K] for _ in range(tokens)])
            ids = pool[pick] if per_rank >= K else pool[pick % per_rank]
        elif routing == "same":
            ids = torch.randperm(E, generator=torch.Generator().manual_seed(seed))[:K].repeat(
                tokens, 1
            )
        else:
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
        if routing == "duplicate" and K > 1:
            ids[:, 1] = ids[:, 0]
        if routing == "padded":
            ids[::3] = -1
            ids[1::3, K // 2 :] = -1
        if routing == "ragged":
            ids[real_tokens(tokens, num_ranks)[source] :] = -1
        if routing == "nan" and source == 0:
            latent[tokens // 2, L // 3] = float("nan")
        weights = torch.rand(tokens, K, generator=gen) + 0.05
        weights = weights / weights.sum(dim=1, keepdim=True)
        case.latent.append(latent)
        case.ids.append(ids.to(torch.int32))
        case.weights.append(weights)
    return case


def real_tokens(tokens: int, num_ranks: int) -> list[int]:
    """Real token count of each rank in the "ragged" routing: T - s*T/N for rank s, and none on
    the last rank when N >= 3 (an idle data-parallel rank still joins every call)."""
    real = [tokens - (s * tokens) // num_ranks for s in range(num_ranks)]
    if num_ranks >= 3:
        real[-1] = 0
    return real


def agreed_seed(group: dist.ProcessGroup, base: int) -> int:
    """`base` plus a fresh random offset drawn by group rank 0 and broadcast: every rank builds the
    same case, and every run a new one. EP_TEST_SEED_OFFSET=N fixes the offset (to replay a
    failure: its message names the seed, base + offset)."""
    fixed = os.environ.get("EP_TEST_SEED_OFFSET")
    offset = int(fixed) if fixed else int(torch.randint(0, 10**6, (1,)))
    t = torch.tensor([base + offset])
    dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    return int(t)


def tiny_routed(group: dist.ProcessGroup, max_tokens: int, device: str, timeout_s: float):
    """An EpRouted of the TINY geometry on `group` (collective), every wait bounded by
    `timeout_s`: the one the whole-process cases (helpers/*_case*.py) build."""
    geometry = dict(num_experts=TINY.experts, latent=TINY.latent, topk=TINY.topk)
    config = EpConfig(timeout_s=timeout_s)
    return EpRouted(group, max_tokens, device, config=config, **geometry)
