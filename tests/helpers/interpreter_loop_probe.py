"""Whether Triton's CPU interpreter runs a loop bounded by a kernel argument, in its own process:

    TRITON_INTERPRET=1 python -m helpers.interpreter_loop_probe   (from tests/)

Triton 3.6's interpreter takes such a bound with int() of a one-element NumPy array, which NumPy
2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars", triton-lang/triton
issue 9171; Triton 3.9 squeezes the array first). Prints "ok" when the loop runs, else exits 1
with the error.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def count_kernel(out_ptr, bound):
    total = 0
    for _ in range(0, bound, 1):
        total += 1
    tl.store(out_ptr, total)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    out = torch.zeros(1, dtype=torch.int32)
    count_kernel[(1,)](out, 3)
    assert int(out) == 3, int(out)
    print("ok")


if __name__ == "__main__":
    main()
