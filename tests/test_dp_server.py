"""examples/dp_server.py: its continuous batching in-process, and the whole loop under torchrun
on 2 and 4 CPU ranks (malformed requests refused, idle ranks, the reference checks, nothing
lost)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from helpers.launchers import ROOT, launcher

SERVER = os.path.join(ROOT, "examples", "dp_server.py")


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
    assert re.search(r"checks: \d+, worst relative L2 error .* ok$", proc.stdout, re.M), log
