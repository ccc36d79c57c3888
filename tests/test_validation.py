"""Argument validation that needs no rank: integers and reals of any kind (Python, numpy, 0-dim
torch) are accepted where the kind is right, and everything else is a TypeError or ValueError
naming the call, the argument and the rule.

Before these checks (main at 6f889cd): `EpRouted.workspace_bytes` returned 23960.0 for a float
`max_tokens`, nan for NaN, a number for True and for inf."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from dep_ep.checks import check_eps, check_int, check_real, check_step_tokens, check_tokens
from dep_ep.ep import EpRouted


def workspace(**kw):
    args = dict(num_ranks=2, max_tokens=8, latent=256, topk=6)
    args.update(kw)
    num_ranks, max_tokens = args.pop("num_ranks"), args.pop("max_tokens")
    return EpRouted.workspace_bytes(num_ranks, max_tokens, **args)


@pytest.mark.parametrize("field", ["num_ranks", "max_tokens", "latent", "topk"])
@pytest.mark.parametrize("value", [8.0, math.nan, math.inf, True, "8", None])
def test_workspace_bytes_refuses_what_is_not_an_int(field, value):
    with pytest.raises(TypeError, match=f"EpRouted.workspace_bytes: {field}="):
        workspace(**{field: value})


@pytest.mark.parametrize("field", ["num_ranks", "max_tokens", "latent", "topk"])
def test_workspace_bytes_refuses_values_out_of_range(field):
    with pytest.raises(ValueError, match=f"EpRouted.workspace_bytes: {field}=0"):
        workspace(**{field: 0})
    with pytest.raises(ValueError, match="latent=100"):
        workspace(latent=100)  # not a multiple of 32


def test_workspace_bytes_takes_numpy_and_torch_integers():
    want = workspace()
    assert isinstance(want, int) and want > 0
    assert workspace(max_tokens=np.int64(8), latent=np.int32(256)) == want
    assert workspace(topk=torch.tensor(6)) == want


def test_check_int_and_tokens():
    assert check_int("f", "n", np.int64(3)) == 3 and type(check_int("f", "n", np.int64(3))) is int
    # A meta tensor has no value (before: int() raised RuntimeError, which a call's checks did
    # not refuse collectively, and the peers waited out timeout_s; a careless-user probe).
    meta = torch.tensor(3, device="meta")
    for bad in (3.0, True, np.float64(3.0), torch.tensor(3.0), torch.tensor([3]), "3", meta):
        with pytest.raises(TypeError, match="f: n="):
            check_int("f", "n", bad)
    assert check_tokens("f", np.int16(4), 8) == 4
    with pytest.raises(TypeError, match="tokens=4.0; expected an int"):
        check_tokens("f", 4.0, 8)
    with pytest.raises(ValueError, match="tokens=9 outside 1..8"):
        check_tokens("f", 9, 8)
    # A step's T is below 2^31 (routed runs a T above max_tokens in pieces, up to that).
    assert check_step_tokens("f", np.int64(2**31 - 1)) == 2**31 - 1
    for bad in (0, 2**31, 2**70):
        with pytest.raises(ValueError, match=f"tokens={bad}; expected .*2\\^31"):
            check_step_tokens("f", bad)
    with pytest.raises(ValueError, match="2\\^31"):
        check_tokens("f", 2**70, 8)


def test_check_eps_takes_reals():
    assert check_eps("f", np.float32(1e-5)) == pytest.approx(1e-5)
    assert check_eps("f", 1) == 1.0 and check_eps("f", torch.tensor(1e-6)) == pytest.approx(1e-6)
    meta = torch.tensor(1e-5, device="meta")
    for bad in (0.0, -1e-5, math.inf, math.nan, True, "1e-5", torch.tensor([1e-5]), meta):
        with pytest.raises((TypeError, ValueError), match="f: eps="):
            check_eps("f", bad)
    # Finite and > 0, but 0.0 or inf in fp32, where the norm adds it.
    for bad in (1e-46, 5e-324, 3.5e38, 1e300):
        with pytest.raises(ValueError, match="fp32"):
            check_eps("f", bad)
    assert check_eps("f", 2.0**-149) == 2.0**-149


@pytest.mark.parametrize("flush_denormal", [False, True])
def test_check_eps_plain_floats_as_their_fp32_rounding_rules(flush_denormal):
    """Python floats take check_eps' short path where their magnitude is a normal fp32 one: it
    accepts exactly the floats whose fp32 rounding is finite and > 0 (the rule the tensor round
    trip checks), at the range's ends, just past them (2^-150 rounds to 0, fp32's largest plus
    half its last step to inf), at subnormal magnitudes and at random ones, also where torch
    flushes denormals to 0 (where 2^-149 is refused)."""
    big = float(torch.finfo(torch.float32).max)
    ulp = 2.0 ** (127 - 23)
    seed = int(torch.randint(0, 2**31, ()).item())
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.rand(64, generator=gen, dtype=torch.float64) * 300 - 160
    values = [2.0**-149, 2.0**-150, 0.75 * 2.0**-149, 1e-46, 1e-40, 2.0**-126, 2.0**-127]
    values += [big, big + 0.49 * ulp, big + ulp] + [float(10.0**e) for e in exponents]
    if flush_denormal and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals (torch.set_flush_denormal returned False)")
    try:
        for value in values:
            rounded = float(torch.tensor(value, dtype=torch.float64).to(torch.float32))
            if 0 < rounded < math.inf:
                assert check_eps("f", value) == value, f"seed {seed}: {value!r} refused"
            else:
                with pytest.raises(ValueError, match="fp32"):
                    check_eps("f", value)
    finally:
        torch.set_flush_denormal(False)  # torch's default; it has no getter


def test_a_real_past_the_float_range_is_a_value_error():
    """An int or Fraction past the float range (2**1024): ValueError naming the argument, as
    the transport's collective refusal catches (before: OverflowError, which escaped it on
    that rank alone); the message shortens the value."""
    for value in (2**1024, -(2**1024), Fraction(10**400)):
        with pytest.raises(ValueError, match="f: eps=.{1,40} is outside the float range"):
            check_eps("f", value)
        with pytest.raises(ValueError, match="outside the float range"):
            check_real("f", "x", value)


def test_check_eps_traces_under_torch_compile():
    """check_eps of an int, a normal and a subnormal eps inside a fullgraph torch.compile (as
    routed_op's checks run when a model is compiled): it returns the caller's value (before,
    its tensor round trip for ints and subnormals failed the compile)."""

    def scaled(x, eps):
        return x * check_eps("f", eps)

    compiled = torch.compile(scaled, fullgraph=True, backend="eager")
    x = torch.ones(2)
    for eps in (1e-6, 1, 1e-40):
        assert torch.equal(compiled(x, eps), scaled(x, eps)), eps


def test_same_owner_takes_equal_integers_of_any_kind_and_equal_values_of_one_type():
    """abort_stale_step's owner match: an owner given as int at the dispatch and np.int64 at
    the hook (or the reverse) is one owner (before: compared by type too, the hook did nothing
    and the peers waited out timeout_s in the combine); bools, floats and values of other types
    are not integers of the same value."""
    from dep_ep.ep.routed import same_owner

    assert same_owner(3, np.int64(3)) and same_owner(np.int32(3), 3)
    assert same_owner("hook", "".join(["ho", "ok"])) and same_owner((1, "a"), (1, "a"))
    assert not same_owner(3, np.int64(4)) and not same_owner(3, "3")
    assert not same_owner(1, True) and not same_owner(3, 3.0) and not same_owner(3, (3,))
    owner = object()
    assert same_owner(owner, owner) and not same_owner(owner, object())
