"""The SGLang 0.5.23 facts dep_ep.integrations.sglang relies on, checked against SGLang itself as
far as it goes on a CPU machine (docs/integrations.md, "SGLang", says how to install it there and
what ran): installed with `pip install --no-deps --target .engines/sglang sglang==0.5.23`, its
pure-Python dependencies beside it, on PYTHONPATH. Skipped, with the reason, where it is not.

- From its source files, without importing them (most of its MoE modules import torchvision,
  which needs a CUDA build of torch): the parameters of every function the hooks patch, call or
  mirror equal the stand-ins' SIGNATUREs, the fields and attributes the hooks read exist, and the
  statements whose behaviour the hooks reproduce (the scaling factor, the idle rank's [0, L]
  latent, the norm after the experts, the T rule, the "no expert" ids) read as the docs say.
- Imported: the real HookRegistry applies REPLACE, AROUND and AFTER hooks on a target of ours;
  SGLang's own plugin loader finds dep_ep's entry point and runs register(), which registers
  every hook with the real registry; the real seam (engine.py) reads the DP counts, the real-row
  bound, the token budgets and the parallel widths from the real modules.
- The modules that do not import are listed as skipped tests naming the import error.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import types
from pathlib import Path

import pytest
import torch
from standins import sglang_standin as ss

from dep_ep.integrations.sglang import plugin
from dep_ep.integrations.sglang.engine import SGLANG_VERSIONS, SglangEngine
from dep_ep.integrations.sglang.steps import padding_mask, step_tokens

from helpers.source_signatures import assigned_attributes, class_fields, signature_of, source_of

HOW = (
    "install SGLang as docs/integrations.md ('SGLang') says and put .engines/sglang and"
    " .engines/sglang-deps on PYTHONPATH"
)
_SPEC = importlib.util.find_spec("sglang")
if _SPEC is None or not _SPEC.submodule_search_locations:
    pytest.skip(f"sglang is not on the path: {HOW}", allow_module_level=True)
SRT = Path(list(_SPEC.submodule_search_locations)[0]) / "srt"

KIMI = SRT / "models/kimi_k3.py"
MXFP4 = SRT / "layers/quantization/mxfp4.py"
FUSED = SRT / "layers/moe/fused_moe_triton/layer.py"
BASE = SRT / "layers/moe/token_dispatcher/base.py"
FLASHINFER = SRT / "layers/moe/token_dispatcher/flashinfer.py"
TOPK = SRT / "layers/moe/topk.py"
EPLB = SRT / "eplb/expert_distribution.py"
SCHEDULER = SRT / "managers/scheduler.py"
REGISTRY = SRT / "plugins/hook_registry.py"
DP = SRT / "layers/dp_attention.py"
CONTEXT = SRT / "model_executor/forward_context.py"
ENVIRON = SRT / "environ.py"
LAYERNORM = SRT / "layers/layernorm.py"
LOADER = SRT / "model_loader/loader.py"
PARALLEL_STATE = SRT / "distributed/parallel_state.py"
RUNTIME = SRT / "runtime_context.py"
UTILS = SRT / "layers/moe/utils.py"


def test_the_installed_release_is_the_one_the_hooks_were_written_against():
    assert SglangEngine().version() in SGLANG_VERSIONS


# ---------------------------------------------------------------------------------- source
def _standin_signatures():
    for name, cls in (
        ("KimiK3MoE", ss.KimiK3MoE),
        ("Mxfp4MoEMethod", ss.Mxfp4MoEMethod),
        ("FusedMoE", ss.FusedMoE),
        ("BaseDispatcher", ss.BaseDispatcher),
        ("HookRegistry", ss.HookRegistry),
        ("ExpertDistributionRecorder", ss.ExpertDistributionRecorder),
        ("Scheduler", ss.Scheduler),
    ):
        for method, signature in cls.SIGNATURES.items():
            yield f"{name}.{method}", signature
    yield "create_moe_dispatcher", ss.create_moe_dispatcher.SIGNATURE


_FILES = {
    "KimiK3MoE": KIMI,
    "Mxfp4MoEMethod": MXFP4,
    "FusedMoE": FUSED,
    "create_moe_dispatcher": FUSED,
    "BaseDispatcher": BASE,
    "HookRegistry": REGISTRY,
    "ExpertDistributionRecorder": EPLB,
    "Scheduler": SCHEDULER,
}
_MODULE_FILES = {
    "sglang.srt.layers.dp_attention": DP,
    "sglang.srt.model_executor.forward_context": CONTEXT,
    "sglang.srt.layers.moe.utils": UTILS,
    "sglang.srt.eplb.expert_distribution": EPLB,
    "sglang.srt.runtime_context": RUNTIME,
}
SIGNATURES = [(_FILES[q.split(".")[0]], q, s) for q, s in _standin_signatures()]
SIGNATURES += [
    (_MODULE_FILES[module], name, signature)
    for module, functions in ss.FUNCTION_SIGNATURES.items()
    for name, signature in functions.items()
]
SIGNATURES += [
    (FLASHINFER, "_scattered_source_token_counts", ss.scattered_source_token_counts.SIGNATURE),
    (FLASHINFER, "_max_tokens_per_scattered_source", "(dp_global_num_tokens, attn_tp_size)"),
    (
        DP,
        "set_dp_buffer_len",
        (
            "(global_dp_buffer_len, local_dp_buffer_len, dp_max_padding, global_num_tokens=None,"
            " global_num_tokens_gpu=None)"
        ),
    ),
]


@pytest.mark.parametrize("path, qualname, signature", SIGNATURES, ids=lambda v: str(v)[-60:])
def test_signature(path, qualname, signature):
    assert signature_of(path, qualname) == signature


@pytest.mark.parametrize(
    "path, qualname, fields",
    [
        (TOPK, "StandardTopKOutput", list(ss.StandardTopKOutput._fields)),
        (FLASHINFER, "FlashinferDispatchOutput", list(ss.FlashinferDispatchOutput._fields)),
        (FLASHINFER, "FlashinferCombineInput", list(ss.FlashinferCombineInput._fields)),
        (CONTEXT, "ForwardContext", ["attn_backend", "moe_num_token_non_padded"]),
    ],
    ids=lambda v: str(v)[-40:],
)
def test_fields(path, qualname, fields):
    assert class_fields(path, qualname) == fields


@pytest.mark.parametrize(
    "path, qualname, names",
    [
        (
            KIMI,
            "KimiK3MoE.__init__",
            {"experts", "layer_idx", "routed_scaling_factor", "_use_mega_moe", "_mega_top_k"}
            | {"moe_hidden_size", "routed_expert_norm"},
        ),
        (
            FUSED,
            "FusedMoE.__init__",
            {"num_experts", "num_local_experts", "top_k", "layer_id", "moe_ep_rank"}
            | {"moe_ep_size", "moe_tp_size", "num_fused_shared_experts", "moe_runner_config"}
            | {"should_fuse_routed_scaling_factor_in_topk", "quant_method", "dispatcher"},
        ),
        (MXFP4, "Mxfp4MoEMethod.__init__", {"use_mega_moe"}),
        (LAYERNORM, "RMSNorm.__init__", {"weight", "variance_epsilon"}),
        (PARALLEL_STATE, "GroupCoordinator.__init__", {"cpu_group", "device_group"}),
    ],
    ids=lambda v: str(v)[-40:],
)
def test_attributes_the_hooks_read(path, qualname, names):
    assert names <= assigned_attributes(path, qualname)


# (file, definition or None for the whole file, statement): what the hooks reproduce or rely on.
STATEMENTS = [
    # The scaling factor: applied to the experts' sum unless fused into the top-k weights.
    (
        KIMI,
        "KimiK3MoE._forward_mega_experts",
        "if not self.experts.should_fuse_routed_scaling_factor_in_topk: if ("
        " self.routed_scaling_factor is not None and self.routed_scaling_factor != 1.0 ):"
        " y.mul_(self.routed_scaling_factor)",
    ),
    (KIMI, "KimiK3MoE._forward_mega_experts", "topk_output.topk_ids.to(torch.int32)"),
    (KIMI, "KimiK3MoE._forward_mega_experts", "topk_output.topk_weights.to(torch.float32)"),
    (
        KIMI,
        "KimiK3MoE._forward_mega_experts",
        "SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK",
    ),
    # The idle rank's [0, L] latent; the norm after the experts, skipped for 0 rows.
    (
        KIMI,
        "KimiK3MoE._forward_unfused",
        "routed_input = hidden_states.new_empty((0, self.moe_hidden_size))",
    ),
    (
        KIMI,
        "KimiK3MoE._forward_unfused",
        "self._forward_mega_experts(expert_input, topk_output) if self._use_mega_moe",
    ),
    (KIMI, "KimiK3MoE._forward_unfused", "if expert_output.shape[0] == 0:"),
    (KIMI, "KimiK3MoE._forward_unfused", "latent = self._reduce_latent(expert_output)"),
    (
        KIMI,
        "KimiK3MoE._reduce_latent",
        "if not self._routed_needs_reduce: return self._latent_norm(latent)",
    ),
    (
        KIMI,
        "KimiK3MoE._routed_needs_reduce",
        "return self.tp_size > 1 and get_moe_a2a_backend().is_none()",
    ),
    (KIMI, "KimiK3MoE._latent_norm", "return self.routed_expert_norm(latent)"),
    # The experts module: K3's SiTU constants, w13 rows [w1; w3], megamoe from the a2a backend.
    (KIMI, "KimiK3MoE.__init__", "self._use_mega_moe = get_moe_a2a_backend().is_megamoe()"),
    (KIMI, "KimiK3MoE.__init__", "gemm1_alpha=config.activation_situ_beta"),
    (KIMI, "KimiK3MoE.__init__", "gemm1_clamp_limit=config.activation_situ_linear_beta"),
    (KIMI, "KimiK3MoE.__init__", "gate_up_interleaved=False"),
    (
        KIMI,
        "KimiK3MoE.__init__",
        'num_experts=getattr(config, "n_routed_experts", config.num_experts)',
    ),
    # The weights: checkpoint layout, unpadded under megamoe, converted only in this method.
    (MXFP4, "Mxfp4MoEMethod.__init__", "self.use_mega_moe = get_moe_a2a_backend().is_megamoe()"),
    (MXFP4, "Mxfp4MoEMethod.create_weights", "elif self.use_deep_gemm or self.use_mega_moe:"),
    (MXFP4, "Mxfp4MoEMethod.create_weights", 'layer.register_parameter("w13_weight", w13_weight)'),
    (
        MXFP4,
        "Mxfp4MoEMethod.create_weights",
        'layer.register_parameter("w13_weight_scale", w13_weight_scale)',
    ),
    (MXFP4, "Mxfp4MoEMethod.create_weights", 'layer.register_parameter("w2_weight", w2_weight)'),
    (
        MXFP4,
        "Mxfp4MoEMethod.create_weights",
        'layer.register_parameter("w2_weight_scale", w2_weight_scale)',
    ),
    (
        MXFP4,
        "Mxfp4MoEMethod.process_weights_after_loading",
        "if self.use_deep_gemm or self.use_mega_moe:",
    ),
    (MXFP4, "Mxfp4MoEMethod.process_weights_after_loading", "transform_weights_for_mega_moe"),
    (FUSED, "FusedMoE._load_w13", '"load_up_proj_weight_first", False,'),
    (
        FUSED,
        "FusedMoE.__init__",
        "self.quant_method.create_weights( layer=self, num_experts=self.num_local_experts,",
    ),
    (LOADER, None, "quant_method.process_weights_after_loading(module)"),
    # The dispatcher: how FusedMoE builds and calls it, FlashInfer's T and "no expert" rules.
    (
        FUSED,
        "FusedMoE.__init__",
        "create_moe_dispatcher( self.moe_runner_config, quant_method=self.quant_method )",
    ),
    (
        FUSED,
        "create_moe_dispatcher",
        "elif a2a_backend.is_flashinfer(): return FlashinferDispatcher(",
    ),
    (
        FUSED,
        "FusedMoE._dispatch_with_pre_quant",
        "self.dispatcher.dispatch( hidden_states=hidden_states, topk_output=topk_output )",
    ),
    (FUSED, "FusedMoE.forward_impl", "self.dispatcher.combine(combine_input=combine_input)"),
    (
        BASE,
        "BaseDispatcher._dispatch_with_hook",
        "self._original_dispatch_func( hidden_states=hidden_states, topk_output=topk_output )",
    ),
    (
        FLASHINFER,
        "_max_tokens_per_scattered_source",
        "return (max_dp_tokens + attn_tp_size - 1) // attn_tp_size",
    ),
    (
        FLASHINFER,
        "FlashinferDispatcher.dispatch",
        "if dp_global is not None and len(dp_global) > 1:",
    ),
    (FLASHINFER, "FlashinferDispatcher.dispatch", "runtime_max_tokens_per_rank = x.shape[0]"),
    (
        FLASHINFER,
        "FlashinferDispatcher.__init__",
        "runner_backend.is_deep_gemm() or runner_backend.is_flashinfer_trtllm()"
        " or runner_backend.is_flashinfer_trtllm_routed()",
    ),
    (FLASHINFER, "FlashinferDispatcher.__init__", "else self.num_experts"),
    # Padding rows, the DP counts, the budgets.
    (TOPK, "_mask_topk_ids_padded_region", "fill_value: int = -1,"),
    (TOPK, "precomputed_topk_postprocess_is_noop", "and num_token_non_padded is None"),
    (
        DP,
        "set_dp_buffer_len_from_batch",
        "global_num_tokens = forward_batch.global_num_tokens_padded_cpu",
    ),
    (ENVIRON, None, "SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK = EnvInt(8192)"),
    (ENVIRON, None, "SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK = EnvInt(None)"),
    (ENVIRON, None, 'SGLANG_PLUGINS = EnvStr("")'),
    # The recorder: megamoe counts at top-k selection; the per-rank hook is a no-op there.
    (
        EPLB,
        "_SinglePassGatherer.init_new",
        "return _SelectExpertsSinglePassGatherer(expert_location_metadata, rank)",
    ),
    (EPLB, "_SinglePassGatherer.on_deepep_dispatch_low_latency", "): pass"),
    (
        EPLB,
        "_DeepepLowLatencySinglePassGatherer.on_deepep_dispatch_low_latency",
        "self._data[layer_idx, :] += local_physical_count_of_layer",
    ),
    # The per-step poll: both scheduler loops call process_batch_result once per step.
    (SCHEDULER, "Scheduler.event_loop_normal", "self.process_batch_result(batch, result)"),
    (SCHEDULER, "Scheduler.event_loop_overlap", "self.process_batch_result(tmp_batch, tmp_result)"),
    # The groups: the EP group's cpu_group is gloo.
    (PARALLEL_STATE, "GroupCoordinator.__init__", 'backend="gloo",'),
    (RUNTIME, None, '("moe_ep_size", "moe_ep_group"),'),
]


@pytest.mark.parametrize("path, qualname, statement", STATEMENTS, ids=lambda v: str(v)[-50:])
def test_statement(path, qualname, statement):
    text = " ".join(path.read_text().split()) if qualname is None else source_of(path, qualname)
    assert statement in text


def test_mxfp4_does_not_load_the_up_projection_first():
    """FusedMoE loads w1 before w3 unless the quant method says `load_up_proj_weight_first`;
    Mxfp4MoEMethod does not, so w13's rows are [w1 (gate); w3 (up)], ExpertWeights' order."""
    assert "load_up_proj_weight_first" not in MXFP4.read_text()


# ---------------------------------------------------------------------------------- imported
def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception as err:  # the reason is the skip's message
        why = f"{name} does not import here: {type(err).__name__}: {err}"
        if "torchvision" in str(err):
            why += " (torchvision's PyPI wheels link a CUDA build of torch; docs/integrations.md)"
        pytest.skip(why)


@pytest.fixture
def registry():
    """SGLang's HookRegistry, emptied before and after the test (it is process-wide)."""
    module = _import("sglang.srt.plugins.hook_registry")
    module.HookRegistry.reset()
    yield module
    module.HookRegistry.reset()


def test_hook_registry_applies_replace_around_and_after(registry):
    """REPLACE gets the method's arguments, AROUND the original first, AFTER the result first;
    REPLACE is applied first whatever the order of registration."""
    target = types.ModuleType("dep_ep_sglang_hook_target")

    class Target:
        def value(self, x):
            return x + 1

        def other(self, x):
            return x

    target.Target = Target
    sys.modules[target.__name__] = target
    try:
        hooks, kind = registry.HookRegistry, registry.HookType
        name = f"{target.__name__}.Target"
        hooks.register(
            f"{name}.value", lambda original, self, x: 100 + original(self, x), kind.AROUND
        )
        hooks.register(f"{name}.value", lambda self, x: 10 * x, kind.REPLACE)
        hooks.register(f"{name}.other", lambda result, self, x: result - 1, kind.AFTER)
        hooks.apply_hooks()
        assert Target().value(2) == 120
        assert Target().other(5) == 4
    finally:
        del sys.modules[target.__name__]


def test_sglangs_loader_finds_and_runs_the_plugin(registry, monkeypatch):
    """The entry point group is SGLang's, its loader finds dep_ep's entry point (from the
    editable install's metadata) and the loaded register() registers every hook of
    plugin.HOOKS with the real registry and hook types (not applied: their target modules do
    not import here)."""
    plugins = _import("sglang.srt.plugins")
    assert plugins.GENERAL_PLUGINS_GROUP == "sglang.srt.plugins"
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    found = plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP)
    assert "dep_ep" in found, f"found {sorted(found)}: reinstall dep_ep (pip install -e .)"
    register, dist = found["dep_ep"]
    assert register is plugin.register and dist == "dep-ep"
    monkeypatch.setenv("DEP_EP_SGLANG", "1")
    register()
    hook_type = registry.HookType
    got = {target: [h[0] for h in hooks] for target, hooks in registry.HookRegistry._hooks.items()}
    want = {h.target: [getattr(hook_type, h.kind)] for h in plugin.HOOKS}
    assert got == want


def test_the_real_seam_reads_the_real_modules():
    """engine.SglangEngine on the modules that import: the version, the DP counts
    set_dp_buffer_len publishes, the real-row bound of a ForwardContext, the token budgets'
    defaults, the parallel widths under get_parallel().override; and the step's T and padding
    rows computed through it."""
    dp = _import("sglang.srt.layers.dp_attention")
    context = _import("sglang.srt.model_executor.forward_context")
    runtime = _import("sglang.srt.runtime_context")
    _import("sglang.srt.environ")
    assert str(inspect.signature(dp.get_dp_global_num_tokens)) == "() -> 'List[int]'"
    real = SglangEngine()
    assert real.check_version("test") in SGLANG_VERSIONS
    assert real.mega_moe_max_tokens() == 8192 and real.dispatch_max_tokens() is None
    previous = dp.get_dp_global_num_tokens()
    dp.set_dp_buffer_len(14, 7, False, [7, 3, 0, 5])
    try:
        ctx = context.ForwardContext(
            attn_backend=None, moe_num_token_non_padded=lambda: torch.tensor([5])
        )
        with context.forward_context(ctx):
            assert torch.equal(real.num_token_non_padded(), torch.tensor([5]))
            mask = padding_mask(real, 7, torch.device("cpu"))
        assert mask.tolist() == [False] * 5 + [True] * 2
        group = types.SimpleNamespace(cpu_group="the gloo group")
        with runtime.get_parallel().override(attn_tp_size=2, moe_ep_group=group):
            assert real.ep_group() == "the gloo group"
            tokens = step_tokens(real.dp_global_num_tokens(), real.attn_tp_size(), 4)
        assert tokens == 4  # ceil(7 / 2)
    finally:
        dp.set_dp_buffer_len(0, 0, False, previous)
    assert real.hook_registry()[0] is _import("sglang.srt.plugins.hook_registry").HookRegistry


def test_a_real_forward_context_scopes_one_padding_mask():
    """The hook's padding mask is made once a forward, keyed on the ForwardContext object:
    SGLang's `forward_context(ctx, forward_batch=...)`, as its runners enter every forward,
    publishes a new object each time, even for the same ctx and batch, so a forward whose
    bound buffer now holds another count gets a new mask."""
    context = _import("sglang.srt.model_executor.forward_context")
    real, cpu = SglangEngine(), torch.device("cpu")
    bound = torch.tensor([5], dtype=torch.int32)
    batch = types.SimpleNamespace(moe_num_token_non_padded=lambda: bound)
    base = context.ForwardContext(attn_backend=None)
    with context.forward_context(base, forward_batch=batch):
        first = padding_mask(real, 7, cpu)
        assert padding_mask(real, 7, cpu) is first  # the forward's later layers
    bound.fill_(3)
    with context.forward_context(base, forward_batch=batch):
        second = padding_mask(real, 7, cpu)
    assert second is not first
    assert first.tolist() == [i >= 5 for i in range(7)]
    assert second.tolist() == [i >= 3 for i in range(7)]


# The modules whose objects the hooks patch, call or derive from. In 0.5.23 each imports
# sglang.srt.configs, whose nano_nemotron_vl imports torchvision, whose PyPI wheels are built
# against a CUDA torch: these checks then skip, naming the error.
NEED_TORCHVISION = {
    "sglang.srt.models.kimi_k3": ("KimiK3MoE", ss.KimiK3MoE),
    "sglang.srt.layers.quantization.mxfp4": ("Mxfp4MoEMethod", ss.Mxfp4MoEMethod),
    "sglang.srt.layers.moe.fused_moe_triton.layer": ("FusedMoE", ss.FusedMoE),
    "sglang.srt.layers.moe.token_dispatcher.base": ("BaseDispatcher", ss.BaseDispatcher),
    "sglang.srt.eplb.expert_distribution": (
        "ExpertDistributionRecorder",
        ss.ExpertDistributionRecorder,
    ),
    "sglang.srt.managers.scheduler": ("Scheduler", ss.Scheduler),
}


def _parameters(fn) -> str:
    """inspect's parameters of `fn`, without annotations (as the stand-ins' SIGNATUREs)."""
    signature = inspect.signature(fn)
    plain = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=plain, return_annotation=inspect.Signature.empty))


@pytest.mark.parametrize("module", sorted(NEED_TORCHVISION))
def test_imported_classes_match_the_standins(module):
    """Where the module imports: each stand-in method's SIGNATURE is the imported method's."""
    name, standin = NEED_TORCHVISION[module]
    cls = getattr(_import(module), name)
    for method, signature in standin.SIGNATURES.items():
        if method == "register":
            continue  # a classmethod: inspect drops cls
        want = signature.replace("HookType.AFTER", "<HookType.AFTER: 'after'>")
        assert _parameters(getattr(cls, method)) == want, method
