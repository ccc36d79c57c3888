"""The dispatch row contract computed independently of the transports (docs/design.md): weights
that name their source token, and a bitwise check of one rank's receive rows."""

from __future__ import annotations

import torch

from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.config import TINY


def provenance_weights(source: int, tokens: int) -> torch.Tensor:
    """fp32 [T, K] = source*1000 + t + k/16: a misplaced row says where it came from."""
    t = torch.arange(tokens, dtype=torch.float32).unsqueeze(1)
    k = torch.arange(TINY.topk, dtype=torch.float32).unsqueeze(0)
    return source * 1000 + t + k / 16


def check_rows(rows, case, weights, rank, num_ranks, tokens) -> list[str]:
    """This rank's receive rows (CPU tensors) against the row contract computed here from the
    case: row s*T + t holds source s's token t with the ids of other ranks' experts replaced by
    -1, and, when one id is local, the token's MXFP8 bytes, scales and weights. Returns failures."""
    per_rank = TINY.experts // num_ranks
    shape = (num_ranks * tokens, TINY.topk)
    if tuple(rows.ids.shape) != shape:
        return [f"receive ids shape {tuple(rows.ids.shape)}; expected {shape}"]
    failures = []
    for source in range(num_ranks):
        q, sf = mxfp8_quantize(case.latent[source])
        ids = case.ids[source].long()
        local = (ids >= rank * per_rank) & (ids < (rank + 1) * per_rank)
        want_ids = torch.where(local, ids, -1).int()
        for t in range(tokens):
            row = source * tokens + t
            where = f"row {row} (source {source}, token {t})"
            if not torch.equal(rows.ids[row], want_ids[t]):
                failures.append(f"{where}: ids {rows.ids[row].tolist()} != {want_ids[t].tolist()}")
                continue
            if not local[t].any():
                continue
            if not torch.equal(rows.x[row], q[t]):
                failures.append(f"{where}: x bytes differ")
            if not torch.equal(rows.sf[row], sf[t]):
                failures.append(f"{where}: scale bytes differ")
            if not torch.equal(rows.weights[row], weights[source][t]):
                got = float(rows.weights[row, 0])
                failures.append(f"{where}: weights came from source {int(got // 1000)}, token"
                                f" {int(got % 1000)}")  # fmt: skip
    return failures
