"""EpMoeLayer: one Kimi K3 MoE layer of one DEP rank: the router, the latent projections and the
shared experts around the routed path (EpRouted). Formula: docs/formats.md ("The block's forward
order"); schedule and memory: docs/layer.md."""

from __future__ import annotations

import hashlib
import math
from typing import Mapping

import torch

from dep_ep.checks import (
    check_eps,
    check_int,
    check_layer_index,
    check_padding,
    check_real,
    check_step_tokens,
    check_tag,
    vector_rows,
    vector_start,
)
from dep_ep.comm.errors import EpError
from dep_ep.comm.tags import mix64
from dep_ep.config import DEFAULT_NORM_EPS, DEFAULT_ROUTED_SCALING_FACTOR
from dep_ep.constants import (
    GIVEN_DIGEST_BITS,
    GIVEN_TAG_BASE,
    LAYER_FINGERPRINT_BITS,
    LAYER_INDEX_BITS,
    LAYER_STEP_BITS,
    LAYER_TAG_BASE,
)
from dep_ep.ep.digest import byte_digest
from dep_ep.ep.expert_sources import ExpertSources
from dep_ep.ep.routed import (
    COMPLETED_NOTE,
    NOT_SENT_NOTE,
    EpRouted,
    check_experts_match,
    note_recovery,
    step_total,
)
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


def layer_tag(index: int, fingerprint: int, step: int) -> int:
    """The tag of an EpMoeLayer's call given no tag=: its layer index, the fingerprint of its
    dense weights (`dense_fingerprint`) and its own call count (modulo 2^LAYER_STEP_BITS), so
    that layers called in other orders, or built in other orders, on different ranks raise
    EpDesyncError everywhere."""
    step %= 1 << LAYER_STEP_BITS
    high = (step << LAYER_FINGERPRINT_BITS) + fingerprint
    return LAYER_TAG_BASE + (high << LAYER_INDEX_BITS) + index


def given_layer_tag(index: int, fingerprint: int, tag: int) -> int:
    """The tag an EpMoeLayer's call given tag=`tag` sends: its layer index in clear and a
    GIVEN_DIGEST_BITS-bit digest of the given tag and the fingerprint of its dense weights, so
    that one tag given to two layers (tag=step for every layer) sends a different tag from each
    and ranks calling different layers raise EpDesyncError everywhere, as untagged calls do.
    Two different tags given to one layer send the same tag by a 2^-GIVEN_DIGEST_BITS chance
    (2^-44); `tag` is an int in checks.TAG_MIN..TAG_MAX."""
    digest = mix64(mix64(tag) ^ fingerprint) & ((1 << GIVEN_DIGEST_BITS) - 1)
    return GIVEN_TAG_BASE + (digest << LAYER_INDEX_BITS) + index


def dense_fingerprint(dense: Mapping[str, torch.Tensor]) -> int:
    """A LAYER_FINGERPRINT_BITS-bit digest of one layer's dense tensors (DENSE_NAMES): their
    names, shapes and dtypes and every byte of each, in element order (a strided view and a
    contiguous copy of the same values agree). The bytes are read by `byte_digest` on their
    device, whose row sums are folded there with odd position weights into one int64 a tensor
    (a change of any one 4-byte word changes it: an odd weight times a nonzero difference is not
    0 mod 2^64); those int64 and the descriptions are hashed (blake2b) on the host. Every DEP
    rank holds the same dense weights of a model layer, so the digest is the same on every rank
    for the same layer, and a rank whose weights differ in any element (a `refresh()` missing
    there after a load) gives another one except by a 2^-24 chance. At a layer's first call and
    in its refresh(), nothing on later calls: one pass over the dense bytes (380 MB at K3: 0.4 s
    on an idle 2-core x86 host, 1.1-1.3 s with other processes on it; 2.0 ms on one H200) and
    one device-to-host copy of 8 int64."""
    described, folded = [], []
    for name in DENSE_NAMES:
        t = dense[name]
        described.append(f"{name}:{tuple(t.shape)}:{t.dtype}")
        if t.numel() == 0:
            continue
        rows = byte_digest(t)
        position = torch.arange(rows.numel(), dtype=torch.int64, device=rows.device) * 2 + 1
        folded.append((rows * position).sum().reshape(1))
    digest = hashlib.blake2b(";".join(described).encode(), digest_size=8)
    if folded:
        digest.update(torch.cat(folded).cpu().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") & ((1 << LAYER_FINGERPRINT_BITS) - 1)


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage view `t` is (views share their root's storage), or `t`."""
    return t._base if t._base is not None else t


def _covered_by(root: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    """True when `root` is the whole of its storage (contiguous, at offset 0, every byte its
    own) and `parts` (it, or views of it: a merged gate_up parameter's halves, or a checkpoint
    reader's tensor viewing a byte buffer of its own size) lie back to back over all of its
    bytes, contiguous, in order: re-pointing them leaves no byte of the old storage in use."""
    storage_bytes = root.untyped_storage().nbytes()
    if not root.is_contiguous() or root.storage_offset() != 0:
        return False
    if root.numel() * root.element_size() != storage_bytes:
        return False
    at = 0
    for p in parts:
        if not p.is_contiguous() or p.storage_offset() * p.element_size() != at:
            return False
        at += p.numel() * p.element_size()
    return at == storage_bytes


def _sole_holders(root: torch.Tensor, views: list[torch.Tensor]) -> bool:
    """True when `root` and `views` (of it) are the only tensors holding root's storage, so that
    re-pointing them leaves nothing writing into the old storage: no alias elsewhere (a
    state_dict() entry, `.data`, `.detach()` of a parameter, another view the caller kept).
    False where torch does not say (its storage use count is a private call)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    holders = {id(t) for t in [root, *views]}
    # + 1: the storage object this call makes to ask.
    return use_count(root.untyped_storage()._cdata) == len(holders) + 1


def _adopt(tensors: list[torch.Tensor], packed: torch.Tensor, first_byte: int) -> bool:
    """Re-point the caller's tensors (a root that `_covered_by` its parts, and the parts given
    to the layer), whose bytes `packed`'s storage already holds from byte `first_byte` on, at
    the same bytes there: later in-place writes to them (copy_, .data.copy_, load_state_dict,
    a collective receiving into them) land in `packed`, and their old storage is freed with its
    last reference. False where torch refuses one (an inference tensor outside inference mode):
    every one is then left as it was."""
    targets = []
    for t in tensors:
        byte = first_byte + t.storage_offset() * t.element_size()
        if byte % t.element_size():
            return False
        targets.append((t, byte // t.element_size()))
    done: list[tuple[torch.Tensor, torch.UntypedStorage, int]] = []
    try:
        with torch.no_grad():
            for t, offset in targets:
                storage, before = t.untyped_storage(), t.storage_offset()
                if t.is_cuda:  # the old block is not reused before the packing copy ran
                    t.record_stream(torch.cuda.current_stream(t.device))
                t.set_(packed.untyped_storage(), offset, t.shape, t.stride())
                done.append((t, storage, before))
    except Exception:
        with torch.no_grad():
            for t, storage, before in done:
                t.set_(storage, before, t.shape, t.stride())
        return False
    return True


class _Copied:
    """Where a tensor the layer copied came from, for `EpMoeLayer.refresh`: the root tensor of
    the caller's view (held: the view object may be a temporary, and the storage is another
    tensor's too, or the layer would have re-pointed it), the view's offset from the root's,
    shape and strides, and the root's storage, offset, shape and strides when copied."""

    def __init__(self, name: str, t: torch.Tensor):
        self.name, self.root = name, _root(t)  # the object: a later set_ on it is seen
        root = self.root
        self.offset = t.storage_offset() - root.storage_offset()
        self.shape, self.stride = t.shape, t.stride()
        self.where = self._where(root)

    @staticmethod
    def _where(root: torch.Tensor) -> tuple:
        return (root.untyped_storage().data_ptr(), root.storage_offset(), root.shape, root.stride())

    def read(self) -> torch.Tensor:
        """The caller's view as it is now; RuntimeError when its root was moved to other memory
        or reshaped (`set_`, `.data =`, another layer re-pointing it): the layer cannot find it."""
        root = self.root
        if self._where(root) != self.where:
            raise RuntimeError(
                f"EpMoeLayer.refresh: the tensor {self.name} was copied from has been moved to"
                " other memory since the layer was built; build a new layer"
            )
        start = root.storage_offset() + self.offset
        return torch.as_strided(root.detach(), self.shape, self.stride, start)


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
    read at the layer's first call) tells layers apart across ranks. Two layers with equal dense
    tensors (tied weights) share a fingerprint: give them layer_index=. A call given tag=
    sends the layer index and a digest of the tag and the fingerprint (`given_layer_tag`) in
    place of the tag, so one tag given to every layer of a step pairs no two layers either.
    EpRouted.reset() restarts the counts. Under CUDA-graph replay the tag is the one the graph
    was captured with: ranks that capture the same graphs in the same order agree.

    Memory: the shared gate and up projections and the latent down projection are copied once,
    at construction, into one packed weight `packed` bf16 [2S + L, H] (rows: shared gate, shared
    up, latent down; one GEMM computes all three), and `dense` holds views of it under their
    names. When the three already are consecutive slices of one storage in that order (as
    another EpMoeLayer's `dense` is, or a model's parameters that a layer re-pointed), they are
    used in place, without a copy. Otherwise each tensor that is the whole of its storage (a
    model's parameter), or that the given projections viewing it cover whole in packing order
    (a merged gate_up parameter; a checkpoint reader's byte buffer), is re-pointed at its rows
    of `packed`, with the given views (values unchanged; `set_` under no_grad), when no other
    tensor holds its storage: the layer keeps no second copy, and later in-place writes to them
    land in the layer. The rest (aliases such as state_dict() entries, `.data`, `.detach()`;
    slices of a larger tensor; inference tensors; a norm weight that is not contiguous or not
    on a 16-byte boundary) is copied and listed in `copied`. The other five tensors are used as
    given.

    Weights after construction (a server builds its modules, then loads the checkpoint into
    them; a weight update in place): seen without anything more when written in place into the
    tensors given or their storage (copy_, .data.copy_, load_state_dict, a collective receiving
    into them), and into what the layer copied (`copied`) before its first call, which copies
    those again; after it, `refresh()` does. The routed experts' weights are read once into the
    backend's own copy when it is built (`copies_weights`; HopperExperts' triton engine reads
    contiguous tensors in place): given as a backend, when it was built; given as tensors (an
    ExpertWeights or the tuple), at construction, and the layer watches them (weak references
    and a byte digest, ep/expert_sources.py): its first call, on every rank, and every
    `refresh()` refuse tensors written since (RuntimeError naming them; after a refusing
    refresh() every call refuses) instead of computing with the old copy; tensors replaced
    rather than written are not seen (docs/layer.md). Build the layer after loading the experts'
    weights. The fingerprint the layer's tags carry is read at its first call (so: after
    loading), and again by `refresh()`; after weights change once the layer has been called,
    call `refresh()` on every rank so that their fingerprints stay equal. Not seen at all
    (docs/layer.md lists them): tensors replaced instead of written (load_state_dict(...,
    assign=True), `.data =`, `set_`, `module.to()`), weights computed from others
    (parametrizations), writes through memory torch does not count (a NumPy array under
    torch.from_numpy): build a new layer.

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
            # Watched from before the backend copies them (ep/expert_sources.py): a backend with
            # its own copy never sees later writes, so the first call and refresh() refuse them.
            sources = ExpertSources(experts)
            experts = default_experts(experts)
            self._expert_sources = sources if experts.copies_weights else None
        else:
            self._expert_sources = None
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
        given = dense
        S, L = self.shared_intermediate, self.latent
        names = (SHARED_GATE, SHARED_UP, DOWN)
        rows_of = dict(zip(names, (slice(0, S), slice(S, 2 * S), slice(2 * S, 2 * S + L))))
        # The caller's projections by the root they view, in packing order, and whether each
        # root may be re-pointed (decided before the layer makes aliases of its own): the
        # consecutive projections viewing it cover it whole and nothing else holds its storage.
        groups: list[tuple[torch.Tensor, list[str]]] = []
        for name in names:
            root = _root(given[name])
            if groups and groups[-1][0] is root:
                groups[-1][1].append(name)
            else:
                groups.append((root, [name]))
        movable = [
            _covered_by(root, [given[n] for n in members])
            and _sole_holders(root, [given[n] for n in members])
            for root, members in groups
        ]
        # Inference only: a model's nn.Parameters are taken without their autograd (the layer's
        # GEMMs write into given outputs, which autograd refuses for tensors that need grad).
        dense = {
            name: dense[name].detach() if dense[name].requires_grad else dense[name]
            for name in DENSE_NAMES
        }
        parts = [dense[name] for name in names]
        packed = _packed_in_place(parts, self.hidden)
        # The projections the layer holds copies of, by name, and where they came from.
        self._copied: dict[str, _Copied] = {}
        if packed is None:
            packed = torch.empty(2 * S + L, self.hidden, dtype=torch.bfloat16, device=self.device)
            for name in names:
                packed[rows_of[name]].copy_(dense[name])
            for (root, members), may_move in zip(groups, movable):
                views = [given[n] for n in members if given[n] is not root]
                first = packed[rows_of[members[0]]]
                first_byte = first.storage_offset() * first.element_size()
                if not (may_move and _adopt([root, *views], packed, first_byte)):
                    self._copied.update({n: _Copied(n, given[n]) for n in members})
        # bf16 [2S + L, H]: rows [shared gate (S); shared up (S); latent down (L)].
        self.packed = packed
        self.dense = {name: dense[name] for name in DENSE_NAMES}
        self.dense.update({name: packed[rows_of[name]] for name in names})
        self.gate_weight, self.bias = self.dense[GATE], self.dense[BIAS]
        # EpRouted takes a contiguous norm weight starting on a 16-byte boundary (no copy when it
        # is one already; a tensor read from a memory-mapped checkpoint may start elsewhere).
        norm = self.dense[NORM]
        if not (norm.is_contiguous() and vector_start(norm)):
            norm = norm.clone(memory_format=torch.contiguous_format)
        self.norm_weight, self.up_weight = norm, self.dense[UP]
        if self.norm_weight.data_ptr() != dense[NORM].data_ptr():
            self._copied[NORM] = _Copied(NORM, given[NORM])
        self.shared_down = self.dense[SHARED_DOWN]
        # The side stream of the overlapped schedule (CUDA only); one per layer.
        self._side = None
        if self.device.type == "cuda" and schedule == "overlap":
            self._side = torch.cuda.Stream(device=self.device)
        # The same on every rank for this model layer: it goes into every tag the layer sends.
        # Made at the first call (after the server loaded its weights), or refresh().
        self.fingerprint: int | None = None
        self._read_once = False  # the first call (or refresh) read the copied sources again
        # A call found the expert tensors unchanged (refresh() finding them changed clears it).
        self._experts_checked = self._expert_sources is None
        self.layer_index = routed.register_layer(self, layer_index)
        self._calls = 0  # calls so far: the tag of the next call given no tag=
        self._stepped = False  # the call's routed step returned (_note_own_work)

    @property
    def copied(self) -> tuple[str, ...]:
        """The dense tensors the layer holds copies of (names): writes into the caller's tensors
        reach these only through `refresh()`. Empty when the caller's tensors were re-pointed or
        read in place."""
        return tuple(self._copied)

    def refresh(self) -> None:
        """Local (no collective); call it on every rank after changing the weights in a way the
        layer does not see (class docstring, "Weights after construction"): copy the caller's
        tensors the layer holds copies of (`copied`) into those copies, read through the tensors
        their views were taken of, and recompute the fingerprint its tags carry (one
        device-to-host copy). RuntimeError inside a CUDA graph capture, naming a tensor whose
        source was moved to other memory since construction, or naming the expert tensors
        written since the layer built its experts backend from them (`_stale_experts`; nothing
        is copied then)."""
        if self._capturing():
            raise RuntimeError(
                "EpMoeLayer.refresh: called inside a CUDA graph capture; call it before capturing"
            )
        stale = self._stale_experts("EpMoeLayer.refresh")
        if stale is not None:
            self._experts_checked = False  # every later call refuses too, on every rank
            raise stale
        self._copy_sources()
        self.fingerprint = dense_fingerprint(self.dense)
        self._read_once = True

    def _read_sources_once(self) -> None:
        """At the layer's first use of its weights (the first call, or the first front() of a
        layer run by its parts, which reads the packed weight before routed_path's call),
        outside a CUDA graph capture: copy again what the layer copied, so that a load between
        construction and serving reaches it."""
        if not self._read_once and self._copied and not self._capturing():
            self._copy_sources()
            self._read_once = True

    def _stale_experts(self, fn: str) -> RuntimeError | None:
        """The error when the expert tensors the layer built its experts backend from were
        written since (the backend computes with its own copy of them as they were), else
        None. One device-to-host read a tensor; not inside a CUDA graph capture."""
        if self._expert_sources is None:
            return None
        changed = self._expert_sources.changed()
        if not changed:
            return None
        return RuntimeError(
            f"{fn}: the experts' tensors {changed} were written since the layer built its experts"
            f" backend ({type(self.experts).__name__}) from them at construction; the backend"
            " computes with its own copy of the weights as they were then. Build the layer after"
            " the experts' weights are loaded"
        )

    def _capturing(self) -> bool:
        """True inside a CUDA graph capture on the current stream (nothing may be read to the
        host or copied from the caller's tensors there)."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _copy_sources(self) -> None:
        """Copy the caller's tensors the layer holds copies of into those copies (every source
        read first: a refused one changes nothing)."""
        sources = {name: copied.read() for name, copied in self._copied.items()}
        for name, source in sources.items():
            target = self.norm_weight if name == NORM else self.dense[name]
            target.copy_(source)

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
        projections and the latent (2S..2S+L-1), one BF16 GEMM with fp32 sums. The layer's first
        use of its weights (this, for a layer run by its parts) copies again what it copied
        (`_read_sources_once`)."""
        self._read_sources_once()
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
        """bf16 [n, L]: EpRouted.routed with this layer's experts, norm weight and eps, as
        forward runs it: one call of the layer, tagged as forward tags its calls (tag None: the
        layer's own, with its call count; an int: sent with the layer's index and fingerprint,
        `given_layer_tag`) and counted with them; padding: as EpRouted.dispatch. Collective.
        On CUDA capturable once the layer has been called (its first call reads the
        fingerprint)."""
        fn = "EpMoeLayer.routed_path"
        return self._call(fn, tag, self._routed_path_body, latent, ids, weights, tokens, padding)

    def _routed_path_body(self, fn, wire, unready, latent, ids, weights, tokens, padding):
        """routed_path inside its `_call`."""
        if unready is not None:
            self._reject(fn, unready, wire, tokens, latent)
        return self._routed_step(latent, ids, weights, tokens, wire, padding)

    def _routed_step(self, latent, ids, weights, tokens, tag, padding) -> torch.Tensor:
        """EpRouted.routed with this layer's experts, norm weight and eps, under `tag` (the one
        the layer sends: `_call`'s); `_stepped` once it returned (every piece of it done on
        every rank)."""
        normed = self.routed.routed(
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
        self._stepped = True
        return normed

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
        the same on every rank (None: n; n = 0 needs tokens >= 1); tag: an int per step (as
        EpRouted.dispatch; sent with the layer's index and fingerprint, `given_layer_tag`) or
        None (the layer's own, `layer_tag`); padding (bool [>= n], True: the row selects no
        expert; an engine's persistent mask): as EpRouted.dispatch. Collective over routed's
        group. On CUDA stream-ordered (no host sync unless the EpRouted reads values,
        `check_values`, and at the first call, which reads the fingerprint) and capturable in a
        CUDA graph when the experts backend is."""
        fn = "EpMoeLayer.forward"
        return self._call(fn, tag, self._forward_body, x, tokens, padding)

    def _forward_body(self, fn, wire, unready, x, tokens, padding):
        """forward inside its `_call`."""
        error = unready or self._check_call(fn, x, tokens, padding)
        if error is not None:
            self._reject(fn, error, wire, tokens, x)
        if self._side is None:
            return self._forward_serial(fn, x, tokens, wire, padding)
        return self._forward_overlap(fn, x, tokens, wire, padding)

    def _call(self, fn: str, tag: object, body, *args):
        """One call of the layer (forward, routed_path): `body(fn, wire, unready, *args)`, given
        the tag it sends (None for a bad `tag`, which the rank then rejects) and the error that
        makes this rank reject the step (or None); the call is counted on the way out.

        The first call (every rank makes it) copies again what the layer copied, so weights
        loaded between construction and serving reach it, and reads the fingerprint (every tag
        the layer sends carries it); neither can run inside a CUDA graph capture. The call
        counts once it reached the EpRouted's transport on this thread (as its peers' calls
        do): an exception before that (a KeyboardInterrupt in this rank's own work, a call
        refused because another thread is inside one) leaves the count where the peers' is,
        and the next call pairs with theirs. A reset() during the call (a signal
        handler's) restarted the count on every rank: it stays at 0, and the call's routed calls
        publish nothing in the new epoch (the EpRouted's barriers compare with the start of
        this call, taken before its count and tag: `ObjectBarriers.call.began`), so it raises
        EpResetDuringCallError and the peers' retry pairs with this rank's next call (on GPU,
        after a reset between a routed call's last check and its launch: EpDesyncError, and a
        reset() on every rank first: `Transport.launched_after_reset`).

        No context manager: the call is counted (`_count_call`) and the start restored (a
        plain store, CallStart) in this frame's own `finally` blocks, so an interrupt anywhere
        in the call leaves neither a stale start nor a late count behind. In a generator-based
        context manager's `finally`, which waits for contextlib's `__exit__` (Python code, where
        a handler runs) to resume it, an interrupt there kept the start while the exception
        lived (found by a review) and left the count to be stored when the exception was
        dropped, over the counts of the calls made meanwhile."""
        barriers = self.routed._buffers.barriers
        began = barriers.call.began
        # Plain reads and stores (CallStart): no handler runs between them and the try.
        start = (barriers.epoch, barriers.reset_round)
        calls, self._stepped = self._calls, False
        barriers.call.began = start
        entered = None
        try:
            entered = self.routed._entered_here()
            wire, unready = self._call_wire(fn, tag, calls)
            try:
                return body(fn, wire, unready, *args)
            finally:
                self._count_call(calls, entered, start)
        except BaseException as err:
            self._note_own_work(fn, err, entered, calls, start)
            raise
        finally:
            barriers.call.began = began

    def _call_wire(
        self, fn: str, tag: object, calls: int
    ) -> tuple[int | None, BaseException | None]:
        """`_call`'s first call reads (the copied weights, the fingerprint, the experts' digest)
        and the tag it sends for call number `calls`: (the tag, None for a bad `tag`; the error
        that makes this rank reject the step, or None)."""
        unready = None
        first = not self._read_once and bool(self._copied)
        read_fingerprint = self.fingerprint is None
        check_experts = not self._experts_checked
        if first or read_fingerprint or check_experts:
            if self._capturing():
                unready = RuntimeError(
                    f"{fn}: the layer's first call is inside a CUDA graph capture, where it"
                    " reads the weights it copied, their fingerprint and (given expert tensors)"
                    " the experts' digest; call the layer once before capturing (refresh() is"
                    " enough for a layer given an experts backend)"
                )
            else:
                try:
                    self._read_sources_once()
                    if read_fingerprint:
                        self.fingerprint = dense_fingerprint(self.dense)
                    if check_experts:
                        unready = self._stale_experts(fn)
                        self._experts_checked = unready is None
                except BaseException as err:  # the step still fails on every rank
                    unready = err
        wire = None
        try:
            if tag is None:
                wire = layer_tag(self.layer_index, self.fingerprint or 0, calls)
            else:
                wire = given_layer_tag(self.layer_index, self.fingerprint or 0, check_tag(fn, tag))
        except ValueError as err:  # a bad tag: the rank sends none (its peers need not see it)
            unready = unready or err
        return wire, unready

    def _count_call(self, calls: int, entered: int, start: tuple[int, int]) -> None:
        """The call's count, in `_call`'s own `finally`: `calls` + 1 when the call reached the
        transport (the thread's transport entries moved from `entered`) and no reset() ran
        since `start` (one before it restarted the count this call read; one after it abandoned
        the call, whose barriers refused). A plain call, not a generator's `finally`: an
        interrupt as a generator-based context manager's `__exit__` began left that `finally`
        to run when the exception was dropped, calls later, where it stored this count over
        theirs and the layer's next untagged call desynced (tests/test_recovery_mpi.py, "as
        the call ends")."""
        barriers = self.routed._buffers.barriers
        moved = self.routed._entered_here() != entered
        # No call between this read and the store below, where a handler's reset() could run
        # after the read and restart the count this store would then undo.
        if moved and (barriers.epoch, barriers.reset_round) == start:
            self._calls = calls + 1

    def _note_own_work(
        self, fn: str, err: BaseException, entered: int | None, calls: int, start: tuple[int, int]
    ) -> None:
        """A note on `err`, raised in this rank's own work of the call (an interrupt: the
        EpRouted's calls note theirs, its refusals and the protocol's errors say their
        recovery), saying what the next call pairs with: before the call reached the exchange
        (`entered`: the thread's transport entries at its start, None before it read them),
        this call again; after its routed step returned (`_stepped`), the peers' next call,
        the call counted (`calls`: the count at its start) (a careless-user probe: a bare
        KeyboardInterrupt from `up` after the exchange read as one before it, and a retry
        desynced the peers' next layer). None in between, nor while the EpRouted refuses calls
        or holds a dispatched step, nor after a reset() since the call's `start` (its epoch and
        reset round)."""
        routed, barriers = self.routed, self.routed._buffers.barriers
        if isinstance(err, EpError) or getattr(err, "__notes__", None) or routed.closed:
            return
        if routed._broken is not None or routed._lost is not None or routed.pending:
            return
        if (barriers.epoch, barriers.reset_round) != start:
            return
        if entered is None or routed._entered_here() == entered:
            note_recovery(err, f"{fn}: {NOT_SENT_NOTE}")
        elif self._stepped:
            # The routed step returned, so the call counts; `_count_call` counts it unless
            # the interrupt came there first (a careless-user probe: with no tag, this
            # rank's next call then carried its peers' previous count).
            self._calls = calls + 1
            note_recovery(err, f"{fn}: {COMPLETED_NOTE}")

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
        normed = self._routed_step(latent, ids, weights, tokens, tag, padding)
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
            normed = self._routed_step(latent, ids, weights, tokens, tag, padding)
        finally:
            main.wait_stream(side)
        return self.up(normed, shared)
