"""GPU suite: run on a CUDA machine under mpiexec (several processes may share one GPU):
    mpiexec -n 2 python -m pytest -q --with-mpi tests/gpu
The CPU CI does not collect this folder (tests/gpu is excluded by the runner)."""

import pytest
import torch


@pytest.fixture(scope="session")
def gpu_dep():
    from dep_ep.launch import init_rank_context, new_dep_group, teardown

    if not torch.cuda.is_available():
        pytest.fail("tests/gpu needs a CUDA device")
    ctx = init_rank_context("cuda", timeout_s=300.0)
    yield new_dep_group(ctx, ctx.world_size)
    teardown(ctx)
