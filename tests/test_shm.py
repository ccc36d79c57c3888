"""Shared-memory buffers leave no file behind: after setup, on close, and when a rank is killed."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from dep_ep.comm.shm import SHM_DIR, SHM_PREFIX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ours() -> set[str]:
    return set(glob.glob(os.path.join(SHM_DIR, SHM_PREFIX + "*")))


def run_child(body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(
        """
        import os, signal, torch
        from dep_ep.launch import init_rank_context, new_dep_group
        from dep_ep.comm import EpBuffers
        from dep_ep.launch import LaunchEnv
        ctx = init_rank_context("cpu", env=LaunchEnv("single", 0, 1, 0, 1, None, None))
        dep = new_dep_group(ctx, 1)
        buf = EpBuffers(dep.cpu_group, 1, 0, 8, "cpu", latent=64, topk=2)
        """
    ) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("ending", ["close", "sigkill", "exception"])
def test_no_leftover_files(ending):
    before = ours()
    body = {
        "close": "buf.x(4)[:] = 7; assert int(buf.peers[0].x(4)[3, 5]) == 7; buf.close()",
        "sigkill": "os.kill(os.getpid(), signal.SIGKILL)",
        "exception": "raise SystemExit(3)",
    }[ending]
    proc = run_child(body)
    expected_rc = {"close": 0, "sigkill": -9, "exception": 3}[ending]
    assert proc.returncode == expected_rc, proc.stderr[-2000:]
    assert ours() - before == set()


def test_views_after_close_raise():
    proc = run_child("buf.close()\ntry:\n    buf.x(1)\nexcept RuntimeError as e:\n    print(e)\n")
    assert proc.returncode == 0 and "closed" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    # The peers' regions too: an empty list after close() made a combine sum no rank (zeros).
    proc = run_child("buf.close()\ntry:\n    buf.peers\nexcept RuntimeError as e:\n    print(e)\n")
    assert "EpBuffers.peers: the buffers were closed" in proc.stdout, proc.stderr[-2000:]


def test_buffers_reject_wrong_rank_arguments():
    assert not dist.is_initialized()
    proc = run_child(
        "try:\n    EpBuffers(dep.cpu_group, 2, 0, 8, 'cpu', latent=64, topk=2)\n"
        "except ValueError as e:\n    print(e)\n"
    )
    assert "ranks=2" in proc.stdout, proc.stdout + proc.stderr[-2000:]
