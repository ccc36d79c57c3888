"""Loading one MoE layer of a checkpoint written in the Kimi K3 naming and MXFP4 format."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from dep_ep.config import TINY
from dep_ep.experts import ReferenceExperts
from dep_ep.experts.checkpoint import INDEX_FILE, dense_shapes, layer_prefix, load_moe_layer
from dep_ep.experts.trtllm.weights import prepare_trtllm_weights
from dep_ep.testing.synthetic import SyntheticLayer

from helpers.scale_layout import interleave_128x4

LAYER = 3


def checkpoint_tensors(layer: SyntheticLayer) -> dict[str, torch.Tensor]:
    """Every tensor of MoE layer LAYER as the released checkpoint names them."""
    g, prefix = layer.geometry, layer_prefix(LAYER)
    out = {}
    for e in range(g.experts):
        w13, s13, w2, s2 = layer.expert(e)
        I = g.intermediate  # noqa: E741
        out[f"{prefix}experts.{e}.w1.weight_packed"] = w13[:I].contiguous()
        out[f"{prefix}experts.{e}.w1.weight_scale"] = s13[:I].contiguous()
        out[f"{prefix}experts.{e}.w3.weight_packed"] = w13[I:].contiguous()
        out[f"{prefix}experts.{e}.w3.weight_scale"] = s13[I:].contiguous()
        out[f"{prefix}experts.{e}.w2.weight_packed"] = w2
        out[f"{prefix}experts.{e}.w2.weight_scale"] = s2
    gen = torch.Generator().manual_seed(5)
    for name, (shape, dtype) in dense_shapes(g).items():
        out[prefix + name] = torch.randn(shape, generator=gen).to(dtype)
    out["language_model.model.layers.0.mlp.down_proj.weight"] = torch.zeros(4, 4)  # unrelated
    return out


def write_sharded(folder, tensors: dict[str, torch.Tensor], shards: int = 3) -> None:
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(folder / file))
        weight_map.update({n: file for n in part})
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def layer():
    return SyntheticLayer(TINY, seed=int(torch.randint(0, 2**31, (1,))))


@pytest.mark.parametrize("sharded", [True, False])
def test_loads_own_experts_and_dense(tmp_path, layer, sharded):
    tensors = checkpoint_tensors(layer)
    if sharded:
        write_sharded(tmp_path, tensors)
    else:
        save_file(tensors, str(tmp_path / "model.safetensors"))
    first, count = 12, 12  # rank 1 of 4
    loaded = load_moe_layer(tmp_path, LAYER, TINY, first_expert=first, num_local_experts=count)
    want = layer.local(first, count)
    for got, expect in zip(loaded.experts.tensors, want):
        assert torch.equal(got, expect)
    assert (loaded.experts.first_expert, loaded.experts.num_experts) == (first, TINY.experts)
    for name in dense_shapes(TINY):
        assert torch.equal(loaded.dense[name], tensors[layer_prefix(LAYER) + name]), name
    experts = ReferenceExperts(loaded.experts)
    assert (experts.first_expert, experts.num_local_experts) == (first, count)
    # The same weights feed TrtllmExperts' preparation (its interleave modelled on CPU).
    prepared = prepare_trtllm_weights(loaded.experts, interleave=interleave_128x4)
    assert prepared.gemm1_weights.shape == loaded.experts.w13.shape
    assert prepared.gemm2_weights_scale.shape == loaded.experts.s2.shape


def test_missing_tensor_is_named(tmp_path, layer):
    tensors = checkpoint_tensors(layer)
    gone = f"{layer_prefix(LAYER)}experts.13.w3.weight_scale"
    del tensors[gone]
    write_sharded(tmp_path, tensors)
    with pytest.raises(KeyError, match=gone.replace(".", r"\.")):
        load_moe_layer(tmp_path, LAYER, TINY, first_expert=12, num_local_experts=12)
    # Experts another rank owns are never read: the same checkpoint loads for rank 0.
    load_moe_layer(tmp_path, LAYER, TINY, first_expert=0, num_local_experts=12, dense=False)


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_wrong_tensor_is_named(tmp_path, layer, bad):
    tensors = checkpoint_tensors(layer)
    name = f"{layer_prefix(LAYER)}experts.20.w2.weight_packed"
    t = tensors[name]
    tensors[name] = t[:, :-1].contiguous() if bad == "shape" else t.to(torch.int16)
    write_sharded(tmp_path, tensors)
    with pytest.raises(ValueError, match=rf"{name.replace('.', '.')}.*expected torch.uint8"):
        load_moe_layer(tmp_path, LAYER, TINY, first_expert=12, num_local_experts=12)


def test_bad_expert_range(tmp_path):
    with pytest.raises(ValueError, match="outside 0..47"):
        load_moe_layer(tmp_path, LAYER, TINY, first_expert=40, num_local_experts=12)


def test_the_geometry_s_expert_count_is_the_checkpoint_s(tmp_path, layer):
    """With dense=False the gate ([E, H]) is not read, but its header tells the checkpoint's E:
    a geometry of another E is refused (before, it loaded with the wrong num_experts and
    nothing noticed). A folder holding one rank's experts alone (no gate) still loads."""
    tensors = checkpoint_tensors(layer)
    write_sharded(tmp_path, tensors)
    for experts in (2 * TINY.experts, TINY.experts - 8):
        other = dataclasses.replace(TINY, experts=experts)
        with pytest.raises(ValueError, match=f"has {TINY.experts} rows .* has {experts}"):
            load_moe_layer(tmp_path, LAYER, other, first_expert=0, num_local_experts=4, dense=False)
    mine = tmp_path / "rank1"
    mine.mkdir()
    prefix = f"{layer_prefix(LAYER)}experts."
    own = {
        n: t
        for n, t in tensors.items()
        if n.startswith(prefix) and 12 <= int(n.split(".")[-3]) < 24
    }
    write_sharded(mine, own, shards=2)
    loaded = load_moe_layer(mine, LAYER, TINY, first_expert=12, num_local_experts=12, dense=False)
    assert torch.equal(loaded.experts.w2, layer.local(12, 12)[2])


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"first_expert": 12.0}, TypeError, "load_moe_layer: first_expert=12.0; expected an int"),
        ({"num_local_experts": True}, TypeError, "num_local_experts=True; expected an int"),
        ({"num_local_experts": 0}, ValueError, "num_local_experts=0; expected an int >= 1"),
        ({"geometry": "tiny"}, TypeError, "geometry is str; expected a MoeGeometry"),
        ({"layer": "3"}, TypeError, "layer='3'; expected an int"),
        ({"layer": -1}, ValueError, "layer=-1; expected an int >= 0"),
    ],
)
def test_bad_arguments_are_named(tmp_path, layer, kwargs, error, message):
    write_sharded(tmp_path, checkpoint_tensors(layer))
    args = {"geometry": TINY, "first_expert": 12, "num_local_experts": 12, "layer": LAYER} | kwargs
    with pytest.raises(error, match=re.escape(message)):
        load_moe_layer(tmp_path, **args)


def test_an_unreadable_index_or_shard_is_named(tmp_path, layer):
    """An index without weight_map, a shard the index names but the folder lacks, and a
    truncated shard each raise an error naming the index or the tensor."""
    tensors = checkpoint_tensors(layer)
    write_sharded(tmp_path, tensors)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="is not a safetensors index"):
        load_moe_layer(tmp_path, LAYER, TINY, first_expert=12, num_local_experts=12)
    name = f"{layer_prefix(LAYER)}experts.12.w1.weight_packed"
    shard = tmp_path / index["weight_map"][name]
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    with pytest.raises(KeyError, match=re.escape(name)):
        load_moe_layer(tmp_path, LAYER, TINY, first_expert=12, num_local_experts=12)
    shard.unlink()  # gone
    with pytest.raises(KeyError, match=re.escape(name)):
        load_moe_layer(tmp_path, LAYER, TINY, first_expert=12, num_local_experts=12)
