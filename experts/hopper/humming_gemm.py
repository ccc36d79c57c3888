"""humming-kernels' SM90 MoE GEMM, HummingEngine's FC1 and FC2: weights prepared once, routed
through the tile routes of experts/hopper/grouping.py (no host synchronisation).

humming (PyPI humming-kernels, pinned in the `gpu` extra) runs an "indexed" MoE GEMM with WGMMA:
pair p of its sorted id list reads input row id // top_k, multiplies it by expert
expert_ids[p // block_m]'s weights and writes output row id; ids >= the output rows are padding,
and the kernel stops at the device scalar num_tokens_padded. Activations are e4m3 with one fp32
scale per 32 along K (our E8M0 bytes widened: R * L/32 * 4 bytes); MXFP4 weights keep 4 bits, with
their E8M0 scales folded into the FP4 -> FP8 conversion and one fp32 factor per expert.

That folding holds an expert's scale bytes to a spread of FUSED_SCALE_SPREAD (11) binades: humming
would shift the codes of blocks more than 11 below the expert's largest scale (losing precision),
so `check_scale_spread` refuses such weights instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from dep_ep.constants import SCALE_BLOCK

# humming 0.1.19 transform.process_fused_e8m0_scale: the largest E8M0 spread per expert that its
# fused FP4 -> FP8 decode keeps exact with e4m3 activations.
FUSED_SCALE_SPREAD = 11
# Stream-K lock words humming's kernels may use (int32, zeroed once, reset by the kernels).
LOCK_WORDS = 1 << 16
# Changes to humming's heuristic choice per tuned pair count, each applied only to the kernel it
# was measured against: pairs -> (what humming's choice must hold, the change).
# Stream-K off for the kernels of 512 and 1024 pairs ([16, 128, 256] and [24 or 32, 256, 128]
# blocks at K3's shapes), FC1 and FC2. Speed is the same within the run-to-run spread: on an H200
# on a DEP16 shard FC1 took 182 / 209, 191 / 202 and 198 / 209 us at T = 32 / 64 without
# stream-K in three runs, against 190 / 208, 194 / 210 and 190 / 207 with it; FC2 within 3% (the
# last run: docs/results/bench_humming_tuning.md, "Variants"). Without stream-K each output
# element is written once: no BF16 partial outputs added.
TUNING_UPDATES = {512: ({}, {"use_stream_k": False}), 1024: ({}, {"use_stream_k": False})}
# The kernel humming 0.1.19 picks for 16, 32 and 64 pairs at K3's shapes on 56, 112 and 448
# local experts (the counts `tuning_pairs` gives at T = 1, 2 and 4 there; its pick depends on the
# expert count too) unless deterministic: 8 x 128 x 256 blocks, 4 stages, 2 CTAs an SM, stream-K.
DECODE_KERNEL = {
    "block_shape": (8, 128, 256),
    "num_stages": 4,
    "num_ctas_per_sm": 2,
    "use_stream_k": True,
}
DECODE_PAIRS = (16, 32, 64)
# Its changes at decode (HummingEngine applies them at K3's widths only): FC1 with 3 stages and
# without stream-K, FC2 with 3 stages. The whole
# call in graph replay on one H100, both choices on the same rows in the same run
# (docs/results/humming_decode_call/56/bench_experts.md, and 112/, 448/): 87 / 112 / 114 us
# against 92 / 118 / 120 at T = 1 (56 / 112 / 448 local experts), 4-6 us less at T = 2, from
# 5 us less to 2 us more at T = 4; T = 8 and 16 (other kernels) within 4 us either way. The two
# GEMMs alone: docs/results/humming_decode/bench_humming_tuning.md. Not timed on an H200.
FC1_UPDATES = {
    **TUNING_UPDATES,
    **{pairs: (DECODE_KERNEL, {"num_stages": 3, "use_stream_k": False}) for pairs in DECODE_PAIRS},
}
FC2_UPDATES = {
    **TUNING_UPDATES,
    **{pairs: (DECODE_KERNEL, {"num_stages": 3}) for pairs in DECODE_PAIRS},
}
# humming's kernels never launch with programmatic dependent launch (0.1.19's SM90 heuristic sets
# no `use_pdl`; off is its default): with it, a CTA that gets no tile exits without
# griddepcontrol.wait, so a GEMM with no pair could complete before the kernel ahead of it, and
# the kernels after it, which wait on the GEMM alone, could run beside that kernel
# (experts/hopper/pdl.py).
HUMMING_USE_PDL = False


def updated_tuning(choice: dict, update: tuple[dict, dict] | None) -> dict:
    """humming's kernel choice with `update` = (what the choice must hold, the change) applied
    where the choice holds every item of the first (block shapes compared as tuples); the
    choice unchanged otherwise, or without an update."""
    if update is None:
        return dict(choice)
    when, change = update
    for key, value in when.items():
        held = choice.get(key)
        if isinstance(value, tuple) and isinstance(held, list):
            held = tuple(held)
        if held != value:
            return dict(choice)
    return {**choice, **change}


def scale_spread_error(owner: str, name: str, scales: torch.Tensor) -> str | None:
    """None when every expert's E8M0 scale bytes (uint8 [E, rows, K/32]) span at most
    FUSED_SCALE_SPREAD binades, else the message naming the experts that do not (the humming
    engine would lose precision there)."""
    flat = scales.reshape(scales.shape[0], -1)
    spread = (flat.amax(dim=1).int() - flat.amin(dim=1).int()).cpu()
    bad = (spread > FUSED_SCALE_SPREAD).nonzero().squeeze(1).tolist()
    if not bad:
        return None
    return (
        f"{owner}: {name} of local expert(s) {bad[:8]} spread over"
        f" {[int(spread[e]) for e in bad[:8]]} binades; the humming engine keeps at most"
        f" {FUSED_SCALE_SPREAD} exact. Use HopperExperts(..., engine=TritonEngine())"
    )


@dataclass
class HummingGemm:
    """One MoE GEMM out [M, n] = inputs [M', k] @ W_e^T over num_experts MXFP4 experts (W uint8
    [E, n, k/2], scales uint8 [E, n, k/32]), prepared once for e4m3 inputs with fp32 per-32
    scales (or, `prepare(..., bf16_inputs=True)`, BF16 inputs) and BF16 output. The caller's
    tensors are copied, never changed. Its kernels launch without programmatic dependent launch
    (HUMMING_USE_PDL)."""

    config: object
    tensors: dict
    locks: torch.Tensor
    tunings: dict
    deterministic: bool
    # pairs -> (what humming's choice must hold, the change): TUNING_UPDATES, or the engine's
    # FC1_UPDATES / FC2_UPDATES.
    updates: dict = field(default_factory=lambda: dict(TUNING_UPDATES))

    @classmethod
    def prepare(
        cls,
        weights: torch.Tensor,
        scales: torch.Tensor,
        deterministic: bool,
        bf16_inputs: bool = False,
        updates: dict | None = None,
    ) -> HummingGemm:
        """bf16_inputs: humming's W4A16 kernels, for BF16 inputs without scales (the weights in
        their layout for BF16; measured in bench/bench_humming_a16.py, used by no engine).
        updates: the changes to humming's kernel choices (`updated_tuning`; default
        TUNING_UPDATES)."""
        import humming.transform as transform
        from humming.schema import HummingInputSchema, HummingWeightSchema

        num_experts, n, half_k = weights.shape
        weight_schema = HummingWeightSchema(
            b_dtype="float4e2m1", bs_dtype="float8e8m0", weight_scale_group_size=SCALE_BLOCK
        )
        input_schema = HummingInputSchema(a_dtype="float8e4m3", input_scale_group_size=SCALE_BLOCK)
        if bf16_inputs:
            input_schema = HummingInputSchema(a_dtype="bfloat16")
        # humming's MXFP4 words (int32, element i in bits 4i..4i+3) are our bytes viewed as int32;
        # its fused-scale transform rewrites codes in place, hence the copies.
        tensors = {
            "weight": weights.clone().view(torch.int32),
            "weight_scale": scales.clone().view(torch.float8_e8m0fnu),
        }
        config = transform.prepare_layer_config(
            shape_n=n,
            shape_k=2 * half_k,
            weight_schema=weight_schema,
            input_schema=input_schema,
            num_experts=num_experts,
            torch_dtype=torch.bfloat16,
            tensors=tensors,
            device=weights.device,
        )
        config, tensors = transform.prepare_fp16_e8m0_scale(config, tensors)
        tensors = transform.transform_humming_tensors(config, tensors)
        locks = torch.zeros(LOCK_WORDS, dtype=torch.int32, device=weights.device)
        return cls(
            config,
            tensors,
            locks,
            {},
            deterministic,
            dict(TUNING_UPDATES if updates is None else updates),
        )

    def tuning(self, pairs: int) -> dict:
        """humming's kernel choice for `pairs` pairs (engine.tuning_pairs: one compilation per
        value, cached) with `updates` applied (`updated_tuning`). deterministic: humming's
        batch-invariant choice, without stream-K (which splits K over CTAs and adds the BF16
        partial outputs, atomically beyond 3 slices: extra roundings, and an order that can
        change between reruns). `use_pdl` is HUMMING_USE_PDL whatever the heuristic says."""
        if pairs not in self.tunings:
            tuning = updated_tuning(self.heuristic(pairs), self.updates.get(pairs))
            self.tunings[pairs] = {**tuning, "use_pdl": HUMMING_USE_PDL}
        return self.tunings[pairs]

    def heuristic(self, pairs: int) -> dict:
        """humming's own heuristic choice for `pairs` pairs (batch-invariant when deterministic),
        before `updates`."""
        from humming.tune import get_heuristics_config

        return get_heuristics_config(
            self.config,
            shape_m=pairs,
            gemm_type="indexed",
            use_batch_invariant=self.deterministic,
            device=self.locks.device,
        )

    def block_m(self, pairs: int) -> int:
        """Pairs per block of the kernel chosen for `pairs` (the grouping's block_n; humming's
        SM90 choices hold 8 to 64)."""
        return int(self.tuning(pairs)["block_shape"][0])

    def __call__(
        self, inputs, input_scale, sorted_ids, expert_ids, num_padded, top_k, out, tuned_pairs
    ) -> torch.Tensor:
        """out bf16 [M * top_k, n] rows sorted_ids (< M * top_k) = inputs[id // top_k] @ W^T, by
        the kernel chosen for `tuned_pairs` pairs."""
        from humming.ops import humming_gemm

        return humming_gemm(
            layer_config=self.config.to_str(),
            compute_config=json.dumps({"gemm_type": "indexed"}),
            tuning_config=json.dumps(self.tuning(tuned_pairs)),
            inputs=inputs,
            weight=self.tensors["weight"],
            weight_scale=self.tensors["weight_scale"],
            weight_scale_2=self.tensors.get("weight_scale_2"),
            input_scale=input_scale,
            outputs=out,
            top_k=top_k,
            locks=self.locks,
            sorted_ids=sorted_ids,
            expert_ids=expert_ids,
            num_tokens_padded=num_padded,
        )
