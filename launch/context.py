"""From a launched process to a rank context: process groups, device binding, DEP groups, teardown.

Lifetimes: `init_rank_context` (collective over the world) -> `new_dep_group` (collective over the
world, once per group size) -> ... -> `teardown` (collective; reverse order of creation).
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import operator
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dep_ep.checks import check_real_between
from dep_ep.launch.env import LaunchEnv, read_launch_env
from dep_ep.launch.store import give_up, group_store

# new_dep_group's size agreement (`_agree_on_size`): the bound of one store call, and how often
# it polls for the other ranks' sizes (once a job, at start-up).
SIZE_STORE_CALL_S = 30.0
SIZE_POLL_S = 0.002
SIZE_GAVE_UP = 1 << 32  # what a rank that gave up sets into the arrivals' counter


@dataclass(frozen=True)
class RankContext:
    """One process's place in the job.

    device: the bound device; several ranks may share one GPU (`local_rank % device_count`).
    group: the world group (NCCL when every local rank has its own GPU, gloo otherwise).
    cpu_group: a gloo group over the world for metadata and host barriers (`group` itself if gloo).
    """

    env: LaunchEnv
    device: torch.device
    backend: str
    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    owns_process_group: bool = True
    timeout_s: float = 300.0  # init_rank_context's: the bound of the context's own waits
    # The groups init_rank_context and new_dep_group made, for teardown (newest last): state of
    # the context, not a constructor argument.
    _created_groups: list = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def local_rank(self) -> int:
        return self.env.local_rank


@dataclass(frozen=True)
class DepGroup:
    """A DEP group: `size` consecutive world ranks [index*size, (index+1)*size).

    group: the device group (NCCL or gloo); cpu_group: gloo over the same ranks (EpBuffers' barriers
    and metadata use this one); rank: this process's rank inside the group.
    """

    index: int
    size: int
    rank: int
    ranks: tuple[int, ...]
    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup


# A gloo worker thread frees a finished collective's tensors after the waiting thread resumed, and
# freeing a tensor made in Python takes the GIL. When the process reaches interpreter finalisation
# before that worker got the GIL, the worker is killed inside a destructor and the process aborts
# with "terminate called without an active exception": 2 of 100 runs of a single-rank script that
# builds EpBuffers and exits without teardown (torch 2.13). At exit the main thread therefore
# sleeps this long, handing the GIL to such a worker: 0 of 300 runs of the same script.
GLOO_WORKER_GRACE_S = 0.01


def _hand_gil_to_gloo_workers() -> None:
    time.sleep(GLOO_WORKER_GRACE_S)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# MPI's start-up (MPI_Init, inside `from mpi4py import MPI`) waits for every rank of the job in C
# code that holds the GIL: no Python thread or signal handler runs until it returns. So its bound
# is faulthandler's watchdog (a C thread): past timeout_s it writes the Python traceback, which
# names the frame `_mpi_start_up_waits_for_every_rank`, to file descriptor STDERR_FD and ends the
# process with _exit(1) (no atexit handler, no flush of Python's buffers). MPICH's mpiexec does
# not end a job whose rank exited with an error, so a rank that died before it (a server refusing
# its arguments) left the others there for ever. The bound is the job's timeout_s, which also
# bounds every collective: a job whose ranks reach MPI_Init more than timeout_s apart needs a
# larger one.
STDERR_FD = 2


def _mpi_start_up_waits_for_every_rank(env: LaunchEnv) -> int:
    """MPI's start-up and rank 0's rendezvous port, broadcast: the port (the function's name is
    what the timeout's traceback shows)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError(
            f"init_rank_context: launched by {env.launcher} without MASTER_ADDR/MASTER_PORT; set"
            " them, or `pip install mpi4py` so rank 0 can publish a rendezvous port"
        ) from None
    return MPI.COMM_WORLD.bcast(_free_port() if env.rank == 0 else None, root=0)


def _rendezvous(env: LaunchEnv, timeout_s: float) -> str:
    """An init_method URL: torchrun's MASTER_ADDR/PORT, or a port agreed through mpi4py, whose
    start-up is bounded by `timeout_s` (faulthandler's watchdog: see STDERR_FD's comment). It
    cancels a `faulthandler.dump_traceback_later` the host had armed (faulthandler keeps one)."""
    if env.master_port is not None:
        return f"tcp://{env.master_addr or '127.0.0.1'}:{env.master_port}"
    if env.master_addr is None and env.local_world_size != env.world_size:
        raise RuntimeError(
            "init_rank_context: a multi-node MPI job needs MASTER_ADDR (rank 0's host) in the"
            " environment"
        )
    faulthandler.dump_traceback_later(timeout_s, exit=True, file=STDERR_FD)
    try:
        port = _mpi_start_up_waits_for_every_rank(env)
    finally:
        faulthandler.cancel_dump_traceback_later()
    return f"tcp://{env.master_addr or '127.0.0.1'}:{port}"


def _bind_device(env: LaunchEnv, device: str) -> tuple[torch.device, bool]:
    """Returns (device, shares_gpu). device: "auto" | "cpu" | "cuda"."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"init_rank_context: device={device!r}; allowed: 'auto', 'cpu', 'cuda'")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu"), False
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError("init_rank_context: device='cuda' but torch sees no CUDA device")
    index = env.local_rank % count
    torch.cuda.set_device(index)
    return torch.device("cuda", index), env.local_world_size > count


def init_rank_context(
    device: str = "auto", *, timeout_s: float = 300.0, env: LaunchEnv | None = None
) -> RankContext:
    """Initialise torch.distributed for this process and bind its device. Collective (world).

    Backend: gloo on CPU and whenever ranks share a GPU (NCCL refuses two ranks on one GPU),
    NCCL otherwise, with a gloo group beside it for metadata. `timeout_s` bounds every collective.
    Reuses a process group the host already initialised (and then leaves its teardown to the host).
    Under an MPI launcher without MASTER_ADDR/MASTER_PORT, MPI's start-up is bounded by `timeout_s`
    too: past it the process writes its traceback (`_mpi_start_up_waits_for_every_rank`) to
    stderr and exits with code 1, since a rank missing from MPI_Init cannot be waited for any
    other way. ValueError for a `timeout_s` that is
    not a number of seconds above 0 and below 1e9.
    """
    timeout_s = check_real_between(
        "init_rank_context", "timeout_s", timeout_s, 0, 1e9, "seconds above 0 and below 1e9"
    )
    env = read_launch_env() if env is None else env
    bound, shares_gpu = _bind_device(env, device)
    backend = "nccl" if bound.type == "cuda" and not shares_gpu else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        kwargs = dict(backend=backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
        if env.world_size == 1:
            dist.init_process_group(store=dist.HashStore(), **kwargs)
        else:
            dist.init_process_group(init_method=_rendezvous(env, timeout_s), **kwargs)
        owned = True
    else:
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise RuntimeError(
                f"init_rank_context: torch.distributed is initialised as rank {dist.get_rank()}"
                f" of {dist.get_world_size()}, the launcher says {env.rank} of {env.world_size}"
            )
        backend = dist.get_backend()
        owned = False
    atexit.unregister(_hand_gil_to_gloo_workers)  # once per process, however many contexts
    atexit.register(_hand_gil_to_gloo_workers)
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    ctx = RankContext(env, bound, backend, world, cpu_group, owned, timeout_s)
    if cpu_group is not world:
        ctx._created_groups.append(cpu_group)
    return ctx


def new_dep_group(ctx: RankContext, size: int) -> DepGroup:
    """Split the world into DEP groups of `size` consecutive ranks; return this rank's.

    Collective over the world (every rank creates every group, in the same order). The ranks
    first compare their `size` (`_agree_on_size`): sizes that differ raise ValueError on every
    rank naming each rank's (ranks that built different groups would wait for each other in
    their first barrier until its timeout, naming no cause).
    """
    _agree_on_size(ctx, size)
    if size < 1 or ctx.world_size % size:
        raise ValueError(f"new_dep_group: size={size} must divide the world size {ctx.world_size}")
    mine = None
    for index in range(ctx.world_size // size):
        ranks = tuple(range(index * size, (index + 1) * size))
        if size == ctx.world_size:
            group, cpu_group = ctx.group, ctx.cpu_group
        else:
            group = dist.new_group(list(ranks), backend=ctx.backend)
            cpu_group = group if ctx.backend == "gloo" else dist.new_group(list(ranks), "gloo")
            ctx._created_groups.append(group)
            if cpu_group is not group:
                ctx._created_groups.append(cpu_group)
        if ctx.rank in ranks:
            mine = DepGroup(index, size, ctx.rank - ranks[0], ranks, group, cpu_group)
    assert mine is not None
    return mine


def _agree_on_size(ctx: RankContext, size: object) -> None:
    """Every rank's `size` through the world's store, as the library's host barriers exchange
    (launch/store.py: polled, so a signal takes effect at once; bounded by the context's
    timeout_s; nothing on the gloo connections). A counter of arrivals decides alone, as the
    barriers' does (comm/host_channel.py): a rank at its deadline sets a give-up into it by
    compare-and-set while a rank is missing, so every rank returns or every rank raises
    TimeoutError. ValueError on every rank when the sizes differ."""
    if ctx.world_size == 1:
        return
    try:
        mine = str(operator.index(size))  # np.int64(4) and 4 are one size
    except TypeError:
        mine = repr(size)  # refused below, on every rank alike
    store = group_store(ctx.cpu_group, SIZE_STORE_CALL_S)
    call = store.add(f"dep-ep/dep-group-calls/{ctx.rank}", 1)  # this rank's call number
    keys = [f"dep-ep/dep-group-size/{call}/{r}" for r in range(ctx.world_size)]
    arrived = f"dep-ep/dep-group-size/{call}/arrived"
    store.set(keys[ctx.rank], mine)
    counter = store.add(arrived, 1)
    deadline = time.monotonic() + ctx.timeout_s
    while counter != ctx.world_size:
        if counter >= SIZE_GAVE_UP:
            raise TimeoutError(
                f"new_dep_group (rank {ctx.rank}): another rank gave up waiting for the others"
                " to call it (its timeout_s)"
            )
        if time.monotonic() >= deadline:
            counter, gave_up = give_up(
                store, arrived, counter, ctx.world_size, SIZE_GAVE_UP, SIZE_GAVE_UP
            )
            if gave_up:
                missing = [r for r, key in enumerate(keys) if not store.check([key])]
                raise TimeoutError(
                    f"new_dep_group (rank {ctx.rank}): rank(s) {', '.join(map(str, missing))}"
                    f" did not call it within {ctx.timeout_s:g} s"
                )
            continue  # every rank arrived, or another gave up: the loop's test says which
        time.sleep(SIZE_POLL_S)
        counter = store.add(arrived, 0)
    sizes = [value.decode() for value in store.multi_get(keys)]
    if len(set(sizes)) > 1:
        by_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(sizes))
        raise ValueError(
            f"new_dep_group: the ranks asked for DEP groups of different sizes ({by_rank}); every"
            " rank must pass the same size"
        )


def teardown(ctx: RankContext) -> None:
    """Destroy what `init_rank_context` and `new_dep_group` created, newest first. Collective.

    Close every EpBuffers/EpRouted before this. A process group the host created stays.
    """
    if not dist.is_initialized():
        return
    for group in reversed(ctx._created_groups):
        dist.destroy_process_group(group)
    ctx._created_groups.clear()
    if ctx.owns_process_group:
        dist.destroy_process_group()
