"""The dispatch row contract computed independently of the transports (docs/design.md): weights
that name their source token, and a bitwise check of one rank's receive rows."""

from __future__ import annotations

import torch

from dep_ep.comm.mxfp8 import mxfp8_quantize
from dep_ep.config import TINY, MoeGeometry

# A weight is source * SOURCE_STEP + t + k / 32: exact in fp32 for T < SOURCE_STEP, K <= 32 and
# up to 16 sources (every value below 2^18, whose fp32 spacing is 1/64).
SOURCE_STEP = 10_000


def provenance_weights(source: int, tokens: int, topk: int = TINY.topk) -> torch.Tensor:
    """fp32 [T, K] = source * SOURCE_STEP + t + k/32: a misplaced row says where it came from."""
    assert tokens < SOURCE_STEP and topk <= 32 and source < 16
    t = torch.arange(tokens, dtype=torch.float32).unsqueeze(1)
    k = torch.arange(topk, dtype=torch.float32).unsqueeze(0)
    return source * SOURCE_STEP + t + k / 32


def check_rows(rows, case, weights, rank, num_ranks, tokens, geometry: MoeGeometry = TINY):
    """This rank's receive rows (CPU tensors) against the row contract computed here from the
    case: row s*T + t holds source s's token t with the ids of other ranks' experts replaced by
    -1, and, when one id is local, the token's MXFP8 bytes, scales and weights. Returns the
    failures (a list of str)."""
    per_rank = geometry.experts // num_ranks
    shape = (num_ranks * tokens, geometry.topk)
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
                failures.append(
                    f"{where}: weights came from source {int(got // SOURCE_STEP)},"
                    f" token {int(got % SOURCE_STEP)}"
                )
    return failures
