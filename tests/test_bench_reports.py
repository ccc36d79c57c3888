"""The CPU parts of the benchmarks: bench_routed_experts.py reading the peer's log and writing its
page; bench_humming_tuning.py naming humming's distinct kernels."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_script(name: str):
    """bench/<name>.py as module `name` (the scripts import their neighbours by name, as
    `python bench/<script>.py` lets them)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


load_script("timing")
load_script("bench_experts")
bench = load_script("bench_routed_experts")
tuning = load_script("bench_humming_tuning")


def test_peer_log_rows_by_local_experts(tmp_path):
    log = tmp_path / "fi.log"
    rows = [
        {"T": 1, "local": 448, "layer_us": 202.57, "error": None},
        {"T": 4, "local": 448, "error": "failed, see logs"},
        {"T": 16, "local": 224, "layer_us": 900.0, "error": None},
        {"T": 64, "local": 448, "layer_us": 1973.05, "error": None},
    ]
    lines = ["# warming up", "FI_MEGA {cut", "[rank0]: " + bench.PEER_PREFIX + json.dumps(rows[0])]
    lines += [bench.PEER_PREFIX + json.dumps(r) for r in rows[1:]]
    log.write_text("\n".join(lines) + "\n")
    assert bench.read_peer_log(log, 448) == {1: 202.57, 64: 1973.05}
    assert bench.read_peer_log(log, 224) == {16: 900.0}
    with pytest.raises(ValueError, match="no `FI_MEGA` line without error at 112 local"):
        bench.read_peer_log(log, 112)


def test_report_puts_the_peer_beside_ours(tmp_path):
    results = [
        {"tokens": 1, "us": 150.0, "touched": 16, "floor_us": 65.0, "mode": "graph",
         "finite": True},
        {"tokens": 4, "us": 400.0, "touched": 62, "floor_us": 250.0, "mode": "graph",
         "finite": False},
    ]  # fmt: skip
    meta = {"n": 2, "local": 448, "bandwidth": 4100.0, "backend": "HopperExperts (humming)",
            "grouping": "torch", "gpu": "GPU", "arguments": "--out docs"}  # fmt: skip
    bench.write_report(tmp_path, results, {1: 202.57}, meta)
    page = (tmp_path / "bench_routed_experts2.md").read_text()
    assert "| 1 | 16 | 65 | 150 | 43% | 203 | 32% | 1.35 | graph | yes |" in page, page
    assert "| 4 | 62 | 250 | 400 | 62% | - | - | - | graph | NO |" in page, page
    assert "bench/bench_routed_experts.py --out docs`" in page, page
    assert "# Routed path with experts, 2 GPUs," in page and "448 local experts per rank" in page


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
