import pytest


@pytest.fixture(scope="session")
def dep():
    """The DEP group of every rank of this mpiexec job (gloo, CPU). Session-wide: one init."""
    from dep_ep.launch import init_rank_context, new_dep_group, teardown

    ctx = init_rank_context("cpu", timeout_s=120.0)
    yield new_dep_group(ctx, ctx.world_size)
    teardown(ctx)
