"""ReferenceExperts: MXFP4 experts in plain torch (any device), the numerics every backend meets."""

from __future__ import annotations

import torch

from comm.mxfp8 import mxfp8_dequantize
from experts.base import ExpertsBackend
from experts.mxfp4 import SCALE_BLOCK, mxfp4_dequantize
from experts.situ import situ


def _check_weight(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.uint8:
        raise TypeError(f"ReferenceExperts: {name} dtype {t.dtype}; expected torch.uint8")
    if tuple(t.shape) != shape:
        raise ValueError(f"ReferenceExperts: {name} shape {tuple(t.shape)}; expected {shape}")


class ReferenceExperts(ExpertsBackend):
    """The rank's experts from checkpoint-layout MXFP4 weights.

    w13 uint8 [E_local, 2I, L/2]: rows [w1 (gate); w3 (up)], two E2M1 codes per byte (low nibble
    first); s13 uint8 [E_local, 2I, L/32]; w2 uint8 [E_local, L, I/2]; s2 uint8 [E_local, L, I/32]
    (E8M0 scale bytes). first_expert: the global id of local expert 0.

    Numerics: x dequantized exactly from MXFP8; g, u = x @ w1^T, x @ w3^T in fp32; SiTU in fp32,
    one cast to BF16; expert output (act @ w2^T in fp32) cast to BF16; the weighted sum over the
    row's local ids in fp32, k in order; one cast to BF16. Each expert's weights are dequantized
    on first use and cached in BF16 (exact for MXFP4 values; 2 bytes per weight, 66 MB per K3
    expert) and widened to fp32 for each GEMM.
    """

    def __init__(
        self,
        w13: torch.Tensor,
        s13: torch.Tensor,
        w2: torch.Tensor,
        s2: torch.Tensor,
        *,
        first_expert: int,
    ) -> None:
        if w13.dim() != 3 or w2.dim() != 3:
            raise ValueError(
                f"ReferenceExperts: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be 3-D"
                " [E_local, rows, K/2]"
            )
        num_local, two_i, half_latent = w13.shape
        latent, intermediate = half_latent * 2, two_i // 2
        if two_i % 2 or latent % SCALE_BLOCK or intermediate % SCALE_BLOCK:
            raise ValueError(
                f"ReferenceExperts: w13 shape {tuple(w13.shape)} gives L={latent},"
                f" I={intermediate};"
                f" both must be multiples of {SCALE_BLOCK}"
            )
        _check_weight("w13", w13, (num_local, 2 * intermediate, latent // 2))
        _check_weight("s13", s13, (num_local, 2 * intermediate, latent // SCALE_BLOCK))
        _check_weight("w2", w2, (num_local, latent, intermediate // 2))
        _check_weight("s2", s2, (num_local, latent, intermediate // SCALE_BLOCK))
        devices = {t.device for t in (w13, s13, w2, s2)}
        if len(devices) != 1:
            raise ValueError(
                f"ReferenceExperts: weights on several devices {sorted(map(str, devices))}"
            )
        if first_expert < 0:
            raise ValueError(f"ReferenceExperts: first_expert={first_expert} must be >= 0")
        self.check_device(w13.device)
        self.w13, self.s13, self.w2, self.s2 = w13, s13, w2, s2
        self.first_expert = int(first_expert)
        self.num_local_experts = num_local
        self.latent, self.intermediate = latent, intermediate
        self.device = w13.device
        self._dequantized: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _weights(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (w13 [2I, L], w2 [L, I]) of local expert `local` (cached in BF16, exact)."""
        if local not in self._dequantized:
            w13 = mxfp4_dequantize(self.w13[local], self.s13[local], torch.bfloat16)
            w2 = mxfp4_dequantize(self.w2[local], self.s2[local], torch.bfloat16)
            self._dequantized[local] = (w13, w2)
        w13, w2 = self._dequantized[local]
        return w13.float(), w2.float()

    def forward(
        self,
        x: torch.Tensor,
        sf: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        local = (ids >= self.first_expert) & (ids < self.first_expert + self.num_local_experts)
        rows = local.any(dim=1).nonzero().squeeze(1)
        if rows.numel() == 0:
            return out
        h = mxfp8_dequantize(x[rows], sf[rows]).float()
        row_ids = ids[rows].long() - self.first_expert
        pairs = local[rows].nonzero()  # [P, 2]: (index into rows, k)
        pair_expert = row_ids[pairs[:, 0], pairs[:, 1]]
        expert_out = torch.empty(pairs.shape[0], self.latent, dtype=torch.float32, device=x.device)
        for expert in pair_expert.unique().tolist():
            sel = (pair_expert == expert).nonzero().squeeze(1)
            w13, w2 = self._weights(expert)
            gate_up = h[pairs[sel, 0]] @ w13.T
            act = situ(gate_up[:, : self.intermediate], gate_up[:, self.intermediate :])
            o = act.to(torch.bfloat16).float() @ w2.T
            expert_out[sel] = o.to(torch.bfloat16).float()
        total = torch.zeros(rows.numel(), self.latent, dtype=torch.float32, device=x.device)
        row_weights = weights[rows]
        for k in range(ids.shape[1]):
            sel = (pairs[:, 1] == k).nonzero().squeeze(1)
            at = pairs[sel, 0]
            total[at] += row_weights[at, k].unsqueeze(1) * expert_out[sel]
        out[rows] = total.to(torch.bfloat16)
        return out
