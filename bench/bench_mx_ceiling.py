"""The ceiling of exact MX scaling on Hopper's FP8 MMA: a kernel that does only the arithmetic of
an MXFP8 x MXFP4 GEMM's inner loop, its operands in shared memory (no global traffic in the
loop), timed against cuBLAS's dense FP8 GEMM.

    python -m bench.bench_mx_ceiling     # docs/results/bench_mx_ceiling.md

Hopper's wgmma takes no block scales, so exact MX scaling sums each 32-deep K block in an MMA
from zero and adds its partials, scaled by their block's scales, into fp32 accumulators: one
FFMA an output element a k32 block beside the MMA's 32 multiply-adds. Forms, each a warpgroup a
CTA, wgmma.m64nNk32 e4m3 x e4m3 -> fp32 with both operands in shared memory (K-major, no
swizzle, four k32 blocks cycled), `ctas` CTAs an SM:
- row / 128: four wgmma a group (128 of K), the first from zero and the others accumulating in
  the MMA, one wait, then acc += P * s once a group: the promotion a format with one scale per
  128 of K would need, the nearest to the MMA's own rate whose sums this kernel checks against
  float64 (the MMA's own accumulation of FP8 products keeps fewer bits than fp32, so no form
  accumulates all of K in it).
- row: `blocks` wgmma from zero a group into separate partials, one wait, then acc += P * s for
  each, s the row's block scale (two loads from shared memory a block): the promotion with the
  weights' scales folded into their FP8 values (what humming does), one FFMA an element.
- row x column: the same with s = row scale * column scale (a column's scale loaded per block):
  the promotion with neither operand's scales folded, FMUL + FFMA an element.
TFLOP/s counts 2 * 64 * N * 32 a wgmma; beside it the dense FP8 rate of torch._scaled_mm (e4m3
8192^3) and BF16 (torch.mm 8192^3) measured in the same run. Graph replay of --reps launches,
median of --samples replays.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.memory import SmemAllocator

from bench import cli, report
from bench.bench_experts import bf16_tflops, fp8_tflops
from bench.timing import capture, replay_us
from dep_ep.comm.kernels.launcher import compile_kernel
from dep_ep.comm.kernels.tensors import gmem_tensor, row_major_layout
from dep_ep.experts.hopper.narrow_gemm import (
    CORE_GROUP_BYTES,
    f32_asm,
    fence_proxy_async_shared,
    smem_desc,
)

KBLOCK_BYTES = 32  # one k32 block of e4m3 a row
SLOTS = 4  # k32 blocks of A and B in shared memory, cycled
ROWS = 64  # the wgmma's M
WARPGROUP_THREADS = 128
ITERS = 4096  # k32 blocks a warpgroup
REPS, SAMPLES = 5, 10
# Each thread's sum against float64 (positive terms): the MMA's own accumulation of FP8
# products is narrower than fp32, so the bound is loose; a form that skipped work or misread a
# scale (powers of two from 2^-4 to 2^3: a wrong one is off by 2x or more) is off by far more.
CHECK_TOLERANCE = 1e-2
# (form, N, blocks a wait, CTAs an SM)
FORMS = [
    ("row / 128", 128, 4, 1),
    ("row / 128", 128, 4, 2),
    ("row / 128", 128, 4, 3),
    ("row", 128, 1, 1),
    ("row", 128, 1, 2),
    ("row", 128, 1, 3),
    ("row", 128, 2, 1),
    ("row", 128, 2, 2),
    ("row", 64, 4, 2),
    ("row", 64, 4, 3),
    ("row x column", 128, 1, 2),
    ("row x column", 128, 1, 3),
]


@dataclass(frozen=True)
class Form:
    """A form of the module's docstring: its name, N, wgmma a wait (`blocks`: SLOTS for
    "row / 128"), CTAs an SM."""

    name: str
    n: int
    blocks: int
    ctas: int


@dsl_user_op
def wgmma_group(descs, n: int, chained: bool, *, loc=None, ip=None):
    """One wgmma.m64nNk32 per (A, B) descriptor pair in `descs`, issued together, committed and
    waited for once. chained: the first from zero, the others accumulating into its N / 2 fp32
    partials (returned); else each from zero into its own (returned block by block)."""
    regs = n // 2
    outs = regs if chained else regs * len(descs)
    mmas = []
    for b in range(len(descs)):
        first = 0 if chained else regs * b
        d = ", ".join(f"${first + i}" for i in range(regs))
        accumulate = 1 if chained and b > 0 else 0
        mmas.append(
            f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{d}}},"
            f" ${outs + 2 * b}, ${outs + 2 * b + 1}, {accumulate}, 1, 1;"
        )
    text = (
        "wgmma.fence.sync.aligned; " + " ".join(mmas) + " wgmma.commit_group.sync.aligned;"
        " wgmma.wait_group.sync.aligned 0;"
    )
    args = []
    for da, db in descs:
        args += [Int64(da).ir_value(loc=loc, ip=ip), Int64(db).ir_value(loc=loc, ip=ip)]
    constraints = ",".join(["=f"] * outs + ["l"] * (2 * len(descs)))
    return f32_asm(args, text, constraints, True, loc, ip, count=outs)


# A k32 block of an operand's rows in shared memory: each 8-row group's two core matrices (8
# rows x 16 bytes) along K, 128 bytes apart (LBO), the groups 256 bytes apart (SBO).
BLOCK_LEADING_BYTES = CORE_GROUP_BYTES
BLOCK_STRIDE_BYTES = 2 * CORE_GROUP_BYTES


class CeilingKernel:
    """One warpgroup a CTA, sms * form.ctas CTAs; each runs `iters` k32 blocks of `form`."""

    def __init__(self, form: Form, sms: int):
        self.form, self.ctas = form, sms * form.ctas
        self.regs = form.n // 2
        self.a_bytes, self.b_bytes = ROWS * KBLOCK_BYTES, form.n * KBLOCK_BYTES
        self.words = SLOTS * (self.a_bytes + self.b_bytes) // 4
        self.scales = SLOTS * (ROWS + form.n)

    @cute.jit
    def __call__(self, src: Int64, scales: Int64, out: Int64, iters: Int32, stream: cuda.CUstream):
        """src int32 [words] (the operands' bytes), scales fp32 [SLOTS, 64 + N], out fp32
        [CTAs * 128] (each thread's accumulator sum)."""
        mSrc = gmem_tensor(Uint32, src, cute.make_layout(self.words))
        mScales = gmem_tensor(Float32, scales, cute.make_layout(self.scales))
        threads = self.ctas * WARPGROUP_THREADS
        mOut = gmem_tensor(Float32, out, cute.make_layout(threads), align=4)
        self.kernel(mSrc, mScales, mOut, iters).launch(
            grid=[self.ctas, 1, 1], block=[WARPGROUP_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mSrc: cute.Tensor, mScales: cute.Tensor, mOut: cute.Tensor, iters: Int32):
        form, regs = self.form, self.regs
        chained = form.name == "row / 128"
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        g, t = (tidx % 32) // 4, tidx % 4
        row = (tidx // 32) * 16 + g
        smem = SmemAllocator()
        sOps = smem.allocate_tensor(Uint32, cute.make_layout(self.words), byte_alignment=128)
        sScales = smem.allocate_tensor(
            Float32, row_major_layout((SLOTS, ROWS + form.n)), byte_alignment=16
        )
        for i in cutlass.range(tidx, self.words, WARPGROUP_THREADS):
            sOps[i] = mSrc[i]
        for i in cutlass.range(tidx, self.scales, WARPGROUP_THREADS):
            sScales[i // (ROWS + form.n), i % (ROWS + form.n)] = mScales[i]
        fence_proxy_async_shared()
        cute.arch.sync_threads()
        base = sOps.iterator.toint()
        a_desc = smem_desc(base, BLOCK_LEADING_BYTES, BLOCK_STRIDE_BYTES)
        b_desc = smem_desc(base + SLOTS * self.a_bytes, BLOCK_LEADING_BYTES, BLOCK_STRIDE_BYTES)
        acc = cute.make_rmem_tensor(cute.make_layout(regs), Float32)
        acc.fill(0.0)
        for i in cutlass.range(iters // form.blocks):
            descs = []
            for b in cutlass.range_constexpr(form.blocks):
                slot = Int64((i * form.blocks + b) % SLOTS)
                descs.append(
                    (
                        a_desc + slot * (self.a_bytes >> 4),
                        b_desc + slot * (self.b_bytes >> 4),
                    )
                )
            d = wgmma_group(descs, form.n, chained)
            # the partials' sets: one a group (chained, scaled by its first block's slot's row
            # scales), else one a block
            for b in cutlass.range_constexpr(1 if chained else form.blocks):
                slot = (i * form.blocks + b) % SLOTS
                s0, s8 = sScales[slot, row], sScales[slot, row + 8]
                for e in cutlass.range_constexpr(regs):
                    s = s8 if (e // 2) % 2 else s0
                    if cutlass.const_expr(form.name == "row x column"):
                        s = s * sScales[slot, ROWS + 8 * (e // 4) + 2 * t + e % 2]
                    acc[e] = acc[e] + d[regs * b + e] * s
        total = Float32(0.0)
        for e in cutlass.range_constexpr(regs):
            total = total + acc[e]
        mOut[bx * WARPGROUP_THREADS + tidx] = total


def build(form: Form, sms: int, arch: str | None = None, keep_ptx_dir: str | None = None):
    """CeilingKernel(form, sms) compiled for `arch` (None: this process's GPU)."""
    z = Int64(0)
    kernel = CeilingKernel(form, sms)
    return compile_kernel(lambda: (kernel, (z, z, z, Int32(1))), arch, keep_ptx_dir)


def operand(src: torch.Tensor, first: int, rows: int) -> torch.Tensor:
    """float64 [rows, 32]: the k32 block of `rows` rows at byte `first` of the operands' bytes
    (`src` int32 words), laid out as the descriptors read it: byte (m, k) at
    256 (m // 8) + 128 (k // 16) + 16 (m % 8) + k % 16."""
    data = src.view(torch.uint8)[first : first + rows * KBLOCK_BYTES]
    m = torch.arange(rows, device=src.device)[:, None]
    k = torch.arange(KBLOCK_BYTES, device=src.device)[None, :]
    at = 256 * (m // 8) + 128 * (k // 16) + 16 * (m % 8) + k % 16
    return data[at].view(torch.float8_e4m3fn).double()


def expected_sums(form: Form, src: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [128]: each thread's accumulator sum after ITERS blocks (block j on slot
    j % SLOTS). The accumulators hold, summed over the slots, ITERS / SLOTS times
    (r * A) @ (c * B)^T: r the rows' scales of the block's slot ("row", "row x column") or of its
    group's first block's slot ("row / 128": slot 0, as blocks == SLOTS), c the columns' scales
    ("row x column") or ones. Thread 32 w + 4 g + t holds rows 16 w + g and 16 w + g + 8 and
    columns 8 j + 2 t and 8 j + 2 t + 1 (the wgmma's accumulator fragment)."""
    a_bytes, b_bytes = ROWS * KBLOCK_BYTES, form.n * KBLOCK_BYTES
    table = scales.double().view(SLOTS, ROWS + form.n)
    product = torch.zeros(ROWS, form.n, dtype=torch.float64, device=src.device)
    for slot in range(SLOTS):
        a = operand(src, slot * a_bytes, ROWS)
        b = operand(src, SLOTS * a_bytes + slot * b_bytes, form.n)
        a = a * table[0 if form.name == "row / 128" else slot, :ROWS, None]
        if form.name == "row x column":
            b = b * table[slot, ROWS:, None]
        product += (a @ b.T) * (ITERS // SLOTS)
    thread = torch.arange(WARPGROUP_THREADS, device=src.device)
    warp, g, t = thread // 32, (thread % 32) // 4, thread % 4
    rows = torch.stack((16 * warp + g, 16 * warp + g + 8), dim=1)  # [128, 2]
    j = torch.arange(form.n // 8, device=src.device)
    cols = torch.cat((8 * j + 2 * t[:, None], 8 * j + 2 * t[:, None] + 1), dim=1)  # [128, N/4]
    return product[rows[:, :, None], cols[:, None, :]].sum(dim=(1, 2))


def measure(form: Form, gen: torch.Generator, timing: tuple[int, int]) -> float:
    """TFLOP/s of `form` in graph replay (timing: launches a graph, timed replays), after
    checking every thread's sum against `expected_sums` (RuntimeError when one differs: the
    kernel did not compute the form)."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    compiled = build(form, sms)
    words = SLOTS * (ROWS + form.n) * KBLOCK_BYTES // 4
    # positive e4m3 bytes below 2 (exponent fields <= 7: no NaN; no cancellation in the sums)
    src = torch.randint(-(1 << 31), 1 << 31, (words,), device="cuda", generator=gen)
    src = (src & 0x3F3F3F3F).to(torch.int32)
    exponents = torch.randint(-4, 4, (SLOTS * (ROWS + form.n),), device="cuda", generator=gen)
    scales = torch.pow(2.0, exponents.float())
    ctas = sms * form.ctas
    out = torch.full((ctas * WARPGROUP_THREADS,), float("nan"), device="cuda")

    def launch():
        # the stream current at the call: a capture's own stream while the graph is captured
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        compiled(src.data_ptr(), scales.data_ptr(), out.data_ptr(), ITERS, stream)

    launch()
    torch.cuda.synchronize()
    want = expected_sums(form, src, scales)
    got = out.double().view(ctas, WARPGROUP_THREADS)
    error = float(((got - want) / want).abs().max())  # nan (a thread not written) fails too
    if not error < CHECK_TOLERANCE:
        raise RuntimeError(f"{form}: a thread's sum off by {error:.1e} relative")
    reps, samples = timing
    us = replay_us(capture(launch, reps), reps, samples)
    flops = ctas * ITERS * 2 * ROWS * form.n * KBLOCK_BYTES
    return flops / (us * 1e-6) / 1e12


def main() -> int:
    timing = (REPS, SAMPLES)
    args = cli.parser(__doc__, page="bench_mx_ceiling.md", timing=timing).parse_args()
    timing = (args.reps, args.samples)
    gen = torch.Generator(device="cuda").manual_seed(0)
    page = report.Page(
        args.out / "bench_mx_ceiling.md",
        "Exact MX scaling's ceiling on the FP8 MMA",
        report.summary(__doc__),
        report.Run.this_process(),
    )
    fp8 = fp8_tflops()
    bf16_rate = bf16_tflops()
    page.text(
        f"Dense FP8 (torch._scaled_mm e4m3 8192^3): {fp8:.0f} TFLOP/s; dense BF16 (torch.mm"
        f" 8192^3): {bf16_rate:.0f} TFLOP/s; the same run."
    )
    rows, failed = [], 0
    for name, n, blocks, ctas in FORMS:
        form = Form(name, n, blocks, ctas)
        try:
            rate = measure(form, gen, timing)
            cells = [f"{rate:.0f}", f"{100 * rate / fp8:.0f}%"]
        except Exception as error:  # a form that fails is on the page, and the run fails
            cells = [f"failed ({type(error).__name__}: {str(error)[:80]})", "-"]
            failed += 1
        rows.append([name, n, blocks, ctas, *cells])
        print(rows[-1], flush=True)
    page.section("Forms")
    page.table(["form", "N", "wgmma a wait", "CTAs an SM", "TFLOP/s", "% of dense FP8"], rows)
    page.write()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
