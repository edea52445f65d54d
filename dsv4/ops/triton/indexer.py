"""The V4.1 indexer as three CUDA-graph-safe kernels (H200 fast path); signatures and torch
references in `dsv4.ops.indexer`.

Every kernel takes its per-row bounds from device tensors (`lengths`, `row_req`, `entries`),
sizes its grid from tensor shapes only and loops in-kernel up to the row's real length: no host
synchronisation, no data-dependent output shape, so a step can be captured in a CUDA graph at
the largest width and replayed with any lengths, doing work in proportion to the lengths.

* `index_scores` — program (row, split s of S): the row's 64-column tiles s, s+S, s+2S, ...
  (strided, so every program of a row gets a share of any length). A tile reads its keys
  through the block table — one contiguous [64, Dk/2] run of codes when column c is entry c
  and the tile lies in one block, else a gather per entry — and multiplies them with the row's
  query as [keys, Dk] x [Dk, H] by `tl.dot_scaled` (e2m1 codes with ue8m0 bytes per 32
  channels, the query bf16): the compiler upcasts the codes to bf16 times 2**(byte-127), which
  is exact, and runs bf16 tensor cores into fp32 (exact products). The keys are the M side, so
  a tile is one wgmma row block and the heads the N side. Then relu, x Dk**-0.5, x the head
  weight, sum over heads. Each column is one dot product per head whatever tile or split
  computes it, so a row's scores are the same bits alone or in any batch. S only spreads short
  batches over the SMs (S = 1 for prefill-sized T). (Triton 3.9's interpreter runs
  `dot_scaled`, 3.6's has none: the CPU tests need 3.9; the GPU compiles it with either.)
* `block_max` — program (row, split): tiles of TILE_BLOCKS blocks, max per block, the newest
  block forced to +inf.
* `topk_ascending` — radix select on the order-preserving uint32 image of each score, one
  program per row looping over its columns: 4 passes of 8-bit digits (`tl.histogram` of the
  columns still matching the digits chosen so far) find the k-th largest key; one ordered
  compaction pass (`tl.cumsum`) then emits, in ascending column order, every column above it
  and the first columns equal to it — which is the lower-column tie rule and the ascending
  output at once. Rows of at most k columns skip the passes; a pass whose chosen digit holds
  exactly the columns still needed ends the search. Batches of fewer rows than SMs split rows
  longer than a chunk (`TOPK_CONFIG`): each chunk selects its own top k (stage 1), then one
  program per row selects among the chunks' candidates (stage 2). Exact: a column of the row's
  top k is beaten (larger score, or equal and lower column) by fewer than k columns of the
  row, so also of its chunk; candidates are kept in (chunk, column) order, so stage 2's ties
  and output order are the row's. The result is a set of columns defined by the scores alone,
  so it is the same whichever path a row takes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.triton.fp8_gemm import num_sms

IDX_SCALE_BLOCK = tl.constexpr(32)  # one ue8m0 byte per 32 channels of an indexer key
# Columns per tile: wgmma's M is 64 per warp group of 4 warps; ~96 registers on sm_90 (~127
# with an entry list), so 4-5 programs fit an SM (the gathers are not software-pipelined:
# programs in flight hide the latency). The e2m1 upcast dominates the instructions (~35 warp
# instructions per key at these tiles, ~30 at 128 columns; scripts/check_kernels.py times
# both). PROGRAMS_PER_SM: the target of programs over all rows when T is small (the split S
# of a row never changes its bits).
SCORES_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "PROGRAMS_PER_SM": 4}
BLOCK_MAX_CONFIG = {"TILE_BLOCKS": 128, "num_warps": 4, "PROGRAMS_PER_SM": 4}
# BLOCK: columns per tile of every pass. A row is split into chunks of
# max(CHUNK, CHUNK_PER_K * k) columns when the batch has fewer rows than SMs (chunks much
# longer than k, so stage 2 reads a fraction of the row).
TOPK_CONFIG = {"BLOCK": 1024, "num_warps": 4, "CHUNK": 16384, "CHUNK_PER_K": 8}


def _fail(op: str, name: str, expected: str, got) -> None:
    raise ValueError(f"{op}: {name} must be {expected}, got {got}")


def _describe(x: torch.Tensor) -> str:
    return f"{x.dtype} {list(x.shape)}"


def _check_index(op: str, name: str, x: torch.Tensor, shape: tuple) -> None:
    if x.dtype not in (torch.int32, torch.int64) or tuple(x.shape) != shape:
        _fail(op, name, f"int32/int64 {list(shape)}", _describe(x))


# ----------------------------------------------------------------------------- index scores


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, codes_ptr, scales_ptr, block_table_ptr, row_req_ptr, lengths_ptr, entries_ptr, out_ptr,
    H, width, scale,
    stride_qt, stride_qh, stride_wt, stride_bt, stride_et, stride_ot,
    PER_BLOCK: tl.constexpr, DK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ENTRIES: tl.constexpr, CONTIGUOUS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    length = tl.minimum(tl.load(lengths_ptr + t).to(tl.int32), width)
    req = tl.load(row_req_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    h_ok = heads < H
    # the query as [Dk, H], the N side of the product, loaded once
    q_t = tl.load(q_ptr + t * stride_qt + heads[None, :] * stride_qh + tl.arange(0, DK)[:, None], mask=h_ok[None, :], other=0.0).to(tl.bfloat16)
    w = tl.load(w_ptr + t * stride_wt + heads, mask=h_ok, other=0.0)
    cols = tl.arange(0, BLOCK_N)
    for tile in range(split, tl.cdiv(length, BLOCK_N), n_split):
        c = tile * BLOCK_N + cols
        in_row = c < length
        if HAS_ENTRIES:
            entry = tl.load(entries_ptr + t * stride_et + c, mask=in_row, other=-1).to(tl.int32)
            ok = entry >= 0
        else:
            entry = c
            ok = in_row
        if CONTIGUOUS:  # column c is entry c and the tile lies in one block: contiguous keys
            block = tl.load(block_table_ptr + req * stride_bt + (tile * BLOCK_N) // PER_BLOCK).to(tl.int64)
            loc = block * PER_BLOCK + (tile * BLOCK_N) % PER_BLOCK + cols
        else:
            entry = tl.where(ok, entry, 0)
            block = tl.load(block_table_ptr + req * stride_bt + entry // PER_BLOCK, mask=ok, other=0).to(tl.int64)
            loc = block * PER_BLOCK + entry % PER_BLOCK
        codes = tl.load(codes_ptr + loc[:, None] * (DK // 2) + tl.arange(0, DK // 2)[None, :], mask=ok[:, None], other=0)
        exps = tl.load(scales_ptr + loc[:, None] * (DK // IDX_SCALE_BLOCK) + tl.arange(0, DK // IDX_SCALE_BLOCK)[None, :], mask=ok[:, None], other=0)
        # [BLOCK_N, Dk] keys x [Dk, H]: the compiler's e2m1 upcast to bf16 times 2**(byte-127)
        # (exact), then bf16 tensor cores with an fp32 accumulator (exact products)
        acc = tl.dot_scaled(codes, exps, "e2m1", q_t, None, "bf16")
        score = tl.sum(tl.maximum(acc, 0.0) * scale * w[None, :], axis=1)
        tl.store(out_ptr + t * stride_ot + c, tl.where(ok, score, float("-inf")), mask=in_row)


def index_scores(q, weights, key_codes, key_scales, block_tables, row_req, lengths, per_block: int, width: int, entries=None) -> torch.Tensor:
    """Triton `dsv4.ops.indexer.index_scores` (same contract; columns >= lengths[t] are left
    unwritten). q bf16 (or fp32 holding bf16 values) [T, H, Dk]."""
    op = "index_scores"
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float32):
        _fail(op, "q", "bf16 [T, H, Dk] (fp32 holding bf16 values allowed)", _describe(q))
    t, h, dk = q.shape
    if dk < 32 or dk & (dk - 1):
        _fail(op, "q", "[T, H, Dk] with Dk a power of two >= 32 (ue8m0 scale per 32 channels)", _describe(q))
    if weights.dtype != torch.float32 or tuple(weights.shape) != (t, h):
        _fail(op, "weights", f"float32 [{t}, {h}]", _describe(weights))
    if key_codes.dtype != torch.uint8 or key_codes.dim() != 3 or tuple(key_codes.shape[1:]) != (per_block, dk // 2):
        _fail(op, "key_codes", f"uint8 [NB, {per_block}, {dk // 2}] (per_block entries, Dk/2 packed bytes)", _describe(key_codes))
    if key_scales.dtype != torch.uint8 or tuple(key_scales.shape) != (key_codes.shape[0], per_block, dk // 32):
        _fail(op, "key_scales", f"uint8 [{key_codes.shape[0]}, {per_block}, {dk // 32}] (ue8m0 bytes)", _describe(key_scales))
    if not (key_codes.is_contiguous() and key_scales.is_contiguous()):
        _fail(op, "key_codes / key_scales", "contiguous", "strided tensors")
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
    split = max(1, min(triton.cdiv(width, bn), triton.cdiv(cfg["PROGRAMS_PER_SM"] * num_sms(q.device), t)))
    _index_scores_kernel[(t, split)](
        q, weights, key_codes, key_scales, block_tables, row_req, lengths, ent, out,
        h, width, dk**-0.5,
        q.stride(0), q.stride(1), weights.stride(0), block_tables.stride(0), ent.stride(0), out.stride(0),
        PER_BLOCK=per_block, DK=dk, BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_N=bn, HAS_ENTRIES=entries is not None,
        CONTIGUOUS=entries is None and per_block % bn == 0,
        num_warps=cfg["num_warps"],
    )
    return out


# ----------------------------------------------------------------------------- block max


@triton.jit
def _block_max_kernel(scores_ptr, lengths_ptr, out_ptr, width, stride_st, stride_ot, BLOCK: tl.constexpr, TILE_BLOCKS: tl.constexpr):
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
        scores, lengths, out, width, scores.stride(0), out.stride(0), BLOCK=block, TILE_BLOCKS=tb, num_warps=cfg["num_warps"]
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
def _radix_threshold(v_ptr, lo, hi, k, BLOCK: tl.constexpr):
    """The k-th largest key of columns lo..hi-1 (pickable ones; all of them when there are at
    most k) as (prefix, mask, need): pick the columns whose key & mask is above prefix, and the
    first `need` whose key & mask equals it."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    n_tiles = tl.cdiv(hi - lo, BLOCK)
    prefix = tl.full([], 0, tl.uint32)
    mask = tl.full([], 0, tl.uint32)  # mask 0, prefix 0, need k: every pickable column
    need = k
    done = hi - lo <= k
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], dtype=tl.int32)
        for i in range(0, tl.where(done, 0, n_tiles)):
            v, ok = _load_row(v_ptr, lo + i * BLOCK + offs, hi)
            key = _ordered_key(v)
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=ok & ((key & mask) == prefix))
        total = tl.sum(hist, 0)
        if p == 0:
            done = done | (total <= k)  # at most k pickable columns: all of them
        # the highest digit whose columns, with those of the digits above, reach `need`
        at_least = total - tl.cumsum(hist, 0) + hist
        digit = tl.max(tl.where(at_least >= need, bins, -1), 0)
        above = tl.sum(tl.where(bins > digit, hist, 0), 0)
        in_digit = tl.sum(tl.where(bins == digit, hist, 0), 0)
        prefix = tl.where(done, prefix, prefix | (digit.to(tl.uint32) << shift))
        mask = tl.where(done, mask, mask | (tl.full([], 255, tl.uint32) << shift))
        left = need - above
        finished = in_digit == left  # every column of this digit is picked: no finer digit needed
        need = tl.where(done, need, left)
        done = done | finished
    return prefix, mask, need


@triton.jit
def _topk_kernel(
    v_ptr, col_ptr, lengths_ptr, out_ptr, out_v_ptr, width, k, chunk, stride_v, stride_c,
    STAGE: tl.constexpr, BLOCK: tl.constexpr,
):
    """STAGE 0: the top k of a whole row -> out [T, k]. STAGE 1: of chunk s of the row (columns
    s*chunk ..) -> columns and scores out[t*S + s, :k]. STAGE 2: of the candidates row t of
    stage 1 left (cdiv(length, chunk) chunks of k, in column order) -> their columns, out [T, k]."""
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
    prefix, mask, need = _radix_threshold(row_v, lo, hi, k, BLOCK)
    offs = tl.arange(0, BLOCK)
    taken = tl.zeros([], tl.int32)
    equal_seen = tl.zeros([], tl.int32)
    for i in range(0, tl.cdiv(hi - lo, BLOCK)):
        c = lo + i * BLOCK + offs
        v, ok = _load_row(row_v, c, hi)
        key = _ordered_key(v) & mask
        equal = ok & (key == prefix)
        pick = (ok & (key > prefix)) | (equal & (equal_seen + tl.cumsum(equal.to(tl.int32), 0) <= need))
        slot = taken + tl.cumsum(pick.to(tl.int32), 0) - 1
        if STAGE == 2:
            col = tl.load(col_ptr + t * stride_c + c, mask=pick, other=-1)
        else:
            col = c
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


def topk_chunks(rows: int, width: int, k: int, device: torch.device) -> tuple[int, int]:
    """(chunk, chunks) of the split top-k for a batch shape; chunks == 1: one program per row.
    Shapes only, so a captured graph keeps its grid."""
    cfg = TOPK_CONFIG
    chunk = triton.cdiv(max(cfg["CHUNK"], cfg["CHUNK_PER_K"] * k), cfg["BLOCK"]) * cfg["BLOCK"]
    chunks = triton.cdiv(width, chunk)
    if chunks <= 1 or rows >= num_sms(device):
        return width, 1
    return chunk, chunks


def topk_ascending(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Triton `dsv4.ops.indexer.topk_ascending`: int32 [T, k], picked columns ascending, -1
    padded. Scores must not be NaN (a NaN column is never picked; the reference would count it
    among the top k and then drop it)."""
    op = "topk_ascending"
    if scores.dim() != 2 or scores.dtype != torch.float32:
        _fail(op, "scores", "float32 [T, width]", _describe(scores))
    t, width = scores.shape
    _check_index(op, "lengths", lengths, (t,))
    if k < 0:
        _fail(op, "k", ">= 0", k)
    out = torch.empty(t, k, dtype=torch.int32, device=scores.device)
    if t == 0 or k == 0:
        return out
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    lengths = lengths.contiguous()
    cfg = TOPK_CONFIG
    opts = {"BLOCK": cfg["BLOCK"], "num_warps": cfg["num_warps"]}
    chunk, chunks = topk_chunks(t, width, k, scores.device)
    if chunks == 1:
        _topk_kernel[(t, 1)](scores, out, lengths, out, out, width, k, width, scores.stride(0), 0, STAGE=0, **opts)
        return out
    cand = torch.empty(t * chunks, k, dtype=torch.int32, device=scores.device)
    cand_v = torch.empty(t * chunks, k, dtype=torch.float32, device=scores.device)
    _topk_kernel[(t, chunks)](scores, cand, lengths, cand, cand_v, width, k, chunk, scores.stride(0), 0, STAGE=1, **opts)
    _topk_kernel[(t, 1)](cand_v, cand, lengths, out, out, width, k, chunk, chunks * k, chunks * k, STAGE=2, **opts)
    return out
