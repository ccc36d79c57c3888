"""ep/expert_sources.py: the byte digest that tells an EpMoeLayer its expert tensors were written
in place, and the weak references that keep no tensor alive."""

from __future__ import annotations

import gc
import weakref

import torch

from dep_ep.config import TINY
from dep_ep.ep.digest import DIGEST_ROW_BYTES, ROWS_PER_STEP, byte_digest
from dep_ep.ep.expert_sources import ExpertSources
from dep_ep.testing import SyntheticLayer


def test_any_one_byte_changed_changes_the_digest():
    """Fresh random bytes over several digest steps with a short last row: one byte changed at
    random positions (the first, the last, one in the short row, any) changes the digest;
    equal bytes in another tensor give an equal digest."""
    seed = int(torch.randint(0, 2**31, (1,)))
    gen = torch.Generator().manual_seed(seed)
    size = (ROWS_PER_STEP + 3) * DIGEST_ROW_BYTES + 123  # two steps, the last row short
    t = torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)
    digest = byte_digest(t)
    assert digest.shape == (ROWS_PER_STEP + 4,)
    assert torch.equal(byte_digest(t.clone()), digest)
    positions = [0, size - 1, size - 50, *torch.randint(0, size, (8,), generator=gen).tolist()]
    for at in positions:
        changed = t.clone()
        changed[at] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
        assert not torch.equal(byte_digest(changed), digest), f"byte {at} of {size}, seed {seed}"


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


def test_strided_views_digest_as_their_elements():
    """A strided 1-D view (every other element of a buffer) and a transposed 2-D view digest as
    a contiguous copy of their elements (before, the 1-D view raised: its bytes cannot be
    viewed in place)."""
    buffer = torch.randn(2 * DIGEST_ROW_BYTES).to(torch.bfloat16)
    every_other = buffer[::2]
    assert torch.equal(byte_digest(every_other), byte_digest(every_other.clone()))
    transposed = buffer.view(64, -1).t()
    assert torch.equal(byte_digest(transposed), byte_digest(transposed.contiguous()))


def test_sources_see_writes_through_the_object_or_its_storage_and_keep_nothing_alive():
    """Writes into the tensor objects, a re-pointed object, writes through a buffer whose
    temporary views were given (the objects gone, the storage alive): each is seen; with the
    objects and their storage gone nothing is watched, and nothing kept them alive."""
    weights = SyntheticLayer(TINY, seed=3).local_weights(12, 12)
    tensors = [t.clone() for t in weights.tensors]
    sources = ExpertSources(type(weights)(*tensors, first_expert=12, num_experts=TINY.experts))
    assert sources.changed() == []
    tensors[1][5, 6, 2] ^= 1
    tensors[2][0, 0, 0] ^= 16
    assert sources.changed() == ["s13", "w2"]
    tensors[1][5, 6, 2] ^= 1
    tensors[2].data = tensors[2].clone()  # re-pointed: the object is read, not the old storage
    assert sources.changed() == ["w2"]
    tensors[2][0, 0, 0] ^= 16  # reverted in the new storage
    assert sources.changed() == []
    tensors[3].set_(torch.zeros_like(tensors[3]))
    assert sources.changed() == ["s2"]
    # Temporary views of buffers: only the storage says where the bytes are.
    buffers = [torch.cat([t.reshape(-1), t.reshape(-1)]) for t in weights.tensors]
    views = [b[: t.numel()].view(t.shape) for b, t in zip(buffers, weights.tensors)]
    watched = ExpertSources(type(weights)(*views, first_expert=12, num_experts=TINY.experts))
    del views
    gc.collect()
    assert watched.changed() == []
    buffers[0][7] ^= 4
    assert watched.changed() == ["w13"]
    dead = weakref.ref(buffers[0])
    del buffers, tensors
    gc.collect()
    assert dead() is None and watched.changed() == [] and sources.changed() == []


def test_freed_or_reshaped_tensors_are_not_read():
    """A storage resized to 0 under the object or under a dead view (freed in place, as FSDP
    frees), and an object re-pointed at an empty tensor (`.data = torch.empty(0)`), have
    nothing to compare: no change, and no read of freed memory (a non-contiguous view
    included)."""
    weights = SyntheticLayer(TINY, seed=4).local_weights(0, 4)
    tensors = [t.clone() for t in weights.tensors]
    base = tensors[2].clone()
    tensors[2] = base.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous, same values
    sources = ExpertSources(type(weights)(*tensors, first_expert=0, num_experts=TINY.experts))
    tensors[0].untyped_storage().resize_(0)
    tensors[1].data = torch.empty(0, dtype=torch.uint8)
    tensors[2].untyped_storage().resize_(0)
    assert sources.changed() == []
    tensors[3][0, 0, 0] ^= 1
    assert sources.changed() == ["s2"]
