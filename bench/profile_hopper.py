"""Where HopperExperts (humming engine) spends a call at K3 geometry: torch profiler over 5 eager
calls after one warm-up, GPU kernel time per call, for 56 local experts at T = 8 and 256 and 448
at T = 16, with the kernel chosen for the expected pairs (num_experts given) and for the capacity.

    python bench/profile_hopper.py
"""

from __future__ import annotations

import sys

import torch
from bench_experts import receive_rows
from torch.profiler import ProfilerActivity, profile

from dep_ep.ep import K3
from dep_ep.ep.synthetic import SyntheticLayer
from dep_ep.experts.hopper import HopperExperts

CASES = [(56, 8), (56, 256), (448, 16)]  # (local experts, T)
CALLS = 5


def main() -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for local, tokens in CASES:
        weights = SyntheticLayer(K3, seed=1, device="cuda").local(0, local)
        for num_experts in (K3.experts, None):
            backend = HopperExperts(*weights, first_expert=0, engine="humming",
                                    num_experts=num_experts)  # fmt: skip
            rows = receive_rows(K3.experts // local, tokens, local, gen)
            out = torch.empty(rows[2].shape[0], K3.latent, dtype=torch.bfloat16, device="cuda")
            backend.forward(*rows, out)  # compiles humming's kernel for this pair bound
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    backend.forward(*rows, out)
                torch.cuda.synchronize()
            events = prof.key_averages()
            busy = sum(e.self_device_time_total for e in events) / CALLS
            bound = backend.pair_bound(rows[2].shape[0], K3.topk)
            print(f"== local {local} T {tokens} num_experts {num_experts} pair bound {bound}:"
                  f" GPU busy {busy:.0f} us a call", flush=True)  # fmt: skip
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:8]:
                print(f"   {e.self_device_time_total / CALLS:8.1f} us  x{e.count // CALLS}"
                      f"  {e.key[:90]}")  # fmt: skip
        del weights
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
