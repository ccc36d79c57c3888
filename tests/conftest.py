import pytest


@pytest.fixture(scope="session")
def ctx():
    """The rank context of this mpiexec job (gloo, CPU). Session-wide: one init."""
    from dep_ep.launch import init_rank_context, teardown

    ctx = init_rank_context("cpu", timeout_s=120.0)
    yield ctx
    teardown(ctx)


@pytest.fixture(scope="session")
def dep(ctx):
    """The DEP group of every rank of this mpiexec job: the whole world."""
    from dep_ep.launch import new_dep_group

    return new_dep_group(ctx, ctx.world_size)
