"""EpRouted: dispatch -> experts -> combine (+ latent RMSNorm) for one rank of a DEP group."""

from __future__ import annotations

import functools
import numbers
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dep_ep.checks import (
    MAX_STEP_TOKENS,
    check_aligned,
    check_eps,
    check_flag,
    check_ids,
    check_int,
    check_layer_index,
    check_padding,
    check_positive_int,
    check_rows,
    check_step_tokens,
    check_tag,
    check_tensor,
    check_tokens,
    check_weights,
    vector_start,
)
from dep_ep.comm.agreement import agree_on_construction
from dep_ep.comm.buffers import EpBuffers, resolve_device
from dep_ep.comm.errors import (
    RECOVERY_NONE,
    RECOVERY_REBUILD,
    EpError,
    EpPeerLostError,
    EpResetDuringCallError,
    tag_text,
)
from dep_ep.comm.failure import StepFailure
from dep_ep.comm.layout import EpLayout
from dep_ep.comm.tags import piece_tag
from dep_ep.comm.transport import (
    CAUSE_ABORT_STEP,
    CAUSE_EARLIER_PIECE,
    CAUSE_EXPERTS,
    CAUSE_INPUT,
    CAUSE_REJECT_STEP,
    open_transport,
)
from dep_ep.config import DEFAULT_NORM_EPS, EpConfig
from dep_ep.constants import MAX_LAYER_INDEX, NO_TAG, SCALE_BLOCK
from dep_ep.ep.unwritten_rows import UnwrittenRows, mark_rows
from dep_ep.experts.base import ExpertsBackend
from dep_ep.version import __version__


@dataclass(frozen=True)
class ReceiveRows:
    """This rank's receive rows for a step of T tokens (R = num_ranks * stride(T) rows):
    x uint8 [R, L], sf uint8 [R, L/32], ids int32 [R, K] (-1 = not for this rank), weights fp32
    [R, K]; out bf16 [R, L] is where an experts backend writes its sums for combine (in the
    symmetric allocation: the sources' combines read the rows where they lie)."""

    x: torch.Tensor
    sf: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor


@dataclass(frozen=True)
class _Step:
    """The dispatched step awaiting its combine: T, this rank's real rows n, the tag, the
    staged ids int32 [T, K] (a copy: the caller may reuse its tensor), and who dispatched it
    (`dispatch`'s owner; None for a plain caller)."""

    tokens: int
    real: int
    tag: int
    ids: torch.Tensor
    owner: object = None
    # Where an owner's dispatch ran, for `abort_stale_step`: inside a CUDA-graph capture, and
    # on which CUDA stream (None on CPU and for a plain caller).
    captured: bool = False
    stream: object = None


def check_experts_match(fn: str, routed: EpRouted, experts: object) -> None:
    """An ExpertsBackend holding exactly the experts `routed`'s rank owns, at its latent width,
    of the model's num_experts where the backend says it (the library's backends do)."""
    if not isinstance(experts, ExpertsBackend):
        raise TypeError(f"{fn}: experts is {type(experts).__name__}; expected an ExpertsBackend")
    mine = (routed.first_expert, routed.experts_per_rank, routed.latent)
    theirs = (experts.first_expert, experts.num_local_experts, experts.latent)
    if theirs != mine:
        raise ValueError(
            f"{fn}: experts hold first_expert={theirs[0]}, {theirs[1]} experts, latent"
            f" {theirs[2]}; rank {routed.rank} owns experts {mine[0]}..{mine[0] + mine[1] - 1}"
            f" (first_expert={mine[0]}, {mine[1]} experts) of latent {mine[2]}"
        )
    # The library's backends take the model's E from their ExpertWeights (TrtllmExperts' routing
    # and HopperExperts' kernel choice read it); a backend without the attribute is not checked.
    total = getattr(experts, "num_experts", None)
    if total is not None and total != routed.num_experts:
        raise ValueError(
            f"{fn}: experts were built for num_experts={total}; the EpRouted was built for"
            f" num_experts={routed.num_experts}"
        )


def step_total(tokens: object, latent: object) -> object:
    """The T of a call given `tokens` on `latent`, for reject_step's `tokens`: `tokens` as
    given, or for None the latent's rows (routed's rule), None when it has none to give."""
    if tokens is not None:
        return tokens
    shape = getattr(latent, "shape", None)
    return shape[0] if shape is not None and len(shape) >= 1 else None


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, end) byte addresses `t`'s elements can occupy (strides >= 0; a tensor of no
    element occupies none: (start, start))."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def shares_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the byte spans of `a` and `b` intersect (conservative: interleaved views that
    share no byte count as sharing); a tensor of no element shares none."""
    return b.numel() > 0 and lies_in(a, *byte_span(b))


def lies_in(t: torch.Tensor, first: int, end: int) -> bool:
    """True when a byte of `t` may lie in [first, end): first its storage's range (two
    comparisons: most tensors are in other allocations), then its byte span."""
    storage = t.untyped_storage()
    start = storage.data_ptr()
    if start + storage.nbytes() <= first or start >= end or t.numel() == 0:
        return False
    t0, t1 = byte_span(t)
    return t0 < end and first < t1


def may_overlap(out: torch.Tensor, latent: torch.Tensor) -> bool:
    """True when the byte spans of `out` and `latent` (2-D, rows contiguous) intersect, unless
    `out` is the latent itself (same start and strides: each piece of a step then overwrites
    only the rows it has read). Conservative: interleaved column slices of one buffer, which
    share no byte, count as overlapping (they cost a copy, never a wrong row)."""
    if out.data_ptr() == latent.data_ptr() and out.stride() == latent.stride():
        return False
    return shares_bytes(out, latent)


def out_overlaps_inputs(out: torch.Tensor, latent, ids, weights, norm_weight, padding) -> bool:
    """True when `out` may share memory with an input a later piece of a step reads: the latent
    (`may_overlap`), ids, weights, the norm weight or the padding (each checked where it is a
    tensor; the call's validation refuses the rest)."""
    if isinstance(latent, torch.Tensor) and may_overlap(out, latent):
        return True
    others = (ids, weights, norm_weight, padding)
    return any(isinstance(t, torch.Tensor) and shares_bytes(out, t) for t in others)


def same_owner(a: object, b: object) -> bool:
    """Whether two dispatch owners are one caller: the same object, equal integers of any kind
    (int, NumPy's; bools excepted), or equal values of one type among str, bytes and tuple (an
    engine's layer number or a name it formats again at each hook: equal values need not be
    one object, nor one integer type)."""
    if a is b:
        return True
    integral = [isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (a, b)]
    if all(integral):
        return int(a) == int(b)
    if any(integral) or type(a) is not type(b) or not isinstance(a, (str, bytes, tuple)):
        return False
    try:
        return bool(a == b)
    except Exception:  # a tuple holding something whose == is not a bool
        return False


def expert_rows_checked(config: EpConfig, device: torch.device) -> bool:
    """EpConfig.check_expert_rows as resolved on `device`: None checks on CPU, not on CUDA."""
    check = config.check_expert_rows
    return device.type == "cpu" if check is None else check


def _wire_tag(tag: object) -> int:
    """The tag a call sends: the caller's when it is valid, else NO_TAG (a rank that rejects its
    tag sends none; its peers need not see the bad value)."""
    try:
        value = check_tag("", tag)
    except ValueError:
        return NO_TAG
    return NO_TAG if value is None else value


def _in_piece(err: BaseException, index: int, steps: int, total: int, max_tokens: int) -> None:
    """Say in a protocol error's message which piece of a step run in pieces raised it (its
    tags and token counts are the piece's, not the caller's)."""
    if not isinstance(err, EpError) or not err.args or not isinstance(err.args[0], str):
        return
    where = f"(in piece {index + 1} of {steps} of a step of T={total}, max_tokens {max_tokens})"
    if where not in err.args[0]:
        err.args = (f"{err.args[0]} {where}", *err.args[1:])


def _as_exception(fn: str, error: object) -> BaseException:
    """The exception `reject_step` or `abort_step` raises for `error`: an exception, or an
    exception class (as `raise` takes one), else a TypeError saying so (the step still fails on
    every rank: the caller meant to fail it)."""
    if isinstance(error, BaseException):
        return error
    if isinstance(error, type) and issubclass(error, BaseException):
        try:
            return error()
        except Exception as err:  # a class that needs arguments
            return TypeError(f"{fn}: could not instantiate {error.__name__}: {err}")
    return TypeError(f"{fn}: error is {type(error).__name__} ({error!r}); expected an exception")


# The notes an exception that is not an EpError (a KeyboardInterrupt, the caller's own) gets on
# its way out of a transport call, so that the rank can tell the two recoveries apart: raised
# after this rank took part in the step (its experts, its input), which then failed on every
# rank, or inside the exchange with the peers (a signal handler's), which needs a reset. Before,
# a KeyboardInterrupt in the experts looked like one in a wait, and a rank that reset after it
# cost its peers a step (a careless-user probe: with tag=step every later step desynced).
REJECTED_NOTE = (
    "this rank took part in the step and then raised this; the step failed on every rank (the"
    " peers raise EpPeerError) and the ranks are in step: no reset() is needed (recovery"
    " 'none')"
)
INTERRUPTED_NOTE = (
    "this was raised inside the exchange with the peers; call reset() on every rank before the"
    " next step (recovery 'reset')"
)
# Raised after this rank passed the step's last barrier: every peer returned its rows of the
# step, and a reset here would cost them their next step (a careless-user probe: with tag=step
# every later step desynced). Their next call may be the next layer of the same server step (a
# model's layers share one EpRouted, each called with the step's tag): this rank makes it too
# (a second probe: a rank that went on to its next step desynced every later one).
COMPLETED_NOTE = (
    "this was raised after the call's exchange completed on every rank: the peers returned"
    " their rows of it and the ranks are in step, so no reset() is needed (recovery 'none');"
    " this rank's rows of it are lost. The next call pairs with the peers' next call on this"
    " object (the next layer of the same step, or their next step): make the calls they make"
    " next, with the tags they use, and do not repeat this one"
)


# Raised in an EpMoeLayer's own work before its call reached the EpRouted's exchange (an
# interrupt: the layer's checks turn any other exception there into the step's rejection).
NOT_SENT_NOTE = (
    "this was raised in this rank's own work before the call reached the exchange: nothing of"
    " it was sent, the peers wait in this call and no reset() is needed (recovery 'none'); call"
    " it again (it pairs with theirs)"
)


def _keep_context(err: BaseException, error: BaseException | None) -> None:
    """Chain `error` (the step's own error: abort_step's, the experts') to `err`, raised before
    the step's combine began and rejecting the step in its place, unless `err` already carries
    a context: the traceback then shows both."""
    if error is not None and err is not error and err.__context__ is None:
        err.__context__ = error


def note_recovery(err: BaseException, note: str) -> None:
    """Add `note` to `err` once (Python 3.11's add_note; nothing on 3.10), unless it is an
    EpError, whose `recovery` says it."""
    if isinstance(err, EpError) or not hasattr(err, "add_note"):
        return
    if note not in getattr(err, "__notes__", ()):
        err.add_note(note)


def _reset_during(name: str, rank: int, when: str = "during the call") -> EpResetDuringCallError:
    """The error of a call that a reset() on its own rank (a signal handler's) overtook `when`."""
    return EpResetDuringCallError(
        f"{name} (rank {rank}): reset() ran on this rank {when} (from a signal handler, say);"
        " nothing of the call was used. The ranks are in step after that reset: the next call"
        " needs no reset"
    )


def _one_thread(method):
    """An EpRouted method that one thread at a time may be inside: a call entered while another
    (live) thread is inside one of them raises RuntimeError on the entering thread, naming both
    calls and threads (the call in progress goes on). Calls nested on one thread (routed ->
    dispatch, or a signal handler's close() inside a call) pass. Two threads interleaving one
    EpRouted's collectives would pair this rank's calls with its peers' in another order than
    they were made.

    The slot (`_caller`: the thread inside a call and the call) is taken under a re-entrant lock
    (a signal handler that runs on the same thread while it is held enters it again instead of
    waiting on itself), marked as ours before it is taken and cleared in `finally`, so that an
    exception at any point (a KeyboardInterrupt included) leaves it free; a slot whose thread has
    ended is free.

    A call (but reset and close) during which this rank's reset() ran, nested on its thread (a
    signal handler's), returns nothing: from that reset on its barriers publish nothing and, on
    GPU, launches it has not reached yet do not run (each compares the object's epoch with the
    call's start, `ObjectBarriers.call.began`), so no peer's next call pairs with it; whatever it
    did after the reset (a dispatch it recorded again) is dropped (`_abandon_call`), and it
    raises EpResetDuringCallError, recovery "none". On GPU a reset between the call's last
    check and a launch lets that launch run in the new epoch: the transport's EpDesyncError
    (recovery "reset") is raised instead, and calls are refused until the next reset()
    (`Transport.launched_after_reset`)."""
    name = f"EpRouted.{method.__name__}"

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        me = threading.current_thread()
        outer, busy = False, None
        try:
            with self._caller_lock:
                caller = self._caller
                if caller is None or not caller[0].is_alive():
                    outer = True
                    self._caller = (me, name)
                elif caller[0] is not me:
                    busy = caller
            if busy is not None:
                raise RuntimeError(
                    f"{name}: thread {me.name!r} called while thread {busy[0].name!r} is in"
                    f" {busy[1]} on this EpRouted; drive an EpRouted from one thread (two"
                    " threads would pair this rank's calls with its peers' in another order)"
                )
            if method.__name__ in ("reset", "close"):
                return method(self, *args, **kwargs)
            # The call's start, which its barriers and launches compare with: after a reset()
            # nested in it they publish and launch nothing (comm/host_channel.py, CallStart).
            # An outermost call inside an EpMoeLayer call keeps the layer call's start (a reset
            # in the layer's own work came after it); a call nested in another (a signal
            # handler's) has its own. Restored on the way out.
            barriers = self._buffers.barriers
            call = barriers.call
            began = call.began
            if began is None or not outer:
                call.began = (barriers.epoch, barriers.reset_round)
            try:
                if not outer:
                    return method(self, *args, **kwargs)
                return _abandoned_if_reset(self, name, method, args, kwargs)
            finally:
                call.began = began  # a plain store: no call where a handler could raise
        finally:
            if outer:
                self._caller = None

    return guarded


def _abandoned_if_reset(routed, name: str, method, args, kwargs):
    """`method(routed, ...)`, the outermost call of this thread; when this rank's reset() ran
    during it (nested: a signal handler's), what the call left is dropped (`_abandon_call`) and
    EpResetDuringCallError raised instead of its result or its error; but when one of its
    launches went into the new epoch (`Transport.launched_after_reset`), the transport's
    EpDesyncError, recovery "reset"."""
    resets = routed._resets
    try:
        result = method(routed, *args, **kwargs)
    except EpResetDuringCallError:
        routed._abandon_call()
        raise
    except BaseException as err:
        if routed._resets == resets:
            raise
        routed._abandon_call()
        if routed._transport.launched_after_reset is not None:
            raise  # a launch went into the new epoch: the ranks are out of step (EpDesyncError)
        raise _reset_during(name, routed.rank) from err
    if routed._resets != resets:
        routed._abandon_call()
        raise _reset_during(name, routed.rank)
    return result


class EpRouted:
    """The routed-expert path of every MoE layer of one rank: buffers shared by all layers.

    Collective calls (every rank of `group`, same order, same T): construction, `dispatch` (or
    `reject_step`), `combine` (or `abort_step`), `routed` (the object is callable: `ep(...)` is
    `ep.routed(...)`), `reset`, `close`. On CPU each blocks the host and completes before it
    returns; on CUDA (NVSHMEM buffers, CuTeDSL kernels) dispatch/combine/routed are
    stream-ordered, never sync the host and can be captured in a CUDA graph; `poll()` (no sync)
    and `synchronize()` report what the kernels recorded. A context manager: `with EpRouted(...)
    as ep:` closes on exit.

    group: gloo group of the EP ranks (its rendezvous store carries the host barriers; the group's
    own connections carry nothing of ours); max_tokens: the most tokens a rank passes in a step;
    device: "cpu" or a CUDA device; num_experts: E (divisible by the rank count; rank r owns
    [r*E/N, (r+1)*E/N)); latent: L (a multiple of 32); topk: K; config: runtime settings
    (the timeout, the value and expert-row checks, the peer watch, expert counts). Integers of
    any kind (numpy, 0-dim torch) are taken. Construction compares every rank's arguments (and
    device kind, library version and whether the values are checked, `config.check_values` as
    resolved) and raises ValueError on every rank naming the fields that differ; a rank whose own
    arguments are invalid raises its error and every other rank EpPeerError; a rank that never
    arrives gives EpTimeoutError within `config.timeout_s`.

    Calls pair by their order: the i-th dispatch of every rank forms one step. A rank that skips a
    whole step (a call that raises before it reaches this object, a misspelled keyword say, is
    one) is only seen when the calls carry a `tag` (an int the caller advances, such as
    step * layers + layer; EpMoeLayer tags its calls by itself): ranks whose tags differ raise
    EpDesyncError. Errors (docs/design.md, "Errors"; each EpError's `recovery` says what to do):
    a call whose input one rank rejects raises on every rank (ValueError/TypeError on the
    rejecting rank, EpPeerError elsewhere: in the same call on CPU, at the next call, `poll()` or
    `synchronize()` on CUDA, whose outputs of that call are NaN); the buffers stay usable. After
    a timeout, a desync (differing tags included: the ranks' calls no longer pair) or an
    interrupted call, every call raises until `reset()` on every rank; after a lost peer
    (EpPeerLostError) only `close()` is left.
    """

    # Built outside inference mode even inside one (a server may construct its model under
    # torch.inference_mode()): the object's own tensors are updated in place by every call, and
    # an inference tensor refuses that outside inference mode.
    @torch.inference_mode(False)
    def __init__(
        self,
        group: dist.ProcessGroup,
        max_tokens: int,
        device: torch.device | str,
        *,
        num_experts: int,
        latent: int,
        topk: int,
        config: EpConfig | None = None,
    ) -> None:
        fn = "EpRouted"
        # _one_thread: (the thread inside a call, the call) or None, and the lock it is taken
        # under (re-entrant: see _one_thread).
        self._caller_lock = threading.RLock()
        self._caller: tuple[threading.Thread, str] | None = None
        num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        error = None
        try:
            config, max_tokens, num_experts, latent, topk = self._check_construction(
                fn, num_ranks, max_tokens, num_experts, latent, topk, config
            )
            self.device = resolve_device(fn, device)
        except (TypeError, ValueError) as err:
            # Every rank still takes part in the agreement: the others raise EpPeerError.
            error, config, self.device = err, EpConfig(), torch.device("cpu")
        self.config = config
        fingerprint = {
            "num_ranks": num_ranks,
            "max_tokens": max_tokens,
            "num_experts": num_experts,
            "latent": latent,
            "topk": topk,
            "device": self.device.type,
            "version": __version__,
            # One rank reading the ids' range and another not would refuse a step on one rank
            # and drop the same out-of-range id on another. As resolved: None reads them on CPU
            # (its host transport), not on CUDA.
            "check_values": bool(
                self.device.type == "cpu" if config.check_values is None else config.check_values
            ),
            # A rank without the check would sum a row its experts left unwritten, silently. As
            # resolved: None checks on CPU, not on CUDA.
            "check_expert_rows": expert_rows_checked(config, self.device),
        }
        agreement = agree_on_construction(fn, group, fingerprint, config.timeout_s, error)
        self._buffers: EpBuffers | None = None
        self._transport = None
        try:
            self._open(group, agreement, config, max_tokens, num_experts, latent, topk, rank)
        except BaseException:
            # Abandoned after the ranks agreed (an error, or a KeyboardInterrupt, past the last
            # construction barrier: the peers may hold complete objects already). Close what
            # exists, publishing this rank's closed mark: the peers' next call raises
            # EpPeerLostError naming this rank instead of waiting for it, and a construction
            # retried on every rank pairs at once.
            self._abandon(agreement)
            raise
        agreement.barriers.built()

    def _open(self, group, agreement, config, max_tokens, num_experts, latent, topk, rank):
        """The constructor after the agreement: the buffers, the transport and the state."""
        num_ranks = dist.get_world_size(group)
        self.num_experts, self.latent, self.topk = num_experts, latent, topk
        self.num_ranks, self.rank, self.max_tokens = num_ranks, rank, max_tokens
        self.experts_per_rank = num_experts // num_ranks
        self.first_expert = rank * self.experts_per_rank
        self._buffers = EpBuffers(
            group,
            num_ranks,
            rank,
            max_tokens,
            self.device,
            latent=latent,
            topk=topk,
            timeout_s=config.timeout_s,
            agreement=agreement,
        )
        self._transport = open_transport(self._buffers, self.experts_per_rank, config)
        # [first, end) bytes of the symmetric allocation and of its receive().out region, for the
        # checks of every call that an input or `out` keeps off them (`lies_in`).
        self._segment_span = byte_span(self._buffers.segment)
        self._out_span = self._buffers.span("out")
        # Value checks (ids range, weights) read the tensors: free where calls complete on
        # return, a host sync where they are stream-ordered.
        check = config.check_values
        self.check_values = self._transport.completes_on_return if check is None else check
        on = dict(device=self.device)
        self._rows_of: dict[int, ReceiveRows] = {}  # T -> the step's views (EpRouted._rows)
        # Staged ids and weights of the step: padded to T with -1 ids, owned by this object.
        self._ids = torch.empty(max_tokens, topk, dtype=torch.int32, **on)
        # The id a padding row's ids become (`padding=`), as a device scalar: torch.where writes
        # the staged ids from it without a host-to-device copy of its own.
        self._no_expert = torch.full((), -1, dtype=torch.int32, **on)
        self._weights = torch.empty(max_tokens, topk, dtype=torch.float32, **on)
        self._step: _Step | None = None  # the dispatched step awaiting its combine
        # Dispatches (and rejections) handed to the transport, by the thread that made them
        # (`_entered_here()`): an EpMoeLayer counts a call (its tags' call count) only once it got
        # this far, so that an exception before it (a KeyboardInterrupt in the layer's own work,
        # a call refused because another thread is inside one) does not put its count ahead of
        # the peers'.
        self._entered: dict[int, int] = {}
        self._last_tokens: int | None = None  # T of the last dispatch (expert_counts)
        self._step_failure: str | None = None  # why the last step failed on this rank
        self._resets = 0  # reset()s so far: a call during which one ran is abandoned
        # A reset() dropped a pending dispatch, and no dispatch came since: a combine() then
        # says so and drops the failure record the caller's experts may have stored after it.
        self._reset_dropped_step = False
        # The reset count at which the transport last dropped an abandoned call's failure
        # record (once a reset: `_routed_step` and `_abandoned_if_reset` both abandon the call).
        self._dropped_at = -1
        self._broken: str | None = None  # why calls are refused until reset()
        self._lost: EpPeerLostError | None = None  # a peer is gone: only close() is left
        # Inside a step run in pieces only (`_in_pieces`): the error this rank raised after
        # taking part in its last transport call (its input or its experts failed), after which
        # the step goes on without payload. Not kept past the step: its traceback holds the
        # caller's frames (a layer registered by weak reference among them).
        self._in_pieces = False
        self._own_failure: BaseException | None = None
        # Inside a step run in pieces: whether the piece running is the step's last (only its
        # final barrier ends the step on every rank: `_passed_final_barrier`). True outside.
        self._last_piece = True
        # check_expert_rows: the mark at dispatch and the check before the combine.
        checked = expert_rows_checked(config, self.device)
        self._unwritten = UnwrittenRows(self.device) if checked else None
        self._counts = None  # int32 [E_local]: the last dispatch's pairs per local expert
        if config.count_experts:
            self._counts = torch.zeros(self.experts_per_rank, dtype=torch.int32, **on)
        self._layers: weakref.WeakSet = weakref.WeakSet()  # layers tagging their calls
        self._layer_indices: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._next_layer_index = 0  # the default index of the next layer registered

    def _abandon(self, agreement) -> None:
        """Close what a construction abandoned after the agreement built (local): the transport,
        the buffers and the object's barriers (this rank's closed mark)."""
        transport, buffers = self._transport, self._buffers
        try:
            if transport is not None:
                transport.close()
        finally:
            if buffers is not None:
                buffers.close()  # closes the barriers too
            agreement.barriers.close()  # idempotent

    @staticmethod
    def _check_construction(fn, num_ranks, max_tokens, num_experts, latent, topk, config):
        """The constructor's arguments on their own (local); returns (config, max_tokens,
        num_experts, latent, topk) as EpConfig and Python ints."""
        config = EpConfig() if config is None else config
        if not isinstance(config, EpConfig):
            raise TypeError(f"{fn}: config is {type(config).__name__}; expected an EpConfig")
        num_experts = check_int(fn, "num_experts", num_experts)
        latent = check_positive_int(fn, "latent", latent, SCALE_BLOCK)
        topk = check_int(fn, "topk", topk)
        max_tokens = check_int(fn, "max_tokens", max_tokens)
        if num_experts < 1 or num_experts % num_ranks:
            raise ValueError(
                f"{fn}: num_experts={num_experts} must be a positive multiple of the rank"
                f" count {num_ranks}"
            )
        if not 1 <= topk <= num_experts:
            raise ValueError(f"{fn}: topk={topk} outside 1..{num_experts} (num_experts)")
        if max_tokens < 1:
            raise ValueError(f"{fn}: max_tokens={max_tokens} must be >= 1")
        return config, max_tokens, num_experts, latent, topk

    # ----------------------------------------------------------------------------- lifetime
    def __enter__(self) -> EpRouted:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            self.close()
        except RuntimeError:
            # close() refused (another thread is inside a call): the exception that ended the
            # block, if any, is the one to see; the buffers stay until that call returns.
            if exc is None:
                raise

    @property
    def closed(self) -> bool:
        return self._buffers.closed

    @property
    def layout(self) -> EpLayout:
        """The geometry of this rank's symmetric allocation (row counts, region offsets)."""
        return self._buffers.layout

    @staticmethod
    def workspace_bytes(num_ranks: int, max_tokens: int, *, latent: int, topk: int) -> int:
        """Bytes of the buffers one rank's EpRouted allocates on its device for the rows: the
        symmetric allocation (EpLayout: the receive rows and the expert output rows) and the
        staged ids and weights (a few hundred bytes of control words, and the expert counts,
        besides). Local, no
        allocation. Integers of any kind; TypeError for anything else, ValueError for values
        out of range."""
        fn = "EpRouted.workspace_bytes"
        num_ranks = check_positive_int(fn, "num_ranks", num_ranks)
        max_tokens = check_positive_int(fn, "max_tokens", max_tokens)
        latent = check_positive_int(fn, "latent", latent, SCALE_BLOCK)
        topk = check_positive_int(fn, "topk", topk)
        layout = EpLayout(num_ranks, max_tokens, latent, topk)
        staged = max_tokens * topk * (torch.int32.itemsize + torch.float32.itemsize)
        return layout.total_bytes + staged

    def register_layer(self, layer: object, index: int | None = None) -> int:
        """Record a layer that tags its calls (an EpMoeLayer, an engine's per-layer adapter;
        reset() calls its `restart_steps()`): returns its layer index, `index` or, for
        None, the next index in this EpRouted's construction order, skipping those live layers
        took with layer_index= (a dropped layer's index is not given again, so the indices do
        not depend on when the garbage collector frees layers). Local: ranks that build their
        layers in the same order get the same indices. A call of another layer's index on
        another rank raises EpDesyncError on every rank, and so does a call of one index by
        different layers on different ranks (built in other orders): an EpMoeLayer's tag carries
        its dense weights' fingerprint too (ep/layer.py, layer_tag). TypeError, before anything
        is recorded, for a layer without `restart_steps` or that cannot be weakly referenced."""
        owner = type(layer).__name__
        if not callable(getattr(layer, "restart_steps", None)):
            raise TypeError(f"register_layer: {owner} has no restart_steps() for reset() to call")
        try:
            weakref.ref(layer)
        except TypeError:
            raise TypeError(
                f"register_layer: {owner} cannot be weakly referenced (the EpRouted must not keep"
                " its layers alive)"
            ) from None
        if index is None:
            index = self._next_layer_index
            while index in self._layer_indices:
                index += 1
            if index > MAX_LAYER_INDEX:
                raise ValueError(
                    f"{owner}: this EpRouted has numbered {index} layers, past"
                    f" {MAX_LAYER_INDEX}; pass layer_index= (the model's layer number)"
                )
            self._next_layer_index = index + 1
            return self._record_layer(layer, index)
        index = check_layer_index(owner, index)
        if index in self._layer_indices:
            raise ValueError(f"{owner}: layer_index={index} is taken by another layer")
        return self._record_layer(layer, index)

    def _record_layer(self, layer: object, index: int) -> int:
        self._layer_indices[index] = layer
        self._layers.add(layer)
        return index

    # ----------------------------------------------------------------------------- geometry
    def prepare(self, tokens: int) -> int:
        """Check `tokens` and get ready for steps of that size; returns stride(T). Local, cheap."""
        tokens = check_tokens("EpRouted.prepare", tokens, self.max_tokens)
        return self._buffers.layout.stride(tokens)

    @property
    def pending(self) -> bool:
        """True while a dispatch awaits its combine (or abort_step) on this rank. Local."""
        return self._step is not None

    @_one_thread
    def abort_stale_step(self, fn: str, owner: object) -> None:
        """For an engine's split dispatch and combine hooks, at the next dispatch: when the pending
        dispatch is `owner`'s (`dispatch(..., owner=)`: the same object, an equal integer of any
        kind, or an equal str, bytes or tuple, `same_owner`; TypeError for None, a plain caller's)
        and its combine never came on this rank (the engine raised between its hooks), take part in
        that step's combine without payload (`abort_step`, ordered after the stale dispatch's
        stream) and raise RuntimeError naming `fn` and the stale step's tag; this call did not
        start. Nothing when no dispatch is pending or another caller's is (its own combine is still
        to come: the dispatch that follows refuses to start, locally, as before).

        CPU: the peers raise EpPeerError in the combine they wait in, and the next call runs
        as usual. GPU: the peers' step is NaN and they raise EpPeerError at their next call or
        poll(), but their later calls were queued already and no longer pair with this rank's:
        this rank refuses calls until reset() on every rank (the error says so). While a
        CUDA-graph capture runs, or when the stale dispatch was only captured (its graph never
        replayed), nothing is launched: RuntimeError saying to reset() on every rank."""
        if owner is None:
            raise TypeError(
                f"{fn}: owner=None; pass the owner= the engine's dispatch was given (None is a"
                " plain caller's, whose pending step is not an engine hook's to abort)"
            )
        step = self._step
        if step is None or not same_owner(step.owner, owner):
            return
        what = (
            f"{fn}: this rank's dispatch of {tag_text(step.tag)} was never combined (the engine"
            " raised between its dispatch and combine)"
        )
        if step.captured or self._transport.capturing():
            # A combine launched now would go into a graph the error ends, or pair with a
            # dispatch that never ran on the device.
            if step.captured:
                self._step = None
            self._broken = f"{what} inside a CUDA-graph capture; call reset() on every rank"
            raise RuntimeError(self._broken)
        if step.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(step.stream)
        on_gpu = not self._transport.completes_on_return
        after = (
            "the peers' later calls were queued already: call reset() on every rank"
            if on_gpu
            else "call it again"
        )
        try:
            self.abort_step(
                RuntimeError(
                    f"{what}; that step is aborted on every rank and this call did not start:"
                    f" {after}"
                )
            )
        finally:
            if on_gpu:
                self._broken = f"{what}, and that step was aborted; call reset() on every rank"

    def receive(self, tokens: int | None = None) -> ReceiveRows:
        """This rank's receive rows of the dispatched step (valid until its combine), or, with no
        dispatch pending, the views for a step of `tokens` tokens (for callers that set up where
        their experts write before the dispatch). Local. Every call for the same T returns the
        same view objects (read and write through them; do not resize them). `out` lies in the
        symmetric allocation and the sources' combines read it there, during this rank's
        combine: a combine returns (CPU) or completes on the stream (CUDA) only once every rank
        has read it, so any write ordered after the combine is safe."""
        fn = "EpRouted.receive"
        self._check_usable(fn)
        step = self._step
        if step is None:
            if tokens is None:
                raise RuntimeError(f"{fn}: no dispatch is pending; pass tokens= for the views")
            return self._rows(check_tokens(fn, tokens, self.max_tokens))
        if tokens is not None and tokens != step.tokens:
            raise ValueError(
                f"{fn}: tokens={tokens!r}, but the pending dispatch has T={step.tokens}"
            )
        return self._rows(step.tokens)

    def step_failure(self) -> StepFailure:
        """For a caller that runs its experts itself between `dispatch` and `combine`: the
        dispatched step's StepFailure (comm/failure.py), to pass as `failure=` to a backend whose
        `device_failures` is True, as `routed` does, so that a call those experts cannot compute
        (over HopperExperts' pair budget) fails the step on every rank at the combine. Local."""
        fn = "EpRouted.step_failure"
        self._check_usable(fn)
        if self._step is None:
            raise RuntimeError(f"{fn}: no dispatch is pending")
        return self._transport.step_failure(self._step.tag)

    def _rows(self, tokens: int) -> ReceiveRows:
        """The views of a step of T tokens, made once per T (each call of a step took them twice:
        their slicing was most of EpRouted's own host time per eager step)."""
        views = self._rows_of.get(tokens)
        if views is None:
            b = self._buffers
            rows = b.layout.rows(tokens)
            views = ReceiveRows(b.x(rows), b.sf(rows), b.ids(rows), b.weights(rows), b.out(rows))
            self._rows_of[tokens] = views
        return views

    def expert_counts(
        self, out: torch.Tensor | None = None, *, accumulate: bool = False
    ) -> torch.Tensor:
        """The (token, k) pairs this rank received per local expert in the last dispatch (for
        expert-load balancing; after a `routed` step run in pieces, the sum over its pieces),
        counted right after that dispatch (EpConfig.count_experts must
        be on): int32 [E_local] on the device, a new tensor, or written into `out` (int32 or
        int64 [E_local] on the device; `accumulate=True` adds to it, as a load recorder
        sums over steps). Stream-ordered, no host sync, no allocation with `out`. After a step
        that failed on this rank (any error it raised) it raises RuntimeError: its rows are not
        one step's. On CUDA a dispatch that failed on a peer only, not known on the host yet,
        counts zero for every expert (the failure itself comes from poll())."""
        fn = "EpRouted.expert_counts"
        self._check_usable(fn)
        if self._counts is None:
            raise RuntimeError(
                f"{fn}: build the EpRouted with EpConfig(count_experts=True): the counts are taken"
                " at each dispatch, before a peer's next dispatch overwrites the receive rows"
            )
        if self._last_tokens is None:
            raise RuntimeError(f"{fn}: no dispatch yet")
        if self._step_failure is not None:
            raise RuntimeError(
                f"{fn}: the last step failed ({self._step_failure}); its receive rows are not one"
                " step's, so there are no counts for it"
            )
        if out is None:
            return self._counts.clone()
        check_tensor(
            fn, "out", out, (torch.int32, torch.int64), (self.experts_per_rank,), self.device
        )
        check_flag(fn, "accumulate", accumulate)
        if accumulate:
            out.add_(self._counts)
        else:
            out.copy_(self._counts)
        return out

    def _count_experts(self, tokens: int) -> None:
        """self._counts = this rank's received (row, k) pairs per local expert in the dispatch
        just made (zeros where the device transport saw the dispatch fail)."""
        ids = self._buffers.ids(self._buffers.layout.rows(tokens))
        local = (ids.long() - self.first_expert).clamp(min=0).flatten()
        self._counts.zero_()
        self._counts.scatter_add_(0, local, (ids >= 0).flatten().int())
        step_ok = getattr(self._transport, "step_ok", None)
        if step_ok is not None:
            self._counts.mul_(step_ok())

    # ----------------------------------------------------------------------------- validation
    def _check_inputs(
        self, fn, latent, ids, weights, experts, need_experts, tokens, tag, limit=None, padding=None
    ):
        """Returns (T, n) for latent [n, L] padded to T tokens. `need_experts`: None is an error
        (routed runs them), not "not given" (dispatch). `limit`: the largest T (max_tokens when
        None; a step run in pieces checks its whole arguments against its own T). `padding`:
        None or bool [>= n] on the device."""
        if not isinstance(latent, torch.Tensor) or latent.dim() != 2:
            shape = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent)
            raise ValueError(f"{fn}: latent {shape}; expected a 2-D tensor [n, {self.latent}]")
        real = latent.shape[0]
        if tokens is None:
            if real == 0:
                raise ValueError(f"{fn}: latent has 0 rows and tokens=None; pass tokens= (T)")
            tokens = real
        tokens = check_tokens(fn, tokens, self.max_tokens if limit is None else limit)
        if real > tokens:
            raise ValueError(f"{fn}: latent has {real} rows, more than tokens={tokens}")
        check_tag(fn, tag)
        check_rows(fn, "latent", latent, torch.bfloat16, (real, self.latent), self.device)
        shape = (real, self.topk)
        check_tensor(fn, "ids", ids, (torch.int32, torch.int64), shape, self.device)
        check_tensor(fn, "weights", weights, (torch.float32,), shape, self.device)
        if padding is not None:
            check_padding(fn, padding, real, self.device)
        inputs = (("latent", latent), ("ids", ids), ("weights", weights), ("padding", padding))
        self._check_outside_buffers(fn, inputs)
        if self.check_values:
            # A padding row's ids and weights are never read: whatever they hold is no error.
            if padding is not None:
                ids = torch.where(padding[:real, None], self._no_expert, ids)
            check_ids(fn, ids, self.num_experts)
            check_weights(fn, weights, ids)
        if experts is not None or need_experts:
            check_experts_match(fn, self, experts)
        return tokens, real

    def _check_norm(self, fn: str, norm_weight: torch.Tensor | None, eps: object) -> float:
        if norm_weight is not None:
            check_tensor(
                fn, "norm_weight", norm_weight, (torch.bfloat16,), (self.latent,), self.device
            )
            check_aligned(fn, "norm_weight", norm_weight)
        return check_eps(fn, eps)

    def _enter(self) -> None:
        """Count a dispatch (or rejection) this thread hands to the transport."""
        me = threading.get_ident()
        self._entered[me] = self._entered.get(me, 0) + 1

    def _entered_here(self) -> int:
        """The dispatches (and rejections) the calling thread handed to the transport so far;
        an EpMoeLayer's call counts once this moved during it."""
        return self._entered.get(threading.get_ident(), 0)

    def _check_usable(self, fn: str) -> None:
        if self._buffers.closed:
            raise RuntimeError(f"{fn}: this EpRouted was closed")
        if self._lost is not None:
            lost = self._lost
            raise EpPeerLostError(
                self.rank, fn, lost.lost, f"seen in phase '{lost.phase}'; close() this EpRouted"
            )
        if self._broken is not None:
            raise RuntimeError(f"{fn}: {self._broken}")

    def _run(self, fn: str, call, rejected: BaseException | None, began: list | None = None):
        """Run a transport call; mark the object unusable until reset() (or for good) when the
        call was cut short in a way that leaves the ranks' states unknown. An exception that
        is not an EpError gets a note saying which recovery it needs (`note_recovery`): none
        after this rank took part in a step that then failed, or after the step's last barrier
        passed (`Transport.final_barrier`); a reset when it came inside the exchange; none when
        the object was closed during the call (its RuntimeError says so: rebuild). `began`: a
        one-element list whose element it sets True as its `try` begins (before that, an
        exception is the caller's to handle)."""
        barriers = self._buffers.barriers
        start = (barriers.epoch, barriers.count)  # plain reads: no call where a handler runs
        try:
            if began is not None:
                # A plain store first: from here an exception is this handler's to note, and
                # `_combine` tells it from one raised before the transport call began.
                began[0] = True
            return call()
        except BaseException as err:
            self._step_failure = f"{type(err).__name__} in {fn}"
            if err is rejected:
                if self._in_pieces:  # this rank took part in the call, then raised its error
                    self._own_failure = err
                note_recovery(err, f"{fn}: {REJECTED_NOTE}")
                raise
            recovery = getattr(err, "recovery", None)
            if isinstance(err, EpError) and recovery == RECOVERY_REBUILD:
                self._lost = err
            elif isinstance(err, EpError) and recovery != RECOVERY_NONE:
                self._broken = f"an earlier call failed ({err}); call reset() on every rank"
            elif self._buffers.closed or self._buffers.barriers.closed_here():
                pass  # closed during the call (a signal handler's close()): nothing to reset
            elif not isinstance(err, EpError) and self._passed_final_barrier(start):
                note_recovery(err, f"{fn}: {COMPLETED_NOTE}")
            elif not isinstance(err, EpError):
                # Not the protocol's own error (those are EpErrors raised by every rank in the
                # same call): an exception raised inside a wait (a signal handler's, of any
                # type) left this rank's barrier count behind its peers'.
                self._broken = (
                    f"an earlier {fn} was interrupted ({type(err).__name__}) inside the exchange;"
                    " call reset() on every rank (collective) before the next step"
                )
                note_recovery(err, f"{fn}: {INTERRUPTED_NOTE}")
            raise

    def _passed_final_barrier(self, start: tuple[int, int]) -> bool:
        """Whether this rank counted the step's last barrier (`Transport.final_barrier`) as
        passed since `start` (the barriers' (epoch, count) when the transport call began): then
        every rank passed it, and an exception raised after it left the ranks in step. In a
        step run in pieces, only its last piece's (the peers go on to the next piece)."""
        barriers, final = self._buffers.barriers, self._transport.final_barrier
        return (
            final is not None
            and (not self._in_pieces or self._last_piece)
            and barriers.passed_phase == final
            and barriers.epoch == start[0]
            and barriers.count > start[1]
        )

    # ----------------------------------------------------------------------------- the path
    @_one_thread
    def dispatch(
        self,
        latent: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        *,
        experts: ExpertsBackend | None = None,
        tokens: int | None = None,
        tag: int | None = None,
        padding: torch.Tensor | None = None,
        owner: object = None,
    ) -> ReceiveRows:
        """Quantize each token to MXFP8 once and deliver it to every rank owning one of its experts.

        latent bf16 [n, L]; ids int32|int64 [n, K] global expert ids, -1 = none (int64 ids outside
        -1..E-1 select no expert when the values are not checked); weights fp32 [n, K]. tokens: T,
        the step's token count, the same on every rank (None: n); rows n..T-1 are padding (no
        expert). tag: an int identifying the step, or None (see the class docstring).
        padding: None, or bool [>= n] on the device, True for a padding row among the n (an
        engine's persistent mask: vLLM's `is_padding`): such a row selects no expert whatever its
        ids and weights hold. Applied where the ids are staged (the one kernel that copies them
        either way), so it costs no launch and a CUDA graph reads the live mask at each replay.
        Collective; on CPU it blocks until every rank has delivered. Returns this rank's receive
        rows. `experts`, when given, is validated with the inputs. `owner`: who dispatches (an
        engine hook's marker, for `abort_stale_step`), recorded with the pending step. An input
        lying in this object's own buffers (receive()'s rows, which the peers' dispatch writes)
        is refused: ValueError on this rank, EpPeerError on the others.
        """
        return self._dispatch(
            "EpRouted.dispatch",
            latent,
            ids,
            weights,
            experts,
            False,
            tokens,
            tag,
            padding=padding,
            owner=owner,
        )

    def _dispatch(
        self,
        fn,
        latent,
        ids,
        weights,
        experts,
        need_experts,
        tokens,
        tag,
        checked=True,
        padding=None,
        owner=None,
    ):
        self._check_usable(fn)
        if self._step is not None:
            raise RuntimeError(
                f"{fn}: the previous dispatch was not combined yet; call combine (or abort_step)"
                " on every rank first: after an error of this rank's own between its dispatch"
                " and its combine, abort_step(error) ends that step on every rank"
            )
        self._step_failure = None
        self._reset_dropped_step = False
        error, real = None, 0
        try:
            tokens, real = self._check_inputs(
                fn, latent, ids, weights, experts, need_experts, tokens, tag, padding=padding
            )
            weights = self._stage(ids, weights, padding, tokens, real)
        except Exception as err:
            # Bad input, or a torch error while staging it: this rank rejects the step through
            # the transport, so its peers raise too instead of pairing with its next call.
            error, tokens = err, 0
        wire_tag = _wire_tag(tag)
        staged_ids = self._ids[:tokens]

        def exchange():
            # Counted inside `_run`'s try: an interrupt before it (at the call of `_run`) sent
            # nothing, and an EpMoeLayer's call then does not count (its retry pairs); one
            # after it is `_run`'s to note (a careless-user probe: counted before `_run`, the
            # call counted with nothing sent and the layer's retry desynced).
            self._enter()
            return self._transport.dispatch(
                latent,
                staged_ids,
                weights,
                tokens=tokens,
                rejected=error,
                cause=CAUSE_INPUT,
                tag=wire_tag,
                checked=checked,
            )

        self._run(fn, exchange, error)
        captured, stream = False, None
        if owner is not None and self.device.type == "cuda":  # only an engine hook's dispatch
            captured = self._transport.capturing()
            stream = torch.cuda.current_stream(self.device)
        self._step = _Step(tokens, real, wire_tag, staged_ids, owner, captured, stream)
        self._last_tokens = tokens
        if self._unwritten is not None:
            # Every expert output row of the step is marked; the experts overwrite the rows they
            # own, and the check before the combine finds the marks left on rows with a local id.
            mark_rows(self._rows(tokens).out)
        if self._counts is not None:
            self._count_experts(tokens)
        return self._rows(tokens)

    def _stage(self, ids, weights, padding, tokens: int, real: int) -> torch.Tensor:
        """Write the step's ids into the staged ids [T, K] (int32; rows n..T-1 and those
        `padding` marks get -1) and return the weights the dispatch reads (staged fp32 [T, K]
        when padding rows must follow the caller's n rows or its tensor does not start on the
        16-byte boundary the GPU kernel's loads need; else the caller's).

        The ids are copied, never referenced: combine reads them again and the caller may reuse
        its tensor in between. int64 ids outside int32 would wrap in the copy (2**32 + 3 becomes
        expert 3): they are clamped to -1..E first, and E, like any id past the last rank's
        experts, selects no rank."""
        staged_ids = self._ids[:tokens]
        if ids.dtype == torch.int64:
            # torch.where into the int32 staged ids needs int32 ids: the mask is applied to the
            # clamp's own copy instead (one launch more than int32 ids take).
            ids = ids.clamp(-1, self.num_experts)
            if padding is not None:
                ids.masked_fill_(padding[:real, None], -1)
            staged_ids[:real].copy_(ids)
        elif padding is None:
            staged_ids[:real].copy_(ids)
        else:  # one launch, as the copy: the mask read on the device
            torch.where(padding[:real, None], self._no_expert, ids, out=staged_ids[:real])
        if real < tokens:
            staged_ids[real:].fill_(-1)
        if real < tokens or not vector_start(weights):
            self._weights[:real].copy_(weights)
            return self._weights[:tokens]
        return weights

    @_one_thread
    def combine(
        self,
        norm_weight: torch.Tensor | None,
        *,
        eps: float = DEFAULT_NORM_EPS,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Read each of this rank's tokens' expert sums where they lie (`receive().out` of every
        rank owning one of the token's experts: the experts wrote them there since the
        dispatch; the combine completes only once every rank has read this rank's rows), sum
        them over ranks in fp32 in rank order, then RMSNorm with `norm_weight`
        (bf16 [L]) and `eps`; norm_weight None returns the plain sum rounded to BF16 (for a
        caller that applies the norm itself, or a model without a latent norm).

        Collective; on CPU it blocks until every rank has delivered. Returns bf16 [n, L] (the
        real rows of the dispatch): `out` when given (bf16 [n, L], rows 16-byte aligned), which
        the kernel writes in place when it is contiguous, n = T and it shares no byte with
        `norm_weight` nor with this object's buffers (whose rows the peers read until the combine
        completes), else a copy lands there once it has. A norm weight lying in this object's
        buffers, or an `out` lying in them outside receive().out (rows the peers' next dispatch
        writes), is refused (ValueError on this rank, EpPeerError on the others).
        """
        return self._combine("EpRouted.combine", norm_weight, eps, None, CAUSE_INPUT, out)

    @_one_thread
    def reject_step(
        self, error: BaseException, *, tag: int | None = None, tokens: int | None = None
    ) -> None:
        """Instead of dispatch, for a rank that cannot take part in this step with inputs (its
        caller failed before the dispatch): take part in the step's dispatch and combine without
        payload (no peer waits for this rank; every peer raises EpPeerError: in this call on CPU,
        at its next call on CUDA), then raise `error`. An exception class is instantiated (as
        `raise` does); anything else fails the step with a TypeError saying so. `tokens`: the
        step's T, when the peers pass one above max_tokens (`routed` runs such a step in pieces:
        this rank rejects every piece its peers run). Collective, like dispatch + combine."""
        fn = "EpRouted.reject_step"
        error = _as_exception(fn, error)
        self._check_usable(fn)
        if self._step is not None:
            raise RuntimeError(f"{fn}: a dispatch is pending; call combine or abort_step")
        self._step_failure = f"{type(error).__name__} in {fn}"
        self._reset_dropped_step = False
        try:  # an int of any kind, as routed takes it; anything else rejects one step
            total = None if tokens is None else check_int(fn, "tokens", tokens)
        except TypeError:
            total = None
        steps = 1
        if total is not None and self.max_tokens < total <= MAX_STEP_TOKENS:
            steps = -(-total // self.max_tokens)
        for index in range(steps):
            this_tag = tag if steps == 1 else piece_tag(_wire_tag(tag), total, index)
            cause = CAUSE_REJECT_STEP if index == 0 else CAUSE_EARLIER_PIECE
            try:
                self._reject_piece(fn, error, cause, this_tag, checked=index == 0)
            except BaseException as err:
                if steps > 1:
                    _in_piece(err, index, steps, total, self.max_tokens)
                raise
            if self._transport.completes_on_return:
                break  # CPU: every peer raised in this piece
        raise error

    def _reject_piece(self, fn, error, cause, tag, checked) -> None:
        """Take part in one step (or piece) without payload, rejecting it with `error` and
        `cause`; returns (the caller raises `error`). Other errors propagate."""

        def exchange():
            self._enter()  # inside `_run`'s try, as dispatch's
            return self._transport.dispatch(
                None,
                self._ids[:0],
                self._weights[:0],
                tokens=0,
                rejected=error,
                cause=cause,
                tag=_wire_tag(tag),
                checked=checked,
            )

        try:
            self._run(fn, exchange, error)
        except BaseException as err:
            if err is not error:
                raise

    @_one_thread
    def abort_step(self, error: BaseException) -> None:
        """Instead of combine, after a dispatch whose experts failed on this rank: take part in the
        step's combine without payload (no peer waits for this rank; every peer raises
        EpPeerError: in this call on CPU, at its next call on CUDA, where its output of the step
        is NaN), then raise `error`. An exception class is instantiated (as `raise` does);
        anything else fails the step with a TypeError saying so. Collective, like combine."""
        fn = "EpRouted.abort_step"
        self._combine(fn, None, DEFAULT_NORM_EPS, _as_exception(fn, error), CAUSE_ABORT_STEP, None)

    def _combine(self, fn, norm_weight, eps, error, cause, out) -> torch.Tensor:
        self._check_usable(fn)
        step = self._step
        if step is None:
            refusal: Exception = RuntimeError(f"{fn}: no dispatch to combine")
            if self._reset_dropped_step:
                # The caller's own experts of the dispatch a reset() dropped (a signal handler's,
                # nested in them) may have stored a failure record after it (_abandon_call).
                self._reset_dropped_step = False
                self._drop_abandoned_failure()
                # As `routed` says of a call a reset overtook: the peers' step failed and they
                # reset too (EpDesyncError), so every rank goes on to its next step. "Dispatch
                # it again" here had this rank retry a step its peers had left (a careless-user
                # probe: with tag=step every later step desynced).
                refusal = EpResetDuringCallError(
                    f"{fn} (rank {self.rank}): no dispatch to combine: reset() ran on this rank"
                    " since the step's dispatch (from a signal handler inside its experts, say),"
                    " which dropped the step on every rank; nothing of it was used. The ranks are"
                    " in step after that reset: the next call needs no reset"
                )
            if error is not None:  # abort_step's error stays the cause
                raise refusal from error
            raise refusal
        self._step = None
        began = [False]  # set by `_run` as its try begins: this call's transport combine
        try:
            return self._combine_step(fn, step, norm_weight, eps, error, cause, out, began)
        except BaseException as err:
            if began[0]:
                raise  # the transport's combine began: `_run` noted this, or it completed
            # Raised before the transport's combine began (an interrupt at a call there, at
            # `_run`'s own call included): the step was taken off the object here and the peers
            # wait in its combine. Before (a careless-user probe): a bare exception, the peers
            # waiting out the combine, and every rank's next call raised EpDesyncError.
            _keep_context(err, error)
            self._reject_in_combine(fn, step, err, cause)
            raise

    def _reject_in_combine(
        self, fn: str, step: _Step, failure: BaseException, cause: str, pending: bool = False
    ) -> None:
        """Take part in dispatched `step`'s combine without payload, rejecting it with
        `failure` (an exception raised on this rank before it took part: the peers wait there),
        so that the step fails on every rank and the ranks stay in step; raises `failure` with
        `_run`'s note (no reset needed). Returns without an exchange where there is none to take
        part in (not `_in_step_usable`); the caller raises `failure`, whose own way says the
        recovery.
        `pending`: the step is still the object's pending one (taken off it here). From `_run`'s
        call until the rejection's exchange begins, calls are refused until reset() (an
        interrupt there, a second one, leaves the peers waiting) and such an exception says so;
        one raised in the checks before carries no note (a reset on every rank recovers)."""
        if not self._in_step_usable():
            return
        if pending:
            self._step = None
        refused = (
            f"an earlier {fn} was interrupted before it took part in the step's combine;"
            " call reset() on every rank (collective) before the next step"
        )
        self._step_failure = f"{type(failure).__name__} in {fn}"
        began = [False]

        def exchange():
            # The rejection's exchange begins: from here `_run` judges what it leaves, and other
            # threads' calls (poll()) are no longer told to reset (a careless-user probe: they
            # were, through the whole exchange, for a step that needed none).
            if self._broken is refused:
                self._broken = None
            return self._transport.combine(
                step.ids, None, DEFAULT_NORM_EPS, rejected=failure, cause=cause, tag=step.tag
            )

        self._broken = refused  # a plain store, right before the try
        try:
            self._run(fn, exchange, failure, began)
        except BaseException as err:
            if not began[0]:
                note_recovery(err, f"{fn}: {INTERRUPTED_NOTE}")
            raise
        finally:
            if began[0] and self._broken is refused:  # `_run` judged its exchange itself
                self._broken = None

    def _combine_step(self, fn, step, norm_weight, eps, error, cause, out, began) -> torch.Tensor:
        """`_combine` of the dispatched `step` once it was taken off the object: the checks,
        then the transport's combine, rejecting the step with `error` (or the checks' error);
        `began` as `_run` takes it."""
        if error is None:
            # Any exception here (a KeyboardInterrupt, a tensor type the checks cannot read)
            # rejects the step: the step was dispatched, so this rank must take part in its
            # combine, or its peers would wait there until timeout_s.
            try:
                eps = self._check_norm(fn, norm_weight, eps)
                self._check_outside_buffers(fn, (("norm_weight", norm_weight),))
                if out is not None:
                    self._check_out(fn, out, step.real)
            except BaseException as err:
                error, cause = err, CAUSE_INPUT
        if error is None and self._unwritten is not None:
            # Rows with a local id left unwritten fail the step through its status word, as
            # failed experts do: the combine then fails it on every rank (comm/failure.py). A
            # check that raises (a Triton compile, an interrupt) fails it as the experts' error,
            # so that this rank still takes part in the combine.
            rows = self._rows(step.tokens)
            try:
                self._unwritten.fail_step(
                    rows.out, rows.ids, self._transport.step_failure(step.tag)
                )
            except BaseException as err:
                error, cause = err, CAUSE_EXPERTS
        if error is not None:
            self._step_failure = f"{type(error).__name__} in {fn}"
        # The kernel writes T contiguous rows: the caller's buffer takes them in place only then,
        # only when it holds no byte of the norm weight, which every CTA reads as the others
        # write their rows, and none of this object's buffers, whose expert rows the peers read
        # until the combine completes (then a copy into them is safe: "combine-end").
        in_place = (
            error is None
            and isinstance(out, torch.Tensor)
            and step.real == step.tokens
            and out.is_contiguous()
            and not lies_in(out, *self._segment_span)
        )
        if in_place and isinstance(norm_weight, torch.Tensor):
            in_place = not shares_bytes(out, norm_weight)
        direct = out if in_place else None
        normed = self._run(
            fn,
            lambda: self._transport.combine(
                step.ids,
                norm_weight,
                eps,
                rejected=error,
                cause=cause,
                tag=step.tag,
                out=direct,
            ),
            error,
            began,
        )
        if out is None:
            return normed[: step.real]
        if direct is None:
            out.copy_(normed[: step.real])
        return out

    def _check_out(self, fn: str, out: object, rows: int) -> None:
        """ValueError unless `out` is bf16 [rows, L] on the device, writable here (not requiring
        grad under autograd, not an inference tensor outside inference mode), and, where it
        lies in this object's buffers, within receive().out: the other receive rows (x, sf, ids,
        weights, flags) are the peers' to write, by their next dispatch as soon as this combine
        completes, before a copy into them could land (receive().out is written by this rank's
        experts only, and read by the peers until combine-end)."""
        check_rows(fn, "out", out, torch.bfloat16, (rows, self.latent), self.device)
        # Writes torch refuses, found here so that the step is refused on every rank: the
        # transport writes `out` in place after the exchange, where an error is this rank's alone.
        if out.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{fn}: out requires grad, and torch refuses writes into it under autograd: pass"
                " a tensor that does not (the call is inference-only), or call under no_grad()"
            )
        if out.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(
                f"{fn}: out is an inference tensor (made under torch.inference_mode()) and this"
                " call runs outside inference mode, where torch refuses writes into it: pass"
                " another tensor, or call inside inference mode"
            )
        if lies_in(out, *self._segment_span):
            first, end = byte_span(out)
            out_first, out_end = self._out_span
            if first < out_first or end > out_end:
                raise ValueError(
                    f"{fn}: out lies in this EpRouted's receive rows other than receive().out"
                    " (x, sf, ids, weights or flags), which the peers' next dispatch writes as"
                    " soon as the combine completes: pass receive().out rows or another buffer"
                )

    @_one_thread
    def routed(
        self,
        latent: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        norm_weight: torch.Tensor | None,
        *,
        experts: ExpertsBackend,
        eps: float = DEFAULT_NORM_EPS,
        tokens: int | None = None,
        tag: int | None = None,
        out: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """dispatch -> experts.forward on the receive rows -> combine. Returns bf16 [n, L] =
        RMSNorm(sum over the token's experts of weight * expert(latent)) (norm_weight None: the
        plain sum), into `out` when given (as `combine`). Arguments as `dispatch` and `combine`.
        Collective. An exception after the dispatch (inside the experts, KeyboardInterrupt
        included) still completes the step on every rank (this rank aborts it; its peers'
        EpPeerError names the experts and, on CPU, the error) and is then raised. A backend with
        `device_failures` gets the step's StepFailure (`step_failure()`): a call it finds on the
        device it cannot compute (HopperExperts over its pair budget) fails the step on every
        rank, this rank raising EpPairBudgetError and its peers EpPeerError (CPU: in this call;
        GPU: at the next call, poll() or synchronize(), every rank's output of the step NaN);
        so do rows left unwritten under EpConfig.check_expert_rows (EpUnwrittenRowsError).

        A step of more than `max_tokens` tokens (T = `tokens`, the same on every rank) runs as
        ceil(T / max_tokens) steps of at most max_tokens tokens each, rank r passing its rows of
        each (possibly none): every rank runs the same steps, known from T alone. The transport
        and the combine treat every token alone, so the result is that of one step of T bit for
        bit with an experts backend whose rows do not depend on the rows beside them; the
        library's backends group a call's rows into GEMMs, whose sums may run in another order
        for another row count (within the rounding model). An `out` that may share memory with
        the latent (`may_overlap`; the latent itself excepted), the ids, the weights, the norm
        weight, the padding (`out_overlaps_inputs`) or this object's own buffers (receive()'s
        rows, which every piece rewrites) gets the step's rows by one copy at the end, so no
        piece writes a byte a later piece has yet to read; a step that fails
        leaves `out` without a defined result. T is below 2^31 (a larger one is
        refused, as one step). The first piece's tag carries T (comm/tags.py), so ranks whose T
        differ raise in it on every rank, naming each rank's T (CPU: EpTokenCountError, a
        ValueError; CUDA: EpDesyncError, since the ranks may run different piece counts), and an
        error raised in a piece says which piece of which step."""
        fn = "EpRouted.routed"
        try:
            total = latent.shape[0] if tokens is None else check_int(fn, "tokens", tokens)
        except (AttributeError, TypeError, IndexError):  # IndexError: a 0-dim latent
            total = None  # the step's validation rejects it on this rank, collectively
        if total is None or total <= self.max_tokens or total > MAX_STEP_TOKENS:
            # One step (a T past the bound is refused in it, on every rank: no 1e20 pieces).
            return self._routed_step(
                fn, latent, ids, weights, norm_weight, experts, eps, tokens, tag, out, padding
            )
        refused, n = None, 0
        try:  # the whole call's arguments, before they are cut: a piece sees only its rows
            _, n = self._check_inputs(
                fn, latent, ids, weights, experts, True, total, tag, limit=total, padding=padding
            )
            if out is not None:
                self._check_out(fn, out, n)
            self._check_outside_buffers(fn, (("norm_weight", norm_weight),))
        except Exception as err:  # as one step's dispatch takes any error of its checks
            refused = err
        return self._routed_pieces(
            fn,
            latent,
            ids,
            weights,
            norm_weight,
            experts,
            eps,
            total,
            tag,
            out,
            padding,
            n,
            refused,
        )

    def _check_outside_buffers(self, fn, named) -> None:
        """ValueError when an input, (name, tensor or None) of `named`, lies in this object's own
        buffers (receive()'s rows): the peers' dispatch writes the x, sf, ids and weights rows
        while this rank's dispatch reads its inputs, this rank's experts write receive().out, and
        every piece of a step above max_tokens rewrites them all; such an input would be read
        half rewritten."""
        first, end = self._segment_span
        for name, t in named:
            if isinstance(t, torch.Tensor) and lies_in(t, first, end):
                raise ValueError(
                    f"{fn}: {name} lies in this EpRouted's own buffers (receive()'s rows), which"
                    " the ranks' dispatch and experts rewrite during the call: pass a copy"
                )

    def _routed_pieces(
        self,
        fn,
        latent,
        ids,
        weights,
        norm_weight,
        experts,
        eps,
        total,
        tag,
        out,
        padding,
        n,
        refused,
    ) -> torch.Tensor:
        """A step of T = `total` > max_tokens tokens as ceil(T / max_tokens) pieces (`routed`),
        the latent's n rows cut along them. A rank whose arguments were refused (`refused`) or
        that fails a piece (its input or its experts) takes part in the remaining pieces without
        payload where the peers learn of a failure only at their next call (CUDA), so every
        rank runs every piece and the pieces stay paired; on CPU every rank raises in the
        failing piece. Then it raises its error."""
        self._in_pieces = True
        try:
            steps = -(-total // self.max_tokens)
            result = out
            if refused is None and (
                out is None
                or out_overlaps_inputs(out, latent, ids, weights, norm_weight, padding)
                or lies_in(out, *self._segment_span)
            ):
                # A piece's output rows must not land on what a later piece reads before it reads
                # it: an `out` sharing memory with the latent (other than the latent itself), the
                # ids, the weights, the norm weight, the padding or this object's own buffers
                # (receive()'s rows, which every piece rewrites) takes the result by one copy at
                # the end.
                result = torch.empty(n, self.latent, dtype=torch.bfloat16, device=self.device)
            # The pieces' expert counts, summed: expert_counts() gives the whole step's.
            counts = None if self._counts is None else torch.zeros_like(self._counts)
            failure, cause = refused, CAUSE_INPUT
            for index in range(steps):
                this_tag = piece_tag(_wire_tag(tag), total, index)
                checked = index == 0  # later pieces run to the end on every rank
                self._last_piece = index == steps - 1
                piece = (index, steps, total, this_tag, checked)
                if failure is not None:
                    if self._reject_in_piece(fn, failure, cause, piece):
                        break  # CPU: every peer raised in this piece
                    cause = CAUSE_EARLIER_PIECE
                    continue
                start = index * self.max_tokens
                step_tokens = min(self.max_tokens, total - start)
                lo, hi = min(start, n), min(start + step_tokens, n)
                self._own_failure = None
                entered = self._entered_here()
                try:
                    self._routed_step(
                        fn,
                        latent[lo:hi],
                        ids[lo:hi],
                        weights[lo:hi],
                        norm_weight,
                        experts,
                        eps,
                        step_tokens,
                        this_tag,
                        result[lo:hi],
                        None if padding is None else padding[lo:hi],
                        checked=checked,
                    )
                except BaseException as err:
                    if index > 0 and self._unsent_piece(entered):
                        # Raised before this piece's dispatch began (an interrupt at the call of
                        # its `_run`), after earlier pieces ran: the peers wait in this piece, so
                        # this rank rejects it and the pieces after it (a review: a bare
                        # exception there, and every rank's next call raised EpDesyncError).
                        failure = err
                        if self._reject_in_piece(fn, failure, CAUSE_INPUT, piece):
                            break  # CPU: every peer raised in this piece
                        cause = CAUSE_EARLIER_PIECE
                        continue
                    if err is not self._own_failure or self._transport.completes_on_return:
                        _in_piece(err, index, steps, total, self.max_tokens)
                        raise
                    failure, cause = err, CAUSE_EARLIER_PIECE
                    continue
                if counts is not None:
                    counts += self._counts
            if failure is not None:
                raise failure
            if counts is not None:
                self._counts.copy_(counts)
            if out is not None and result is not out:
                out.copy_(result)
                return out
            return result
        finally:
            self._in_pieces, self._own_failure, self._last_piece = False, None, True

    def _reject_in_piece(self, fn: str, failure: BaseException, cause: str, piece) -> bool:
        """Take part in piece (index, steps, total, tag, checked) of a step run in pieces without
        payload, rejecting it with `failure` and `cause`; True when every peer raised in it
        (CPU: no later piece runs). Other errors propagate, saying which piece they came in."""
        index, steps, total, tag, checked = piece
        self._step_failure = f"{type(failure).__name__} in {fn}"
        try:
            self._reject_piece(fn, failure, cause, tag, checked)
        except BaseException as err:
            _in_piece(err, index, steps, total, self.max_tokens)
            raise
        return self._transport.completes_on_return

    def _unsent_piece(self, entered: int) -> bool:
        """Whether the piece whose routed step just raised sent nothing and left the object
        usable (`_in_step_usable`): no dispatch handed to the transport since `entered` (this
        thread's entries then) and none pending (an exception inside `_run`'s try before the
        transport call is `_run`'s: it refuses calls until reset())."""
        return self._entered_here() == entered and self._step is None and self._in_step_usable()

    def _in_step_usable(self) -> bool:
        """Whether this rank can still take part in the step its call is in, after an exception
        raised on it before it did: the object neither closed, lost, refusing calls, nor reset
        since the call began (a signal handler's close() or reset(): no exchange follows)."""
        barriers = self._buffers.barriers
        if self._buffers.closed or barriers.closed_here() or barriers.reset_in_call():
            return False
        return self._lost is None and self._broken is None

    def _routed_step(
        self,
        fn,
        latent,
        ids,
        weights,
        norm_weight,
        experts,
        eps,
        tokens,
        tag,
        out,
        padding=None,
        checked=True,
    ):
        """One step of at most max_tokens tokens into `out` (or a new tensor). `checked`: as
        Transport.dispatch."""
        # experts=None is caught by the dispatch's validation, which every rank takes part in.
        resets = self._resets
        before, error = self._step, None
        try:
            rows = self._dispatch(
                fn, latent, ids, weights, experts, True, tokens, tag, checked, padding=padding
            )
        except BaseException as err:
            if self._step is None or self._step is before:
                raise  # the dispatch itself failed (it took part in the step, or says why not)
            # Dispatched, then interrupted (check_expert_rows' mark, the expert count): the
            # step goes on to its combine as failed experts, so that the peers are told.
            error = err
        if error is None:
            try:
                if experts.device_failures:
                    # A call the experts cannot compute (over a pair budget, found on the
                    # device) fails the step through the transport's status word: the combine
                    # then fails it on every rank (comm/failure.py).
                    failure = self.step_failure()
                    experts.forward(
                        rows.x, rows.sf, rows.ids, rows.weights, rows.out, failure=failure
                    )
                else:
                    experts.forward(rows.x, rows.sf, rows.ids, rows.weights, rows.out)
            except BaseException as err:  # every rank must still complete the step
                error = err
        if self._resets != resets:
            # reset() ran on this rank since its dispatch (during its experts, or right after its
            # dispatch barrier, which then recorded the step again): the step was dropped on
            # every rank (the peers reset too, as their EpDesyncError said), so the combine must
            # not exchange in the new epoch. _one_thread's check comes only after it would have.
            self._abandon_call()
            when = "between the call's dispatch and its combine"
            raise _reset_during(fn, self.rank, when) from error
        step = self._step
        try:
            return self._combine(fn, norm_weight, eps, error, CAUSE_EXPERTS, out)
        except BaseException as err:
            if self._step is step and step is not None:
                # Raised before the combine took the step (an interrupt at its call, or at its
                # usability check; a careless-user probe: a bare exception, where a layer's
                # caller has no handle on the pending step): the peers wait in its combine.
                _keep_context(err, error)
                self._reject_in_combine(fn, step, err, CAUSE_EXPERTS, pending=True)
            raise

    @_one_thread
    def warmup(self, tokens: int, experts: ExpertsBackend) -> None:
        """Local (no collective, no exchange): prepare `experts` for steps of `tokens` tokens, so
        that capturing such a step in a CUDA graph compiles nothing: the backend compiles what
        it compiles per receive-row count (HopperExperts' humming kernels) on scratch rows, and
        check_expert_rows' check once (ep/unwritten_rows.py). The dispatch and combine kernels
        were compiled at construction (T is their runtime argument). A T above max_tokens warms
        the steps it runs as (see `routed`)."""
        fn = "EpRouted.warmup"
        self._check_usable(fn)
        total = check_step_tokens(fn, tokens)  # the T a step may have: 1..MAX_STEP_TOKENS
        check_experts_match(fn, self, experts)
        sizes = {min(total, self.max_tokens), (total - 1) % self.max_tokens + 1}
        for size in sorted(sizes):
            experts.warmup(self._buffers.layout.rows(size), self.topk)
        if self._unwritten is not None:  # one compilation for every T
            rows = self._rows(min(sizes))
            self._unwritten.warmup(rows.out, rows.ids)

    __call__ = routed

    def poll(self) -> None:
        """Raise what went wrong since the last poll, without waiting: on CUDA the first error a
        kernel recorded in any step since (a peer's rejection or failed experts, differing tags
        or token counts, a timeout: naming the call, the phase, this rank and the peer), on both
        a peer whose process is gone (EpPeerLostError). Non-blocking, no device sync; not inside
        a CUDA graph capture. A server replaying CUDA graphs calls it once per engine step: the
        outputs of a failed step are NaN rows, and nothing else reports it."""
        fn = "EpRouted.poll"
        self._check_usable(fn)
        if self._transport.capturing():
            raise RuntimeError(
                f"{fn}: called while a CUDA graph is being captured; call it after each replay,"
                " outside the capture"
            )
        self._run(fn, self._transport.poll, None)

    def synchronize(self) -> None:
        """Wait for this rank's queued work and raise what a kernel recorded (as `poll()`). On
        CPU every call completes before it returns and this only checks the state."""
        self._check_usable("EpRouted.synchronize")
        self._run("EpRouted.synchronize", self._transport.synchronize, None)

    @_one_thread
    def reset(self) -> None:
        """Collective, blocks the host: bring every rank back to a clean state after a failed or
        interrupted call (a timeout, a desync, an interrupt): every rank leaves
        whatever call it was in, the host barriers start a new epoch (no message or flag of an
        earlier call can match a later one), a pending dispatch is dropped and the layers'
        step counts restart. Every rank calls it, with no call of this group queued on its
        stream. A peer that waits in a call meanwhile raises EpDesyncError saying to reset()
        too (CPU: in that call; CUDA: its peer watch ends its kernels within peer_watch_s, and
        its next poll(), call or synchronize() raises). After a lost peer it raises
        EpPeerLostError."""
        fn = "EpRouted.reset"
        if self._buffers.closed:
            raise RuntimeError(f"{fn}: this EpRouted was closed")
        if self._lost is not None:
            self._check_usable(fn)
        self._run(fn, self._transport.reset, None)
        self._resets += 1
        self._reset_dropped_step = self._step is not None
        self._step = None
        self._step_failure = "reset() since"
        self._broken = None
        for layer in list(self._layers):
            layer.restart_steps()

    def _abandon_call(self) -> None:
        """What a call overtaken by this rank's reset() left behind goes, as reset() clears it:
        a pending dispatch, the refusal of further calls (the ranks are in step after the
        reset; a lost peer stays lost), and a failure record its experts' kernels stored after
        the reset, which would name the next call (Transport.drop_abandoned_failure). Unless
        one of its launches went into the new epoch (`Transport.launched_after_reset`): then
        the ranks are out of step, and the refusal `_run` set on that launch's EpDesyncError
        stays until the next reset(), which also clears the record (waiting for the stream
        here would wait for that launch's peers)."""
        self._step = None
        self._reset_dropped_step = False
        if self._transport.launched_after_reset is None:
            self._broken = None
            self._drop_abandoned_failure()

    def _drop_abandoned_failure(self) -> None:
        """Transport.drop_abandoned_failure, once for each reset() (it waits for the stream)."""
        if self._dropped_at != self._resets:
            self._transport.drop_abandoned_failure()
            self._dropped_at = self._resets

    @_one_thread
    def close(self) -> None:
        """Release the buffers. Collective by contract; idempotent."""
        if not self._buffers.closed:
            try:
                self._transport.close()
            finally:  # the buffers go even when the transport's close raised
                self._buffers.close()
        self._rows_of.clear()
        self._step = None
