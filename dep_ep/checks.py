"""Argument validation for EpRouted and EpMoeLayer: every message names the call, the argument,
the value and what is allowed. Integers and reals of any kind are accepted where the kind is
right (Python, numpy and 0-dim torch numbers: `numbers.Integral`, `numbers.Real`); a bool is
never a number here."""

from __future__ import annotations

import math
import numbers
import struct

import torch

from dep_ep.constants import MAX_LAYER_INDEX, NO_TAG, STEP_TOKENS_BITS, VECTOR_BYTES

# The largest routing weight magnitude a value check accepts. The combine's output of a token is
# finite when the BF16 sum h = sum_k w_k o_k over its K <= MAX_TOPK = 2^7 expert outputs o_k is
# below BF16's largest finite value, about 2^128 (the overflow-safe norm then normalises any
# finite h: comm/reference.py rms_norm). With |w_k| <= 2^64 that holds for every expert output
# below 2^(128 - 64 - 7) = 2^57 (1.4e17) in magnitude, far beyond what experts give; weights of
# 5e37 overflow h already for outputs of order 10 (NaN rows). Router weights are at most the
# routed scaling factor (2.5 in DeepSeek-V3, 1 in Kimi K3).
WEIGHT_MAX = 2.0**64


def check_int(fn: str, name: str, value: object) -> int:
    """`value` as a Python int when it is an integer of any kind (not a bool), else TypeError."""
    if type(value) is int:  # per call: 0.06 us on an x86 host where the checks below took 0.8
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not (value.is_floating_point() or value.is_complex()):
            if value.dtype != torch.bool and value.device.type != "meta":  # meta: no value
                return int(value)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise TypeError(f"{fn}: {name}={value!r}; expected an int")


def check_real(fn: str, name: str, value: object) -> float:
    """`value` as a Python float when it is a real number of any kind (not a bool), else
    TypeError. Finiteness is the caller's rule."""
    if type(value) is float:
        return value
    real = False
    if isinstance(value, torch.Tensor):
        real = value.dim() == 0 and value.dtype != torch.bool and not value.is_complex()
        real = real and value.device.type != "meta"  # a meta tensor has no value
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        real = True
    if not real:
        raise TypeError(f"{fn}: {name}={value!r}; expected a real number")
    try:
        return float(value)
    except OverflowError:  # an int or Fraction past the float range: 2**1024
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise ValueError(f"{fn}: {name}={shown} is outside the float range") from None


def check_flag(fn: str, name: str, value: object) -> None:
    """TypeError naming `fn` and the option unless `value` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name}={value!r}; expected a bool")


def check_positive_int(fn: str, name: str, value: object, multiple_of: int = 1) -> int:
    """An int >= 1 (and a multiple of `multiple_of`), returned as a Python int."""
    n = check_int(fn, name, value)
    if n < 1 or n % multiple_of:
        rule = ">= 1" if multiple_of == 1 else f"a positive multiple of {multiple_of}"
        raise ValueError(f"{fn}: {name}={n}; expected {rule}")
    return n


def check_int_in(
    fn: str, name: str, value: object, low: int, high: int | None = None, expected: str = ""
) -> int:
    """`value` as a Python int in low..high (no upper bound when high is None), else ValueError
    (a value of the wrong kind too: for settings whose kind and range are one rule). The message
    says `expected`, by default "an int >= low" or "an int in low..high"."""
    try:
        n = check_int(fn, name, value)
    except TypeError:
        n = None
    if n is None or n < low or (high is not None and n > high):
        if not expected:
            expected = f"an int >= {low}" if high is None else f"an int in {low}..{high}"
        raise ValueError(f"{fn}: {name}={value!r}; expected {expected}")
    return n


def check_real_between(
    fn: str, name: str, value: object, low: float, high: float, expected: str
) -> float:
    """`value` as a Python float with low < value < high (NaN is outside), else ValueError (a
    value of the wrong kind too) whose message says `expected`."""
    try:
        x = check_real(fn, name, value)
    except TypeError:
        x = math.nan
    if not low < x < high:
        raise ValueError(f"{fn}: {name}={value!r}; expected {expected}")
    return x


def check_tensor(
    fn: str,
    name: str,
    t: object,
    dtypes: tuple[torch.dtype, ...],
    shape: tuple[int, ...],
    device: torch.device,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} is {type(t).__name__}; expected a torch.Tensor")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{fn}: {name} dtype {t.dtype}; expected {allowed}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{fn}: {name} shape {tuple(t.shape)}; expected {shape}")
    if t.device != device:
        raise ValueError(f"{fn}: {name} on {t.device}; expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous (row-major); call .contiguous()")
    return t


def vector_start(t: torch.Tensor) -> bool:
    """Whether t's first element lies on a 16-byte boundary (VECTOR_BYTES, the GPU kernels'
    vector loads). Every torch allocation does; a view at an odd offset may not."""
    return t.data_ptr() % VECTOR_BYTES == 0


def vector_rows(t: torch.Tensor) -> bool:
    """Whether the rows of the 2-D tensor t lie a multiple of 16 bytes apart (its row stride in
    bytes a multiple of VECTOR_BYTES): with `vector_start`, every row starts on a 16-byte
    boundary, the 16-byte row rule of `check_rows`."""
    return t.stride(0) * t.element_size() % VECTOR_BYTES == 0


def check_rows(
    fn: str, name: str, t: object, dtype: torch.dtype, shape: tuple[int, int], device
) -> torch.Tensor:
    """A 2-D tensor of `shape` whose rows are contiguous and start on 16-byte boundaries: a
    contiguous tensor, or a column slice of a wider one (a packed GEMM's output), row stride a
    multiple of 16 bytes. TypeError for the type or dtype, ValueError for the rest."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} is {type(t).__name__}; expected a torch.Tensor")
    if t.dtype != dtype:
        raise TypeError(f"{fn}: {name} dtype {t.dtype}; expected {dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{fn}: {name} shape {tuple(t.shape)}; expected {shape}")
    if t.device != device:
        raise ValueError(f"{fn}: {name} on {t.device}; expected {device}")
    rows, cols = shape
    if rows and cols > 1 and t.stride(1) != 1:
        raise ValueError(f"{fn}: {name}'s rows must be contiguous (stride(1) = {t.stride(1)})")
    if rows > 1:
        row_bytes = t.stride(0) * t.element_size()
        if t.stride(0) < cols or not vector_rows(t):
            raise ValueError(
                f"{fn}: {name}'s row stride is {t.stride(0)} elements ({row_bytes} bytes); expected"
                f" at least {cols} and a multiple of {VECTOR_BYTES} bytes (contiguous, or a column"
                " slice of a wider tensor)"
            )
    check_aligned(fn, name, t)
    return t


def check_aligned(fn: str, name: str, t: torch.Tensor) -> None:
    """A tensor the GPU kernels read in 16-byte vectors must start on a 16-byte boundary (every
    torch allocation does; a view at an odd offset may not)."""
    if t.numel() and not vector_start(t):
        raise ValueError(
            f"{fn}: {name} starts at an address that is not a multiple of {VECTOR_BYTES} bytes"
            f" (data_ptr() % {VECTOR_BYTES} = {t.data_ptr() % VECTOR_BYTES}); pass a tensor of"
            " its own (.clone())"
        )


# The largest T of a step (EpRouted.routed and EpMoeLayer run a T above max_tokens in pieces): T
# travels as an int32 and in the first piece's tag (constants.STEP_TOKENS_BITS); a larger one
# (2**70 say) would ask for ~1e20 pieces.
MAX_STEP_TOKENS = (1 << STEP_TOKENS_BITS) - 1


def check_step_tokens(fn: str, tokens: object) -> int:
    """A step's T as a Python int in 1..MAX_STEP_TOKENS: TypeError for what is not an int, else
    ValueError naming the bound."""
    t = check_int(fn, "tokens", tokens)
    if not 1 <= t <= MAX_STEP_TOKENS:
        raise ValueError(
            f"{fn}: tokens={t}; expected 1..{MAX_STEP_TOKENS} (a step's T is below 2^31; above"
            " max_tokens it runs in pieces)"
        )
    return t


def check_tokens(fn: str, tokens: object, max_tokens: int) -> int:
    """T as a Python int in 1..max_tokens: TypeError for what is not an int, else ValueError
    (naming 2^31 for a T at or past it, the bound of a step run in pieces)."""
    t = check_int(fn, "tokens", tokens)
    if t > max_tokens:
        check_step_tokens(fn, t)
    if not 1 <= t <= max_tokens:
        raise ValueError(f"{fn}: tokens={t} outside 1..{max_tokens} (max_tokens)")
    return t


# The norm adds eps in fp32 (the combine kernel's Float32 argument, comm/reference.py): an eps
# that rounds to 0.0 there (below 2^-149 by more than half of it) leaves 0 / sqrt(0) = NaN for an
# all-padding row, and one that rounds to inf (from 2^128 - 2^103 up) makes every row 0. Allowed:
# what rounds to fp32's positive finite range, EPS_MIN = 2^-149 (1.4e-45) to EPS_MAX (3.4e38).
EPS_MIN, EPS_MAX = 2.0**-149, float(torch.finfo(torch.float32).max)
EPS_NORMAL = float(torch.finfo(torch.float32).tiny)  # 2^-126, fp32's smallest normal
EPS_TO_INF = 2.0**128 - 2.0**103  # fp32's largest plus half its last step: rounds to inf


def check_eps(fn: str, eps: object) -> float:
    """A real whose fp32 rounding is finite and > 0 (the norm adds it in fp32), returned as a
    float (the caller's value, not its rounding)."""
    if type(eps) is float and EPS_NORMAL <= eps <= EPS_MAX:
        # A normal fp32 magnitude, so its rounding is finite and > 0 even where denormals are
        # flushed (torch.set_flush_denormal): 0.12 us a call on an x86 host, where a tensor
        # round trip took 11.
        return eps
    value = check_real(fn, "eps", eps)
    if torch.compiler.is_compiling():
        # Dynamo traces Python arithmetic, not struct or a tensor's value: fp32's rounding by
        # its bounds (ties to even: 2^-150 to 0, fp32's largest plus half its last step to inf;
        # denormals not flushed).
        rounded = 0.0 if value <= 2.0**-150 else math.inf if value >= EPS_TO_INF else value
    else:
        try:  # the hardware's rounding, denormal flushing included, without a tensor
            rounded = struct.unpack("f", struct.pack("f", value))[0]
        except OverflowError:  # rounds past fp32's largest
            rounded = math.inf
    if not (value > 0 and 0 < rounded < math.inf):
        raise ValueError(
            f"{fn}: eps={eps!r} (fp32: {rounded!r}); expected a real > 0 whose fp32 rounding is"
            f" finite and > 0: {EPS_MIN:.4g} (2^-149) to {EPS_MAX:.8g} (fp32's largest)"
        )
    return value


def check_layer_index(fn: str, index: object) -> int:
    """A model layer's number as a Python int in 0..MAX_LAYER_INDEX (the bits a layer's tags
    give it): TypeError for what is not an int, else ValueError."""
    value = check_int(fn, "layer_index", index)
    if not 0 <= value <= MAX_LAYER_INDEX:
        raise ValueError(f"{fn}: layer_index={value} outside 0..{MAX_LAYER_INDEX}")
    return value


# Tags are int64 words on the wire, where NO_TAG (-2**63) means "no tag".
TAG_MIN, TAG_MAX = NO_TAG + 1, 2**63 - 1


def check_tag(fn: str, tag: object) -> int | None:
    """None, or the tag as a Python int in TAG_MIN..TAG_MAX (ValueError otherwise)."""
    if tag is None:
        return None
    try:
        value = check_int(fn, "tag", tag)
    except TypeError:
        value = None
    if value is None or not TAG_MIN <= value <= TAG_MAX:
        raise ValueError(f"{fn}: tag={tag!r}; expected None or an int in {TAG_MIN}..{TAG_MAX}")
    return value


def check_padding(fn: str, padding: object, rows: int, device: torch.device) -> torch.Tensor:
    """A padding mask: bool [>= rows] on `device`, one element a row (True: a padding row; the
    elements past `rows` are not read), contiguous or strided. TypeError for the type or dtype,
    ValueError for the rest."""
    if not isinstance(padding, torch.Tensor):
        raise TypeError(f"{fn}: padding is {type(padding).__name__}; expected a torch.Tensor")
    if padding.dtype != torch.bool:
        raise TypeError(f"{fn}: padding dtype {padding.dtype}; expected torch.bool")
    if padding.dim() != 1 or padding.shape[0] < rows:
        raise ValueError(
            f"{fn}: padding shape {tuple(padding.shape)}; expected [m] with m >= {rows} (one"
            " element a row of the latent)"
        )
    if padding.device != device:
        raise ValueError(f"{fn}: padding on {padding.device}; expected {device}")
    return padding


def check_ids(fn: str, ids: torch.Tensor, num_experts: int) -> None:
    """Values in -1..num_experts-1 (reads the tensor: a host sync on GPU)."""
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < -1 or high >= num_experts:
        bad = low if low < -1 else high
        raise ValueError(f"{fn}: ids hold {bad}; allowed -1 (no expert) or 0..{num_experts - 1}")


def check_weights(fn: str, weights: torch.Tensor, ids: torch.Tensor) -> None:
    """Routing weights of real (id != -1) selections must be finite and at most WEIGHT_MAX in
    magnitude (reads the tensors: a host sync on GPU; EpRouted calls it only with
    EpConfig.check_values on). The bound keeps a token's sum finite for expert outputs below
    2^57 (WEIGHT_MAX's comment), not for any output."""
    bad = ~(weights.abs() <= WEIGHT_MAX) & (ids >= 0)
    if bool(bad.any()):
        token, k = (int(v) for v in bad.nonzero()[0])
        value, expert = float(weights[token, k]), int(ids[token, k])
        if not math.isfinite(value):
            raise ValueError(
                f"{fn}: weights[{token}, {k}]={value} is not finite for expert {expert}; routing"
                " weights must be finite"
            )
        raise ValueError(
            f"{fn}: weights[{token}, {k}]={value} for expert {expert} exceeds 2^64 in magnitude;"
            " with |w| <= 2^64 a token's sum of weight * expert output over its <= 128 experts"
            " stays finite for every expert output below 2^57 (dep_ep.checks.WEIGHT_MAX). This"
            " check runs only with the value checks on (EpConfig.check_values; off by default"
            " on CUDA)"
        )
