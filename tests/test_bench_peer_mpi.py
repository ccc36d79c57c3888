"""bench_dep.py's peer (bench/peer_one_sided.py): a failure on any rank turns it off on every rank
with the reason, never leaving a rank alone in FlashInfer's collectives."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from bench import peer_one_sided


def fake_flashinfer(monkeypatch, jit):
    """A `flashinfer` package holding the modules create() imports, in sys.modules for the test:
    `jit()` is its JIT build; construction finds no BootstrapConfig."""
    names = [
        "flashinfer",
        "flashinfer.comm",
        "flashinfer.comm.mnnvl",
        "flashinfer.fused_moe",
        "flashinfer.fused_moe.api",
        "flashinfer.moe_ep",
    ]
    kernels = "flashinfer.moe_ep.backends.split.comm.nvlink_one_sided.kernels"
    parts = kernels.split(".")
    names += [".".join(parts[: i + 1]) for i in range(1, len(parts))]
    for name in dict.fromkeys(names):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        parent, _, child = name.rpartition(".")
        if parent:  # `import a.b.c as m` looks the child up on its parent
            setattr(sys.modules[parent], child, sys.modules[name])
    sys.modules[kernels].get_nvlink_one_sided_alltoall_module = jit
    sys.modules["flashinfer.fused_moe.api"].QuantFormat = types.SimpleNamespace(MXFP8="mxfp8")
    # flashinfer.moe_ep holds no BootstrapConfig: construction fails with an ImportError.


def create(dep):
    return peer_one_sided.OneSidedPeer.create(
        dep.cpu_group, dep.rank, dep.size, torch.device("cpu"), 16, latent=64, topk=4, experts=8
    )


@pytest.mark.mpi(min_size=2)
def test_jit_failure_on_one_rank_turns_the_peer_off_everywhere(dep, monkeypatch):
    def jit():
        if dep.rank == 1:
            raise RuntimeError("nvcc: cublasLt.h not found")

    fake_flashinfer(monkeypatch, jit)
    peer, why_not = create(dep)
    assert peer is None
    if dep.rank == 1:
        assert why_not == "import/JIT: RuntimeError: nvcc: cublasLt.h not found", why_not
    else:
        assert why_not == "failed on another rank", why_not


@pytest.mark.mpi(min_size=2)
def test_construction_failure_on_every_rank_names_it(dep, monkeypatch):
    fake_flashinfer(monkeypatch, lambda: None)  # JIT fine; the flashinfer.moe_ep import fails
    peer, why_not = create(dep)
    assert peer is None
    want = "create_communication: ImportError: cannot import name 'BootstrapConfig'"
    assert why_not.startswith(want), why_not


@pytest.mark.mpi(min_size=2)
def test_bad_handles_raise_before_any_collective(dep):
    with pytest.raises(ValueError, match="handles must be one of"):
        peer_one_sided.OneSidedPeer.create(
            dep.cpu_group,
            dep.rank,
            dep.size,
            torch.device("cpu"),
            16,
            latent=64,
            topk=4,
            experts=8,
            handles="fabric",
        )
