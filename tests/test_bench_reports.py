"""The CPU parts of the benchmarks: every bench module imports and every benchmark's --help runs;
a page through bench/report.py (header, table, a plot or the line saying it is missing) and the
command it names; bench_routed_experts reading the peer's log and writing its page; bench_dep's
page with and without its peer; bench_experts' floors (hand-computed) and its
page; bench_integration end to end on one CPU process (tiny preset)
and its page's graph-replay table; bench_humming_tuning naming humming's distinct kernels;
timing.pair_timed_us's argument check; profile_combine and profile_hopper_gemms reading Nsight
Compute's tables."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from bench import (
    bench_dep,
    profile_combine,
    profile_hopper_gemms,
    profile_narrow_gemm,
    profile_narrow_source,
    report,
    timing,
)
from bench import bench_experts as experts
from bench import bench_humming_tuning as tuning
from bench import bench_integration as integration
from bench import bench_routed_experts as routed_experts

from helpers.launchers import launcher

ROOT = Path(__file__).resolve().parent.parent
# Every module of the package, found on disk so that a new one is covered without listing it.
MODULES = sorted(
    "bench" if path.stem == "__init__" else f"bench.{path.stem}"
    for path in (ROOT / "bench").glob("*.py")
)


def torchrun(ranks: int, module: str, *arguments: str) -> report.Run:
    """The Run of `module` under torchrun with `ranks` processes on one node (fixed hardware,
    software and date)."""
    environ = {"RANK": "0", "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks)}
    command = report.command_line(["-", *arguments], environ, module)
    return report.Run(command, f"{ranks} x GPU", "Python 3, torch 2", "2026-12-02")


@pytest.mark.parametrize("module", MODULES)
def test_every_bench_module_imports_and_its_help_runs(module, monkeypatch, capsys):
    loaded = importlib.import_module(module)
    if not hasattr(loaded, "main"):
        return  # a part the benchmarks share, no command line
    # As `python -m <module> --help` runs it, in this process.
    monkeypatch.setitem(sys.modules, "__main__", loaded)
    monkeypatch.setattr(sys, "argv", [loaded.__file__, "--help"])
    with pytest.raises(SystemExit) as exit_:
        loaded.main()
    assert exit_.value.code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"usage: python -m {module} "), module


def test_help_runs_from_the_repository_root():
    command = [sys.executable, "-m", "bench.bench_dep", "--help"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "--out OUT" in run.stdout and "default: docs/results" in run.stdout, run.stdout


def test_command_names_the_launcher_module_and_arguments(monkeypatch):
    line = report.command_line(["-", "--out", "docs/results"], {}, "bench.bench_ep")
    assert line == "python -m bench.bench_ep --out docs/results"
    environ = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    line = report.command_line(["-", "--tokens", "1", "4"], environ, "bench.bench_dep")
    want = "CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 4 -m bench.bench_dep --tokens 1 4"
    assert line == want, line
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # a file, no -m
    environ = {"PMI_RANK": "0", "PMI_SIZE": "2"}
    line = report.command_line(["bench/x.py", "--peer-log", "a b.log"], environ)
    assert line == "mpiexec -n 2 python bench/x.py --peer-log 'a b.log'", line


def test_page_has_its_header_a_table_and_says_when_its_plot_is_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    run = torchrun(2, "bench.bench_x", "--out", str(tmp_path))
    purpose = report.summary("What it is for,\n  on two lines.\n\nMore.")
    page = report.Page(tmp_path / "results" / "bench_x2.md", "A benchmark", purpose, run)
    page.table(["T", "us"], [(1, "2.5"), (16, "3.0")])
    series = [report.Series("ours", [1, 16], [2.5, 3.0])]
    assert not page.plot(report.Figure("us against T", [report.Panel("T", "us", series)]))
    text = page.write().read_text()
    assert text.startswith("# A benchmark\n\nWhat it is for, on two lines.\n\n"), text
    assert f"- Command: `torchrun --nproc-per-node 2 -m bench.bench_x --out {tmp_path}`" in text
    assert "- Hardware: 2 x GPU\n- Software: Python 3, torch 2\n- Date: 2026-12-02\n" in text
    assert "| T | us |\n|---|---|\n| 1 | 2.5 |\n| 16 | 3.0 |\n" in text, text
    assert "No plot: matplotlib was not importable" in text
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["bench_x2.md"]


def test_plot_is_drawn_beside_the_page_and_shown_on_it(tmp_path):
    # matplotlib is in the test extra: here the plot must be drawn, not skipped
    page = report.Page(tmp_path / "bench_x1.md", "A benchmark", "For.", torchrun(1, "bench.x"))
    floor = report.Series("floor", [1, 16], [1.0, 2.0], "--", color_of_previous=True)
    series = [report.Series("ours", [1, 16], [2.5, 3.0]), floor]
    panels = [report.Panel("T", "us", series, x_log=2, y_log=10, reference=(2.0, "ceiling"))]
    assert page.plot(report.Figure("us against T", panels))
    assert "![us against T](bench_x1.png)" in page.write().read_text()
    assert (tmp_path / "bench_x1.png").stat().st_size > 0


def test_a_table_row_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="a row of 1 cells under 2 columns"):
        report.table(["T", "us"], [(1,)])


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
        dict(tokens=1, us=150.0, touched=16, floor_us=65.0, mode="graph", finite=True),
        dict(tokens=4, us=400.0, touched=62, floor_us=250.0, mode="graph", finite=False),
    ]
    meta = dict(n=2, local=448, bandwidth=4100.0, backend="HopperExperts (humming)")
    meta["grouping"] = "torch"
    run = torchrun(2, "bench.bench_routed_experts", "--out", "docs")
    routed_experts.write_report(tmp_path, results, {1: 202.57}, meta, run)
    page = (tmp_path / "bench_routed_experts2.md").read_text()
    assert "| 1 | 16 | 65 | 150 | 43% | 203 | 32% | 1.35 | graph | yes |" in page, page
    assert "| 4 | 62 | 250 | 400 | 62% | - | - | - | graph | NO |" in page, page
    assert "torchrun --nproc-per-node 2 -m bench.bench_routed_experts --out docs`" in page, page
    assert "# Routed path with experts, 2 GPUs," in page and "448 local experts per rank" in page


def test_report_gives_the_checked_steps_time_and_its_cost(tmp_path):
    """--check-expert-rows: the checked call's time and its difference from ours, a column
    each, after the peer's."""
    results = [
        dict(tokens=1, us=150.0, touched=16, floor_us=65.0, mode="graph", finite=True),
        dict(tokens=4, us=400.0, touched=62, floor_us=250.0, mode="graph", finite=True),
    ]
    results[0]["checked_us"], results[1]["checked_us"] = 153.25, 399.5
    meta = dict(n=1, local=896, bandwidth=4100.0, backend="HopperExperts (humming)")
    meta["grouping"] = "torch"
    run = torchrun(1, "bench.bench_routed_experts", "--check-expert-rows", "--out", "docs")
    routed_experts.write_report(tmp_path, results, {}, meta, run)
    page = (tmp_path / "bench_routed_experts1.md").read_text()
    assert "| 1 | 16 | 65 | 150 | 43% | - | - | - | 153.2 | +3.2 | graph | yes |" in page, page
    assert "| 4 | 62 | 250 | 400 | 62% | - | - | - | 399.5 | -0.5 | graph | yes |" in page, page
    assert "checked us | + |" in page and "check_expert_rows on" in page, page


def dep_row(tokens: int, peer: bool) -> dict:
    row = dict(tokens=tokens, routing="uniform", skew=1.0, pair_skew=1.02, receive_mib=0.5)
    row.update(dispatch=10.0, combine=20.0, pair=28.0, allgather=12.0, reduce_scatter=30.0)
    row.update(a2a=15.0, a2a_back=40.0, d_bytes=2.0e6, c_bytes=4.0e6, modes="graph")
    if peer:
        row.update(peer_dispatch=8.0, peer_combine=25.0, peer_pair=35.0)
    return row


def test_dep_report_puts_the_peer_beside_ours(tmp_path):
    note = "Peer: FlashInfer one-sided (flashinfer 0.7.4, ...); its workspace 301.0 MiB per rank"
    run = torchrun(2, "bench.bench_dep", "--out", "docs")
    bench_dep.write_report(
        tmp_path, [dep_row(1, True), dep_row(16, False)], 2, 3.5, peer_note=note, run=run
    )
    page = (tmp_path / "bench_dep2.md").read_text()
    # dispatch 2 MB in 10 us = 200 GB/s (peer 8 us: 250); combine 4 MB in 20 us = 200 (peer 160)
    assert (
        "| 1 | uniform | 1.00 / 1.02 | 0.50 | 10.0 / 8.0 | 20.0 / 25.0 | 28.0 / 35.0 | 1.25 |"
        " 200 / 250 | 200 / 160 |"
    ) in page, page
    assert "| 16 | uniform | 1.00 / 1.02 | 0.50 | 10.0 / - | 20.0 / - | 28.0 / - | - |" in page
    assert "| 1 | uniform | 12.0 (1.2x) | 30.0 (1.5x) | 15.0 (1.5x) | 40.0 (2.0x) | graph |" in page
    assert note in page and "torchrun --nproc-per-node 2 -m bench.bench_dep --out docs`" in page
    assert "# DEP benchmark, 2 GPUs, one process per GPU" in page


def test_integration_benchmark_runs_on_one_cpu_process(tmp_path):
    """The whole module under torchrun, one CPU process, tiny preset, a few calls: every path's
    row at every T with numbers, every integration's own host time with its verdict, the
    integrations' outputs equal EpRouted.routed's bit for bit (the reference experts rerun
    bitwise), the graph section saying it needs CUDA, the plot."""
    out = tmp_path / "results"
    arguments = ["--preset", "tiny", "--layers", "2", "--tokens", "4", "1", "--samples", "3"]
    arguments += ["--reps", "1", "--device", "cpu", "--out", str(out)]
    command = [launcher("torchrun"), "--nproc-per-node", "1", "-m", "bench.bench_integration"]
    run = subprocess.run(command + arguments, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    page = (out / "bench_integration.md").read_text()
    assert (
        "- Command: `torchrun --nproc-per-node 1 -m bench.bench_integration --preset tiny" in page
    )
    assert "2 layers sharing one EpRouted and one experts backend: ReferenceExperts" in page
    number = r"-?\d+\.\d"
    own_section, eager_section = page.split("## Eager: host time per layer call (us)")
    for tokens in (1, 4):  # sorted, each once
        for path in integration.PATHS:
            cells = rf"\| {tokens} \| {re.escape(path)} \| {number} \| {number} \| "
            if path in integration.INTEGRATIONS:
                own = cells + rf"{number} \| {number} \| (yes|NO) \|$"
                assert len(re.findall(own, own_section, re.M)) == 1, (own, page)
                cells += rf"{number} \| {number} \| yes \|$"
            else:
                cells += r"- \| - \| - \|$"
            assert len(re.findall(cells, eager_section, re.M)) == 1, (cells, page)
    assert "Not run: CUDA graphs need a CUDA device (this run: cpu)." in page
    assert (out / "bench_integration.png").stat().st_size > 10_000


def test_integration_page_puts_each_path_beside_the_call_it_wraps(tmp_path):
    def row(tokens: int, direct: float) -> dict:
        eager = {name: (direct + 3.0, direct + 5.0, 80) for name in integration.PATHS}
        eager[integration.DIRECT] = (direct, direct + 1.0, 80)
        eager[integration.OP] = (direct + 9.5, direct + 20.0, 80)
        graph = {name: 2 * direct for name in integration.PATHS}
        graph[integration.VLLM] = 2 * direct + 1.5

        def own_times(first: float, later: float, p90: float) -> dict:
            return dict(median=later, p90=p90, calls=80, first=first, later=later)

        own = {name: own_times(6.0, 6.0, 7.0) for name in integration.PATHS}  # under the stub
        own[integration.DIRECT] = own_times(0.5, 0.5, 0.8)
        own[integration.OP] = own_times(4.5, 4.5, 9.0)
        own[integration.SGLANG] = own_times(14.5, 2.5, 16.0)  # the mask in the first call
        same = {name: None for name in integration.INTEGRATIONS}  # not compared: see meta
        return dict(
            tokens=tokens, eager=eager, own=own, graph=graph, same_eager=same, same_graph=same
        )

    meta = dict(preset="k3", geometry=integration.PRESETS["k3"], layers=4, reps=2, samples=100)
    meta.update(backend="HopperExperts (HummingEngine)", deterministic=False, device="cuda")
    run = torchrun(1, "bench.bench_integration")
    integration.write_report(tmp_path, [row(1, 40.0), row(256, 60.0)], meta, run)
    page = (tmp_path / "bench_integration.md").read_text()
    assert "| 1 | EpRouted.routed | 40.0 | 41.0 | - | - | - |" in page, page
    assert "| 1 | vLLM DepEpKimiExperts.forward | 43.0 | 45.0 | 3.0 | 4.0 | - |" in page
    assert "| 256 | torch.ops.dep_ep.routed | 69.5 | 80.0 | 9.5 | 19.0 | - |" in page
    # Own host time: the path under the stub less the stub's own call, first and later layer
    # calls, the verdict on their mean over a forward of 4 layers.
    assert "| 1 | vLLM DepEpKimiExperts.forward | 5.5 | 5.5 | 5.5 | 6.2 | NO |" in page, page
    assert "| 256 | torch.ops.dep_ep.routed | 4.0 | 4.0 | 4.0 | 8.2 | yes |" in page
    assert "| 1 | SGLang forward_mega_experts | 14.0 | 2.0 | 5.0 | 15.2 | yes |" in page
    assert "| 256 | vLLM DepEpKimiExperts.forward | 121.5 | 1.5 | - |" in page, page
    assert "| 256 | SGLang forward_mega_experts | 120.0 | 0.0 | - |" in page
    assert "| 1 | EpMoeLayer | 80.0 | - | - |" in page
    assert "the experts backend's reruns are not bitwise equal" in page
    assert "Not run" not in page and (tmp_path / "bench_integration.png").exists()


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


def test_humming_decode_variants_change_one_thing_each_from_the_base():
    variants = tuning.decode_variant_configs(FakeHeuristic())
    base = variants["humming's 16"]
    assert list(variants)[0] == "humming's 16" and base["block_shape"] == [8, 256, 128]
    # N 256 and K 128 are the base's own: dropped as duplicates.
    assert "N 256" not in variants and "K 128" not in variants
    assert variants["N 64"]["block_shape"] == [8, 64, 128]
    assert variants["K 512"]["block_shape"] == [8, 256, 512]
    assert (
        variants["3 stages"]["num_stages"] == 3 and variants["4 CTAs an SM"]["num_ctas_per_sm"] == 4
    )
    assert variants["stream-K off"]["use_stream_k"] is False
    assert len(variants) == 1 + 2 + 2 + 4 + 4 + 1
    for label, config in variants.items():
        changed = {key for key in {**config, **base} if config.get(key) != base.get(key)}
        assert len(changed) <= 1, (label, changed)


def ncu_csv(rows: list[tuple[str, str, str, str, str]]) -> str:
    """ncu's `--csv --page details` text: a banner line, the header, one line per (launch,
    section, metric, unit, value)."""
    head = ["ID", "Process ID", "Kernel Name", "Section Name", "Metric Name"]
    head += ["Metric Unit", "Metric Value"]
    lines = ["==PROF== Connected to process 1", ",".join(f'"{h}"' for h in head)]
    for launch, *fields in rows:
        cells = [launch, "1", "kernel_CombineKernel", *fields]
        lines.append(",".join(f'"{c}"' for c in cells))
    return "\n".join(lines) + "\n"


SOL, OCC = "GPU Speed Of Light Throughput", "Occupancy"
NCU_CSV = ncu_csv(
    [
        ("0", SOL, "Duration", "us", "5.12"),
        ("0", OCC, "Achieved Occupancy", "%", "11.9"),
        ("1", SOL, "Duration", "us", "20.48"),
        ("1", OCC, "Achieved Occupancy", "%", "12.4"),
    ]
)


def test_profile_combine_reads_ncu_and_writes_a_column_per_t(tmp_path):
    keys, values = profile_combine.metrics(NCU_CSV)
    assert keys == [
        ("GPU Speed Of Light Throughput", "Duration", "us"),
        ("Occupancy", "Achieved Occupancy", "%"),
    ]
    run = report.Run("python -m bench.profile_combine", "1 x GPU", "Python 3", "2026-12-02")
    profile_combine.write_report(tmp_path, [1, 4096], keys, values, run)
    page = (tmp_path / "profile_combine.md").read_text()
    assert "| section | metric | unit | T = 1 | T = 4096 |" in page, page
    assert "| GPU Speed Of Light Throughput | Duration | us | 5.12 | 20.48 |" in page, page
    with pytest.raises(SystemExit, match="2 launches profiled for Duration; expected one per T"):
        profile_combine.write_report(tmp_path, [1, 16, 4096], keys, values, run)
    with pytest.raises(SystemExit, match="no ncu table"):
        profile_combine.metrics("==ERROR== no kernels were profiled")


def test_experts_mma_flops_count_fc1_and_fc2():
    # FC1 [L=2] -> [2I=6]: 2 * 1 * 2 * 6 = 24; FC2 [I=3] -> [L=2]: 2 * 1 * 3 * 2 = 12.
    assert experts.mma_flops(1, 2, 3) == 36
    assert experts.mma_flops(0, 3584, 3072) == 0
    # K3: 6 * L * I = 66,060,288 FLOPs a pair.
    assert experts.mma_flops(1000, 3584, 3072) == 66_060_288_000
    assert experts.EXPERT_BYTES == 17_547_264  # 3 * I * L / 2 codes + 3 * I * L / 32 scales


def test_experts_floor_is_the_larger_of_weight_read_and_fp8_mma():
    # Few pairs: the weights bound. 56 experts * 17,547,264 B at 4000 GB/s = 245.661696 us;
    # 100 pairs * 66,060,288 FLOPs at 1000 TFLOP/s = 6.6060288 us.
    few = experts.floors(56, 100, 4000.0, 1000.0)
    assert few.weight_us == pytest.approx(245.661696, rel=1e-12)
    assert few.mma_us == pytest.approx(6.6060288, rel=1e-12)
    assert few.floor_us == few.weight_us
    assert few.percent(491.323392) == pytest.approx(50.0, rel=1e-12)
    # Many pairs: the MMA bounds. 2 experts: 8.773632 us; 1000 pairs: 66.060288 us.
    many = experts.floors(2, 1000, 4000.0, 1000.0)
    assert many.weight_us == pytest.approx(8.773632, rel=1e-12)
    assert many.mma_us == pytest.approx(66.060288, rel=1e-12)
    assert many.floor_us == many.mma_us
    # Other geometry: 1 expert of 1e6 B at 1000 GB/s = 1 us; 10 pairs * 36 FLOPs at 1e-6 TFLOP/s.
    other = experts.floors(1, 10, 1000.0, 1e-6, expert_bytes=10**6, latent=2, intermediate=3)
    assert (other.weight_us, other.mma_us) == (pytest.approx(1.0), pytest.approx(360.0))


@pytest.mark.parametrize(
    "args, match",
    [
        ((-1, 1, 1.0, 1.0), "touched=-1"),
        ((1, 2.5, 1.0, 1.0), "pairs=2.5"),
        ((1, 1, 0.0, 1.0), "copy_gbs=0.0"),
        ((1, 1, 1.0, float("nan")), "fp8_tflops=nan"),
        ((1, 1, float("inf"), 1.0), "copy_gbs=inf"),
    ],
)
def test_experts_floors_refuse_bad_inputs(args, match):
    with pytest.raises(ValueError, match=f"floors: {match}"):
        experts.floors(*args)


def test_experts_graph_reps_fit_the_replay_budget():
    assert experts.graph_reps(100.0, 10) == 10  # 10 calls of 0.1 ms: within 20 ms
    assert experts.graph_reps(5_000.0, 10) == 4  # 4 calls of 5 ms fill 20 ms
    assert experts.graph_reps(50_000.0, 10) == 1  # one call past the budget still runs
    assert experts.graph_reps(0.0, 7) == 7  # no time measured: as asked


def experts_row(local, tokens, routing, touched=50, pairs=400, **columns):
    """A row of bench_experts.bench_local: 300 rows, the floor at 4000 GB/s and 1000 TFLOP/s."""
    floor = experts.floors(touched, pairs, 4000.0, 1000.0)
    row = {"local": local, "ranks": 896 // local, "tokens": tokens, "routing": routing}
    row.update(rows=300, pairs=pairs, touched=touched, floor_us=floor.floor_us)
    return {**row, "weight_us": floor.weight_us, "mma_us": floor.mma_us, **columns}


def test_experts_page_shows_both_floors_and_the_percent_of_the_larger(tmp_path):
    results = [
        experts_row(
            56,
            1,
            "uniform",
            humming=438.6,
            triton=877.2,
            **{"humming workspace": 2**21, "humming peak": 3 * 2**20},
        ),
        experts_row(56, 2048, "hot", touched=56, pairs=65536, humming=10_000.0),
        experts_row(448, 1, "zipf", triton=1000.0, reference=2000.0, **{"triton diff": 2e-4}),
    ]
    run = report.Run("python -m bench.bench_experts", "1 x H200", "torch", "2026-12-03")
    text = experts.write_report(tmp_path, results, 4000.0, 1000.0, 10, 20, run).read_text()
    assert "- Command: `python -m bench.bench_experts`" in text
    assert "copy bandwidth 4000 GB/s, dense FP8 rate 1000 TFLOP/s" in text, text
    header = (
        "| local (ranks) | T | routing | rows | pairs | touched | weight us | MMA us | floor us"
        " | humming us | humming % | triton us | triton % | humming workspace MiB"
        " | humming peak MiB | triton workspace MiB | triton peak MiB | Reference us"
        " | humming diff | triton diff |"
    )
    assert header in text, text
    # 50 experts: 219.3 us of weights, 400 pairs: 26.4 us of MMA; 438.6 us is 50%, 877.2 25%.
    uniform = "| 56 (16) | 1 | uniform | 300 | 400 | 50 | 219 | 26 | 219 | 439 | 50% | 877 | 25% |"
    assert uniform + " 2 | 3 | - | - | - | - | - |" in text, text
    # 65,536 pairs: 4329.3 us of MMA bound the 245.7 us of weights: 43% at 10 ms.
    hot = "| 56 (16) | 2048 | hot | 300 | 65536 | 56 | 246 | 4329 | 4329 | 10000 | 43% | - | - |"
    assert hot in text, text
    assert "| 448 (2) | 1 | zipf |" in text and "| 2000 | - | 2.0e-04 |" in text, text
    assert "![K3 experts on 1 x H200: % of the floor](bench_experts.png)" in text
    assert (tmp_path / "bench_experts.png").stat().st_size > 0
    # The summary says what the rows cover, not the whole run's default.
    covered = (
        "HopperExperts against the hardware floor, beside ReferenceExperts, at 56 and 448 local"
        " experts (rank 0 of 16 and 2 ranks), T = 1, 2048 tokens per rank, uniform, zipf and hot"
        " routing"
    )
    assert covered in text, text
    one = experts.write_report(tmp_path, results[1:2], 4000.0, 1000.0, 10, 20, run).read_text()
    assert "floor, at 56 local experts (rank 0 of 16 ranks), T = 2048 tokens per rank, hot" in one


def test_report_words():
    assert [report.words(x) for x in ([], ["a"], ["a", "b"], ["a", "b", "c"])] == [
        "",
        "a",
        "a and b",
        "a, b and c",
    ]


def test_layer_workspace_page_gives_memory_in_mib_and_flags_a_changed_output(tmp_path):
    from bench import bench_layer_workspace as workspace

    def row(tokens: int, bitwise: bool) -> dict:
        return {
            "local": 56,
            "tokens": tokens,
            "rows": 9,
            "pairs": 13,
            "workspace": 3 * 2**20,
            "one call": 3 * 2**20,
            "layers eager": 3 * 2**20,
            "one call graph pool": 4 * 2**20,
            "graph pool": 4 * 2**20,
            "sequence us": 80.04,
            "alone us": 76.0,
            "bitwise": bitwise,
        }

    run = report.Run("python -m bench.bench_layer_workspace", "1 x H100", "torch", "2026-12-05")
    text = workspace.write_page(tmp_path, [row(1, True), row(64, False)], 4, run).read_text()
    assert "| local | T | rows | pairs | workspace MiB | one call peak MiB |" in text, text
    assert "| 4 layers eager peak MiB | one call's graph pool MiB | 4 layers' graph pool" in text
    assert "| 56 | 1 | 9 | 13 | 3 | 3 | 3 | 4 | 4 | 80.0 | 76.0 | yes |" in text, text
    assert "| 56 | 64 | 9 | 13 | 3 | 3 | 3 | 4 | 4 | 80.0 | 76.0 | NO |" in text, text


def raw_csv(rows: list[tuple[str, str, str, str]], time_unit: str = "ns") -> str:
    """ncu's `--csv --page raw` text as ncu 2025.3 writes it: the program's own lines first (one
    holding "ID" in quotes), the header, the units row, a launch per (kernel name, duration,
    tensor pipe %, issue active %), then a line the program printed after the table."""
    tensor = profile_hopper_gemms.UTILIZATION["tensor pipe %"]
    issue = profile_hopper_gemms.UTILIZATION["issue active %"]
    head = ["ID", "Kernel Name", profile_hopper_gemms.TIME_METRIC, tensor, issue]
    lines = ["==PROF== Connected to process 1", 'the program printed {"ID": 1}']
    lines += [",".join(f'"{h}"' for h in head), f'"","","{time_unit}","%","%"']
    for launch, row in enumerate(rows):
        lines.append(",".join(f'"{c}"' for c in (str(launch), *row)))
    lines.append("==PROF== Disconnected from process 1")
    return "\n".join(lines) + "\n"


FC1 = "void humming<MmaOpClass, Shape<0, 6144, 3584>, Shape<64, 256, 128>>"
FC2 = "void humming<MmaOpClass, Shape<0u, 3584u, 3072u>, Shape<64u, 256u, 128u>>"


def test_profile_hopper_gemms_reads_ncu_raw_and_rates_each_gemm(tmp_path):
    gemms = profile_hopper_gemms
    assert [gemms.kernel_group(n) for n in (FC1, FC2, "finalize_kernel")] == ["fc1", "fc2", "other"]
    assert gemms.kernel_group("void humming<MmaOpClass, Shape<0, 128, 256>>") == "other"
    assert gemms.kernel_group("nvjet_sm90_qqtst_320x128") == "dense"
    text = raw_csv(
        [
            (FC1, "1,000,000", "20", "60"),
            ("situ_mxfp8_kernel", "50,000", "0", "30"),
            (FC1, "3,000,000", "40", "80"),
            (FC2, "500,000", "30", "70"),
        ]
    )
    columns, units, launches = gemms.raw_rows(text)
    assert columns[:2] == ["ID", "Kernel Name"] and len(launches) == 4
    assert units[gemms.TIME_METRIC] == "ns"
    flops = {"fc1": 4 * 10**12, "fc2": 10**12}
    rates = gemms.group_rates(launches, units, flops)
    # fc1: 4e12 FLOPs over 4,000 us = 1,000 TFLOP/s; fc2: 1e12 over 500 us = 2,000.
    assert rates["fc1"][:2] == (2, 4000.0) and rates["fc1"][2] == pytest.approx(1000.0)
    assert rates["fc2"][2] == pytest.approx(2000.0)
    tensor = gemms.UTILIZATION["tensor pipe %"]
    assert gemms.weighted_mean(launches, units, "fc1", tensor) == pytest.approx(35.0)
    dense = raw_csv([("nvjet_sm90_qqtst", "1", "95", "16")], time_unit="ms")
    run = report.Run("python -m bench.profile_hopper_gemms", "1 x GPU", "Python 3", "2026-12-03")
    results = [
        (gemms.Case(0, 0), {"flops": {"dense": 4 * 10**12}}, *gemms.raw_rows(dense)),
        (
            gemms.Case(56, 2048),
            {"rows": 9, "pairs": 13, "touched": 11, "flops": flops},
            columns,
            units,
            launches,
        ),
    ]
    page = gemms.write_report(tmp_path, results, run).read_text()
    # The dense GEMM: 4e12 FLOPs in 1 ms = 4,000 TFLOP/s; fc1 runs at a quarter of it.
    assert "| dense FP8 GEMM 8192^3 | - | dense | 1 | 1000.0 | 4000 | 100% | 95.0 | 16.0 |" in page
    assert (
        "| 56 local experts, T = 2048 | 13 | fc1 | 2 | 4000.0 | 1000 | 25% | 35.0 | 75.0 |" in page
    )
    assert "No metric matched: `launch__grid_size`" in page, page
    with pytest.raises(SystemExit, match="no ncu table"):
        gemms.raw_rows("==ERROR== no kernels were profiled")
    with pytest.raises(SystemExit, match="no profiled launch"):
        gemms.raw_rows('"ID","Kernel Name"\n"",""\n')
    # A FLOPs group that no launch belongs to, a time unit ncu does not write: refused.
    with pytest.raises(SystemExit, match="no fc2 launch among"):
        gemms.group_rates(launches[:3], units, flops)
    with pytest.raises(SystemExit, match="in unit 'furlong'"):
        gemms.time_us(launches[0], {gemms.TIME_METRIC: "furlong"})


def write_gemm_cases(raw, cases) -> None:
    """profile_hopper_gemms' files of each case in `raw` as a run writes them: ncu's CSV of one
    launch (100 us; the dense GEMM's nvjet, else humming's FC1) and the child's facts
    (10^11 FLOPs)."""
    for case in cases:
        group = "dense" if case.local == 0 else "fc1"
        name = "nvjet_sm90" if case.local == 0 else FC1
        (raw / f"{case.slug}.csv").write_text(raw_csv([(name, "100,000", "50", "50")]))
        facts = {"rows": 1, "pairs": 1, "touched": 1, "flops": {group: 10**11}}
        (raw / f"{case.slug}.json").write_text(json.dumps(facts))


def test_profile_hopper_gemms_page_again_from_a_runs_folder(tmp_path):
    gemms = profile_hopper_gemms
    raw = tmp_path / "raw"
    raw.mkdir()
    with pytest.raises(SystemExit, match="run.json is missing"):
        gemms.from_raw(raw, tmp_path)
    run = {
        "command": "python -m bench.profile_hopper_gemms",
        "hardware": "1 x GPU",
        "software": "Python 3",
        "date": "2026-12-03",
    }
    (raw / gemms.RUN_FILE).write_text(json.dumps(run))
    write_gemm_cases(raw, gemms.all_cases())
    page = gemms.from_raw(raw, tmp_path / "out").read_text()
    again = f"python -m bench.profile_hopper_gemms --from-raw {raw}"
    assert f"- Command: `python -m bench.profile_hopper_gemms; then {again}`" in page
    assert page.count("| fc1 | 1 | 100.0 | 1000 | 100% |") == len(gemms.CASES), page
    (raw / "l56_t64.csv").unlink()
    with pytest.raises(SystemExit, match="56 local experts, T = 64: no"):
        gemms.from_raw(raw, tmp_path / "out")
    # A header that is not the run's: one line naming it, not a traceback.
    for header in ("[1, 2]", '{"command": "c"}', "{not json"):
        (raw / gemms.RUN_FILE).write_text(header)
        with pytest.raises(SystemExit, match="run.json: not a run's header as this module"):
            gemms.from_raw(raw, tmp_path / "out")


def test_profile_hopper_gemms_page_again_keeps_the_runs_own_cases(tmp_path):
    gemms = profile_hopper_gemms
    raw = tmp_path / "raw"
    raw.mkdir()
    run = {"command": "c", "hardware": "h", "software": "s", "date": "d"}
    (raw / gemms.RUN_FILE).write_text(json.dumps(run))
    cases = [(112, 128), (448, 512)]
    (raw / gemms.CASES_FILE).write_text(json.dumps(cases))
    assert gemms.run_cases(raw) == cases
    write_gemm_cases(raw, gemms.all_cases(cases))
    page = gemms.from_raw(raw, tmp_path / "out").read_text()
    assert "112 local experts, T = 128" in page and "448 local experts, T = 512" in page
    assert "56 local experts" not in page  # CASES, which this run did not profile
    assert page.count("| fc1 | 1 | 100.0 | 1000 | 100% |") == len(cases), page
    # A cases file that is not the run's own list of distinct [local, T] pairs: refused.
    for listed, match in (
        ({"56": 64}, r"expected \[\[local, T\], \.\.\.\], positive ints"),
        (["56"], r"expected \[\[local, T\]"),
        ([[56.9, 64]], r"expected \[\[local, T\]"),
        ([["56", "64"]], r"expected \[\[local, T\]"),
        ([[True, 64]], r"expected \[\[local, T\]"),
        ([[0, 0]], r"expected \[\[local, T\]"),
        ([[56, -64]], r"expected \[\[local, T\]"),
        ([], "no case"),
        ([[57, 64]], "case 57:64: local experts must divide 896"),
        ([[112, 128], [112, 128]], "case 112:128 twice"),
    ):
        (raw / gemms.CASES_FILE).write_text(json.dumps(listed))
        with pytest.raises(SystemExit, match=match):
            gemms.from_raw(raw, tmp_path / "out")
    for text in ("[[Infinity, 1]]", "[[1e400, 1]]", "{not json"):
        (raw / gemms.CASES_FILE).write_text(text)
        with pytest.raises(SystemExit, match=f"{gemms.CASES_FILE}: (expected|not readable)"):
            gemms.from_raw(raw, tmp_path / "out")
    (raw / gemms.CASES_FILE).unlink()
    (raw / gemms.CASES_FILE).mkdir()  # not a file: refused, not read as "no list"
    with pytest.raises(SystemExit, match="not readable as JSON"):
        gemms.from_raw(raw, tmp_path / "out")


@pytest.mark.parametrize("case", ["56", "56:", ":64", "56:0", "-56:64", "a:b", "56:64:1"])
def test_profile_hopper_gemms_cases_are_refused_unless_local_colon_t(case, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["profile_hopper_gemms", f"--cases={case}"])
    with pytest.raises(SystemExit):
        profile_hopper_gemms.main()
    assert "expected LOCAL:T, two positive integers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cases", "56:64", "57:64"], "case 57:64: local experts must divide 896"),
        (["--cases", "56:64", "112:1", "56:64"], "case 56:64 twice"),
        (["--from-raw", "raw", "--cases", "56:64"], "--cases with --from-raw: the page shows"),
    ],
)
def test_profile_hopper_gemms_refuses_cases_it_cannot_profile(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["profile_hopper_gemms", *argv])
    with pytest.raises(SystemExit):
        profile_hopper_gemms.main()
    assert message in capsys.readouterr().err


def test_profile_hopper_gemms_without_ncu_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(profile_hopper_gemms.shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["profile_hopper_gemms", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no `ncu` on PATH"):
        profile_hopper_gemms.main()
    assert not list(tmp_path.iterdir())  # nothing written before the check


def narrow_raw_csv(launches: list[dict[str, str]]) -> str:
    """ncu's raw CSV (as raw_csv) of launches given as {metric: cell}, with a units row."""
    head = ["ID", "Kernel Name", *launches[0]]
    units = {profile_hopper_gemms.TIME_METRIC: "us"}
    lines = [",".join(f'"{h}"' for h in head)]
    lines.append(",".join(f'"{units.get(h, "")}"' for h in head))
    for i, launch in enumerate(launches):
        lines.append(",".join(f'"{c}"' for c in (str(i), f"kernel_{i}", *launch.values())))
    return "\n".join(lines) + "\n"


def test_profile_narrow_gemm_maps_launches_onto_calls_and_ranks_stalls(tmp_path):
    narrow = profile_narrow_gemm
    stall = narrow.STALL_PREFIX + "{}" + narrow.STALL_SUFFIX
    limit = narrow.OCCUPANCY_PREFIX + "{}"

    def launch(us, long_scoreboard, barrier, smem_limit):
        return {
            profile_hopper_gemms.TIME_METRIC: us,
            stall.format("long_scoreboard"): long_scoreboard,
            stall.format("barrier"): barrier,
            stall.format("wait"): "0.5",
            stall.format("not_issued"): "9",  # not stall reasons: never listed
            stall.format("selected"): "1",
            limit.format("shared_mem"): smem_limit,
            limit.format("registers"): "2",
        }

    launches = [launch("100", "3.0", "1.0", "1"), launch("50", "0.2", "2.5", "3")]
    facts = [
        {
            "local": 56,
            "ranks": 16,
            "tokens": 64,
            "rows": 60,
            "pairs": 1000,
            "touched": 56,
            "fc1_bytes": 200_000_000,
            "fc2_bytes": 100_000_000,
            "calls": ["humming words, tiles of 32_fc1", "humming_fc2"],
            "humming words, tiles of 32_fc1_diff": 0.0012,
        }
    ]
    columns, units, rows = profile_hopper_gemms.raw_rows(narrow_raw_csv(launches))
    run = report.Run("python -m bench.profile_narrow_gemm", "1 x GPU", "Python 3", "2026-12-06")
    page = narrow.write_report(tmp_path, facts, columns, units, rows, run).read_text()
    # 200 MB of FC1 in 100 us: 2,000 GB/s; 100 MB of FC2 in 50 us: 2,000.
    first = "| `humming words, tiles of 32_fc1` | 100.0 | 2000 | 1.2e-03 |"
    assert first in page, page
    line = next(x for x in page.splitlines() if x.startswith(first))
    assert line.endswith("| 1 (shared_mem) | long_scoreboard 3.00, barrier 1.00, wait 0.50 |")
    line = next(x for x in page.splitlines() if x.startswith("| `humming_fc2` | 50.0 | 2000 | - |"))
    assert line.endswith("| 2 (registers) | barrier 2.50, wait 0.50, long_scoreboard 0.20 |")
    assert "not_issued" not in line
    # A launch more or fewer than the calls: refused, the launches named.
    with pytest.raises(SystemExit, match="profiled 1 launches for 2 calls"):
        narrow.write_report(tmp_path, facts, columns, units, rows[:1], run)


def test_profile_narrow_gemm_refuses_bad_rows_and_a_missing_ncu(tmp_path, monkeypatch, capsys):
    narrow = profile_narrow_gemm
    for row, message in (
        ("56", "'56': expected LOCAL:T"),
        ("55:64", "row 55:64: local experts must divide 896"),
        ("56:0", "'56:0': expected LOCAL:T, two positive integers"),
        ("0:1", "'0:1': expected LOCAL:T, two positive integers"),
    ):
        argv = ["profile_narrow_gemm", "--out", str(tmp_path), "--rows", row]
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit):
            narrow.main()
        assert message in capsys.readouterr().err
    monkeypatch.setattr(narrow.shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["profile_narrow_gemm", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no `ncu` on PATH"):
        narrow.main()
    assert not list(tmp_path.iterdir())
    with pytest.raises(SystemExit, match="run.json is missing"):
        narrow.from_raw(tmp_path, tmp_path)
    # A run's folder with a malformed file: one SystemExit naming the folder.
    run = {"command": "c", "hardware": "h", "software": "s", "date": "d"}
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "ncu.csv").write_text(narrow_raw_csv([{profile_hopper_gemms.TIME_METRIC: "1"}]))
    for facts in ("{not json", json.dumps([{"calls": ["x_fc1"]}]), json.dumps({"a": 1})):
        (tmp_path / "facts.json").write_text(facts)
        with pytest.raises(SystemExit, match=f"{tmp_path} does not hold a profiling run's"):
            narrow.from_raw(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("option", ["--tokens", "--reps", "--samples"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_bench_counts_are_positive_ints(option, value, capsys):
    from bench import cli

    parser = cli.parser("doc", tokens=[1], timing=(2, 3))
    with pytest.raises(SystemExit):
        parser.parse_args([option, value])
    assert "expected an int >= 1" in capsys.readouterr().err
    assert getattr(parser.parse_args([option, "4"]), option[2:]) in (4, [4])


def narrow_source_csv(instructions) -> str:
    """ncu's source page (--page source --csv --print-source sass) for `instructions`: (SASS,
    executed, samples, {state: samples}) each, with a Not Issued repeat column that must not
    count."""
    source = profile_narrow_source
    states = ["barrier", "long_sb", "selected"]
    heads = [source.ADDRESS, source.SOURCE, source.SAMPLES, source.EXECUTED]
    heads += [f"stall_{s}" for s in states] + ["stall_long_sb (Not Issued)"]
    lines = ['"Kernel Name","kernel_narrow",', ",".join(f'"{h}"' for h in heads)]
    for i, (sass, executed, samples, by_state) in enumerate(instructions):
        cells = [f"0x{16 * i:x}", f"      {sass}", str(samples), f"{executed:,}"]
        cells += [str(by_state.get(s, 0)) for s in states] + ["999"]
        lines.append(",".join(f'"{c}"' for c in cells))
    return "\n".join(lines) + "\n"


def test_profile_narrow_source_ranks_instructions_and_totals_the_warp_states(tmp_path):
    source = profile_narrow_source
    text = narrow_source_csv(
        [
            ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR11+0xc880], R18", 600, 10, {"selected": 10}),
            ("@!P0 BRA 0x100", 600, 70, {"long_sb": 68, "selected": 2}),
            ("BAR.SYNC.DEFER_BLOCKING 0x0", 60, 0, {}),
            ("@P0 BRA 0x200", 60, 20, {"barrier": 20}),
        ]
    )
    kernel, columns, rows = source.source_rows(text)
    assert kernel == "kernel_narrow" and len(rows) == 4
    # The Not Issued repeat is not a state of its own and adds nothing.
    totals = dict(source.states_total(columns, rows))
    assert totals == {"long_sb": 68, "barrier": 20, "selected": 12}
    top = source.top_instructions(columns, rows, 2)
    # The wait's branch first (70 of 100 samples), named with the wait before it.
    assert top[0] == [
        "1",
        "`@!P0 BRA 0x100`",
        "`SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR11+0xc880], R18`",
        "600",
        "70.0%",
        "long_sb 68, selected 2",
    ]
    assert top[1][:2] == ["3", "`@P0 BRA 0x200`"] and top[1][-2:] == ["20.0%", "barrier 20"]
    facts = {"local": 56, "tokens": 16, "rows": 177, "pairs": 280, "touched": 56}
    facts["fc1_bytes"] = 655_100_000
    run = report.Run("python -m bench.profile_narrow_source", "1 x GPU", "Python 3", "2026-12-06")
    page = source.write_report(tmp_path, facts, "a form", text, run, top=3).read_text()
    with pytest.raises(SystemExit, match="holds no sample"):
        source.write_report(tmp_path, facts, "a form", narrow_source_csv([("NOP", 1, 0, {})]), run)
    assert "| long_sb | 68 | 68.0% |" in page and "| barrier | 20 | 20.0% |" in page
    assert "## The 3 instructions with the most samples" in page
    assert "Form: `a form`, FC1 (655.1 MB of weights)" in page
    # Text that is not a source page, or one without an instruction or a needed column.
    for bad, match in (
        ("==ERROR== no kernel profiled\n", "no ncu source table"),
        ('"Address","Source"\n', r"the source table has no \['Warp Stall Sampling"),
        (narrow_source_csv([]), "the source table holds no instruction"),
        # From a careless-user probe: a short row was dropped (every later instruction shifted),
        # a count that is not one raised ValueError, a doubled column was read silently.
        (text.replace(',"999"\n', "\n", 1), "line 3 of the source table has 7 cells, the header 8"),
        (text.replace('"600"', '"n/a"', 1), "'n/a' in the source table is not a count"),
        (text.replace('"70"', '"-70"', 1), "'-70' in the source table is not a count"),
        (
            text.replace('"stall_barrier"', '"Source"'),
            r"the source table has the \['Source'\] column",
        ),
    ):
        with pytest.raises(SystemExit, match=f"^bench.profile_narrow_source: {match}"):
            source.source_rows(bad)


def test_profile_narrow_source_refuses_bad_arguments_a_missing_ncu_and_bad_raw(
    tmp_path, monkeypatch, capsys
):
    source = profile_narrow_source
    for args, message in (
        (["--row", "55:16"], "row 55:16: local experts must divide 896"),
        (["--top", "0"], "--top 0: at least 1"),
        (["--form", "no such form"], "invalid choice"),
    ):
        monkeypatch.setattr(sys, "argv", ["profile_narrow_source", "--out", str(tmp_path), *args])
        with pytest.raises(SystemExit):
            source.main()
        assert message in capsys.readouterr().err
    monkeypatch.setattr(source.shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["profile_narrow_source", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no `ncu` on PATH"):
        source.main()
    assert not list(tmp_path.iterdir())
    with pytest.raises(SystemExit, match="run.json is missing"):
        source.from_raw(tmp_path, tmp_path)
    run = {"command": "c", "hardware": "h", "software": "s", "date": "d"}
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "form.txt").write_text(source.FORM + "\n")
    (tmp_path / "source.csv").write_text(narrow_source_csv([("NOP", 1, 1, {"selected": 1})]))
    row = {"local": 56, "tokens": 16, "rows": 1, "pairs": 1, "touched": 1, "fc1_bytes": 1e6}
    # From the probe too: facts of other types, a form that is none of the bench's, a binary
    # source page were rendered or raised.
    for facts in (
        "{not json",
        json.dumps([{"local": 56}]),
        json.dumps([{}, {}]),
        json.dumps([row | {"fc1_bytes": "1e6"}]),
        json.dumps([row | {"local": False}]),
        json.dumps([row | {"tokens": -3}]),
        json.dumps([row | {"fc1_bytes": float("nan")}]),
    ):
        (tmp_path / "facts.json").write_text(facts)
        with pytest.raises(SystemExit, match=f"{tmp_path} does not hold a profiling run's"):
            source.from_raw(tmp_path, tmp_path / "out")
    (tmp_path / "facts.json").write_text(json.dumps([row]))
    (tmp_path / "form.txt").write_text("no such form\n")
    with pytest.raises(SystemExit, match="form 'no such form'; not one of"):
        source.from_raw(tmp_path, tmp_path / "out")
    (tmp_path / "form.txt").write_text(source.FORM + "\n")
    (tmp_path / "source.csv").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(SystemExit, match="does not hold a profiling run's files"):
        source.from_raw(tmp_path, tmp_path / "out")
    (tmp_path / "source.csv").write_text(narrow_source_csv([("NOP", 1, 1, {"selected": 1})]))
    # --out a file: one line, not FileExistsError.
    (tmp_path / "afile").write_text("")
    argv = ["profile_narrow_source", "--from-raw", str(tmp_path), "--out", str(tmp_path / "afile")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit, match="cannot write to"):
        source.main()
    page = source.from_raw(tmp_path, tmp_path / "out").read_text()
    assert "c; then python -m bench.profile_narrow_source --from-raw" in page


def test_run_ncu_keeps_its_output_and_names_what_ran_past_its_time(tmp_path):
    run_ncu = profile_hopper_gemms.run_ncu
    csv_path, log_path = tmp_path / "a.csv", tmp_path / "a.log"
    made = tmp_path / "facts.json"
    script = f"import sys; print('table'); print('note', file=sys.stderr); open({str(made)!r}, 'w')"
    done = run_ncu([sys.executable, "-c", script], csv_path, log_path, 60, "who", made)
    assert done.returncode == 0
    assert csv_path.read_text() == "table\n" and log_path.read_text() == "note\n"
    made.unlink()
    # Exit 0 without the child's file, or an error exit: failed, the output named and kept.
    for script in ("print('table')", "import sys; print('table'); sys.exit(3)"):
        with pytest.raises(SystemExit, match=r"bench.x: case: ncu failed \(exit \d\):\ntable"):
            run_ncu([sys.executable, "-c", script], csv_path, log_path, 60, "bench.x: case", made)
        assert csv_path.read_text() == "table\n"
    script = "import sys, time; print('part', flush=True); time.sleep(30)"
    with pytest.raises(SystemExit, match="bench.x: case: ncu ran past 1 s; its output so far"):
        run_ncu([sys.executable, "-c", script], csv_path, log_path, 1, "bench.x: case", made)
    assert csv_path.read_text() == "part\n"
    # Bytes that are not UTF-8, finished or cut off by the timeout: kept, replaced, no error.
    write = "import sys; sys.stdout.buffer.write(b'k\\xff\\n'); sys.stdout.flush()"
    script = f"{write}; open({str(made)!r}, 'w')"
    run_ncu([sys.executable, "-c", script], csv_path, log_path, 60, "who", made)
    assert csv_path.read_text() == "k\ufffd\n"
    script = f"{write}; import time; time.sleep(30)"
    with pytest.raises(SystemExit, match="ran past 1 s"):
        run_ncu([sys.executable, "-c", script], csv_path, log_path, 1, "bench.x: case", made)
    assert csv_path.read_text() == "k\ufffd\n"


def test_ncu_table_errors_name_the_module_reading_it():
    with pytest.raises(SystemExit, match="^bench.profile_narrow_gemm: no ncu table in"):
        profile_hopper_gemms.raw_rows("==ERROR== nothing", "bench.profile_narrow_gemm")
    with pytest.raises(SystemExit, match="^bench.profile_hopper_gemms: ncu's table has no"):
        profile_hopper_gemms.raw_rows('"ID","Kernel Name"\n"",""\n')


def test_bench_narrow_gemm_refuses_forms_with_wide_or_shapes(monkeypatch, capsys):
    from bench import bench_narrow_gemm

    for extra in ("--wide", "--shapes"):
        argv = ["bench_narrow_gemm", "--forms", "humming words", extra]
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit):
            bench_narrow_gemm.main()
        assert "--forms names every form timed" in capsys.readouterr().err
