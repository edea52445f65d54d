"""Sparse MQA attention over the V4.1 caches, read in their stored formats (H200 fast path).

For every query token of a flat batch: one softmax over

* the window keys, positions max(floor, p - W + 1) .. p — keys below the step's first position
  p0 come from the request's FP8 ring (e4m3 codes + one ue8m0 byte per 32 channels, slot
  position % W), the step's own keys (positions >= p0) from `kv_new`, the bf16 keys this step
  computed (already FP8-rounded, as the model's QAT and the ring hold them). So the ring is
  written *after* attention, for decode and prefill alike, exactly like the reference
  (`Attention._window_keys` / `_write_ring`), and one kernel serves chunked prefill, decode and
  mixed batches without ordering constraints;
* the selected compressed entries `topk` [T, k] (entry index j of the request's compressed
  sequence, -1 = none), found through the block table at block j // P, offset j % P
  (P = block_size / ratio) of the paged FP4 cache (e2m1 packed two per byte, low nibble = even
  channel, one E4M3 scale per 16 channels);
* plus the per-head sink logit, which only enlarges the denominator.

K = V (one shared 512-wide latent for all heads). Numerics follow `Attention._attend`: the
logit is q.k rounded to bf16, times the softmax scale, rounded to bf16 again; the softmax is
fp32 (computed online); probabilities go to bf16 before multiplying V. Output bf16 [T, H, D].

Kernel layout: one program per (token, block of BLOCK_H heads[, chunk of the key list]); the
key tile is dequantised once and used by all heads of the block (MQA: the heads are the rows of
both tensor-core products). The key list is the window (padded to the key tile) followed by the
top-k entries. Few-token batches can give each chunk of CHUNK_TILES key tiles its own program
(flash-decoding) and merge the partial softmaxes, with the sink, in a second kernel.
`CONFIG["SPLIT"]` decides: "auto" splits when the unsplit grid would leave SMs idle (fastest,
but a token's bits then depend on its batch's size), "always" / "never" are batch-invariant
(every token takes the same path). Only V4.1's cache formats (FP8 ring, FP4 compressed KV) are
supported; V4's bf16 caches and all-visible HCA layers use the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.model import quant
from dsv4.ops.triton.fp8_gemm import e8m0_to_fp32, num_sms

# constexpr: the kernels read them (Python code uses .value)
RING_SCALE_BLOCK = tl.constexpr(32)  # ue8m0 byte per 32 channels of a window key
CKV_SCALE_BLOCK = tl.constexpr(16)  # E4M3 scale per 16 channels of a compressed entry
# Heads per program, keys per tile, tiles per chunk (the unit of the split: 128 keys), split
# policy (module docstring). Fixed rather than autotuned per batch size: the key tiling decides
# the rounding. 16 x 16 with 8 warps is the largest tiling that compiles for sm_90 without
# register spills (ptxas: 210-220 registers; 32 or 64 heads spill, as do 4 warps);
# scripts/check_kernels.py times alternatives.
CONFIG = {"BLOCK_H": 16, "BLOCK_N": 16, "CHUNK_TILES": 8, "SPLIT": "auto", "num_warps": 8, "num_stages": 2}


@triton.jit
def _fp4_values(code):
    """e2m1 codes (low 4 bits) -> fp32: bit 3 sign, bits 1-2 exponent, bit 0 mantissa."""
    c = code.to(tl.int32)
    e = (c >> 1) & 3
    m = c & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _attend_tile(q, k, valid, m_i, l_i, acc, sm_scale):
    """Online-softmax update of [BLOCK_H] rows with one [BLOCK_N, D] key (= value) tile."""
    s = tl.dot(q, tl.trans(k))
    s = (s.to(tl.bfloat16).to(tl.float32) * sm_scale).to(tl.bfloat16).to(tl.float32)
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), k)
    return m_new, l_i, acc


@triton.jit
def _merge(m_a, l_a, acc_a, m_b, l_b, acc_b):
    """Softmax state a followed by state b (max, sum, unnormalised output)."""
    m = tl.maximum(m_a, m_b)
    alpha = tl.exp(m_a - m)
    beta = tl.exp(m_b - m)
    return m, l_a * alpha + l_b * beta, acc_a * alpha[:, None] + acc_b * beta[:, None]


@triton.jit
def _finish(m_i, l_i, acc, sink):
    """Normalise with the sink logit in the denominator."""
    m_f = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_f)
    return acc * (alpha / (l_i * alpha + tl.exp(sink - m_f)))[:, None]


@triton.jit
def _sparse_attn_kernel(
    q_ptr, kv_new_ptr, ring_ptr, ring_scale_ptr, ckv_ptr, ckv_scale_ptr, topk_ptr,
    token_req_ptr, pos_ptr, start_ptr, row_ptr, slot_ptr, floor_ptr, block_table_ptr, sink_ptr,
    out_ptr, part_ptr, part_ml_ptr,
    H, n_top, sm_scale,
    stride_qt, stride_qh, stride_kv, stride_top, stride_bt, stride_ot, stride_oh,
    WINDOW: tl.constexpr, PER_BLOCK: tl.constexpr, DIM: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_TILES: tl.constexpr,
):
    """Program (token, head block[, chunk of CHUNK_TILES key tiles if SPLIT]): online softmax
    over its key tiles (window tiles, then top-k tiles); SPLIT programs store their partial
    state for `_combine_kernel`, the others normalise with the sink and store the output."""
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    req = tl.load(token_req_ptr + tok)
    pos = tl.load(pos_ptr + tok)
    start = tl.load(start_ptr + req)
    row0 = tl.load(row_ptr + req)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    floor = tl.maximum(tl.load(floor_ptr + req), 0)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    d = tl.arange(0, DIM)
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=h_ok[:, None], other=0.0)

    w_tiles = (WINDOW + BLOCK_N - 1) // BLOCK_N
    n_tiles = w_tiles + tl.cdiv(n_top, BLOCK_N)
    if SPLIT:
        lo = tl.program_id(2) * CHUNK_TILES
        hi = tl.minimum(lo + CHUNK_TILES, n_tiles)
    else:
        lo = 0
        hi = n_tiles
    m_i = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, DIM), dtype=tl.float32)
    # window keys: ring below the step's first position, this step's bf16 keys from there on
    for tile in range(lo, tl.minimum(hi, w_tiles)):
        idx = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        kpos = pos - (WINDOW - 1) + idx
        valid = (idx < WINDOW) & (kpos >= floor)
        in_ring = valid & (kpos < start)
        in_new = valid & (kpos >= start)
        ring_row = slot * WINDOW + tl.where(valid, kpos, 0) % WINDOW
        codes = tl.load(ring_ptr + ring_row[:, None] * DIM + d[None, :], mask=in_ring[:, None], other=0.0)
        scales = tl.load(ring_scale_ptr + ring_row[:, None] * (DIM // RING_SCALE_BLOCK) + (d // RING_SCALE_BLOCK)[None, :], mask=in_ring[:, None], other=0)
        k_ring = codes.to(tl.float32) * e8m0_to_fp32(scales)
        new_row = row0 + tl.where(in_new, kpos - start, 0)
        k_new = tl.load(kv_new_ptr + new_row[:, None] * stride_kv + d[None, :], mask=in_new[:, None], other=0.0)
        k = tl.where(in_ring[:, None], k_ring, k_new.to(tl.float32)).to(tl.bfloat16)
        m_i, l_i, acc = _attend_tile(q, k, valid, m_i, l_i, acc, sm_scale)
    # selected compressed entries, FP4 through the block table. Channel c is nibble c % 2 of
    # byte c // 2; each byte is read for both its channels (L1 hits) and scales are gathered
    # per channel: plain [BLOCK_N, D] tensors, which need far fewer registers than unpacking
    # into [BLOCK_N, D/2, 2] and interleaving (that spilled).
    for tile in range(tl.maximum(lo, w_tiles), hi):
        c = (tile - w_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        entry = tl.load(topk_ptr + tok * stride_top + c, mask=c < n_top, other=-1)
        valid = entry >= 0
        entry = tl.where(valid, entry, 0)
        block = tl.load(block_table_ptr + req * stride_bt + entry // PER_BLOCK, mask=valid, other=0).to(tl.int64)
        loc = block * PER_BLOCK + entry % PER_BLOCK
        byte = tl.load(ckv_ptr + loc[:, None] * (DIM // 2) + (d // 2)[None, :], mask=valid[:, None], other=0)
        code = tl.where((d & 1)[None, :] == 1, byte >> 4, byte & 0xF)
        scale = tl.load(ckv_scale_ptr + loc[:, None] * (DIM // CKV_SCALE_BLOCK) + (d // CKV_SCALE_BLOCK)[None, :], mask=valid[:, None], other=0.0)
        k = (_fp4_values(code) * scale.to(tl.float32)).to(tl.bfloat16)
        m_i, l_i, acc = _attend_tile(q, k, valid, m_i, l_i, acc, sm_scale)

    if SPLIT:
        part = (tok * tl.num_programs(2) + tl.program_id(2)) * H + heads
        tl.store(part_ptr + part[:, None] * DIM + d[None, :], acc, mask=h_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=h_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=h_ok)
    else:
        out = _finish(m_i, l_i, acc, tl.load(sink_ptr + heads, mask=h_ok, other=0.0))
        tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(tl.bfloat16), mask=h_ok[:, None])


@triton.jit
def _combine_kernel(
    part_ptr, part_ml_ptr, sink_ptr, out_ptr, H, CHUNKS, stride_ot, stride_oh,
    DIM: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Merge the chunks' softmax states in chunk order, then normalise with the sink."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    d = tl.arange(0, DIM)
    m_r = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    l_r = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc_r = tl.zeros((BLOCK_H, DIM), dtype=tl.float32)
    for chunk in range(CHUNKS):
        part = (tok * CHUNKS + chunk) * H + heads
        m_c = tl.load(part_ml_ptr + part * 2, mask=h_ok, other=-1e30)
        l_c = tl.load(part_ml_ptr + part * 2 + 1, mask=h_ok, other=0.0)
        acc_c = tl.load(part_ptr + part[:, None] * DIM + d[None, :], mask=h_ok[:, None], other=0.0)
        m_r, l_r, acc_r = _merge(m_r, l_r, acc_r, m_c, l_c, acc_c)
    out = _finish(m_r, l_r, acc_r, tl.load(sink_ptr + heads, mask=h_ok, other=0.0))
    tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(tl.bfloat16), mask=h_ok[:, None])


def _check(q, kv_new, ring_codes, ring_scales, ckv_codes, ckv_scales, topk) -> None:
    t, _, dim = q.shape
    if q.dtype != torch.bfloat16 or kv_new.dtype != torch.bfloat16 or tuple(kv_new.shape) != (t, dim):
        raise ValueError(f"sparse_attention: q must be bf16 [T, H, D] and kv_new bf16 [T, D], got {list(q.shape)} {q.dtype}, {list(kv_new.shape)} {kv_new.dtype}")
    if dim % RING_SCALE_BLOCK.value or dim & (dim - 1):
        raise ValueError(f"sparse_attention: head_dim must be a power of two multiple of {RING_SCALE_BLOCK.value}, got {dim}")
    if ring_codes.dtype != torch.float8_e4m3fn or ring_codes.shape[-1] != dim or ring_scales.shape[-1] != dim // RING_SCALE_BLOCK.value:
        raise ValueError("sparse_attention: ring must be float8_e4m3fn [S, W, D] with uint8 scales [S, W, D/32]")
    if ckv_codes.shape[-1] != dim // 2 or ckv_scales.dtype != torch.float8_e4m3fn or ckv_scales.shape[-1] != dim // CKV_SCALE_BLOCK.value:
        raise ValueError("sparse_attention: compressed KV must be packed uint8 [NB, P, D/2] with float8_e4m3fn scales [NB, P, D/16]")
    if topk.dim() != 2 or topk.shape[0] != t:
        raise ValueError(f"sparse_attention: topk must be [T, k], got {list(topk.shape)}")
    for name, x in (("ring", ring_codes), ("ring scales", ring_scales), ("compressed KV", ckv_codes), ("compressed scales", ckv_scales)):
        if not x.is_contiguous():
            raise ValueError(f"sparse_attention: {name} must be contiguous")


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
) -> torch.Tensor:
    """Sparse MQA over window ring + selected compressed entries (module docstring).

    q bf16 [T, H, D] (after RoPE); kv_new bf16 [T, D] this step's window keys; ring_codes
    float8_e4m3fn [S, W, D] + ring_scales uint8 [S, W, D/32]; ckv_codes uint8 [NB, P, D/2] +
    ckv_scales float8_e4m3fn [NB, P, D/16]; topk int [T, k] (-1 = none; k may be 0);
    token_req int [T] request of each token; positions int [T]; per request (int [B]):
    start_pos (first position of the step), row_start (its first row in q / kv_new), slots,
    floors (window keys below are invisible); block_tables int [B, max_blocks]; sink fp32 [H].
    -> bf16 [T, H, D]."""
    _check(q, kv_new, ring_codes, ring_scales, ckv_codes, ckv_scales, topk)
    t, h, dim = q.shape
    window, per_block = ring_codes.shape[1], ckv_codes.shape[1]
    out = torch.empty(t, h, dim, dtype=torch.bfloat16, device=q.device)
    if t == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv_new = kv_new.contiguous()
    topk = topk.contiguous()
    n_top = topk.shape[1]
    sink = sink.float().contiguous()
    cfg = CONFIG
    bh = cfg["BLOCK_H"]
    chunks = triton.cdiv(triton.cdiv(window, cfg["BLOCK_N"]) + triton.cdiv(n_top, cfg["BLOCK_N"]), cfg["CHUNK_TILES"])
    # "auto": one program per chunk only while the unsplit grid would leave SMs idle — the
    # partial states ([H, D] fp32 per chunk and token) cost more traffic than the chunk's keys.
    policy = cfg["SPLIT"]
    if policy not in ("auto", "always", "never"):
        raise ValueError(f"sparse_attention: CONFIG['SPLIT'] must be 'auto', 'always' or 'never', got {policy!r}")
    split = chunks > 1 and (policy == "always" or (policy == "auto" and t * triton.cdiv(h, bh) <= num_sms(q.device)))
    if split:
        part = torch.empty(t, chunks, h, dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(t, chunks, h, 2, dtype=torch.float32, device=q.device)
    else:
        part = part_ml = out  # not written without SPLIT
    _sparse_attn_kernel[(t, triton.cdiv(h, bh), chunks if split else 1)](
        q, kv_new, ring_codes, ring_scales.view(torch.uint8), ckv_codes, ckv_scales, topk,
        token_req, positions, start_pos, row_start, slots, floors, block_tables, sink,
        out, part, part_ml,
        h, n_top, float(softmax_scale),
        q.stride(0), q.stride(1), kv_new.stride(0), topk.stride(0), block_tables.stride(0), out.stride(0), out.stride(1),
        WINDOW=window, PER_BLOCK=per_block, DIM=dim, SPLIT=split,
        BLOCK_H=bh, BLOCK_N=cfg["BLOCK_N"], CHUNK_TILES=cfg["CHUNK_TILES"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split:
        _combine_kernel[(t, triton.cdiv(h, bh))](
            part, part_ml, sink, out, h, chunks, out.stride(0), out.stride(1), DIM=dim, BLOCK_H=bh, num_warps=cfg["num_warps"]
        )
    return out


def sparse_attention_reference(
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
    chunk: int = 256,
) -> torch.Tensor:
    """Torch reference of `sparse_attention` (same signature; `chunk` bounds the gathered keys'
    memory): gathers and dequantises every key a query may see, then computes the softmax of
    `Attention._attend` — bf16 logits, fp32 softmax with the sink column, bf16 probabilities."""
    t, h, dim = q.shape
    window, per_block = ring_codes.shape[1], ckv_codes.shape[1]
    out = torch.empty(t, h, dim, dtype=q.dtype, device=q.device)
    offs = torch.arange(window, device=q.device)
    for c0 in range(0, t, chunk):
        rows = slice(c0, min(c0 + chunk, t))
        req = token_req[rows].long()
        pos = positions[rows].long()
        start, row0 = start_pos.long()[req], row_start.long()[req]
        kpos = pos[:, None] - (window - 1) + offs  # [n, W]
        valid = kpos >= floors.long()[req].clamp_min(0)[:, None]
        in_ring = valid & (kpos < start[:, None])
        ring_idx = (slots.long()[req][:, None], kpos.clamp_min(0) % window)
        ring = quant.dequantize_fp8_ue8m0(ring_codes[ring_idx], ring_scales.view(torch.uint8)[ring_idx], q.dtype, RING_SCALE_BLOCK.value)
        new_row = (row0[:, None] + kpos - start[:, None]).clamp(0, t - 1)
        keys = torch.where(in_ring[..., None], ring, kv_new[new_row])
        entries = topk[rows].long()
        if entries.shape[1]:
            safe = entries.clamp_min(0)
            blocks = block_tables.long()[req[:, None], safe // per_block]
            loc = (blocks, safe % per_block)
            comp = quant.dequantize_fp4(ckv_codes[loc], ckv_scales[loc], q.dtype, CKV_SCALE_BLOCK.value)
            keys = torch.cat([keys, comp], dim=1)
            valid = torch.cat([valid, entries >= 0], dim=1)
        keys = keys.masked_fill(~valid[..., None], 0)  # unwritten cache bytes may decode to NaN
        logits = (torch.einsum("nhd,nkd->nhk", q[rows], keys) * softmax_scale).float()
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        sinks = sink.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1].to(q.dtype)
        out[rows] = torch.einsum("nhk,nkd->nhd", probs, keys)
    return out
