"""Two-GPU ping-pong: the latency floor of one NVLink store + flag round trip.

    torchrun --nproc-per-node 2 -m bench.pingpong     # writes docs/results/pingpong.md
    (or mpirun -n 2 ...; with more ranks, ranks 0 and 1 play and the others idle)

One thread on each of the two GPUs; the flags are int64 words in NVSHMEM symmetric memory.
Round i: rank 0 stores the value base+i into rank 1's flag with a release store at system scope
and spins (acquire, system scope, bounded by %globaltimer) until its own flag reaches base+i;
rank 1 waits for its flag, then stores base+i into rank 0's. One launch plays `rounds` rounds;
the time per round is the round trip (two one-way store + flag latencies). Medians over launches
timed with CUDA events on rank 0. Two processes sharing one GPU are time-sliced: their numbers
measure the scheduler, not NVLink (the script says so when it sees it).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
import torch.distributed as dist
from cutlass import Int32, Int64

from bench import cli, report
from dep_ep.comm.errors import EpTimeoutError
from dep_ep.comm.kernels.launch_args import RankControl
from dep_ep.comm.kernels.signals import wait_flag
from dep_ep.comm.kernels.tensors import element_ptr, gmem_tensor
from dep_ep.comm.nvshmem_alloc import allocate_nvshmem, free_nvshmem
from dep_ep.constants import (
    ERROR_COMPLETE,
    ERROR_PEER,
    ERROR_STATUS,
    ERROR_WORDS,
    FLAG_CALL,
    FLAG_WORDS,
    STATE_WORDS,
)
from dep_ep.launch import init_rank_context, teardown

PHASE_PINGPONG = 3


class PingPongKernel:
    """One CTA of one warp; thread 0 plays `rounds` rounds (see the module docstring)."""

    @cute.jit
    def __call__(
        self,
        my_slot: Int64,
        peer_slot: Int64,
        base: Int64,
        rounds: Int32,
        initiator: Int32,
        control: RankControl,
        peer: Int32,
        stream: cuda.CUstream,
    ):
        mMine = gmem_tensor(Int64, my_slot, cute.make_layout(FLAG_WORDS))
        mPeer = gmem_tensor(Int64, peer_slot, cute.make_layout(FLAG_WORDS))
        self.kernel(mMine, mPeer, base, rounds, initiator, control, peer).launch(
            grid=[1, 1, 1], block=[32, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mMine: cute.Tensor,
        mPeer: cute.Tensor,
        base: Int64,
        rounds: Int32,
        initiator: Int32,
        control: RankControl,
        peer: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            for i in cutlass.range(rounds):
                value = base + Int64(i) + 1
                if initiator != 0:
                    cute.arch.store(
                        element_ptr(mPeer, FLAG_CALL), value, sem="release", scope="sys"
                    )
                    wait_flag(mMine, value, control, PHASE_PINGPONG, peer)
                else:
                    wait_flag(mMine, value, control, PHASE_PINGPONG, peer)
                    cute.arch.store(
                        element_ptr(mPeer, FLAG_CALL), value, sem="release", scope="sys"
                    )


def main() -> int:
    p = cli.parser(__doc__, page="pingpong.md")
    p.add_argument("--rounds", type=int, default=1000, help="round trips per launch")
    p.add_argument("--launches", type=int, default=30, help="timed launches (median)")
    p.add_argument("--timeout-s", type=float, default=10.0, help="a flag's wait bound, seconds")
    args = p.parse_args()
    ctx = init_rank_context("cuda", timeout_s=120.0)
    group, rank = ctx.cpu_group, ctx.rank
    if ctx.world_size < 2:
        raise SystemExit("bench.pingpong: needs 2 ranks (torchrun --nproc-per-node 2)")
    nbytes = 256
    flags = allocate_nvshmem(group, rank, ctx.world_size, nbytes, ctx.device)
    playing = rank < 2
    same_gpu = ctx.backend == "gloo"  # init_rank_context picks gloo when ranks share a GPU
    state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=ctx.device)  # its abort word
    error = torch.zeros(ERROR_WORDS, dtype=torch.int64).pin_memory()
    control = RankControl(
        Int64(state.data_ptr()),
        Int64(error.data_ptr()),
        Int32(rank),
        Int64(int(args.timeout_s * 1e9)),
    )
    kernel = cute.compile(
        PingPongKernel(),
        Int64(0),
        Int64(0),
        Int64(0),
        Int32(1),
        Int32(0),
        control,
        Int32(0),
        cuda.CUstream(0),
    )
    peer = 1 - rank if playing else rank
    my_flag, peer_flag = flags[rank].data_ptr(), flags[peer].data_ptr()
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    base, times = 0, []
    for launch in range(args.launches + 2):
        dist.barrier(group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if playing:
            kernel(my_flag, peer_flag, base, args.rounds, int(rank == 0), control, peer, stream)
        end.record()
        end.synchronize()
        if int(error[ERROR_STATUS]) == ERROR_COMPLETE:
            raise EpTimeoutError(
                rank, "pingpong", f"rank {int(error[ERROR_PEER])}", "flag never came", remedy=""
            )
        base += args.rounds
        if launch >= 2:  # two warm-up launches
            times.append(start.elapsed_time(end) * 1e3 / args.rounds)
    dist.barrier(group)
    if rank == 0:
        rtt = statistics.median(times)
        print(
            f"round trip {rtt:.2f} us (one way {rtt / 2:.2f} us), {args.rounds} rounds x"
            f" {args.launches} launches"
            + (" [ranks share one GPU: time-sliced]" if same_gpu else ""),
            flush=True,
        )
        write_report(args.out, rtt, times, same_gpu)
    free_nvshmem(flags[rank])
    teardown(ctx)
    return 0


def write_report(
    out: Path, rtt: float, times: list[float], same_gpu: bool, run: report.Run | None = None
) -> Path:
    """OUTDIR/pingpong.md: the median round trip `rtt` and the per-launch `times` (us a round)."""
    run = run or report.Run.this_process(2)
    title = "Ping-pong: one NVLink store + flag round trip"
    page = report.Page(out / "pingpong.md", title, report.summary(__doc__), run)
    page.text(
        "Release store of a flag into the peer's NVSHMEM memory, acquire spin on the own flag"
        " (system scope), one thread per GPU; per round: rank 0 -> rank 1 -> rank 0.",
    )
    page.table(
        ["", "us"],
        [
            (f"round trip (median of {len(times)} launches)", f"{rtt:.2f}"),
            ("one way", f"{rtt / 2:.2f}"),
            ("min / max launch", f"{min(times):.2f} / {max(times):.2f}"),
        ],
    )
    if same_gpu:
        page.text("Both ranks shared ONE GPU (time-sliced): this is the scheduler, not NVLink.")
    return page.write()


if __name__ == "__main__":
    sys.exit(main())
