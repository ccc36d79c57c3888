"""ExpertWeights, the one value every experts backend takes: its validation (each bad input named
with the rule it breaks), its geometry, and that every backend refuses anything else."""

from __future__ import annotations

import pytest
import torch

from dep_ep.config import TINY
from dep_ep.experts import ExpertWeights
from dep_ep.testing.synthetic import SyntheticLayer

FIRST, COUNT = 12, 3


def tensors() -> dict[str, torch.Tensor]:
    w13, s13, w2, s2 = SyntheticLayer(TINY, seed=3).local(FIRST, COUNT)
    return {"w13": w13, "s13": s13, "w2": w2, "s2": s2}


def build(**changes) -> ExpertWeights:
    """ExpertWeights of TINY's experts 12..14 of 48, with `changes` to the fields."""
    fields = {**tensors(), "first_expert": FIRST, "num_experts": TINY.experts, **changes}
    return ExpertWeights(**fields)


def test_geometry_and_tensors():
    given = tensors()
    weights = ExpertWeights(**given, first_expert=FIRST, num_experts=TINY.experts)
    assert (weights.first_expert, weights.num_experts) == (FIRST, TINY.experts)
    assert weights.num_local_experts == COUNT
    assert (weights.latent, weights.intermediate) == (TINY.latent, TINY.intermediate)
    assert weights.device == torch.device("cpu")
    assert all(a is b for a, b in zip(weights.tensors, given.values()))  # the caller's, as given
    assert repr(weights) == "ExpertWeights(experts 12..14 of 48, L=256, I=128, cpu)"
    moved = weights.to("cpu")
    assert moved.first_expert == FIRST and moved.num_experts == TINY.experts
    assert moved.w13 is weights.w13  # torch's `to`: no copy where the tensor already is
    with pytest.raises(AttributeError):
        weights.first_expert = 0  # frozen: validated once, never changed after
    # The smallest geometry: one expert, L = I = 32.
    one = ExpertWeights(*SyntheticLayer(TINY, 0).local(0, 1), first_expert=0, num_experts=1)
    assert one.num_local_experts == 1
    assert (
        ExpertWeights(
            torch.zeros(1, 64, 16, dtype=torch.uint8),
            torch.zeros(1, 64, 1, dtype=torch.uint8),
            torch.zeros(1, 32, 16, dtype=torch.uint8),
            torch.zeros(1, 32, 1, dtype=torch.uint8),
            first_expert=0,
            num_experts=1,
        ).intermediate
        == 32
    )


def test_first_expert_and_num_experts_are_keywords():
    with pytest.raises(TypeError):
        ExpertWeights(*tensors().values(), FIRST, TINY.experts)
    with pytest.raises(TypeError, match="num_experts"):
        ExpertWeights(*tensors().values(), first_expert=FIRST)  # no default for the model's E


def bad_inputs():
    """(label, changes, error, message): each breaks one rule."""
    t = tensors()
    w13, s13, w2, s2 = t["w13"], t["s13"], t["w2"], t["s2"]
    return [
        ("w13 a list", {"w13": [1]}, TypeError, "ExpertWeights: w13 is list; expected a torch"),
        ("s2 None", {"s2": None}, TypeError, "ExpertWeights: s2 is NoneType; expected a torch"),
        ("w2 int32", {"w2": w2.int()}, TypeError, "w2 dtype torch.int32; expected torch.uint8"),
        ("s13 float", {"s13": s13.float()}, TypeError, "s13 dtype torch.float32; expected"),
        ("w13 2-D", {"w13": w13[0]}, ValueError, r"w13 shape \(256, 128\); expected 3-D"),
        ("s2 4-D", {"s2": s2[None]}, ValueError, r"s2 shape \(1, 3, 256, 4\); expected 3-D"),
        (
            "first_expert float",
            {"first_expert": 1.5},
            TypeError,
            "first_expert=1.5; expected an int",
        ),
        (
            "first_expert bool",
            {"first_expert": True},
            TypeError,
            "first_expert=True; expected an int",
        ),
        ("num_experts str", {"num_experts": "48"}, TypeError, "num_experts='48'; expected an int"),
        (
            "no expert",
            {"w13": w13[:0], "s13": s13[:0], "w2": w2[:0], "s2": s2[:0]},
            ValueError,
            r"w13 shape \(0, 256, 128\) holds no expert; expected E_local >= 1",
        ),
        (
            "I not a multiple of 32",
            {"w13": w13[:, :240], "s13": s13[:, :240]},
            ValueError,
            "L=256, 2I=240; L and I must be positive multiples of 32",
        ),
        (
            "2I odd",
            {"w13": w13[:, :255], "s13": s13[:, :255]},
            ValueError,
            "2I=255; L and I must be positive multiples of 32",
        ),
        (
            "L not a multiple of 32",
            {"w13": w13[:, :, :120]},
            ValueError,
            "L=240, 2I=256; L and I must be positive multiples of 32",
        ),
        (
            "s13 short",
            {"s13": s13[:, :, :7]},
            ValueError,
            r"s13 shape \(3, 256, 7\); expected \(3, 256, 8\) \(E_local, L, I = 3, 256, 128",
        ),
        (
            "w2 of fewer experts",
            {"w2": w2[:2]},
            ValueError,
            r"w2 shape \(2, 256, 64\); expected \(3, 256, 64\)",
        ),
        (
            "s2 of another I",
            {"s2": s2[:, :, :2]},
            ValueError,
            r"s2 shape \(3, 256, 2\); expected \(3, 256, 4\)",
        ),
        (
            "sparse",
            {"w2": w2.to_sparse()},
            ValueError,
            "w2 layout torch.sparse_coo; expected torch.strided",
        ),
        (
            "devices",
            {"s13": s13.to("meta")},
            ValueError,
            "w13 on cpu, s13 on meta, w2 on cpu, s2 on cpu; expected all four on one device",
        ),
        (
            "meta",
            {n: v.to("meta") for n, v in t.items()},
            ValueError,
            "the weights are on the meta device",
        ),
        (
            "first_expert negative",
            {"first_expert": -1},
            ValueError,
            "first_expert=-1; expected an int >= 0",
        ),
        (
            "past the model",
            {"num_experts": 14},
            ValueError,
            "num_experts=14; expected >= first_expert \\+ E_local = 12 \\+ 3 = 15",
        ),
        (
            "beyond int32",
            {"num_experts": 2**31 + 1},
            ValueError,
            "num_experts=2147483649; .* at most 2\\^31 \\(ids are int32\\)",
        ),
    ]


@pytest.mark.parametrize(
    "label,changes,error,message", bad_inputs(), ids=[case[0] for case in bad_inputs()]
)
def test_each_bad_input_names_the_field_and_the_rule(label, changes, error, message):
    with pytest.raises(error, match=message) as raised:
        build(**changes)
    assert str(raised.value).startswith("ExpertWeights: "), (label, str(raised.value))


def test_every_backend_takes_only_expert_weights():
    """The four tensors, or anything else, are refused with a TypeError naming the backend
    before any device check (so on any machine)."""
    from dep_ep.experts import (
        DenseExperts,
        HopperExperts,
        ReferenceExperts,
        TrtllmExperts,
        default_experts,
    )
    from dep_ep.experts.trtllm import prepare_trtllm_weights

    four = tuple(tensors().values())
    backends = (ReferenceExperts, DenseExperts, HopperExperts, TrtllmExperts)
    for build in (*backends, default_experts, prepare_trtllm_weights):
        for bad in (four, list(four), None, {"w13": four[0]}):
            message = f"{build.__name__}: weights is {type(bad).__name__}; expected an ExpertW"
            with pytest.raises(TypeError, match=message):
                build(bad)
