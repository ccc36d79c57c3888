"""ReferenceExperts: MXFP4 experts in plain torch (any device), the numerics every backend meets."""

from __future__ import annotations

import torch

from dep_ep.comm.mxfp8 import mxfp8_dequantize
from dep_ep.experts.base import ExpertsBackend, check_receive_rows
from dep_ep.experts.mxfp4 import mxfp4_dequantize
from dep_ep.experts.situ import situ
from dep_ep.experts.weights import ExpertWeights


def _grouped_mm_available(device: torch.device) -> bool:
    """torch's grouped BF16 GEMM (fp32 accumulation, one rounding to BF16) runs here: CUDA SM90+."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


# torch.mm / torch.bmm(..., out_dtype=) (BF16 inputs, fp32 output) exist on CUDA from torch 2.8.
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()
_BMM_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 [M, N] = a @ b for BF16 a [M, K] and b [K, N], products and sums in fp32. On CUDA one
    BF16 GEMM with fp32 output (no widened copy of the weights); elsewhere an fp32 GEMM."""
    if a.is_cuda and _MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _expert_slices(counts: list[int]):
    """(local expert, rows slice) of each expert with rows, for rows sorted by expert."""
    start = 0
    for e, count in enumerate(counts):
        if count:
            yield e, slice(start, start + count)
        start += count


class ReferenceExperts(ExpertsBackend):
    """The rank's experts from an ExpertWeights (experts/weights.py: the checkpoint layout).

    Numerics: x dequantized from MXFP8 into BF16 (exact for scale bytes 3..246:
    comm.mxfp8.mxfp8_dequantize); g, u = x @ w1^T, x @ w3^T with fp32 products and
    sums; SiTU in fp32, one cast to BF16; the expert output (act @ w2^T, fp32 sums) cast to BF16;
    the weighted sum over the row's local ids in fp32, k in order; one cast to BF16. Only the
    order of the fp32 sums inside a GEMM differs between devices.

    Memory: every local expert is dequantized once, at construction, into BF16 (exact for MXFP4
    values): 2 bytes per weight, 3 * I * L * 2 bytes per expert, 66.1 MB for K3, so 3.70 GB for
    56 local experts (16 ranks) and 7.40 GB for 112 (8 ranks), per layer, on the weights' device.
    Per call, temporaries grow with the P (row, local expert) pairs: the batched FC1 holds at most
    2P padded rows, 2P * (2L + 8I) bytes (270 MB for K3 at P = 4,219, T = 256 on 16 ranks).

    Execution: device-to-host reads to size the work, then the (row, expert) pairs sorted by
    expert; FC1 needs fp32 output, which torch's grouped GEMM does not offer: on CUDA it runs as
    one batched GEMM over all local experts (rows zero-padded) when the padding at most doubles
    the rows, else one GEMM per expert that has rows; FC2 runs as one grouped GEMM over all experts
    where torch has it (CUDA SM90+), else one GEMM per expert. Not capturable in a CUDA graph
    (DenseExperts is).
    """

    def __init__(self, weights: ExpertWeights) -> None:
        self._take_weights(weights)
        self.check_device(weights.device)
        num_local, latent, inter = self.num_local_experts, self.latent, self.intermediate
        # bf16 [E_local, 2I, L] rows [w1 (gate); w3 (up)] and bf16 [E_local, L, I].
        bf16 = dict(dtype=torch.bfloat16, device=self.device)
        self.w13_bf16 = torch.empty(num_local, 2 * inter, latent, **bf16)
        self.w2_bf16 = torch.empty(num_local, latent, inter, **bf16)
        w13, s13, w2, s2 = weights.tensors
        for e in range(num_local):  # one expert at a time bounds the fp32 temporaries
            self.w13_bf16[e] = mxfp4_dequantize(w13[e], s13[e], torch.bfloat16)
            self.w2_bf16[e] = mxfp4_dequantize(w2[e], s2[e], torch.bfloat16)
        self._grouped_fc2 = _grouped_mm_available(self.device)
        # fc1: padded rows / real rows up to which FC1 runs batched (tests set 0 to force a loop).
        self.batched_fc1_max_padding = 2.0

    def fc1(self, h: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """fp32 [P, 2I] = rows h [P, L] (BF16, sorted by local expert, `counts` per expert) times
        their expert's w13^T. On CUDA, when padding every local expert's rows to the largest count
        at most multiplies the rows by `batched_fc1_max_padding` (so at least half the experts
        have rows, and memory stays bounded), one batched GEMM over every local expert (zero rows
        for the padding; every expert's weights read once; one launch); else one GEMM each."""
        num_local, inter = self.num_local_experts, self.intermediate
        most = max(counts)
        batched = num_local * most <= self.batched_fc1_max_padding * h.shape[0]
        if h.is_cuda and _BMM_OUT_DTYPE and batched:
            starts = torch.tensor([0] + counts[:-1], device=h.device).cumsum(0)
            expert = torch.repeat_interleave(
                torch.arange(num_local, device=h.device), torch.tensor(counts, device=h.device)
            )
            slot = expert * most + torch.arange(h.shape[0], device=h.device) - starts[expert]
            padded = torch.zeros(num_local * most, self.latent, dtype=h.dtype, device=h.device)
            padded[slot] = h
            out = torch.bmm(
                padded.view(num_local, most, self.latent),
                self.w13_bf16.transpose(1, 2),
                out_dtype=torch.float32,
            )
            return out.view(num_local * most, 2 * inter)[slot]
        gate_up = torch.empty(h.shape[0], 2 * inter, dtype=torch.float32, device=h.device)
        for e, rows in _expert_slices(counts):
            gate_up[rows] = _mm_fp32(h[rows], self.w13_bf16[e].T)
        return gate_up

    def expert_outputs(self, h: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """BF16 [P, L] expert outputs of BF16 rows h [P, L] sorted by local expert: rows
        [sum(counts[:e]), sum(counts[:e+1])) go through local expert e."""
        inter = self.intermediate
        gate_up = self.fc1(h, counts)
        act = situ(gate_up[:, :inter], gate_up[:, inter:]).to(torch.bfloat16)
        if self._grouped_fc2:
            offsets = torch.tensor(counts, device=h.device).cumsum(0).to(torch.int32)
            return torch._grouped_mm(act, self.w2_bf16.transpose(1, 2), offs=offsets)
        out = torch.empty(h.shape[0], self.latent, dtype=torch.bfloat16, device=h.device)
        for e, rows in _expert_slices(counts):
            out[rows] = _mm_fp32(act[rows], self.w2_bf16[e].T).to(torch.bfloat16)
        return out

    def forward(
        self,
        x: torch.Tensor,
        sf: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        check_receive_rows(type(self).__name__, x, sf, ids, weights, out, self.latent, self.device)
        local_ids = ids.long() - self.first_expert
        local = (local_ids >= 0) & (local_ids < self.num_local_experts)  # bool [R, K]
        rows = local.any(dim=1).nonzero().squeeze(1)  # [N] rows with a local id (host sync)
        if rows.numel() == 0:
            return out
        row_local = local[rows]
        pair_row, pair_k = row_local.nonzero().unbind(1)  # [P] each, row-major: k ascending
        pair_expert = local_ids[rows][pair_row, pair_k]
        order = torch.argsort(pair_expert, stable=True)
        counts = torch.bincount(pair_expert, minlength=self.num_local_experts).tolist()
        h = mxfp8_dequantize(x[rows], sf[rows])  # BF16, exact for scale bytes 3..246
        sorted_out = self.expert_outputs(h[pair_row[order]], counts)
        num_pairs = pair_row.numel()
        padded = torch.zeros(num_pairs + 1, self.latent, dtype=torch.bfloat16, device=x.device)
        padded[order] = sorted_out  # pair order; row num_pairs stays zero (padding)

        # Weighted sum, k in order: slot j of a row is its j-th local pair; missing slots point
        # at the zero row with weight 0, and adding +0.0 leaves an fp32 sum unchanged.
        per_row = row_local.sum(dim=1)
        slot = torch.arange(num_pairs, device=x.device) - (per_row.cumsum(0) - per_row)[pair_row]
        num_slots = int(per_row.max())
        pair_at = torch.full((rows.numel(), num_slots), num_pairs, device=x.device)
        pair_at[pair_row, slot] = torch.arange(num_pairs, device=x.device)
        slot_weight = torch.zeros(rows.numel(), num_slots, dtype=torch.float32, device=x.device)
        slot_weight[pair_row, slot] = weights[rows][pair_row, pair_k].float()
        total = torch.zeros(rows.numel(), self.latent, dtype=torch.float32, device=x.device)
        for j in range(num_slots):
            total += slot_weight[:, j : j + 1] * padded[pair_at[:, j]].float()
        out[rows] = total.to(torch.bfloat16)
        return out
