"""ExpertSources: the expert tensors an EpMoeLayer built its experts backend from, watched for
writes in place (a server builds its modules, then loads the checkpoint into them).

A backend prepares its own copy of the weights when it is built (ReferenceExperts a BF16 cache,
HopperExperts humming's re-laid copy): writes into the tensors it was built from do not reach
it. The layer therefore keeps weak references to those tensors (it does not keep them alive:
memory the caller frees stays freed) and a digest of their bytes, and compares the digest at its
first call (where it builds the backend again from the tensors when they changed, before any
CUDA graph can hold the old one) and in `refresh()` (where it refuses: a graph captured since
would keep reading the old backend).
"""

from __future__ import annotations

import weakref

import torch

from dep_ep.experts.weights import TENSORS, ExpertWeights

# The digest: a tensor's bytes as rows of DIGEST_ROW_BYTES, read as int32 words, each row's words
# summed in int64 (wrapping) with the odd position weights (2j + 1) * DIGEST_MULTIPLIER, the row
# sums kept. A change of one word changes its row's sum (an odd weight times a nonzero difference
# below 2^32 is not 0 mod 2^64), and so does a swap of two different words of a row (the weights
# differ by 2(i - j) * DIGEST_MULTIPLIER, at most 2^11 in their power of two); other changes of
# several words cancel only when their weighted differences sum to 0 mod 2^64. DIGEST_ROWS rows
# a step bound the int64 temporary (twice the bytes: 32 MiB a step).
DIGEST_ROW_BYTES = 4096
DIGEST_ROWS = 4096
WORD_BYTES = 4
# An odd 64-bit multiplier (the golden ratio's 64-bit constant, as a signed int64).
DIGEST_MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)


def byte_digest(t: torch.Tensor) -> torch.Tensor:
    """int64 [ceil(bytes / DIGEST_ROW_BYTES)] on t's device: each row of DIGEST_ROW_BYTES of t's
    bytes (row-major; the last row zero-padded) as int32 words, summed with the position
    weights. Equal bytes give equal digests; what a different one means: DIGEST_ROW_BYTES."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    rows = -(-flat.numel() // DIGEST_ROW_BYTES)
    words = DIGEST_ROW_BYTES // WORD_BYTES
    odd = torch.arange(words, dtype=torch.int64, device=t.device) * 2 + 1
    weights = odd * DIGEST_MULTIPLIER
    digest = torch.empty(rows, dtype=torch.int64, device=t.device)
    for start in range(0, rows, DIGEST_ROWS):
        end = min(start + DIGEST_ROWS, rows)
        part = flat[start * DIGEST_ROW_BYTES : end * DIGEST_ROW_BYTES]
        full = (end - start) * DIGEST_ROW_BYTES
        if part.numel() != full or part.storage_offset() % WORD_BYTES:
            # the last, short row zero-padded; a start off a word boundary copied (int32 view)
            padded = torch.zeros(full, dtype=torch.uint8, device=t.device)
            padded[: part.numel()] = part
            part = padded
        rows_here = part.view(torch.int32).view(end - start, words).to(torch.int64)
        digest[start:end] = (rows_here * weights).sum(dim=1)
    return digest


class ExpertSources:
    """Weak references to the four tensors of an ExpertWeights (w13, s13, w2, s2) and their
    digests, with the geometry to build an ExpertWeights of them again."""

    def __init__(self, weights: ExpertWeights) -> None:
        self._refs = [weakref.ref(t) for t in weights.tensors]
        self.first_expert, self.num_experts = weights.first_expert, weights.num_experts
        self._take(weights.tensors)

    def _take(self, tensors) -> None:
        """Remember the tensors' shapes and digests as the ones `changed` compares with."""
        self._shapes = [tuple(t.shape) for t in tensors]
        self._digests = [byte_digest(t) for t in tensors]

    def alive(self) -> list[torch.Tensor] | None:
        """The four tensors while every one of them lives, else None (nothing can write them
        through the objects the layer was given)."""
        tensors = [ref() for ref in self._refs]
        return None if any(t is None for t in tensors) else tensors

    def changed(self) -> list[str]:
        """The names of the tensors whose bytes differ from their digests (one host read)."""
        tensors = self.alive()
        if tensors is None:
            return []
        return [
            name
            for name, t, shape, digest in zip(TENSORS, tensors, self._shapes, self._digests)
            if tuple(t.shape) != shape or not torch.equal(byte_digest(t), digest)
        ]

    def weights(self) -> ExpertWeights:
        """An ExpertWeights of the tensors as they are now (checked again), whose digests become
        the ones `changed` compares with. RuntimeError when a tensor is gone."""
        tensors = self.alive()
        if tensors is None:
            raise RuntimeError("ExpertSources.weights: a tensor the layer was given is gone")
        weights = ExpertWeights(
            *tensors, first_expert=self.first_expert, num_experts=self.num_experts
        )
        self._take(weights.tensors)
        return weights
