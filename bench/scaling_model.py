"""The per-step scaling model of dispatch and combine (docs/scaling.md): predictions for N ranks
from the EP=2 measurements, checked against them, and the receive memory per rank. CPU only.

    python -m bench.scaling_model            # prints the tables of docs/scaling.md

Model, per rank and step of T tokens per rank (K3: L = 3584, K = 16, E = 896):
    t(N, T) = t_small + V(N, T) / B
    V(N, T) = T * R(N) * b,  R(N) = (N - 1) * (1 - q(N)),  q(N) = C(E - E/N, K) / C(E, K)
R(N): the expected other ranks a token goes to (q: no expert of the token on a given other rank);
b: bytes per token and destination (dispatch 3,824: x 3,584, scales 112, ids and weights 128;
combine 7,168: one BF16 row). t_small and B are fitted to the EP=2 table of
docs/results/bench_dep2.md (2026-11-29): t_small = the mean time at T <= 16,
B = V(2, 4096) / (t(2, 4096) - t_small).
"""

from __future__ import annotations

import math

from bench import cli
from dep_ep.comm.layout import EpLayout
from dep_ep.config import K3
from dep_ep.constants import SCALE_BLOCK
from dep_ep.ep import EpRouted
from dep_ep.experts.hopper import HummingEngine, TritonEngine
from dep_ep.experts.hopper.engine import PAIR_BUDGET_SKEW, pair_budget

BYTES = {"dispatch": K3.latent + K3.latent // SCALE_BLOCK + K3.topk * 8, "combine": K3.latent * 2}
# docs/results/bench_dep2.md, 2026-11-29 (two H200, NV18), us: T -> (dispatch, combine).
EP2 = {
    1: (6.5, 11.3),
    2: (8.2, 11.1),
    4: (8.5, 10.4),
    8: (8.8, 12.3),
    16: (9.4, 12.0),
    32: (9.6, 12.9),
    64: (10.4, 15.4),
    128: (11.4, 16.5),
    256: (14.3, 17.9),
    1024: (27.5, 42.7),
    4096: (76.2, 129.4),
}
# docs/results/nvlink_ceiling.md: kernel stores both ways at once, 16 MB and 64 MB (GB/s).
CEILING_GBS = 345.0
TOKENS = [1, 16, 128, 256, 1024, 4096]
RANKS = [2, 8, 16]


def other_ranks(n: int) -> float:
    """R(N): expected number of other ranks a token's K distinct experts of E land on."""
    if n == 1:
        return 0.0
    q = math.comb(K3.experts - K3.experts // n, K3.topk) / math.comb(K3.experts, K3.topk)
    return (n - 1) * (1 - q)


def fit(phase: int) -> tuple[float, float]:
    """(t_small us, B GB/s) of dispatch (phase 0) or combine (1) from the EP=2 table."""
    small = [t[phase] for tokens, t in EP2.items() if tokens <= 16]
    t_small = sum(small) / len(small)
    bytes_4096 = 4096 * other_ranks(2) * BYTES[("dispatch", "combine")[phase]]
    return t_small, bytes_4096 / ((EP2[4096][phase] - t_small) * 1e-6) / 1e9


def predict(n: int, tokens: int, phase: int, bandwidth_gbs: float | None = None) -> float:
    t_small, fitted = fit(phase)
    volume = tokens * other_ranks(n) * BYTES[("dispatch", "combine")[phase]]
    return t_small + volume / ((bandwidth_gbs or fitted) * 1e9) * 1e6


def main() -> None:
    cli.parser(__doc__).parse_args()  # --help only: the model's inputs are the constants above
    for phase, name in enumerate(("dispatch", "combine")):
        t_small, bandwidth = fit(phase)
        print(f"{name}: t_small {t_small:.1f} us, B {bandwidth:.0f} GB/s")
    print("\nN | R(N) | dispatch KB/token | combine KB/token")
    for n in [1, *RANKS]:
        kb = {phase: other_ranks(n) * size / 1e3 for phase, size in BYTES.items()}
        print(f"{n} | {other_ranks(n):.2f} | {kb['dispatch']:.1f} | {kb['combine']:.1f}")
    print("\nEP=2 check: T | dispatch measured / model | combine measured / model (us)")
    for tokens in TOKENS:
        d, c = EP2[tokens]
        print(f"{tokens} | {d} / {predict(2, tokens, 0):.1f} | {c} / {predict(2, tokens, 1):.1f}")
    print("\nprediction: N | T | dispatch us | combine us | pair us | pair at the ceiling us")
    for n in RANKS[1:]:
        for tokens in TOKENS:
            d, c = predict(n, tokens, 0), predict(n, tokens, 1)
            best = predict(n, tokens, 0, CEILING_GBS) + predict(n, tokens, 1, CEILING_GBS)
            print(f"{n} | {tokens} | {d:.0f} | {c:.0f} | {d + c:.0f} | {best:.0f}")
    print(
        "\nmemory per rank, MiB: N | max_tokens | EpRouted (symmetric part) | HopperExperts"
        " workspace at T = max_tokens at the capacity (pair_skew=None), humming / triton |"
        f" at the default pair_skew={PAIR_BUDGET_SKEW}, humming / triton (the pair budget)"
    )
    for n in [1, *RANKS]:
        for tokens in (256, 1024, 2048, 4096):
            routed = EpRouted.workspace_bytes(n, tokens, latent=K3.latent, topk=K3.topk)
            symmetric = EpLayout(n, tokens, K3.latent, K3.topk).total_bytes
            rows, local = n * tokens, K3.experts // n
            shape = (rows, K3.topk, K3.latent, K3.intermediate)
            budget = pair_budget(rows, K3.topk, local, K3.experts, PAIR_BUDGET_SKEW)
            engines = (HummingEngine(), TritonEngine())
            capacity = [e.workspace_bytes(*shape, num_local=local) / 2**20 for e in engines]
            budgeted = [
                e.workspace_bytes(*shape, num_local=local, max_pairs=budget) / 2**20
                for e in engines
            ]
            print(
                f"{n} | {tokens} | {routed / 2**20:.0f} ({symmetric / 2**20:.0f}) |"
                f" {capacity[0]:,.0f} / {capacity[1]:,.0f} |"
                f" {budgeted[0]:,.0f} / {budgeted[1]:,.0f} ({budget:,})"
            )


if __name__ == "__main__":
    main()
