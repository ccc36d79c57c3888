"""A data-parallel serving loop with dep_ep inside: each rank serves its own requests (data-parallel
attention), and the MoE layers of every rank form one expert-parallel group.

    torchrun --nproc-per-node 4 examples/dp_server.py                     # CPU, tiny preset
    torchrun --nproc-per-node 2 examples/dp_server.py --requests 40 --plot dp_server.png
    mpiexec -n 3 python examples/dp_server.py --metrics metrics.json

Requests: each rank owns a queue of requests arriving at random times (exponential gaps, --rate
per second per rank) with a random prompt (1..--max-prompt tokens) and a random number of tokens to
generate (1..--max-new). Rank 0 gets --requests of them and the others fewer, down to (1 - --skew)
of that on the last rank, so the ranks' loads differ the way a DP server's do. --malformed adds
that many malformed requests to every rank's queue (an empty prompt, a prompt over --max-prompt):
each is refused with a message naming the rank and the request, and the loop goes on.

Continuous batching: every step a rank takes one decode token of each running request, then fills
the step up to --step-tokens with prefill chunks of the prompts it has admitted (at most
--max-running requests at once), so the ranks' counts differ and a rank with nothing to do runs the
step with no tokens (the dummy batch of a DP server). The ranks agree on the step's common count T
with one all-reduce of every rank's counts (`integrations.common.common_tokens`) and skip a step
that no rank has tokens for.

The model: a token embedding, --layers pre-norm residual blocks whose MoE is an EpMoeLayer (the
layers share one EpRouted through `integrations.common.shared_routed`, as the engine integrations
share it), and greedy sampling from the tied embedding. It has no attention: in DEP attention is
each rank's own, takes no part in the exchange, and is left out, so a token's successor depends on
that token alone.

On CUDA every decode-only step of T <= max(--buckets) replays the CUDA graph of its bucket (the
smallest bucket >= T). Before serving starts, as a server starts, the experts are warmed for every
T up to --step-tokens (`warm_buckets`) and every bucket is captured after one eager step of it;
all ranks decide from the same all-reduced counts, so they replay the same graphs in the same
order. A bucket's rows past the step's tokens are padding, as an engine's are: the graph reads a
persistent is_padding mask at every replay and sends those rows to no expert (EpMoeLayer's
`padding=`, the mask the engine integrations pass to the routed call). After every step
`poll_all()` raises what a failed replayed step would otherwise only show as NaN rows.
--emulate-graphs runs the same bucket logic on the CPU, where a "graph" is its step run again on
the same static buffers (CI checks the logic; only CUDA captures).

Checks: every --check-every steps each MoE layer's output is compared with the float64 reference
of that layer on the same input (dep_ep.testing.layer_reference, collective over the DEP group):
a step that falls in a captured bucket replays its graph, which records every layer's input and
output in static buffers, and the real rows of those are compared; any other step runs eagerly
(EpMoeLayer's call) and is compared the same way. The largest relative L2 error over ranks and
layers must be within the experts backend's tolerance; the metrics count the checks of replayed
and of eager steps apart. The loop's clock (arrivals, latencies, tokens/s) stops while the
references run: they are not part of serving. At the end every admitted request must have
received exactly its tokens, and every request must be finished or refused; --max-seconds bounds
the loop (the ranks stop at the same step, and what is unfinished counts as lost).

Rank 0 draws a progress bar on stderr and prints the results: requests, tokens, tokens/s, time to
first token (TTFT) and the time between a request's tokens (inter-token latency), p50/p90/p99,
the steps, idle rank-steps and graph replays, and the checks (of replayed and of eager steps).
--metrics writes them as JSON, --plot as a PNG (when matplotlib is importable). Exit status 1
when a check fails or a request is lost.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dep_ep.config import PRESETS, EpConfig
from dep_ep.cuda_graphs import capture_graph
from dep_ep.ep import EpMoeLayer
from dep_ep.experts import default_experts
from dep_ep.integrations.common import (
    close_shared,
    common_tokens,
    poll_all,
    shared_routed,
    warm_buckets,
)
from dep_ep.launch import init_rank_context, new_dep_group, teardown
from dep_ep.testing import SyntheticLayer, rel_l2
from dep_ep.testing.layer_reference import layer_reference, synthetic_dense
from dep_ep.testing.tolerance import LAYER_REL_L2_BY_ACTIVATION

# The residual stream's RMSNorm eps (the model's own norms; the MoE's latent norm is EpMoeLayer's).
RESIDUAL_NORM_EPS = 1e-6
# Columns of the per-step count row every rank writes into the all-reduced [world, 5] tensor.
COUNT_TOKENS, COUNT_PENDING, COUNT_PREFILL, COUNT_FINISHED, COUNT_OVERTIME = range(5)
COUNT_COLUMNS = 5
# A step no rank has tokens for is skipped; the ranks then wait this long for arrivals.
IDLE_WAIT_S = 0.002
PROGRESS_WIDTH = 30


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--preset",
        choices=["auto", *PRESETS],
        default="auto",
        help="MoE geometry (auto: k3 on CUDA, tiny on CPU)",
    )
    p.add_argument("--layers", type=int, default=2, help="decoder blocks, one MoE layer each")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    p.add_argument("--requests", type=int, default=12, help="well-formed requests per rank")
    p.add_argument(
        "--skew", type=float, default=0.5, help="the last rank's share of requests is 1 - skew"
    )
    p.add_argument("--malformed", type=int, default=2, help="malformed requests per rank")
    p.add_argument("--rate", type=float, default=40.0, help="arrivals per second per rank")
    p.add_argument("--max-prompt", type=int, default=24, help="longest prompt accepted (tokens)")
    p.add_argument("--max-new", type=int, default=8, help="most tokens a request generates")
    p.add_argument("--step-tokens", type=int, default=16, help="most tokens a rank runs per step")
    p.add_argument("--max-running", type=int, default=6, help="requests a rank serves at once")
    p.add_argument(
        "--buckets",
        default="1,2,4,8,16",
        help="CUDA-graph decode buckets (T values), comma separated",
    )
    p.add_argument("--check-every", type=int, default=8, help="steps between reference checks")
    p.add_argument(
        "--emulate-graphs",
        action="store_true",
        help="CPU: run the decode buckets as on CUDA, a replay re-running the captured step on"
        " its static buffers (the bucket logic without CUDA)",
    )
    p.add_argument(
        "--dep-size",
        type=int,
        default=None,
        help="ranks per DEP group (default: all; must divide the world size)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any wait may take")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=600.0,
        help="stop serving after this long (unfinished requests count as lost)",
    )
    p.add_argument("--metrics", default=None, help="write the results as JSON to this path")
    p.add_argument("--plot", default=None, help="draw the results into this PNG")
    args = p.parse_args()
    positive = ("layers", "vocab", "max_prompt", "max_new", "step_tokens", "max_running")
    for name in positive + ("check_every",):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.requests < 0 or args.malformed < 0:
        p.error("--requests and --malformed must be >= 0")
    if not 0 <= args.skew <= 1:
        p.error("--skew must lie in 0..1")
    if not args.max_seconds > 0:
        p.error("--max-seconds must be > 0")
    if not (args.rate > 0 and math.isfinite(args.rate)):
        p.error("--rate must be a finite number > 0")
    if not 0 < args.timeout < 1e9:
        p.error("--timeout must be a number of seconds above 0 and below 1e9")
    try:
        args.buckets = sorted({int(b) for b in args.buckets.split(",")})
    except ValueError:
        p.error(f"--buckets {args.buckets!r}: expected integers separated by commas")
    if args.buckets[0] < 1 or args.buckets[-1] > args.step_tokens:
        p.error(f"--buckets {args.buckets} must lie in 1..--step-tokens ({args.step_tokens})")
    return args


# --------------------------------------------------------------------------- requests and batches
@dataclass
class Request:
    """One request of one rank. prompt: int64 [p] token ids; max_new: the tokens it generates;
    prefilled: prompt tokens run so far; generated: its tokens so far; times in seconds since the
    loop's start (arrival_s, token_s: when each generated token came out)."""

    rid: int
    arrival_s: float
    prompt: torch.Tensor
    max_new: int
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    token_s: list[float] = field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.prefilled == self.prompt.numel()

    @property
    def done(self) -> bool:
        return len(self.generated) == self.max_new


def well_formed_requests(args, rank: int, world_size: int) -> int:
    """Rank `rank`'s well-formed requests: --requests on rank 0, linearly fewer to
    (1 - --skew) * --requests on the last rank."""
    share = 1.0 - args.skew * rank / max(world_size - 1, 1)
    return round(args.requests * share)


def workload(args, rank: int, world_size: int) -> list[Request]:
    """This rank's requests by arrival: its well-formed ones and --malformed malformed ones
    (alternately an empty prompt and one of --max-prompt + 1 tokens), from a seeded generator."""
    gen = torch.Generator().manual_seed(args.seed * 7919 + rank)
    total = well_formed_requests(args, rank, world_size) + args.malformed
    gaps = torch.empty(total, dtype=torch.float64).exponential_(args.rate, generator=gen)
    arrivals = torch.cumsum(gaps, 0).tolist()
    lengths = torch.randint(1, args.max_prompt + 1, (total,), generator=gen).tolist()
    for i, at in enumerate(torch.randperm(total, generator=gen)[: args.malformed].tolist()):
        lengths[at] = 0 if i % 2 == 0 else args.max_prompt + 1
    news = torch.randint(1, args.max_new + 1, (total,), generator=gen).tolist()
    return [
        Request(rid, arrival, torch.randint(0, args.vocab, (length,), generator=gen), new)
        for rid, (arrival, length, new) in enumerate(zip(arrivals, lengths, news))
    ]


# The token-id dtypes a prompt may hold (the embedding's lookup takes them; torch has no min()
# of the unsigned 16-64 bit ones on CPU).
PROMPT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
PROMPT_KINDS = "uint8, int8, int16, int32 or int64"


def refusal(request: Request, max_prompt: int, vocab: int) -> str | None:
    """Why `request` cannot be served, or None: a prompt that is not a 1-D tensor of integer
    token ids (PROMPT_DTYPES) in 0..vocab-1 (an embedding lookup would wrap a negative id onto
    another token, and a float or bool prompt would be cast), empty, over `max_prompt` tokens,
    or whose values cannot be read (a meta tensor); a max_new that is not an int >= 1 (such a
    request would never finish); an arrival time that is not a finite int or float."""
    prompt = request.prompt
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1:
        return "its prompt is not a 1-D tensor of token ids"
    length = prompt.numel()
    if length == 0:
        return "its prompt is empty"
    if prompt.dtype not in PROMPT_DTYPES:
        return f"its prompt holds {prompt.dtype} values, not integer token ids ({PROMPT_KINDS})"
    if length > max_prompt:
        return f"its prompt of {length} tokens is over the limit of {max_prompt}"
    try:
        low, high = int(prompt.min()), int(prompt.max())
    except (RuntimeError, NotImplementedError) as err:  # a meta or sparse tensor, say
        return f"its prompt's token ids cannot be read ({type(err).__name__}: {err})"
    if low < 0 or high >= vocab:
        return f"its prompt holds token ids {low}..{high}, outside 0..{vocab - 1}"
    new = request.max_new
    if not isinstance(new, numbers.Integral) or isinstance(new, bool) or new < 1:
        return f"max_new={new!r}; expected an int >= 1"
    arrival = request.arrival_s
    if not isinstance(arrival, numbers.Real) or isinstance(arrival, bool):
        return f"its arrival time {arrival!r} is not a real number (an int or a float)"
    if not math.isfinite(arrival):
        return f"its arrival time {arrival!r} is not finite"
    return None


def finite_time(value: object) -> bool:
    """True for a real number (not a bool) that is finite."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return real and math.isfinite(value)


def refusal_line(rank: int, rid: int, why: str) -> str:
    """The message a refused request prints."""
    return f"dp_server: rank {rank} refused request {rid}: {why}"


@dataclass
class Batch:
    """One step of one rank: tokens int64 [n] and, per row, the request whose token it emits
    (None for a prefill row that is not its prompt's last)."""

    tokens: torch.Tensor
    emits: list[Request | None]
    prefill_rows: int


class Scheduler:
    """One rank's continuous batching: requests arrive (`admit`), each step takes a decode token of
    every running request and prefill chunks up to the step's budget (`plan`), and the step's next
    tokens go back to their requests (`complete`)."""

    def __init__(self, requests: list[Request], args, rank: int) -> None:
        self.total = len(requests)  # the workload's size, for the count of lost requests
        self.future = deque(requests)
        self.admitted: deque[Request] = deque()  # arrived, not yet running
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.refused: list[tuple[Request, str]] = []
        self.args, self.rank = args, rank

    @property
    def pending(self) -> int:
        """Requests neither finished nor refused (arrived or not)."""
        return len(self.future) + len(self.admitted) + len(self.running)

    def admit(self, now_s: float) -> None:
        # A request whose arrival time is not a finite number (NaN, inf, None) is taken (and
        # refused), not left to block the queue behind it or to keep the loop waiting.
        while self.future and not (
            finite_time(self.future[0].arrival_s) and self.future[0].arrival_s > now_s
        ):
            request = self.future.popleft()
            why = refusal(request, self.args.max_prompt, self.args.vocab)
            if why is None:
                self.admitted.append(request)
                continue
            self.refused.append((request, why))
            # One write of the whole line: the ranks share stdout, and a print's text and its
            # newline may reach it apart, between another rank's.
            sys.stdout.write(f"{refusal_line(self.rank, request.rid, why)}\n")
            sys.stdout.flush()

    def plan(self) -> Batch:
        budget = self.args.step_tokens
        rows: list[torch.Tensor] = []
        emits: list[Request | None] = []
        for request in self.running:  # one decode token each, before any prefill
            if request.decoding and budget:
                rows.append(torch.tensor(request.generated[-1:]))
                emits.append(request)
                budget -= 1
        while self.admitted and len(self.running) < self.args.max_running:
            self.running.append(self.admitted.popleft())
        prefill_rows = 0
        for request in self.running:
            if request.decoding or not budget:
                continue
            start = request.prefilled
            chunk = min(request.prompt.numel() - start, budget)
            rows.append(request.prompt[start : start + chunk])
            request.prefilled += chunk
            emits += [None] * (chunk - 1) + [request if request.decoding else None]
            budget -= chunk
            prefill_rows += chunk
        tokens = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)
        return Batch(tokens.long(), emits, prefill_rows)

    def complete(self, batch: Batch, next_tokens: list[int], now_s: float) -> None:
        for request, token in zip(batch.emits, next_tokens):
            if request is not None:
                request.generated.append(token)
                request.token_s.append(now_s)
        self.finished += [r for r in self.running if r.done]
        self.running = [r for r in self.running if not r.done]


# ------------------------------------------------------------------------------------ the model
def rms_norm(h: torch.Tensor) -> torch.Tensor:
    """bf16 [n, H] -> bf16 [n, H]: RMSNorm without weight, in fp32."""
    return torch.nn.functional.rms_norm(h.float(), (h.shape[-1],), eps=RESIDUAL_NORM_EPS).bfloat16()


class Decoder:
    """Token embedding bf16 [V, H], `layers` blocks h += moe(rms_norm(h)), greedy sampling from
    rms_norm(h) @ embedding^T. Every rank of a DEP group holds the same weights."""

    def __init__(self, args, ctx, dep, geometry) -> None:
        device = ctx.device
        gen = torch.Generator(device=device).manual_seed(args.seed)
        self.embedding = torch.randn(args.vocab, geometry.hidden, generator=gen, device=device)
        self.embedding = self.embedding.bfloat16()
        self.routed = shared_routed(
            dep.cpu_group,
            device,
            num_experts=geometry.experts,
            latent=geometry.latent,
            topk=geometry.topk,
            max_tokens=args.step_tokens,
            config=EpConfig(timeout_s=args.timeout),
        )
        per_rank = geometry.experts // dep.size
        self.synthetic: list[SyntheticLayer] = []
        self.layers: list[EpMoeLayer] = []
        for index in range(args.layers):
            seed = args.seed + 1 + index
            synthetic = SyntheticLayer(geometry, seed, device)
            experts = default_experts(synthetic.local_weights(dep.rank * per_rank, per_rank))
            dense = synthetic_dense(geometry, synthetic, seed, device)
            moe = EpMoeLayer(dense, self.routed, experts, topk=geometry.topk, layer_index=index)
            self.synthetic.append(synthetic)
            self.layers.append(moe)

    def forward(
        self,
        tokens: torch.Tensor,
        T: int,
        record: list | None = None,
        is_padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens int64 [n] (n <= T) -> the next tokens, int64 [n]. Collective (T the same on
        every rank). `record`: gets (input, output) of every MoE layer. `is_padding`: bool [n],
        True for a padding row (a CUDA-graph bucket's rows past the step's tokens), which the
        MoE layers send to no expert (`padded_moe`); None: every row is a token (EpMoeLayer's
        call)."""
        h = self.embedding[tokens]
        for moe in self.layers:
            x = rms_norm(h)
            y = moe(x, tokens=T) if is_padding is None else padded_moe(moe, x, T, is_padding)
            if record is not None:
                record.append((x, y))
            h = h + y
        logits = rms_norm(h).float() @ self.embedding.float().T
        return logits.argmax(dim=-1)


def padded_moe(moe: EpMoeLayer, x: torch.Tensor, T: int, is_padding: torch.Tensor) -> torch.Tensor:
    """The layer's call with the rows `is_padding` (bool [>= n]) marks sent to no expert:
    EpMoeLayer's `padding=`, as the engine integrations pass their engine's mask to the routed
    call (read on the device where the ids are staged: a graph reads the live mask at every
    replay). Tagged with the layer index, as the integrations tag their calls. Collective."""
    return moe(x, tokens=T, tag=moe.layer_index, padding=is_padding)


def copy_into(static: object, fresh: object) -> None:
    """Copy the tensors of `fresh` into those of `static`, nested alike (tuples, lists)."""
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
        return
    for a, b in zip(static, fresh, strict=True):
        copy_into(a, b)


@dataclass
class Captured:
    """One bucket's captured step: its static inputs (tokens int64 [bucket], is_padding bool
    [bucket]), outputs (next int64 [bucket]; record: every MoE layer's (input, output), bf16
    [bucket, H] each) and `replay`, which reruns the step on them: a CUDA graph's replay, or
    with `emulated` the step run again, its results copied into the same outputs."""

    tokens: torch.Tensor
    is_padding: torch.Tensor
    next: torch.Tensor
    record: list
    replay: Callable[[], object]


def capture_step(step, emulated: bool):
    """(outputs, replay) of `step()`: captured in a CUDA graph (replay: the graph's), or emulated
    (the step run once now; replay runs it again and copies its outputs into the first ones)."""
    if emulated:
        outputs = step()
        return outputs, lambda: copy_into(outputs, step())
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        outputs = step()
    return outputs, graph.replay


class DecodeGraphs:
    """CUDA graphs of decode steps, one per bucket (`capture`, collective; `run` captures a bucket
    not captured yet): the tokens are copied into the bucket's input, the rows past them marked
    in its is_padding mask (their token 0 is run and ignored, and reaches no expert), the graph
    replays, the first n next tokens are read; `check` compares the replayed step's layers with
    the reference. `emulated`: the same on the CPU, a replay running the step again."""

    def __init__(self, decoder: Decoder, buckets: list[int], emulated: bool = False) -> None:
        self.decoder, self.buckets, self.emulated = decoder, buckets, emulated
        self.graphs: dict[int, Captured] = {}
        self.replays = 0

    def bucket(self, T: int) -> int | None:
        return next((b for b in self.buckets if b >= T), None)

    def capture(self, bucket: int) -> None:
        decoder = self.decoder
        device = decoder.embedding.device
        if not self.emulated:
            for moe in decoder.layers:  # compile what a step of `bucket` tokens runs
                warm_buckets(decoder.routed, moe.experts, [bucket])
        tokens = torch.zeros(bucket, dtype=torch.int64, device=device)
        is_padding = torch.zeros(bucket, dtype=torch.bool, device=device)
        decoder.forward(tokens, bucket, None, is_padding)  # one eager step before its capture
        if not self.emulated:
            torch.cuda.synchronize()

        def step():
            record: list = []
            return decoder.forward(tokens, bucket, record, is_padding), record

        (out, record), replay = capture_step(step, self.emulated)
        self.graphs[bucket] = Captured(tokens, is_padding, out, record, replay)

    def run(self, tokens: torch.Tensor, bucket: int) -> torch.Tensor:
        """tokens int64 [n] (n <= bucket) -> next tokens int64 [n]. Collective."""
        if bucket not in self.graphs:
            self.capture(bucket)
        step = self.graphs[bucket]
        n = tokens.numel()
        step.tokens[:n].copy_(tokens)
        step.tokens[n:].zero_()
        step.is_padding.copy_(torch.arange(bucket, device=step.is_padding.device) >= n)
        step.replay()
        self.replays += 1
        return step.next[:n].clone()

    def check(self, dep, n: int, bucket: int) -> tuple[float, float]:
        """The last replay of `bucket` (n tokens) against the reference: every MoE layer's
        output as the graph recorded it, its first n rows (`check_layers`; the reference is
        evaluated on the whole bucket, whose router GEMM then has the graph's row count, so
        the two route each token alike). Collective: every rank checks the same replay."""
        step = self.graphs[bucket]
        step.next.tolist()  # the replay is done (a device sync) before the references start
        return check_layers(self.decoder, dep, step.record, bucket, rows=n)


# ---------------------------------------------------------------------------------- the loop
def check_layers(
    decoder: Decoder, dep, record: list, T: int, rows: int | None = None
) -> tuple[float, float]:
    """Compare every MoE layer's (input, output) of a step of T tokens (`record`, this rank's
    rows, the step complete) with its float64 reference on the same input, on the first `rows`
    rows (None: all; a replayed bucket's real rows); returns this rank's largest relative L2
    error (inf for a non-finite output) and the seconds the references took. Collective."""
    worst = 0.0
    reference_start = time.perf_counter()
    for (x, y), moe, synthetic in zip(record, decoder.layers, decoder.synthetic):
        ref = layer_reference(dep.cpu_group, moe, synthetic.expert, x, T)[:rows]
        y = y[:rows]
        if y.shape[0]:
            worst = max(worst, rel_l2(y, ref) if y.isfinite().all() else math.inf)
    return worst, time.perf_counter() - reference_start


def check_step(decoder: Decoder, dep, tokens: torch.Tensor, T: int):
    """Run the step eagerly and compare every MoE layer with its float64 reference on the same
    input (`check_layers`); returns the next tokens (int64 [n]), this rank's largest relative L2
    error and the seconds the references took. Collective."""
    record: list = []
    next_tokens = decoder.forward(tokens, T, record)
    next_tokens.tolist()  # the step itself is done (a device sync) before the reference starts
    return (next_tokens, *check_layers(decoder, dep, record, T))


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 (nearest rank) of `values` in milliseconds; None for an empty list."""
    ordered = sorted(values)

    def at(q: float) -> float | None:
        if not ordered:
            return None
        return 1e3 * ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]

    return {"p50_ms": at(0.50), "p90_ms": at(0.90), "p99_ms": at(0.99)}


class Progress:
    """A bar on stderr of requests done (finished or refused) of all ranks' requests: redrawn in
    place on a terminal, one line per tenth otherwise (a log)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = max(total, 1), enabled
        self.tty = sys.stderr.isatty()
        self.shown_tenth = -1

    def update(self, done: int, step: int, T: int) -> None:
        if not self.enabled:
            return
        tenth = 10 * done // self.total
        if not self.tty and tenth == self.shown_tenth:
            return
        self.shown_tenth = tenth
        filled = PROGRESS_WIDTH * done // self.total
        bar = "#" * filled + "-" * (PROGRESS_WIDTH - filled)
        line = f"dp_server [{bar}] {done}/{self.total} requests, step {step}, T={T}"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr)
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


def serve(args, ctx, dep, decoder: Decoder, scheduler: Scheduler, tolerance: float) -> dict:
    """Run the loop until every rank's requests are finished or refused; returns this rank's
    numbers (rank 0's also hold the per-step counts of every rank)."""
    on_gpu = ctx.device.type == "cuda"
    graphs = None
    if on_gpu or args.emulate_graphs:  # a server's start: compile every step size, capture
        if on_gpu:  # every decode bucket
            for moe in decoder.layers:
                warm_buckets(decoder.routed, moe.experts, range(1, args.step_tokens + 1))
        graphs = DecodeGraphs(decoder, args.buckets, emulated=not on_gpu)
        for bucket in args.buckets:
            graphs.capture(bucket)
    total = sum(
        well_formed_requests(args, r, ctx.world_size) + args.malformed
        for r in range(ctx.world_size)
    )
    progress = Progress(total, ctx.rank == 0)
    counts = torch.zeros(ctx.world_size, COUNT_COLUMNS, dtype=torch.int64)
    steps = idle_rank_steps = 0
    checks = {"replayed": 0, "eager": 0}  # reference checks of replayed and of eager steps
    worst_error = 0.0
    history: list[list[int]] = []  # per step: every rank's token count
    dist.barrier(group=ctx.cpu_group)
    start = time.perf_counter()
    paused = 0.0  # seconds the references took: the loop's clock stops while they run

    def clock() -> float:
        return time.perf_counter() - start - paused

    while True:
        now = clock()
        scheduler.admit(now)
        batch = scheduler.plan()
        counts.zero_()
        counts[ctx.rank] = torch.tensor(
            [
                batch.tokens.numel(),
                scheduler.pending,
                batch.prefill_rows,
                len(scheduler.finished) + len(scheduler.refused),
                now > args.max_seconds,
            ]
        )
        dist.all_reduce(counts, group=ctx.cpu_group)  # every rank's row: the step's one collective
        per_rank = counts[:, COUNT_TOKENS].tolist()
        progress.update(int(counts[:, COUNT_FINISHED].sum()), steps, max(per_rank))
        if int(counts[:, COUNT_PENDING].sum()) == 0:
            break
        if int(counts[:, COUNT_OVERTIME].sum()):  # every rank stops at the same step
            if ctx.rank == 0:
                print(f"dp_server: stopped after --max-seconds {args.max_seconds:g}", flush=True)
            break
        if max(per_rank) == 0:  # nobody has tokens: wait for arrivals
            time.sleep(IDLE_WAIT_S)
            continue
        T = common_tokens(per_rank)
        tokens = batch.tokens.to(ctx.device)
        decode_only = int(counts[:, COUNT_PREFILL].sum()) == 0
        check = steps % args.check_every == 0
        bucket = graphs.bucket(T) if graphs is not None and decode_only else None
        if bucket is not None:  # a replay, checked against the reference as it ran
            next_tokens = graphs.run(tokens, bucket)
            if check:
                error, reference_s = graphs.check(dep, tokens.numel(), bucket)
        elif check:
            next_tokens, error, reference_s = check_step(decoder, dep, tokens, T)
        else:
            next_tokens = decoder.forward(tokens, T)
        if check:
            checks["replayed" if bucket is not None else "eager"] += 1
            worst = torch.tensor([error, reference_s], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
            worst_error = max(worst_error, float(worst[0]))
            paused += float(worst[1])
        poll_all()  # what a replayed step's kernels recorded, once per step, outside any capture
        scheduler.complete(batch, next_tokens.tolist(), clock())
        idle_rank_steps += per_rank.count(0)
        history.append(per_rank)
        steps += 1
    elapsed = clock()
    progress.close()
    ttft = [r.token_s[0] - r.arrival_s for r in scheduler.finished]
    inter_token = [b - a for r in scheduler.finished for a, b in zip(r.token_s, r.token_s[1:])]
    wrong = [r.rid for r in scheduler.finished if len(r.generated) != r.max_new]
    return {
        "rank": ctx.rank,
        "elapsed_s": elapsed,
        "steps": steps,
        "checks": sum(checks.values()),
        "checks_replayed": checks["replayed"],
        "checks_eager": checks["eager"],
        "worst_error": worst_error,
        "idle_rank_steps": idle_rank_steps,
        "graphs": "none" if graphs is None else "emulated" if graphs.emulated else "cuda",
        "graph_replays": graphs.replays if graphs else 0,
        "requests": scheduler.total,
        "finished": len(scheduler.finished),
        "refused": [(r.rid, why) for r, why in scheduler.refused],
        "wrong_length": wrong,
        "prompt_tokens": sum(r.prompt.numel() for r in scheduler.finished),
        "generated_tokens": sum(len(r.generated) for r in scheduler.finished),
        "ttft_s": ttft,
        "inter_token_s": inter_token,
        "history": history,
    }


def summarize(args, ctx, geometry, backend: str, tolerance: float, ranks: list[dict]) -> dict:
    """All ranks' numbers -> the run's results (rank 0)."""
    elapsed = max(r["elapsed_s"] for r in ranks)
    generated = sum(r["generated_tokens"] for r in ranks)
    prompt = sum(r["prompt_tokens"] for r in ranks)
    lost = sum(r["requests"] - r["finished"] - len(r["refused"]) for r in ranks)
    return {
        "world_size": ctx.world_size,
        "device": str(ctx.device),
        "preset": geometry.name,
        "experts_backend": backend,
        "layers": args.layers,
        "requests": sum(r["requests"] for r in ranks),
        "finished": sum(r["finished"] for r in ranks),
        "refused": sum(len(r["refused"]) for r in ranks),
        "refusals": [[r["rank"], rid, why] for r in ranks for rid, why in r["refused"]],
        "lost": lost,
        "wrong_length": sum(len(r["wrong_length"]) for r in ranks),
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "elapsed_s": elapsed,
        "generated_tokens_per_s": generated / elapsed,
        "processed_tokens_per_s": (generated + prompt) / elapsed,
        "steps": ranks[0]["steps"],
        "idle_rank_steps": ranks[0]["idle_rank_steps"],
        "graphs": ranks[0]["graphs"],
        "graph_replays": ranks[0]["graph_replays"],
        "checks": ranks[0]["checks"],
        "checks_replayed": ranks[0]["checks_replayed"],
        "checks_eager": ranks[0]["checks_eager"],
        "worst_error": max(r["worst_error"] for r in ranks),
        "tolerance": tolerance,
        "ttft": percentiles([t for r in ranks for t in r["ttft_s"]]),
        "inter_token": percentiles([t for r in ranks for t in r["inter_token_s"]]),
        "tokens_per_step": ranks[0]["history"],
    }


def report(results: dict) -> None:
    def ms(p: dict) -> str:
        return " ".join(f"{k[:3]} {'-' if v is None else f'{v:.1f}'} ms" for k, v in p.items())

    r = results
    emulated = ", emulated on the CPU" if r["graphs"] == "emulated" else ""
    print(
        f"dp_server: {r['world_size']} rank(s) on {r['device']}, preset {r['preset']}, experts"
        f" {r['experts_backend']}, {r['layers']} MoE layer(s)\n"
        f"  requests: {r['requests']} ({r['finished']} finished, {r['refused']} refused,"
        f" {r['lost']} lost, {r['wrong_length']} with a wrong token count)\n"
        f"  tokens: {r['prompt_tokens']} prompt, {r['generated_tokens']} generated in"
        f" {r['elapsed_s']:.2f} s: {r['generated_tokens_per_s']:.1f} generated tokens/s,"
        f" {r['processed_tokens_per_s']:.1f} tokens/s in all\n"
        f"  TTFT: {ms(r['ttft'])}; inter-token: {ms(r['inter_token'])}\n"
        f"  steps: {r['steps']} ({r['idle_rank_steps']} idle rank-steps,"
        f" {r['graph_replays']} graph replays{emulated})\n"
        f"  checks: {r['checks']} ({r['checks_replayed']} of replayed steps,"
        f" {r['checks_eager']} of eager steps), worst relative L2 error {r['worst_error']:.2e}"
        f" (tolerance {r['tolerance']:g}):"
        f" {'ok' if r['worst_error'] <= r['tolerance'] else 'FAILED'}\n"
        "  (host wall clock; ranks sharing a device are time-sliced)",
        flush=True,
    )


def plot(results: dict, path: str) -> bool:
    """Two panels: every rank's tokens per step, and the latency distributions. False when
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (counts, latency) = plt.subplots(1, 2, figsize=(11, 4))
    history = torch.tensor(results["tokens_per_step"])
    for rank in range(results["world_size"]):
        counts.plot(history[:, rank].tolist(), lw=1, label=f"rank {rank}")
    counts.set_xlabel("step")
    counts.set_ylabel("tokens")
    counts.set_title("tokens per step (0: the rank runs a dummy step)")
    counts.legend(fontsize=7)
    for name in ("ttft", "inter_token"):
        p = results[name]
        values = [v for v in p.values() if v is not None]
        latency.plot([50, 90, 99][: len(values)], values, "o-", label=name.replace("_", "-"))
    latency.set_xlabel("percentile")
    latency.set_ylabel("ms")
    latency.set_title("latency")
    latency.legend(fontsize=7)
    fig.suptitle(
        f"dp_server: {results['world_size']} ranks, {results['device']},"
        f" {results['generated_tokens_per_s']:.0f} generated tokens/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def gpu_stack_present() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cutlass.cute  # noqa: F401
        import nvshmem.core  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> int:
    args = parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if gpu_stack_present() else "cpu"
    ctx = init_rank_context(device, timeout_s=args.timeout)
    dep = new_dep_group(ctx, args.dep_size or ctx.world_size)
    on_gpu = ctx.device.type == "cuda"
    if on_gpu and args.emulate_graphs:
        teardown(ctx)
        raise SystemExit(
            "dp_server: --emulate-graphs is for CPU runs; on CUDA the buckets are graphs"
        )
    geometry = PRESETS[("k3" if on_gpu else "tiny") if args.preset == "auto" else args.preset]
    decoder = Decoder(args, ctx, dep, geometry)
    experts = decoder.layers[0].experts
    tolerance = LAYER_REL_L2_BY_ACTIVATION[experts.activation_format]
    scheduler = Scheduler(workload(args, ctx.rank, ctx.world_size), args, ctx.rank)
    mine = serve(args, ctx, dep, decoder, scheduler, tolerance)
    ranks: list[dict] = [{} for _ in range(ctx.world_size)]
    dist.all_gather_object(ranks, mine, group=ctx.cpu_group)
    close_shared()
    failed = False
    if ctx.rank == 0:
        results = summarize(args, ctx, geometry, type(experts).__name__, tolerance, ranks)
        report(results)
        if args.metrics:
            with open(args.metrics, "w") as f:
                json.dump(results, f, indent=1)
        if args.plot and not plot(results, args.plot):
            print(f"dp_server: no plot at {args.plot}: matplotlib is not importable")
        failed = results["lost"] or results["wrong_length"] or results["worst_error"] > tolerance
    verdict = torch.tensor([int(bool(failed))])
    dist.broadcast(verdict, 0, group=ctx.cpu_group)
    teardown(ctx)
    return int(verdict)


if __name__ == "__main__":
    sys.exit(main())
