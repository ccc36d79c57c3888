"""A Triton kernel's PTX for SM90, compiled here with no GPU (Triton's CUDA backend compiles for a
target it is given): the tests that read what a kernel does from its code use it."""

from __future__ import annotations

SM90 = 90


def sm90_ptx(kernel, signature: dict, constants: dict) -> str:
    """`kernel`'s PTX for SM90: `signature` types every runtime parameter ("*i64", "i32", ...),
    `constants` every constexpr one (AssertionError naming a parameter given neither)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = [p.name for p in kernel.params]
    missing = [n for n in params if n not in signature and n not in constants]
    assert not missing, f"{kernel.fn.__name__}: no type for {missing}"
    full = {n: signature.get(n, "constexpr") for n in params}
    source = ASTSource(fn=kernel, signature=full, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", SM90, 32))
    return compiled.asm["ptx"]
