"""dep_ep.integrations.vllm in one process: the stand-ins have the signatures they claim and the
adapter's experts module has DeepGemmMegaMoEExperts' (so real == stand-in, checked by
test_vllm_real.py, gives real == adapter); importing the adapter imports no vLLM; the plugin
is a no-op without DEP_EP_VLLM=1, names the supported versions for another vLLM and registers a
lazy class that resolves; the options; the per-step poll wraps the worker's step methods."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from standins import vllm_standin as vs

from dep_ep.integrations.vllm import engine as vllm_engine
from dep_ep.integrations.vllm import plugin, step_poll
from dep_ep.integrations.vllm.kimi_k3 import DepEpKimiExperts, layer_index
from dep_ep.integrations.vllm.options import options_from
from dep_ep.integrations.vllm.steps import sequence_parallel_size, step_tokens

SIGNED = [
    (vs.DPMetadata.__init__, vs.DPMetadata.SIGNATURE),
    (vs.DPMetadata.sp_local_sizes, vs.DPMetadata.SP_LOCAL_SIZES),
    (vs.MegaMoEActivation.__init__, vs.MegaMoEActivation.SIGNATURE),
    (vs.RMSNorm.__init__, vs.RMSNorm.SIGNATURE),
    (vs.KimiRoutedOutputTransform.__init__, vs.KimiRoutedOutputTransform.SIGNATURE),
    (vs.KimiRoutedOutputTransform.forward, vs.KimiRoutedOutputTransform.FORWARD),
    (vs.KimiMoE.__init__, vs.KimiMoE.SIGNATURE),
    (vs.KimiK3ForConditionalGeneration.__init__, vs.KimiK3ForConditionalGeneration.SIGNATURE),
    (vs.FusedMoEPrepareAndFinalizeModular.prepare, vs.FusedMoEPrepareAndFinalizeModular.PREPARE),
    (
        vs.FusedMoEPrepareAndFinalizeModular.finalize,
        vs.FusedMoEPrepareAndFinalizeModular.FINALIZE,
    ),
    (
        vs.FusedMoEPrepareAndFinalizeModular.allocate_fused_expert_output,
        vs.FusedMoEPrepareAndFinalizeModular.ALLOCATE,
    ),
    (vs.Worker.execute_model, vs.Worker.EXECUTE_MODEL),
    (vs.Worker.execute_dummy_batch, vs.Worker.EXECUTE_DUMMY_BATCH),
    # The adapter's module against the class it replaces.
    (DepEpKimiExperts.__init__, vs.DeepGemmMegaMoEExperts.SIGNATURE),
    (DepEpKimiExperts.forward, vs.DeepGemmMegaMoEExperts.FORWARD),
    (DepEpKimiExperts.weight_loader, vs.DeepGemmMegaMoEExperts.WEIGHT_LOADER),
]


@pytest.mark.parametrize("fn,claimed", SIGNED, ids=lambda v: getattr(v, "__qualname__", "sig"))
def test_signatures_are_the_ones_claimed(fn, claimed):
    assert vs.bare_signature(fn) == claimed


def test_bare_signature_drops_annotations_only():
    def f(self, a: int, *, b: str = "x") -> None: ...

    assert vs.bare_signature(f) == "(self, a, *, b='x')"


def experts_module(**overrides):
    """A DepEpKimiExperts of TINY's geometry (2 ranks' worth of experts, rank 0's)."""
    keywords = dict(
        num_experts=48,
        num_local_experts=24,
        experts_start_idx=0,
        top_k=6,
        hidden_size=256,
        intermediate_size=128,
        activation=vs.MegaMoEActivation("situ", alpha=4.0, beta=25.0),
        weight_format=vs.MEGA_MOE_MXFP4,
        prefix="language_model.model.layers.3.block_sparse_moe.experts",
    )
    keywords.update(overrides)
    cfg = vs.vllm_config(vs.KimiK3TextConfig(512, 256, 128, 48, 6), max_num_batched_tokens=40)
    with vllm_engine.replaced(vs.VllmStandin()):
        return DepEpKimiExperts(cfg, **keywords), cfg


def test_experts_module_has_the_replaced_class_surface():
    """Every attribute and method DeepGemmMegaMoEExperts has that the adapter mirrors, the
    checkpoint-layout parameters with their loader, the static forward context entry."""
    module, cfg = experts_module()
    missing = [a for a in vs.DeepGemmMegaMoEExperts.ATTRIBUTES if not hasattr(module, a)]
    missing += [m for m in vs.DeepGemmMegaMoEExperts.METHODS if not hasattr(type(module), m)]
    assert not missing, missing
    shapes = {name: (p.dtype, tuple(p.shape)) for name, p in module.named_parameters()}
    assert shapes == {
        "w13_weight": (torch.uint8, (24, 256, 128)),
        "w13_weight_scale": (torch.uint8, (24, 256, 8)),
        "w2_weight": (torch.uint8, (24, 256, 64)),
        "w2_weight_scale": (torch.uint8, (24, 256, 4)),
    }
    assert all(p.weight_loader == module.weight_loader for p in module.parameters())
    assert DepEpKimiExperts.weight_loader.supports_moe_loading is True
    assert cfg.compilation_config.static_forward_context[module.prefix] is module
    assert module.layer_id == 3 and module.tokens_per_step() == 40
    assert module.has_fused_shared_experts is False


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(activation=vs.MegaMoEActivation("swiglu")), ValueError, "SiTU"),
        (dict(weight_format=vs.MEGA_MOE_BF16), ValueError, "'bf16'"),
        (dict(hidden_size=250), ValueError, "hidden_size=250"),
        (dict(experts_start_idx=30), ValueError, "outside the num_experts=48"),
        (dict(prefix="experts"), ValueError, "0 layer numbers"),
        (dict(top_k=6.0), TypeError, "top_k"),
    ],
)
def test_experts_module_refuses_what_it_cannot_run(overrides, error, match):
    with pytest.raises(error, match=match):
        experts_module(**overrides)


def test_importing_the_adapter_imports_no_vllm():
    """Run in a fresh interpreter: no module named vllm* gets imported."""
    probe = (
        "import sys; import dep_ep.integrations.vllm.plugin, dep_ep.integrations.vllm.kimi_k3,"
        " dep_ep.integrations.vllm.prepare_finalize;"
        " print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_plugin_is_a_no_op_unless_enabled(monkeypatch):
    seam = vs.VllmStandin()
    monkeypatch.delenv("DEP_EP_VLLM", raising=False)
    with vllm_engine.replaced(seam):
        assert plugin.register() is False
        monkeypatch.setenv("DEP_EP_VLLM", "1")
        assert plugin.register() is True
    assert seam.registered == [(plugin.KIMI_K3_ARCHITECTURE, plugin.KIMI_K3_MODEL)]


def test_plugin_names_the_supported_versions(monkeypatch):
    seam = vs.VllmStandin(version_string="0.34.0")
    monkeypatch.setenv("DEP_EP_VLLM", "1")
    with vllm_engine.replaced(seam), pytest.raises(ValueError, match=r"vLLM 0\.34\.0 .* 0\.33\.0"):
        plugin.register()
    assert seam.registered == []


def test_registered_target_resolves_to_a_subclass_of_the_engines_model():
    """The lazy "module:Class" imports and resolves as vLLM's _LazyRegisteredModel does
    (import_module, getattr) to a subclass of the engine's KimiK3ForConditionalGeneration."""
    module_name, class_name = plugin.KIMI_K3_MODEL.split(":")
    seam = vs.VllmStandin()
    with vllm_engine.replaced(seam):
        cls = getattr(importlib.import_module(module_name), class_name)
    assert issubclass(cls, vs.KimiK3ForConditionalGeneration)
    assert cls.__name__ == class_name and cls.__module__ == module_name


def test_options():
    cfg = vs.vllm_config(vs.KimiK3TextConfig(512, 256, 128, 48, 6))
    assert options_from("t", cfg).fused_norm is False
    cfg.additional_config = {"dep_ep": {"fused_norm": True, "max_tokens": 8, "timeout_s": 30}}
    got = options_from("t", cfg)
    assert (got.fused_norm, got.max_tokens, got.timeout_s) == (True, 8, 30)
    for bad, error, match in [
        ({"fused": True}, ValueError, "unknown key"),
        ({"fused_norm": 1}, TypeError, "fused_norm"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"timeout_s": -1}, ValueError, "timeout"),
        ([1], TypeError, "JSON object"),
    ]:
        cfg.additional_config = {"dep_ep": bad}
        with pytest.raises(error, match=match):
            options_from("t", cfg)


def test_step_tokens_and_sequence_parallel_size():
    dp = vs.DPMetadata(torch.tensor([3, 7, 0, 5]))
    context = vs.ForwardContext(dp_metadata=dp)
    assert step_tokens(None, 0) == 1 and step_tokens(vs.ForwardContext(), 5) == 5
    assert step_tokens(context, 3) == 7 and step_tokens(context, 2, 2) == 4
    with dp.sp_local_sizes(2):
        assert step_tokens(context, 2, 1) == 4  # the runner's per-rank sizes win
    pc = vs.vllm_config(vs.KimiK3TextConfig(512, 256, 128, 48, 6), tensor_parallel_size=4)
    assert sequence_parallel_size(pc.parallel_config) == 4
    pc.parallel_config.pipeline_parallel_size = 2
    assert sequence_parallel_size(pc.parallel_config) == 1
    assert layer_index("t", "a.layers.12.moe.experts") == 12


def test_step_tokens_is_kept_for_one_forwards_dp_metadata():
    """The later layers of a forward get its first layer's T; a new DPMetadata (vLLM makes one a
    forward), local_sizes set or cleared, or another sequence-parallel width give T again from
    the counts then."""
    first = vs.ForwardContext(dp_metadata=vs.DPMetadata(torch.tensor([3, 7])))
    assert step_tokens(first, 3) == 7
    first.dp_metadata.num_tokens_across_dp_cpu = torch.tensor([3, 9])  # vLLM never does this
    assert step_tokens(first, 3) == 7  # the forward's T, not read again
    assert step_tokens(first, 3, 2) == 5  # another width: read again
    with first.dp_metadata.sp_local_sizes(3):
        assert step_tokens(first, 3, 2) == 3  # the runner's per-rank sizes, ceil(9 / 3)
    assert step_tokens(first, 3, 2) == 5
    second = vs.ForwardContext(dp_metadata=vs.DPMetadata(torch.tensor([2, 4])))
    assert step_tokens(second, 2) == 4 and step_tokens(second, 2) == 4
    assert step_tokens(vs.ForwardContext(), 6) == 6  # DP = 1: this rank's rows
    assert step_tokens(first, 3) == 9


def test_step_poll_wraps_the_worker_steps_once(monkeypatch):
    polls = []
    monkeypatch.setattr(step_poll, "poll_all", lambda: polls.append(1))
    seam = vs.VllmStandin()
    original = {name: getattr(vs.Worker, name) for name in step_poll.STEP_METHODS}
    try:
        with vllm_engine.replaced(seam):
            step_poll.install_step_poll()
            step_poll.install_step_poll()
        worker = vs.Worker(step=lambda batch: "ran")
        assert worker.execute_model("batch") == "ran" and polls == [1]
        worker.execute_dummy_batch()
        assert polls == [1, 1]
    finally:
        for name, method in original.items():
            setattr(vs.Worker, name, method)
