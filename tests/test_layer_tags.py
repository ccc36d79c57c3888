"""EpMoeLayer's own tags (ep/layer.py): the dense weights' fingerprint is the same for the same
weights however they are held (a copy, a non-contiguous view, nn.Parameters) and differs
between layers; a tag carries the index, the fingerprint and the call count, and error messages
read all three back (comm/errors.py, tag_text); a tag given to a layer is sent with the layer's
index and fingerprint, so one tag given to two layers sends two tags."""

from __future__ import annotations

import torch

from dep_ep.checks import TAG_MAX, TAG_MIN
from dep_ep.comm.errors import TAGS_DIFFER, tag_text, tags_differ_text
from dep_ep.comm.tags import piece_tag
from dep_ep.config import TINY
from dep_ep.constants import (
    FIRST_PIECE_TAG_BASE,
    GIVEN_TAG_BASE,
    LAYER_STEP_BITS,
    LAYER_TAG_BASE,
    MAX_LAYER_INDEX,
    NO_TAG,
)
from dep_ep.ep.layer import dense_fingerprint, given_layer_tag, layer_tag
from dep_ep.experts.checkpoint import dense_shapes


def dense(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen).to(dtype)
        for name, (shape, dtype) in dense_shapes(TINY).items()
    }


def test_fingerprint_follows_the_weights_not_their_storage():
    a = dense(1)
    copy = {name: t.clone() for name, t in a.items()}
    # The same values through non-contiguous views (a transposed copy, transposed back).
    strided = {name: t.t().contiguous().t() if t.dim() == 2 else t for name, t in a.items()}
    for name, t in a.items():  # 1-D: every other element of a buffer twice as long
        if t.dim() == 1:
            strided[name] = torch.stack([t, torch.zeros_like(t)], dim=1).view(-1)[::2]
    params = {name: torch.nn.Parameter(t.clone()) for name, t in a.items()}
    prints = {dense_fingerprint(d) for d in (a, copy, strided, params)}
    assert len(prints) == 1, prints
    others = {dense_fingerprint(dense(seed)) for seed in range(2, 40)}
    assert dense_fingerprint(a) not in others and len(others) == 38
    one_element = {name: t.clone() for name, t in a.items()}
    one_element["gate.weight"][0, 0] += 1
    assert dense_fingerprint(one_element) != dense_fingerprint(a)


def test_fingerprint_reads_every_element():
    """A change of one element anywhere in any dense tensor changes the fingerprint (before, it
    read 64 evenly spaced elements of each, and a weight update in rows it skipped, loaded on
    one rank only, left the ranks' fingerprints equal: that rank computed with the old weights
    and no error; found by a careless-user probe). Fresh positions each run, and every element
    of the smallest tensors; the last bit of a BF16 element is the smallest change."""
    a = dense(1)
    before = dense_fingerprint(a)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    for name, t in a.items():
        flat = t.view(-1)
        positions = torch.randint(0, flat.numel(), (6,), generator=gen).tolist()
        if flat.numel() <= 256:
            positions = range(flat.numel())
        bits = flat.view({2: torch.int16, 4: torch.int32}[t.element_size()])
        for i in positions:
            bits[i] ^= 1
            assert dense_fingerprint(a) != before, f"{name}[{i}] changed, fingerprint did not"
            bits[i] ^= 1
    assert dense_fingerprint(a) == before


def test_layer_tags_carry_index_fingerprint_and_call():
    tag = layer_tag(MAX_LAYER_INDEX, 0xABCDEF, 12)
    assert LAYER_TAG_BASE <= tag < 0 and tag != NO_TAG
    assert tag_text(tag) == f"layer {MAX_LAYER_INDEX} (weights abcdef) call 12"
    assert layer_tag(3, 0xFFFFFF, (1 << LAYER_STEP_BITS) - 1) < 0  # the largest stays negative
    assert layer_tag(3, 5, 1 << LAYER_STEP_BITS) == layer_tag(3, 5, 0)  # the count wraps
    # Any one field that differs gives another tag.
    base = layer_tag(1, 2, 3)
    assert len({base, layer_tag(0, 2, 3), layer_tag(1, 1, 3), layer_tag(1, 2, 2)}) == 4


def test_a_given_tag_is_sent_with_the_layer():
    """tag=t given to layer i sends GIVEN_TAG_BASE + (digest(t, fingerprint) << 16) + i: inside
    its region for every int64 tag a caller may give, apart from NO_TAG, the layers' own tags
    and the first pieces'; the same on every rank for the same layer and tag; another layer
    index, another fingerprint or another tag gives another tag (no two of 200,000 consecutive
    steps of one layer share one); messages read the index back."""
    for given in (TAG_MIN, TAG_MAX, -1, 0, 1, GIVEN_TAG_BASE, LAYER_TAG_BASE):
        for index, fingerprint in ((0, 0), (MAX_LAYER_INDEX, 0xFFFFFF)):
            tag = given_layer_tag(index, fingerprint, given)
            assert GIVEN_TAG_BASE <= tag < FIRST_PIECE_TAG_BASE, (given, index, tag)
            assert tag_text(tag).startswith(f"layer {index}, given tag digest "), tag_text(tag)
    assert given_layer_tag(3, 5, 7) == given_layer_tag(3, 5, 7)
    base = given_layer_tag(1, 2, 3)
    others = {given_layer_tag(0, 2, 3), given_layer_tag(1, 1, 3), given_layer_tag(1, 2, 4)}
    assert base not in others and len(others) == 3
    steps = {given_layer_tag(5, 0x123456, step) for step in range(200_000)}
    assert len(steps) == 200_000
    # One tag given to 64 layers: 64 tags.
    assert len({given_layer_tag(index, 0xABC, 9) for index in range(64)}) == 64
    # Ranks that gave one layer different tags (or hold other weights for it) are told so; two
    # layers, the general reason.
    for theirs in (given_layer_tag(7, 1, 6), given_layer_tag(7, 2, 5)):
        text = tags_differ_text([given_layer_tag(7, 1, 5), theirs])
        assert text.startswith("the ranks gave layer 7 different tag= or hold different dense")
        assert text.endswith(TAGS_DIFFER)
    assert tags_differ_text([given_layer_tag(7, 1, 5), given_layer_tag(8, 2, 5)]) == TAGS_DIFFER


def test_a_layer_with_other_weights_on_another_rank_is_said_to_be_one():
    """The layers' own tags of one index and call count whose fingerprints differ: the reason
    names the weights (build order without layer_index=, a missing refresh()); another call
    count or index: the general reason."""
    text = tags_differ_text([layer_tag(3, 0xA, 5), layer_tag(3, 0xB, 5)])
    assert text.startswith("the ranks' layer 3 has different dense weights"), text
    assert "layer_index=" in text and "refresh()" in text
    assert tags_differ_text([layer_tag(3, 0xA, 5), layer_tag(3, 0xA, 6)]) == TAGS_DIFFER
    assert tags_differ_text([layer_tag(3, 0xA, 5), layer_tag(4, 0xB, 5)]) == TAGS_DIFFER
    # One layer, a tag= on some ranks and none on the others.
    text = tags_differ_text([layer_tag(3, 0xA, 5), given_layer_tag(3, 0xA, 5)])
    assert text.startswith("some ranks gave layer 3 a tag= and others did not"), text


def test_what_differing_tags_of_a_step_in_pieces_are_said_to_mean():
    """The desync message's reason: plain tags, TAGS_DIFFER alone; first pieces of the same T
    whose call tags differ (5 and 6, or 9 and none), different tags, not different T; first
    pieces of different T, different T first."""
    assert tags_differ_text([5, 6]) == TAGS_DIFFER
    for mine, theirs in ((5, 6), (9, NO_TAG)):
        text = tags_differ_text([piece_tag(mine, 20, 0), piece_tag(theirs, 20, 0)])
        assert text.startswith("the ranks passed the same T but different tags"), text
        assert text.endswith(TAGS_DIFFER)
    text = tags_differ_text([piece_tag(5, 20, 0), piece_tag(5, 17, 0)])
    assert text.startswith("the ranks passed different T"), text
