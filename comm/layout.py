"""EpLayout: the geometry of one rank's symmetric allocation and the byte offset of every region."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dep_ep.constants import FLAG_PHASES, FLAG_WORDS, SCALE_BLOCK

ALIGN_BYTES = 256  # every region starts on this boundary (16-byte vector stores, TMA-friendly)


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class Region:
    """One array inside the allocation: `offset` bytes in, `shape` at capacity, `dtype`."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class EpLayout:
    """Receive-row geometry for `num_ranks` ranks, each sending at most `max_tokens` tokens.

    Receive row `s * stride(T) + t` on rank d holds token t of source rank s (the row contract of
    docs/design.md). Regions, each sized for `max_rows = num_ranks * max_tokens` rows:
      x        uint8 [max_rows, latent]   MXFP8 e4m3 bytes of the dispatched latent
      sf       uint8 [max_rows, latent/32] E8M0 scale bytes, linear layout
      ids      int32 [max_rows, topk]     global expert ids this rank owns, -1 elsewhere
      weights  fp32  [max_rows, topk]     routing weights as the source sent them
      out      bf16  [max_rows, latent]   this rank's expert sum for the receive row (the
                                          experts write it; the sources' combines read it)
      flags    int64 [3, num_ranks, 4]    GPU step flags per phase and source (signals.py)
    """

    num_ranks: int
    max_tokens: int
    latent: int
    topk: int

    def __post_init__(self) -> None:
        for name in ("num_ranks", "max_tokens", "latent", "topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"EpLayout: {name}={getattr(self, name)} must be >= 1")
        if self.latent % SCALE_BLOCK:
            raise ValueError(f"EpLayout: latent={self.latent} must be a multiple of {SCALE_BLOCK}")

    @property
    def max_rows(self) -> int:
        return self.num_ranks * self.max_tokens

    def stride(self, tokens: int) -> int:
        """Receive rows reserved per source rank for a step of `tokens` tokens (compact: T)."""
        if not 1 <= tokens <= self.max_tokens:
            raise ValueError(f"EpLayout.stride: tokens={tokens} outside 1..{self.max_tokens}")
        return tokens

    def rows(self, tokens: int) -> int:
        """Receive rows in use for a step of `tokens` tokens: num_ranks * stride(tokens)."""
        return self.num_ranks * self.stride(tokens)

    @property
    def regions(self) -> dict[str, Region]:
        rows, L, K = self.max_rows, self.latent, self.topk
        specs = (
            ("x", (rows, L), torch.uint8),
            ("sf", (rows, L // SCALE_BLOCK), torch.uint8),
            ("ids", (rows, K), torch.int32),
            ("weights", (rows, K), torch.float32),
            ("out", (rows, L), torch.bfloat16),
            ("flags", (FLAG_PHASES, self.num_ranks, FLAG_WORDS), torch.int64),
        )
        out, offset = {}, 0
        for name, shape, dtype in specs:
            out[name] = Region(offset, shape, dtype)
            offset = _align(offset + out[name].nbytes)
        return out

    @property
    def total_bytes(self) -> int:
        last = list(self.regions.values())[-1]
        return _align(last.offset + last.nbytes)
