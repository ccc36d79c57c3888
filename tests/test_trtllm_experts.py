"""TrtllmExperts without an SM100 GPU: weight preparation (FlashInfer's permutations, a torch
model of its scale interleave), the kernel's arguments against FlashInfer's signature, and the
errors. The kernel itself runs only on SM100/103 (tests/test_experts_backends.py)."""

from __future__ import annotations

import inspect

import flashinfer as fi  # the test extra installs it; a missing one fails here, not skips
import pytest
import torch

from dep_ep.config import TINY
from dep_ep.experts import ExpertWeights
from dep_ep.experts.base import check_receive_rows
from dep_ep.experts.trtllm import TrtllmExperts, routed_moe_arguments
from dep_ep.experts.trtllm.weights import TrtllmWeights, prepare_trtllm_weights
from dep_ep.testing.synthetic import SyntheticLayer

from helpers.scale_layout import deinterleave_128x4, interleave_128x4


def shuffled_position(row: int) -> int:
    """Where trtllm-gen's epilogue-tile shuffle (tile 128: blocks of 32 rows) puts `row`: within
    a block, row o goes to (o % 4) * 8 + o // 4."""
    o = row % 32
    return row - o + (o % 4) * 8 + o // 4


def expected_fc1_source(two_i: int) -> list[int]:
    """Checkpoint row ([w1 gate; w3 up]) of each prepared FC1 row: [up; gate], rows alternating
    up_j, gate_j for the gated GEMM, then the shuffle."""
    inter = two_i // 2
    alternating = [inter + j if r % 2 == 0 else j for r in range(two_i) for j in [r // 2]]
    source = [0] * two_i
    for r, src in enumerate(alternating):
        source[shuffled_position(r)] = src
    return source


def expected_fc2_source(rows: int) -> list[int]:
    source = [0] * rows
    for r in range(rows):
        source[shuffled_position(r)] = r
    return source


def test_prepared_weights_follow_the_documented_row_order():
    seed = int(torch.randint(0, 2**31, (1,)))
    weights = SyntheticLayer(TINY, seed).local_weights(5, 3)
    w13, s13, w2, s2 = weights.tensors
    prepared = prepare_trtllm_weights(weights, interleave=interleave_128x4)
    two_i, latent = w13.shape[1], w2.shape[1]
    fc1, fc2 = expected_fc1_source(two_i), expected_fc2_source(latent)
    assert sorted(fc1) == list(range(two_i))
    assert prepared.gemm1_weights_scale.dtype == torch.float8_e4m3fn
    for e in range(3):
        assert torch.equal(prepared.gemm1_weights[e], w13[e][fc1]), f"seed {seed} expert {e}"
        assert torch.equal(prepared.gemm2_weights[e], w2[e][fc2])
        g1s = prepared.gemm1_weights_scale[e].view(torch.uint8).flatten()
        g2s = prepared.gemm2_weights_scale[e].view(torch.uint8).flatten()
        assert torch.equal(deinterleave_128x4(g1s, *s13.shape[1:]), s13[e][fc1])
        assert torch.equal(deinterleave_128x4(g2s, *s2.shape[1:]), s2[e][fc2])


def test_interleave_model_is_a_permutation_with_the_documented_corners():
    sf = torch.arange(256 * 8, dtype=torch.int64).reshape(256, 8)
    flat = interleave_128x4(sf)
    assert sorted(flat.tolist()) == list(range(256 * 8))
    assert flat[1] == sf[0, 1] and flat[4] == sf[32, 0] and flat[16] == sf[1, 0]
    assert flat[512] == sf[0, 4] and flat[1024] == sf[128, 0]
    assert torch.equal(deinterleave_128x4(flat, 256, 8), sf)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer's interleave needs CUDA")
def test_flashinfer_interleave_matches_the_model():
    sf = torch.randint(0, 256, (2 * 3072, 3584 // 32), dtype=torch.uint8, device="cuda")
    assert torch.equal(fi.block_scale_interleave(sf), interleave_128x4(sf))


def test_prepare_rejects_unaligned_geometry():
    w13, s13, w2, s2 = SyntheticLayer(TINY, 0).local(0, 1)
    inter = w13.shape[1] // 2
    middle = slice(inter - 96, inter + 96)
    narrow = (w13[:, middle], s13[:, middle], w2[:, :, :48], s2[:, :, :3])
    narrow = ExpertWeights(*narrow, first_expert=0, num_experts=TINY.experts)
    with pytest.raises(ValueError, match="I=96; FlashInfer's MXFP4 kernels need a multiple of"):
        prepare_trtllm_weights(narrow, interleave=interleave_128x4)
    with pytest.raises(TypeError, match="prepare_trtllm_weights: weights is tuple; expected an"):
        prepare_trtllm_weights((w13, s13, w2, s2), interleave=interleave_128x4)


def receive_rows(rows: int = 24, topk: int = TINY.topk):
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, 256, (rows, TINY.latent), generator=gen, dtype=torch.uint8)
    sf = torch.randint(118, 130, (rows, TINY.latent // 32), generator=gen, dtype=torch.uint8)
    ids = torch.randint(-1, TINY.experts, (rows, topk), generator=gen, dtype=torch.int32)
    weights = torch.rand(rows, topk, generator=gen)
    out = torch.full((rows, TINY.latent), float("nan"), dtype=torch.bfloat16)
    return x, sf, ids, weights, out


def test_routed_moe_arguments_match_flashinfer_and_the_contract():
    num_local, inter = 4, TINY.intermediate
    prepared = TrtllmWeights(
        torch.zeros(num_local, 2 * inter, TINY.latent // 2, dtype=torch.uint8),
        torch.zeros(num_local, 2 * inter, TINY.latent // 32, dtype=torch.float8_e4m3fn),
        torch.zeros(num_local, TINY.latent, inter // 2, dtype=torch.uint8),
        torch.zeros(num_local, TINY.latent, inter // 32, dtype=torch.float8_e4m3fn),
    )
    x, sf, ids, weights, out = receive_rows()
    alpha, beta = torch.full((num_local,), 4.0), torch.full((num_local,), 25.0)
    args = routed_moe_arguments(
        prepared,
        x,
        sf,
        ids,
        weights,
        out,
        first_expert=8,
        num_experts=TINY.experts,
        gemm1_alpha=alpha,
        gemm1_beta=beta,
        output_scales=torch.ones(num_local),
    )
    signature = inspect.signature(fi.trtllm_fp4_block_scale_routed_moe).parameters
    assert set(args) <= set(signature), set(args) - set(signature)
    required = {n for n, p in signature.items() if p.default is inspect.Parameter.empty}
    assert required <= set(args), required - set(args)
    assert args["topk_ids"][0] is ids and args["topk_ids"][1] is weights
    for name, source in (("hidden_states", x), ("hidden_states_scale", sf)):
        assert args[name].dtype == torch.float8_e4m3fn
        assert args[name].data_ptr() == source.data_ptr() and args[name].shape == source.shape
    assert args["output"] is out and args["do_finalize"] is True
    assert int(args["activation_type"]) == 10  # SiTU (docs/formats.md)
    assert int(args["routing_method_type"]) == int(fi.RoutingMethodType.Renormalize)
    assert args["hidden_states_scale_layout"] == fi.SfLayout.layout_linear
    assert args["gemm1_alpha"] is alpha and args["gemm1_beta"] is beta
    assert (args["local_expert_offset"], args["local_num_experts"]) == (8, num_local)
    assert (args["num_experts"], args["top_k"], args["intermediate_size"]) == (48, 6, inter)
    assert args["gemm1_weights"] is prepared.gemm1_weights
    assert args["gemm2_weights_scale"] is prepared.gemm2_weights_scale


def test_receive_rows_are_checked():
    x, sf, ids, weights, out = receive_rows()
    check_receive_rows("T", x, sf, ids, weights, out, TINY.latent)
    with pytest.raises(TypeError, match="T.forward: ids dtype torch.int64"):
        check_receive_rows("T", x, sf, ids.long(), weights, out, TINY.latent)
    with pytest.raises(ValueError, match=r"T.forward: sf shape \(24, 7\); expected \(24, 8\)"):
        check_receive_rows("T", x, sf[:, :7], ids, weights, out, TINY.latent)
    with pytest.raises(TypeError, match="T.forward: out dtype torch.float32"):
        check_receive_rows("T", x, sf, ids, weights, out.float(), TINY.latent)
    with pytest.raises(ValueError, match="T.forward: x on cpu; expected meta"):
        check_receive_rows("T", x, sf, ids, weights, out, TINY.latent, torch.device("meta"))


def test_refuses_a_device_below_sm100(monkeypatch):
    weights = SyntheticLayer(TINY, 0).local_weights(0, 2)
    message = "TrtllmExperts cannot run on cpu: cpu is not a CUDA device; it needs an NVIDIA"
    with pytest.raises(RuntimeError, match=message):
        TrtllmExperts(weights)
    with pytest.raises(TypeError, match="TrtllmExperts: weights is tuple; expected an Expert"):
        TrtllmExperts(weights.tensors)
    if not torch.cuda.is_available():  # a CPU-only torch: a reason, not torch's AssertionError
        assert TrtllmExperts.unsupported_reason("cuda") == "CUDA is not available"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    reason = TrtllmExperts.unsupported_reason(torch.device("cuda", 0))
    assert reason == "its compute capability is 9.0"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert TrtllmExperts.unsupported_reason(torch.device("cuda", 0)) is None


def test_rejects_experts_beyond_the_model():
    """The kernel's routing reads the weights' num_experts: ExpertWeights refuses experts past
    it before any backend is built (TrtllmExperts used to check it itself)."""
    tensors = SyntheticLayer(TINY, 0).local(0, 2)
    with pytest.raises(ValueError, match="num_experts=48; expected >= first_expert \\+ E_local"):
        TrtllmExperts(ExpertWeights(*tensors, first_expert=47, num_experts=TINY.experts))


def test_missing_flashinfer_names_the_install(monkeypatch):
    import importlib

    from dep_ep.experts.trtllm import weights as trtllm_weights

    real = importlib.import_module

    def no_flashinfer(name, *args):
        if name == "flashinfer":
            raise ImportError("No module named 'flashinfer'")
        return real(name, *args)

    monkeypatch.setattr(trtllm_weights.importlib, "import_module", no_flashinfer)
    with pytest.raises(ImportError, match=r"TrtllmExperts needs FlashInfer: pip install"):
        trtllm_weights.import_flashinfer()
