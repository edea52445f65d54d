"""Sparse MQA attention over the V4.1 and V4 caches, read in their stored formats (H200 fast path).

For every query token of a flat batch: one softmax over

* the window keys, positions max(floor, p - W + 1) .. p — keys below the step's first position
  p0 come from the request's ring (slot position % W): V4.1's FP8 ring (e4m3 codes + one ue8m0
  byte per 32 channels) or V4's bf16 ring (the values, `ring_scales` None); the step's own keys
  (positions >= p0) from `kv_new`, the bf16 keys this step computed (for V4.1 already
  FP8-rounded, as the model's QAT and the ring hold them). So the ring is written *after*
  attention, for decode and prefill alike, exactly like the reference
  (`Attention._window_keys` / `_write_ring`), and one launch serves chunked prefill, decode and
  mixed batches without ordering constraints;
* the selected compressed entries `topk` [T, k] (entry index j of the request's compressed
  sequence, -1 = none), found through the block table at block j // P, offset j % P
  (P = block_size / ratio) of the paged compressed cache: V4.1's FP4 (e2m1 packed two per byte,
  low nibble = even channel, one E4M3 scale per 16 channels) or V4's bf16 values (`ckv_scales`
  None). V4's HCA layers select every visible entry, so k reaches context / 128 (8192 at 1M
  tokens): a call runs its tokens in slices whose workspace fits WORKSPACE_MAX_BYTES;
* plus the per-head sink logit, which only enlarges the denominator.

K = V (one shared 512-wide latent for all heads). Numerics follow `Attention._attend`: the
logit is q.k rounded to bf16, times the softmax scale, rounded to bf16 again; the softmax is
fp32 with the sink in the denominator; probabilities exp(logit - max) go to bf16 before
multiplying V (unnormalised; the fp32 output is divided by the denominator at the end).
Output bf16 [T, H, D].

Two kernels, because the 64 x 512 fp32 output of a token's 64 heads (128 registers a thread
at 8 warps) leaves too few registers for the logits and the key dequantisation in one loop:

1. `_logits_kernel`, program (token, block of 16, 32 or 64 heads, run of tiles): for each tile of
   LOGIT_BLOCK_N keys (the window, then the top-k entries) the logits S^T = K Q^T with the
   keys as the rows of a 128-row wgmma, whose A operand comes from registers: the key tile is
   dequantised piece by piece (PIECE channel pairs) straight into the operand, so it never
   passes through shared memory, and Q sits in shared memory as the B operand. It stores the
   rounded logits (bf16, -inf where masked) to a workspace [T, H, keys] and each tile's
   softmax statistics (max, sum of exp) per head.
2. `_pv_kernel`, program (token, head block, channel slice): merges the tiles' statistics in
   tile order with the sink, then for each tile of PV_BLOCK_N keys p = exp(S - max) in bf16
   (the A operand from registers) times the dequantised values of its output channel pairs
   (shared memory) into two fp32 accumulators (even and odd channels); its epilogue divides by
   the denominator, rounds to bf16 and, where the caller passes the angles, rotates the RoPE
   channels back (the inverse RoPE the output projection needs, no launch of its own); with
   `fp8_output` it then quantises the output as wo_a's FP8 input (FP8 activations: codes and
   an exponent byte per 32 channels, the bits `fp8_act_quant` gives, no launch of its own).
   The selected entries' tiles load a tile ahead by the loop itself, into registers (values
   and logits one tile ahead, cache blocks two, entries three): a value's address needs its entry and cache block, and the compiler's
   pipelining of that chain waited at every tile for all the copies the tile before had
   issued, exposing a load latency per tile (attention_sweep, H100, both kernels: one token
   30.2 -> 25.6 us, 8 tokens 38.8 -> 31.9, 64 tokens 112 -> 98, 256 tokens 294 -> 265; a
   4096-token chunk level; same bits).

Neither kernel's arithmetic depends on how the work is spread: the statistics are per tile
and merged in a fixed order, the logits per key, the output channels independently, and a
logits head block only changes the wgmma's N (heads), not any element's products, their
accumulation order or the per-head reductions over a tile's keys — so a token's bits do not
depend on its batch (batch invariance) while the launch still fills the SMs at any batch
size: "auto" gives few-token batches one logits tile per program, narrower head blocks when
the tiles alone leave SMs idle, and several channel slices (DSPLIT) per token. Channels are
handled as (even, odd) halves: byte c of an FP4 compressed entry holds channels 2c and 2c + 1,
a uint16 of the FP8 ring two e4m3 codes, an int32 of kv_new / q / V4's bf16 caches two bf16
values, so every dequantisation is a plain load and nibble / byte / half extraction, never an
interleave. Each cache's format is a constexpr of both kernels (RING_RAW, CKV_RAW: bf16 values).

V4.1's FP4 entries are decoded by byte permutes, shifts, masks and two exact bf16x2 multiplies
per two values on compiled CUDA (`_fp4_ptx`), through fp16 and fp32 in the interpreter: the
same values (the `attention` device section checks the bits).
Prefill-sized steps read V4.1's FP4 compressed entries from a bf16 copy instead (DENSE_CKV below),
stored per entry in operand pieces: piece c holds the even channels of pairs c*PIECE ..
(c+1)*PIECE - 1, then their odd channels, so a logits piece is two contiguous runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.triton.fp8_gemm import e2m1_pair_ptx, e4m3_bits, e8m0_to_fp32, fp8_exponent, num_sms, pow2, ptx_convert, round_to_e4m3
from dsv4.ops.triton.pdl import begin, pdl_launch
from dsv4.ops.triton.rowwise import rotate_pairs

# constexpr: the kernels read them (Python code uses .value)
RING_SCALE_BLOCK = tl.constexpr(32)  # ue8m0 byte per 32 channels of a window key
CKV_SCALE_BLOCK = tl.constexpr(16)  # E4M3 scale per 16 channels of a compressed entry
# Tiling (module docstring). BLOCK_H heads per PV program (all 64 of a token: the heads are the
# wgmma's M, 64 rows a warpgroup); LOGIT_BLOCK_H heads per logits program (the wgmma's N: each
# head block dequantises the key tile again, so "auto" narrows it to 32 or 16 only when the tiles
# alone give fewer programs than half the SMs, e.g. 20 instead of 5 at one token); LOGIT_BLOCK_N keys per
# logits tile (the rows of S^T: 128 = one 64-row wgmma per warpgroup at 8 warps), which is also
# the unit of the softmax statistics; PIECE channel pairs dequantised per operand piece;
# PV_BLOCK_N keys per PV tile; DSPLIT output-channel slices per (token, head block) in the PV
# kernel (ranges of channel pairs, both channels of a pair in one slice, so that the epilogue
# can rotate them); TILES_PER_PROGRAM logits tiles per program. "auto" picks LOGIT_BLOCK_H and
# the last two from the batch size to fill the SMs, and PV_BLOCK_N from DSPLIT. LOGIT_BLOCK_N
# and PIECE decide the rounding (so they are fixed, not tuned per batch); LOGIT_BLOCK_H, DSPLIT,
# TILES_PER_PROGRAM and PV_BLOCK_N do not change a bit (PV_BLOCK_N: a 64-key tile is the same
# chain of k16 wgmmas into the accumulator as two 32-key tiles; same bits on the H200, S4-2).
# Registers and spills of every variant: scripts/check_kernels.py --compile-only; timings:
# its `attention_sweep` section.
CONFIG = {
    "BLOCK_H": 64, "LOGIT_BLOCK_H": "auto", "LOGIT_BLOCK_N": 128, "PIECE": 32, "logit_warps": 8, "logit_stages": 2, "TILES_PER_PROGRAM": "auto",
    "PV_BLOCK_N": "auto", "DSPLIT": "auto", "pv_warps": 8, "pv_stages": 3, "DENSE_CKV": "auto", "dense_stages": 3,
    "dense_logit_maxnreg": 128,
}
# dense_logit_maxnreg: the register cap of the logits kernel when it reads the dense copy (its
# loads are async copies into shared memory, so 128 registers leave 8 bytes spilled under
# Triton 3.6): two programs per SM instead of one, 6.18 -> 5.17 ms for an 8192-token chunk on
# the H200 (attention_prefill, same bits; registers never change a result). The cache-key
# form keeps its 245 (its dequantisation would spill).
# pv_stages: the compiler's pipeline depth for PV's window loop (its top-k loop loads a tile
# ahead by itself). 3 (was 2): equal or faster at every size in attention_sweep S3-2, when it
# pipelined both loops (T=1 50.2 -> 48.7 us, T=8 52.8 -> 50.2, T=256 300 -> 296, a 4096-token
# chunk 4.12 -> 4.09 ms, T=64 level); with the top-k loop's own loads (S20-4, H100), 2 was
# level but at T=64 (98.0 -> 95.3 us, both kernels).
DSPLITS = (1, 2, 4, 8, 16)  # 16: 16 pairs a slice, one ring scale group (and two wgmma N of 16)
AUTO_DSPLITS = (1, 2, 4, 8)  # "auto" above a few tokens (below: WIDE_DSPLITS)
# "auto" while tokens x slices fit in one wave of programs: the widest that does. (When a slice
# held one parity of its pairs, 32 slices of 16 channels took one token's call from 34.3 to
# 30.6 us against 16 slices; attention_sweep, H100, nineteenth session. A slice now loads only
# its own pairs' bytes and decodes both nibbles of each.)
WIDE_DSPLITS = (16,)
LOGIT_BLOCK_HS = (64, 32, 16)  # widest first; 16 is the narrowest wgmma N worth a program
# Dense compressed keys (DENSE_CKV): a prefill-sized step uses each compressed entry many times
# (8192 tokens x 512 selections over 2048 entries: ~2000 uses each), and dequantising it at
# every use was the two kernels' main work. "auto" first writes every entry the step's block
# tables reach as bf16 (`_dense_ckv_kernel`, the same values the kernels' FP4 decoding gives)
# when the selections use them at least DENSE_MIN_USES times on average and the copy fits
# DENSE_MAX_BYTES (shapes only: requests x max_blocks x P entries); the kernels then load the
# bf16 keys straight into the wgmma operands, with the same products in the same order, so a
# token's bits do not depend on which form it read (the `invariance` device section checks).
# V4's bf16 compressed entries are never copied: the copy exists to decode each FP4 entry once
# instead of at every use, and a bf16 entry is read as plainly as its copy would be (int32
# words split into the two halves, no scales). What the copy would still give, the keys in
# shared memory by async copies in operand-piece layout, is unmeasured against writing and
# reading every reached entry once more, so "auto" and True both leave bf16 entries in place.
DENSE_MIN_USES = 4
DENSE_MAX_BYTES = 256 << 20
DENSE_ROWS = 16  # entries per program of the dense copy
# The workspace of one launch pair (logits [tokens, H, keys] bf16 and the tiles' statistics)
# stays within this: a call runs its tokens in slices of as many as fit. V4's HCA layers
# attend every visible entry (8192 keys at 1M tokens: about 9 GB for an 8192-token chunk of
# 64 heads in one piece); a token's bits do not depend on its batch, so slicing changes none.
WORKSPACE_MAX_BYTES = 1 << 30
# Selection tables wider than this (V4's HCA layers: every visible entry, the table as wide as
# the block tables reach, e.g. 8192 entries at a 1M-token capacity while a request at 8K sees
# 64) skip the tiles without a selected entry in both kernels: no key reads, products or
# logits stores for them, the same results. Narrower tables (the top-512 selections) are full
# but for a short context's tail, and keep the branch-free loops the software pipeliner wants.
SKIP_EMPTY_MIN_ENTRIES = 512


@triton.jit
def _e2m1_over_2e14(code):
    """e2m1 codes (low 4 bits: sign, 2 exponent bits, 1 mantissa bit) -> value / 2**14 in fp32:
    the magnitude bits become exponent and mantissa bits of an fp16 whose exponent is 14 short,
    code 1 landing exactly on the subnormal 2**-15; the caller's scale carries the 2**14."""
    bits = ((code & 0x07) << 9) | ((code & 0x08) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


# The compiled path's FP4 decoding (`PTX`), on four entry bytes (channel pairs c .. c + 3, the
# even channel in each low nibble; Triton hands them over packed in one register): two byte
# permutes spread bytes 0, 1 and 2, 3 over the halves of a word, so that a pair's nibble sits at
# bits 0..3 of each half (shifted right by 4: the odd channels'), then the nibbles' bit
# placement (`fp8_gemm.e2m1_pair_ptx`: the e2m1 values times 2**-126 as bf16 pairs) and its two
# exact bf16x2 multiplies, by 2**126 and by the entry's E4M3 scale (exact in bf16): the values
# `_e2m1_over_2e14` times the scale give, rounded — exact either way (two and four significant
# bits), so the same bits without the conversions through fp16 and fp32.
def _fp4_ptx(shift: str) -> str:
    """PTX: the 4 bytes (a pack) in $2 -> the bf16 values of their nibbles at bits `shift` in
    $0 (bytes 0, 1) and $1 (bytes 2, 3), times their scales ($3: bytes 0, 1; $4: bytes 2, 3)."""
    return ("{\n.reg .b32 x, y, a, b, k;\nmov.b32 k, 0x7E807E80;\nprmt.b32 x, $2, 0, 0x4140;\nprmt.b32 y, $2, 0, 0x4342;\n"
            f"shr.u32 x, x, {shift};\nshr.u32 y, y, {shift};\n"
            + e2m1_pair_ptx("x", "$0", "$3") + e2m1_pair_ptx("y", "$1", "$4") + "}")


_FP4_EVEN_PTX = tl.constexpr(_fp4_ptx("0"))
_FP4_ODD_PTX = tl.constexpr(_fp4_ptx("4"))


@triton.jit
def _fp8_code(byte):
    return (byte & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _fp4_scales(ckv_scale_ptr, loc, valid, g0, GROUPS: tl.constexpr, DIM: tl.constexpr):
    """The E4M3 scales g0 .. g0 + GROUPS of the entries at cache rows loc as fp32 (0 where not
    valid): one load of whole rows, which the software pipeline can prefetch."""
    g = tl.arange(0, GROUPS)
    scale = tl.load(ckv_scale_ptr + loc[:, None] * (DIM // CKV_SCALE_BLOCK) + g0 + g[None, :], mask=valid[:, None], other=0.0)
    return scale.to(tl.float32)


@triton.jit
def _fp4_bytes(ckv_ptr, loc, valid, p0, NP: tl.constexpr, DIM: tl.constexpr):
    """The bytes of channel pairs p0 .. p0 + NP of the compressed entries at cache rows loc,
    uint8 [rows, NP / 8, 8] (0 where not valid)."""
    BYTES: tl.constexpr = CKV_SCALE_BLOCK // 2
    off = p0 + tl.arange(0, NP // BYTES)[None, :, None] * BYTES + tl.arange(0, BYTES)[None, None, :]
    return tl.load(ckv_ptr + loc[:, None, None] * (DIM // 2) + off, mask=valid[:, None, None], other=0)


@triton.jit
def _fp4_row_bytes(ckv_ptr, loc, valid, p0, NP: tl.constexpr, DIM: tl.constexpr):
    """`_fp4_bytes` loaded as rows [rows, NP] and viewed as [rows, NP / 8, 8]: the PV values.
    Loaded in three dimensions, the lanes of a warp ran along the keys, so the decoded values
    reached the wgmma's shared-memory operand key-major, one 16-bit store per value (65
    `STS.U16` in the loop at one channel slice, sm_90 SASS); loaded as rows, the lanes run
    along a row's bytes (16-byte loads), the operand is stored channel-major in 16-byte stores,
    and 34 fewer byte permutes remain. The logits' key pieces (32 bytes a row, the A operand
    from registers) gained nothing from it."""
    BYTES: tl.constexpr = CKV_SCALE_BLOCK // 2
    row = tl.load(ckv_ptr + loc[:, None] * (DIM // 2) + p0 + tl.arange(0, NP)[None, :], mask=valid[:, None], other=0)
    return tl.reshape(row, (row.shape[0], NP // BYTES, BYTES))


@triton.jit
def _fp4_pairs(ckv_ptr, scale, loc, valid, p0, NP: tl.constexpr, DIM: tl.constexpr, BLOCK_N: tl.constexpr, PTX: tl.constexpr):
    """Channel pairs p0 .. p0 + NP of the compressed entries at cache rows loc, with their
    scales [BLOCK_N, NP / 8], as their (even, odd) channels, bf16 [BLOCK_N, NP] each (0 where
    not valid)."""
    return _fp4_decode(_fp4_bytes(ckv_ptr, loc, valid, p0, NP, DIM), scale, NP, BLOCK_N, PTX)


@triton.jit
def _fp4_decode(byte, scale, NP: tl.constexpr, BLOCK_N: tl.constexpr, PTX: tl.constexpr):
    """`_fp4_pairs` of the loaded bytes [BLOCK_N, NP / 8, 8] and scales [BLOCK_N, NP / 8]."""
    if PTX:  # (if / else: the other form's code would be built too)
        per_byte = tl.broadcast_to(scale.to(tl.bfloat16)[:, :, None], byte.shape)  # a pack of 4: two bf16 pairs
        lo = tl.inline_asm_elementwise(_FP4_EVEN_PTX, "=r,=r,r,r,r", [byte, per_byte], dtype=tl.bfloat16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(_FP4_ODD_PTX, "=r,=r,r,r,r", [byte, per_byte], dtype=tl.bfloat16, is_pure=True, pack=4)
        lo = tl.reshape(lo, (BLOCK_N, NP))
        hi = tl.reshape(hi, (BLOCK_N, NP))
    else:
        byte = byte.to(tl.int32)
        scale = scale[:, :, None] * 16384.0
        lo = tl.reshape(_e2m1_over_2e14(byte) * scale, (BLOCK_N, NP)).to(tl.bfloat16)
        hi = tl.reshape(_e2m1_over_2e14(byte >> 4) * scale, (BLOCK_N, NP)).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _bf16_halves(words):
    """int32 words of two bf16 channels (the even one in the low half) -> the (even, odd)
    channels, bf16."""
    return (words << 16).to(tl.float32, bitcast=True).to(tl.bfloat16), (words & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _bf16_words(ptr, row, valid, p0, NP: tl.constexpr, DIM: tl.constexpr):
    """Channel pairs p0 .. p0 + NP of rows `row` of a bf16 [rows, DIM] tensor (V4's compressed
    KV) as int32 words of two channels [rows, NP] (0 where not valid)."""
    pair = p0 + tl.arange(0, NP)
    return tl.load(ptr.to(tl.pointer_type(tl.int32)) + row[:, None] * (DIM // 2) + pair[None, :], mask=valid[:, None], other=0)


@triton.jit
def _window_pairs(kv_new_ptr, ring_ptr, ring_scale_ptr, stride_kv, kpos, valid, start, row0, slot, p0,
                  NP: tl.constexpr, WINDOW: tl.constexpr, DIM: tl.constexpr, BLOCK_N: tl.constexpr, RING_RAW: tl.constexpr):
    """Channel pairs p0 .. p0 + NP of the window keys at positions kpos, as `_fp4_pairs`: the
    ring's keys below the step's first position (FP8 codes, or bf16 values if RING_RAW), this
    step's keys from there on."""
    ring, ring_scale, words = _window_loads(kv_new_ptr, ring_ptr, ring_scale_ptr, stride_kv, kpos, valid, start, row0, slot, p0, NP, WINDOW, DIM, RING_RAW)
    return _window_decode(ring, ring_scale, words, NP, BLOCK_N, RING_RAW)


@triton.jit
def _window_loads(kv_new_ptr, ring_ptr, ring_scale_ptr, stride_kv, kpos, valid, start, row0, slot, p0,
                  NP: tl.constexpr, WINDOW: tl.constexpr, DIM: tl.constexpr, RING_RAW: tl.constexpr):
    """The loads of `_window_pairs`, not yet decoded (`_window_decode`): the ring's codes as
    int32 [BLOCK_N, NP / 16, 16] (two e4m3 codes each) and their scale bytes [BLOCK_N, NP / 16],
    or its bf16 words if RING_RAW (then the scales are the words again, unused), and this
    step's keys as int32 words; each key's ring or kv_new load masked to 0."""
    PAIRS: tl.constexpr = RING_SCALE_BLOCK // 2
    in_ring = valid & (kpos < start)
    in_new = valid & (kpos >= start)
    g = tl.arange(0, NP // PAIRS)
    pair = p0 + g[None, :, None] * PAIRS + tl.arange(0, PAIRS)[None, None, :]
    ring_row = slot * WINDOW + tl.where(valid, kpos, 0) % WINDOW
    if RING_RAW:  # bf16 values: int32 words of two channels, as kv_new's
        ring = tl.load(ring_ptr.to(tl.pointer_type(tl.int32)) + ring_row[:, None, None] * (DIM // 2) + pair, mask=in_ring[:, None, None], other=0)
        ring_scale = ring
    else:
        ring = tl.load(ring_ptr.to(tl.pointer_type(tl.uint16)) + ring_row[:, None, None] * (DIM // 2) + pair, mask=in_ring[:, None, None], other=0).to(tl.int32)
        ring_scale = tl.load(ring_scale_ptr + ring_row[:, None] * (DIM // RING_SCALE_BLOCK) + p0 // PAIRS + g[None, :], mask=in_ring[:, None], other=0)
    new_row = row0 + tl.where(in_new, kpos - start, 0)
    words = tl.load(kv_new_ptr.to(tl.pointer_type(tl.int32)) + new_row[:, None, None] * (stride_kv // 2) + pair, mask=in_new[:, None, None], other=0)
    return ring, ring_scale, words


@triton.jit
def _window_decode(ring, ring_scale, words, NP: tl.constexpr, BLOCK_N: tl.constexpr, RING_RAW: tl.constexpr):
    """`_window_pairs` of its loads (`_window_loads`)."""
    # each key's ring or kv_new load is masked to 0, so | (bf16 words) and + (values) merge the
    # two exactly. if / else, not an early return: the compiler would still build the FP8 code
    # after one, which needs the codes
    if RING_RAW:
        return _bf16_halves(tl.reshape(words | ring, (BLOCK_N, NP)))
    else:
        scale = e8m0_to_fp32(ring_scale)[:, :, None]
        lo = _fp8_code(ring) * scale + (words << 16).to(tl.float32, bitcast=True)
        hi = _fp8_code(ring >> 8) * scale + (words & -65536).to(tl.float32, bitcast=True)
        return tl.reshape(lo, (BLOCK_N, NP)).to(tl.bfloat16), tl.reshape(hi, (BLOCK_N, NP)).to(tl.bfloat16)


@triton.jit
def _dense_offsets(pair, PIECE: tl.constexpr):
    """Offsets of the even channels of channel pairs `pair` in a dense row (operand pieces;
    the odd ones follow PIECE later)."""
    return (pair // PIECE) * (2 * PIECE) + pair % PIECE


@triton.jit
def _dense_pairs(dense_ptr, row, valid, p0, NP: tl.constexpr, DIM: tl.constexpr, PIECE: tl.constexpr):
    """Channel pairs p0 .. p0 + NP of the dense copy's rows `row`, as `_fp4_pairs`."""
    pair = p0 + tl.arange(0, NP)
    base = dense_ptr + row[:, None] * DIM + _dense_offsets(pair, PIECE)[None, :]
    return tl.load(base, mask=valid[:, None], other=0.0), tl.load(base + PIECE, mask=valid[:, None], other=0.0)


@triton.jit
def _dense_ckv_kernel(ckv_ptr, ckv_scale_ptr, block_table_ptr, dense_ptr, n_blocks, entries, stride_bt,
                      PER_BLOCK: tl.constexpr, DIM: tl.constexpr, PIECE: tl.constexpr, ROWS: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr):
    """Program (request b, run of ROWS entries j < entries): entry j of b's compressed sequence
    (cache row block_tables[b, j // P] * P + j % P) to dense row b * entries + j, in operand
    pieces (module docstring); 0 where the table holds no cache block (-1 padding)."""
    begin(PDL)
    req = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    in_seq = j < entries
    block = tl.load(block_table_ptr + req * stride_bt + j // PER_BLOCK, mask=in_seq, other=-1).to(tl.int64)
    valid = in_seq & (block >= 0) & (block < n_blocks)
    loc = tl.where(valid, block, 0) * PER_BLOCK + j % PER_BLOCK
    scale = _fp4_scales(ckv_scale_ptr, loc, valid, 0, DIM // CKV_SCALE_BLOCK, DIM)
    lo, hi = _fp4_pairs(ckv_ptr, scale, loc, valid, 0, DIM // 2, DIM, ROWS, PTX)
    pair = tl.arange(0, DIM // 2)
    dst = dense_ptr + (req * entries + j)[:, None] * DIM + _dense_offsets(pair, PIECE)[None, :]
    tl.store(dst, lo, mask=in_seq[:, None])
    tl.store(dst + PIECE, hi, mask=in_seq[:, None])


@triton.jit
def _q_words(q_ptr, tok, heads, stride_qt, stride_qh, PIECE: tl.constexpr):
    """Pointers [PIECE, BLOCK_H] to q's int32 words (two channels each) of piece 0 of the
    head block, transposed (`_q_piece` reads piece c at + c * PIECE)."""
    pair = tl.arange(0, PIECE)
    return q_ptr.to(tl.pointer_type(tl.int32)) + (tok * stride_qt + heads[None, :] * stride_qh) // 2 + pair[:, None]


@triton.jit
def _q_piece(q_words, c, PIECE: tl.constexpr, h_ok):
    """q^T's piece c as (even, odd) channels, bf16 [PIECE, BLOCK_H] each (a B operand of the
    logits product), from q's words (`_q_words`): one 32-bit load per channel pair."""
    return _bf16_halves(tl.load(q_words + c * PIECE, mask=h_ok[None, :], other=0))


@triton.jit
def _q_pieces(q_ptr, tok, heads, h_ok, stride_qt, stride_qh, PIECE: tl.constexpr, DIM: tl.constexpr):
    """Every piece of q^T (`_q_piece`), loaded once per program: (lo, hi) tuples of DIM / 2 /
    PIECE pieces. (As 16-bit loads of each channel, this prologue took twice the loads.)"""
    q_words = _q_words(q_ptr, tok, heads, stride_qt, stride_qh, PIECE)
    lo = ()
    hi = ()
    for c in tl.static_range(DIM // 2 // PIECE):
        lo_c, hi_c = _q_piece(q_words, c, PIECE, h_ok)
        lo = lo + (lo_c,)
        hi = hi + (hi_c,)
    return lo, hi


@triton.jit
def _logit_tile(s_t, s_ptr, stat_ptr, sm_scale, valid, key, key_ok, tok, tile, n_tiles, heads, h_ok, H, n_keys):
    """Round the tile's logits (bf16, times the scale, bf16 again), store them (-inf where
    masked) and the tile's per-head max and sum of exp."""
    s_t = (s_t.to(tl.bfloat16).to(tl.float32) * sm_scale).to(tl.bfloat16).to(tl.float32)
    s_t = tl.where(valid[:, None], s_t, float("-inf"))
    m = tl.maximum(tl.max(s_t, axis=0), -1e30)  # finite even for a tile without valid keys
    l = tl.sum(tl.exp(s_t - m[None, :]), axis=0)
    tl.store(s_ptr + (tok * H + heads[None, :]) * n_keys + key[:, None], s_t.to(tl.bfloat16), mask=key_ok[:, None] & h_ok[None, :])
    stat = ((tok * n_tiles + tile) * H + heads) * 2
    tl.store(stat_ptr + stat, m, mask=h_ok)
    tl.store(stat_ptr + stat + 1, l, mask=h_ok)


@triton.jit
def _empty_tile(stat_ptr, tok, tile, n_tiles, heads, h_ok, H):
    """The statistics of a tile without a selected entry (those `_logit_tile` stores for an
    all-masked tile: max -1e30, sum 0); its logits are not stored (SKIP_EMPTY: the PV kernel
    skips the tile too)."""
    stat = ((tok * n_tiles + tile) * H + heads) * 2
    tl.store(stat_ptr + stat, tl.full(heads.shape, -1e30, tl.float32), mask=h_ok)
    tl.store(stat_ptr + stat + 1, tl.zeros(heads.shape, tl.float32), mask=h_ok)


@triton.jit
def _logits_kernel(
    q_ptr, kv_new_ptr, ring_ptr, ring_scale_ptr, ckv_ptr, ckv_scale_ptr, topk_ptr,
    token_req_ptr, pos_ptr, start_ptr, row_ptr, slot_ptr, floor_ptr, block_table_ptr,
    dense_ptr, s_ptr, stat_ptr,
    H, n_top, n_keys, n_tiles, tiles_per_program, sm_scale, dense_rows,
    stride_qt, stride_qh, stride_kv, stride_top, stride_bt,
    WINDOW: tl.constexpr, PER_BLOCK: tl.constexpr, DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PIECE: tl.constexpr, DENSE: tl.constexpr, DENSE_STAGES: tl.constexpr,
    RING_RAW: tl.constexpr, CKV_RAW: tl.constexpr, SKIP_EMPTY: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr,
):
    """Program (token, head block, run of tiles_per_program logits tiles). DENSE: the
    compressed keys from the dense copy (dense_rows rows per request). RING_RAW / CKV_RAW: the
    ring / the compressed KV hold bf16 values (no scales). PTX: FP4 entries decoded by
    `_fp4_ptx` (compiled CUDA; the interpreter takes the fp32 form, the same values).

    Outside DENSE a tile's keys come in pieces of PIECE channel pairs, each loaded, decoded
    (through shared memory where the layouts differ: barriers) and multiplied in turn; the loads
    of piece c + 1 are issued before piece c is decoded. Loaded where it is decoded, every piece
    waited for a global load after the barriers of the one before: a tile's eight pieces paid
    eight load latencies one after another (sm_90 SASS: each piece's loads issued after the
    previous piece's wgmma). On the H200 that took d1_8k's step 1.3% (~4 us of each of its 8
    logits calls, now ~14 us; docs/PERF.md, twenty-eighth session)."""
    begin(PDL)
    tok = tl.program_id(0).to(tl.int64)
    req = tl.load(token_req_ptr + tok)
    pos = tl.load(pos_ptr + tok)
    start = tl.load(start_ptr + req)
    row0 = tl.load(row_ptr + req)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    floor = tl.maximum(tl.load(floor_ptr + req), 0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    N_PIECES: tl.constexpr = DIM // 2 // PIECE
    if DENSE:
        # q's pieces from its words inside pipelined loops over the pieces (the same values as
        # `_q_pieces`), instead of all 16 held through the program: the registers of a second
        # program per SM
        q_words = _q_words(q_ptr, tok, heads, stride_qt, stride_qh, PIECE)
    else:
        q_lo, q_hi = _q_pieces(q_ptr, tok, heads, h_ok, stride_qt, stride_qh, PIECE, DIM)
    w_tiles = (WINDOW + BLOCK_N - 1) // BLOCK_N
    lo = tl.program_id(2) * tiles_per_program
    hi = tl.minimum(lo + tiles_per_program, n_tiles)
    # not software-pipelined: a stage of a 128-key window tile (ring codes and this step's bf16
    # keys, both read under masks) would take 192 KB of shared memory (DENSE pipelines its pieces)
    for tile in tl.range(lo, tl.minimum(hi, w_tiles), num_stages=1):
        idx = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        kpos = pos - (WINDOW - 1) + idx
        valid = (idx < WINDOW) & (kpos >= floor)
        s_t = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
        if DENSE:
            for c in tl.range(0, N_PIECES, num_stages=DENSE_STAGES):
                k_lo, k_hi = _window_pairs(kv_new_ptr, ring_ptr, ring_scale_ptr, stride_kv, kpos, valid, start, row0, slot, c * PIECE, PIECE, WINDOW, DIM, BLOCK_N, RING_RAW)
                q_lo_c, q_hi_c = _q_piece(q_words, c, PIECE, h_ok)
                s_t = tl.dot(k_lo, q_lo_c, s_t)
                s_t = tl.dot(k_hi, q_hi_c, s_t)
        else:  # pieces loaded one ahead (docstring)
            ring, ring_scale, words = _window_loads(kv_new_ptr, ring_ptr, ring_scale_ptr, stride_kv, kpos, valid, start, row0, slot, 0, PIECE, WINDOW, DIM, RING_RAW)
            for c in tl.static_range(N_PIECES):
                if c + 1 < N_PIECES:
                    next_ring, next_scale, next_words = _window_loads(kv_new_ptr, ring_ptr, ring_scale_ptr, stride_kv, kpos, valid, start, row0, slot,
                                                                      (c + 1) * PIECE, PIECE, WINDOW, DIM, RING_RAW)
                k_lo, k_hi = _window_decode(ring, ring_scale, words, PIECE, BLOCK_N, RING_RAW)
                s_t = tl.dot(k_lo, q_lo[c], s_t)
                s_t = tl.dot(k_hi, q_hi[c], s_t)
                if c + 1 < N_PIECES:
                    ring, ring_scale, words = next_ring, next_scale, next_words
        _logit_tile(s_t, s_ptr, stat_ptr, sm_scale, valid, idx, idx < WINDOW, tok, tile, n_tiles, heads, h_ok, H, n_keys)
    for tile in range(tl.maximum(lo, w_tiles), hi):
        c_idx = (tile - w_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        entry = tl.load(topk_ptr + tok * stride_top + c_idx, mask=c_idx < n_top, other=-1)
        valid = entry >= 0
        taken = True  # (a constexpr: no branch without SKIP_EMPTY)
        if SKIP_EMPTY:
            taken = tl.max(valid.to(tl.int32), axis=0) > 0
        if taken:
            entry = tl.where(valid, entry, 0)
            s_t = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
            if DENSE:  # the bf16 keys go to shared memory by async copies
                row = req.to(tl.int64) * dense_rows + entry
                for c in tl.range(0, N_PIECES, num_stages=DENSE_STAGES):
                    k_lo, k_hi = _dense_pairs(dense_ptr, row, valid, c * PIECE, PIECE, DIM, PIECE)
                    q_lo_c, q_hi_c = _q_piece(q_words, c, PIECE, h_ok)
                    s_t = tl.dot(k_lo, q_lo_c, s_t)
                    s_t = tl.dot(k_hi, q_hi_c, s_t)
            else:
                block = tl.load(block_table_ptr + req * stride_bt + entry // PER_BLOCK, mask=valid, other=0).to(tl.int64)
                loc = block * PER_BLOCK + entry % PER_BLOCK
                if not CKV_RAW:
                    # the whole rows' scales in one (prefetched) load, each piece's groups picked out of it
                    GROUPS: tl.constexpr = PIECE // (CKV_SCALE_BLOCK // 2)
                    scales = tl.reshape(_fp4_scales(ckv_scale_ptr, loc, valid, 0, DIM // CKV_SCALE_BLOCK, DIM), (BLOCK_N, N_PIECES, GROUPS))
                    which = tl.arange(0, N_PIECES)[None, :, None]
                # pieces loaded one ahead (docstring)
                if CKV_RAW:
                    piece = _bf16_words(ckv_ptr, loc, valid, 0, PIECE, DIM)
                else:
                    piece = _fp4_bytes(ckv_ptr, loc, valid, 0, PIECE, DIM)
                for c in tl.static_range(N_PIECES):
                    if c + 1 < N_PIECES:
                        if CKV_RAW:
                            next_piece = _bf16_words(ckv_ptr, loc, valid, (c + 1) * PIECE, PIECE, DIM)
                        else:
                            next_piece = _fp4_bytes(ckv_ptr, loc, valid, (c + 1) * PIECE, PIECE, DIM)
                    if CKV_RAW:
                        k_lo, k_hi = _bf16_halves(piece)
                    else:
                        k_lo, k_hi = _fp4_decode(piece, tl.sum(tl.where(which == c, scales, 0.0), axis=1), PIECE, BLOCK_N, PTX)
                    s_t = tl.dot(k_lo, q_lo[c], s_t)
                    s_t = tl.dot(k_hi, q_hi[c], s_t)
                    if c + 1 < N_PIECES:
                        piece = next_piece
            _logit_tile(s_t, s_ptr, stat_ptr, sm_scale, valid, WINDOW + c_idx, c_idx < n_top, tok, tile, n_tiles, heads, h_ok, H, n_keys)
        else:
            _empty_tile(stat_ptr, tok, tile, n_tiles, heads, h_ok, H)


@triton.jit
def _top_entries(topk_ptr, tok, stride_top, tile, n_top, BLOCK_N: tl.constexpr):
    """The selected entries of top-k tile `tile` (-1 where none, and past the table)."""
    c_idx = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(topk_ptr + tok * stride_top + c_idx, mask=c_idx < n_top, other=-1)


@triton.jit
def _top_blocks(block_table_ptr, req, stride_bt, entry, PER_BLOCK: tl.constexpr, DENSE: tl.constexpr):
    """The cache block of each selected entry (0 where none); the dense copy needs none (the
    entries stand in)."""
    if DENSE:
        return entry
    else:
        valid = entry >= 0
        return tl.load(block_table_ptr + req * stride_bt + tl.where(valid, entry, 0) // PER_BLOCK, mask=valid, other=0).to(tl.int64)


@triton.jit
def _top_logits(s_row, tile, entry, h_ok, n_top, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, SKIP_EMPTY: tl.constexpr):
    """A top-k tile's stored logits, bf16 [BLOCK_H, BLOCK_N] (-inf past the table; SKIP_EMPTY:
    not read for a tile without an entry, whose logits were never stored)."""
    c_idx = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    keys = c_idx < n_top
    if SKIP_EMPTY:
        keys = keys & (c_idx * 0 + tl.max((entry >= 0).to(tl.int32), axis=0) > 0)
    return tl.load(s_row + WINDOW + c_idx[None, :], mask=h_ok[:, None] & keys[None, :], other=float("-inf"))


@triton.jit
def _top_values(ckv_ptr, ckv_scale_ptr, dense_ptr, entry, block, req, dense_rows, p0,
                PER_BLOCK: tl.constexpr, NP: tl.constexpr, DIM: tl.constexpr, PIECE: tl.constexpr, DENSE: tl.constexpr, CKV_RAW: tl.constexpr):
    """The loads of a top-k tile's values (channel pairs p0 .. p0 + NP, 0 where no entry), not
    yet decoded (`_top_decode`): the dense copy's bf16 halves, V4's bf16 words (twice), or
    V4.1's FP4 bytes and their scales."""
    valid = entry >= 0
    e = tl.where(valid, entry, 0)
    if DENSE:
        return _dense_pairs(dense_ptr, req.to(tl.int64) * dense_rows + e, valid, p0, NP, DIM, PIECE)
    else:
        loc = block * PER_BLOCK + e % PER_BLOCK
        if CKV_RAW:
            words = _bf16_words(ckv_ptr, loc, valid, p0, NP, DIM)
            return words, words
        else:
            scale = _fp4_scales(ckv_scale_ptr, loc, valid, p0 // (CKV_SCALE_BLOCK // 2), NP // (CKV_SCALE_BLOCK // 2), DIM)
            return _fp4_row_bytes(ckv_ptr, loc, valid, p0, NP, DIM), scale


@triton.jit
def _top_decode(x, y, NP: tl.constexpr, BLOCK_N: tl.constexpr, DENSE: tl.constexpr, CKV_RAW: tl.constexpr, PTX: tl.constexpr):
    """`_top_values`' loads as the bf16 (even, odd) channels the PV product takes."""
    if DENSE:
        return x, y
    else:
        if CKV_RAW:
            return _bf16_halves(x)
        else:
            return _fp4_decode(x, y, NP, BLOCK_N, PTX)


@triton.jit
def _pv_kernel(
    s_ptr, stat_ptr, kv_new_ptr, ring_ptr, ring_scale_ptr, ckv_ptr, ckv_scale_ptr, topk_ptr,
    token_req_ptr, pos_ptr, start_ptr, row_ptr, slot_ptr, floor_ptr, block_table_ptr, sink_ptr, dense_ptr, cos_ptr, sin_ptr, out_ptr,
    out_exp_ptr, H, n_top, n_keys, dense_rows,
    stride_kv, stride_top, stride_bt, stride_rope, stride_ot, stride_oh, stride_oe,
    WINDOW: tl.constexpr, PER_BLOCK: tl.constexpr, DIM: tl.constexpr, N_TILES: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DSPLIT: tl.constexpr, DENSE: tl.constexpr, PIECE: tl.constexpr, ROPE_HALF: tl.constexpr,
    FP8_OUT: tl.constexpr, RING_RAW: tl.constexpr, CKV_RAW: tl.constexpr, SKIP_EMPTY: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr,
):
    """Program (token, head block x channel slice): slice r of DSPLIT holds the channel pairs
    r * NP .. (r + 1) * NP - 1, their even channels in one accumulator and their odd ones in
    another. DENSE: the compressed values from the dense copy (pieces of PIECE pairs).
    RING_RAW / CKV_RAW: the ring / the compressed KV hold bf16 values (no scales). PTX: as the
    logits kernel's. ROPE_HALF > 0: the output's last ROPE_HALF pairs leave inverse-RoPE'd by
    the token's cos / sin (`_inverse_rope`); a slice holds both channels of its pairs for it.
    FP8_OUT: the output leaves as the next projection's FP8 input (`fp8_gemm.fp8_act_quant`'s
    codes into out_ptr, exponent bytes per 32 channels into out_exp_ptr [T, H * DIM / 32]),
    quantised from the rounded (and rotated) values, so the same bits as quantising the bf16
    output; a slice holds whole 32-channel blocks (its pairs are whole ring scale groups)."""
    begin(PDL)
    NP: tl.constexpr = DIM // 2 // DSPLIT  # channel pairs of the slice
    tok = tl.program_id(0).to(tl.int64)
    req = tl.load(token_req_ptr + tok)
    pos = tl.load(pos_ptr + tok)
    start = tl.load(start_ptr + req)
    row0 = tl.load(row_ptr + req)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    floor = tl.maximum(tl.load(floor_ptr + req), 0)
    heads = (tl.program_id(1) // DSPLIT) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    p0 = (tl.program_id(1) % DSPLIT) * NP
    # the tiles' statistics, merged in tile order, with the sink in the denominator. N_TILES is
    # fixed by the shapes, so the compiler sees the trip count and can issue a pass's loads
    # together instead of one L2 round trip per tile (a static_range would force that, but at
    # 164 instead of 124 registers for DSPLIT 4: one program per SM instead of two)
    stat = stat_ptr + ((tok * N_TILES) * H + heads) * 2
    m = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    for t in range(N_TILES):
        m = tl.maximum(m, tl.load(stat + t * H * 2, mask=h_ok, other=-1e30))
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0)
    m = tl.maximum(m, sink)
    denom = tl.exp(sink - m)
    for t in range(N_TILES):
        m_t = tl.load(stat + t * H * 2, mask=h_ok, other=-1e30)
        denom += tl.load(stat + t * H * 2 + 1, mask=h_ok, other=0.0) * tl.exp(m_t - m)

    s_row = s_ptr + (tok * H + heads[:, None]) * n_keys
    acc_a = tl.zeros((BLOCK_H, NP), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_H, NP), dtype=tl.float32)  # the odd channels
    for tile in range(0, (WINDOW + BLOCK_N - 1) // BLOCK_N):
        idx = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        kpos = pos - (WINDOW - 1) + idx
        valid = (idx < WINDOW) & (kpos >= floor)
        p = tl.exp(tl.load(s_row + idx[None, :], mask=h_ok[:, None] & (idx < WINDOW)[None, :], other=float("-inf")) - m[:, None])
        v_a, v_b = _window_pairs(kv_new_ptr, ring_ptr, ring_scale_ptr, stride_kv, kpos, valid, start, row0, slot, p0, NP, WINDOW, DIM, BLOCK_N, RING_RAW)
        acc_a = tl.dot(p.to(tl.bfloat16), v_a, acc_a)
        acc_b = tl.dot(p.to(tl.bfloat16), v_b, acc_b)
    # the selected entries' tiles, their loads issued a tile ahead (module docstring): tile t's
    # values and logits load during tile t - 1, its cache blocks during t - 2, its entries
    # during t - 3, so each load's address is in registers when it issues (loads past the table
    # are masked off: no traffic)
    entry = _top_entries(topk_ptr, tok, stride_top, 0, n_top, BLOCK_N)
    entry_1 = _top_entries(topk_ptr, tok, stride_top, 1, n_top, BLOCK_N)
    entry_2 = _top_entries(topk_ptr, tok, stride_top, 2, n_top, BLOCK_N)
    block_1 = _top_blocks(block_table_ptr, req, stride_bt, entry_1, PER_BLOCK, DENSE)
    s_t = _top_logits(s_row, 0, entry, h_ok, n_top, WINDOW, BLOCK_N, SKIP_EMPTY)
    x, y = _top_values(ckv_ptr, ckv_scale_ptr, dense_ptr, entry, _top_blocks(block_table_ptr, req, stride_bt, entry, PER_BLOCK, DENSE),
                       req, dense_rows, p0, PER_BLOCK, NP, DIM, PIECE, DENSE, CKV_RAW)
    for tile in tl.range(0, tl.cdiv(n_top, BLOCK_N), num_stages=1):  # (no pipelining by the compiler on top)
        s_next = _top_logits(s_row, tile + 1, entry_1, h_ok, n_top, WINDOW, BLOCK_N, SKIP_EMPTY)
        x_next, y_next = _top_values(ckv_ptr, ckv_scale_ptr, dense_ptr, entry_1, block_1, req, dense_rows, p0,
                                     PER_BLOCK, NP, DIM, PIECE, DENSE, CKV_RAW)
        block_2 = _top_blocks(block_table_ptr, req, stride_bt, entry_2, PER_BLOCK, DENSE)
        entry_3 = _top_entries(topk_ptr, tok, stride_top, tile + 3, n_top, BLOCK_N)
        taken = True  # (a constexpr: no branch without SKIP_EMPTY)
        if SKIP_EMPTY:  # a tile without an entry: the logits kernel stored nothing, every probability is 0
            taken = tl.max((entry >= 0).to(tl.int32), axis=0) > 0
        if taken:
            p = tl.exp(s_t - m[:, None])
            v_a, v_b = _top_decode(x, y, NP, BLOCK_N, DENSE, CKV_RAW, PTX)
            acc_a = tl.dot(p.to(tl.bfloat16), v_a, acc_a)
            acc_b = tl.dot(p.to(tl.bfloat16), v_b, acc_b)
        entry, entry_1, entry_2, block_1 = entry_1, entry_2, entry_3, block_2
        s_t, x, y = s_next, x_next, y_next
    inv = (1.0 / denom)[:, None]
    pair = p0 + tl.arange(0, NP)
    even = (acc_a * inv).to(tl.bfloat16)
    odd = (acc_b * inv).to(tl.bfloat16)
    if ROPE_HALF > 0:
        even, odd = _inverse_rope(even, odd, cos_ptr + tok * stride_rope, sin_ptr + tok * stride_rope, pair, DIM // 2 - ROPE_HALF, PTX)
    row = tok * stride_ot + heads[:, None] * stride_oh
    if FP8_OUT:  # a block of 32 channels is 16 pairs: its even and odd halves quantised with one exponent
        BLOCKS: tl.constexpr = NP // (RING_SCALE_BLOCK // 2)
        which = tl.arange(0, NP)[None, :] // (RING_SCALE_BLOCK // 2)  # each pair's block in the slice
        ev, od = even.to(tl.float32), odd.to(tl.float32)
        mag = tl.maximum(tl.abs(ev), tl.abs(od))
        unit = tl.zeros((BLOCK_H, NP), dtype=tl.float32)
        for b in tl.static_range(BLOCKS):  # (per block over the whole tile: no reshape of the MMA layout)
            exp = fp8_exponent(tl.max(tl.where(which == b, mag, 0.0), axis=1))
            unit = tl.where(which == b, pow2(-exp)[:, None], unit)
            tl.store(out_exp_ptr + tok * stride_oe + (heads * DIM + 2 * p0) // RING_SCALE_BLOCK + b, (exp + 127).to(tl.uint8), mask=h_ok)
        # the codes from their bits (`fp8_gemm.e4m3_bits`), not the cast: packed two values a
        # register, the compiled cast lost every odd pair's even code (sm_90, Triton 3.6)
        lo = e4m3_bits(round_to_e4m3(ev * unit))
        hi = e4m3_bits(round_to_e4m3(od * unit))
        tl.store(out_ptr.to(tl.pointer_type(tl.int16)) + row // 2 + pair[None, :], (lo | (hi << 8)).to(tl.int16), mask=h_ok[:, None])  # one 16-bit store per pair
    else:
        lo = even.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF  # one int32 word of two channels per store
        hi = odd.to(tl.int16, bitcast=True).to(tl.int32) << 16
        tl.store(out_ptr.to(tl.pointer_type(tl.int32)) + row // 2 + pair[None, :], lo | hi, mask=h_ok[:, None])


@triton.jit
def _inverse_rope(even, odd, cos_row, sin_row, pair, first, PTX: tl.constexpr):
    """The output's channel pairs `pair` (bf16 [BLOCK_H, NP] even and odd channels) with the pairs
    from `first` on rotated back by the token's angles (cos_row / sin_row: its tables' row,
    pair p at p - first): `ops.rope.apply_rope_(..., inverse=True)` on the rounded output —
    fp32 products each rounded on its own, their difference / sum rounded to bf16."""
    rot = pair >= first
    c = tl.load(cos_row + (pair - first), mask=rot, other=0.0).to(tl.float32)[None, :]
    s = -tl.load(sin_row + (pair - first), mask=rot, other=0.0).to(tl.float32)[None, :]
    e2, o2 = rotate_pairs(even.to(tl.float32), odd.to(tl.float32), c, s, PTX)
    return tl.where(rot[None, :], e2.to(tl.bfloat16), even), tl.where(rot[None, :], o2.to(tl.bfloat16), odd)


def _rope_tables(inverse_rope, t: int, dim: int, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_attention`'s inverse_rope checked: (cos, sin) [T, half], half a power of two up to
    dim / 2, one dtype and row stride (the kernel takes one); None -> a placeholder pair the
    kernel never reads."""
    if inverse_rope is None:
        return placeholder.view(1, -1), placeholder.view(1, -1)
    cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in inverse_rope)
    half = cos.shape[-1] if cos.dim() == 2 else 0
    if cos.dim() != 2 or cos.shape[0] != t or half & (half - 1) or not 0 < 2 * half <= dim or sin.shape != cos.shape:
        raise ValueError(f"sparse_attention: inverse_rope must be (cos, sin) [{t}, half] with half a power of two <= {dim // 2}, got {_described(cos)} / {_described(sin)}")
    if sin.dtype != cos.dtype or sin.stride(0) != cos.stride(0):
        cos, sin = cos.contiguous(), sin.to(cos.dtype).contiguous()
    return cos, sin


def _described(x: torch.Tensor | None) -> str:
    """dtype and shape for an error message."""
    return "None" if x is None else f"{x.dtype} {list(x.shape)}"


def _check(q, kv_new, ring_codes, ring_scales, ckv_codes, ckv_scales, topk) -> None:
    t, _, dim = q.shape
    if q.dtype != torch.bfloat16 or kv_new.dtype != torch.bfloat16 or tuple(kv_new.shape) != (t, dim):
        raise ValueError(f"sparse_attention: q must be bf16 [T, H, D] and kv_new bf16 [T, D], got {list(q.shape)} {q.dtype}, {list(kv_new.shape)} {kv_new.dtype}")
    if dim % RING_SCALE_BLOCK.value or dim & (dim - 1):
        raise ValueError(f"sparse_attention: head_dim must be a power of two multiple of {RING_SCALE_BLOCK.value}, got {dim}")

    def rows(x: torch.Tensor, dtype: torch.dtype, width: int) -> bool:
        return x.dtype == dtype and x.dim() == 3 and x.shape[2] == width

    if ring_scales is None:
        ring_ok = rows(ring_codes, torch.bfloat16, dim)
    else:  # ue8m0 scales come as uint8 or float8_e8m0fnu: any one-byte dtype
        ring_ok = (rows(ring_codes, torch.float8_e4m3fn, dim) and ring_scales.element_size() == 1
                   and tuple(ring_scales.shape) == (*ring_codes.shape[:2], dim // RING_SCALE_BLOCK.value))
    if not ring_ok:
        raise ValueError(f"sparse_attention: ring_codes must be float8_e4m3fn [S, W, {dim}] with ring_scales one ue8m0 byte per "
                         f"{RING_SCALE_BLOCK.value} channels [S, W, {dim // RING_SCALE_BLOCK.value}], or V4's bf16 values [S, W, {dim}] "
                         f"with ring_scales None; got ring_codes {_described(ring_codes)}, ring_scales {_described(ring_scales)}")
    if ckv_scales is None:
        ckv_ok = rows(ckv_codes, torch.bfloat16, dim)
    else:
        ckv_ok = (rows(ckv_codes, torch.uint8, dim // 2) and ckv_scales.dtype == torch.float8_e4m3fn
                  and tuple(ckv_scales.shape) == (*ckv_codes.shape[:2], dim // CKV_SCALE_BLOCK.value))
    if not ckv_ok:
        raise ValueError(f"sparse_attention: ckv_codes must be packed FP4 uint8 [NB, P, {dim // 2}] with ckv_scales float8_e4m3fn "
                         f"[NB, P, {dim // CKV_SCALE_BLOCK.value}], or V4's bf16 values [NB, P, {dim}] with ckv_scales None; "
                         f"got ckv_codes {_described(ckv_codes)}, ckv_scales {_described(ckv_scales)}")
    if topk.dim() != 2 or topk.shape[0] != t:
        raise ValueError(f"sparse_attention: topk must be [T, k], got {list(topk.shape)}")
    for name, x in (("ring_codes", ring_codes), ("ring_scales", ring_scales), ("ckv_codes", ckv_codes), ("ckv_scales", ckv_scales)):
        if x is not None and not x.is_contiguous():
            raise ValueError(f"sparse_attention: {name} must be contiguous")


def launch_plan(t: int, h: int, dim: int, window: int, n_top: int, device: torch.device, cfg: dict, requests: int, entries: int,
                fp4_ckv: bool = True) -> dict:
    """Grid choices of a call of t tokens with `requests` block tables of `entries` compressed
    entries each (max_blocks x P), FP4 ones unless `fp4_ckv` is False (V4's bf16): tokens per
    launch pair (the most whose workspace fits WORKSPACE_MAX_BYTES), logits tiles, logits head
    block, logits programs per (token, head block), PV channel slices and PV key tile (for a
    launch of that many tokens), and whether the compressed keys are read from a dense bf16
    copy (DENSE_CKV; "auto"; FP4 entries only, see DENSE_MIN_USES; one copy serves every
    launch). None of them changes any result.
    Logits: the widest head block that gives at least half as many programs as SMs (a narrower
    block dequantises every key again), tiles per program counted in whole waves
    (`logit_tiles_per_program`; 64 tokens: 3 tiles a program, 114.3 -> 111.2 us a call on the
    H100, attention_sweep, nineteenth session).
    PV: 16 channel slices while they fit in one wave, else the most slices that keep the
    programs within half the SMs. (attention_sweep, device call S3-1: DSPLIT 1 instead of 4
    took T=64 from 139 to 115 us, LOGIT_BLOCK_H 32 instead of 16 T=8 from 61 to 54 us; S4-2:
    16 slices of 64-key tiles instead of 8 of 32 took T=1 from 47.9 to 35.5 us and T=8 from
    49.5 to 39.3, while at T=64 two slices were 25% slower than one.)"""
    bh = cfg["BLOCK_H"]
    n_tiles = triton.cdiv(window, cfg["LOGIT_BLOCK_N"]) + triton.cdiv(n_top, cfg["LOGIT_BLOCK_N"])
    tokens = max(1, min(t, WORKSPACE_MAX_BYTES // workspace_bytes(1, h, window + n_top, n_tiles)))
    rows = tokens * triton.cdiv(h, bh)
    sms = num_sms(device)
    lbh = cfg["LOGIT_BLOCK_H"]
    if lbh == "auto":
        lbh = next((b for b in LOGIT_BLOCK_HS if tokens * triton.cdiv(h, b) * n_tiles >= sms // 2), LOGIT_BLOCK_HS[-1])
    if lbh not in LOGIT_BLOCK_HS:
        raise ValueError(f"sparse_attention: LOGIT_BLOCK_H must be 'auto' or one of {LOGIT_BLOCK_HS}, got {lbh!r}")
    logit_rows = tokens * triton.cdiv(h, lbh)
    tiles = cfg["TILES_PER_PROGRAM"]
    dense = cfg["DENSE_CKV"]
    if dense == "auto":
        copied = requests * entries
        dense = t * n_top >= DENSE_MIN_USES * copied and copied * dim * 2 <= DENSE_MAX_BYTES
    if dense not in (True, False):
        raise ValueError(f"sparse_attention: DENSE_CKV must be 'auto', True or False, got {dense!r}")
    dense = bool(dense and n_top > 0 and fp4_ckv)
    if tiles == "auto":
        tiles = logit_tiles_per_program(logit_rows, n_tiles, sms * (2 if dense and cfg["dense_logit_maxnreg"] else 1))
    dsplit = cfg["DSPLIT"]
    if dsplit == "auto":
        dsplit = next((d for d in WIDE_DSPLITS if rows * d <= sms), None)
        if dsplit is None:
            dsplit = max((d for d in AUTO_DSPLITS if rows * d <= sms // 2), default=1)
    if dsplit not in DSPLITS:
        raise ValueError(f"sparse_attention: DSPLIT must be 'auto' or one of {DSPLITS}, got {dsplit!r}")
    dsplit = min(dsplit, dim // RING_SCALE_BLOCK.value)  # a slice holds whole ring scale groups (16 pairs each)
    return {"tokens": tokens, "n_tiles": n_tiles, "LOGIT_BLOCK_H": lbh, "tiles_per_program": tiles, "logit_programs": triton.cdiv(n_tiles, tiles), "DSPLIT": dsplit,
            "PV_BLOCK_N": pv_block_n(dsplit, cfg), "DENSE_CKV": dense}


def logit_tiles_per_program(rows: int, n_tiles: int, resident: int) -> int:
    """Logits tiles per program for `rows` (token, head block) rows of n_tiles tiles, with
    `resident` programs at a time on the GPU (one per SM: the cache-key form takes 245
    registers): the most tiles whose rounds of tiles per SM (waves x tiles) are within 10% of
    the fewest. Waves count whole: at 64 tokens 2 tiles a program made 192 programs, two waves
    of 2 tile rounds where 128 programs of 3 tiles take one wave of 3; ties and small gains keep
    the larger tiles (q loaded once per program, e.g. at prefill)."""
    rounds = {k: triton.cdiv(rows * triton.cdiv(n_tiles, k), resident) * k for k in range(1, n_tiles + 1)}
    return max(k for k, r in rounds.items() if r <= 1.1 * min(rounds.values()))


def workspace_bytes(tokens: int, h: int, n_keys: int, n_tiles: int) -> int:
    """Bytes of a launch pair's workspace: the logits [tokens, H, keys] bf16 and the tiles'
    statistics [tokens, tiles, H, 2] fp32."""
    return tokens * h * (2 * n_keys + 8 * n_tiles)


def dense_ckv(ckv_codes: torch.Tensor, ckv_scales: torch.Tensor, block_tables: torch.Tensor, piece: int) -> torch.Tensor:
    """The dense bf16 copy of every compressed entry the block tables reach: [B * max_blocks *
    P, D], row b * max_blocks * P + j = entry j of request b, in operand pieces of `piece`
    pairs (module docstring); rows of -1 table slots are 0."""
    n_blocks, per_block, half = ckv_codes.shape
    requests, max_blocks = block_tables.shape
    entries = max_blocks * per_block
    dense = torch.empty(requests * entries, 2 * half, dtype=torch.bfloat16, device=ckv_codes.device)
    if dense.numel():
        _dense_ckv_kernel[(requests, triton.cdiv(entries, DENSE_ROWS))](
            ckv_codes, ckv_scales, block_tables, dense, n_blocks, entries, block_tables.stride(0),
            PER_BLOCK=per_block, DIM=2 * half, PIECE=piece, ROWS=DENSE_ROWS, PTX=ptx_convert(ckv_codes.device), num_warps=4, **pdl_launch(ckv_codes.device),
        )
    return dense


def pv_block_n(dsplit: int, cfg: dict) -> int:
    """Keys per PV tile: cfg's, or for "auto" 64 at 8 or more channel slices (half as many
    tiles one after another; a 64-key stage of all 512 channels, DSPLIT 1, would need 280 KB
    of shared memory), else 32."""
    bn = cfg["PV_BLOCK_N"]
    return (64 if dsplit >= 8 else 32) if bn == "auto" else bn


def sparse_attention(
    q: torch.Tensor,
    kv_new: torch.Tensor,
    ring_codes: torch.Tensor,
    ring_scales: torch.Tensor,
    ckv_codes: torch.Tensor,
    ckv_scales: torch.Tensor,
    topk: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    start_pos: torch.Tensor,
    row_start: torch.Tensor,
    slots: torch.Tensor,
    floors: torch.Tensor,
    block_tables: torch.Tensor,
    sink: torch.Tensor,
    softmax_scale: float,
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8_output: bool = False,
    *,
    config: dict | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA over window ring + selected compressed entries (module docstring).

    q bf16 [T, H, D] (after RoPE); kv_new bf16 [T, D] this step's window keys; ring_codes
    float8_e4m3fn [S, W, D] + ring_scales uint8 [S, W, D/32], or V4's bf16 ring [S, W, D] with
    ring_scales None; ckv_codes uint8 [NB, P, D/2] + ckv_scales float8_e4m3fn [NB, P, D/16], or
    V4's bf16 compressed KV [NB, P, D] with ckv_scales None (each cache's form independent of
    the other's); topk int [T, k] (-1 = none; k may be 0);
    token_req int [T] request of each token; positions int [T]; per request (int [B]):
    start_pos (first position of the step), row_start (its first row in q / kv_new), slots,
    floors (window keys below are invisible); block_tables int [B, max_blocks]; sink fp32 [H];
    inverse_rope: None, or the (cos, sin) tables [T, rd/2] the queries were rotated by: the
    output's trailing rd channels leave rotated back (`ops.rope.apply_rope_(out, cos, sin,
    inverse=True)`, the same bits), in the PV kernel's epilogue.
    fp8_output: the output as an FP8 projection's input instead, quantised in the same
    epilogue: (float8_e4m3fn codes [T, H, D], exponent bytes uint8 [T, H * D / 32]) — the bits of
    `fp8_gemm.fp8_act_quant(out.view(T, -1), 32)` without its launch.
    `config` overrides entries of CONFIG for this call (tiling experiments).
    -> bf16 [T, H, D] (or the pair above). Shapes alone decide the launches (one pair per
    `launch_plan` slice of tokens): no host synchronisation (CUDA graphs)."""
    _check(q, kv_new, ring_codes, ring_scales, ckv_codes, ckv_scales, topk)
    cfg = CONFIG if config is None else {**CONFIG, **config}
    t, h, dim = q.shape
    window, per_block = ring_codes.shape[1], ckv_codes.shape[1]
    out = torch.empty(t, h, dim, dtype=torch.float8_e4m3fn if fp8_output else torch.bfloat16, device=q.device)
    # FP8 output: exponent bytes per 32 channels, the blocks the slices hold whole (`launch_plan`)
    out_exps = torch.empty(t, h * dim // RING_SCALE_BLOCK.value if fp8_output else 0, dtype=torch.uint8, device=q.device)
    cos, sin = _rope_tables(inverse_rope, t, dim, out)
    if t == 0:
        return (out, out_exps) if fp8_output else out
    # kv_new and q are read and the output written in channel pairs (int32 words): 4-byte
    # aligned starts and even strides, else a fresh copy (`contiguous` would keep a
    # contiguous view that starts mid-word)
    if not (q.stride(-1) == 1 and q.stride(0) % 2 == 0 and q.stride(1) % 2 == 0 and q.data_ptr() % 4 == 0):
        q = q.clone(memory_format=torch.contiguous_format)
    if not (kv_new.stride(-1) == 1 and kv_new.stride(0) % 2 == 0 and kv_new.data_ptr() % 4 == 0):
        kv_new = kv_new.clone(memory_format=torch.contiguous_format)
    topk = topk.contiguous()
    n_top = topk.shape[1]
    sink = sink.float().contiguous()
    ring_raw, ckv_raw = ring_scales is None, ckv_scales is None
    dense_rows = block_tables.shape[1] * per_block  # a request's rows in the dense copy
    plan = launch_plan(t, h, dim, window, n_top, q.device, cfg, block_tables.shape[0], dense_rows, fp4_ckv=not ckv_raw)
    tokens, n_keys, n_tiles, bh = plan["tokens"], window + n_top, plan["n_tiles"], cfg["BLOCK_H"]
    piece = min(cfg["PIECE"], dim // 2)
    dense = plan["DENSE_CKV"]
    # without the copy, or without scales, the kernels take an unused pointer in its place
    dense_keys = dense_ckv(ckv_codes, ckv_scales, block_tables, piece) if dense else ckv_codes
    ring_scale_bytes = ring_codes if ring_raw else ring_scales.view(torch.uint8)
    ckv_scale_arg = ckv_codes if ckv_raw else ckv_scales
    # one workspace, reused by each launch pair in turn (stream order)
    logits = torch.empty(tokens, h, n_keys, dtype=torch.bfloat16, device=q.device)
    stats = torch.empty(tokens, n_tiles, h, 2, dtype=torch.float32, device=q.device)
    lbh = plan["LOGIT_BLOCK_H"]
    formats = {"RING_RAW": ring_raw, "CKV_RAW": ckv_raw, "SKIP_EMPTY": n_top > SKIP_EMPTY_MIN_ENTRIES, "PTX": ptx_convert(q.device)}
    # the tokens in slices of `tokens` rows; kv_new and the per-request tensors stay whole (a
    # token's window reads its request's rows of kv_new, which may lie in another slice)
    for t0 in range(0, t, tokens):
        rows = slice(t0, min(t0 + tokens, t))
        n = rows.stop - t0
        index = (token_req[rows], positions[rows], start_pos, row_start, slots, floors, block_tables)
        _logits_kernel[(n, triton.cdiv(h, lbh), plan["logit_programs"])](
            q[rows], kv_new, ring_codes, ring_scale_bytes, ckv_codes, ckv_scale_arg, topk[rows], *index, dense_keys, logits, stats,
            h, n_top, n_keys, n_tiles, plan["tiles_per_program"], float(softmax_scale), dense_rows,
            q.stride(0), q.stride(1), kv_new.stride(0), topk.stride(0), block_tables.stride(0),
            WINDOW=window, PER_BLOCK=per_block, DIM=dim, BLOCK_H=lbh, BLOCK_N=cfg["LOGIT_BLOCK_N"], PIECE=piece, DENSE=dense, DENSE_STAGES=cfg["dense_stages"],
            **formats, num_warps=cfg["logit_warps"], num_stages=cfg["logit_stages"],
            **({"maxnreg": cfg["dense_logit_maxnreg"]} if dense and cfg["dense_logit_maxnreg"] else {}), **pdl_launch(q.device),
        )
        _pv_kernel[(n, triton.cdiv(h, bh) * plan["DSPLIT"])](
            logits, stats, kv_new, ring_codes, ring_scale_bytes, ckv_codes, ckv_scale_arg, topk[rows], *index, sink, dense_keys,
            cos[rows] if inverse_rope is not None else cos, sin[rows] if inverse_rope is not None else sin, out[rows],
            out_exps[rows], h, n_top, n_keys, dense_rows,
            kv_new.stride(0), topk.stride(0), block_tables.stride(0), cos.stride(0), out.stride(0), out.stride(1), out_exps.stride(0),
            WINDOW=window, PER_BLOCK=per_block, DIM=dim, N_TILES=n_tiles, BLOCK_H=bh, BLOCK_N=plan["PV_BLOCK_N"], DSPLIT=plan["DSPLIT"], DENSE=dense, PIECE=piece,
            ROPE_HALF=cos.shape[1] if inverse_rope is not None else 0, FP8_OUT=fp8_output, **formats, num_warps=cfg["pv_warps"], num_stages=cfg["pv_stages"], **pdl_launch(logits.device),
        )
    return (out, out_exps) if fp8_output else out
