"""dep_ep.integrations.sglang in one process, against the SGLang 0.5.23 stand-ins
(standins/sglang_standin.py): register() is a no-op without DEP_EP_SGLANG=1, refuses another
SGLang version naming the one it was written against, and registers its hooks with the
registry's hook types; importing the integration imports no SGLang; the per-step poll; the
step's T and padding rules; and the stand-ins themselves read as the SIGNATUREs they carry
(which test_sglang_real.py compares with the installed SGLang's source)."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from standins import sglang_standin as ss

from dep_ep.integrations import common
from dep_ep.integrations.sglang import engine as sglang_engine
from dep_ep.integrations.sglang import plugin, steps
from dep_ep.integrations.sglang.steps import forward_step, padding_mask, routing, step_tokens

from helpers.source_signatures import signature_of

EXPECTED_HOOKS = {
    "sglang.srt.models.kimi_k3.KimiK3MoE.__init__": ss.HookType.AFTER,
    "sglang.srt.layers.quantization.mxfp4.Mxfp4MoEMethod.process_weights_after_loading": (
        ss.HookType.AROUND
    ),
    "sglang.srt.models.kimi_k3.KimiK3MoE._forward_mega_experts": ss.HookType.REPLACE,
    "sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher": ss.HookType.AROUND,
    "sglang.srt.managers.scheduler.Scheduler.process_batch_result": ss.HookType.AFTER,
}


@pytest.fixture
def standin():
    """A one-rank SGLang stand-in behind the integration's seam (restored afterwards)."""
    sglang = ss.SglangStandin(None)
    previous = sglang_engine.use_engine(ss.StandinEngine(sglang))
    yield sglang
    sglang_engine.use_engine(previous)


def registered(sglang) -> dict:
    return {target: [kind for kind, _ in hooks] for target, hooks in sglang.registry._hooks.items()}


def test_register_is_a_no_op_without_the_flag(standin, monkeypatch):
    monkeypatch.delenv("DEP_EP_SGLANG", raising=False)
    plugin.register()
    monkeypatch.setenv("DEP_EP_SGLANG", "0")
    plugin.register()
    assert registered(standin) == {}


def test_register_refuses_another_version(standin, monkeypatch):
    monkeypatch.setenv("DEP_EP_SGLANG", "1")
    standin.version = "0.5.24"
    with pytest.raises(
        ImportError, match=r"sglang 0\.5\.24 is installed.*written against sglang 0\.5\.23"
    ):
        plugin.register()
    assert registered(standin) == {}


def test_register_registers_every_hook(standin, monkeypatch):
    monkeypatch.setenv("DEP_EP_SGLANG", "1")
    plugin.register()
    want = {target: [kind] for target, kind in EXPECTED_HOOKS.items()}
    assert registered(standin) == want


def test_importing_the_integration_imports_no_sglang():
    """Run in a fresh interpreter: importing every module of the integration (the plugin the
    entry point names, the hooks, the dispatcher, the seam, the step rules) imports no module
    named sglang*, so installing dep_ep beside SGLang costs SGLang's processes nothing until
    DEP_EP_SGLANG=1."""
    modules = ("plugin", "kimi_k3", "dispatcher", "engine", "steps")
    probe = (
        "import sys; "
        + "; ".join(f"import dep_ep.integrations.sglang.{name}" for name in modules)
        + "; print(sorted(m for m in sys.modules if m.split('.')[0] == 'sglang'))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_poll_after_each_step(standin, monkeypatch):
    """The AFTER hook on Scheduler.process_batch_result polls every shared EpRouted once per
    call and leaves the result alone."""
    calls = []
    monkeypatch.setattr(common, "poll_all", lambda: calls.append(1))
    monkeypatch.setenv("DEP_EP_SGLANG", "1")
    plugin.register()
    standin.registry.apply_hooks()
    scheduler = standin.Scheduler()
    assert scheduler.process_batch_result("batch", "result") is None
    scheduler.process_batch_result("batch", "result")
    assert len(calls) == 2
    assert ss.Scheduler().process_batch_result("batch", "result") is None  # base untouched
    assert len(calls) == 2


@pytest.mark.parametrize(
    "counts, attn_tp, rows, want",
    [
        ([7, 3, 0, 5], 1, 3, 7),  # DP: the largest count
        ([7, 3], 2, 2, 4),  # DP x attention TP: ceil(7 / 2)
        ([0, 0], 1, 0, 1),  # every rank idle: one step of padding
        ([9], 4, 3, 3),  # one DP entry (SP attention): the rank's rows
        (None, 1, 5, 5),  # no DP list
        (None, 1, 0, 1),
    ],
)
def test_step_tokens(counts, attn_tp, rows, want):
    assert step_tokens(counts, attn_tp, rows) == want


def test_routing_takes_integer_ids_and_floating_weights_only():
    """Integer ids of any width and floating weights of any width are converted (int32 and
    int64 ids and fp32 weights kept as they are); float or bool ids (before: cast, 3.7 to
    expert 3, silently) and integer weights raise TypeError, which the hook turns into a
    rejected step."""
    weights = torch.rand(2, 4)
    for dtype in (torch.int32, torch.int64):
        ids = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 6]], dtype=dtype)
        got_ids, got_weights = routing(
            SimpleNamespace(topk_ids=ids, topk_weights=weights), 2, 4, "cpu"
        )
        assert got_ids is ids and got_weights is weights
    small = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 6]], dtype=torch.int16)
    half = weights.to(torch.bfloat16)
    got_ids, got_weights = routing(SimpleNamespace(topk_ids=small, topk_weights=half), 2, 4, "cpu")
    assert got_ids.dtype == torch.int32 and got_ids.tolist() == small.tolist()
    assert got_weights.dtype == torch.float32 and torch.equal(got_weights, half.float())
    for ids, w, match in (
        (small.float() + 0.7, weights, "topk_ids dtype torch.float32"),
        (small >= 0, weights, "topk_ids dtype torch.bool"),
        (small, torch.ones(2, 4, dtype=torch.int32), "topk_weights dtype torch.int32"),
    ):
        with pytest.raises(TypeError, match=match):
            routing(SimpleNamespace(topk_ids=ids, topk_weights=w), 2, 4, "cpu")


def test_step_tokens_refuses_a_negative_count():
    with pytest.raises(ValueError, match="negative"):
        step_tokens([3, -1], 1, 3)


def test_padding_rows_from_the_bound(standin):
    """The rows at or past the forward's real-row bound are padding (every row count, with the
    row indices kept and grown); no bound or no rows: no mask."""
    engine = sglang_engine.engine()
    cpu = torch.device("cpu")
    assert padding_mask(engine, 4, cpu) is None
    for rows, bound in ((4, 2), (1, 0), (300, 299), (1000, 7)):
        with standin.step([rows], torch.tensor([bound], dtype=torch.int32)):
            mask = padding_mask(engine, rows, cpu)
            assert padding_mask(engine, 0, cpu) is None
        assert mask.dtype == torch.bool and mask.tolist() == [i >= bound for i in range(rows)]


def test_one_padding_mask_a_forward(standin):
    """The layers of one forward share its mask; a new forward (a new ForwardContext, as SGLang
    makes one for each) gets a new mask even when its bound is the same tensor holding another
    count (a graph runner's static buffer), and so do another row count and a bound written in
    place within one forward context."""
    engine = sglang_engine.engine()
    cpu = torch.device("cpu")
    bound = torch.tensor([3], dtype=torch.int32)
    with standin.step([6], bound):
        first = padding_mask(engine, 6, cpu)
        assert padding_mask(engine, 6, cpu) is first  # a later layer of the forward
        other_rows = padding_mask(engine, 5, cpu)
        assert other_rows is not first and other_rows.tolist() == [i >= 3 for i in range(5)]
    assert first.tolist() == [i >= 3 for i in range(6)]
    bound.fill_(5)  # the next forward writes its count into the same buffer
    with standin.step([6], bound):
        second = padding_mask(engine, 6, cpu)
        assert second is not first and second.tolist() == [i >= 5 for i in range(6)]
    assert first.tolist() == [i >= 3 for i in range(6)]  # the earlier mask is not rewritten
    with standin.step([6], torch.tensor([1], dtype=torch.int32)):  # another bound tensor
        assert padding_mask(engine, 6, cpu).tolist() == [i >= 1 for i in range(6)]
    # The bound written in place inside one forward context (between two layers, or an engine
    # that keeps one context over two forwards): the next layer gets a mask of the new count
    # (before: the first layer's, its padding rows sent to experts or real rows dropped,
    # silently). Under inference mode the bound keeps no version counter: shared as before.
    bound = torch.tensor([5], dtype=torch.int32)
    with standin.step([6], bound):
        assert padding_mask(engine, 6, cpu).tolist() == [i >= 5 for i in range(6)]
        bound.fill_(2)
        assert padding_mask(engine, 6, cpu).tolist() == [i >= 2 for i in range(6)]
        bound.copy_(torch.tensor([4]))
        again = padding_mask(engine, 6, cpu)
        assert again.tolist() == [i >= 4 for i in range(6)]
        assert padding_mask(engine, 6, cpu) is again
    with torch.inference_mode():
        frozen = torch.tensor([3], dtype=torch.int32)
    with standin.step([6], frozen):
        shared = padding_mask(engine, 6, cpu)
        assert shared.tolist() == [i >= 3 for i in range(6)]
        assert padding_mask(engine, 6, cpu) is shared


def test_forward_step_keeps_mask_and_tokens_for_the_forward_only(standin):
    """forward_step: the layers of one forward share its mask and T; a new counts list (SGLang
    assigns one per forward), a new forward, another row count or a bound written in place
    give T and the mask again, each from what the engine publishes then; without a bound or
    rows, T alone (no mask) from the counts of that call."""
    engine = sglang_engine.engine()
    cpu = torch.device("cpu")
    bound = torch.tensor([4], dtype=torch.int32)
    with standin.step([6, 9], bound):
        mask, tokens = forward_step(engine, 6, cpu)
        assert tokens == 9 and mask.tolist() == [i >= 4 for i in range(6)]
        again, tokens_again = forward_step(engine, 6, cpu)
        assert again is mask and tokens_again == 9  # a later layer of the forward
        standin.dp_global_num_tokens = [6, 12]  # a new list: T again, the same mask
        later, tokens = forward_step(engine, 6, cpu)
        assert later is mask and tokens == 12
        assert forward_step(engine, 5, cpu)[1] == 12  # another row count
        bound.fill_(2)  # written in place: a new mask, T again
        written, tokens = forward_step(engine, 6, cpu)
        assert written.tolist() == [i >= 2 for i in range(6)] and tokens == 12
    with standin.step([3, 2], bound):  # the next forward, the same bound buffer
        mask, tokens = forward_step(engine, 3, cpu)
        assert tokens == 3 and mask.tolist() == [i >= 2 for i in range(3)]
    with standin.step([3, 7], None):  # no bound: no mask, T from this call's counts
        assert forward_step(engine, 3, cpu) == (None, 7)
        standin.dp_global_num_tokens = [3, 8]
        assert forward_step(engine, 3, cpu) == (None, 8)
    with standin.step([0, 5], torch.tensor([0], dtype=torch.int32)):  # an idle rank
        assert forward_step(engine, 0, cpu) == (None, 5)
        # Counts written in place mid-forward (SGLang never does): the idle rank keeps the
        # forward's T as the ranks with rows do (before, it alone read them again, and the
        # ranks' T differed: EpTokenCountError on every rank at every step).
        standin.dp_global_num_tokens[1] = 9
        assert forward_step(engine, 0, cpu) == (None, 5)
    with standin.step([4, 2], bound):  # padding_mask's mask, then T for it
        first = padding_mask(engine, 4, cpu)
        mask, tokens = forward_step(engine, 4, cpu)
        assert mask is first and tokens == 4


def test_row_indices_a_mask_was_made_of_outlive_later_growth():
    """A CUDA graph captured with a padding mask reads the row indices' memory at every replay:
    when the indices grow (a longer prefill) and the views of them are dropped (more than
    _MAX_ROW_VIEWS row counts), the indices the mask was made of stay alive (before: freed, so
    a replay could compare reused memory with the bound and drop real rows silently). The
    growth at least doubles, so the kept ones hold less than the current."""
    cpu = torch.device("cpu")
    key = (cpu, torch.int64)
    saved = steps._ROW_INDEX.pop(key, None)
    if saved is not None:  # retired as the module would retire it
        steps._RETIRED_ROW_INDEX.append(saved)
    steps._ROW_VIEWS.clear()
    first = steps.row_index(8, torch.int64, cpu, False)
    kept = weakref.ref(steps._ROW_INDEX[key])
    for rows in (300, *range(1, steps._MAX_ROW_VIEWS + 80)):
        steps.row_index(rows, torch.int64, cpu, False)
    del first
    gc.collect()
    assert kept() is not None and kept() is not steps._ROW_INDEX[key]
    assert steps._ROW_INDEX[key].shape[0] >= 2 * kept().shape[0]
    assert steps.row_index(5, torch.int64, cpu, False).tolist() == list(range(5))


@pytest.mark.parametrize(
    "dtype, rows, bound",
    [
        (torch.int8, 200, 100),
        (torch.uint8, 300, 250),
        (torch.int16, 40000, 30000),
        (torch.bfloat16, 300, 260),
        (torch.float16, 3000, 2052),
        (torch.float32, 10, 3.5),
    ],
)
def test_padding_mask_with_a_narrow_bound(standin, dtype, rows, bound):
    """A bound of a dtype narrower than int32, or a half float (bounds it holds exactly), still
    bounds every row: the row indices are not made in a dtype that cannot hold them (int8
    wrapped rows 128+ to negative indices, sending padding rows to the experts with no error)."""
    engine = sglang_engine.engine()
    cpu = torch.device("cpu")
    with standin.step([rows], torch.tensor([bound], dtype=dtype)):
        mask = padding_mask(engine, rows, cpu)
    wrong = [i for i, padded in enumerate(mask.tolist()) if padded != (i >= bound)]
    assert not wrong, f"{dtype} bound {bound}: {len(wrong)} rows masked wrongly, first {wrong[:3]}"


def standin_signatures():
    """(qualname, SIGNATURE) of every stand-in that carries one."""
    for name in dir(ss):
        obj = getattr(ss, name)
        if callable(obj) and isinstance(getattr(obj, "SIGNATURE", None), str):
            yield name, obj.SIGNATURE
        for method, signature in getattr(obj, "__dict__", {}).get("SIGNATURES", {}).items():
            yield f"{name}.{method}", signature


def test_standins_read_as_their_signatures():
    """Each stand-in's own definition has the parameters of the real one it mirrors, so the
    drift test's comparison of SIGNATURE with SGLang's source covers the stand-in too."""
    path = Path(ss.__file__)
    found = dict(standin_signatures())
    assert len(found) >= 15, sorted(found)
    wrong = {
        name: (signature, signature_of(path, name))
        for name, signature in found.items()
        if signature_of(path, name) != signature
    }
    assert not wrong, wrong
