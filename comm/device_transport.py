"""DeviceTransport: dispatch and combine between CUDA ranks over NVSHMEM, with CuTeDSL kernels.

Composes the kernels' launchers (comm/kernels/: DispatchLaunch, CombineLaunch, RejectLaunch, each
beside its kernel with its compile, grid rule, launch parameters and constraints), built at
construction (before any graph capture; the compiled kernels are cached per geometry and
process, and T is a runtime argument, so no compile per token count); keeps the device state
(the calls done, the step status, the launches' CTA counters, the abort word) and the
host-mapped error record, and launches on the current stream. No host synchronisation and no
memset between calls: every launch can be captured in a CUDA graph (a call's tag is a launch
argument: a graph replays the tag it was captured with).
"""

from __future__ import annotations

import time

import torch

from dep_ep.comm.buffers import EpBuffers
from dep_ep.comm.errors import (
    MISALIGNED,
    RECOVERY_RESET,
    EpDesyncError,
    EpPeerError,
    EpPeerLostError,
    EpTimeoutError,
    EpTokenCountError,
    ranks_text,
    tag_text,
    tags_differ_text,
)

# compiled_count: the process's compile cache's size, read here by the tests and benchmarks.
from dep_ep.comm.failure import StepFailure, failure_error, new_record
from dep_ep.comm.kernels.launcher import REJECT_KERNELS
from dep_ep.comm.kernels.launcher import compiled_count as compiled_count
from dep_ep.comm.layout import EpLayout
from dep_ep.comm.peer_watch import PeerWatch
from dep_ep.comm.tags import first_piece
from dep_ep.comm.transport import (
    CAUSE_EXPERTS,
    CAUSE_INPUT,
    CAUSE_UNUSABLE,
    EXPERT_CAUSES,
    Transport,
)
from dep_ep.config import EpConfig
from dep_ep.constants import (
    ABORT_PEER_LOST,
    ABORT_PEER_RESET,
    ABORT_RESET,
    ERROR_ABORT,
    ERROR_CALL,
    ERROR_COMPLETE,
    ERROR_KERNEL_WORDS,
    ERROR_KIND,
    ERROR_MINE,
    ERROR_PEER,
    ERROR_PHASE,
    ERROR_RANK,
    ERROR_STATUS,
    ERROR_THEIRS,
    ERROR_WORDS,
    KIND_ABORTED,
    KIND_REJECTED,
    KIND_TAG,
    KIND_TIMEOUT,
    KIND_TOKENS,
    MAX_RANKS,
    MAX_TOPK,
    NO_TAG,
    PHASE_NAMES,
    STATE_CALL,
    STATE_STEP_STATUS,
    STATE_WORDS,
    STATUS_FAILED,
    STATUS_UNUSABLE,
)
from dep_ep.launch.nvshmem import GPU_EXTRA
from dep_ep.launch.store import group_store

MAX_INDEX = 1 << 31  # element indices of the kernels' tensors are int32
# synchronize(): spin on the stream's event this long, then sleep between looks (a kernel's step
# takes microseconds; a blocked wait beyond this is waiting for something slow), and look at the
# peers' processes this often.
SYNC_SPIN_S, SYNC_SLEEP_S, SYNC_WATCH_S = 1e-3, 2e-4, 0.05
# Bound of one store call of the peer watch's thread (its reads of the peers' reset rounds): a
# store that does not answer within it is skipped until the next look.
WATCH_STORE_CALL_S = 1.0


def import_cute():
    try:
        import cuda.bindings.driver as cuda
        import cutlass
        import cutlass.cute as cute
    except ImportError as err:
        raise ImportError(f"the GPU kernels need CuTeDSL: {GPU_EXTRA}") from err
    return cuda, cutlass, cute


# The kernels a DeviceTransport launches: the dispatch, the combine and the RejectKernel
# variants (comm/kernels/launcher.py, REJECT_KERNELS).
KERNEL_NAMES = ("dispatch", "combine", *REJECT_KERNELS)


def compile_kernels(
    num_ranks: int,
    latent: int,
    topk: int,
    experts_per_rank: int,
    arch: str | None = None,
    keep_ptx_dir: str | None = None,
    names: tuple[str, ...] = KERNEL_NAMES,
    tuning=None,
) -> dict:
    """Compile the kernels `names` (of KERNEL_NAMES) for one geometry, each through its
    launcher's `compile` (comm/kernels/: DispatchLaunch, CombineLaunch, RejectLaunch). `arch`
    (e.g. "sm_90a", "sm_100a") compiles for that GPU without needing one; `keep_ptx_dir` keeps
    the PTX; `tuning` a KernelTuning (None: the default, the measured best:
    docs/perf_notes.md). Returns {name: compiled function}. Compiled kernels are cached in the
    process per geometry and mode, so a second DeviceTransport of the same geometry (a rebuild
    after a timeout, a test fixture) compiles nothing (`compiled_count()` counts the cache's
    entries)."""
    import_cute()
    from dep_ep.comm.kernels.combine import CombineLaunch
    from dep_ep.comm.kernels.dispatch import DispatchLaunch
    from dep_ep.comm.kernels.launch_args import KernelTuning
    from dep_ep.comm.kernels.launcher import KernelGeometry
    from dep_ep.comm.kernels.reject import RejectLaunch

    tuning = KernelTuning() if tuning is None else tuning
    geometry = KernelGeometry(num_ranks, latent, topk, experts_per_rank)
    kernels = {}
    for name in names:
        if name == DispatchLaunch.NAME:
            kernels[name] = DispatchLaunch.compile(geometry, tuning, arch, keep_ptx_dir)
        elif name == CombineLaunch.NAME:
            kernels[name] = CombineLaunch.compile(geometry, tuning, arch, keep_ptx_dir)
        else:
            kernels[name] = RejectLaunch.compile(name, geometry, tuning, arch, keep_ptx_dir)
    return kernels


def check_kernel_limits(layout: EpLayout) -> None:
    """ValueError unless the GPU kernels can serve `layout`: at most MAX_RANKS ranks (a token's
    destinations are a 32-bit mask), topk at most MAX_TOPK, and every row tensor indexable in 32
    bits (the widest rows: the expert outputs, L / 2 words, or the ids and weights,
    K words, when K is larger)."""
    if layout.num_ranks > MAX_RANKS or layout.topk > MAX_TOPK:
        raise ValueError(
            f"EpRouted: the GPU kernels take at most {MAX_RANKS} ranks and topk {MAX_TOPK};"
            f" got {layout.num_ranks} ranks, topk {layout.topk}"
        )
    row_words = max(layout.latent // 2, layout.topk)
    words = layout.max_rows * row_words
    if words >= MAX_INDEX:
        limit = (MAX_INDEX - 1) // (layout.num_ranks * row_words)
        raise ValueError(
            f"EpRouted: the GPU kernels index at most {MAX_INDEX - 1} words a region; ranks *"
            f" max_tokens * {row_words} words a row = {words}: max_tokens must be at most"
            f" {limit} at {layout.num_ranks} ranks, latent {layout.latent} and topk"
            f" {layout.topk}"
        )


class DeviceTransport(Transport):
    """The CUDA transport of one EpBuffers (docs/design.md, "GPU protocol").

    Device state (int64 [STATE_WORDS], this rank only): the calls done, the current call's step
    status, the CTA counters of the running launches, the abort word (comm/kernels/signals.py).
    The error record (int64 [ERROR_WORDS], host-mapped): the first error a kernel met, read by
    `check()` without a device sync, and the host's abort request (a PeerWatch thread sets it
    when a peer's process is gone or a peer called reset(); reset() sets it so that waits end at
    once). The failure record (int64 [FAILURE_WORDS], host-mapped): an experts backend's
    failure of a step on the device (comm/failure.py), which check() raises as this rank's error
    when it is the rejected call's.
    """

    completes_on_return = False

    def __init__(self, buffers: EpBuffers, experts_per_rank: int, config: EpConfig):
        layout = buffers.layout
        check_kernel_limits(layout)
        import_cute()  # ImportError with the pip line when CuTeDSL is missing
        from dep_ep.comm.kernels.launcher import KernelGeometry, TransportParams

        self.buffers = buffers
        self.num_ranks, self.rank, self.device = buffers.num_ranks, buffers.rank, buffers.device
        self.experts_per_rank = experts_per_rank
        self.timeout_s = config.timeout_s
        self.timeout_ns = int(config.timeout_s * 1e9)
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=self.device)
        self.error = torch.zeros(ERROR_WORDS, dtype=torch.int64).pin_memory()
        # Where an experts backend fails a step on the device (comm/failure.py): the state's step
        # status word, which the combine reads, and a host-mapped record of the failure.
        self.failure_record = new_record(pinned=True)
        self._status_word = self.state[STATE_STEP_STATUS : STATE_STEP_STATUS + 1]
        # The calls done, which a step's failure record takes its call index from.
        self._calls_done = self.state[STATE_CALL : STATE_CALL + 1]
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.geometry = KernelGeometry(
            layout.num_ranks, layout.latent, layout.topk, experts_per_rank
        )
        # The launch parameters every kernel shares (regions, control words), then the
        # launchers (retune), which own the rest.
        self._shared_params = TransportParams(
            buffers, self.state, self.error, self.rank, self.timeout_ns
        )
        self.retune(None)
        self.barriers = buffers.barriers
        channel = self.barriers.channel
        # The watch's thread reads the peers' reset rounds on a store connection of its own.
        store = None
        if config.peer_watch_s is not None and channel.size > 1:
            store = group_store(channel.group, WATCH_STORE_CALL_S)
        self.watch = PeerWatch(channel, self.error, config.peer_watch_s, self.barriers, store)

    def retune(self, tuning) -> None:
        """Build this geometry's launchers with `tuning` (a KernelTuning; None: the default),
        compiling their kernels or taking them from the cache, and launch those from now on.
        Local; for benchmarks that compare tunings on one set of buffers. The results do not
        depend on the tuning."""
        from dep_ep.comm.kernels.combine import CombineLaunch
        from dep_ep.comm.kernels.dispatch import DispatchLaunch
        from dep_ep.comm.kernels.launch_args import KernelTuning
        from dep_ep.comm.kernels.reject import RejectLaunch

        tuning = KernelTuning() if tuning is None else tuning
        geometry, shared = self.geometry, self._shared_params
        # Built first, assigned together: a compile that fails leaves the previous set whole.
        dispatch = DispatchLaunch(geometry, tuning, shared, self.num_sms)
        combine = CombineLaunch(geometry, tuning, shared, self.num_sms)
        rejects = {name: RejectLaunch(name, geometry, tuning, shared) for name in REJECT_KERNELS}
        self.tuning, self.dispatch_launch, self.combine_launch = tuning, dispatch, combine
        self.reject_launches = rejects

    def _stream_handle(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def check(self) -> None:
        """Raise the error a kernel recorded (host-mapped memory: no sync). A timeout or an abort
        stays (every later call raises it) until reset(), or for a lost peer until the object is
        closed; any other error is cleared once raised. The next call then runs in step, except
        after differing tags or call indices (EpDesyncError: the ranks' calls no longer pair),
        after which EpRouted refuses calls until reset() on every rank."""
        if self.watch.lost:
            self._raise_lost("poll")
        if self.launched_after_reset is not None:
            raise EpDesyncError(self.launched_after_reset, RECOVERY_RESET)
        if int(self.error[ERROR_STATUS]) != ERROR_COMPLETE:
            if int(self.error[ERROR_ABORT]) == ABORT_PEER_RESET:
                self._raise_peer_reset("")  # no wait of this rank was ended (yet)
            return
        phase_id, peer, rank, kind, theirs, mine, call = (
            int(self.error[i])
            for i in (
                ERROR_PHASE,
                ERROR_PEER,
                ERROR_RANK,
                ERROR_KIND,
                ERROR_THEIRS,
                ERROR_MINE,
                ERROR_CALL,
            )
        )
        phase = PHASE_NAMES.get(phase_id, str(phase_id))
        if kind == KIND_TIMEOUT:
            raise EpTimeoutError(
                rank,
                phase,
                f"rank {peer}",
                "recorded by the GPU kernel",
            )
        if kind == KIND_ABORTED:
            if theirs == ABORT_PEER_LOST:
                self._raise_lost(phase)
            if theirs == ABORT_PEER_RESET:
                self._raise_peer_reset(f", which ended this rank's wait of {phase} for rank {peer}")
            raise EpDesyncError(
                f"EpRouted (rank {rank}): a wait of {phase} for rank {peer} ended because reset()"
                " ran; call reset() on every rank",
                RECOVERY_RESET,
            )
        self.error[:ERROR_KERNEL_WORDS].zero_()
        if kind != KIND_REJECTED:
            # A failure record the experts (or check_expert_rows) wrote in a step whose first
            # error is this one is not raised: cleared with it, so that a later step's error
            # does not read it as its own (KIND_REJECTED reads and clears it below).
            self.failure_record.zero_()
        where = f"EpRouted (rank {rank}): call {call} ({phase})"
        after = "; this rank's output of that call is NaN. This call did not start: call it again"
        if kind == KIND_REJECTED:
            # This rank's own experts failed a step on the device (its combine then recorded its
            # own STATUS_UNUSABLE flag, or a peer's rejection came first): its own error first.
            outcome = (
                "this rank's output of that call is NaN, and so is every peer's (they raise"
                f" EpPeerError naming rank {rank}). This call did not start: call it again"
            )
            # A record of another call is stale: a failed step's kernels stored it after an
            # earlier check() cleared the record (comm/failure.py); it is dropped here.
            failure = failure_error(self.failure_record, where, outcome, call)
            if failure is not None:
                raise failure
            cause = {STATUS_FAILED: CAUSE_EXPERTS, STATUS_UNUSABLE: CAUSE_UNUSABLE}.get(
                theirs, CAUSE_INPUT
            )
            raise EpPeerError(f"{where}: rank {peer} {cause}{after}")
        if kind == KIND_TOKENS:
            raise EpTokenCountError(
                f"{where}: ranks passed different token counts (rank {peer}: {theirs}, this rank:"
                f" {mine}); every rank must pass the same T{after}"
            )
        # Differing tags or call indices: the ranks' calls no longer pair (EpRouted refuses
        # calls until reset() on every rank).
        nan = f"; this rank's output of that call is NaN. {MISALIGNED}"
        if kind == KIND_TAG:
            pieces = [first_piece(theirs), first_piece(mine)]
            if None not in pieces and pieces[0][1] == pieces[1][1]:
                # The first pieces of one call's steps run in pieces, with different T: the
                # ranks may have run different piece counts since.
                raise EpDesyncError(
                    f"{where}: the ranks passed different token counts T to a step run in pieces"
                    f" (rank {peer}: T={pieces[0][0]}, this rank: T={pieces[1][0]}), found in its"
                    f" first piece (whose tag carries T); every rank must pass the same T{nan}",
                    RECOVERY_RESET,
                )
            raise EpDesyncError(
                f"{where}: the ranks are out of step: rank {peer} ran {tag_text(theirs)} where"
                f" this rank ran {tag_text(mine)} ({tags_differ_text([theirs, mine])}){nan}",
                RECOVERY_RESET,
            )
        raise EpDesyncError(
            f"{where}: the ranks are out of step: rank {peer} was at call {theirs}{nan}",
            RECOVERY_RESET,
        )

    def _raise_peer_reset(self, ended: str) -> None:
        """EpDesyncError for a peer's reset() seen by the watch (ABORT_PEER_RESET); `ended` says
        which wait of this rank it ended, if one was."""
        peers = ranks_text(self.watch.resetting) or "a peer"
        raise EpDesyncError(
            f"EpRouted (rank {self.rank}): {peers} called reset(){ended}; this rank's outputs"
            " since are NaN. Call reset() on this rank too (the ranks meet there)",
            RECOVERY_RESET,
        )

    def _raise_lost(self, phase: str) -> None:
        raise EpPeerLostError(
            self.rank,
            phase,
            ranks_text(self.watch.lost),
            "the process exited; this rank's waits for it were ended (outputs since are NaN)",
        )

    def poll(self) -> None:
        """Look at the peers' processes once, then `check()`. Non-blocking, no device sync;
        refused during a CUDA graph capture (it would run once, at capture, not per replay)."""
        if self.capturing():
            raise RuntimeError(
                "poll: called while a CUDA graph is being captured; call it after each replay,"
                " outside the capture"
            )
        self.watch.check_now()
        self.check()

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def synchronize(self) -> None:
        """Wait for this rank's current stream, watching the peers meanwhile (a peer found gone
        ends the waits, so this returns), then `check()`. The wait polls the stream rather than
        blocking inside CUDA, so a signal (SIGINT) takes effect within a millisecond."""
        self._wait_stream()
        self.check()

    def _wait_stream(self) -> None:
        """Wait for this rank's current stream as `synchronize()` does, without `check()`."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        spin_until = time.monotonic() + SYNC_SPIN_S
        next_look = time.monotonic() + SYNC_WATCH_S
        while not done.query():
            now = time.monotonic()
            if now >= next_look:
                self.watch.check_now()
                next_look = now + SYNC_WATCH_S
            if now >= spin_until:
                time.sleep(SYNC_SLEEP_S)

    def reset(self) -> None:
        """Ask this rank's kernels to end their waits (the abort request), let its queued work
        finish, then agree with every rank on a new epoch of the host barriers (every rank's
        kernels are done then), zero this rank's step flags, device state and error record, and
        meet once more so that no rank launches before every rank has zeroed. After a timeout,
        a rejection or an interrupted call, the next call is in step; after a lost peer,
        EpPeerLostError (the object must be closed). A peer whose kernels wait in a call
        meanwhile learns of this reset from its PeerWatch (this rank's reset round, in the
        store): its kernels end within its peer_watch_s, its next poll(), call or synchronize()
        raises EpDesyncError, and its reset() meets this one."""
        self.error[ERROR_ABORT] = ABORT_RESET
        torch.cuda.synchronize(self.device)
        self.barriers.reset(self.timeout_s)
        self.buffers.flags.zero_()
        self.state.zero_()
        with self.watch.lock:  # after reset_round rose: the watch aborts for no earlier round
            self.error.zero_()
            self.failure_record.zero_()
            self.watch.cleared()
        torch.cuda.synchronize(self.device)
        self.barriers.exchange("reset-done", {}, self.timeout_s)
        self.launched_after_reset = None  # its launch ended with the kernels synchronized above

    def drop_abandoned_failure(self) -> None:
        """The abandoned call's kernels queued after the reset on the current stream (its
        experts' finalize, the unwritten-rows check) read the new epoch's calls done and store a
        record naming the next call's index: wait for them as `synchronize()` waits (polling,
        the peers watched; bounded: the reset refused the call's combine and any launch after
        it, and `EpRouted` does not ask for the drop after a launch that went into the new
        epoch, `_refuse_launch_after_reset`), then zero the record. Not during a CUDA graph
        capture, where nothing queued has run (a reset() there has already failed the
        capture)."""
        if self.capturing():
            return
        self._wait_stream()
        with self.watch.lock:
            self.failure_record.zero_()

    def close(self) -> None:
        self.watch.stop()

    def step_failure(self, tag: int) -> StepFailure:
        return StepFailure(self._status_word, self.failure_record, tag, self._calls_done)

    def step_ok(self) -> torch.Tensor:
        """bool [] on the device, stream-ordered: the last call passed every check on this rank
        (its outputs are the sums, not NaN)."""
        return self.state[STATE_STEP_STATUS] == 0

    def dispatch(
        self, latent, ids, weights, *, tokens, rejected, cause=CAUSE_INPUT, tag=NO_TAG, checked=True
    ):
        """latent bf16 [n, L] (rows 16-byte aligned: its row stride a multiple of 8 elements;
        contiguous or a column slice), ids int32 [T, K], weights fp32 [T, K], contiguous, on the
        device. A rejected call takes part without payload (RejectKernel) and then raises
        `rejected`."""
        if checked:
            self.check()
        # A reset() nested in the call before this point (a signal handler's): launch nothing
        # in the new epoch, where the peers' next calls would pair with this abandoned one. A
        # reset between here and the launch: `_refuse_launch_after_reset`.
        self.barriers.refuse_reset_in_call("dispatch")
        if rejected is not None:
            self._reject("reject_dispatch", tag, rejected)
            raise rejected
        self.dispatch_launch(latent, ids, weights, tokens, tag, self._stream_handle())
        self._refuse_launch_after_reset("dispatch")

    def combine(
        self,
        ids,
        norm_weight,
        eps,
        *,
        rejected,
        cause=CAUSE_INPUT,
        tag=NO_TAG,
        out=None,
    ):
        """The expert output rows are every rank's `out` region (the experts wrote this rank's
        before this launch on the stream). ids int32 [T, K] as dispatched, norm_weight bf16 [L]
        or None (the plain sum); returns
        bf16 [T, L]. A rejected call takes part without payload (RejectKernel; its peers see
        STATUS_FAILED when the cause is the experts) and then raises `rejected`."""
        self.barriers.refuse_reset_in_call("combine")
        if rejected is not None:
            self._reject(
                "fail_combine" if cause in EXPERT_CAUSES else "reject_combine", tag, rejected
            )
            raise rejected
        tokens = ids.shape[0]
        normed = out
        if normed is None:
            normed = torch.empty(
                tokens, self.buffers.layout.latent, dtype=torch.bfloat16, device=self.device
            )
        self.combine_launch(ids, norm_weight, normed, eps, tokens, tag, self._stream_handle())
        self._refuse_launch_after_reset("combine")
        return normed

    def _reject(self, name: str, tag: int, rejected: BaseException) -> None:
        self.reject_launches[name](tag, self._stream_handle())
        self._refuse_launch_after_reset(name, rejected)

    def _refuse_launch_after_reset(self, phase: str, cause: BaseException | None = None) -> None:
        """EpDesyncError (recovery "reset") when this rank reset the object after its call's
        last check (`refuse_reset_in_call`) and before the launch just queued: a signal
        handler's reset() can run between any two Python calls, the launcher's included. Such
        a launch reads the new epoch's zeroed device state, so it takes part in the peers' next
        call as this rank's, with the abandoned call's rows (a combine's "ready" flag pointing
        them at expert outputs this rank's next call has not written). The peers cannot
        complete the sums of a call a stale dispatch or combine joined without this rank's next
        launch (a stale reject completes it with NaN rows and EpPeerError), so no wrong row is
        returned as long as this rank launches nothing more: it raises this at every call
        (`launched_after_reset`, `check`) until the next reset() on every rank, whose abort
        ends the launch's waits. `cause`: the caller's rejection a reject kernel carried. A reset
        that came after the launch returned is taken for one before it (one reset more than
        needed; its synchronize ended that launch)."""
        if self.barriers.reset_in_call():
            self.launched_after_reset = (
                f"rank {self.rank} in {phase} of {self.barriers.label}: reset() ran on this rank"
                f" during the call, after its last check and before its {phase} kernel was"
                " queued (from a signal handler, say): that kernel runs in the new epoch, where"
                " the peers' next call pairs with it. Call reset() on every rank before the next"
                " step; until then every call of this rank raises this"
            )
            raise EpDesyncError(self.launched_after_reset, RECOVERY_RESET) from cause
