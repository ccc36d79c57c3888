import pytest
import torch

from dep_ep.launch.context import RankContext
from dep_ep.launch.env import read_launch_env


def test_torchrun():
    env = read_launch_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "29500",
        }
    )
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == (
        "torchrun",
        3,
        8,
        1,
        4,
    )
    assert (env.master_addr, env.master_port) == ("h", 29500)


def test_openmpi():
    env = read_launch_env(
        {
            "OMPI_COMM_WORLD_RANK": "5",
            "OMPI_COMM_WORLD_SIZE": "6",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert (env.launcher, env.rank, env.local_rank, env.master_port) == ("openmpi", 5, 1, None)


def test_mpich_without_local_vars():
    env = read_launch_env({"PMI_RANK": "2", "PMI_SIZE": "4"})
    assert (env.launcher, env.rank, env.local_rank, env.local_world_size) == ("mpich", 2, 2, 4)


def test_single_process():
    env = read_launch_env({})
    assert (env.launcher, env.rank, env.world_size) == ("single", 0, 1)


@pytest.mark.parametrize(
    "environ, match",
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "rank=4"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x'"),
        ({"RANK": "0"}, "WORLD_SIZE is not set"),
    ],
)
def test_bad_environment(environ, match):
    with pytest.raises(ValueError, match=match):
        read_launch_env(environ)


def test_rank_context_takes_no_private_arguments():
    """The groups teardown destroys are the context's own: no caller passes them, and every
    context starts with an empty list of its own."""
    env = read_launch_env({})
    args = (env, torch.device("cpu"), "gloo", None, None)
    with pytest.raises(TypeError, match="_created_groups"):
        RankContext(*args, _created_groups=["a group"])
    with pytest.raises(TypeError):
        RankContext(*args, True, 300.0, ["a group"])
    a, b = RankContext(*args), RankContext(*args)
    assert a._created_groups == [] and a._created_groups is not b._created_groups
    assert "_created_groups" not in repr(a) and a == b


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf"), 1e9, "60", True])
def test_init_rank_context_refuses_a_timeout_that_is_no_number_of_seconds(timeout_s):
    """Before: accepted, and a job ended in a raw traceback from the store's timedelta (0, -1:
    "timed out after 0ms", nan: "cannot convert float NaN", inf: OverflowError)."""
    from dep_ep.launch import init_rank_context

    with pytest.raises(ValueError, match=r"init_rank_context: timeout_s=.*above 0 and below 1e9"):
        init_rank_context("cpu", timeout_s=timeout_s)


def agree_in_threads(monkeypatch, plans) -> list:
    """new_dep_group's size agreement on ranks that are threads of this process, on one store:
    `plans` gives each rank's (delay, timeout_s, size). Returns each rank's exception or None."""
    import threading
    import time
    import types

    import torch.distributed as dist

    from dep_ep.launch import context

    store = dist.HashStore()
    monkeypatch.setattr(context, "group_store", lambda group, call_s: store)
    results: list = [None] * len(plans)

    def rank(r: int) -> None:
        delay, timeout_s, size = plans[r]
        ctx = types.SimpleNamespace(rank=r, world_size=len(plans), cpu_group=None)
        ctx.timeout_s = timeout_s
        time.sleep(delay)
        try:
            context._agree_on_size(ctx, size)
        except Exception as err:  # compared by the caller
            results[r] = err

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(plans))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_dep_group_sizes_agree_or_every_rank_raises(monkeypatch):
    """The same size (as int or numpy int): every rank returns. Different sizes: ValueError on
    every rank naming each. A rank later than another's timeout: TimeoutError on both (the late
    rank finds every size there, and raises all the same)."""
    import numpy as np

    assert agree_in_threads(monkeypatch, [(0, 5.0, 4), (0.05, 5.0, np.int64(4))]) == [None, None]
    errors = agree_in_threads(monkeypatch, [(0, 5.0, 2), (0.05, 5.0, 4)])
    assert all(isinstance(e, ValueError) and "rank 0: 2, rank 1: 4" in str(e) for e in errors)
    early, late = agree_in_threads(monkeypatch, [(0, 0.2, 2), (0.5, 5.0, 2)])
    assert isinstance(early, TimeoutError) and "rank(s) 1 did not call it" in str(early), early
    assert isinstance(late, TimeoutError) and "another rank gave up" in str(late), late
