"""Exact-rounding PTX helpers for CuTeDSL kernels.

Each numerically relevant operation is one PTX instruction with an explicit rounding modifier
(`.rn`), which ptxas never contracts into an FMA: the kernels then round exactly as the torch
references do, bit for bit.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(result_type, args, text: str, constraints: str, *, loc=None, ip=None):
    return llvm.inline_asm(
        result_type,
        [a.ir_value(loc=loc, ip=ip) for a in args],
        text,
        constraints,
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(
        _asm(T.f32(), [Float32(a), Float32(b)], "mul.rn.f32 $0, $1, $2;", "=f,f,f", loc=loc, ip=ip)
    )


@dsl_user_op
def add_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(
        _asm(T.f32(), [Float32(a), Float32(b)], "add.rn.f32 $0, $1, $2;", "=f,f,f", loc=loc, ip=ip)
    )


@dsl_user_op
def div_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(
        _asm(T.f32(), [Float32(a), Float32(b)], "div.rn.f32 $0, $1, $2;", "=f,f,f", loc=loc, ip=ip)
    )


@dsl_user_op
def sqrt_rn(a: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [Float32(a)], "sqrt.rn.f32 $0, $1;", "=f,f", loc=loc, ip=ip))


@dsl_user_op
def f32_bits(a: Float32, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [Float32(a)], "mov.b32 $0, $1;", "=r,f", loc=loc, ip=ip))


@dsl_user_op
def bits_f32(a: Uint32, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [Uint32(a)], "mov.b32 $0, $1;", "=f,r", loc=loc, ip=ip))


@dsl_user_op
def bf16_round(a: Float32, *, loc=None, ip=None) -> Uint32:
    """fp32 -> bf16 bits (round to nearest even) in the low 16 bits of a u32."""
    text = "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; cvt.u32.u16 $0, h; }"
    return Uint32(_asm(T.i32(), [Float32(a)], text, "=r,f", loc=loc, ip=ip))


@dsl_user_op
def bf16x2_round(hi: Float32, lo: Float32, *, loc=None, ip=None) -> Uint32:
    """Two fp32 -> two bf16 (round to nearest even, as bf16_round each) in one u32: `lo` in bits
    0-15, `hi` in bits 16-31. One instruction for two values, and the pair is a packed word."""
    text = "cvt.rn.bf16x2.f32 $0, $1, $2;"
    return Uint32(_asm(T.i32(), [Float32(hi), Float32(lo)], text, "=r,f,f", loc=loc, ip=ip))


@dsl_user_op
def e4m3x2(hi: Float32, lo: Float32, *, loc=None, ip=None) -> Uint32:
    """Two fp32 -> two e4m3 bytes (nearest even, saturating to +-448, NaN -> 0x7F) in the low 16
    bits: `lo` in bits 0-7, `hi` in bits 8-15."""
    text = "{ .reg .b16 h; cvt.rn.satfinite.e4m3x2.f32 h, $1, $2; cvt.u32.u16 $0, h; }"
    return Uint32(_asm(T.i32(), [Float32(hi), Float32(lo)], text, "=r,f,f", loc=loc, ip=ip))


@dsl_user_op
def barrier_or(flag: Int32, *, loc=None, ip=None) -> Int32:
    """CTA barrier (barrier 0, every thread) that also ORs `flag` (non-zero) over the CTA: 1 on
    every thread when any thread passed a non-zero flag, else 0 (bar.red.or.pred)."""
    text = (
        "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; bar.red.or.pred q, 0, p; selp.s32 $0, 1, 0, q; }"
    )
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(flag).ir_value(loc=loc, ip=ip)],
            text,
            "=r,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def nanosleep(ns: Uint32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None,
        [Uint32(ns).ir_value(loc=loc, ip=ip)],
        "nanosleep.u32 $0;",
        "r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


__all__ = [
    "Int64",
    "add_rn",
    "barrier_or",
    "bf16_round",
    "bf16x2_round",
    "bits_f32",
    "div_rn",
    "e4m3x2",
    "f32_bits",
    "mul_rn",
    "nanosleep",
    "sqrt_rn",
]
