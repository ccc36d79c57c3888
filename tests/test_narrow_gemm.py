"""The narrow GEMM (experts/hopper/narrow_gemm.py): its weight layout and E2M1 -> e4m3 expansion
on CPU, its PTX for sm_90a, and on an SM90 GPU the kernel against the float64 reference on fresh
random data, outputs poisoned with NaN."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import re

import pytest
import torch

from dep_ep.experts.hopper.grouping import group_pairs
from dep_ep.experts.hopper.humming_gemm import FUSED_SCALE_SPREAD
from dep_ep.experts.hopper.humming_layout import prepared_tensors, prepared_weights
from dep_ep.experts.hopper.narrow_layout import (
    E2M1_TO_E4M3_EXPONENT,
    NARROW_MAX_SCALE_BYTE,
    NARROW_PAIRS,
    NARROW_TILE_PAIRS,
    e4m3_bytes_to_float,
    e4m3_from_high,
    e4m3_from_low,
    narrow_dequantize,
    narrow_gemm_reference,
    narrow_weights,
)
from dep_ep.experts.mxfp4 import E2M1_VALUES, mxfp4_dequantize

HAVE_CUTLASS = importlib.util.find_spec("cutlass") is not None


def fresh_generator() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))


def random_weights(num: int, n: int, k: int, gen: torch.Generator, device="cpu", spread: int = 24):
    """Codes and scale bytes 110 .. 110 + spread (humming's prepared weights hold a spread of at
    most FUSED_SCALE_SPREAD)."""
    w = torch.randint(0, 256, (num, n, k // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(110, 111 + spread, (num, n, k // 32), dtype=torch.uint8, generator=gen)
    return w.to(device), s.to(device)


@pytest.mark.parametrize("nibble", range(16))
def test_expansion_is_the_code_times_2_to_the_minus_6(nibble):
    word = torch.tensor([nibble * 0x11111111])
    expected = torch.full((1, 4), E2M1_VALUES[nibble] * 2.0**-E2M1_TO_E4M3_EXPONENT).double()
    for expand in (e4m3_from_low, e4m3_from_high):
        got = e4m3_bytes_to_float(expand(word))
        assert torch.equal(got, expected) and torch.equal(got.signbit(), expected.signbit())


def test_expansion_takes_each_nibble_of_its_byte_only():
    gen = fresh_generator()
    words = torch.randint(0, 2**32, (256,), dtype=torch.int64, generator=gen)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64) * 2.0**-E2M1_TO_E4M3_EXPONENT
    shifts = torch.arange(0, 32, 8)
    low = table[(words.unsqueeze(-1) >> shifts) & 0xF]
    high = table[(words.unsqueeze(-1) >> (shifts + 4)) & 0xF]
    assert torch.equal(e4m3_bytes_to_float(e4m3_from_low(words)), low)
    assert torch.equal(e4m3_bytes_to_float(e4m3_from_high(words)), high)


@pytest.mark.parametrize("shape", [(1, 16, 128), (3, 32, 256), (2, 48, 384)])
def test_layout_reads_back_the_checkpoint_values(shape):
    gen = fresh_generator()
    w, s = random_weights(*shape, gen)
    words, scales = narrow_weights(w, s)
    num, n, k = shape
    assert words.shape == (num, n // 16, k // 128, 32, 8) and words.dtype == torch.int32
    assert scales.shape == (num, n // 16, k // 128, 8, 2) and scales.dtype == torch.int32
    assert torch.equal(narrow_dequantize(words, scales), mxfp4_dequantize(w, s, torch.float64))


def test_layout_refuses_what_it_cannot_hold():
    gen = fresh_generator()
    w, s = random_weights(2, 32, 256, gen)
    with pytest.raises(ValueError, match="N % 16 == 0, K % 128 == 0"):
        narrow_weights(w[:, :24], s[:, :24])
    with pytest.raises(ValueError, match="N % 16 == 0, K % 128 == 0"):
        narrow_weights(w[:, :, :32], s[:, :, :2])
    s[1, 3, 5] = NARROW_MAX_SCALE_BYTE + 1
    with pytest.raises(ValueError, match=r"local experts \[1\]"):
        narrow_weights(w, s)


def test_reference_is_the_dequantized_product():
    gen = fresh_generator()
    w, s = random_weights(3, 16, 128, gen)
    x = (torch.randn(5, 128, generator=gen) * 4).to(torch.float8_e4m3fn)
    xs = torch.pow(2.0, torch.randint(-3, 4, (5, 4), generator=gen).float())
    rows = torch.tensor([4, 0, 2, 2], dtype=torch.int32)
    experts = torch.tensor([0, 2, 2, 1])
    got = narrow_gemm_reference(w, s, x, xs, rows, experts)
    xd = (x.double().view(5, 4, 32) * xs.double().unsqueeze(-1)).view(5, 128)
    for j in range(4):
        weights = mxfp4_dequantize(w[experts[j]], s[experts[j]], torch.float64)
        assert torch.equal(got[j], weights @ xd[rows[j]])


def fc1_ptx(tuning, folder) -> str:
    """The sm_90a PTX of the kernel at K3's FC1 (N = 6144, K = 3584, indexed) under `tuning`,
    compiled on CPU into `folder` (emptied of it again)."""
    from cutlass import Int32, Int64

    from dep_ep.comm.kernels.launcher import compile_kernel
    from dep_ep.experts.hopper.narrow_gemm import NarrowGemmKernel

    z = Int64(0)
    compile_kernel(
        lambda: (NarrowGemmKernel(6144, 3584, True, tuning), (z,) * 11 + (Int32(1),) * 4),
        "sm_90a",
        str(folder),
    )
    (ptx,) = folder.glob("*.ptx")
    text = ptx.read_text()
    ptx.unlink()
    return text


@pytest.mark.skipif(not HAVE_CUTLASS, reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")
def test_kernel_compiles_for_sm90a_to_its_mmas_and_vector_loads(tmp_path):
    from dep_ep.experts.hopper.narrow_gemm import NarrowTuning

    def ptx_of(tuning: NarrowTuning) -> str:
        return fc1_ptx(tuning, tmp_path)

    text = ptx_of(NarrowTuning(wgmma=False, stages=0))
    assert "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32" in text
    # The weights: two 16-byte loads a lane per 128 of K (unrolled twice), never byte loads.
    assert text.count("ld.global.v4.b32") >= 4
    assert "ld.global.u8" not in text and "ld.global.b8" not in text
    assert "cp.async.bulk" not in text
    text = ptx_of(NarrowTuning(stages=0))
    # The warpgroup form: a chunk's four MMAs from zero (scale-d 0) on registers and
    # descriptors, committed and waited for once; its rows' stores made visible to the async
    # proxy before the CTA barrier.
    mma = "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3"
    assert text.count(mma) == 4 * text.count("wgmma.commit_group.sync.aligned") > 0
    assert ", 0, 1, 1;" in text and "mma.sync" not in text
    assert text.index("fence.proxy.async.shared::cta") < text.index("bar.sync")
    text = ptx_of(NarrowTuning())
    # The default ring: the weights and scales by bulk copies completing on mbarriers, which
    # the warps wait on; no global vector load of the weights is left.
    copy = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
    assert text.count(copy) >= 4 and "mbarrier.try_wait.parity" in text
    assert "mbarrier.init.shared" in text and "mbarrier.arrive.expect_tx" in text
    assert text.count(mma) == 4 * text.count("wgmma.commit_group.sync.aligned") > 0
    for pairs in NARROW_TILE_PAIRS[1:]:
        # Wider tiles: the chunk's four MMAs are m64nPk32, into P / 2 partials each.
        text = ptx_of(NarrowTuning(pairs=pairs))
        wide = f"wgmma.mma_async.sync.aligned.m64n{pairs}k32.f32.e4m3.e4m3"
        assert text.count(wide) == 4 * text.count("wgmma.commit_group.sync.aligned") > 0
        assert mma not in text
        outputs = text[text.index(wide) :].split("{")[1].split("}")[0]
        assert outputs.count(",") + 1 == pairs // 2, outputs
    # humming's prepared words: per k32 block two words a lane (one 8-byte load, from global
    # memory or the warpgroup's ring) expanded by four byte permutes, beside one MMA; the ring
    # filled by bulk copies and refilled after the warpgroup's named barrier of 128 threads.
    for stages in (0, 2):
        text = ptx_of(NarrowTuning(weights="humming", stages=stages))
        mmas = text.count(mma)
        assert text.count("prmt.b32") == 4 * mmas > 0
        assert text.count(mma) == 4 * text.count("wgmma.commit_group.sync.aligned")
        assert text.count("ld.shared.v2.b32" if stages else "ld.global.v2.b32") == mmas
        # The tile's rows staged by 16-byte cp.async with a register source size (0 past the
        # tile's rows), waited for before the async proxy's fence, before the CTA barrier.
        assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;", text)
        fence = text.index("fence.proxy.async.shared::cta")
        barrier = re.search(r"bar\.sync\s+0;", text)
        assert barrier and text.index("cp.async.wait_all") < fence < barrier.start()
        if stages:
            assert text.count(copy) >= 16 and "ld.global.v2" not in text
            # The ring's block addresses at N = 6144, K = 3584: an expert's words 11,010,048
            # bytes on (K/32 x 4N words) and its scales 688,128 (K/32 x N), a k32 group's
            # words 16 N = 98,304 bytes on.
            for stride in (11010048, 688128, 98304):
                assert re.search(rf"\b{stride}\b", text), stride
            assert re.search(r"bar\.sync\s+%r\d+, 128;", text)
        else:
            assert copy not in text
    # `ahead` with stages of 4 chunks at K3's FC1 (7 whole stages): in the loop's body each
    # chunk's MMAs issued without a wait; the first three chunks' waited for (group 1) after
    # the next one's issue, the last (group 0) before the stage's barrier; no wgmma.fence
    # between an issue and its wait but the next chunk's own.
    text = ptx_of(NarrowTuning(weights="humming", stage_chunks=4, ahead=True))
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d);", text)
    assert waits == ["1", "1", "1", "0"], waits
    assert text.count("wgmma.commit_group.sync.aligned") == 4
    body = text[text.index("wgmma.fence.sync.aligned") :]
    assert body.index("wait_group.sync.aligned 1") > body.index("wgmma.fence.sync.aligned", 1)
    assert (
        body.index("wait_group.sync.aligned 0")
        < re.search(r"bar\.sync\s+%r\d+, 128;", body).start()
    )
    # stage_scales: the lane pairs' activation scales read from shared memory (one 16-byte
    # load each a chunk, four lane pairs at P = 16), none from global memory.
    text = ptx_of(NarrowTuning(weights="humming", pairs=16, stage_scales=True))
    assert "ld.global.v4" not in text and text.count("ld.shared.v4.b32") >= 4
    assert "ld.global.v4" in ptx_of(NarrowTuning(weights="humming", pairs=16))
    # Tiles of 24 (48 copies a row's blocks do not divide the 256 threads): the row looked up
    # in the staging loop.
    assert "cp.async.cg.shared.global" in ptx_of(NarrowTuning(weights="humming", pairs=24))
    for pairs in NARROW_TILE_PAIRS:
        # The four blocks' descriptors of the staged rows, in 16-byte units: SBO (8-row groups,
        # 128 bytes) at bit 32, LBO (core columns along K, 16 P bytes) at bit 16, each block 2 P
        # units on; with LBO and SBO swapped or a block's step wrong, the constants differ.
        text = ptx_of(NarrowTuning(pairs=pairs))
        for block in range(4):
            constant = (8 << 32) + (pairs << 16) + 2 * pairs * block
            assert re.search(rf"add\.s64\s+%rd\d+, %rd\d+, {constant};", text), (pairs, block)


@pytest.mark.skipif(not HAVE_CUTLASS, reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")
@pytest.mark.parametrize("pairs", NARROW_TILE_PAIRS)
def test_specialized_form_compiles_to_shared_operand_mmas_on_mbarriers(tmp_path, pairs):
    """The specialized form's PTX at K3's FC1: each chunk's four wgmma.m64nPk32 take both
    operands from shared-memory descriptors (no A registers), committed and waited for once;
    the expanding warpgroup's stores fenced for the async proxy before it arrives on the slot's
    mbarrier; the ring refilled after its warpgroup's barrier (128 threads), the consumers'
    sums added after theirs (256 threads with two consumers); no byte permute among the
    consumers' MMAs (the expansion is the expander's)."""
    from dep_ep.experts.hopper.narrow_gemm import NarrowTuning

    tuning = NarrowTuning(weights="humming", warps=12, pairs=pairs, expanded_slots=4)
    text = fc1_ptx(tuning, tmp_path)
    mma = rf"wgmma\.mma_async\.sync\.aligned\.m64n{pairs}k32\.f32\.e4m3\.e4m3 \{{[^}}]*\}}"
    shared = re.findall(rf"{mma}, %rd\d+, %rd\d+, 0, 1, 1;", text)
    assert len(shared) == 4 == len(re.findall(mma, text)), len(shared)
    assert text.count("wgmma.commit_group.sync.aligned") == 1
    assert text.count("wgmma.wait_group.sync.aligned 0;") == 1
    # One CTA barrier (the mbarriers' initialisation), before any wait; then, for each of a
    # ring stage's two chunks (unrolled), the expander's fence and its arrive on the slot's
    # `full` mbarrier; the consumers' staging of the rows, its fence and their own barrier
    # (256 threads, not the expanders': they do not wait for the staging), before their first
    # wait on `full`; the consumer's arrive on `empty` after its MMAs' wait.
    fences = [m.start() for m in re.finditer(r"fence\.proxy\.async\.shared::cta", text)]
    arrives = [m.start() for m in re.finditer(r"mbarrier\.arrive\.shared\.b64", text)]
    assert len(fences) == 3 == len(arrives), (fences, arrives)
    (cta,) = [m.start() for m in re.finditer(r"bar\.sync\s+0;", text)]
    assert cta < text.index("mbarrier.try_wait") < fences[0] < arrives[0] < fences[1] < arrives[1]
    staged = [m.start() for m in re.finditer(r"bar\.sync\s+2, 256;", text)]
    assert len(staged) == 2, staged  # the staging's, and the sums' at the end
    assert text.index("cp.async.wait_all") < fences[2] < staged[0]
    assert staged[0] < text.index("mbarrier.try_wait", staged[0]) < arrives[2]
    assert arrives[2] > text.index("wgmma.wait_group.sync.aligned 0;")
    assert re.search(r"bar\.sync\s+1, 128;", text)
    consumer = text[text.index("wgmma.fence.sync.aligned") :]
    assert "prmt.b32" not in consumer[: consumer.index("wgmma.wait_group")]
    # copy_warp: the ring's barrier counts the copy warp's 32 threads beside the expanders' 128.
    text = fc1_ptx(dataclasses.replace(tuning, copy_warp=True), tmp_path)
    assert re.search(r"bar\.sync\s+1, 160;", text) and not re.search(r"bar\.sync\s+1, 128;", text)
    # Two expanders: the ring's barrier counts both warpgroups (256 threads), the consumers'
    # theirs (warps 8-15); each expander takes chunk c of a stage where c % 2 is its group, so
    # the unrolled stage still holds two expansions, each behind its own group test.
    two = dataclasses.replace(tuning, warps=16, expanded_slots=2, expanders=2)
    text = fc1_ptx(two, tmp_path)
    assert re.search(r"bar\.sync\s+1, 256;", text) and re.search(r"bar\.sync\s+2, 256;", text)
    assert not re.search(r"bar\.sync\s+1, 128;", text)
    assert text.count("fence.proxy.async.shared::cta") == 3
    # register_a: the four MMAs take A from registers, loaded by four 16-byte shared loads
    # before the consumer releases the slot, and that before its MMAs; the expanders store 16
    # bytes a k32 block (four a chunk, two chunks a ring stage) with no async-proxy fence (the
    # staging's alone).
    base = fc1_ptx(dataclasses.replace(tuning, expanded_slots=2), tmp_path)
    text = fc1_ptx(dataclasses.replace(tuning, expanded_slots=2, register_a=True), tmp_path)
    registers = re.findall(rf"{mma}, \{{%r\d+, %r\d+, %r\d+, %r\d+\}}, %rd\d+, 0, 1, 1;", text)
    assert len(registers) == 4 == len(re.findall(mma, text)), len(registers)
    assert text.count("fence.proxy.async.shared::cta") == 1
    assert text.count("st.shared.v4.b32") == base.count("st.shared.v4.b32") + 2 * 4
    assert text.count("ld.shared.v4.b32") == base.count("ld.shared.v4.b32") + 4
    consumer = text[text.rindex("mbarrier.try_wait") :]
    release = consumer.index("mbarrier.arrive.shared.b64")
    assert consumer[:release].count("ld.shared.v4.b32") == 4
    assert release < consumer.index("wgmma.fence")


@pytest.mark.skipif(not HAVE_CUTLASS, reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")
def test_expanded_weights_are_where_the_a_descriptor_points():
    """wgmma reads A through its descriptor as the K-major layout without swizzle: element (m,
    k) of k32 block s at byte 2048 s + (k // 16) * LBO + (m // 8) * SBO + (m % 8) * 16 + k % 16
    (EXPANDED_LBO, EXPANDED_SBO). The expanding thread (warp w, lane 4g + t) stores its A words
    a[4 s + 2 h + r] (row 16 w + g + 8 r, k 16 h + 4 t + j: the register form's A) at [e, s, h, 2
    w + r, g, t] of the expanded chunks' row-major tensor of EXPANDED_SHAPE. Every byte of a
    chunk is written once and lands where the descriptor reads its (m, k)."""
    from dep_ep.experts.hopper.narrow_gemm import (
        EXPANDED_BLOCK_BYTES,
        EXPANDED_CHUNK_BYTES,
        EXPANDED_LBO,
        EXPANDED_SBO,
        EXPANDED_SHAPE,
    )

    strides = [4]
    for size in reversed(EXPANDED_SHAPE[1:]):
        strides.insert(0, strides[0] * size)
    assert strides[0] * EXPANDED_SHAPE[0] == EXPANDED_CHUNK_BYTES
    seen = set()
    for w, g, t, s, h, r, j in itertools.product(
        range(4), range(8), range(4), range(4), range(2), range(2), range(4)
    ):
        stored = sum(i * stride for i, stride in zip((s, h, 2 * w + r, g, t), strides)) + j
        m, k = 16 * w + g + 8 * r, 16 * h + 4 * t + j
        read = (
            EXPANDED_BLOCK_BYTES * s
            + (k // 16) * EXPANDED_LBO
            + (m // 8) * EXPANDED_SBO
            + (m % 8) * 16
            + k % 16
        )
        assert stored == read, (w, g, t, s, h, r, j)
        seen.add(stored)
    assert seen == set(range(EXPANDED_CHUNK_BYTES))


@pytest.mark.skipif(not HAVE_CUTLASS, reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")
@pytest.mark.parametrize("pairs", NARROW_TILE_PAIRS)
def test_staged_rows_are_where_the_descriptor_points(pairs):
    """The wgmma reads B through the descriptor as CuTe's K-major INTERLEAVE layout ((8, P/8),
    (16 bytes, 2)) : ((16 bytes, SBO), (1, LBO)) from each k32 block's start: byte (n % 8) * 16 +
    (n // 8) * SBO + half * LBO for row n and 16-byte half of the block. stage_rows writes word
    0 of core column c of row n at [c, n, 0] of its row-major tensor of `staged_rows_shape`.
    Both must name the same byte for every row and core column."""
    from dep_ep.experts.hopper.narrow_gemm import (
        CORE_ROW_BYTES,
        staged_row_offset,
        staged_rows_shape,
        staged_rows_strides,
    )

    leading, stride, block = staged_rows_strides(pairs)
    columns, rows, words = staged_rows_shape(224, pairs)  # K = 224: 7 k32 blocks
    assert rows == pairs and columns == 14
    for n in range(pairs):
        for c in range(columns):
            written = (c * rows + n) * words * 4  # row-major word offset, in bytes
            b, half = divmod(c, 2)
            read = b * block + (n % 8) * CORE_ROW_BYTES + (n // 8) * stride + half * leading
            assert written == read, (pairs, n, c)
            # The humming form's cp.async destination.
            assert staged_row_offset(c, n, pairs) == read, (pairs, n, c)


@pytest.mark.skipif(not HAVE_CUTLASS, reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")
def test_humming_lane_pairs_hold_the_lanes_a_registers():
    """humming_lane_pairs against humming_layout.prepared_index: for every warp of a
    warpgroup, lane 4g + t and k32 group, word 2 wp + r of the group's 64-row block holds row
    16 warp + g + 8 r at k 4t + j (magnitude nibble j) and 16 + 4t + j (nibble 4 + j), wgmma's
    A registers from registers; scale byte 2 sp + r of the block holds that row's s'."""
    from dep_ep.experts.hopper.humming_layout import prepared_index
    from dep_ep.experts.hopper.narrow_gemm import HUMMING_BLOCK_WORDS, humming_lane_pairs

    rows, k = 128, 64
    index = prepared_index(rows, k)
    for block in range(rows // 64):
        for group in range(k // 32):
            words_at = group * 4 * rows + block * HUMMING_BLOCK_WORDS
            scales_at = group * rows + block * 64
            for warp in range(4):
                for g in range(8):
                    for t in range(4):
                        word_pair, scale_pair = humming_lane_pairs(warp, g, t)
                        for r in range(2):
                            row = 64 * block + 16 * warp + g + 8 * r
                            for half in range(2):
                                for j in range(4):
                                    kk = 32 * group + 16 * half + 4 * t + j
                                    word = int(index["word"][row, kk])
                                    assert word == words_at + 2 * word_pair + r, (row, kk)
                                    assert int(index["magnitude"][row, kk]) == 4 * half + j
                            scale = int(index["scale"][row, group])
                            assert scale == scales_at + 2 * scale_pair + r, (row, group)


@pytest.mark.skipif(not HAVE_CUTLASS, reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")
def test_launch_refuses_arguments_it_was_not_compiled_for():
    """Every check runs before the launch, so it shows on CPU tensors: tiles of another size, a
    shape or dtype the kernel would read at other strides, a pair_row shorter than out, more
    tile slots than the grid's second axis takes, and (last) tensors off a CUDA device; and at
    construction N, K, a warpgroup split, a ring without chunks and one over the shared memory."""
    from dep_ep.experts.hopper.narrow_gemm import (
        MAX_TILE_SLOTS,
        SMEM_LIMIT,
        TUNING_FIELD_TYPES,
        NarrowGemmLaunch,
        NarrowTuning,
        smem_bytes,
    )

    gen = fresh_generator()
    n, k, rows, topk = 128, 256, 3, 4
    w, s = random_weights(2, n, k, gen)
    words, scales = narrow_weights(w, s)
    ids = torch.randint(0, 8, (rows, topk), dtype=torch.int32, generator=gen)
    groups = group_pairs(ids, 0, 2, NARROW_PAIRS)
    x = torch.zeros(rows, k, dtype=torch.uint8)
    xs = torch.ones(rows, k // 32)
    out = torch.zeros(rows * topk, n, dtype=torch.bfloat16)
    launch = NarrowGemmLaunch(n, k, True, arch="sm_90a")
    good = (words, scales, x, xs, groups.pair_row, groups, out, 0)

    def call(index, value, match):
        args = list(good)
        args[index] = value
        with pytest.raises(ValueError, match=match):
            launch(*args)

    call(5, group_pairs(ids, 0, 2, 16), r"tiles of 16 pairs; expected 8 \(tuning.pairs\)")
    wide = NarrowGemmLaunch(n, k, True, NarrowTuning(pairs=32), arch="sm_90a")
    with pytest.raises(ValueError, match="tiles of 8 pairs; expected 32"):
        wide(*good)
    call(2, torch.zeros(rows, k + 128, dtype=torch.uint8), r"x \(3, 384\)")
    call(3, xs.double(), "fp32 scales")
    call(6, out.float(), "bf16")
    call(0, words[:, :, :1], "words")
    call(4, groups.pair_row[:5], "pair_row at least out's rows")
    call(0, words.view(torch.float32), "words torch.float32; words, pair_row and the tiles must")
    # Found by a careless-user probe, each passing every check before: out without a row for
    # every pair slot, a pair_row read at other strides, x of another 1-byte type or off its
    # 16-byte alignment, groups of more local experts than the weights hold.
    call(6, out[:-1], "out needs a row for every pair slot")
    call(4, torch.zeros(24, dtype=torch.int32)[::2], r"pair_row torch.int32 \(not contiguous\)")
    call(2, x.view(torch.float8_e5m2), "expected e4m3")
    shifted = torch.zeros(rows * k + 16, dtype=torch.uint8)[1 : 1 + rows * k].view(rows, k)
    call(2, shifted, "x at address 0x[0-9a-f]+; the kernel reads it 16-byte aligned")
    eight = group_pairs(ids, 0, 8, NARROW_PAIRS)
    more = torch.zeros(eight.pair_capacity, n, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the groups are of 8 local experts, the weights hold 2"):
        launch(words, scales, x, xs, eight.pair_row, eight, more, 0)
    plain = NarrowGemmLaunch(n, k, False, arch="sm_90a")
    with pytest.raises(ValueError, match="pair j reads row j of x: it needs the groups' 12 rows"):
        plain(*good)
    call(3, xs[:2], "the rows and the experts must match")
    call(1, scales[:1], "the rows and the experts must match")
    call(7, 0, "one CUDA device")  # the same stream: every check passes but the device's
    with pytest.raises(ValueError, match="N=136, K=256; need positive ints with N % 128 == 0"):
        NarrowGemmLaunch(136, k, True, arch="sm_90a")
    # N within 32-bit column arithmetic (2^40 was accepted, a review found the kernel's columns
    # Int32).
    for size in (2**31, 2**40):
        with pytest.raises(ValueError, match=f"N={size}; at most 2147483647"):
            NarrowGemmLaunch(size, k, True, arch="sm_90a")
    # Found by a careless-user probe: CuTe's own errors, or an AttributeError, before.
    for size in (0, -128, 128.0):
        with pytest.raises(ValueError, match=f"N={size!r}, K=256; need positive ints"):
            NarrowGemmLaunch(size, k, True, arch="sm_90a")
    with pytest.raises(ValueError, match="tuning 'humming'; expected a NarrowTuning"):
        NarrowGemmLaunch(n, k, True, "humming", arch="sm_90a")
    with pytest.raises(ValueError, match="warps in whole warpgroups"):
        NarrowGemmLaunch(n, k, True, NarrowTuning(warps=2, wgmma=True), arch="sm_90a")
    for tuning in (
        NarrowTuning(pairs=40),
        NarrowTuning(pairs=12),
        NarrowTuning(wgmma=False, pairs=16),
    ):
        with pytest.raises(ValueError, match=r"tiles of 8 pairs, or with wgmma one of \(8, 16"):
            NarrowGemmLaunch(n, k, True, tuning, arch="sm_90a")
    with pytest.raises(ValueError, match="need stages >= 0"):
        NarrowGemmLaunch(n, k, True, NarrowTuning(stage_chunks=0), arch="sm_90a")
    # `ahead` runs a stage's MMAs ahead in the humming weights' ring: not elsewhere.
    for tuning in (
        NarrowTuning(ahead=True),
        NarrowTuning(weights="humming", stages=0, ahead=True),
        NarrowTuning(weights="humming", stage_chunks=1, ahead=True),
    ):
        with pytest.raises(ValueError, match="`ahead` is a form of the humming weights' ring"):
            NarrowGemmLaunch(n, k, True, tuning, arch="sm_90a")
    with pytest.raises(ValueError, match="stage_scales is a form of the humming weights'"):
        NarrowGemmLaunch(n, k, True, NarrowTuning(stage_scales=True), arch="sm_90a")
    # The specialized form: humming's weights through a ring, not `ahead`, a consumer beside the
    # expanding warpgroup; expanded_slots never negative.
    specialized = NarrowTuning(weights="humming", warps=12, expanded_slots=2)
    # Each refusal names what the tuning lacks (a careless-user probe found one message
    # listing every condition).
    for change, match in (
        ({"weights": "narrow"}, "needs weights='humming' with wgmma"),
        ({"stages": 0}, r"needs a ring \(stages > 0\) without `ahead`"),
        ({"ahead": True}, r"needs a ring \(stages > 0\) without `ahead`"),
        ({"warps": 4}, "needs warps a multiple of 4, at least 4 more than the expanders' 4"),
        ({"warps": 10}, "needs warps a multiple of 4, at least 4 more than the expanders' 4"),
        ({"expanders": 0}, "needs expanders >= 1"),
        ({"expanders": 2, "warps": 8}, "at least 4 more than the expanders' 8"),
        ({"expanders": 2, "warps": 16, "stage_chunks": 3}, "multiples of expanders=2"),
        ({"expanders": 2, "warps": 16, "expanded_slots": 3}, "multiples of expanders=2"),
        # Found by a review's model of the barriers: slots not a multiple of the turns, nor the
        # turns of the expanders, let a consumer's wait pass a phase early.
        (
            {"expanders": 3, "warps": 20, "stage_chunks": 3, "expanded_slots": 3},
            r"needs expanded_slots a multiple of the consumers a block \(2\), or those a multiple"
            " of expanders=3",
        ),
        (
            {"expanders": 2, "warps": 20, "expanded_slots": 4},
            r"a multiple of the consumers a block \(3\), or those a multiple of expanders=2",
        ),
        ({"expanded_slots": -1}, r"expanded_slots >= 0 \(0: not specialized\)"),
        ({"blocks": 2, "warps": 16}, "needs blocks=2 dividing the 3 consumer warpgroups"),
        ({"blocks": 3}, "needs blocks=3 dividing the 2 consumer warpgroups"),
        ({"blocks": 0}, "needs blocks=0 dividing the 2 consumer warpgroups"),
        # Found by a review: fewer expanded slots than a block's consumers let a consumer
        # pass its wait on a slot before the slot was filled.
        ({"expanded_slots": 1}, r"needs expanded_slots at least the consumers a block \(2:"),
        ({"warps": 16}, r"needs expanded_slots at least the consumers a block \(3:"),
    ):
        tuning = dataclasses.replace(specialized, **change)
        with pytest.raises(ValueError, match=match):
            NarrowGemmLaunch(n, k, True, tuning, arch="sm_90a")
    # No expander: that alone is named, not consumers or slots counted beside no expander (a
    # careless-user probe found a slots problem named from a negative consumer count).
    for expanders in (0, -1):
        tuning = dataclasses.replace(specialized, expanders=expanders, warps=8, expanded_slots=1)
        with pytest.raises(ValueError) as refused:
            NarrowGemmLaunch(n, k, True, tuning, arch="sm_90a")
        needs = str(refused.value).split(" needs ", 1)[1]
        assert needs == "expanders >= 1", needs
    for tuning in (
        NarrowTuning(weights="humming", blocks=2),
        NarrowTuning(weights="humming", copy_warp=True),
        NarrowTuning(weights="humming", register_a=True),
        NarrowTuning(weights="humming", expanders=2),
        NarrowTuning(warps=32, copy_warp=True),
    ):
        with pytest.raises(ValueError, match="copy_warp and register_a are forms of the spec"):
            NarrowGemmLaunch(n, k, True, tuning, arch="sm_90a")
    assert dataclasses.replace(specialized, copy_warp=True).threads() == 13 * 32
    for tuning in (
        NarrowTuning(warps=0),
        NarrowTuning(warps=36),
        dataclasses.replace(specialized, warps=32, expanded_slots=8, copy_warp=True),
    ):
        with pytest.raises(ValueError, match="a CTA of 1 to 32 warps, the copy warp counted"):
            NarrowGemmLaunch(n, k, True, tuning, arch="sm_90a")
    # From the same probe: `indexed` a bool, `unroll` at least 1, the wgmma forms for sm_90a.
    for indexed in ("False", None, 0):
        with pytest.raises(ValueError, match="indexed=.*; expected a bool"):
            NarrowGemmLaunch(n, k, indexed, arch="sm_90a")
    with pytest.raises(ValueError, match="unroll >= 1"):
        NarrowGemmLaunch(n, k, True, NarrowTuning(stages=0, unroll=0), arch="sm_90a")
    with pytest.raises(ValueError, match="arch 'sm_100a' with .* the wgmma forms are SM90's"):
        NarrowGemmLaunch(n, k, True, NarrowTuning(), arch="sm_100a")
    assert dataclasses.replace(specialized, blocks=2).columns() == 128
    # Its N in blocks of 64 columns (one CTA's), and its shared memory counted: tiles of 32
    # with their scales staged and rings of 4 x 2 fit at K3's FC1 (204,896 bytes), not with 6
    # expanded slots and rings of 6 x 2 (238,736).
    assert specialized.columns() == 64
    NarrowGemmLaunch(192, k, True, specialized, arch="sm_90a")
    wide = dataclasses.replace(specialized, pairs=32, stages=4, stage_scales=True, expanded_slots=4)
    assert smem_bytes(3584, wide) == 204896 <= SMEM_LIMIT
    over = dataclasses.replace(wide, stages=6, expanded_slots=6)
    with pytest.raises(ValueError, match="takes 238736 bytes .* expanded_slots"):
        NarrowGemmLaunch(6144, 3584, True, over, arch="sm_90a")
    # Every field's annotation has a check (a new kind of field needs one).
    assert {f.type for f in dataclasses.fields(NarrowTuning)} <= set(TUNING_FIELD_TYPES)
    # A field of another type: named, before it reaches a check that reads only its truth.
    for field, value in (("ahead", "no"), ("stage_scales", 1), ("stages", 2.0), ("pairs", True)):
        tuning = dataclasses.replace(NarrowTuning(weights="humming"), **{field: value})
        with pytest.raises(ValueError, match=rf"NarrowTuning\.{field}={value!r}; expected"):
            NarrowGemmLaunch(n, k, True, tuning, arch="sm_90a")
    # The staged scales count in the shared memory: tiles of 32 through rings of 6 x 2 fit at
    # K3's FC1 (219,232 bytes) and not with their scales (233,568).
    deep = NarrowTuning(weights="humming", pairs=32, stages=6)
    assert smem_bytes(3584, deep) <= SMEM_LIMIT
    with pytest.raises(ValueError, match="takes 233568 bytes .* or stage_scales off"):
        NarrowGemmLaunch(
            6144, 3584, True, dataclasses.replace(deep, stage_scales=True), arch="sm_90a"
        )
    with pytest.raises(ValueError, match="bytes of shared memory a CTA; at most"):
        NarrowGemmLaunch(n, k, True, NarrowTuning(stages=16, stage_chunks=4), arch="sm_90a")
    # Tiles of 32 stage 32 * K bytes of rows: 224 KiB at K = 7168, over with the ring.
    with pytest.raises(ValueError, match="K=7168 takes 264"):
        NarrowGemmLaunch(n, 7168, True, NarrowTuning(pairs=32), arch="sm_90a")
    many = dataclasses.replace(
        groups, tile_expert=torch.zeros(MAX_TILE_SLOTS + 1, dtype=torch.int32)
    )
    call(5, many, "65536 tile slots; at most 65535")
    # humming's prepared weights: only with wgmma, with their weight_scale_2 and only theirs.
    for tuning in (NarrowTuning(weights="humming", wgmma=False), NarrowTuning(weights="fp4")):
        with pytest.raises(ValueError, match="weights one of"):
            NarrowGemmLaunch(n, k, True, tuning, arch="sm_90a")
    with pytest.raises(ValueError, match="expert_scale given; the narrow weights take no"):
        launch(*good, expert_scale=torch.ones(2))
    prepared = prepared_weights(*random_weights(2, n, k, gen, spread=FUSED_SCALE_SPREAD))
    hum = NarrowGemmLaunch(n, k, True, NarrowTuning(weights="humming"), arch="sm_90a")
    rest = (x, xs, groups.pair_row, groups, out, 0)
    with pytest.raises(ValueError, match="expert_scale missing; the humming weights take"):
        hum(*prepared[:2], *rest)
    with pytest.raises(ValueError, match="words torch.float32; words, pair_row and the tiles"):
        hum(prepared[0].view(torch.float32), prepared[1], *rest, expert_scale=prepared[2])
    for scale_2 in (prepared[2][0], 0.5):
        with pytest.raises(ValueError, match=r"expected humming's weight_scale_2, fp32 \[E\]"):
            hum(*prepared[:2], *rest, expert_scale=scale_2)
    with pytest.raises(ValueError, match=r"words \(2, 8, 128\); expected a contiguous \[\*, 8, 5"):
        hum(prepared[0][:, :, :128], prepared[1], *rest, expert_scale=prepared[2])
    with pytest.raises(ValueError, match="1-byte s' and fp32 weight_scale_2"):
        hum(*prepared[:2], *rest, expert_scale=prepared[2].double())
    with pytest.raises(ValueError, match=r"expert_scale \(1,\): the rows and the experts must"):
        hum(*prepared[:2], *rest, expert_scale=prepared[2][:1])
    hum_args = (*prepared[:2], x, xs, groups.pair_row, groups, out, 0)
    with pytest.raises(ValueError, match="one CUDA device"):
        hum(*hum_args, expert_scale=prepared[2])


# ---- SM90 GPU ----------------------------------------------------------------------------------
def sm90_here() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device here"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs SM90, found {torch.cuda.get_device_capability()}"
    if not HAVE_CUTLASS:
        return "needs nvidia-cutlass-dsl"
    return None


GPU = pytest.mark.skipif(sm90_here() is not None, reason=f"narrow GEMM: {sm90_here()}")


def gpu_case(num_local, n, k, rows, topk, indexed, hot, gen, pairs=NARROW_PAIRS, spread=24):
    """Weights, rows, ids of `rows` receive rows (topk ids of 4 * num_local experts, this rank's
    the first num_local; hot: local expert 0 in every row), the groups of tiles of `pairs`."""
    dev = torch.device("cuda")
    w, s = random_weights(num_local, n, k, gen, spread=spread)
    w, s = w.to(dev), s.to(dev)
    num_experts = 4 * num_local
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:topk] for _ in range(rows)])
    # Every row holds a local id in slot 0 (expert 0 when hot; it may repeat another slot's):
    # no case without pairs.
    ids[:, 0] = 0 if hot else torch.randint(0, num_local, (rows,), generator=gen)
    ids = ids.int().to(dev)
    groups = group_pairs(ids, 0, num_local, pairs)
    capacity = rows * topk
    x_rows = rows if indexed else capacity
    x = (torch.randn(x_rows, k, generator=gen) * 8).to(torch.float8_e4m3fn).to(dev)
    xs = torch.pow(2.0, torch.randint(-6, 7, (x_rows, k // 32), generator=gen).float()).to(dev)
    return w, s, x, xs, groups


# The kernel's forms tested: its MMA either way, each chunk loaded straight into registers or
# streamed through each warp's ring in shared memory (bulk copies): 2 slots of 2 chunks (the
# default) and 3 of 4, whose slots K3's FC1 reuses unevenly (28 chunks: 7 stages); K = 384 ends
# in a part stage, and K = 128 (one chunk) is shorter than either ring. The wgmma form also on
# tiles of 16, 24 and 32 pairs (the hot cases fill some and leave others part full).
TESTED_FORMS = {
    f"{mma}-{ring}": dict(wgmma=mma == "wgmma", **ring_args)
    for mma in ("mma.sync", "wgmma")
    for ring, ring_args in (
        ("direct", {"stages": 0}),
        ("ring2x2", {"stages": 2, "stage_chunks": 2}),
        ("ring3x4", {"stages": 3, "stage_chunks": 4}),
    )
}
TESTED_FORMS |= {f"wgmma-ring2x2-pairs{p}": dict(pairs=p) for p in NARROW_TILE_PAIRS[1:]}
TESTED_FORMS["wgmma-direct-pairs32"] = dict(stages=0, pairs=32)
# humming's prepared weights (packed in torch by prepared_weights), loaded directly and through
# the warpgroup's ring, on tiles of 8 to 32.
TESTED_FORMS |= {
    f"humming-{ring}": dict(weights="humming", **ring_args)
    for ring, ring_args in (
        ("direct", {"stages": 0}),
        ("ring2x2", {"stages": 2, "stage_chunks": 2}),
        ("ring3x4", {"stages": 3, "stage_chunks": 4}),
    )
}
TESTED_FORMS |= {
    f"humming-ring2x2-pairs{p}": dict(weights="humming", pairs=p) for p in NARROW_TILE_PAIRS[1:]
}
TESTED_FORMS["humming-direct-pairs32"] = dict(weights="humming", stages=0, pairs=32)
# The wider tiles through bench_narrow_gemm's deeper rings (DEEP): 3 x 2 at 16, 6 x 2 at 32,
# whose 6 slots K3's FC1 (14 stages) and FC2 (12) reuse two or more times.
TESTED_FORMS["humming-ring3x2-pairs16"] = dict(weights="humming", pairs=16, stages=3)
TESTED_FORMS["humming-ring6x2-pairs32"] = dict(weights="humming", pairs=32, stages=6)
# `ahead` (a stage's MMAs a chunk ahead of their promotions): K = 384 (3 chunks) ends in a part
# stage (one chunk with stages of 2; with stages of 4 it is one part stage of three), K = 128 is a
# part stage alone; K3's FC1 (28 chunks) and FC2 (24) are whole stages.
TESTED_FORMS["humming-ahead"] = dict(weights="humming", ahead=True)
TESTED_FORMS["humming-ahead-ring3x4-pairs16"] = dict(
    weights="humming", pairs=16, stages=3, stage_chunks=4, ahead=True
)
TESTED_FORMS["humming-ahead-ring6x2-pairs32"] = dict(
    weights="humming", pairs=32, stages=6, ahead=True
)
# The activation scales staged with the rows (the staging's loop looks each row up).
TESTED_FORMS |= {
    f"humming-scales-pairs{p}": dict(weights="humming", pairs=p, stage_scales=True)
    for p in (8, 24, 32)
}
# The specialized form (an expanding warpgroup, consumers taking the chunks in turn): two
# consumers on tiles of 8, 16 and 32 (32 with its scales staged); one consumer through two
# expanded slots; three consumers through three slots (each consumer always the same slot) and a
# ring of 3 x 4, whose K = 128 case leaves two consumers without a chunk.
TESTED_FORMS |= {
    f"specialized-pairs{p}": dict(
        weights="humming", warps=12, pairs=p, expanded_slots=4, stage_scales=p == 32
    )
    for p in (8, 16, 32)
}
TESTED_FORMS["specialized-1consumer"] = dict(weights="humming", warps=8, pairs=16, expanded_slots=2)
TESTED_FORMS["specialized-3consumers-ring3x4"] = dict(
    weights="humming", warps=16, pairs=24, expanded_slots=3, stages=3, stage_chunks=4
)
# Two 64-column blocks a CTA: a consumer each (scales staged), and two consumers each taking
# the chunks in turn through a ring of 3 x 2 (K3's FC1: 14 stages, 28 chunks over 2 slots).
TESTED_FORMS["specialized-2blocks"] = dict(
    weights="humming", warps=12, pairs=16, blocks=2, expanded_slots=2, stage_scales=True
)
TESTED_FORMS["specialized-2blocks-2turns"] = dict(
    weights="humming", warps=20, pairs=8, blocks=2, expanded_slots=2, stages=3
)
# The ring's copies issued by a warp of their own (the CTA's 13th).
TESTED_FORMS["specialized-copy-warp"] = dict(
    weights="humming", warps=12, pairs=16, expanded_slots=2, stages=4, copy_warp=True
)
# The consumers' A words loaded into registers (register_a): alone on tiles of 8, and with two
# blocks of two consumers each and the copy warp.
TESTED_FORMS["specialized-register-a"] = dict(
    weights="humming", warps=12, pairs=8, expanded_slots=2, stages=4, register_a=True
)
# Two expanding warpgroups (each its own chunk of a ring stage and its own slots): on tiles of 8
# with two consumers; with two blocks of a consumer each; three expanders through stages of three
# chunks (K3's FC1: 28 chunks, the last stage holding one) and six slots (a multiple of its two
# consumers: with three, a review's model found a consumer's wait passing a phase early), A from
# registers and the copy warp.
TESTED_FORMS["specialized-2expanders"] = dict(
    weights="humming", warps=16, pairs=8, expanded_slots=2, stages=4, stage_scales=True, expanders=2
)
TESTED_FORMS["specialized-2expanders-2blocks"] = dict(
    weights="humming", warps=16, pairs=16, blocks=2, expanded_slots=2, expanders=2
)
TESTED_FORMS["specialized-3expanders-register-a-copy-warp"] = dict(
    weights="humming",
    warps=20,
    pairs=16,
    expanded_slots=6,
    stage_chunks=3,
    register_a=True,
    copy_warp=True,
    expanders=3,
)
TESTED_FORMS["specialized-register-a-2blocks-copy-warp"] = dict(
    weights="humming",
    warps=20,
    pairs=16,
    blocks=2,
    expanded_slots=2,
    stage_scales=True,
    register_a=True,
    copy_warp=True,
)


@GPU
@pytest.mark.parametrize("form", list(TESTED_FORMS))
@pytest.mark.parametrize(
    "num_local,n,k,rows,topk,indexed,hot",
    [
        (4, 256, 256, 1, 4, True, False),  # one row
        (4, 256, 384, 16, 4, True, True),  # a hot expert: 16 pairs, two full tiles of 8
        (4, 256, 384, 48, 4, True, True),  # a hot expert's 48 pairs or more: tiles of 32 and 24
        (3, 128, 128, 9, 8, False, False),  # rows by pair number
        (8, 6144, 3584, 2, 16, True, False),  # K3's FC1
        (8, 3584, 3072, 3, 16, False, True),  # K3's FC2
    ],
)
def test_kernel_against_float64_reference(num_local, n, k, rows, topk, indexed, hot, form):
    from dep_ep.experts.hopper.narrow_gemm import NarrowGemmLaunch, NarrowTuning

    gen = fresh_generator()
    tuning = NarrowTuning(**TESTED_FORMS[form])
    humming = tuning.weights == "humming"
    spread = FUSED_SCALE_SPREAD if humming else 24
    w, s, x, xs, groups = gpu_case(
        num_local, n, k, rows, topk, indexed, hot, gen, tuning.pairs, spread
    )
    extra = {}
    if humming:
        words, scales, scale_2 = prepared_weights(w, s)
        extra = {"expert_scale": scale_2}
    else:
        words, scales = narrow_weights(w, s)
    launch = NarrowGemmLaunch(n, k, indexed, tuning)
    out = torch.full((rows * topk, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    pair_row = groups.pair_row
    stream = torch.cuda.current_stream().cuda_stream
    launch(words, scales, x, xs, pair_row, groups, out, stream, **extra)
    torch.cuda.synchronize()
    assert_matches_reference(out, w, s, x, xs, groups, indexed, num_local, k)


def assert_matches_reference(out, w, s, x, xs, groups, indexed, num_local, k):
    """out (bf16 [capacity, N], NaN before the call) holds every pair's row within the bound of
    the float64 reference and nothing past the pairs."""
    pair_row = groups.pair_row
    pairs = int(groups.num_pairs)
    assert pairs >= 1
    j = torch.arange(pairs, device="cuda")
    experts = torch.repeat_interleave(
        torch.arange(num_local, device="cuda"), groups.expert_pairs.to("cuda")
    )
    rows_read = pair_row[:pairs] if indexed else j.int()
    exact = narrow_gemm_reference(w, s, x, xs, rows_read, experts)
    got = out[:pairs].double()
    assert not got.isnan().any(), "a pair's output row was not written"
    assert out[pairs:].isnan().all(), "rows past the pairs were written"
    # The bound: BF16's rounding (2^-8 relative), and the MMA's and fp32 sums (terms' magnitudes).
    xd = (x.double().view(x.shape[0], -1, 32) * xs.double().unsqueeze(-1)).view(x.shape[0], k)
    magnitude = torch.empty_like(exact)
    for e in experts.unique().tolist():
        sel = experts == e
        weights = mxfp4_dequantize(w[e], s[e], torch.float64).abs()
        magnitude[sel] = xd[rows_read[sel].long()].abs() @ weights.T
    bound = 2.0**-8 * exact.abs() + 2.0**-12 * magnitude
    excess = ((got - exact).abs() - bound).max()
    assert excess <= 0, f"error above the bound by {excess:.3g}"


@GPU
@pytest.mark.parametrize("stages", [0, 2])
def test_humming_form_reads_hummings_own_preparation(stages):
    """The humming form on the tensors humming-kernels' own preparation keeps
    (HummingGemm.prepare, as HummingEngine holds them) at K3's FC1 shape: within the float64
    reference's bound, and bit for bit the output on prepared_weights' tensors (the same values;
    an expert's s' and weight_scale_2 may split its scale otherwise, by powers of two)."""
    pytest.importorskip("humming", reason="needs humming-kernels (the gpu extra)")
    from dep_ep.experts.hopper.humming_gemm import HummingGemm
    from dep_ep.experts.hopper.narrow_gemm import NarrowGemmLaunch, NarrowTuning

    gen = fresh_generator()
    num_local, n, k, rows, topk = 4, 6144, 3584, 3, 16
    tuning = NarrowTuning(weights="humming", stages=stages)
    w, s, x, xs, groups = gpu_case(
        num_local, n, k, rows, topk, True, True, gen, tuning.pairs, FUSED_SCALE_SPREAD
    )
    theirs = prepared_tensors(HummingGemm.prepare(w, s, False).tensors)
    launch = NarrowGemmLaunch(n, k, True, tuning)
    stream = torch.cuda.current_stream().cuda_stream
    outs = []
    for words, scales, scale_2 in (theirs, prepared_weights(w, s)):
        out = torch.full((rows * topk, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch(words, scales, x, xs, groups.pair_row, groups, out, stream, expert_scale=scale_2)
        outs.append(out)
    torch.cuda.synchronize()
    assert_matches_reference(outs[0], w, s, x, xs, groups, True, num_local, k)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
