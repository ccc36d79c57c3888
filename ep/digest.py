"""byte_digest: a digest of a tensor's bytes computed where the tensor lies (no copy to the host),
for the checks that a tensor was not written: the expert tensors an EpMoeLayer built its backend
from (ep/expert_sources.py) and the fingerprint of a layer's dense tensors (ep/layer.py,
`dense_fingerprint`)."""

from __future__ import annotations

import torch

# The digest: a tensor's bytes as rows of DIGEST_ROW_BYTES, read as int32 words, each row's words
# summed in int64 (wrapping) with the odd position weights (2j + 1) * DIGEST_MULTIPLIER, the row
# sums kept. A change of one word changes its row's sum (an odd weight times a nonzero difference
# below 2^32 is not 0 mod 2^64), and so does a swap of two different words of a row (the weights
# differ by 2(i - j) * DIGEST_MULTIPLIER, at most 2^11 in their power of two); other changes of
# several words cancel only when their weighted differences sum to 0 mod 2^64. ROWS_PER_STEP rows
# a step bound the temporaries (the words as int64 and their weighted products: 4 times the
# bytes, 64 MiB a step).
DIGEST_ROW_BYTES = 4096
ROWS_PER_STEP = 4096
WORD_BYTES = 4
# An odd 64-bit multiplier (the golden ratio's 64-bit constant, as a signed int64).
DIGEST_MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)


def byte_digest(t: torch.Tensor) -> torch.Tensor:
    """int64 [ceil(bytes / DIGEST_ROW_BYTES)] on t's device: each row of DIGEST_ROW_BYTES of t's
    bytes (row-major; the last row zero-padded) as int32 words, summed with the position
    weights. Equal bytes give equal digests; a different digest means different bytes, and the
    comment on DIGEST_ROW_BYTES says which changes of bytes keep it equal."""
    flat = t.detach().contiguous().view(-1).view(torch.uint8)  # a strided view: its copy
    rows = -(-flat.numel() // DIGEST_ROW_BYTES)
    words = DIGEST_ROW_BYTES // WORD_BYTES
    odd = torch.arange(words, dtype=torch.int64, device=t.device) * 2 + 1
    weights = odd * DIGEST_MULTIPLIER
    digest = torch.empty(rows, dtype=torch.int64, device=t.device)
    for start in range(0, rows, ROWS_PER_STEP):
        end = min(start + ROWS_PER_STEP, rows)
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
