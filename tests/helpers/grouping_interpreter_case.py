"""The one-launch grouping kernel in Triton's CPU interpreter against the torch grouping, run in
its own process (the interpreter must be chosen before triton is imported):

    TRITON_INTERPRET=1 python -m helpers.grouping_interpreter_case SEED   (from tests/)

Every tensor of group_pairs and tile_routes must come out bitwise equal, for one tile size and
for two in one launch (group_and_route_tilings, up to 56 local experts), on fresh random ids of
several shapes: rows without a local id, -1 slots, a hot expert over many tiles, repeated ids,
every slot local, no local id, one row (over 56 and over 896 local experts: most programs
without a slot, which write only their pair count), no row, a chunk boundary (R * K past
BLOCK_S), 448 local experts over two chunks, 18 chunks (the unused tiles written in shares by 18
programs, some of them more than one block of BLOCK_T), an expert with more tiles than BLOCK_T,
expert counts where num_local + 2 is a power of two, and tiles of humming's sizes that are not
powers of two (24, 40, 48, 56 pairs); and chunk_prefix_kernel alone against torch.cumsum,
its carry across steps included. Outputs are poisoned before the call. Exits 0 and prints
"ok ..." when every case holds, else raises naming the case, the seed and the tensor.
"""

from __future__ import annotations

import os
import sys

import torch

from dep_ep.experts.hopper.grouping import group_pairs, tile_routes


def random_ids(gen: torch.Generator, rows: int, topk: int, experts: int) -> torch.Tensor:
    """Distinct random ids per row, every third row's last slot -1."""
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(rows)])
    ids = ids.reshape(rows, topk).int()
    ids[::3, -1] = -1
    return ids


def cases(gen: torch.Generator):
    """(name, ids int32 [R, K], first_expert, num_local, block_n)."""
    yield "mixed", random_ids(gen, 37, 6, 40), 8, 8, 16
    yield "k3-like", random_ids(gen, 64, 16, 112), 56, 56, 16
    yield "past-one-step", random_ids(gen, 300, 8, 60), 10, 14, 32  # 2400 slots > BLOCK_S
    hot = random_ids(gen, 70, 4, 30)
    hot[:, 0] = 3
    yield "hot", hot, 0, 6, 16  # expert 3 over five tiles; bins = 8 = num_local + 2
    yield "repeats", torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1], [1, 0, -1, 1]]).int(), 0, 2, 16
    every = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(5)]).int()
    yield "all-local", every, 0, 8, 16
    yield "none-local", torch.randint(20, 40, (9, 4), generator=gen).int(), 0, 8, 16
    yield "one-row", random_ids(gen, 1, 16, 896), 0, 56, 64
    # Every expert of one rank at EP = 1: at most 16 of 896 programs have a slot (the others
    # only write their pair count, 0).
    yield "one-row-896-local", random_ids(gen, 1, 16, 896), 0, 896, 16
    yield "448-local", random_ids(gen, 140, 16, 896), 448, 448, 64  # 2,240 slots, 2 steps
    very_hot = random_ids(gen, 1100, 2, 40)  # 2,200 slots, 2 steps
    very_hot[:, 0] = 5
    yield "very-hot", very_hot, 0, 8, 16  # expert 5: 69 tiles, more than one step of BLOCK_T
    yield "no-row", torch.empty(0, 4, dtype=torch.int32), 0, 8, 16
    yield "tiles-of-24", random_ids(gen, 90, 16, 112), 56, 56, 24
    yield "tiles-of-56-hot", hot, 0, 6, 56  # expert 3: 70 pairs over two tiles of 56
    yield "tiles-of-40", random_ids(gen, 64, 16, 896), 448, 448, 40
    yield "tiles-of-48-very-hot", very_hot, 0, 8, 48  # expert 5: 23 tiles, unused tiles after
    # 35,200 slots: 18 chunks; about 2,090 unused tiles of 16, 33 blocks of BLOCK_T in 18 shares.
    yield "many-chunks", random_ids(gen, 2200, 16, 40), 4, 2, 16


POISON = -7  # what the outputs hold before the call
# The second tile size beside each first one: larger (more lanes) and smaller, humming's pairs
# (24 -> 32, 48 -> 56, 56 -> 48) and sizes that are not multiples of 8.
SECOND_BLOCK_N = {16: 24, 24: 32, 32: 7, 48: 56, 56: 48, 64: 100}


def differ(a: torch.Tensor, b: torch.Tensor) -> str:
    """The first differing entries of two equal-shape tensors, as text."""
    bad = (a.reshape(-1) != b.reshape(-1)).nonzero().reshape(-1)[:8].tolist()
    return ", ".join(f"[{i}] got {a.reshape(-1)[i]} want {b.reshape(-1)[i]}" for i in bad)


def check_tiling(where: str, got, got_routes, want, want_routes, slots: int) -> None:
    """Every tensor of one tiling bitwise equal (dtypes and shapes included)."""
    for field in (
        "pair_row",
        "pair_flat",
        "num_pairs",
        "pair_slot",
        "tile_expert",
        "tile_start",
        "tile_rows",
        "num_tiles",
        "expert_pairs",
    ):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {field} {a.dtype}"
        assert torch.equal(a, b), f"{where}: {field} {differ(a, b)}"
    assert got.block_n == want.block_n, where
    for field in ("flat", "pair", "num_padded"):
        a, b = getattr(got_routes, field), getattr(want_routes, field)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: routes.{field}"
        assert torch.equal(a, b), f"{where}: routes.{field} {differ(a, b)}"
    assert got_routes.sentinel == want_routes.sentinel == slots, where


def check_prefix(gen: torch.Generator, seed: int) -> None:
    """chunk_prefix_kernel against torch.cumsum over the chunks, bitwise: fewer chunks than a
    step, exactly one step, several steps with a partial last one (the carry between steps),
    one program and several (a program per bin block), at the bin counts of 56 and 896 local
    experts; guard rows after the histogram must come out unchanged."""
    from dep_ep.experts.hopper.grouping_kernel import chunk_prefix_kernel

    guard = 2
    for chunks, bins, block_b, block_c in (
        (3, 64, 64, 64),
        (8, 64, 64, 8),
        (37, 64, 64, 8),
        (37, 64, 16, 8),
        (11, 1024, 64, 4),
        (11, 1024, 1024, 4),
    ):
        hist = torch.randint(0, 1 << 12, (chunks + guard, bins), dtype=torch.int32, generator=gen)
        want = torch.cat((hist[:chunks].cumsum(0, dtype=torch.int32), hist[chunks:]))
        chunk_prefix_kernel[(bins // block_b,)](hist, chunks, bins, block_b, block_c)
        where = (
            f"prefix chunks {chunks} bins {bins} block_b {block_b} block_c {block_c} seed {seed}"
        )
        assert torch.equal(hist, want), f"{where}: {differ(hist, want)}"


def main(seed: int) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    from dep_ep.experts.hopper import grouping_kernel

    gen = torch.Generator().manual_seed(seed)
    check_prefix(gen, seed)
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):  # outputs start as garbage the kernel must overwrite
        return real_empty(*args, **kwargs).fill_(POISON)

    for name, ids, first, num_local, block_n in cases(gen):
        # One tiling, then two in one launch (humming's FC2 may tile larger or smaller than its
        # FC1), the latter where the interpreter's time allows (449 programs: ~20 s a launch).
        second = SECOND_BLOCK_N.get(block_n, block_n + 8)
        tilings = [(block_n,)] + ([(block_n, second)] if num_local <= 56 else [])
        for block_ns in tilings:
            torch.empty = poisoned_empty  # the kernel's outputs are allocated with torch.empty
            try:
                got = grouping_kernel.group_and_route_tilings(ids, first, num_local, block_ns)
            finally:
                torch.empty = real_empty
            assert len(got) == len(block_ns), name
            for (groups, routes), size in zip(got, block_ns):
                want = group_pairs(ids, first, num_local, size)
                where = f"{name} block_ns {block_ns} tiling {size} seed {seed}"
                check_tiling(where, groups, routes, want, tile_routes(want), ids.numel())
    print(f"ok seed {seed}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
