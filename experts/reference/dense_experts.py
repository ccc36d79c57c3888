"""DenseExperts: every local expert on every receive row, masked by the ids. No data-dependent
shapes and no host synchronisation, so a CUDA graph can capture it; the work grows with the
number of local experts, so it suits small geometries (tests, graph-replay checks)."""

from __future__ import annotations

import torch

from dep_ep.comm.mxfp8 import mxfp8_dequantize
from dep_ep.experts.base import check_receive_rows
from dep_ep.experts.reference.reference_experts import ReferenceExperts
from dep_ep.experts.situ import situ
from dep_ep.experts.weights import ExpertWeights


class DenseExperts(ReferenceExperts):
    """Same ExpertWeights as ReferenceExperts and the same per-expert formulas (fp32 GEMMs,
    SiTU in fp32, BF16 activation and expert outputs, fp32 sum over k in order); the GEMMs run on
    all rows at once, so results may differ from ReferenceExperts in the last bit. Writes every
    row (combine reads only rows with a local id). Holds fp32 copies of the local experts' weights
    (twice ReferenceExperts' BF16 cache)."""

    def __init__(self, weights: ExpertWeights) -> None:
        super().__init__(weights)
        self._w13 = self.w13_bf16.float()  # fp32 [E_local, 2I, L]
        self._w2 = self.w2_bf16.float()  # fp32 [E_local, L, I]

    def forward(self, x, sf, ids, weights, out):
        check_receive_rows(type(self).__name__, x, sf, ids, weights, out, self.latent, self.device)
        h = mxfp8_dequantize(x, sf).float()
        gate_up = torch.einsum("rl,eil->eri", h, self._w13)
        act = situ(gate_up[..., : self.intermediate], gate_up[..., self.intermediate :])
        expert_out = torch.einsum("eri,eli->erl", act.to(torch.bfloat16).float(), self._w2)
        expert_out = expert_out.to(torch.bfloat16).float()  # [E_local, R, L]
        local = ids.long() - self.first_expert
        valid = (local >= 0) & (local < self.num_local_experts)
        rows = torch.arange(x.shape[0], device=x.device)
        total = torch.zeros(x.shape[0], self.latent, dtype=torch.float32, device=x.device)
        for k in range(ids.shape[1]):
            picked = expert_out[local[:, k].clamp(0, self.num_local_experts - 1), rows]
            # A slot without a local id adds +0.0, not 0 * picked: the clamped expert's output
            # may be NaN or Inf (its weights' scale byte 255), which must not reach rows that
            # never chose it.
            term = weights[:, k].unsqueeze(1) * picked
            total = total + torch.where(valid[:, k].unsqueeze(1), term, 0.0)
        out.copy_(total.to(torch.bfloat16))
        return out
