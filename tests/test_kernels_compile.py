"""The CuTeDSL kernels compile for Hopper (sm_90a) and Blackwell (sm_100a) without a GPU, and the
PTX holds what the protocol relies on: 16-byte vector stores, system-scope release/acquire with
each fence by one signalling thread, bounded waits on %globaltimer, exact-rounding arithmetic,
programmatic dependent launch, no local-memory arrays; the launch parameters marshal as
CuTeDSL's own, and each kernel's launcher (comm/kernels/) hands its kernel the arguments and grid
of its rule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import cutlass  # noqa: F401

    from dep_ep.comm.device_transport import check_kernel_limits, compile_kernels, compiled_count
    from dep_ep.comm.kernels.launch_args import KernelTuning
except ImportError as err:  # the test extra installs CuTeDSL: missing it is a failure, not a skip
    raise ImportError(f"tests/test_kernels_compile.py needs nvidia-cutlass-dsl: {err}") from err

# A launch signals its step: every CTA fences its payload at system scope and counts itself done
# (acquire-release add at GPU scope: every CTA is on this GPU); the last one fences once more and
# stores the step flag into every other rank, relaxed stores at system scope after the fence (a
# release pattern), which the peers acquire.
SIGNALS = [r"fence\.acq_rel\.sys", r"atom\.global\.acq_rel\.add", r"st\.relaxed\.sys\.global"]
# A bounded wait: acquire loads at system scope against %globaltimer.
WAITS = [r"ld\.acquire\.sys", r"%globaltimer"]
# Programmatic dependent launch (KernelTuning.pdl, the default): wait for the grid before, then
# let the next launch start.
PDL = [r"griddepcontrol\.wait", r"griddepcontrol\.launch_dependents"]
REQUIRED = {
    "dispatch": [r"st\.global\.v4\.b32", r"ld\.global\.v4\.b32", *SIGNALS, *WAITS, *PDL,
                 r"cvt\.rn\.satfinite\.e4m3x2\.f32", r"mul\.rn\.f32"],
    "combine": [r"st\.global\.v4\.b32", r"ld\.global\.v4\.b32", *SIGNALS, *WAITS, *PDL,
                r"sqrt\.rn\.f32", r"div\.rn\.f32", r"shfl\.sync", r"bar\.red\.or\.pred",
                # a group of 4 warps reduces a token (its named barrier); BF16 rounding in pairs
                r"bar\.sync\s+1, 128", r"cvt\.rn\.bf16x2\.f32"],
    # A rank that rejects its input still signals both phases (flags only) and waits, bounded.
    "reject_dispatch": [r"st\.release\.sys\.global", *WAITS],
    "reject_combine": [r"st\.release\.sys\.global", *WAITS],
}  # fmt: skip
FORBIDDEN = [r"\.local", r"fma\.rn\.f32"]  # spills; a contracted multiply-add breaks bit-exactness
# The system-scope fences in each kernel's code, each by one signalling thread: the dispatch's
# after its CTA barrier (signal_after_cta) and before its flags (signal_all); the combine's
# before its ready flags and, with several ranks (8 here), before its combine-end flags (each
# signal_all). One fence for all the destinations, not one a destination.
FENCES = {"dispatch": 2, "combine": 2}


@pytest.fixture(scope="module", params=["sm_90a", "sm_100a"])
def ptx(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    kernels = compile_kernels(
        num_ranks=8,
        latent=3584,
        topk=16,
        experts_per_rank=112,
        arch=request.param,
        keep_ptx_dir=str(folder),
    )
    return request.param, {name: ptx_text(k.artifacts.PTX) for name, k in kernels.items()}


def ptx_text(artifact: str) -> str:
    """CuTeDSL gives the PTX itself or the path it was kept at, depending on the version."""
    if "\n" not in artifact and Path(artifact).is_file():
        return Path(artifact).read_text()
    return artifact


@pytest.mark.parametrize("kernel", sorted(REQUIRED))
def test_ptx_holds_the_protocol(ptx, kernel):
    arch, texts = ptx
    text = texts[kernel]
    assert f".target {arch}" in text, f"{kernel}: not compiled for {arch}"
    missing = [p for p in REQUIRED[kernel] if not re.search(p, text)]
    assert not missing, f"{kernel} ({arch}) PTX lacks {missing}"
    present = [p for p in FORBIDDEN if re.search(p, text)]
    assert not present, f"{kernel} ({arch}) PTX holds {present}"
    if kernel in FENCES:
        fences = len(re.findall(r"fence\.acq_rel\.sys", text))
        want = FENCES[kernel]
        assert fences == want, f"{kernel} ({arch}): {fences} system-scope fences; expected {want}"
        unreleased = relaxed_stores_without_fence(text)
        assert not unreleased, f"{kernel} ({arch}): flag stores with no fence before: {unreleased}"


def relaxed_stores_without_fence(text: str) -> list[str]:
    """The relaxed system-scope stores (the step flags) not preceded by a system-scope fence with
    no other store or atomic between them: each flag store must be part of a release pattern
    (fence, then strong store). The PTX lines of such stores, numbered."""
    bad, released = [], False
    for number, line in enumerate(text.splitlines(), 1):
        op = line.strip()
        if op.startswith("fence.acq_rel.sys"):
            released = True
        elif op.startswith("st.relaxed.sys"):
            if not released:
                bad.append(f"{number}: {op}")
        elif op.startswith(("st.", "atom.", "red.")):
            released = False
    return bad


def test_one_rank_kernels_signal_nothing(tmp_path):
    """At one rank nobody waits for a flag (a rank's own slot is never read): the dispatch and
    the combine compile without a system-scope fence or a flag store, and the combine without
    the count of its CTAs (an acquire-release atomic; its CTA 0 stores the call the dispatch
    opened, STATE_OPEN_CALL)."""
    kernels = compile_kernels(
        num_ranks=1,
        latent=3584,
        topk=16,
        experts_per_rank=896,
        arch="sm_90a",
        keep_ptx_dir=str(tmp_path),
        names=("dispatch", "combine"),
    )
    for name, kernel in kernels.items():
        text = ptx_text(kernel.artifacts.PTX)
        patterns = [r"fence\.acq_rel\.sys", r"st\.relaxed\.sys"]
        if name == "combine":
            patterns.append(r"atom\.global\.acq_rel")
        held = [p for p in patterns if re.search(p, text)]
        assert not held, f"{name} at one rank holds {held}"


def test_compile_cache_per_geometry():
    """A second compile of one geometry returns the cached kernels and compiles nothing; another
    geometry compiles again. Small geometries of this test alone (nothing else caches them)."""
    names = ("dispatch", "combine")
    small = dict(num_ranks=2, latent=64, topk=2, experts_per_rank=3, arch="sm_90a", names=names)
    before = compiled_count()
    first = compile_kernels(**small)
    assert compiled_count() == before + len(names), (before, compiled_count())
    again = compile_kernels(**small)
    assert compiled_count() == before + len(names), "the same geometry compiled again"
    assert sorted(again) == sorted(names) and all(again[n] is first[n] for n in names)
    other = compile_kernels(**{**small, "latent": 96})
    assert compiled_count() == before + 2 * len(names), "another geometry was not compiled"
    assert all(other[n] is not first[n] for n in names)


@pytest.mark.parametrize("arch", ["sm90a", "sm_90", "90a", "SM_90A"])
def test_compile_refuses_an_arch_it_has_no_kernels_for(arch):
    """A misspelt arch is named before CuTe sees it (its own error is a bare KeyError)."""
    from dep_ep.comm.kernels.launcher import compile_kernel

    with pytest.raises(
        ValueError, match=rf"arch '{arch}'; expected one of \('sm_90a', 'sm_100a'\)"
    ):
        compile_kernel(lambda: pytest.fail("built before the arch was checked"), arch)


def test_compile_for_this_process_gpu_without_one_is_refused(monkeypatch):
    """arch None means this process's GPU; without one CuTe would pick a default arch."""
    import torch

    from dep_ep.comm.kernels.launcher import compile_kernel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="arch None .* in a process without a GPU; name one of"):
        compile_kernel(lambda: pytest.fail("built before the arch was checked"), None)


def test_tuning_is_part_of_the_cache_key():
    """Another KernelTuning compiles its own kernels; the same one again compiles nothing."""
    small = dict(num_ranks=2, latent=64, topk=4, experts_per_rank=3, arch="sm_90a")
    plain = compile_kernels(**small, names=("dispatch",))
    other = compile_kernels(**small, names=("dispatch",), tuning=KernelTuning(pdl=False))
    again = compile_kernels(**small, names=("dispatch",), tuning=KernelTuning())
    assert other["dispatch"] is not plain["dispatch"] and again["dispatch"] is plain["dispatch"]


BAD_COUNTS = (0, 9, 2.0, True)


@pytest.mark.parametrize(
    "field,value",
    [
        *((f, v) for f in ("dispatch_blocks_in_flight", "combine_warps") for v in BAD_COUNTS),
        *(("combine_warps", v) for v in (2, 6)),  # not whole groups of NORM_WARPS
        *(("combine_ctas_per_sm", v) for v in (-1, 9, 1.0, False)),
    ],
)
def test_tuning_refuses_bad_values(field, value):
    with pytest.raises(ValueError, match=f"KernelTuning: {field}="):
        KernelTuning(**{field: value})


def test_kernel_limits():
    """The GPU transport refuses what its kernels cannot index, naming the bound it needs."""
    from dep_ep.comm.layout import EpLayout

    check_kernel_limits(EpLayout(16, 4096, 3584, 16))  # K3 at DEP16, 4096 tokens a rank
    with pytest.raises(ValueError, match="max_tokens must be at most 74898 at 16 ranks"):
        check_kernel_limits(EpLayout(16, 74899, 3584, 16))
    # A narrow latent with a wide topk: the ids and weights rows are the widest.
    check_kernel_limits(EpLayout(32, 524_287, 64, 128))
    with pytest.raises(ValueError, match="max_tokens must be at most 524287 at 32 ranks"):
        check_kernel_limits(EpLayout(32, 524_288, 64, 128))
    with pytest.raises(ValueError, match="at most 32 ranks"):
        check_kernel_limits(EpLayout(33, 8, 64, 4))


@pytest.mark.parametrize("kernel", ["dispatch", "combine", "reject_dispatch"])
def test_host_params_marshal_like_cutedsl(kernel):
    """HostParams hand a compiled kernel the same parameter bytes as CuTeDSL's own conversion of
    typed arguments (the JitArgument protocol, read at launch): every parameter, in order."""
    import ctypes

    import cuda.bindings.driver as cuda
    from cutlass import Float32, Int32, Int64

    from dep_ep.comm.kernels.host_params import STREAM, HostParams
    from dep_ep.comm.kernels.launch_args import RankControl, Step, SymmetricRegions

    compiled = compile_kernels(2, 64, 4, 3, arch="sm_90a", names=(kernel,))[kernel]
    regions = [0x7F0000001000 + 256 * i for i in range(8)]
    control, step, stream = (
        [0x7F0000009000, 0x7F000000A000, 1, 20 * 10**9],
        [37, -(2**62)],
        0x7F000000ABC0,
    )
    typed = [
        SymmetricRegions(*map(Int64, regions)),
        RankControl(Int64(control[0]), Int64(control[1]), Int32(1), Int64(control[3])),
        Step(Int32(step[0]), Int64(step[1])),
    ]
    prepared = [
        HostParams.of(SymmetricRegions(*regions)),
        HostParams.of(RankControl(*control)),
        HostParams(Int32, Int64).set(*step),
    ]
    sizes = [8] * 8 + [8, 8, 4, 8] + [4, 8]
    if kernel == "dispatch":  # latent, its row stride (words), ids, weights, structs, grid
        latent, row_words, head = 0x7F00000B0000, 48, [0x7F00000C0000, 0x7F00000D0000]
        typed = [Int64(latent), Int32(row_words), *map(Int64, head), *typed, Int32(99)]
        prepared = [
            HostParams(Int64).set(latent),
            HostParams(Int32).set(row_words),
            *(HostParams(Int64).set(a) for a in head),
            *prepared,
            HostParams(Int32).set(99),
        ]
        sizes = [8, 4, 8, 8] + sizes + [4]
    elif kernel == "combine":  # ids, norm_weight, normed, structs, eps, normalize, grid
        head = [0x7F00000C0000, 0, 0x7F00000E0000]
        typed = [*map(Int64, head), *typed, Float32(1e-5), Int32(1), Int32(7)]
        prepared = [
            *(HostParams(Int64).set(a) for a in head),
            *prepared,
            HostParams(Float32).set(1e-5),
            HostParams(Int32).set(1),
            HostParams(Int32).set(7),
        ]
        sizes = [8] * 3 + sizes + [4, 4, 4]
    typed.append(cuda.CUstream(stream))
    prepared.append(HostParams(STREAM).set(stream))
    sizes.append(8)
    binder = compiled.execution_args
    want, _ = binder.generate_execution_args(tuple(typed), {})
    got, _ = binder.generate_execution_args(tuple(prepared), {})
    assert len(want) == len(got) == len(sizes), (len(want), len(got), len(sizes))

    def target(pointer, size: int) -> bytes:  # CuTeDSL hands c_void_p or plain addresses
        return ctypes.string_at(getattr(pointer, "value", pointer), size)

    for i, (w, g, size) in enumerate(zip(want, got, sizes)):
        assert target(w, size) == target(g, size), f"{kernel}: parameter {i} differs"


def fake_transport_params(rank: int = 1, timeout_ns: int = 20 * 10**9):
    """TransportParams of made-up addresses (no GPU): (the params, the regions' values, the
    control's values)."""
    from types import SimpleNamespace

    from dep_ep.comm.kernels.launcher import TransportParams

    names = ("x", "sf", "ids", "weights", "out", "flags")
    offsets = {name: 0x1000 * (i + 1) for i, name in enumerate(names)}
    peers, base, state, error = 0x7F0000001000, 0x7F0000100000, 0x7F0000009000, 0x7F000000A000
    buffers = SimpleNamespace(
        layout=SimpleNamespace(regions={n: SimpleNamespace(offset=o) for n, o in offsets.items()}),
        peer_addresses=SimpleNamespace(data_ptr=lambda: peers),
        base_address=base,
    )
    shared = TransportParams(
        buffers,
        SimpleNamespace(data_ptr=lambda: state),
        SimpleNamespace(data_ptr=lambda: error),
        rank,
        timeout_ns,
    )
    return shared, [peers, base, *offsets.values()], [state, error, rank, timeout_ns]


def test_launcher_grid_rules():
    """The launchers' grids: the dispatch one CTA a token, at most CTAS_PER_SM an SM; the
    combine ceil(T / groups), groups = combine_warps / NORM_WARPS, at most combine_ctas_per_sm an
    SM (0: no cap)."""
    from dep_ep.comm.kernels.combine import CombineLaunch
    from dep_ep.comm.kernels.dispatch import DispatchLaunch
    from dep_ep.comm.kernels.launcher import KernelGeometry
    from dep_ep.constants import CTAS_PER_SM

    geometry, sms = KernelGeometry(2, 64, 4, 3), 132
    shared, _, _ = fake_transport_params()
    dispatch = DispatchLaunch(geometry, KernelTuning(), shared, sms, arch="sm_90a")
    for tokens in (1, 7, CTAS_PER_SM * sms, CTAS_PER_SM * sms + 1, 10**5):
        assert dispatch.grid(tokens) == min(tokens, CTAS_PER_SM * sms), tokens
    four_warps = {"combine_warps": 4}
    cases = [  # (tuning, T, grid)
        (KernelTuning(), 1, 1),  # the default: two token groups a CTA, at most 2 CTAs an SM
        (KernelTuning(), 500, 250),
        (KernelTuning(), 4096, 2 * sms),
        (KernelTuning(**four_warps, combine_ctas_per_sm=8), 500, 500),
        (KernelTuning(**four_warps, combine_ctas_per_sm=8), 4096, 8 * sms),
        (KernelTuning(**four_warps, combine_ctas_per_sm=0), 4096, 4096),
        (KernelTuning(combine_warps=8, combine_ctas_per_sm=0), 9, 5),
        (KernelTuning(combine_warps=8, combine_ctas_per_sm=2), 4096, 2 * sms),
        (KernelTuning(combine_warps=8, combine_ctas_per_sm=2), 100, 50),
    ]
    for tuning, tokens, grid in cases:
        combine = CombineLaunch(geometry, tuning, shared, sms, arch="sm_90a")
        assert combine.grid(tokens) == grid, (tuning, tokens)


class Tensor:
    """What a launcher reads of a torch tensor: its address, shape and row stride."""

    def __init__(self, address: int, shape: tuple[int, ...], row_stride: int | None = None):
        self.address, self.shape = address, shape
        self.row_stride = shape[-1] if row_stride is None else row_stride

    def data_ptr(self) -> int:
        return self.address

    def stride(self, dim: int) -> int:
        assert dim == 0
        return self.row_stride


@pytest.mark.parametrize("kernel", ["dispatch", "combine", "fail_combine"])
def test_launchers_pass_the_kernel_its_arguments(kernel):
    """Each launcher hands its compiled kernel the parameter bytes of the typed arguments the
    kernel's signature names (CuTeDSL's own conversion): the tensors' addresses, the latent's
    row stride in words, the step, the grid of its rule, the stream; the shared structs."""
    import ctypes

    import cuda.bindings.driver as cuda
    from cutlass import Float32, Int32, Int64

    from dep_ep.comm.kernels.combine import CombineLaunch
    from dep_ep.comm.kernels.dispatch import DispatchLaunch
    from dep_ep.comm.kernels.launch_args import RankControl, Step, SymmetricRegions
    from dep_ep.comm.kernels.launcher import KernelGeometry
    from dep_ep.comm.kernels.reject import RejectLaunch

    geometry, sms, tokens, tag, stream = KernelGeometry(2, 64, 4, 3), 132, 37, -(2**62), 0xABC0
    shared, regions, control = fake_transport_params()
    structs = [
        SymmetricRegions(*map(Int64, regions)),
        RankControl(Int64(control[0]), Int64(control[1]), Int32(control[2]), Int64(control[3])),
    ]
    if kernel == "dispatch":
        launch = DispatchLaunch(geometry, KernelTuning(), shared, sms, arch="sm_90a")
        latent = Tensor(0x7F00000B0000, (tokens, 64), row_stride=96)  # a column slice
        ids, weights = Tensor(0x7F00000C0000, (tokens, 4)), Tensor(0x7F00000D0000, (tokens, 4))
        call = (latent, ids, weights, tokens, tag, stream)
        head = [Int64(latent.address), Int32(48), Int64(ids.address), Int64(weights.address)]
        tail = [Int32(tokens)]  # min(T, CTAS_PER_SM * SMs)
        step = Step(Int32(tokens), Int64(tag))
    elif kernel == "combine":
        launch = CombineLaunch(geometry, KernelTuning(), shared, sms, arch="sm_90a")
        ids, norm = Tensor(0x7F00000C0000, (tokens, 4)), Tensor(0x7F00000E0000, (64,))
        normed = Tensor(0x7F00000F0000, (tokens, 64))
        call = (ids, norm, normed, 1e-5, tokens, tag, stream)
        head = [Int64(ids.address), Int64(norm.address), Int64(normed.address)]
        tail = [Float32(1e-5), Int32(1), Int32(19)]  # eps, normalize, ceil(T / 2 groups)
        step = Step(Int32(tokens), Int64(tag))
    else:
        launch = RejectLaunch(kernel, geometry, KernelTuning(), shared, arch="sm_90a")
        call, head, tail, step = (tag, stream), [], [], Step(Int32(-1), Int64(tag))
    typed = (*head, *structs, step, *tail, cuda.CUstream(stream))
    compiled, seen = launch.compiled, []
    launch.compiled = lambda *args: seen.extend(args)  # what the launch hands the kernel
    launch(*call)
    binder = compiled.execution_args
    want, _ = binder.generate_execution_args(typed, {})
    got, _ = binder.generate_execution_args(tuple(seen), {})
    sizes = parameter_sizes(typed)
    assert len(want) == len(got) == len(sizes), (len(want), len(got), len(sizes))

    def target(pointer, size: int) -> bytes:  # CuTeDSL hands c_void_p or plain addresses
        return ctypes.string_at(getattr(pointer, "value", pointer), size)

    for i, (w, g, size) in enumerate(zip(want, got, sizes)):
        assert target(w, size) == target(g, size), f"{kernel}: parameter {i} differs"


def parameter_sizes(typed) -> list[int]:
    """The bytes of each kernel parameter of typed launch arguments (a struct's fields each)."""
    import dataclasses

    from cutlass import Float32, Int32, Int64

    size = {Int32: 4, Float32: 4, Int64: 8}
    sizes = []
    for arg in typed:
        if dataclasses.is_dataclass(arg):
            sizes += [size[f.type] for f in dataclasses.fields(arg)]
        else:
            sizes.append(size.get(type(arg), 8))  # the stream: a pointer
    return sizes


def test_quantize_launcher_compiles():
    """Mxfp8QuantizeLaunch compiles its kernel without a GPU; its grid is one CTA a row."""
    from dep_ep.comm.kernels.mxfp8_quantize import Mxfp8QuantizeLaunch

    quantize = Mxfp8QuantizeLaunch(64, arch="sm_90a")
    assert quantize.grid(5) == 5
