"""NVSHMEM bootstrap bookkeeping (launch/nvshmem.py) against a fake nvshmem.core: initialise
from a unique id when nobody has, reuse what the host initialised, finalize only our own; the
ImportError of missing GPU packages gives the pip line. The real library ran on the H200 (GPU
suite); this checks the branches a single machine cannot reach."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch.distributed as dist

import dep_ep.launch.nvshmem as boot


class FakeNvshmem(types.SimpleNamespace):
    def __init__(self, status: int, pes: int):
        super().__init__(calls=[], status=status, pes=pes)

    def init_status(self):
        return self.status

    def n_pes(self):
        return self.pes

    def get_unique_id(self, empty=False):
        self.calls.append(("uid", empty))
        return types.SimpleNamespace(_data=np.zeros(128, dtype=np.int8))

    def init(self, device, uid, rank, nranks, initializer_method):
        self.calls.append(("init", rank, nranks, initializer_method))
        self.status = 2

    def finalize(self):
        self.calls.append(("finalize",))


@pytest.fixture
def group(monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setattr(boot, "_device", lambda index: None)
    monkeypatch.setitem(boot._state, "users", 0)
    monkeypatch.setitem(boot._state, "created", False)
    yield dist.group.WORLD
    dist.destroy_process_group()


def share_alone(uid):
    """The unique-id sharing of a one-rank group: rank 0's bytes come back (every rank calls)."""
    share_alone.calls.append(uid)
    return uid if uid is not None else b""


share_alone.calls = []


def install(monkeypatch, fake):
    package = types.ModuleType("nvshmem")
    package.core = fake
    monkeypatch.setitem(sys.modules, "nvshmem", package)
    monkeypatch.setitem(sys.modules, "nvshmem.core", fake)


def test_initialises_from_a_unique_id_and_finalizes_its_own(monkeypatch, group):
    fake = FakeNvshmem(status=0, pes=1)
    install(monkeypatch, fake)
    import torch

    share_alone.calls.clear()
    assert boot.acquire_nvshmem(group, torch.device("cuda", 0), share_alone) == [0]
    assert boot.acquire_nvshmem(group, torch.device("cuda", 0), share_alone) == [0]  # reuse
    assert fake.calls == [("uid", False), ("init", 0, 1, "uid")]
    # Every call shares (a collective on every rank): the id's bytes, then None once initialised.
    assert [len(c) if c is not None else None for c in share_alone.calls] == [128, None]
    boot.release_nvshmem()
    assert ("finalize",) not in fake.calls  # one user left
    boot.release_nvshmem()
    assert fake.calls[-1] == ("finalize",)


def test_reuses_the_hosts_nvshmem_and_leaves_it(monkeypatch, group):
    fake = FakeNvshmem(status=2, pes=1)
    install(monkeypatch, fake)
    import torch

    assert boot.acquire_nvshmem(group, torch.device("cuda", 0), share_alone) == [0]
    boot.release_nvshmem()
    assert fake.calls == []  # no init, no finalize


def test_refuses_a_host_nvshmem_of_another_size(monkeypatch, group):
    install(monkeypatch, FakeNvshmem(status=2, pes=4))
    import torch

    with pytest.raises(RuntimeError, match="4 PEs"):
        boot.acquire_nvshmem(group, torch.device("cuda", 0), share_alone)


def test_missing_packages_name_the_pip_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvshmem", None)
    monkeypatch.setitem(sys.modules, "nvshmem.core", None)
    with pytest.raises(ImportError, match="pip install 'nvshmem4py-cu13"):
        boot.import_nvshmem()
    from dep_ep.comm import device_transport

    monkeypatch.setitem(sys.modules, "cutlass", None)
    monkeypatch.setitem(sys.modules, "cutlass.cute", None)
    with pytest.raises(ImportError, match="pip install"):
        device_transport.import_cute()
