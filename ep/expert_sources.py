"""ExpertSources: the expert tensors an EpMoeLayer built its experts backend from, watched for
writes after construction (a server builds its modules, then loads the checkpoint into them).

Most backends prepare their own copy of the weights when they are built (ReferenceExperts a BF16
cache, HopperExperts' humming engine its re-laid copy, TrtllmExperts its shuffled copy;
`ExpertsBackend.copies_weights`): writes into the tensors they were built from never reach them,
and the layer would compute with the weights as they were. So the layer keeps, for each of the
four tensors, a weak reference to the tensor object and one to its storage (it keeps neither
alive: memory the caller frees stays freed), with a digest of the bytes, and compares them at
its first call and in `refresh()`, which refuse a change on every rank instead of computing with
the old copy. The tensor object is read while it lives (a `.data =` or `set_` re-pointing it at
bytes of the same shape is seen); else its storage, through the view's offset, shape and strides
(a temporary view such as `.data` or a slice of a buffer dies at once, its storage lives on with
the buffer). Not seen: tensors replaced rather than written once the objects given and their
storage are gone (`load_state_dict(..., assign=True)` on the parameters given, `.data =` on the
base of a view given, a buffer read again into new memory), which the layer cannot tell from
tensors freed after it was built (a temporary ExpertWeights, `.data = torch.empty(0)`, a storage
resized to 0); it reads neither. A digest can also miss several words changed together whose
weighted differences cancel (ep/digest.py).
"""

from __future__ import annotations

import weakref

import torch

from dep_ep.ep.digest import byte_digest
from dep_ep.experts.weights import TENSORS, ExpertWeights


class _Watched:
    """One tensor the backend was built from: weak references to the tensor object and to its
    storage, the view's geometry on that storage, and the digest of its bytes then."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = weakref.ref(t)
        self.storage = weakref.ref(t.untyped_storage())
        self.dtype, self.device = t.dtype, t.device
        self.view = (t.storage_offset(), tuple(t.shape), t.stride())
        self.digest = byte_digest(t)

    def changed(self) -> bool:
        """Whether the tensor holds other bytes than the digest's, read through the object while
        it lives, else through its storage. Nothing to compare (False): the object and its
        storage gone, a storage freed in place below the view (read no further), or another
        shape (`.data = torch.empty(0)`, say): freed, or replaced by another tensor, which the
        layer cannot see (module docstring)."""
        t = self.tensor()
        offset, shape, stride = self.view
        if t is None:
            storage = self.storage()
            if storage is None or not _holds(storage, self.dtype, offset, shape, stride):
                return False
            t = torch.empty(0, dtype=self.dtype, device=self.device)
            t = t.set_(storage, offset, shape, stride)
        elif tuple(t.shape) != shape or not _holds(
            t.untyped_storage(), t.dtype, t.storage_offset(), t.shape, t.stride()
        ):
            return False
        return not torch.equal(byte_digest(t), self.digest)


def _holds(storage, dtype: torch.dtype, offset: int, shape, stride) -> bool:
    """Whether `storage` holds every element of the view (offset, shape, stride) of `dtype`:
    a storage resized below it (freed in place) must not be read."""
    if any(size == 0 for size in shape):
        return True
    last = offset + sum((size - 1) * step for size, step in zip(shape, stride))
    return storage.nbytes() >= (last + 1) * dtype.itemsize


class ExpertSources:
    """The four tensors of an ExpertWeights (w13, s13, w2, s2) an experts backend was built from,
    watched (module docstring). Built before the backend, so that a write landing while the
    backend copies the tensors shows as a change, never as the state the backend holds."""

    def __init__(self, weights: ExpertWeights) -> None:
        self._watched = [_Watched(t) for t in weights.tensors]

    def changed(self) -> list[str]:
        """The names of the tensors that hold other bytes than those the backend was built from
        (`_Watched.changed`); one device-to-host read a tensor."""
        return [name for name, w in zip(TENSORS, self._watched) if w.changed()]
