"""The CuTeDSL kernels compile for Hopper (sm_90a) and Blackwell (sm_100a) without a GPU, and the
PTX holds what the protocol relies on: 16-byte vector stores, system-scope release/acquire,
bounded waits on %globaltimer, exact-rounding arithmetic, no local-memory spills."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import cutlass  # noqa: F401

    from dep_ep.comm.device_transport import compile_kernels, compiled_count
except ImportError as err:  # the test extra installs CuTeDSL: missing it is a failure, not a skip
    raise ImportError(f"tests/test_kernels_compile.py needs nvidia-cutlass-dsl: {err}") from err

# A launch signals its step: every CTA fences its payload at system scope and counts itself done
# (acquire-release add at GPU scope: every CTA is on this GPU); the last one stores the step flag
# with release semantics at system scope, which the peers acquire.
SIGNALS = [r"fence\.acq_rel\.sys", r"atom\.global\.acq_rel\.add", r"st\.release\.sys\.global"]
# A bounded wait: acquire loads at system scope against %globaltimer.
WAITS = [r"ld\.acquire\.sys", r"%globaltimer"]
REQUIRED = {
    "dispatch": [r"st\.global\.v4\.b32", r"ld\.global\.v4\.b32", *SIGNALS, *WAITS,
                 r"cvt\.rn\.satfinite\.e4m3x2\.f32", r"mul\.rn\.f32"],
    "combine": [r"st\.global\.v4\.b32", r"ld\.global\.v4\.b32", *SIGNALS, *WAITS,
                r"sqrt\.rn\.f32", r"div\.rn\.f32", r"shfl\.sync", r"bar\.red\.or\.pred"],
    "combine_send": [r"st\.global\.v4\.b32", r"ld\.global\.v4\.b32", *SIGNALS],
    "combine_reduce": [r"ld\.global\.v4\.b32", *WAITS, r"sqrt\.rn\.f32", r"div\.rn\.f32",
                       r"shfl\.sync", r"bar\.red\.or\.pred"],
    # A rank that rejects its input still signals both phases (flags only) and waits, bounded.
    "reject_dispatch": [r"st\.release\.sys\.global", *WAITS],
    "reject_combine": [r"st\.release\.sys\.global", *WAITS],
}  # fmt: skip
FORBIDDEN = [r"\.local", r"fma\.rn\.f32"]  # spills; a contracted multiply-add breaks bit-exactness
# The split combine's send launch may take any grid only because it never waits.
NEVER_WAITS = {"combine_send": [r"ld\.acquire", r"%globaltimer"]}


@pytest.fixture(scope="module", params=["sm_90a", "sm_100a"])
def ptx(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    kernels = compile_kernels(num_ranks=8, latent=3584, topk=16, experts_per_rank=112,
                              arch=request.param, keep_ptx_dir=str(folder))  # fmt: skip
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
    present = [p for p in FORBIDDEN + NEVER_WAITS.get(kernel, []) if re.search(p, text)]
    assert not present, f"{kernel} ({arch}) PTX holds {present}"


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
