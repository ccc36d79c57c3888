"""examples/dp_server.py: its continuous batching in-process; the bucket logic of its CUDA graphs
in-process (the emulated capture and replay, the padding rows given no expert); the whole loop
under torchrun on 2 and 4 CPU ranks (malformed requests refused, idle ranks, the reference
checks, nothing lost); and on 2 CPU ranks with the decode buckets emulated, the poll counted at
every step and the checks of replayed steps."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers.launchers import ROOT, launcher

SERVER = os.path.join(ROOT, "examples", "dp_server.py")
TESTS = os.path.join(ROOT, "tests")


def load_server():
    spec = importlib.util.spec_from_file_location("dp_server", SERVER)
    module = importlib.util.module_from_spec(spec)
    sys.modules["dp_server"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def settings(**overrides) -> argparse.Namespace:
    values = dict(
        requests=10,
        malformed=2,
        skew=0.5,
        rate=1e6,
        max_prompt=9,
        max_new=4,
        step_tokens=6,
        max_running=3,
        vocab=32,
        seed=int(torch.randint(0, 2**31, ())),
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def test_continuous_batching_serves_every_token_within_the_budget():
    server = load_server()
    args = settings()
    requests = server.workload(args, rank=1, world_size=3)
    assert len(requests) == server.well_formed_requests(args, 1, 3) + args.malformed == 10
    scheduler = server.Scheduler(requests, args, rank=1)
    scheduler.admit(now_s=float("inf"))  # everything has arrived
    assert len(scheduler.refused) == args.malformed
    assert {why.split(" ")[1] for _, why in scheduler.refused} == {"prompt"}
    steps, fed = 0, {r.rid: [] for r in requests}
    while scheduler.pending:
        batch = scheduler.plan()
        assert 0 < batch.tokens.numel() <= args.step_tokens
        assert len(scheduler.running) <= args.max_running
        assert len(batch.emits) == batch.tokens.numel()
        decodes = batch.tokens.numel() - batch.prefill_rows
        # decode rows come first: one per request past its prompt, each emitting a token
        assert all(r is not None for r in batch.emits[:decodes])
        for request, token in zip(batch.emits[:decodes], batch.tokens[:decodes].tolist()):
            assert token == request.generated[-1]
            fed[request.rid].append(token)
        scheduler.complete(batch, [steps] * batch.tokens.numel(), now_s=float(steps))
        steps += 1
        assert steps < 1000
    well_formed = [r for r in requests if 0 < r.prompt.numel() <= args.max_prompt]
    assert sorted(r.rid for r in scheduler.finished) == sorted(r.rid for r in well_formed)
    for request in scheduler.finished:
        assert len(request.generated) == request.max_new
        assert request.prefilled == request.prompt.numel()
        # every generated token but the last was fed back as the next decode row
        assert fed[request.rid] == request.generated[:-1]


def test_a_request_the_loop_cannot_serve_is_refused_not_served_or_left():
    """refusal() names what is wrong with a request taken from outside: negative or too large
    token ids (an embedding lookup wrapped -1 onto the last token and served it), float, bool
    and 2-D prompts (cast or flattened before), max_new 0 or -1 (never finished), a NaN, inf or
    missing arrival (a NaN blocked every request behind it in the queue, an inf kept the loop
    waiting), unsigned 16-64 bit and meta prompts (refusal() raised); well-formed ones pass
    (int32, int16 and uint8 ids, a NumPy max_new), and the scheduler takes the requests whose
    arrival is not a finite number out of the queue."""
    server = load_server()
    args = settings(vocab=32, max_prompt=9)
    ok = torch.tensor([1, 5, 31])
    cases = [
        (ok, 3, 0.0, None),
        (torch.tensor([5, -1]), 3, 0.0, "outside 0..31"),
        (torch.tensor([5, 32]), 3, 0.0, "outside 0..31"),
        (torch.tensor([4.9, 5.2]), 3, 0.0, "float32 values"),
        (torch.tensor([True, False]), 3, 0.0, "bool values"),
        (ok[None], 3, 0.0, "1-D tensor"),
        ([1, 2], 3, 0.0, "1-D tensor"),
        (ok, 0, 0.0, "max_new=0"),
        (ok, -1, 0.0, "max_new=-1"),
        (ok, 2.0, 0.0, "max_new=2.0"),
        (ok, 3, float("nan"), "is not finite"),
        (ok, 3, float("inf"), "is not finite"),
        (ok, 3, None, "not a real number"),
        # A 0-dim tensor is not an arrival time (before: "not a finite number" for 0.5).
        (ok, 3, torch.tensor(0.5), "not a real number"),
        # Integer dtypes without a min() on CPU, and a tensor without values (before: the
        # refusal raised, and the rank left the loop while its peers waited in their
        # collectives; found by a careless-user probe).
        (ok.to(torch.uint16), 3, 0.0, "uint16 values"),
        (ok.to(torch.uint32), 3, 0.0, "uint32 values"),
        (ok.to(torch.uint64), 3, 0.0, "uint64 values"),
        (ok.to("meta"), 3, 0.0, "cannot be read"),
        (ok.to(torch.uint8), 3, 0.0, None),
        (ok.to(torch.int16), 3, 0.0, None),
        (ok.int(), np.int64(3), 1, None),  # int32 ids, a NumPy max_new, an int arrival
        (torch.tensor([]), 3, 0.0, "empty"),
        (torch.tensor(5), 3, 0.0, "1-D tensor"),
    ]
    for rid, (prompt, max_new, arrival, why) in enumerate(cases):
        request = server.Request(rid, arrival, prompt, max_new)
        got = server.refusal(request, args.max_prompt, args.vocab)
        assert (got is None) if why is None else (got is not None and why in got), (rid, got)
    queue = [server.Request(0, float("nan"), ok, 3), server.Request(1, 5.0, ok, 3)]
    queue += [server.Request(2, float("inf"), ok, 3), server.Request(3, 7.0, ok, 3)]
    scheduler = server.Scheduler(queue, args, rank=0)
    with contextlib.redirect_stdout(io.StringIO()):
        scheduler.admit(now_s=6.0)
    assert [r.rid for r, _ in scheduler.refused] == [0, 2]
    assert [r.rid for r in scheduler.admitted] == [1]
    assert [r.rid for r in scheduler.future] == [3]  # arrives later


@pytest.mark.parametrize("ranks", [2, 4])
def test_serving_loop_on_cpu_ranks(ranks, tmp_path):
    server = load_server()
    metrics, png = tmp_path / "metrics.json", tmp_path / "dp_server.png"
    seed = int(torch.randint(0, 2**31, ()))
    cmd = [
        launcher("torchrun"),
        "--nproc-per-node",
        str(ranks),
        SERVER,
        "--requests",
        "8",
        "--malformed",
        "2",
        "--seed",
        str(seed),
        "--check-every",
        "6",
        "--metrics",
        str(metrics),
        "--plot",
        str(png),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    results = json.loads(metrics.read_text())
    assert results["world_size"] == ranks
    assert results["lost"] == 0 and results["wrong_length"] == 0, results
    assert results["refused"] == 2 * ranks
    assert results["finished"] + results["refused"] == results["requests"]
    assert results["finished"] == sum(round(8 * (1 - 0.5 * r / (ranks - 1))) for r in range(ranks))
    refusals = results["refusals"]
    assert sorted(rank for rank, _, _ in refusals) == sorted(list(range(ranks)) * 2)
    for rank, rid, why in refusals:  # each printed as one line
        assert server.refusal_line(rank, rid, why) + "\n" in proc.stdout, log
    # the checks ran and compared real numbers; the ranks were unequal, some idle
    assert results["checks"] >= 1 and 0 < results["worst_error"] <= results["tolerance"]
    # no graphs on the CPU unless emulated: every check is of an eager step
    assert results["graphs"] == "none" and results["graph_replays"] == 0, results
    assert results["checks_eager"] == results["checks"] and results["checks_replayed"] == 0
    assert results["idle_rank_steps"] > 0
    history = results["tokens_per_step"]
    assert len(history) == results["steps"] and all(len(row) == ranks for row in history)
    assert (
        sum(map(sum, history))
        == results["prompt_tokens"] + results["generated_tokens"] - (results["finished"])
    )  # every prompt token once, every generated token but each request's last fed back
    assert results["generated_tokens_per_s"] > 0 and results["ttft"]["p50_ms"] is not None
    assert "dp_server [" in proc.stderr  # the progress bar
    assert png.stat().st_size > 10_000  # the plot (matplotlib is in the test extra)
    checks = r"checks: \d+ \(0 of replayed steps, \d+ of eager steps\), worst relative L2 error"
    assert re.search(checks + " .* ok$", proc.stdout, re.M), log


class FakeLayer:
    """What padded_moe calls of an EpMoeLayer: its call, recording the keywords."""

    layer_index = 7

    def __init__(self):
        self.call = None

    def __call__(self, x, **kw):
        self.call = kw
        return x + 1


def test_padding_rows_go_to_no_expert_through_the_layers_padding_mask():
    """padded_moe passes the step's is_padding to the layer as `padding=` (the mask the engine
    integrations pass to the routed call) with T and the layer index as the tag."""
    server = load_server()
    layer, x = FakeLayer(), torch.ones(4, 2)
    is_padding = torch.tensor([False, False, True, True])
    y = server.padded_moe(layer, x, 4, is_padding)
    assert layer.call == {"tokens": 4, "tag": 7, "padding": is_padding}
    assert torch.equal(y, x + 1)


def test_emulated_capture_replays_into_the_same_outputs():
    """The CPU stand-in of a CUDA graph: the captured outputs are the tensors every replay
    writes (the step run again on the static inputs), nested records included."""
    server = load_server()
    static = torch.tensor([1.0, 2.0])

    def step():
        doubled = static * 2
        return doubled, [(static + 0, doubled + 1)]

    (out, record), replay = server.capture_step(step, emulated=True)
    first = out
    static.copy_(torch.tensor([5.0, 7.0]))
    replay()
    assert out is first and out.tolist() == [10.0, 14.0]
    assert record[0][0].tolist() == [5.0, 7.0] and record[0][1].tolist() == [11.0, 15.0]


def seed_with_a_decode_only_step(server, ranks: int) -> int:
    """A fresh seed whose workload (the test's below, every request arrived at once) has a step
    with no prefill row on any rank, which replays a bucket: about 1 seed in 1000 has none (every
    request's last token comes out with the last prefill chunk)."""
    while True:
        seed = int(torch.randint(0, 2**31, ()))
        args = settings(requests=6, max_prompt=24, max_new=8, step_tokens=16, max_running=6)
        args.vocab, args.seed = 256, seed
        schedulers = [
            server.Scheduler(server.workload(args, r, ranks), args, r) for r in range(ranks)
        ]
        with contextlib.redirect_stdout(io.StringIO()):  # the refusals' lines
            for scheduler in schedulers:
                scheduler.admit(now_s=float("inf"))
        while any(scheduler.pending for scheduler in schedulers):
            batches = [scheduler.plan() for scheduler in schedulers]
            if sum(b.prefill_rows for b in batches) == 0 and any(b.emits for b in batches):
                return seed
            for scheduler, batch in zip(schedulers, batches):
                scheduler.complete(batch, [0] * len(batch.emits), now_s=0.0)


def test_emulated_buckets_replay_check_and_poll_every_step(tmp_path):
    """2 CPU ranks, the decode buckets emulated (--emulate-graphs), a check every step: replayed
    steps are checked against the reference as the graph recorded them (padding rows sent to no
    expert), eager ones too, and poll_all runs once per step on every rank."""
    metrics = tmp_path / "metrics.json"
    seed = seed_with_a_decode_only_step(load_server(), ranks=2)
    arguments = ["--requests", "6", "--rate", "1e6", "--check-every", "1", "--seed", str(seed)]
    arguments += ["--emulate-graphs", "--metrics", str(metrics)]
    cmd = [launcher("torchrun"), "--nproc-per-node", "2", "-m", "helpers.dp_server_polls"]
    proc = subprocess.run(
        cmd + [str(tmp_path), *arguments], cwd=TESTS, capture_output=True, text=True, timeout=300
    )
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    results = json.loads(metrics.read_text())
    assert results["lost"] == 0 and results["wrong_length"] == 0, results
    assert results["graphs"] == "emulated" and results["graph_replays"] >= 1, results
    assert results["checks"] == results["steps"], results  # --check-every 1
    assert results["checks_replayed"] >= 1 and results["checks_eager"] >= 1, results
    assert results["checks_replayed"] + results["checks_eager"] == results["checks"]
    assert 0 < results["worst_error"] <= results["tolerance"], results
    for rank in range(2):
        polls = json.loads((tmp_path / f"polls{rank}.json").read_text())
        assert polls["polls"] == results["steps"] > 0, (rank, polls, results["steps"])
    assert "graph replays, emulated on the CPU)" in proc.stdout, log


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "1e9"])
def test_a_timeout_that_is_no_number_of_seconds_is_refused(timeout, monkeypatch, capsys):
    """--timeout 0, -1, nan, inf: before, accepted, and every rank ended in a raw traceback from
    the store's timedelta a few seconds later."""
    monkeypatch.setattr(sys, "argv", ["dp_server.py", "--timeout", timeout])
    with pytest.raises(SystemExit) as exit_info:
        load_server().parse_args()
    assert exit_info.value.code == 2
    assert "--timeout must be a number of seconds above 0 and below 1e9" in capsys.readouterr().err
