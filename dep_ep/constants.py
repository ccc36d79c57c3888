"""Constants of the formats and of the kernels, defined once: the torch reference, the CuTeDSL
kernels, the layout and the validation all import them from here."""

import struct

SCALE_BLOCK = 32  # MXFP8/MXFP4 elements per E8M0 scale byte (the OCP MX block size)
E4M3_MAX = 448.0  # largest finite e4m3 magnitude
# MXFP8 scale rule: amax times rcp.approx.ftz(448.0), whose fp32 bits are these (docs/formats.md).
RCP_448_BITS = 0x3B124925
RCP_448 = struct.unpack("<f", struct.pack("<I", RCP_448_BITS))[0]  # that fp32 value, as a float

# Expert ids travel as int32 (the receive rows' ids, the grouping's lists): E at most 2^31.
MAX_EXPERTS = 2**31

# The GPU kernels keep a token's set of destination ranks in a 32-bit mask.
MAX_RANKS = 32
# The dispatch kernel writes a token's ids and weights with one thread per k (128 threads a CTA).
MAX_TOPK = 128

# The GPU step protocol (comm/kernels/signals.py): the host transport reads the same numbers.
# The combine has two flags: "my rows of the call are written" (PHASE_COMBINE, at its start) and
# "I have read your rows of the call" (PHASE_COMBINE_END, at its end: a rank's combine completes
# only when every rank is done reading its rows, so they can be rewritten after it).
PHASE_DISPATCH, PHASE_COMBINE, PHASE_COMBINE_END = 1, 2, 3
PHASE_NAMES = {
    PHASE_DISPATCH: "dispatch",
    PHASE_COMBINE: "combine",
    PHASE_COMBINE_END: "combine-end",
}
# Step flags: int64 words per (phase, source rank) in every rank's symmetric allocation:
# [flag = call << 2 | status, unused, tokens, tag]; tokens and tag share one 16-byte load.
FLAG_PHASES = 3  # dispatch, combine, combine-end: slot (phase - PHASE_DISPATCH, source)
FLAG_WORDS = 4
FLAG_CALL, FLAG_TOKENS, FLAG_TAG = 0, 2, 3
# A flag's status: the source took part with its payload, rejected its input (or called
# reject_step), failed in its experts (or called abort_step), or ran the step after its own
# dispatch of it had failed (a wait timed out or was aborted, or a source's flag was wrong):
# its expert rows may come from receive rows a late peer had not finished writing.
STATUS_OK, STATUS_REJECTED, STATUS_FAILED, STATUS_UNUSABLE = 0, 1, 2, 3
NO_TAG = -(1 << 63)  # the tag word of a call that gave none
# EpMoeLayer's own tags (a call given no tag=): LAYER_TAG_BASE + (step mod 2^LAYER_STEP_BITS)
# << (LAYER_FINGERPRINT_BITS + LAYER_INDEX_BITS) + fingerprint << LAYER_INDEX_BITS + layer index,
# negative and apart from NO_TAG (the three fields fill the 62 bits below LAYER_TAG_BASE's
# magnitude); the fingerprint is a digest of the layer's dense weights (ep/layer.py); error
# messages show the tags as "layer i (weights f) call s".
LAYER_INDEX_BITS = 16
MAX_LAYER_INDEX = (1 << LAYER_INDEX_BITS) - 1  # the largest EpMoeLayer.layer_index
LAYER_FINGERPRINT_BITS = 24
LAYER_STEP_BITS = 62 - LAYER_FINGERPRINT_BITS - LAYER_INDEX_BITS  # 22: the call count wraps
LAYER_TAG_BASE = -(1 << 62)
# An EpMoeLayer's call given tag=: GIVEN_TAG_BASE + (a GIVEN_DIGEST_BITS-bit digest of the given
# tag and the fingerprint << LAYER_INDEX_BITS) + layer index, negative, between NO_TAG and
# FIRST_PIECE_TAG_BASE (the two fields fill its 60 bits), so that one tag given to two layers
# sends two tags (ep/layer.py, given_layer_tag); messages show it as "layer i, given tag digest
# d". Two different given tags of one layer send the same tag by a 2^-44 chance.
GIVEN_DIGEST_BITS = 44
GIVEN_TAG_BASE = -(1 << 63) + (1 << 60)
# A step's T (tokens) is below 2^STEP_TOKENS_BITS (checks.MAX_STEP_TOKENS). The first piece of a
# step run in pieces (T above max_tokens, EpRouted.routed) carries T in its tag, so that ranks
# whose T differ are told in that piece: FIRST_PIECE_TAG_BASE + (T << PIECE_DIGEST_BITS) + a
# digest of the caller's tag (its low PIECE_DIGEST_BITS bits), negative, between NO_TAG and
# LAYER_TAG_BASE; messages show it as "piece 1 of a step of T=<T>". The later pieces' tags
# hash the caller's tag, T and the piece's index (ep/routed.py, _piece_tag).
STEP_TOKENS_BITS = 31
PIECE_DIGEST_BITS = 30
FIRST_PIECE_TAG_BASE = -(1 << 63) + (1 << 61)
# Device state of one rank (int64 words, device memory, not symmetric).
STATE_CALL = 0  # calls completed: the dispatch of call c reads c - 1; its combine stores c
# (with several ranks once its last CTA is done; at one rank CTA 0 stores it before its output
# rows: nothing reads the word before the launch completes)
STATE_STEP_STATUS = 1  # 0, or the error kind a kernel of the current call met (KIND_EXPERTS:
# the rank's experts failed the call on the device, comm/failure.py; the combine then marks it)
STATE_DONE_DISPATCH = 2  # CTAs of the running dispatch launch done with their payload (int32)
STATE_DONE_COMBINE = 3  # CTAs of the running combine launch done with their tokens
STATE_ABORT = 4  # 1 after a timeout: every later wait returns at once
STATE_READY_COMBINE = 5  # CTAs of the running combine launch started (the first one signals)
# One rank alone: the call the running dispatch opened (the dispatch's CTA 0 stores STATE_CALL + 1
# here; the combine's CTAs read it, and its CTA 0 stores it into STATE_CALL, which no CTA of the
# combine reads, so the combine needs no count of its CTAs to find a last one).
STATE_OPEN_CALL = 6
STATE_WORDS = 8
# The error record (int64, host-mapped): [status, phase, peer, rank, kind, theirs, mine, call]
# written by the kernels (status 1 while a kernel writes it, 2 once complete), then the abort
# request the host writes (0, or an ABORT_* reason): a wait that has lasted HOST_ABORT_POLL_NS
# reads it and ends. Kinds:
ERROR_WORDS = 16
ERROR_STATUS, ERROR_PHASE, ERROR_PEER, ERROR_RANK = 0, 1, 2, 3
ERROR_KIND, ERROR_THEIRS, ERROR_MINE, ERROR_CALL = 4, 5, 6, 7
ERROR_KERNEL_WORDS = 8  # the words above: the host clears these, never the abort request
ERROR_ABORT = 8
ERROR_WRITING, ERROR_COMPLETE = 1, 2
KIND_TIMEOUT, KIND_REJECTED, KIND_TAG, KIND_TOKENS, KIND_CALL, KIND_ABORTED = 1, 2, 3, 4, 5, 6
# Written into the state's step status only (never into the error record) by an experts backend
# that failed the call on the device (comm/failure.py, StepFailure): over its pair budget.
KIND_EXPERTS = 7
# Why the host asked the kernels' waits to end: a peer's process is gone, reset() is running on
# this rank, or a peer called reset() (comm/peer_watch.py: this rank must reset too).
ABORT_PEER_LOST, ABORT_RESET, ABORT_PEER_RESET = 1, 2, 3
# A wait reads the host's abort request only after it has waited this long: the read crosses
# PCIe (about a microsecond), and a flag that comes within this needs no abort.
HOST_ABORT_POLL_NS = 20_000

# The GPU kernels move rows in 16-byte vectors (ld/st.global.v4.b32, the widest access of one
# thread), so every tensor they read or write starts on a 16-byte boundary: checks.check_aligned
# asks it of the caller's tensors, comm/kernels/tensors.py assumes it of their views.
VECTOR_BYTES = 16

# Launch geometry of the CuTeDSL kernels, read by their host launch code too.
WARP_LANES = 32
DISPATCH_THREADS = 128  # 4 warps: one 32-element block per thread and pass
COMBINE_WARPS = 8  # warps of a combine CTA (KernelTuning's default): two tokens at a time
COMBINE_CTAS_PER_SM = 2  # combine CTAs an SM (KernelTuning's default): <= 128 registers a thread
# Shared memory of an SM on Hopper and Blackwell (sm_90a, sm_100a), and what the driver keeps of
# it for each resident CTA: the combine's carveout is sized from them (no device query).
SM_SHARED_BYTES = 228 * 1024
CTA_RESERVED_SHARED_BYTES = 1024
# The dispatch grid takes up to this many CTAs an SM; the kernel is compiled for it (launch
# bounds: at most 64 registers a thread), so the whole grid is one wave.
CTAS_PER_SM = 8

# The combine kernel reduces and normalises one token per group of NORM_WARPS warps: lane l of
# the group's NORM_LANES owns the 8-element (16-byte) chunks l, l + 128, ... of the row (4 at
# L = 3584). Its sum of squares: each lane's in chunk and element order, the tree over each
# warp's 32 lanes, then the tree over the group's warps. The torch reference sums squares in the
# same order (bitwise equal); the order is the same for every launch (any T, any tuning).
NORM_WARPS = 4
NORM_LANES = NORM_WARPS * WARP_LANES
NORM_CHUNK = VECTOR_BYTES // 2  # bf16 elements in one vector
# The norm scales a row by 2^(127 - clamp(E, 127, 253)), E the biased fp32 exponent of its largest
# magnitude: exact, 1 below 2.0, and no square can overflow (comm/reference.py rms_norm).
NORM_SCALE_MIN_EXP, NORM_SCALE_MAX_EXP = 127, 253
