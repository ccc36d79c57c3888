"""What the recovery tests share: seeded batches every rank rebuilds alone (with a reference that
needs no collective, so it can be computed while the ranks are out of step), the loop a server
runs around EpRouted (an error, then what its message says, then the next batch), a signal
delivered to this process while it waits inside a call, and an EpMoeLayer run by its public
parts."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from dep_ep.comm.errors import EpDesyncError, EpPeerError, EpTimeoutError
from dep_ep.config import TINY
from dep_ep.testing import SyntheticLayer, routed_reference
from dep_ep.testing.compare import compare

from helpers.cases import make_case
from helpers.reference_check import make_experts

# The errors after which docs/design.md ("Errors") says to call reset() on every rank.
RECOVERABLE = (EpDesyncError, EpPeerError, EpTimeoutError, RuntimeError)


class Batches:
    """Batch i of every rank from seed + i: this rank's latent bf16 [T, L], ids int32 [T, K] and
    weights fp32 [T, K], and its float64 reference rows (dep_ep.testing.routed_reference)."""

    def __init__(self, dep, layer: SyntheticLayer, seed: int, tokens: int):
        self.dep, self.layer, self.seed, self.tokens = dep, layer, seed, tokens
        self.experts = make_experts(layer, dep.rank, dep.size)

    def inputs(self, i: int):
        case = make_case(TINY, self.dep.size, self.tokens, self.seed + i)
        r = self.dep.rank
        return case.latent[r], case.ids[r], case.weights[r]

    def reference(self, i: int) -> torch.Tensor:
        return self.reference_of(self.layer, *self.inputs(i))

    @staticmethod
    def reference_of(layer: SyntheticLayer, latent, ids, weights) -> torch.Tensor:
        """float64 [T, L]: the routed output of these rows with `layer`'s experts and norm."""
        return routed_reference(latent, ids, weights, layer.norm_weight(), layer.expert)

    def run(self, routed, i: int, **kw) -> torch.Tensor:
        latent, ids, weights = self.inputs(i)
        return routed(latent, ids, weights, self.layer.norm_weight(), experts=self.experts, **kw)


def serve(routed, batches: Batches, first: int, count: int, failures: list[str], label: str):
    """Run batches first .. first + count - 1 as a server would: a call that raises one of the
    RECOVERABLE errors is followed by reset() (what its message says) and the next batch. Every
    output a call returns must match its reference. Returns the batches that returned, in
    order; a reset that raises is a failure (its error is recorded, the loop goes on)."""
    done = []
    for i in range(first, first + count):
        try:
            out = batches.run(routed, i)
        except RECOVERABLE:
            try:
                routed.reset()
            except Exception as err:  # reported collectively
                failures.append(f"{label}: reset() after batch {i}: {type(err).__name__}: {err}")
            continue
        failures += compare(out, batches.reference(i), f"{label} batch {i}")
        done.append(i)
    return done


def interrupt_after(seconds: float) -> threading.Timer:
    """SIGINT to this process in `seconds` (as Ctrl-C in a terminal delivers it): the default
    handler raises KeyboardInterrupt in the main thread. Returns the started timer."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def timed(call) -> tuple[BaseException | None, float]:
    """(the exception `call()` raised or None, seconds it took)."""
    start = time.monotonic()
    try:
        call()
    except BaseException as err:  # KeyboardInterrupt included: the caller checks
        return err, time.monotonic() - start
    return None, time.monotonic() - start


def run_by_parts(moe, x, tag=None):
    """bf16 [n, H]: EpMoeLayer `moe` on x run by its public parts (front, router, latent_of,
    routed_path, shared, up), as an engine that runs its own projections would. Collective."""
    front = moe.front(x)
    ids, weights = moe.router(x)
    normed = moe.routed_path(moe.latent_of(front), ids, weights, tag=tag)
    return moe.up(normed, moe.shared(front))
