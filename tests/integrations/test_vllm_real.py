"""The drift test: the real vLLM 0.33.0 classes against the stand-ins the CPU tests run on, the
adapter's T and padding logic on vLLM's own ForwardContext / DPMetadata, and the plugin found by
vLLM's own plugin loader. vLLM is installed without its dependencies into the git-ignored
`.engines/vllm` beside a CPU torch (docs/integrations.md, "vLLM", has the commands); run as

    PYTHONPATH=.engines/vllm .engines/venv/bin/python -m pytest -q \
        tests/integrations/test_vllm_real.py

Skipped, with the reason, where vLLM 0.33.0 is not importable (CI installs no engine: there
the stand-in tests carry the adapter's logic)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import torch
from standins import vllm_standin as vs

from dep_ep.integrations.vllm import engine as vllm_engine
from dep_ep.integrations.vllm import plugin
from dep_ep.integrations.vllm.steps import padding_mask, step_tokens

ROOT = Path(__file__).resolve().parents[2]
ENGINE_DIR = ROOT / ".engines" / "vllm"


def _real_vllm():
    """vllm's version module when vLLM 0.33.0 is importable, else the reason it is not."""
    try:
        version = importlib.import_module("vllm.version")
    except Exception as err:  # any failure to import is a reason to skip
        return None, (
            f"vLLM is not importable ({type(err).__name__}: {err}); install vLLM 0.33.0 into"
            f" {ENGINE_DIR} and run with PYTHONPATH={ENGINE_DIR} (docs/integrations.md, 'vLLM')"
        )
    if version.__version__ != vs.VERSION:
        return None, f"vLLM {version.__version__} is installed; this test checks {vs.VERSION}"
    return version, None


_VERSION, _REASON = _real_vllm()
pytestmark = pytest.mark.skipif(_VERSION is None, reason=str(_REASON))


def real(path: str):
    """The object at "module:attr.attr" of the real vLLM."""
    module, _, attrs = path.partition(":")
    obj = importlib.import_module(module)
    for name in attrs.split("."):
        obj = getattr(obj, name)
    return obj


FUSED_MOE = "vllm.model_executor.layers.fused_moe"
K3 = "vllm.models.kimi_k3.nvidia.model"
MEGA = f"{FUSED_MOE}.deep_gemm_mega_moe:DeepGemmMegaMoEExperts"
MODULAR = f"{FUSED_MOE}.modular_kernel:FusedMoEPrepareAndFinalizeModular"
SIGNATURES = {
    f"{MEGA}.__init__": vs.DeepGemmMegaMoEExperts.SIGNATURE,
    f"{MEGA}.forward": vs.DeepGemmMegaMoEExperts.FORWARD,
    f"{MEGA}.weight_loader": vs.DeepGemmMegaMoEExperts.WEIGHT_LOADER,
    f"{FUSED_MOE}.deep_gemm_mega_moe:MegaMoEActivation.__init__": vs.MegaMoEActivation.SIGNATURE,
    "vllm.forward_context:DPMetadata.__init__": vs.DPMetadata.SIGNATURE,
    "vllm.forward_context:DPMetadata.sp_local_sizes": vs.DPMetadata.SP_LOCAL_SIZES,
    "vllm.model_executor.layers.layernorm:RMSNorm.__init__": vs.RMSNorm.SIGNATURE,
    f"{K3}:KimiRoutedOutputTransform.__init__": vs.KimiRoutedOutputTransform.SIGNATURE,
    f"{K3}:KimiRoutedOutputTransform.forward": vs.KimiRoutedOutputTransform.FORWARD,
    f"{K3}:KimiMoE.__init__": vs.KimiMoE.SIGNATURE,
    f"{K3}:KimiK3ForConditionalGeneration.__init__": vs.KimiK3ForConditionalGeneration.SIGNATURE,
    f"{MODULAR}.prepare": vs.FusedMoEPrepareAndFinalizeModular.PREPARE,
    f"{MODULAR}.finalize": vs.FusedMoEPrepareAndFinalizeModular.FINALIZE,
    f"{MODULAR}.allocate_fused_expert_output": vs.FusedMoEPrepareAndFinalizeModular.ALLOCATE,
    "vllm.v1.worker.gpu_worker:Worker.execute_model": vs.Worker.EXECUTE_MODEL,
    "vllm.v1.worker.gpu_worker:Worker.execute_dummy_batch": vs.Worker.EXECUTE_DUMMY_BATCH,
}


@pytest.mark.parametrize("path", sorted(SIGNATURES))
def test_mirrored_signature(path):
    assert vs.bare_signature(real(path)) == SIGNATURES[path], path


def test_mirrored_shapes():
    """The fields, attributes, abstract methods, module globals and name mapping the adapter and
    the stand-ins rely on."""
    fields = real("vllm.forward_context:ForwardContext").__dataclass_fields__
    for name, default in vs.ForwardContext.FIELDS.items():
        assert name in fields and fields[name].default is default, name
    assert "local_sizes" in real("vllm.forward_context:DPMetadata").__dataclass_fields__
    coordinator = inspect.getsource(real("vllm.distributed.parallel_state:GroupCoordinator"))
    for name in vs.GroupCoordinator.FIELDS:
        assert f"self.{name} =" in coordinator, name
    mega = real(MEGA)
    source = inspect.getsource(mega.__init__)
    for name in vs.DeepGemmMegaMoEExperts.ATTRIBUTES:
        assert f"self.{name}" in source or hasattr(mega, name), name
    for name in vs.DeepGemmMegaMoEExperts.METHODS:
        assert hasattr(mega, name), name
    assert mega.weight_loader.supports_moe_loading is True
    abstract = real(MODULAR).__abstractmethods__
    assert set(abstract) == set(vs.FusedMoEPrepareAndFinalizeModular.ABSTRACT)
    k3 = importlib.import_module(K3)
    assert k3.DeepGemmMegaMoEExperts is mega  # the module global KimiMoE builds with
    assert "DeepGemmMegaMoEExperts(" in inspect.getsource(k3.KimiMoE.__init__)
    for experts in (4, 896):
        assert k3.make_kimi_k3_mega_moe_expert_params_mapping(experts) == (
            vs.make_kimi_k3_mega_moe_expert_params_mapping(experts)
        )
    assert real(f"{FUSED_MOE}.deep_gemm_mega_moe:MEGA_MOE_MXFP4").name == vs.MEGA_MOE_MXFP4.name


def test_engine_rms_norm_is_the_standins():
    """vLLM's native RMSNorm (vllm.ir.ops.layernorm.rms_norm) gives the stand-in's bits."""
    rms_norm = real("vllm.ir.ops.layernorm:rms_norm")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 256, generator=gen).to(torch.bfloat16)
    norm = vs.RMSNorm(256, eps=1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(256, generator=gen)).to(torch.bfloat16)
    want = rms_norm(x, norm.weight.data, 1e-5, None)
    assert torch.equal(norm(x).view(torch.int16), want.view(torch.int16))


def test_t_and_padding_on_the_real_forward_context():
    """step_tokens and padding_mask through the real engine seam, on vLLM's ForwardContext and
    DPMetadata (inside and outside sp_local_sizes)."""
    fc = importlib.import_module("vllm.forward_context")
    seam = vllm_engine.VllmEngine()
    assert seam.forward_context() is None
    dp = fc.DPMetadata(torch.tensor([3, 7, 0, 5], dtype=torch.int32))
    mask = torch.tensor([False, True, False, False, True, True])
    context = fc.ForwardContext(
        no_compile_layers={}, attn_metadata={}, slot_mapping={}, dp_metadata=dp, is_padding=mask
    )
    with fc.override_forward_context(context):
        got = seam.forward_context()
        assert got is context
        assert step_tokens(got, 3) == 7 and step_tokens(got, 2, 2) == 4
        with dp.sp_local_sizes(2) as sizes:
            assert sizes == [2, 2, 4, 4, 0, 0, 3, 3]
            assert step_tokens(got, 2) == 4
        assert padding_mask(got) is mask
    none = fc.ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
    assert step_tokens(none, 5) == 5 and padding_mask(none) is None and padding_mask(None) is None


def test_plugin_through_vllms_loader(monkeypatch):
    """vLLM's load_plugins_by_group finds dep_ep's entry point (dep-ep installed in the same
    environment); with DEP_EP_VLLM=1 it registers the lazy model in the real ModelRegistry,
    which resolves it to a subclass of vLLM's KimiK3ForConditionalGeneration."""
    plugins = real("vllm.plugins:load_plugins_by_group")("vllm.general_plugins")
    assert plugins.get("dep_ep") is plugin.register, sorted(plugins)
    registry = real("vllm.model_executor.models.registry:ModelRegistry")
    arch = plugin.KIMI_K3_ARCHITECTURE
    before = registry.models[arch]
    monkeypatch.setenv("DEP_EP_VLLM", "1")
    try:
        assert plugins["dep_ep"]() is True
        entry = registry.models[arch]
        assert f"{entry.module_name}:{entry.class_name}" == plugin.KIMI_K3_MODEL
        cls = entry.load_model_cls()
        assert issubclass(cls, real(f"{K3}:KimiK3ForConditionalGeneration"))
    finally:
        registry.models[arch] = before
