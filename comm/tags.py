"""Step tags on the wire (int64 words): the tags of a step run in pieces, and what a mismatch of
them says. A call's tag is the caller's, an EpMoeLayer's own (ep/layer.py, layer_tag), the one
an EpMoeLayer sends for a tag given to it (ep/layer.py, given_layer_tag) or NO_TAG;
a step above max_tokens runs in pieces (EpRouted.routed) whose tags `piece_tag` derives from the
call's tag, its T and the piece's index. The first piece carries T in clear, so that ranks whose
T differ find it there and the error names every rank's T (constants.FIRST_PIECE_TAG_BASE)."""

from __future__ import annotations

from dep_ep.constants import FIRST_PIECE_TAG_BASE, LAYER_TAG_BASE, PIECE_DIGEST_BITS

_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1
_DIGEST_MASK = (1 << PIECE_DIGEST_BITS) - 1


def mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit words that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def tag_digest(tag: int) -> int:
    """PIECE_DIGEST_BITS bits of a hash of a call's tag word (the first piece's tag holds it)."""
    return mix64(tag & _MASK64) & _DIGEST_MASK


def piece_tag(tag: int, total: int, index: int) -> int:
    """The tag of piece `index` of a step of T = `total` tokens (< 2^STEP_TOKENS_BITS) run in
    pieces, for a call of tag word `tag` (NO_TAG for none). The first: FIRST_PIECE_TAG_BASE +
    (T << PIECE_DIGEST_BITS) + tag_digest(tag), so ranks whose T differ are told in it; the
    others hash the tag, T and the index into a non-negative int64, so another tag (no tag and
    tag 0 included), another T or a piece of another call differ except by a 2^-63 chance."""
    if index == 0:
        return FIRST_PIECE_TAG_BASE + (total << PIECE_DIGEST_BITS) + tag_digest(tag)
    base = mix64(tag & _MASK64)
    return mix64(base ^ mix64((total << 32) | index)) & _MASK63


def first_piece(tag: int) -> tuple[int, int] | None:
    """(T, tag digest) when `tag` is the tag of the first piece of a step run in pieces, else
    None."""
    if not FIRST_PIECE_TAG_BASE <= tag < LAYER_TAG_BASE:
        return None
    offset = tag - FIRST_PIECE_TAG_BASE
    return offset >> PIECE_DIGEST_BITS, offset & _DIGEST_MASK


def step_totals(tags: list[int], tokens: list[int]) -> list[int] | None:
    """Each rank's T when the differences of these tags (one call, each rank's tag and token
    count) are differences of T alone: some rank runs a step in pieces (its first piece's tag),
    and every rank's tag is such a first piece or a whole step of the same call's tag (the same
    digest). Else None."""
    totals, digests = [], set()
    for tag, count in zip(tags, tokens):
        piece = first_piece(tag)
        total, digest = piece if piece is not None else (count, tag_digest(tag))
        totals.append(total)
        digests.add(digest)
    if all(first_piece(t) is None for t in tags) or len(digests) > 1:
        return None
    return totals
