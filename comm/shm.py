"""POSIX shared-memory symmetric allocation for CPU ranks: one file per rank, mapped by every rank.

Each rank creates `/dev/shm/dep-ep-<job>-<rank>`, reserves its pages (posix_fallocate: a tmpfs
too small fails here with ENOSPC, not with a SIGBUS at the first large step), every rank maps
every file, and each rank unlinks its own file as soon as all ranks have mapped it: the memory
lives on in the mappings, and no file is left when a rank dies later (even by SIGKILL). Between
the creation and that unlink, SIGTERM and SIGHUP unlink the job's files before the process
takes the signal (torchrun forwards SIGTERM to its workers), and any exception unlinks them too.
Only a SIGKILL inside that window (two barriers long) can leave a file.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import threading
from contextlib import contextmanager

import torch

from dep_ep.comm.errors import EpPeerError, error_text
from dep_ep.comm.host_channel import ObjectBarriers

SHM_DIR = "/dev/shm"
SHM_PREFIX = "dep-ep-"
GUARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _path(shm_dir: str, job: str, rank: int) -> str:
    return os.path.join(shm_dir, f"{SHM_PREFIX}{job}-{rank}")


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


@contextmanager
def _unlink_on_signal(paths: list[str]):
    """While inside: SIGTERM and SIGHUP first unlink `paths`, then act as they did before (the
    default action, or the handler the host installed). Only the main thread can install
    handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def handler(signum, frame):
        _unlink_all(paths)
        before = previous[signum]
        signal.signal(signum, before)
        if callable(before):
            before(signum, frame)
        else:  # SIG_DFL (or SIG_IGN, which then ignores it): deliver it again as it was
            os.kill(os.getpid(), signum)

    for signum in GUARDED_SIGNALS:
        previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)


def check_capacity(shm_dir: str, num_ranks: int, nbytes: int) -> OSError | None:
    """ENOSPC naming what is needed when `shm_dir` lacks room for every rank's segment (the
    ranks of a CPU group share one host, hence one /dev/shm), else None."""
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    need = num_ranks * nbytes
    if free >= need:
        return None
    mib = 2**20
    size_gib = max(1, math.ceil(need * 1.25 / 2**30))
    return OSError(
        errno.ENOSPC,
        f"EpRouted: {shm_dir} has {free / mib:.0f} MiB free; the {num_ranks} ranks' buffers need"
        f" {need / mib:.0f} MiB ({nbytes / mib:.1f} MiB each). Give it more room (Docker: run"
        f" with --shm-size={size_gib}g; elsewhere: mount -o remount,size={size_gib}G {shm_dir})"
        " or build the EpRouted with a smaller max_tokens",
    )


def allocate_shm(
    barriers: ObjectBarriers,
    rank: int,
    num_ranks: int,
    nbytes: int,
    *,
    job: str,
    timeout_s: float,
    shm_dir: str = SHM_DIR,
) -> list[torch.Tensor]:
    """Collective: every rank gets `num_ranks` uint8 tensors of `nbytes`, entry r mapping rank r's
    segment (entry `rank` is this rank's own). Contents start zeroed. Blocks the host. `job` is a
    tag every rank agreed on (comm/agreement.py), unique to this allocation; `barriers` the
    object's host barriers. A rank that cannot create or map its segment raises its OSError and
    every other rank EpPeerError naming it; every file of the job is unlinked."""
    paths = [_path(shm_dir, job, r) for r in range(num_ranks)]
    # Every rank checks the room before any rank takes some, so all see the same free space.
    _exchange_errors(barriers, "shm-check", check_capacity(shm_dir, num_ranks, nbytes), timeout_s)
    with _unlink_on_signal(paths):
        try:
            _exchange_errors(barriers, "shm-create", _create(paths[rank], nbytes), timeout_s)
            segments, error = [], None
            try:
                segments = [
                    torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
                    for path in paths
                ]
            except (OSError, RuntimeError) as err:
                error = err
            _exchange_errors(barriers, "shm-map", error, timeout_s)
        except BaseException:
            _unlink_all(paths)
            raise
        os.unlink(paths[rank])
    return segments


def _create(path: str, nbytes: int) -> OSError | None:
    """Create and reserve this rank's segment; its error, or None."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            err = OSError(
                errno.ENOSPC,
                f"EpRouted: no room to reserve {nbytes / 2**20:.1f} MiB for {path} ({err});"
                " another process may hold the space. Docker: run with a larger --shm-size",
            )
        return err
    return None


def _exchange_errors(barriers: ObjectBarriers, phase: str, error, timeout_s: float) -> None:
    """A barrier carrying each rank's error: this rank raises its own, else EpPeerError naming
    the ranks that failed."""
    text = None if error is None else error_text(error)
    messages = barriers.exchange(phase, {"error": text}, timeout_s)
    if error is not None:
        raise error
    failed = {r: m["error"] for r, m in enumerate(messages) if m["error"]}
    if failed:
        named = "; ".join(f"rank {r}: {text}" for r, text in failed.items())
        raise EpPeerError(f"EpRouted ({phase}): rank(s) {sorted(failed)} failed ({named})")
