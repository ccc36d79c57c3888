"""ep/expert_sources.py: the byte digest that tells an EpMoeLayer its expert tensors were written
in place, and the weak references that keep no tensor alive."""

from __future__ import annotations

import gc

import torch

from dep_ep.config import TINY
from dep_ep.ep.expert_sources import DIGEST_ROW_BYTES, DIGEST_ROWS, ExpertSources, byte_digest
from dep_ep.testing import SyntheticLayer


def test_any_one_byte_changed_changes_the_digest():
    """Fresh random bytes over several digest steps with a short last row: one byte changed at
    random positions (the first, the last, one in the short row, any) changes the digest;
    equal bytes in another tensor give an equal digest."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    size = (DIGEST_ROWS + 3) * DIGEST_ROW_BYTES + 123  # two steps, the last row short
    t = torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)
    digest = byte_digest(t)
    assert digest.shape == (DIGEST_ROWS + 4,)
    assert torch.equal(byte_digest(t.clone()), digest)
    positions = [0, size - 1, size - 50, *torch.randint(0, size, (8,), generator=gen).tolist()]
    for at in positions:
        changed = t.clone()
        changed[at] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
        assert not torch.equal(byte_digest(changed), digest), f"byte {at} of {size}"


def test_two_words_swapped_change_the_digest():
    """The digest weighs each word by its position: two different words of one row swapped
    change it (a plain sum would not), the row's first and last included."""
    t = torch.arange(DIGEST_ROW_BYTES, dtype=torch.int64).remainder(251).to(torch.uint8)
    words = t.view(torch.int32)
    for i, j in ((3, 900), (0, DIGEST_ROW_BYTES // 4 - 1), (1, 513)):
        swapped = words.clone()
        swapped[[i, j]] = words[[j, i]]
        assert words[i] != words[j]
        assert not torch.equal(byte_digest(swapped), byte_digest(t)), (i, j)


def test_a_view_off_a_word_boundary():
    """A tensor starting at an odd byte (a slice of a buffer) digests as its own bytes."""
    buffer = torch.randint(0, 256, (3 * DIGEST_ROW_BYTES,), dtype=torch.uint8)
    view = buffer[1 : 1 + 2 * DIGEST_ROW_BYTES + 7]
    assert torch.equal(byte_digest(view), byte_digest(view.clone()))


def test_sources_see_writes_and_keep_nothing_alive():
    weights = SyntheticLayer(TINY, seed=3).local_weights(12, 12)
    tensors = [t.clone() for t in weights.tensors]
    sources = ExpertSources(type(weights)(*tensors, first_expert=12, num_experts=TINY.experts))
    assert sources.changed() == []
    tensors[1][5, 6, 2] ^= 1
    tensors[2][0, 0, 0] ^= 16
    assert sources.changed() == ["s13", "w2"]
    again = sources.weights()  # the tensors as they are now, checked again
    assert again.tensors[1] is tensors[1] and sources.changed() == []
    del again, tensors
    gc.collect()
    assert sources.alive() is None and sources.changed() == []
