"""The indexer (V4.1's FP4 keys, V4-Flash's bf16 keys) as CUDA-graph-safe kernels (H200 fast
path); signatures and torch references in `dsv4.ops.indexer`.

Every kernel takes its per-row bounds from device tensors (`lengths`, `row_req`, `entries`),
sizes its grid from tensor shapes only and loops in-kernel up to the row's real length: no host
synchronisation, no data-dependent output shape, so a step can be captured in a CUDA graph at
the largest width and replayed with any lengths, doing work in proportion to the lengths.

* `index_scores` — program (group of ROWS rows, split s of S): the rows' BLOCK_N-column tiles s,
  s+S, s+2S, ... (strided, so every program gets a share of any length). A tile reads its
  keys through the block table — one contiguous [BLOCK_N, Dk/2] run of codes when column c is entry
  c and the tile lies in one block, else a gather per entry — as int32 words, dequantises them
  exactly to bf16 in registers (`fp8_gemm.dequant_fp4_key_words`: bit moves and two exact
  multiplies per pair, the second by 2**(byte-127) — no conversion unit) and multiplies them
  with the rows' queries as [keys, Dk] x [Dk, ROWS x H] on bf16 tensor cores into fp32 (exact
  products). The keys are the M side (wgmma row blocks of 64), loaded in fragment order
  (`fp8_gemm.fragment_rows`, `fragment_dot_order`; Dk = 128), so the dequantised tile is the
  wgmma's register operand without a shared-memory round trip; the queries are loaded with
  their channels in the same dot order. V4-Flash's keys are stored unquantised (bf16 [NB, P,
  Dk], RAW_KEYS): the tile is loaded as it is, channels in natural order, through the same
  block-table addressing. Rows of one request share a tile (prefill: the key read and
  dequantisation are paid once per ROWS rows); a group of rows of several requests scores them
  one after the other. Then relu, x Dk**-0.5, x the head weight, sum over heads.
  Each column is one dot product per head in one order whatever tile, split or group computes
  it (wgmma's per-element sums do not depend on N), so a row's scores are the same bits alone
  or in any batch. S only spreads short batches over the SMs (S = 1 for prefill-sized T).
* `block_max` — program (row, split): tiles of TILE_BLOCKS blocks, max per block, the newest
  block forced to +inf.
* `topk_ascending` — radix select on the order-preserving uint32 image of each score, one
  program per row looping over its columns: passes of `TOPK_CONFIG["DIGIT_BITS"]`-bit digits
  (7 of 5 bits, the last of 2; `tl.histogram` of the columns still matching the digits chosen so far) find
  the k-th largest key; one ordered compaction pass (`tl.cumsum`) then emits, in ascending
  column order, every column above it and the first columns equal to it — which is the
  lower-column tie rule and the ascending output at once. Rows of at most k columns skip the
  passes; a pass whose chosen digit holds exactly the columns still needed ends the search. A
  program whose columns fit one tile of at most `TOPK_CONFIG["RESIDENT_MAX"]` reads them once
  and keeps them in registers through the passes and the compaction, where the call's programs
  fit one wave (`topk_plan`); else they re-read their tiles each pass. Batches of fewer rows
  than SMs split rows longer than a chunk: each chunk selects its own top k (stage 1), then
  one program per row selects among the chunks' candidates (stage 2). Exact: a column of the
  row's top k is beaten (larger score, or equal and lower column) by fewer than k columns of
  the row, so also of its chunk; candidates are kept in (chunk, column) order, so stage 2's
  ties and output order are the row's. The result is a set of columns defined by the scores
  alone, so it is the same whichever path a row takes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsv4.ops.triton.fp8_gemm import (
    dequant_fp4_key_words, fragment_dot_order, fragment_input, fragment_rows, halves, num_sms, ptx_convert, step_scale_bytes,
)
from dsv4.ops.triton.pdl import begin, pdl_launch

IDX_SCALE_BLOCK = tl.constexpr(32)  # one ue8m0 byte per 32 channels of an indexer key
# BLOCK_N: columns per tile (wgmma's M: 64 per warp group of 4 warps; 128 is two row blocks
# a warp group). ROWS: from ROWS_MIN_T rows on, the rows a program stacks as the product's N
# when they are of one request and have no entry list (prefill chunks: a tile's keys are read
# and dequantised once for ROWS rows); a group of rows of several requests scores them one
# after the other, with the same bits. Smaller batches (decode: a request a row) take one row
# a program, whose kernel needs far fewer registers (sm_90, Triton 3.6: 125 vs 255 and a
# 120-byte spill at ROWS 4). MAX_STACKED_N: ROWS shrinks (`scores_rows`) so that ROWS x BLOCK_H
# (heads padded to a power of two) stays within it, whatever the key format: the fp32
# accumulator [BLOCK_N, N] alone takes BLOCK_N x N / (32 num_warps) registers a thread (N of
# them at BLOCK_N 128, 4 warps), so N = 128 already takes half of the 255 a thread can have and
# N = 256 cannot fit. V4.1's 32 heads keep ROWS 4; V4's 64 heads get 2 (sm_90, Triton 3.9
# compile, 64 heads: bf16 keys 224 registers at 2 rows, 255 and a 600-byte spill at 4; FP4
# keys 255 and a 200-byte spill at 4). PROGRAMS_PER_SM: the target of programs over all groups when T is
# small (the split S of a row never changes its bits). scripts/check_kernels.py (`indexer`)
# times alternatives: S13-2, against 64 columns / ROWS 8 / 8 programs an SM, decode T=64 x 64K
# 0.242 -> 0.168 ms, T=1 x 512K 0.031 -> 0.026, prefill 4096 x 16K 1.41 -> 1.23.
SCORES_CONFIG = {"BLOCK_N": 128, "num_warps": 4, "ROWS": 4, "ROWS_MIN_T": 256, "MAX_STACKED_N": 128, "PROGRAMS_PER_SM": 8}
FRAGMENT_DK = 128  # key width whose code tiles load in the wgmma operand's lane layout (V4.1's)
BLOCK_MAX_CONFIG = {"TILE_BLOCKS": 128, "num_warps": 4, "PROGRAMS_PER_SM": 4}
# BLOCK: columns per tile of every pass. A row is split into chunks of
# max(CHUNK, CHUNK_PER_K * k) columns when the batch has fewer rows than SMs (chunks much
# longer than k, so stage 2 reads a fraction of the row). 2048-column tiles at 8 warps
# (S13-4 sweep, k=512): T=64 x 16K 0.105 -> 0.080 ms, T=64 x 64K 0.150 -> 0.126, T=1 x 512K
# 0.202 -> 0.140 against 1024 at 4 warps.
# RESIDENT_MAX: programs that select among at most this many columns read them once into
# registers (one tile, at most RESIDENT_COLS a thread: 16 warps at 8192) instead of once per
# radix pass and again to compact: at one row, with the 8-bit digits then measured, 5 reads one
# after another (each an L2 round trip) per 2048-column tile, 20 for d1_8k's 8192 entries (8 and
# 32 at 5-bit digits). 0: never. Each column a thread holds
# takes about 7 registers (the compaction's scans), so (sm_90 compile, Triton 3.6) 8192 columns at
# 16 warps take 104-128 registers and spill 32 bytes at stage 1 only; 32 a thread took 226-255,
# and 16384 at 32 warps spilled up to 376 bytes. At one program an SM (16 warps) they only pay
# within one wave (`topk_plan`): H100, S26-1, k 512, us: T=1 x 4096 30.7 -> 16.5, T=64 x 16K
# in resident 8192-column chunks 80.2 -> 54.5, but T=64 x 64K (512 chunk programs) 129.7 ->
# 137.8, and a resident merge after re-read 16K chunks 141.0.
# DIGIT_BITS: bits a radix pass decides (5: 7 passes of 32-bin histograms, the last of 2 bits).
# Triton's histogram costs a ballot per digit bit and, per element slot, a popcount for each of
# the bins a lane owns, so narrower digits make each pass cheaper and add passes. check_kernels
# top-k sweep (H100, S27, k 512, us, 8 / 4 / 5 / 6 bits; every result exact): T=1 x 4096 16.4 /
# 15.0 / 13.4 / 15.6; T=1 x 16K 51.7 / 45.6 / 40.2 / 46.6; T=64 x 16K 53.5 / 50.0 / 42.9 / 46.3;
# T=64 x 64K 128.7 / 120.4 / 110.7 / 109.6; T=1 x 512K 138.1 / 122.4 / 109.5 / 115.2; a 4096-row
# prefill call 1361 / 1218 / 1114 / 1088.
TOPK_CONFIG = {"BLOCK": 2048, "num_warps": 8, "CHUNK": 16384, "CHUNK_PER_K": 8, "RESIDENT_MAX": 8192, "RESIDENT_COLS": 16, "DIGIT_BITS": 5}


def _fail(op: str, name: str, expected: str, got) -> None:
    raise ValueError(f"{op}: {name} must be {expected}, got {got}")


def _describe(x: torch.Tensor) -> str:
    return f"{x.dtype} {list(x.shape)}"


def _check_index(op: str, name: str, x: torch.Tensor, shape: tuple) -> None:
    if x.dtype not in (torch.int32, torch.int64) or tuple(x.shape) != shape:
        _fail(op, name, f"int32/int64 {list(shape)}", _describe(x))


# ----------------------------------------------------------------------------- index scores


@triton.jit
def _key_scale_bytes(scales_ptr, loc, ok, DK: tl.constexpr):
    """int32 [BLOCK_N, DK / 8]: the ue8m0 byte of every code word of the keys at `loc` (word w:
    channels 8w .. 8w + 7, in scale block w // 4)."""
    if DK == 128:  # an entry's 4 bytes are one aligned int32 word: one load per key
        word = tl.load(scales_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + loc, mask=ok, other=0)
        sb = step_scale_bytes(word, 0, 128, 8)
    else:
        word_block = tl.arange(0, DK // 8) // (IDX_SCALE_BLOCK // 8)
        sb = tl.load(scales_ptr + loc[:, None] * (DK // IDX_SCALE_BLOCK) + word_block[None, :], mask=ok[:, None], other=0).to(tl.int32)
    return sb


@triton.jit
def _key_channel(p, RAW_KEYS: tl.constexpr, FRAGMENT: tl.constexpr):
    """The key channel at dot position p: p itself for RAW_KEYS (bf16 keys multiplied as
    stored), else the position in `dequant_fp4_key_words`' order (with FRAGMENT relabelled by
    `fragment_dot_order`, 32 channels a lane), whose position e holds channel
    8 (e // 8) + (e % 8) // 2 + 4 (e % 2)."""
    if RAW_KEYS:
        channel = p
    else:
        if FRAGMENT:
            p = fragment_input(p, 32)
        channel = (p // 8) * 8 + (p % 8) // 2 + 4 * (p % 2)
    return channel


@triton.jit
def _sum_products(keys, q):
    """keys [M, C] . q [N, C] -> fp32 [M, N], the products exact, summed in channel order."""
    return tl.sum(keys.to(tl.float32)[:, :, None] * tl.trans(q).to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _rows_dot(keys, q_t, INTERPRETED: tl.constexpr):
    """[BLOCK_N columns in order, Dk] x [Dk, rows x heads]: exact bf16 products into fp32. In
    the interpreter as sums over an axis, a quarter of Dk at a time (numpy's matmul orders its
    sums by the operands' shapes, which would make a row's bits depend on how many rows share
    its tile; the interpreter caps tensors at 2**20 elements)."""
    if INTERPRETED:
        k0, k1 = halves(keys)
        q0, q1 = halves(tl.trans(q_t))
        k00, k01 = halves(k0)
        k10, k11 = halves(k1)
        q00, q01 = halves(q0)
        q10, q11 = halves(q1)
        acc = _sum_products(k00, q00) + _sum_products(k01, q01) + _sum_products(k10, q10) + _sum_products(k11, q11)
    else:
        acc = tl.dot(keys, q_t)
    return acc


@triton.jit
def _score_rows(
    q_ptr, w_ptr, codes_ptr, scales_ptr, block_table_ptr, lengths_ptr, entries_ptr, out_ptr,
    t0, req, split, n_split, H, width, scale,
    stride_qt, stride_qh, stride_wt, stride_bt, stride_et, stride_ot,
    ROWS: tl.constexpr, PER_BLOCK: tl.constexpr, DK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ENTRIES: tl.constexpr, CONTIGUOUS: tl.constexpr, RAW_KEYS: tl.constexpr, PTX: tl.constexpr, FRAGMENT: tl.constexpr,
    WARPS: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Scores of rows t0 .. t0 + ROWS - 1 (one request `req`; ROWS = 1 with HAS_ENTRIES) over
    this program's tiles: each tile's keys are read (and dequantised) once and multiplied with
    the rows' queries stacked as N = ROWS x BLOCK_H. codes_ptr: the FP4 code bytes with their
    scale bytes at scales_ptr, or with RAW_KEYS the bf16 keys themselves (scales_ptr unread)."""
    tl.static_assert(not (RAW_KEYS and FRAGMENT), "fragment order relabels FP4 keys dequantised in registers")
    rows = t0 + tl.arange(0, ROWS)
    lengths = tl.minimum(tl.load(lengths_ptr + rows).to(tl.int32), width)
    longest = tl.max(lengths, axis=0)
    n = tl.arange(0, ROWS * BLOCK_H)
    n_row = t0 + n // BLOCK_H
    head = n % BLOCK_H
    h_ok = head < H
    # the queries as [Dk, rows x heads], channels in dot-position order, loaded once
    ch = _key_channel(tl.arange(0, DK), RAW_KEYS, FRAGMENT)
    q_t = tl.load(q_ptr + n_row[None, :] * stride_qt + head[None, :] * stride_qh + ch[:, None], mask=h_ok[None, :], other=0.0).to(tl.bfloat16)
    head_w = tl.load(w_ptr + n_row * stride_wt + head, mask=h_ok, other=0.0) * scale
    r = tl.arange(0, BLOCK_N)
    if FRAGMENT:
        r = fragment_rows(r, BLOCK_N, WARPS)  # the column offset tile row r loads
    cols = tl.arange(0, BLOCK_N)
    for tile in range(split, tl.cdiv(longest, BLOCK_N), n_split):
        c = tile * BLOCK_N + r
        in_row = c < longest
        if HAS_ENTRIES:
            entry = tl.load(entries_ptr + t0 * stride_et + c, mask=in_row, other=-1).to(tl.int32)
            ok = entry >= 0
        else:
            entry = c
            ok = in_row
        if CONTIGUOUS:  # column c is entry c and the tile lies in one block: contiguous keys
            block = tl.load(block_table_ptr + req * stride_bt + (tile * BLOCK_N) // PER_BLOCK).to(tl.int64)
            loc = block * PER_BLOCK + (tile * BLOCK_N) % PER_BLOCK + r
        else:
            entry = tl.where(ok, entry, 0)
            block = tl.load(block_table_ptr + req * stride_bt + entry // PER_BLOCK, mask=ok, other=0).to(tl.int64)
            loc = block * PER_BLOCK + entry % PER_BLOCK
        if RAW_KEYS:
            keys = tl.load(codes_ptr + loc[:, None] * DK + tl.arange(0, DK)[None, :], mask=ok[:, None], other=0.0)
        else:
            words_ptr = codes_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            words = tl.load(words_ptr + loc[:, None] * (DK // 8) + tl.arange(0, DK // 8)[None, :], mask=ok[:, None], other=0)
            keys = dequant_fp4_key_words(words, _key_scale_bytes(scales_ptr, loc, ok, DK), PTX)
            keys = fragment_dot_order(keys, BLOCK_N, DK, FRAGMENT, WARPS, 32)
        acc = _rows_dot(keys, q_t, INTERPRETED)
        score = tl.sum(tl.reshape(tl.maximum(acc, 0.0) * head_w[None, :], (BLOCK_N, ROWS, BLOCK_H)), axis=2)
        cn = tile * BLOCK_N + cols
        written = cn[:, None] < lengths[None, :]
        if HAS_ENTRIES:
            score = tl.where(tl.load(entries_ptr + t0 * stride_et + cn, mask=cn < longest, other=-1)[:, None] >= 0, score, float("-inf"))
        tl.store(out_ptr + rows[None, :] * stride_ot + cn[:, None], score, mask=written)


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, codes_ptr, scales_ptr, block_table_ptr, row_req_ptr, lengths_ptr, entries_ptr, out_ptr,
    T, H, width, scale,
    stride_qt, stride_qh, stride_wt, stride_bt, stride_et, stride_ot,
    ROWS: tl.constexpr, PER_BLOCK: tl.constexpr, DK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ENTRIES: tl.constexpr, CONTIGUOUS: tl.constexpr, RAW_KEYS: tl.constexpr, PTX: tl.constexpr, FRAGMENT: tl.constexpr,
    WARPS: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr,
):
    """Program (group of ROWS rows, split): the group's rows share each dequantised key tile
    when they are of one request (a prefill chunk), else they are scored one after the other."""
    begin(PDL)
    t0 = tl.program_id(0).to(tl.int64) * ROWS
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    if ROWS == 1:
        _score_rows(q_ptr, w_ptr, codes_ptr, scales_ptr, block_table_ptr, lengths_ptr, entries_ptr, out_ptr,
                    t0, tl.load(row_req_ptr + t0).to(tl.int64), split, n_split, H, width, scale,
                    stride_qt, stride_qh, stride_wt, stride_bt, stride_et, stride_ot,
                    1, PER_BLOCK, DK, BLOCK_H, BLOCK_N, HAS_ENTRIES, CONTIGUOUS, RAW_KEYS, PTX, FRAGMENT, WARPS, INTERPRETED)
    else:
        g = t0 + tl.arange(0, ROWS)
        reqs = tl.load(row_req_ptr + g, mask=g < T, other=-1).to(tl.int64)
        if tl.min(reqs, axis=0) == tl.max(reqs, axis=0):
            _score_rows(q_ptr, w_ptr, codes_ptr, scales_ptr, block_table_ptr, lengths_ptr, entries_ptr, out_ptr,
                        t0, tl.max(reqs, axis=0), split, n_split, H, width, scale,
                        stride_qt, stride_qh, stride_wt, stride_bt, stride_et, stride_ot,
                        ROWS, PER_BLOCK, DK, BLOCK_H, BLOCK_N, HAS_ENTRIES, CONTIGUOUS, RAW_KEYS, PTX, FRAGMENT, WARPS, INTERPRETED)
        else:
            for i in range(ROWS):
                t = t0 + i
                if t < T:
                    _score_rows(q_ptr, w_ptr, codes_ptr, scales_ptr, block_table_ptr, lengths_ptr, entries_ptr, out_ptr,
                                t, tl.load(row_req_ptr + t).to(tl.int64), split, n_split, H, width, scale,
                                stride_qt, stride_qh, stride_wt, stride_bt, stride_et, stride_ot,
                                1, PER_BLOCK, DK, BLOCK_H, BLOCK_N, HAS_ENTRIES, CONTIGUOUS, RAW_KEYS, PTX, FRAGMENT, WARPS, INTERPRETED)


def _block_h(heads: int) -> int:
    """Query heads a row takes in the product's N: a power of two (tl.arange), at least 16 (the
    tensor-core product's smallest N)."""
    return max(16, triton.next_power_of_2(heads))


def scores_rows(t: int, heads: int, has_entries: bool) -> int:
    """Rows an `index_scores` program stacks as the product's N (`SCORES_CONFIG`): ROWS from
    ROWS_MIN_T rows on, as many as fit MAX_STACKED_N columns of rows x padded heads (one row
    at least); one row with entry lists (a row's own)."""
    cfg = SCORES_CONFIG
    if has_entries or t < cfg["ROWS_MIN_T"]:
        return 1
    return max(1, min(cfg["ROWS"], cfg["MAX_STACKED_N"] // _block_h(heads)))


def _check_keys(op: str, key_codes, key_scales, per_block: int, dk: int) -> None:
    """FP4 keys (uint8 codes + ue8m0 scale bytes, V4.1) or, with key_scales None, bf16 keys
    (V4-Flash), entry-major and contiguous (the kernel addresses entry e of block b at
    (b * per_block + e) * row size)."""
    if key_scales is None:
        if key_codes.dtype != torch.bfloat16 or key_codes.dim() != 3 or tuple(key_codes.shape[1:]) != (per_block, dk):
            _fail(op, "key_codes", f"bf16 [NB, {per_block}, {dk}] (unquantised keys, as key_scales is None)", _describe(key_codes))
        if not key_codes.is_contiguous():
            _fail(op, "key_codes", "contiguous", "a strided tensor")
        return
    if dk < 32:
        _fail(op, "q", "[T, H, Dk] with Dk >= 32 for FP4 keys (ue8m0 scale per 32 channels)", f"Dk {dk}")
    if key_codes.dtype != torch.uint8 or key_codes.dim() != 3 or tuple(key_codes.shape[1:]) != (per_block, dk // 2):
        _fail(op, "key_codes", f"uint8 [NB, {per_block}, {dk // 2}] (per_block entries, Dk/2 packed bytes)", _describe(key_codes))
    if key_scales.dtype != torch.uint8 or tuple(key_scales.shape) != (key_codes.shape[0], per_block, dk // 32):
        _fail(op, "key_scales", f"uint8 [{key_codes.shape[0]}, {per_block}, {dk // 32}] (ue8m0 bytes)", _describe(key_scales))
    if not (key_codes.is_contiguous() and key_scales.is_contiguous()):
        _fail(op, "key_codes / key_scales", "contiguous", "strided tensors")


def index_scores(q, weights, key_codes, key_scales, block_tables, row_req, lengths, per_block: int, width: int, entries=None) -> torch.Tensor:
    """Triton `dsv4.ops.indexer.index_scores` (same contract; columns >= lengths[t] are left
    unwritten). q bf16 (or fp32 holding bf16 values) [T, H, Dk]; keys FP4 (key_codes uint8
    [NB, per_block, Dk/2], key_scales uint8 [NB, per_block, Dk/32]) or bf16 (key_codes bf16
    [NB, per_block, Dk], key_scales None)."""
    op = "index_scores"
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float32):
        _fail(op, "q", "bf16 [T, H, Dk] (fp32 holding bf16 values allowed)", _describe(q))
    t, h, dk = q.shape
    if dk < 16 or dk & (dk - 1):
        _fail(op, "q", "[T, H, Dk] with Dk a power of two >= 16 (the tensor-core product's K)", _describe(q))
    if weights.dtype != torch.float32 or tuple(weights.shape) != (t, h):
        _fail(op, "weights", f"float32 [{t}, {h}]", _describe(weights))
    _check_keys(op, key_codes, key_scales, per_block, dk)
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        _fail(op, "block_tables", "int32/int64 [B, max_blocks]", _describe(block_tables))
    _check_index(op, "row_req", row_req, (t,))
    _check_index(op, "lengths", lengths, (t,))
    if width < 0:
        _fail(op, "width", ">= 0", width)
    if entries is not None:
        _check_index(op, "entries", entries, (t, width))
    out = torch.empty(t, width, dtype=torch.float32, device=q.device)
    if t == 0 or width == 0:
        return out
    row_req, lengths = row_req.contiguous(), lengths.contiguous()
    cfg = SCORES_CONFIG
    bn = cfg["BLOCK_N"]
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    ent = out if entries is None else (entries if entries.stride(-1) == 1 else entries.contiguous())
    rows = scores_rows(t, h, entries is not None)
    raw = key_scales is None
    groups = triton.cdiv(t, rows)
    split = max(1, min(triton.cdiv(width, bn), triton.cdiv(cfg["PROGRAMS_PER_SM"] * num_sms(q.device), groups)))
    _index_scores_kernel[(groups, split)](
        q, weights, key_codes, key_codes if raw else key_scales, block_tables, row_req, lengths, ent, out,
        t, h, width, dk**-0.5,
        q.stride(0), q.stride(1), weights.stride(0), block_tables.stride(0), ent.stride(0), out.stride(0),
        ROWS=rows, PER_BLOCK=per_block, DK=dk, BLOCK_H=_block_h(h), BLOCK_N=bn, HAS_ENTRIES=entries is not None,
        CONTIGUOUS=entries is None and per_block % bn == 0, RAW_KEYS=raw, PTX=ptx_convert(q.device), FRAGMENT=not raw and dk == FRAGMENT_DK,
        WARPS=cfg["num_warps"], INTERPRETED=os.environ.get("TRITON_INTERPRET", "0") == "1", num_warps=cfg["num_warps"], **pdl_launch(q.device),
    )
    return out


# ----------------------------------------------------------------------------- block max


@triton.jit
def _block_max_kernel(scores_ptr, lengths_ptr, out_ptr, width, stride_st, stride_ot, BLOCK: tl.constexpr, TILE_BLOCKS: tl.constexpr, PDL: tl.constexpr):
    begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    length = tl.minimum(tl.load(lengths_ptr + t).to(tl.int32), width)
    n_blocks = tl.cdiv(length, BLOCK)
    newest = n_blocks - 1  # the block of column length - 1 (no block when the row is empty)
    for tile in range(split, tl.cdiv(n_blocks, TILE_BLOCKS), n_split):
        blocks = tile * TILE_BLOCKS + tl.arange(0, TILE_BLOCKS)
        c = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        v = tl.load(scores_ptr + t * stride_st + c, mask=c < length, other=float("-inf"))
        m = tl.where(blocks == newest, float("inf"), tl.max(v, axis=1))
        tl.store(out_ptr + t * stride_ot + blocks, m, mask=blocks < n_blocks)


def block_max(scores: torch.Tensor, lengths: torch.Tensor, block: int) -> torch.Tensor:
    """Triton `dsv4.ops.indexer.block_max` (blocks >= cdiv(lengths[t], block) unwritten)."""
    op = "block_max"
    if scores.dim() != 2 or scores.dtype != torch.float32:
        _fail(op, "scores", "float32 [T, width]", _describe(scores))
    t, width = scores.shape
    _check_index(op, "lengths", lengths, (t,))
    if block < 1 or block & (block - 1):
        _fail(op, "block", "a power of two", block)
    n_blocks = triton.cdiv(width, block)
    out = torch.empty(t, n_blocks, dtype=torch.float32, device=scores.device)
    if t == 0 or width == 0:
        return out
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    lengths = lengths.contiguous()
    cfg = BLOCK_MAX_CONFIG
    tb = max(1, cfg["TILE_BLOCKS"] // max(1, block // 8))  # ~1024 columns per tile
    split = max(1, min(triton.cdiv(n_blocks, tb), triton.cdiv(cfg["PROGRAMS_PER_SM"] * num_sms(scores.device), t)))
    _block_max_kernel[(t, split)](
        scores, lengths, out, width, scores.stride(0), out.stride(0), BLOCK=block, TILE_BLOCKS=tb, num_warps=cfg["num_warps"], **pdl_launch(scores.device)
    )
    return out


# ----------------------------------------------------------------------------- top-k


@triton.jit
def _ordered_key(v):
    """fp32 -> uint32 whose unsigned order is the float order (-0 and +0 equal, as in torch's
    comparisons): negative values have every bit flipped, the others the sign bit set."""
    bits = tl.where(v == 0.0, 0.0, v).to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)


@triton.jit
def _load_row(v_ptr, c, hi):
    """Scores of columns c (-inf past hi) and which of them can be picked (not -inf; NaN never)."""
    in_row = c < hi
    v = tl.load(v_ptr + c, mask=in_row, other=float("-inf"))
    return v, in_row & (v > float("-inf"))


@triton.jit
def _digit_hist(key, ok, prefix, mask, shift, DIGITS: tl.constexpr):
    """Histogram of the digit (key >> shift) & (DIGITS - 1) of the pickable keys still matching
    prefix."""
    return tl.histogram(((key >> shift) & (DIGITS - 1)).to(tl.int32), DIGITS, mask=ok & ((key & mask) == prefix))


@triton.jit
def _radix_pass(v_ptr, lo, hi, k, key, ok_tile, prefix, mask, need, done, BLOCK: tl.constexpr, RESIDENT: tl.constexpr,
                BITS: tl.constexpr, P: tl.constexpr):
    """Radix pass P of `_radix_threshold`: the digit of BITS bits below the P * BITS decided
    ones (the last pass: the bits left), chosen among the columns matching prefix."""
    if BITS * (P + 1) < 32:
        SHIFT: tl.constexpr = 32 - BITS * (P + 1)
    else:
        SHIFT: tl.constexpr = 0
    DIGITS: tl.constexpr = 1 << (32 - BITS * P - SHIFT)
    hist = tl.zeros([DIGITS], dtype=tl.int32)
    if RESIDENT:
        if not done:
            hist = _digit_hist(key, ok_tile, prefix, mask, SHIFT, DIGITS)
    else:
        offs = tl.arange(0, BLOCK)
        for i in range(0, tl.where(done, 0, tl.cdiv(hi - lo, BLOCK))):
            v, ok = _load_row(v_ptr, lo + i * BLOCK + offs, hi)
            hist += _digit_hist(_ordered_key(v), ok, prefix, mask, SHIFT, DIGITS)
    total = tl.sum(hist, 0)
    if P == 0:
        done = done | (total <= k)  # at most k pickable columns: all of them
    # the highest digit whose columns, with those of the digits above, reach `need`
    values = tl.arange(0, DIGITS)
    at_least = total - tl.cumsum(hist, 0) + hist
    digit = tl.max(tl.where(at_least >= need, values, -1), 0)
    above = tl.sum(tl.where(values > digit, hist, 0), 0)
    in_digit = tl.sum(tl.where(values == digit, hist, 0), 0)
    prefix = tl.where(done, prefix, prefix | (digit.to(tl.uint32) << SHIFT))
    mask = tl.where(done, mask, mask | (tl.full([], DIGITS - 1, tl.uint32) << SHIFT))
    left = need - above
    finished = in_digit == left  # every column of this digit is picked: no finer digit needed
    need = tl.where(done, need, left)
    return prefix, mask, need, done | finished


@triton.jit
def _radix_threshold(v_ptr, lo, hi, k, v_tile, ok_tile, BLOCK: tl.constexpr, RESIDENT: tl.constexpr, BITS: tl.constexpr):
    """The k-th largest key of columns lo..hi-1 (pickable ones; all of them when there are at
    most k) as (prefix, mask, need): pick the columns whose key & mask is above prefix, and the
    first `need` whose key & mask equals it. Digits of BITS bits from the top, the last pass
    taking what is left. RESIDENT (hi - lo <= BLOCK): the columns are the one tile (v_tile,
    ok_tile) the caller read, kept in registers through the passes; else every pass reads them
    again tile by tile."""
    prefix = tl.full([], 0, tl.uint32)
    mask = tl.full([], 0, tl.uint32)  # mask 0, prefix 0, need k: every pickable column
    need = k
    done = hi - lo <= k
    key = _ordered_key(v_tile) if RESIDENT else None
    for p in tl.static_range((32 + BITS - 1) // BITS):
        prefix, mask, need, done = _radix_pass(v_ptr, lo, hi, k, key, ok_tile, prefix, mask, need, done, BLOCK, RESIDENT, BITS, p)
    return prefix, mask, need


@triton.jit
def _topk_kernel(
    v_ptr, col_ptr, lengths_ptr, out_ptr, out_v_ptr, labels_ptr, width, k, chunk, stride_v, stride_c, stride_l,
    STAGE: tl.constexpr, BLOCK: tl.constexpr, RESIDENT: tl.constexpr, BITS: tl.constexpr, LABELS: tl.constexpr, PDL: tl.constexpr,
):
    """STAGE 0: the top k of a whole row -> out [T, k]. STAGE 1: of chunk s of the row (columns
    s*chunk ..) -> columns and scores out[t*S + s, :k]. STAGE 2: of the candidates row t of
    stage 1 left (cdiv(length, chunk) chunks of k, in column order) -> their columns, out [T, k].
    LABELS (stages 0 and 2): each picked column's label labels[t, col] is stored instead.
    RESIDENT: every program's columns fit one BLOCK (`topk_plan`), read once."""
    begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    length = tl.minimum(tl.load(lengths_ptr + t).to(tl.int32), width)
    if STAGE == 1:
        lo = tl.program_id(1) * chunk
        hi = tl.minimum(lo + chunk, length)
        out_row = t * tl.num_programs(1) + tl.program_id(1)
    elif STAGE == 2:
        lo = 0
        hi = tl.cdiv(length, chunk) * k
        out_row = t
    else:
        lo = 0
        hi = length
        out_row = t
    row_v = v_ptr + t * stride_v
    offs = tl.arange(0, BLOCK)
    if RESIDENT:  # the program's only read of its columns
        v_tile, ok_tile = _load_row(row_v, lo + offs, hi)
    else:
        v_tile, ok_tile = None, None
    prefix, mask, need = _radix_threshold(row_v, lo, hi, k, v_tile, ok_tile, BLOCK, RESIDENT, BITS)
    taken = tl.zeros([], tl.int32)
    equal_seen = tl.zeros([], tl.int32)
    for i in range(0, tl.cdiv(hi - lo, BLOCK)):
        c = lo + i * BLOCK + offs
        if RESIDENT:
            v, ok = v_tile, ok_tile
        else:
            v, ok = _load_row(row_v, c, hi)
        key = _ordered_key(v) & mask
        equal = ok & (key == prefix)
        pick = (ok & (key > prefix)) | (equal & (equal_seen + tl.cumsum(equal.to(tl.int32), 0) <= need))
        slot = taken + tl.cumsum(pick.to(tl.int32), 0) - 1
        if STAGE == 2:
            col = tl.load(col_ptr + t * stride_c + c, mask=pick, other=-1)
        else:
            col = c
        if LABELS and STAGE != 1:
            col = tl.load(labels_ptr + t * stride_l + col, mask=pick, other=-1)
        tl.store(out_ptr + out_row * k + slot, col, mask=pick)
        if STAGE == 1:
            tl.store(out_v_ptr + out_row * k + slot, v, mask=pick)
        taken += tl.sum(pick.to(tl.int32), 0)
        equal_seen += tl.sum(equal.to(tl.int32), 0)
    # pad with -1 (stage 1: only chunks stage 2 reads, those below the row's length)
    n_pad = tl.cdiv(k, BLOCK)
    if STAGE == 1:
        n_pad = tl.where(lo < length, n_pad, 0)
    for i in range(0, n_pad):
        slot = i * BLOCK + offs
        empty = (slot >= taken) & (slot < k)
        tl.store(out_ptr + out_row * k + slot, -1, mask=empty)
        if STAGE == 1:
            tl.store(out_v_ptr + out_row * k + slot, float("-inf"), mask=empty)


def topk_plan(rows: int, width: int, k: int, device: torch.device) -> tuple[int, int, bool]:
    """(chunk, chunks, resident) of the top-k for a batch shape; chunks == 1: one program per
    row. Resident (every program holds its columns in registers, `topk_tiles`) where the call
    fits one wave of programs: fewer rows than SMs, and, rows longer than RESIDENT_MAX split
    into chunks of RESIDENT_MAX, at most an SM's worth of chunk programs whose candidates fit
    one resident merge (at k 512 and one row: up to 128K columns). Else the row's tiles are
    re-read each pass, and small batches split rows into CHUNK columns. Shapes only, so a
    captured graph keeps its grid."""
    cfg = TOPK_CONFIG
    sms = num_sms(device)
    few = rows < sms and cfg["RESIDENT_MAX"] > 0
    if few and width <= cfg["RESIDENT_MAX"]:
        return width, 1, True
    if few and cfg["CHUNK_PER_K"] * k <= cfg["RESIDENT_MAX"]:
        chunks = triton.cdiv(width, cfg["RESIDENT_MAX"])
        if rows * chunks <= sms and chunks * k <= cfg["RESIDENT_MAX"]:
            return cfg["RESIDENT_MAX"], chunks, True
    chunk = triton.cdiv(max(cfg["CHUNK"], cfg["CHUNK_PER_K"] * k), cfg["BLOCK"]) * cfg["BLOCK"]
    chunks = triton.cdiv(width, chunk)
    if chunks <= 1 or rows >= sms:
        return width, 1, False
    return chunk, chunks, False


def topk_tiles(columns: int, resident: bool) -> dict:
    """The tile knobs of a top-k launch whose programs select among at most `columns` columns:
    resident, one tile of the next power of two (at least BLOCK), at most RESIDENT_COLS columns
    a thread; else BLOCK-column tiles read again by every pass."""
    cfg = TOPK_CONFIG
    if not resident:
        return {"BLOCK": cfg["BLOCK"], "RESIDENT": False, "num_warps": cfg["num_warps"]}
    block = max(triton.next_power_of_2(columns), cfg["BLOCK"])
    return {"BLOCK": block, "RESIDENT": True, "num_warps": max(cfg["num_warps"], block // (32 * cfg["RESIDENT_COLS"]))}


def topk_ascending(scores: torch.Tensor, lengths: torch.Tensor, k: int, labels: torch.Tensor | None = None) -> torch.Tensor:
    """Triton `dsv4.ops.indexer.topk_ascending`: int32 [T, k], picked columns (or their
    labels) ascending, -1 padded. Scores must not be NaN (a NaN column is never picked; the
    reference would count it among the top k and then drop it)."""
    op = "topk_ascending"
    if scores.dim() != 2 or scores.dtype != torch.float32:
        _fail(op, "scores", "float32 [T, width]", _describe(scores))
    t, width = scores.shape
    _check_index(op, "lengths", lengths, (t,))
    if labels is not None and (labels.dtype != torch.int32 or tuple(labels.shape) != (t, width)):
        _fail(op, "labels", f"int32 [{t}, {width}]", _describe(labels))
    if k < 0:
        _fail(op, "k", ">= 0", k)
    out = torch.empty(t, k, dtype=torch.int32, device=scores.device)
    if t == 0 or k == 0:
        return out
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    lengths = lengths.contiguous()
    lab = out if labels is None else (labels if labels.stride(-1) == 1 else labels.contiguous())
    opts = {"BITS": TOPK_CONFIG["DIGIT_BITS"], "LABELS": labels is not None, **pdl_launch(scores.device)}
    chunk, chunks, resident = topk_plan(t, width, k, scores.device)
    if chunks == 1:
        _topk_kernel[(t, 1)](scores, out, lengths, out, out, lab, width, k, width, scores.stride(0), 0, lab.stride(0), STAGE=0,
                             **topk_tiles(width, resident), **opts)
        return out
    cand = torch.empty(t * chunks, k, dtype=torch.int32, device=scores.device)
    cand_v = torch.empty(t * chunks, k, dtype=torch.float32, device=scores.device)
    _topk_kernel[(t, chunks)](scores, cand, lengths, cand, cand_v, lab, width, k, chunk, scores.stride(0), 0, lab.stride(0), STAGE=1,
                              **topk_tiles(chunk, resident), **opts)
    _topk_kernel[(t, 1)](cand_v, cand, lengths, out, out, lab, width, k, chunk, chunks * k, chunks * k, lab.stride(0), STAGE=2,
                         **topk_tiles(chunks * k, resident), **opts)
    return out


# ----------------------------------------------------------------------------- candidate pool


@triton.jit
def _pool_entries_kernel(cand_ptr, visible_ptr, out_ptr, n, stride_ct, stride_ot, BLOCK: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr):
    begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * TILE + tl.arange(0, TILE)  # candidate block of the row
    blocks = tl.load(cand_ptr + t * stride_ct + j, mask=j < n, other=-1).to(tl.int64)
    entries = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = (blocks >= 0)[:, None] & (entries < tl.load(visible_ptr + t).to(tl.int64))
    cols = j[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    tl.store(out_ptr + t * stride_ot + cols, tl.where(ok, entries, -1).to(tl.int32), mask=(j < n)[:, None])


POOL_TILE = 256  # candidate blocks per program


def pool_entries(cand: torch.Tensor, visible: torch.Tensor, block: int) -> torch.Tensor:
    """Triton `dsv4.ops.indexer.pool_entries` (one launch; the torch code is ~10)."""
    op = "pool_entries"
    if cand.dim() != 2 or cand.dtype not in (torch.int32, torch.int64):
        _fail(op, "cand", "int32/int64 [T, n_blocks]", _describe(cand))
    t, n = cand.shape
    _check_index(op, "visible", visible, (t,))
    if block < 1 or block & (block - 1):
        _fail(op, "block", "a power of two", block)
    out = torch.empty(t, n * block, dtype=torch.int32, device=cand.device)
    if t and n:
        cand = cand if cand.stride(-1) == 1 else cand.contiguous()
        _pool_entries_kernel[(t, triton.cdiv(n, POOL_TILE))](cand, visible.contiguous(), out, n, cand.stride(0), out.stride(0),
                                                               BLOCK=block, TILE=POOL_TILE, num_warps=4, **pdl_launch(cand.device))
    return out
