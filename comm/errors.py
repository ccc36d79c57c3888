"""Errors of the communication layer. Each says what happened and what to do next; `recovery`
says the same for code: "none" (the ranks are in step, the next call is good), "reset" (call
reset() on every rank, then the next call is good) or "rebuild" (no usable object: a rank is
gone, so close the EpRouted and restart the job's processes; or a construction failed, so
build the object again on every rank)."""

from __future__ import annotations

from dep_ep.comm.tags import first_piece
from dep_ep.constants import (
    FIRST_PIECE_TAG_BASE,
    GIVEN_TAG_BASE,
    LAYER_FINGERPRINT_BITS,
    LAYER_INDEX_BITS,
    LAYER_TAG_BASE,
    NO_TAG,
)

RECOVERY_NONE, RECOVERY_RESET, RECOVERY_REBUILD = "none", "reset", "rebuild"
# What an error with recovery "reset" tells its caller to do.
RESET_REMEDY = "call reset() on every rank"
# What differing tags in one call mean (the transports' EpDesyncError says it).
TAGS_DIFFER = (
    "a rank skipped a step, called its layers in another order, or built its EpMoeLayers in"
    " another order without layer_index= (pass each layer's number in the model)"
)

# What to do after differing tags: a rank that skipped a call stays a call apart (its later tags
# differ too), so no later call would pair; EpRouted refuses calls until then.
MISALIGNED = (
    "The ranks' calls no longer pair (a skipped call stays skipped): every call of this EpRouted"
    " is refused until reset() on every rank (collective), which restarts the pairing and the"
    " EpMoeLayers' call counts (tags the caller gives must agree again after it)"
)


def tags_differ_text(tags: list[int]) -> str:
    """Why these tags of one call may differ: TAGS_DIFFER, led by different T when one of them is
    the first piece of a step run in pieces (that tag carries its T), by different tags when
    every one is such a first piece of the same T (the caller's tags differ: their digests), by
    a tag= given on some ranks only when every one is one EpMoeLayer's (its own or a given
    one), by different tags or weights of one EpMoeLayer when every one is that layer's given
    tag (its digest covers both), or by different weights when every one is that layer's own
    tag of one call count (the fingerprints differ)."""
    pieces = [first_piece(t) for t in tags]
    given = {given_layer_index(t) for t in tags}
    own = {layer_tag_fields(t) for t in tags}
    layers = {layer_of(t) for t in tags}  # (given tag, layer index) of each
    if None not in layers and len({i for _, i in layers}) == 1 and len(layers) == 2:
        return f"some ranks gave layer {layers.pop()[1]} a tag= and others did not: " + TAGS_DIFFER
    if len(given) == 1 and None not in given:
        return (
            f"the ranks gave layer {given.pop()} different tag= or hold different dense weights"
            " for it (its tags carry a digest of both; after a weight update, refresh() on every"
            " rank): " + TAGS_DIFFER
        )
    if None not in own and len({(index, call) for index, _, call in own}) == 1:
        return (
            f"the ranks' layer {own.pop()[0]} has different dense weights (fingerprints): layers"
            " built in another order without layer_index=, or weights updated without refresh()"
            " on every rank"
        )
    if all(piece is None for piece in pieces):
        return TAGS_DIFFER
    if all(piece is not None for piece in pieces) and len({p[0] for p in pieces}) == 1:
        return (
            "the ranks passed the same T but different tags to a step run in pieces (its first"
            " piece's tag carries T and a digest of the call's tag): " + TAGS_DIFFER
        )
    return (
        "the ranks passed different T (a step above max_tokens runs in pieces, and its first"
        " piece's tag carries T), or " + TAGS_DIFFER
    )


def given_layer_index(tag: int) -> int | None:
    """The layer index of an EpMoeLayer's call given tag= (ep/layer.py, given_layer_tag), or
    None for a tag outside that region. A caller's own tag inside it (EpRouted takes any int64)
    reads as one too."""
    if GIVEN_TAG_BASE <= tag < FIRST_PIECE_TAG_BASE:
        return (tag - GIVEN_TAG_BASE) & ((1 << LAYER_INDEX_BITS) - 1)
    return None


def layer_of(tag: int) -> tuple[bool, int] | None:
    """(given, layer index) of an EpMoeLayer's tag: given True for a call given tag=
    (`given_layer_index`), False for the layer's own (`layer_tag_fields`); None for any other
    tag."""
    index = given_layer_index(tag)
    if index is not None:
        return True, index
    fields = layer_tag_fields(tag)
    return None if fields is None else (False, fields[0])


def layer_tag_fields(tag: int) -> tuple[int, int, int] | None:
    """(layer index, fingerprint, call count) of an EpMoeLayer's own tag (ep/layer.py,
    layer_tag), or None for a tag outside that region. A caller's own negative tag inside it
    (EpRouted takes any int64) reads as one too."""
    if not LAYER_TAG_BASE <= tag < 0:
        return None
    offset = tag - LAYER_TAG_BASE
    index = offset & ((1 << LAYER_INDEX_BITS) - 1)
    fingerprint = (offset >> LAYER_INDEX_BITS) & ((1 << LAYER_FINGERPRINT_BITS) - 1)
    return index, fingerprint, offset >> (LAYER_INDEX_BITS + LAYER_FINGERPRINT_BITS)


def tag_text(tag: int) -> str:
    """A step tag as error messages show it: "no tag" for a call that gave none, "layer i
    (weights f) call s" for an EpMoeLayer's own tag (f: its dense weights' fingerprint, hex),
    "layer i, given tag digest d" for an EpMoeLayer's call given tag= (d: the digest of the
    given tag and the fingerprint, hex), "piece 1 of a step of T=<T>" for the first piece of a
    step run in pieces, else "tag <n>"."""
    if tag == NO_TAG:
        return "no tag"
    index = given_layer_index(tag)
    if index is not None:
        digest = (tag - GIVEN_TAG_BASE) >> LAYER_INDEX_BITS
        return f"layer {index}, given tag digest {digest:011x}"
    piece = first_piece(tag)
    if piece is not None:
        return f"piece 1 of a step of T={piece[0]} (tag digest {piece[1]:08x})"
    fields = layer_tag_fields(tag)
    if fields is not None:
        index, fingerprint, step = fields
        return f"layer {index} (weights {fingerprint:06x}) call {step}"
    return f"tag {tag}"


class EpError(RuntimeError):
    """Base of the library's protocol errors (every rank that takes part raises one)."""

    recovery = RECOVERY_NONE


class EpTimeoutError(EpError):
    """A bounded wait expired: names the rank that waited, the phase and the peer(s) it waited for.

    The ranks' states are unknown afterwards (a peer may still be inside the call): call reset()
    on every rank before the next step. `remedy` ends the message with what to do (RESET_REMEDY
    by default, as EpPeerTimeoutError's; a host barrier passes its own: comm/host_channel.py,
    where the group's constructions say to build again, with `recovery` "rebuild").
    """

    recovery = RECOVERY_RESET

    def __init__(
        self,
        rank: int,
        phase: str,
        peers: str,
        detail: str = "",
        remedy: str = RESET_REMEDY,
        recovery: str = RECOVERY_RESET,
    ) -> None:
        self.rank, self.phase, self.peers, self.recovery = rank, phase, peers, recovery
        msg = f"rank {rank}: timed out in phase '{phase}' waiting for {peers}"
        msg += f" ({detail})" if detail else ""
        super().__init__(msg + (f"; {remedy}" if remedy else ""))


class EpPeerTimeoutError(EpTimeoutError):
    """A peer's bounded wait expired before every rank reached the barrier: the peer gave the
    call up (it raised EpTimeoutError), and so does this rank, in the same call, whether it came
    late itself (every message may have come by now) or waited; nothing of the call is used.
    Names this rank, the phase, the rank that gave up (`gave_up_rank`: one a barrier) and the
    ranks whose arrival this rank found missing (`peers`; read after the give-up, so ranks that
    came late meanwhile are not among them). `remedy` ends the message; `recovery` is the
    peer's: "reset" for an object's barrier, "rebuild" for a construction's
    (comm/host_channel.py: a barrier given up is passed by no rank)."""

    def __init__(
        self,
        rank: int,
        phase: str,
        gave_up_rank: int,
        missing: list[int],
        remedy: str = RESET_REMEDY,
        recovery: str = RECOVERY_RESET,
    ) -> None:
        self.rank, self.phase, self.gave_up_rank = rank, phase, gave_up_rank
        self.peers = f"rank(s) {', '.join(map(str, missing))}" if missing else "a late rank"
        self.recovery = recovery
        late = " (this rank, late)" if rank in missing else ""
        EpError.__init__(
            self,
            f"rank {rank}: in phase '{phase}', rank {gave_up_rank} timed out waiting for"
            f" {self.peers}{late} (its timeout_s): the call is given up on every rank; {remedy}",
        )


class EpDesyncError(EpError):
    """The ranks are out of step: in the same call they passed different tags (one rank skipped
    a step, or ran the layers in another order), or they are in different calls (another phase,
    another EpRouted, a reset on one rank). Names the ranks and what each ran. Their calls no
    longer pair (a rank that skipped a call stays one call apart, and so do its tags): `recovery`
    is "reset", and the EpRouted refuses every call until reset() on every rank, which restarts
    the pairing (and EpMoeLayer's call counts)."""

    def __init__(self, message: str, recovery: str = RECOVERY_RESET) -> None:
        super().__init__(message)
        self.recovery = recovery


class EpTokenCountError(EpError, ValueError):
    """The ranks passed different token counts T in the same call (every rank raises it in that
    call; the next call is good). A ValueError too: the caller's arguments disagree."""


class EpPeerError(EpError):
    """Another rank failed this call (it rejected its input, or its experts failed); no rank used
    the exchanged rows. Names the rank, what failed and, on CPU ranks, its error.

    The rank that failed raises its own error (ValueError/TypeError naming the argument, or the
    experts' exception) instead.
    """


class EpPairBudgetError(EpError):
    """This rank's experts received more (row, local expert) pairs in a step than the pair budget
    their workspace was sized for (HopperExperts' pair_skew), counted on the device: they computed
    nothing, and the step failed on every rank (every rank's output of it is NaN on GPU, nothing
    is returned on CPU; the peers raise EpPeerError naming this rank). Names the rank, the step's
    tag, the pair count and the budget. The ranks stay in step: `recovery` is "none", the next
    step runs as usual (and overflows again under the same routing: raise pair_skew)."""

    def __init__(self, message: str, pairs: int, budget: int, tag: int) -> None:
        super().__init__(message)
        self.pairs, self.budget, self.tag = pairs, budget, tag


class EpUnwrittenRowsError(EpError, ValueError):
    """Under EpConfig.check_expert_rows: this rank's experts left receive rows that hold a local
    expert id unwritten since the step's dispatch (a backend that skips rows, or the split API's
    combine without the experts), so the step failed on every rank before its combine summed
    them (every rank's output of it is NaN on GPU, nothing is returned on CPU; the peers raise
    EpPeerError naming this rank). Names the rank, the step's tag, the rows left unwritten and
    the rows checked. A ValueError (the experts' output was bad), `recovery` "none": the next
    step runs as usual."""

    def __init__(self, message: str, rows: int, checked: int, tag: int) -> None:
        super().__init__(message)
        self.rows, self.checked, self.tag = rows, checked, tag


class EpResetDuringCallError(EpError):
    """reset() ran on this rank while one of its calls was inside (a signal handler's reset(),
    say): that call returns nothing and nothing of it was used. The reset brought every rank to
    a new epoch (the peers reset too, as their EpDesyncError told them), so the ranks are in
    step: `recovery` is "none", and the next call pairs as usual."""


class EpPeerLostError(EpError):
    """A rank of the group is gone (its process exited or was killed, or the rendezvous store it
    hosted is unreachable): names the rank that noticed, the phase and the lost rank. Nothing of
    the group can complete any more: close the EpRouted; the job's processes must be restarted.
    """

    recovery = RECOVERY_REBUILD

    def __init__(self, rank: int, phase: str, lost: str, detail: str = "") -> None:
        self.rank, self.phase, self.lost = rank, phase, lost
        msg = f"rank {rank}: lost {lost} (seen in phase '{phase}')"
        super().__init__(msg + (f": {detail}" if detail else ""))


# An error's text as a rank publishes it to its peers (a failed call's cause, a rejected
# construction, a failed allocation) is cut to this many characters: the rendezvous store takes
# at most 8 MiB a value, and a larger message broke the group's store connection for good.
ERROR_TEXT_CHARS = 16_384


def error_text(error: BaseException) -> str:
    """The text "Type: message" of `error` as its peers are told it: at most ERROR_TEXT_CHARS
    characters of it (the cut said), and, when str() of the error raises, its type and that fact
    (so the rank still publishes its message and raises its own error, instead of raising while
    its peers wait)."""
    try:
        message = str(error)
    except Exception as exc:  # any str() failure: the peers must still be told
        message = f"(its message could not be read: str() raised {type(exc).__name__})"
    text = f"{type(error).__name__}: {message}"
    if len(text) > ERROR_TEXT_CHARS:
        text = f"{text[:ERROR_TEXT_CHARS]} ... ({len(text) - ERROR_TEXT_CHARS} more characters)"
    return text


def ranks_text(ranks) -> str:
    """Ranks as messages name them: "rank 1", "rank 0, rank 1"."""
    return ", ".join(f"rank {r}" for r in ranks)
