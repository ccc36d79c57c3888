"""EpMoeLayer: one Kimi K3 MoE layer of one DEP rank: the router, the latent projections and the
shared experts around the routed path (EpRouted). Formula: docs/formats.md ("The block's forward
order"); schedule and memory: docs/layer.md."""

from __future__ import annotations

import hashlib
import math
import weakref
from typing import Mapping

import torch

from dep_ep.checks import (
    check_eps,
    check_int,
    check_layer_index,
    check_padding,
    check_real,
    check_step_tokens,
    vector_rows,
    vector_start,
)
from dep_ep.config import DEFAULT_NORM_EPS, DEFAULT_ROUTED_SCALING_FACTOR
from dep_ep.constants import (
    LAYER_FINGERPRINT_BITS,
    LAYER_INDEX_BITS,
    LAYER_STEP_BITS,
    LAYER_TAG_BASE,
)
from dep_ep.ep.routed import EpRouted, check_experts_match, step_total
from dep_ep.ep.router import route_into
from dep_ep.experts.base import ExpertsBackend
from dep_ep.experts.checkpoint import (  # the dense tensors' checkpoint names
    BIAS,
    DENSE_NAMES,
    DOWN,
    GATE,
    NORM,
    SHARED_DOWN,
    SHARED_GATE,
    SHARED_UP,
    UP,
)
from dep_ep.experts.select import default_experts
from dep_ep.experts.situ import situ
from dep_ep.experts.weights import ExpertWeights

SCHEDULES = ("overlap", "serial")
FINGERPRINT_SAMPLES = 64  # elements of each dense tensor a layer's fingerprint reads


def layer_tag(index: int, fingerprint: int, step: int) -> int:
    """The tag of an EpMoeLayer's call given no tag=: its layer index, the fingerprint of its
    dense weights (`dense_fingerprint`) and its own call count (modulo 2^LAYER_STEP_BITS), so
    that layers called in other orders, or built in other orders, on different ranks raise
    EpDesyncError everywhere."""
    step %= 1 << LAYER_STEP_BITS
    high = (step << LAYER_FINGERPRINT_BITS) + fingerprint
    return LAYER_TAG_BASE + (high << LAYER_INDEX_BITS) + index


def dense_fingerprint(dense: Mapping[str, torch.Tensor]) -> int:
    """A LAYER_FINGERPRINT_BITS-bit digest of one layer's dense tensors (DENSE_NAMES): their
    names, shapes and dtypes and the bits of FINGERPRINT_SAMPLES elements of each, evenly spaced
    over the tensor. Every DEP rank holds the same dense weights of a model layer, so the digest
    is the same on every rank for the same layer, and differs between layers whose sampled
    elements differ (except by a 2^-24 chance). One small gather and one device-to-host copy,
    at construction; nothing per call."""
    described, samples = [], []
    for name in DENSE_NAMES:
        t = dense[name]
        described.append(f"{name}:{tuple(t.shape)}:{t.dtype}")
        count = t.numel()
        if count == 0:
            continue
        picks = torch.linspace(0, count - 1, min(FINGERPRINT_SAMPLES, count)).long()
        index = tuple(torch.unravel_index(picks, t.shape))
        values = t.detach()[tuple(i.to(t.device) for i in index)]
        bits = values.view({2: torch.int16, 4: torch.int32}[values.element_size()])
        samples.append(bits.long())
    digest = hashlib.blake2b(";".join(described).encode(), digest_size=8)
    if samples:
        digest.update(torch.cat(samples).cpu().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") & ((1 << LAYER_FINGERPRINT_BITS) - 1)


def _version_of(ref: weakref.ref | None) -> int | None:
    """The version counter of the tensor `ref` points at (it moves at every in-place change:
    copy_, load_state_dict, an optimizer step), None when the tensor is gone or keeps none (an
    inference tensor)."""
    t = None if ref is None else ref()
    if t is None:
        return None
    try:
        return t._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


def _watch(t: torch.Tensor) -> weakref.ref | None:
    """A weak reference to a caller's dense tensor (the layer holds no strong one to the tensors
    it copied: dropping the caller's dict frees them), None where torch refuses one."""
    try:
        return weakref.ref(t)
    except TypeError:
        return None


def _mode(values: list[int]) -> int | None:
    """The most frequent value (the first of equally frequent ones), None for no values."""
    return max(values, key=values.count) if values else None


def _packed_in_place(parts: list[torch.Tensor], width: int) -> torch.Tensor | None:
    """A [sum of rows, width] view over `parts` when they are contiguous, consecutive slices of one
    storage in this order (another layer's `dense` views, for instance); else None."""
    first = parts[0]
    base = first.untyped_storage().data_ptr()
    offset, rows = first.storage_offset(), 0
    for p in parts:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != base:
            return None
        if p.storage_offset() != offset + rows * width:
            return None
        rows += p.shape[0]
    if (offset + rows * width) * first.element_size() > first.untyped_storage().nbytes():
        return None
    return first.as_strided((rows, width), (width, 1), offset)


def padding_rows(padding: object, rows: int, device: torch.device) -> torch.Tensor | None:
    """padding[:rows] when `padding` is a mask EpRouted accepts (bool [>= rows] on `device`), else
    None: the layer's own value checks skip padding rows, and leave a malformed mask to
    EpRouted, which refuses it on every rank."""
    if padding is None:
        return None
    try:
        check_padding("EpMoeLayer", padding, rows, device)
    except (TypeError, ValueError):
        return None
    return padding[:rows]


class EpMoeLayer:
    """One MoE layer of one DEP rank: x bf16 [n, H] -> bf16 [n, H] (docs/formats.md):

        ids, w  = route(x) (ep/router.py: fp32 logits, sigmoid scores, bias for selection only,
                  weights renormalised w / (sum + 1e-20), times routed_scaling_factor)
        latent  = BF16(x @ routed_expert_down_proj^T)                      [n, L]
        normed  = EpRouted.routed(latent, ids, w, routed_expert_norm)      [n, L] (RMSNorm, eps)
        shared  = BF16(BF16(SiTU(BF16(x @ gate_s^T), BF16(x @ up_s^T))) @ down_s^T)   [n, H]
        out     = BF16(normed @ routed_expert_up_proj^T + shared)          (one addmm, fp32 sum)

    dense: the layer's dense tensors by checkpoint name after the layer prefix, as
      `experts.checkpoint.load_moe_layer(...).dense` returns them: gate.weight bf16 [E, H],
      gate.e_score_correction_bias fp32 [E], routed_expert_down_proj.weight bf16 [L, H],
      routed_expert_norm.weight bf16 [L], routed_expert_up_proj.weight bf16 [H, L],
      shared_experts.{gate,up}_proj.weight bf16 [S, H], shared_experts.down_proj.weight bf16
      [H, S], all on routed's device. E, L come from `routed`; H and S from the tensors (the value
      most of them agree on). Names beyond these are ignored.
    routed: the rank's EpRouted; experts: the ExpertsBackend of the rank's experts (matching
      routed), or their weights: an ExpertWeights (of routed's num_experts), or the checkpoint
      layout as a tuple or list (w13, s13, w2, s2) (experts/weights.py; first_expert and
      num_experts from routed), from which the layer builds `experts.default_experts`
      (HopperExperts on SM90, TrtllmExperts on SM100/103, ReferenceExperts elsewhere); topk: K,
      equal to routed.topk; eps: the latent RMSNorm's eps (finite and > 0 once rounded to fp32,
      where the norm adds it); routed_scaling_factor: multiplies the routing weights (finite,
      > 0; 1.0 for K3).
    schedule: "overlap" (on CUDA: the router and the shared experts on a side stream beside the
      projections and the routed path; docs/layer.md) or "serial" (everything on the current
      stream, in the formula's order). Both run the same GEMMs on the same data, so their results
      are the same bits; on CPU both run the serial order.
    layer_index: the layer's number in the model (0..65535), which its calls' tags carry; None:
      the next number in `routed`'s construction order (local; a dropped layer's number is not
      reused). Ranks must give a layer the same index: build the layers in the same order, or
      pass the model's; ranks that do not raise EpDesyncError at every call (below).

    Tags: a call given no tag= carries (layer_index, the fingerprint of the dense weights,
    the layer's call count) as its tag (`layer_tag`), so a layer called where another layer is
    called on another rank raises EpDesyncError on every rank, and so does a layer whose index
    is another layer's on another rank (layers built in other orders without layer_index=):
    every rank holds the same dense weights of a layer, so the fingerprint (`dense_fingerprint`,
    computed once here) tells layers apart across ranks. Two layers whose sampled dense
    elements are equal share a fingerprint: give them layer_index=. EpRouted.reset() restarts
    the counts. Under CUDA-graph replay the tag is the one the graph was captured with: ranks
    that capture the same graphs in the same order agree.

    Memory: the shared gate and up projections and the latent down projection are copied once,
    at construction, into one packed weight `packed` bf16 [2S + L, H] (rows: shared gate, shared
    up, latent down; one GEMM computes all three). `dense` holds views of it under their names,
    and the layer keeps no reference to the caller's three tensors: dropping the caller's dict
    frees them. When the three already are consecutive slices of one storage in that order (as
    another EpMoeLayer's `dense` is), they are used in place, without a copy. The other five
    tensors are kept as given.

    Weights changed after construction (a checkpoint loaded into the tensors after the layer was
    built, a weight update in place): every call first compares the version counters of the
    tensors given at construction (weak references) with those the layer last read, and when one
    moved it copies the changed tensors it packed (the three above, and the norm weight when it
    was not contiguous) and recomputes the fingerprint (one device-to-host copy), so the call
    uses the new weights and tags (`refresh()` does the same without a call). Inside a CUDA
    graph capture a moved counter fails the call on every rank instead (nothing may be copied
    or read to the host there): call the layer, or `refresh()`, once before capturing. Not seen:
    tensors replaced rather than changed (`load_state_dict(..., assign=True)`, a parameter
    re-bound to a new tensor), and changes to inference tensors (they keep no counter); build a
    new layer for those.

    Errors: construction raises ValueError (missing names, shapes, devices, values) or TypeError
    (types, dtypes) naming the tensor or argument. A call is collective like EpRouted.routed:
    every rank calls with the same `tokens`; a rank whose input is bad raises ValueError or
    TypeError and every other rank EpPeerError (CPU: in the same call; CUDA: at its next call),
    and the layer stays usable.
    """

    def __init__(
        self,
        dense: Mapping[str, torch.Tensor],
        routed: EpRouted,
        experts: ExpertsBackend | ExpertWeights | tuple[torch.Tensor, ...] | list[torch.Tensor],
        *,
        topk: int,
        eps: float = DEFAULT_NORM_EPS,
        routed_scaling_factor: float = DEFAULT_ROUTED_SCALING_FACTOR,
        schedule: str = "overlap",
        layer_index: int | None = None,
    ) -> None:
        fn = "EpMoeLayer"
        if not isinstance(routed, EpRouted):
            raise TypeError(f"{fn}: routed is {type(routed).__name__}; expected an EpRouted")
        if isinstance(experts, (tuple, list)):
            if len(experts) != 4:
                raise TypeError(
                    f"{fn}: experts is a {type(experts).__name__} of {len(experts)}; expected an"
                    " ExpertsBackend, an ExpertWeights or the checkpoint layout (w13, s13, w2, s2)"
                )
            first, total = routed.first_expert, routed.num_experts
            experts = ExpertWeights(*experts, first_expert=first, num_experts=total)
        if isinstance(experts, ExpertWeights):
            if experts.num_experts != routed.num_experts:
                raise ValueError(
                    f"{fn}: experts hold num_experts={experts.num_experts}; the EpRouted was"
                    f" built for num_experts={routed.num_experts}"
                )
            experts = default_experts(experts)
        check_experts_match(fn, routed, experts)
        if check_int(fn, "topk", topk) != routed.topk:
            raise ValueError(f"{fn}: topk={topk!r}; the EpRouted was built for topk={routed.topk}")
        factor = check_real(fn, "routed_scaling_factor", routed_scaling_factor)
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(
                f"{fn}: routed_scaling_factor={factor!r}; expected a finite number > 0"
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"{fn}: schedule={schedule!r}; allowed {SCHEDULES}")
        if layer_index is not None:
            layer_index = check_layer_index(fn, layer_index)
        self.routed, self.experts, self.topk = routed, experts, routed.topk
        self.eps = check_eps(fn, eps)
        self.routed_scaling_factor = factor
        self.schedule = schedule
        self.device = routed.device
        self.num_experts, self.latent = routed.num_experts, routed.latent
        self.hidden, self.shared_intermediate = self._check_dense(fn, dense)
        # Inference only: a model's nn.Parameters are taken without their autograd (the layer's
        # GEMMs write into given outputs, which autograd refuses for tensors that need grad).
        given = dense
        dense = {
            name: dense[name].detach() if dense[name].requires_grad else dense[name]
            for name in DENSE_NAMES
        }

        S, L = self.shared_intermediate, self.latent
        parts = [dense[SHARED_GATE], dense[SHARED_UP], dense[DOWN]]
        packed = _packed_in_place(parts, self.hidden)
        if packed is None:
            packed = torch.empty(2 * S + L, self.hidden, dtype=torch.bfloat16, device=self.device)
            for rows, part in zip((slice(0, S), slice(S, 2 * S), slice(2 * S, None)), parts):
                packed[rows].copy_(part)
        # bf16 [2S + L, H]: rows [shared gate (S); shared up (S); latent down (L)].
        self.packed = packed
        self.dense = {name: dense[name] for name in DENSE_NAMES}
        self.dense.update(
            {SHARED_GATE: packed[:S], SHARED_UP: packed[S : 2 * S], DOWN: packed[2 * S :]}
        )
        self.gate_weight, self.bias = self.dense[GATE], self.dense[BIAS]
        # EpRouted takes a contiguous norm weight (no copy when it is one already).
        self.norm_weight, self.up_weight = self.dense[NORM].contiguous(), self.dense[UP]
        self.shared_down = self.dense[SHARED_DOWN]
        # The side stream of the overlapped schedule (CUDA only); one per layer.
        self._side = None
        if self.device.type == "cuda" and schedule == "overlap":
            self._side = torch.cuda.Stream(device=self.device)
        # The caller's tensors and what the layer made of them, for `refresh`: weak references
        # (the caller may drop what was copied), their version counters when last read, and
        # which of them the layer holds a copy of.
        self._sources = {name: _watch(given[name]) for name in DENSE_NAMES}
        self._read_versions = self._source_versions()
        self._packed_copy = packed.data_ptr() != parts[0].data_ptr()
        self._norm_copy = self.norm_weight.data_ptr() != dense[NORM].data_ptr()
        # The same on every rank for this model layer: it goes into the layer's own tags.
        self.fingerprint = dense_fingerprint(dense)
        self.layer_index = routed.register_layer(self, layer_index)
        self._calls = 0  # calls so far: the tag of the next call given no tag=

    def _source_versions(self) -> tuple[int | None, ...]:
        return tuple(_version_of(self._sources[name]) for name in DENSE_NAMES)

    def refresh(self) -> bool:
        """Local (no collective). When a dense tensor given at construction changed in place
        since the layer last read it (its version counter moved), copy the changed ones the
        layer holds copies of into those copies and recompute the fingerprint; returns whether
        one had changed. Blocks the host (the fingerprint's device-to-host copy) when one had.
        RuntimeError inside a CUDA graph capture when one had (forward fails the step on every
        rank instead)."""
        versions = self._source_versions()
        if versions == self._read_versions:
            return False
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(self._stale_message("EpMoeLayer.refresh"))
        S = self.shared_intermediate
        names = (SHARED_GATE, SHARED_UP, DOWN)
        for name, rows in zip(names, (slice(0, S), slice(S, 2 * S), slice(2 * S, None))):
            source = self._sources[name]() if self._sources[name] is not None else None
            if self._packed_copy and source is not None:
                self.packed[rows].copy_(source.detach())
        norm = self._sources[NORM]() if self._sources[NORM] is not None else None
        if self._norm_copy and norm is not None:
            self.norm_weight.copy_(norm.detach())
        self.fingerprint = dense_fingerprint(self.dense)
        self._read_versions = versions
        return True

    def _stale_message(self, fn: str) -> str:
        return (
            f"{fn}: the layer's dense weights changed in place since it last read them (a"
            " checkpoint loaded after construction, or a weight update); inside a CUDA graph"
            " capture nothing may be copied: call the layer or refresh() once before capturing"
        )

    def restart_steps(self) -> None:
        """Restart the call count the layer's own tags carry (EpRouted.reset does, on every
        rank)."""
        self._calls = 0

    # ----------------------------------------------------------------------------- validation
    def _check_dense(self, fn: str, dense: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        """Check every dense tensor; returns (H, S)."""
        if not isinstance(dense, Mapping):
            raise TypeError(f"{fn}: dense is {type(dense).__name__}; expected a dict of tensors")
        missing = [name for name in DENSE_NAMES if name not in dense]
        if missing:
            raise ValueError(
                f"{fn}: dense lacks {', '.join(missing)} (it needs {', '.join(DENSE_NAMES)})"
            )
        for name in DENSE_NAMES:
            if not isinstance(dense[name], torch.Tensor):
                raise TypeError(
                    f"{fn}: dense[{name!r}] is {type(dense[name]).__name__}; expected a tensor"
                )
        shape = {name: tuple(dense[name].shape) for name in DENSE_NAMES}

        def dim(name: str, axis: int) -> list[int]:
            return [shape[name][axis]] if len(shape[name]) == 2 else []

        # H and S: the value most tensors agree on, so the one misshapen tensor is named.
        hidden = _mode(
            dim(GATE, 1)
            + dim(DOWN, 1)
            + dim(UP, 0)
            + dim(SHARED_GATE, 1)
            + dim(SHARED_UP, 1)
            + dim(SHARED_DOWN, 0)
        )
        inter = _mode(dim(SHARED_GATE, 0) + dim(SHARED_UP, 0) + dim(SHARED_DOWN, 1))
        E, L, H, S = self.num_experts, self.latent, hidden, inter
        expected = {
            GATE: (E, H),
            BIAS: (E,),
            DOWN: (L, H),
            NORM: (L,),
            UP: (H, L),
            SHARED_GATE: (S, H),
            SHARED_UP: (S, H),
            SHARED_DOWN: (H, S),
        }
        sizes = f"E={E}, L={L} from routed; H={H}, S={S} from the other tensors"
        for name in DENSE_NAMES:
            t, want = dense[name], expected[name]
            want_dtype = torch.float32 if name == BIAS else torch.bfloat16
            if t.dtype != want_dtype:
                raise TypeError(f"{fn}: dense[{name!r}] dtype {t.dtype}; expected {want_dtype}")
            if shape[name] != want or 0 in want:
                raise ValueError(
                    f"{fn}: dense[{name!r}] shape {shape[name]}; expected {want} ({sizes})"
                )
            if t.device != self.device:
                raise ValueError(
                    f"{fn}: dense[{name!r}] on {t.device}; expected {self.device} (routed's)"
                )
        return H, S

    def _check_call(self, fn: str, x: object, tokens: object, padding: object) -> Exception | None:
        """The error of a bad call, or None. Padding rows are not read (a malformed `padding`
        is EpRouted's to refuse, on every rank)."""
        if not isinstance(x, torch.Tensor):
            return TypeError(f"{fn}: x is {type(x).__name__}; expected a torch.Tensor")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            return ValueError(f"{fn}: x shape {tuple(x.shape)}; expected (n, {self.hidden}) (n, H)")
        if x.dtype != torch.bfloat16:
            return TypeError(f"{fn}: x dtype {x.dtype}; expected torch.bfloat16")
        if x.device != self.device:
            return ValueError(f"{fn}: x on {x.device}; expected {self.device}")
        if x.requires_grad and torch.is_grad_enabled():
            return ValueError(
                f"{fn}: x requires grad with autograd on; EpMoeLayer is inference-only: call it"
                " under torch.no_grad() or torch.inference_mode()"
            )
        rows = x.shape[0]
        if tokens is None and rows == 0:
            return ValueError(f"{fn}: x has 0 rows and tokens=None; pass tokens= (T >= 1)")
        if tokens is not None:
            try:  # above max_tokens, EpRouted.routed runs the step in max_tokens pieces
                tokens = check_step_tokens(fn, tokens)
            except (TypeError, ValueError) as err:
                return err
            if rows > tokens:
                return ValueError(f"{fn}: x has {rows} rows, more than tokens={tokens}")
        # EpRouted reads its inputs where that costs no host sync (check_values); so does the
        # layer: a non-finite x would reach the router and give NaN routing weights.
        if self.routed.check_values and rows:
            bad = ~x.isfinite().all(dim=1)
            mask = padding_rows(padding, rows, x.device)
            if mask is not None:
                bad &= ~mask
            if bool(bad.any()):
                row = int(bad.nonzero()[0])
                return ValueError(f"{fn}: x holds non-finite values (first in row {row})")
        return None

    def _reject(self, fn: str, error: BaseException, tag, tokens, x) -> None:
        """Take part in the step as a rank that rejects its input, then raise `error`
        (EpRouted.reject_step: every peer raises EpPeerError; CPU: in this call, CUDA: at its
        next call). `tokens` (None: x's rows, as forward takes it): the call's T, so that a
        step above max_tokens is rejected in every piece the peers run. Collective, like a
        call."""
        self.routed.reject_step(error, tag=tag, tokens=step_total(tokens, x))

    # ----------------------------------------------------------------------------- the parts
    def front(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 [n, 2S + L] = x @ packed^T: the shared gate (columns 0..S-1) and up (S..2S-1)
        projections and the latent (2S..2S+L-1), one BF16 GEMM with fp32 sums."""
        return torch.mm(x, self.packed.t())

    def latent_of(self, front: torch.Tensor) -> torch.Tensor:
        """bf16 [n, L]: the front GEMM's latent columns, a view EpRouted reads in place (rows of
        2S + L elements), or a contiguous copy when the view's rows do not start on 16-byte
        boundaries (2S + L or 2S not a multiple of 8)."""
        latent = front[:, 2 * self.shared_intermediate :]
        aligned = vector_start(latent) and vector_rows(latent)
        return latent if aligned or latent.shape[0] == 0 else latent.contiguous()

    def router(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int32 [n, K], weights fp32 [n, K]) of bf16 x [n, H]: ep/router.py's `route` with
        this layer's gate, bias and routed_scaling_factor (on CUDA its BF16 GEMM with fp32 output,
        `bf16_gemm=True`)."""
        ids = torch.empty(x.shape[0], self.topk, dtype=torch.int32, device=x.device)
        weights = torch.empty(x.shape[0], self.topk, dtype=torch.float32, device=x.device)
        self._route_into(x, ids, weights)
        return ids, weights

    def _route_into(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """The router into the step's ids and weights (on CUDA no widened copy of the gate)."""
        gate, bias, factor = self.gate_weight, self.bias, self.routed_scaling_factor
        route_into(x, gate, bias, ids, weights, routed_scaling_factor=factor, bf16_gemm=True)

    def shared(self, front: torch.Tensor) -> torch.Tensor:
        """bf16 [n, H]: the shared experts on the front GEMM's gate and up columns."""
        out = torch.empty(front.shape[0], self.hidden, dtype=torch.bfloat16, device=front.device)
        self._shared_into(front, out)
        return out

    def _shared_into(self, front: torch.Tensor, out: torch.Tensor) -> None:
        S = self.shared_intermediate
        act = situ(front[:, :S].float(), front[:, S : 2 * S].float()).to(torch.bfloat16)
        torch.mm(act, self.shared_down.t(), out=out)

    def routed_path(
        self,
        latent: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        *,
        tokens: int | None = None,
        tag: int | None = None,
        padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """bf16 [n, L]: EpRouted.routed with this layer's experts, norm weight and eps (padding:
        as EpRouted.dispatch). Collective."""
        return self.routed.routed(
            latent,
            ids,
            weights,
            self.norm_weight,
            experts=self.experts,
            eps=self.eps,
            tokens=tokens,
            tag=tag,
            padding=padding,
        )

    def up(self, normed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """shared += normed @ routed_expert_up_proj^T, in place, one addmm (fp32 sum of the
        product and `shared`, one rounding to BF16); returns `shared`, bf16 [n, H]."""
        return shared.addmm_(normed, self.up_weight.t())

    # ----------------------------------------------------------------------------- the call
    def forward(
        self,
        x: torch.Tensor,
        *,
        tokens: int | None = None,
        tag: int | None = None,
        padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x bf16 [n, H] (0 <= n <= tokens) -> bf16 [n, H]. tokens: T, the step's token count,
        the same on every rank (None: n; n = 0 needs tokens >= 1); tag, padding (bool [>= n],
        True: the row selects no expert; an engine's persistent mask): as EpRouted.dispatch.
        Collective over routed's group. On CUDA stream-ordered (no host sync unless the EpRouted
        reads values, `check_values`) and capturable in a CUDA graph when the experts backend is."""
        fn = "EpMoeLayer.forward"
        calls, entered = self._calls, self.routed._entered
        stale = None
        if self._source_versions() != self._read_versions:
            try:
                self.refresh()
            except RuntimeError:  # inside a capture: the step fails on every rank
                stale = RuntimeError(self._stale_message(fn))
        if tag is None:
            tag = layer_tag(self.layer_index, self.fingerprint, calls)
        try:
            error = stale or self._check_call(fn, x, tokens, padding)
            if error is not None:
                self._reject(fn, error, tag, tokens, x)
            if self._side is None:
                return self._forward_serial(fn, x, tokens, tag, padding)
            return self._forward_overlap(fn, x, tokens, tag, padding)
        finally:
            # The call counts once it reached the EpRouted's transport (as its peers' calls do):
            # an exception before that (a KeyboardInterrupt in this rank's own work) leaves the
            # count where the peers' is, and the next call pairs with theirs.
            if self.routed._entered != entered:
                self._calls = calls + 1

    # Under torch.compile a model's call of the layer runs it eagerly (a graph break, 0.4 us a
    # call measured on CPU out of compile): its host-side checks and streams are not traceable.
    # routed_op is the path torch.compile traces (docs/integrations.md).
    forward = torch.compiler.disable(forward)
    __call__ = forward

    def _forward_serial(self, fn, x, tokens, tag, padding) -> torch.Tensor:
        n, on = x.shape[0], dict(device=self.device)
        ids = torch.empty(n, self.topk, dtype=torch.int32, **on)
        weights = torch.empty(n, self.topk, dtype=torch.float32, **on)
        shared = torch.empty(n, self.hidden, dtype=torch.bfloat16, **on)
        try:
            front = self.front(x)
            self._route_into(x, ids, weights)
            self._shared_into(front, shared)
            latent = self.latent_of(front)
            error = self._check_overflow(fn, x, latent, weights, padding)
        except BaseException as err:  # every rank must still complete the step
            self._reject(fn, err, tag, tokens, x)
        if error is not None:
            self._reject(fn, error, tag, tokens, x)
        normed = self.routed_path(latent, ids, weights, tokens=tokens, tag=tag, padding=padding)
        return self.up(normed, shared)

    def _check_overflow(self, fn, x, latent, weights, padding) -> ValueError | None:
        """Where values are read (check_values): a finite x whose projections overflow (a latent
        or a routing weight that is not finite) is the caller's x, named as such; unchecked it
        would give NaN rows. Padding rows are not read (a malformed `padding` is EpRouted's to
        refuse, on every rank)."""
        if not self.routed.check_values or x.shape[0] == 0:
            return None
        bad = ~(latent.isfinite().all(dim=1) & weights.isfinite().all(dim=1))
        mask = padding_rows(padding, x.shape[0], bad.device)
        if mask is not None:
            bad &= ~mask
        if not bool(bad.any()):
            return None
        row = int(bad.nonzero()[0])
        return ValueError(
            f"{fn}: x row {row} (largest |x| {float(x[row].float().abs().max()):.3g}) overflows"
            " the layer's projections (its latent or routing weights are not finite); scale the"
            " layer's input"
        )

    def _forward_overlap(self, fn, x, tokens, tag, padding) -> torch.Tensor:
        """The serial order's operations on two streams:

            main: front GEMM ------------> latent copy, wait router -> routed path -> wait side, up
            side: wait main, router  ->  wait front GEMM, shared SiTU, shared down

        Lifetimes without record_stream: the tensors the side stream writes and the main stream
        reads (ids, weights, shared) are allocated on the main stream before the side stream
        waits for it, so they belong to the main stream's pool and the side stream writes after
        every earlier main-stream use of their memory. The side stream's temporaries stay on the
        side stream. The tensors the side stream reads (x, the front GEMM's output) stay
        referenced until the main stream has waited for the side stream, before this returns
        (on error too), so no later main-stream allocation can reuse them while they are read.
        """
        main = torch.cuda.current_stream(self.device)
        side = self._side
        n, on = x.shape[0], dict(device=self.device)
        ids = torch.empty(n, self.topk, dtype=torch.int32, **on)
        weights = torch.empty(n, self.topk, dtype=torch.float32, **on)
        shared = torch.empty(n, self.hidden, dtype=torch.bfloat16, **on)
        routed_ready, front_ready = torch.cuda.Event(), torch.cuda.Event()
        side.wait_stream(main)
        try:
            with torch.cuda.stream(side):
                self._route_into(x, ids, weights)
                routed_ready.record(side)
            front = self.front(x)
            front_ready.record(main)
            side.wait_event(front_ready)
            with torch.cuda.stream(side):
                self._shared_into(front, shared)
            latent = self.latent_of(front)
            main.wait_event(routed_ready)
            error = self._check_overflow(fn, x, latent, weights, padding)
        except BaseException as err:  # every rank must still complete the step
            main.wait_stream(side)
            self._reject(fn, err, tag, tokens, x)
        if error is not None:
            main.wait_stream(side)
            self._reject(fn, error, tag, tokens, x)
        try:
            normed = self.routed_path(latent, ids, weights, tokens=tokens, tag=tag, padding=padding)
        finally:
            main.wait_stream(side)
        return self.up(normed, shared)
