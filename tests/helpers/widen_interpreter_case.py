"""widen_scales_kernel (experts/hopper/kernels.py) in Triton's CPU interpreter against
comm/mxfp8.e8m0_to_fp32, bit for bit, in its own process:

    TRITON_INTERPRET=1 python -m helpers.widen_interpreter_case SEED   (from tests/)

Fresh random E8M0 bytes with every byte value present (0: subnormal 2^-127, 255: NaN), over a
count that is not a multiple of the kernel's block; the output starts as NaN. Prints "ok ..." or
raises naming the seed and the first differing bytes.
"""

from __future__ import annotations

import os
import sys

import torch

from dep_ep.comm.mxfp8 import e8m0_to_fp32


def main(seed: int) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    from dep_ep.experts.hopper.humming_engine import WIDEN_BLOCK
    from dep_ep.experts.hopper.kernels import widen_scales_kernel

    gen = torch.Generator().manual_seed(seed)
    sf = torch.randint(0, 256, (37, 112), dtype=torch.uint8, generator=gen)
    sf.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    out = torch.full(sf.shape, float("nan"))
    widen_scales_kernel[(-(-sf.numel() // WIDEN_BLOCK),)](sf, out, sf.numel(), WIDEN_BLOCK)
    got, want = out.view(torch.int32), e8m0_to_fp32(sf).view(torch.int32)
    bad = (got != want).nonzero()[:4].tolist()
    assert not bad, f"seed {seed}: bytes {[int(sf[r, c]) for r, c in bad]} at {bad}"
    print(f"ok seed {seed}: {sf.numel()} scales")


if __name__ == "__main__":
    main(int(sys.argv[1]))
