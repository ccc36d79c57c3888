"""The CPU parts of the benchmarks: bench_routed_experts.py reading the peer's log and writing its
page; bench_dep.py's page with and without its peer; bench_humming_tuning.py naming humming's
distinct kernels; timing.pair_timed_us's argument check."""

from __future__ import annotations

import json

import pytest

from bench import bench_dep, timing
from bench import bench_humming_tuning as tuning
from bench import bench_routed_experts as routed_experts


def test_peer_log_rows_by_local_experts(tmp_path):
    log = tmp_path / "fi.log"
    rows = [
        {"T": 1, "local": 448, "layer_us": 202.57, "error": None},
        {"T": 4, "local": 448, "error": "failed, see logs"},
        {"T": 16, "local": 224, "layer_us": 900.0, "error": None},
        {"T": 64, "local": 448, "layer_us": 1973.05, "error": None},
    ]
    prefix = routed_experts.PEER_PREFIX
    lines = ["# warming up", "FI_MEGA {cut", "[rank0]: " + prefix + json.dumps(rows[0])]
    lines += [prefix + json.dumps(r) for r in rows[1:]]
    log.write_text("\n".join(lines) + "\n")
    assert routed_experts.read_peer_log(log, 448) == {1: 202.57, 64: 1973.05}
    assert routed_experts.read_peer_log(log, 224) == {16: 900.0}
    with pytest.raises(ValueError, match="no `FI_MEGA` line without error at 112 local"):
        routed_experts.read_peer_log(log, 112)


def test_report_puts_the_peer_beside_ours(tmp_path):
    results = [
        {"tokens": 1, "us": 150.0, "touched": 16, "floor_us": 65.0, "mode": "graph",
         "finite": True},
        {"tokens": 4, "us": 400.0, "touched": 62, "floor_us": 250.0, "mode": "graph",
         "finite": False},
    ]  # fmt: skip
    meta = {"n": 2, "local": 448, "bandwidth": 4100.0, "backend": "HopperExperts (humming)",
            "grouping": "torch", "gpu": "GPU", "arguments": "--out docs"}  # fmt: skip
    routed_experts.write_report(tmp_path, results, {1: 202.57}, meta)
    page = (tmp_path / "bench_routed_experts2.md").read_text()
    assert "| 1 | 16 | 65 | 150 | 43% | 203 | 32% | 1.35 | graph | yes |" in page, page
    assert "| 4 | 62 | 250 | 400 | 62% | - | - | - | graph | NO |" in page, page
    assert "-m bench.bench_routed_experts --out docs`" in page, page
    assert "# Routed path with experts, 2 GPUs," in page and "448 local experts per rank" in page


def dep_row(tokens: int, peer: bool) -> dict:
    row = dict(tokens=tokens, routing="uniform", skew=1.0, pair_skew=1.02, receive_mib=0.5,
               dispatch=10.0, combine=20.0, pair=28.0, allgather=12.0, reduce_scatter=30.0,
               a2a=15.0, a2a_back=40.0, d_bytes=2.0e6, c_bytes=4.0e6, modes="graph")  # fmt: skip
    if peer:
        row.update(peer_dispatch=8.0, peer_combine=25.0, peer_pair=35.0)
    return row


def test_dep_report_puts_the_peer_beside_ours(tmp_path):
    note = "Peer: FlashInfer one-sided (flashinfer 0.7.4, ...); its workspace 301.0 MiB per rank"
    bench_dep.write_report(tmp_path, [dep_row(1, True), dep_row(16, False)], 2, 3.5,
                           arguments="--out docs", peer_note=note, gpu="GPU")  # fmt: skip
    page = (tmp_path / "bench_dep2.md").read_text()
    # dispatch 2 MB in 10 us = 200 GB/s (peer 8 us: 250); combine 4 MB in 20 us = 200 (peer 160)
    assert ("| 1 | uniform | 1.00 / 1.02 | 0.50 | 10.0 / 8.0 | 20.0 / 25.0 | 28.0 / 35.0 | 1.25 |"
            " 200 / 250 | 200 / 160 |") in page, page  # fmt: skip
    assert "| 16 | uniform | 1.00 / 1.02 | 0.50 | 10.0 / - | 20.0 / - | 28.0 / - | - |" in page
    assert "| 1 | uniform | 12.0 (1.2x) | 30.0 (1.5x) | 15.0 (1.5x) | 40.0 (2.0x) | graph |" in page
    assert note in page and "-m bench.bench_dep --out docs`" in page
    assert "# DEP benchmark, 2 GPUs, one process per GPU" in page


def test_pair_timing_needs_two_pairs():
    with pytest.raises(ValueError, match="reps must be at least 2"):
        timing.pair_timed_us(lambda: None, lambda: None, None, 1, 5)


class FakeGemm:
    """humming's kernel choice by pair count, as HummingGemm.tuning gives it: three kernels."""

    def tuning(self, pairs: int) -> dict:
        block = 8 if pairs <= 256 else 24 if pairs <= 1024 else 64
        return {"block_shape": [block, 256, 128], "use_stream_k": pairs <= 1024}


def test_humming_kernels_named_by_the_smallest_pair_count_picking_them():
    kernels = tuning.distinct_tunings(FakeGemm())
    assert list(kernels) == [16, 512, 2048]
    assert [k["block_shape"][0] for k in kernels.values()] == [8, 24, 64]
    assert tuning.column_of(kernels, FakeGemm(), 128) == 16
    assert tuning.column_of(kernels, FakeGemm(), 1024) == 512
    assert tuning.column_of(kernels, FakeGemm(), 65536) == 2048


class FakeHeuristic(FakeGemm):
    """humming's own choice (HummingGemm.heuristic): FakeGemm's, 24 pairs at 512 and 1024."""

    heuristic = FakeGemm.tuning


def test_humming_variants_are_distinct_and_keep_the_bases():
    variants = tuning.variant_configs(FakeHeuristic())
    # 512 and 1024 pick the same kernel: its 6 variants (one of them the base) once; 2048 alone.
    assert list(variants)[0] == "humming's 512" and "humming's 1024" not in variants
    assert "humming's 2048" in variants and len(variants) == 1 + 5 + 1
    shapes = {(c["block_shape"][0], c["use_stream_k"]) for c in variants.values()}
    assert shapes == {(b, s) for b in (16, 24, 32) for s in (True, False)} | {(64, False)}
    assert "512's, 16 pairs, stream-K off" in variants
    assert all(c["block_shape"][1:] == [256, 128] for c in variants.values())
