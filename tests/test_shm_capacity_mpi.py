"""A /dev/shm too small for the buffers is an error at construction on every rank, saying how
much is needed and how to raise the limit, never a SIGBUS at the first large step (CPU ranks,
2-4 under mpiexec). The free space is faked (os.statvfs) and one rank's reservation refused
(os.posix_fallocate raising ENOSPC): CI cannot shrink its /dev/shm.

Before (main at 6f889cd, run once with this file as it is): both constructions succeeded."""

from __future__ import annotations

import errno
import os

import pytest

from dep_ep.comm.errors import EpPeerError
from dep_ep.comm.layout import EpLayout
from dep_ep.config import TINY, EpConfig
from dep_ep.ep import EpRouted

from helpers.collective import collective_assert, expect_raises


def build(dep, max_tokens: int = 16, geometry=TINY) -> EpRouted:
    return EpRouted(
        dep.cpu_group,
        max_tokens,
        "cpu",
        num_experts=geometry.experts,
        latent=geometry.latent,
        topk=geometry.topk,
        config=EpConfig(timeout_s=10.0),
    )


class SmallShm:
    """os.statvfs answering `free_bytes` free for /dev/shm, the truth elsewhere."""

    def __init__(self, free_bytes: int):
        self.real, self.free_bytes = os.statvfs, free_bytes

    def __call__(self, path):
        st = self.real(path)
        if os.path.realpath(path) != "/dev/shm":
            return st
        fields = list(st)
        fields[4] = fields[3] = self.free_bytes // st.f_frsize  # f_bfree, f_bavail
        return os.statvfs_result(fields)


@pytest.mark.mpi(min_size=2)
def test_too_small_a_shm_is_refused_on_every_rank(dep, monkeypatch):
    """Half the room the job's segments need (as 64 MB, Docker's default, is for K3 at 8 ranks
    and 256 tokens, which needs 172 MiB): every rank raises OSError (ENOSPC) naming the MiB the
    job needs and how to raise /dev/shm; then a fitting EpRouted builds."""
    failures: list[str] = []
    need = dep.size * EpLayout(dep.size, 16, TINY.latent, TINY.topk).total_bytes
    monkeypatch.setattr(os, "statvfs", SmallShm(need // 2))
    err = expect_raises(failures, "half the room in /dev/shm", OSError, "MiB", lambda: build(dep))
    if err is not None and not ("--shm-size" in str(err) and err.errno == errno.ENOSPC):
        failures.append(f"the error does not say how to raise /dev/shm: {err}")
    monkeypatch.undo()
    with build(dep):
        pass
    collective_assert(dep.cpu_group, failures, seeds=None)


@pytest.mark.mpi(min_size=2)
def test_a_reservation_refused_on_one_rank(dep, monkeypatch):
    """The last rank's reservation of its segment fails (ENOSPC, as when another job took the
    space between the check and the reservation): OSError there, EpPeerError on the others."""
    failures: list[str] = []
    bad = dep.rank == dep.size - 1
    if bad:

        def refuse(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", refuse)
    expected = OSError if bad else EpPeerError
    expect_raises(failures, "reservation refused", expected, None, lambda: build(dep))
    monkeypatch.undo()
    with build(dep):
        pass
    collective_assert(dep.cpu_group, failures, seeds=None)
