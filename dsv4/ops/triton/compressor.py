"""`dsv4.ops.compressor.compress_entries` in one Triton kernel (H200 fast path), V4.1's and V4's.

One program per BLOCK_T rows, each row whole (W channels as W/2 even and W/2 odd channels, the
pairs that RoPE rotates and FP4 packs into one byte): gather the pooling slots of the row's
entry from this step's projections, the request's tail slot or (V4's overlapping windows) the
overlap state, softmax over them per channel, the weighted sum rounded to bf16, RMSNorm, the
pre-RoPE entry out, RoPE of the trailing pairs, and the store of the rows that complete a
group: FP4 (`kv._fp4_quantise`, E4M3 scale per 16 channels; V4.1) or the cache's own dtype
(V4's unquantised bf16). The roundings are the reference's, step by step: exp as CUDA's expf
(libdevice; Triton's own exp is an approximation), correctly rounded divisions, every product
rounded on its own (the launch disables fp contraction), sums over the slots as one reduction
(two slots: one addition, as torch's; over more, both orders may differ at fp32 rounding
level); V4 rounds the gate's softmax weights and each weighted term to bf16
(its reference pools in the activation dtype) and multiplies the norm weight in fp32. The
norm's sum of squares runs in another order than the row-wise kernel's (fp32 rounding level,
as that kernel is to torch's).

A row's group is one tile of slots, each input loaded once (max, exp-sum and weighted sum over
it in registers). Groups of more than FUSED_MAX_SLOTS slots (V4 HCA's 128) pool in a launch
of their own first, a program per row and slice of channel pairs (`_pool_kernel`; softmax and
sum are per channel, so the split changes no bit), and the entry kernel reads the pooled rows.
V4's rows that complete no group load nothing and get zeros. The kernel only
reads the overlap state: the op updates it afterwards (`ops.compressor.update_overlap_state`,
on CUDA `overlap_state`: one program per request), as a row's read of it would otherwise race
with another row's write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsv4.cache.storage import CKV_BLOCK, QTensor
from dsv4.ops.triton.kv import _e2m1_code, _fp4_quantise, _load_fp32
from dsv4.ops.triton.pdl import begin, pdl_launch
from dsv4.ops.triton.rowwise import rotate_pairs

_CKV_BLOCK = tl.constexpr(CKV_BLOCK)  # the kernel's view of it (jit code reads constexpr globals only)
BLOCK_T, NUM_WARPS = 2, 4  # V4.1: rows per program (2 x 512 channels), warps
# V4: a program per row (only 1 row in `ratio` pools: a second one would idle), 8 warps over
# its [slots, 256-pair] tiles
V4_BLOCK_T, V4_NUM_WARPS = 1, 8
# Groups of more than FUSED_MAX_SLOTS slots (V4 HCA's 128) pool apart (`_pool_kernel`), in
# tiles of at most APART_TILE (slot, pair) elements: a program per row ran a decode row's
# 128-slot softmax on one SM through 3 passes of serial slot-tile loads (29 us a call, H100
# profile S18-1); V4.1's 2 slots and V4 CSA's 8 stay inside the entry kernel.
FUSED_MAX_SLOTS = 16
APART_TILE = 2048


@triton.jit
def _slots(step_ptr, tail_ptr, state_ptr, ape_ptr, k, g0, first, row0, slot, pooling, p, R, stride_row, stride_tail_s, stride_tail_j,
           stride_state_s, stride_state_j, stride_ape, RATIO: tl.constexpr, W: tl.constexpr, OVERLAP: tl.constexpr, GATE_V4: tl.constexpr):
    """(even, odd) channels, fp32 [rows, slots, W/2], of pooling slots k [slots] of each row's
    entry, from the kv or gate projection (`step_ptr`), its tails and (OVERLAP) its overlap
    state. Slot k is position g0 + k of the row's group; with OVERLAP slots 0..r-1 are the
    previous window's first W channels (Ca) and r..2r-1 the row's window's last W (Cb). A
    position comes from this step's row of it (row0 + position - first, clamped in range for
    the rows that do not read it), before the request's first position from the tail slot's
    entry (position % r), and a previous window wholly before the step's first group from the
    overlap state; there is none before window 0 (kv 0). GATE_V4: V4's gate, plus the position
    bias `ape` (the state holds it biased already), -inf where there is none. Rows outside
    `pooling` [rows, 1, 1] load nothing (0)."""
    j = k % RATIO
    if OVERLAP:
        prev = k < RATIO
        q = g0[:, None] + (j - tl.where(prev, RATIO, 0))[None, :]
        c0 = tl.where(prev, 0, W)[None, :, None]
    else:
        q = g0[:, None] + j[None, :]
        c0 = 0
    first2 = first[:, None]
    in_step = (q >= first2)[:, :, None]
    src = tl.minimum(tl.maximum(row0[:, None] + q - first2, 0), R - 1)[:, :, None]
    ch = c0 + 2 * p
    step = step_ptr + src * stride_row + ch
    tail = tail_ptr + (slot[:, None] * stride_tail_s + j[None, :] * stride_tail_j)[:, :, None] + ch
    from_tail = pooling & ~in_step
    if OVERLAP:
        none = (q < 0)[:, :, None]
        earlier = (q < first2 - first2 % RATIO)[:, :, None] & ~none
        from_tail = from_tail & ~earlier & ~none
    # the fp32 tails and state are read in the projections' dtype, as the reference (exact for
    # the values stored there), but for V4's biased gate state: fp32, as the fp32 `ape` makes it
    dtype = step_ptr.dtype.element_ty
    even = tl.where(in_step, _load_fp32(step, pooling & in_step), _load_fp32(tail, from_tail).to(dtype).to(tl.float32))
    odd = tl.where(in_step, _load_fp32(step + 1, pooling & in_step), _load_fp32(tail + 1, from_tail).to(dtype).to(tl.float32))
    if GATE_V4:
        bias = ape_ptr + (j * stride_ape)[None, :, None] + ch
        even += tl.load(bias)
        odd += tl.load(bias + 1)
    if OVERLAP:
        state = state_ptr + (slot[:, None] * stride_state_s + j[None, :] * stride_state_j)[:, :, None] + 2 * p
        state_dtype = tl.float32 if GATE_V4 else dtype
        even = tl.where(earlier, _load_fp32(state, pooling & earlier).to(state_dtype).to(tl.float32), even)
        odd = tl.where(earlier, _load_fp32(state + 1, pooling & earlier).to(state_dtype).to(tl.float32), odd)
        if GATE_V4:
            even = tl.where(none, float("-inf"), even)
            odd = tl.where(none, float("-inf"), odd)
    return even, odd


@triton.jit
def _pooled_term(kv, gate, m, s, BF16: tl.constexpr):
    """One slot's kv times its softmax weight exp(gate - max) / sum: fp32 (V4.1), or BF16 with
    the weight and the product rounded to bf16 (V4 pools in the activation dtype)."""
    weight = tl.math.div_rn(libdevice.exp(gate - m), s)
    if BF16:
        return (kv * weight.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
    return kv * weight


@triton.jit
def _weighted_norm(x, rstd, weight, FP32_WEIGHT: tl.constexpr):
    """RMSNorm's bf16 result from the fp32 x and rstd: V4.1 rounds the normalised value to bf16
    before the weight multiply, V4 (FP32_WEIGHT) multiplies in fp32 and rounds once."""
    if FP32_WEIGHT:
        return (weight * (x * rstd)).to(tl.bfloat16)
    return (weight * (x * rstd).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _pool(kv_ptr, gate_ptr, tail_kv_ptr, tail_gate_ptr, ape_ptr, prev_kv_ptr, prev_gate_ptr, start_ptr, row0_ptr, slot_ptr,
          req, pos, ok, p, R, stride_kv, stride_tail_s, stride_tail_j, stride_prev_s, stride_prev_j, stride_ape,
          RATIO: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr, PAIRS: tl.constexpr, V4: tl.constexpr, OVERLAP: tl.constexpr):
    """The pooled entry of each row's group over channel pairs p [1, PAIRS]: (even, odd) fp32
    [BLOCK_T, PAIRS] of bf16 values. The group's slots are one tile, each input loaded once;
    softmax and sum run per channel, so any split of the pairs gives the same bits. V4: only
    the rows that complete a group pool, the others get zeros (a program without one loads
    nothing)."""
    N_SLOTS: tl.constexpr = 2 * RATIO if OVERLAP else RATIO
    first = tl.load(start_ptr + req, mask=ok, other=0).to(tl.int64)
    row0 = tl.load(row0_ptr + req, mask=ok, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + req, mask=ok, other=0).to(tl.int64)
    g0 = pos - pos % RATIO
    pooling = ok
    if V4:  # only the rows that complete a group pool (V4's callers use no other row's entry)
        pooling = ok & (pos % RATIO == RATIO - 1)
    le = tl.zeros((BLOCK_T, PAIRS), dtype=tl.float32)
    lo = tl.zeros((BLOCK_T, PAIRS), dtype=tl.float32)
    if tl.max(pooling.to(tl.int32), axis=0) > 0:
        k = tl.arange(0, N_SLOTS)
        pooling3 = pooling[:, None, None]
        p3 = p[:, None, :]
        ge, go = _slots(gate_ptr, tail_gate_ptr, prev_gate_ptr, ape_ptr, k, g0, first, row0, slot, pooling3, p3, R,
                        stride_kv, stride_tail_s, stride_tail_j, stride_prev_s, stride_prev_j, stride_ape, RATIO, W, OVERLAP, V4)
        ke, ko = _slots(kv_ptr, tail_kv_ptr, prev_kv_ptr, ape_ptr, k, g0, first, row0, slot, pooling3, p3, R,
                        stride_kv, stride_tail_s, stride_tail_j, stride_prev_s, stride_prev_j, stride_ape, RATIO, W, OVERLAP, False)
        # softmax over the slots per channel (max, exp and their sum), then the weighted sum
        m_e = tl.max(ge, axis=1)[:, None, :]
        m_o = tl.max(go, axis=1)[:, None, :]
        s_e = tl.sum(libdevice.exp(ge - m_e), axis=1)[:, None, :]
        s_o = tl.sum(libdevice.exp(go - m_o), axis=1)[:, None, :]
        le += tl.sum(_pooled_term(ke, ge, m_e, s_e, V4), axis=1)
        lo += tl.sum(_pooled_term(ko, go, m_o, s_o, V4), axis=1)
    return le.to(tl.bfloat16).to(tl.float32), lo.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _pool_kernel(
    kv_ptr, gate_ptr, tail_kv_ptr, tail_gate_ptr, req_ptr, pos_ptr, start_ptr, row0_ptr, slot_ptr, pooled_ptr,
    R, stride_kv, stride_tail_s, stride_tail_j, ape_ptr, prev_kv_ptr, prev_gate_ptr, stride_prev_s, stride_prev_j, stride_ape,
    RATIO: tl.constexpr, W: tl.constexpr, PAIRS: tl.constexpr, V4: tl.constexpr, OVERLAP: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, PAIRS channel pairs): `_pool` of that slice to `pooled` [R, W] bf16 (the
    rows that pool; `_compress_kernel` POOLED takes the others as zeros)."""
    begin(PDL)
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    ok = rows < R
    req = tl.load(req_ptr + rows, mask=ok, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + rows, mask=ok, other=0).to(tl.int64)
    p = tl.program_id(1) * PAIRS + tl.arange(0, PAIRS)[None, :]
    le, lo = _pool(kv_ptr, gate_ptr, tail_kv_ptr, tail_gate_ptr, ape_ptr, prev_kv_ptr, prev_gate_ptr, start_ptr, row0_ptr, slot_ptr,
                   req, pos, ok, p, R, stride_kv, stride_tail_s, stride_tail_j, stride_prev_s, stride_prev_j, stride_ape,
                   RATIO, W, 1, PAIRS, V4, OVERLAP)
    pooling = ok & (pos % RATIO == RATIO - 1) if V4 else ok
    dst = pooled_ptr + rows[:, None] * W + 2 * p
    tl.store(dst, le.to(tl.bfloat16), mask=pooling[:, None])
    tl.store(dst + 1, lo.to(tl.bfloat16), mask=pooling[:, None])


@triton.jit
def _compress_kernel(
    kv_ptr, gate_ptr, tail_kv_ptr, tail_gate_ptr, req_ptr, pos_ptr, start_ptr, row0_ptr, write_ptr, slot_ptr, emit_from_ptr,
    block_table_ptr, norm_ptr, cos_ptr, sin_ptr, cache_ptr, scales_ptr, out_ptr, block_out_ptr, offset_out_ptr, emit_out_ptr,
    R, eps, n_cols, S, stride_kv, stride_tail_s, stride_tail_j, stride_bt, stride_cos, stride_c0, stride_c1, stride_s0, stride_s1,
    ape_ptr, prev_kv_ptr, prev_gate_ptr, stride_prev_s, stride_prev_j, stride_ape,
    RATIO: tl.constexpr, W: tl.constexpr, ROPE_PAIRS: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
    V4: tl.constexpr, OVERLAP: tl.constexpr, FP4: tl.constexpr, POOLED: tl.constexpr, pooled_ptr, PDL: tl.constexpr,
):
    """W: the entry width. V4: V4's pooling (position bias, bf16 weights and terms, the rows
    that complete no group skipped) and fp32-weight norm; OVERLAP: its overlapping windows
    (kv / gate rows 2W wide, the overlap state `prev_*` [slots, r, W] read); FP4: the cache
    holds FP4 codes (`cache_ptr`, [S, P, W/2]) and E4M3 scales, else the entries in its own
    dtype (`cache_ptr`, [S, P, W]; `scales_ptr` not read). POOLED: `_pool_kernel` pooled the
    rows already (`pooled_ptr` [R, W]; V4's rows that complete no group are zeros, not read)."""
    begin(PDL)
    HALF: tl.constexpr = W // 2
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < R
    req = tl.load(req_ptr + rows, mask=ok, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + rows, mask=ok, other=0).to(tl.int64)
    p = tl.arange(0, HALF)[None, :]
    ok2 = ok[:, None]
    if RATIO == 1:
        le = _load_fp32(kv_ptr + rows[:, None] * stride_kv + 2 * p, ok2)
        lo = _load_fp32(kv_ptr + rows[:, None] * stride_kv + 2 * p + 1, ok2)
    elif POOLED:
        pooling = ok2 & (pos % RATIO == RATIO - 1)[:, None] if V4 else ok2
        le = _load_fp32(pooled_ptr + rows[:, None] * W + 2 * p, pooling)
        lo = _load_fp32(pooled_ptr + rows[:, None] * W + 2 * p + 1, pooling)
    else:
        le, lo = _pool(kv_ptr, gate_ptr, tail_kv_ptr, tail_gate_ptr, ape_ptr, prev_kv_ptr, prev_gate_ptr, start_ptr, row0_ptr, slot_ptr,
                       req, pos, ok, p, R, stride_kv, stride_tail_s, stride_tail_j, stride_prev_s, stride_prev_j, stride_ape,
                       RATIO, W, BLOCK_T, HALF, V4, OVERLAP)
    rstd = tl.math.rsqrt((tl.sum(le * le, axis=1) + tl.sum(lo * lo, axis=1)) / W + eps)[:, None]
    ye = _weighted_norm(le, rstd, tl.load(norm_ptr + 2 * p).to(tl.float32), V4)
    yo = _weighted_norm(lo, rstd, tl.load(norm_ptr + 2 * p + 1).to(tl.float32), V4)
    out_row = out_ptr + rows[:, None] * W + 2 * p
    tl.store(out_row, ye, mask=ok2)
    tl.store(out_row + 1, yo, mask=ok2)
    # RoPE of the trailing ROPE_PAIRS pairs at the entry's position
    rp = p - (HALF - ROPE_PAIRS)
    rot = ok2 & (rp >= 0)
    c = tl.load(cos_ptr + rows[:, None] * stride_cos + rp, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + rows[:, None] * stride_cos + rp, mask=rot, other=0.0).to(tl.float32)
    fe, fo = ye.to(tl.float32), yo.to(tl.float32)
    re, ro = rotate_pairs(fe, fo, c, s, False)  # (the launch disables fp fusion)
    xe = tl.where(rot, re.to(tl.bfloat16).to(tl.float32), fe)
    xo = tl.where(rot, ro.to(tl.bfloat16).to(tl.float32), fo)
    # the rows that complete a group not cached yet: their location, then the store
    write = tl.load(write_ptr + rows, mask=ok, other=0) != 0
    emit_from = tl.load(emit_from_ptr + req, mask=ok, other=0)
    emit = ok & write & (pos - pos % RATIO >= emit_from) & (pos % RATIO == RATIO - 1)
    entry = pos // RATIO
    col = tl.minimum(entry // PER_BLOCK, n_cols - 1)
    block = tl.load(block_table_ptr + req * stride_bt + col, mask=ok, other=0).to(tl.int64)
    i1 = entry % PER_BLOCK
    tl.store(block_out_ptr + rows, block, mask=ok)
    tl.store(offset_out_ptr + rows, i1, mask=ok)
    tl.store(emit_out_ptr + rows, emit.to(tl.int8), mask=ok)
    i0 = tl.where(block < 0, block + S, block)  # negative block ids count from the end, as torch indexing
    emit = emit & (i0 >= 0) & (i0 < S)
    if FP4:  # E4M3 scale per 16 channels
        NB: tl.constexpr = W // _CKV_BLOCK
        PAIRS: tl.constexpr = _CKV_BLOCK // 2  # byte pairs per scale block
        xe3 = tl.reshape(xe, (BLOCK_T, NB, PAIRS))
        xo3 = tl.reshape(xo, (BLOCK_T, NB, PAIRS))
        amax = tl.maximum(tl.max(tl.abs(xe3), axis=2), tl.max(tl.abs(xo3), axis=2))
        qe, stored, _ = _fp4_quantise(xe3, amax, True)
        qo, _, _ = _fp4_quantise(xo3, amax, True)
        packed = _e2m1_code(qe) | (_e2m1_code(qo) << 4)
        nb = tl.arange(0, NB)
        byte = nb[None, :, None] * PAIRS + tl.arange(0, PAIRS)[None, None, :]
        tl.store(cache_ptr + (i0 * stride_c0 + i1 * stride_c1)[:, None, None] + byte, packed.to(tl.uint8), mask=emit[:, None, None])
        tl.store(scales_ptr + (i0 * stride_s0 + i1 * stride_s1)[:, None] + nb[None, :], stored, mask=emit[:, None])
    else:
        dst = cache_ptr + (i0 * stride_c0 + i1 * stride_c1)[:, None] + 2 * p
        tl.store(dst, xe.to(cache_ptr.dtype.element_ty), mask=emit[:, None])
        tl.store(dst + 1, xo.to(cache_ptr.dtype.element_ty), mask=emit[:, None])


def compress_entries(kv, gate, tail_kv, tail_gate, req, positions, start, row0, write, slots, emit_from, block_tables,
                     norm_weight, eps, cos, sin, ckv: QTensor, ratio: int, block_size: int, dtype: torch.dtype, *, v4=None):
    """See `dsv4.ops.compressor.compress_entries` (arguments checked there; bf16 activations):
    the entries and the cache stores (the op then updates V4's overlap state)."""
    if dtype != torch.bfloat16:
        raise ValueError(f"compress_entries: the kernel computes bf16 entries, got dtype {dtype}")
    if v4 is not None and v4.ape.dtype != torch.float32:
        raise ValueError(f"compress_entries: the kernel takes V4's ape in fp32 (as loaded), got {v4.ape.dtype}")
    overlap = v4 is not None and v4.overlap
    n_rows = kv.shape[0]
    width = kv.shape[1] // 2 if overlap else kv.shape[1]  # the entry's
    pairs = width // 2
    blocks = width // CKV_BLOCK
    if pairs < 1 or pairs & (pairs - 1) or cos.shape[1] > pairs or (ckv.quantized and (width % CKV_BLOCK or blocks & (blocks - 1))):
        raise ValueError(f"compress_entries: the kernel needs a power-of-two entry width (for FP4, of whole {CKV_BLOCK}-channel blocks) "
                         f"and at most width/2 RoPE pairs, got width {width}, {cos.shape[1]} pairs")
    out = torch.empty(n_rows, width, dtype=torch.bfloat16, device=kv.device)
    where = (torch.empty(n_rows, dtype=torch.int64, device=kv.device), torch.empty(n_rows, dtype=torch.int64, device=kv.device))
    emit = torch.empty(n_rows, dtype=torch.bool, device=kv.device)
    if n_rows == 0:
        return out, where, emit
    pooled = ratio > 1
    if pooled and (gate.stride(0) != kv.stride(0) or tail_gate.stride() != tail_kv.stride()):  # the kernel takes one stride for each pair
        kv, gate, tail_kv, tail_gate = kv.contiguous(), gate.contiguous(), tail_kv.contiguous(), tail_gate.contiguous()
    gate = gate if pooled else kv
    tail_kv = tail_kv if pooled else kv[:1].unsqueeze(0)  # not read at ratio 1
    tail_gate = tail_gate if pooled else tail_kv
    prev_kv, prev_gate = (v4.prev_kv, v4.prev_gate) if overlap else (tail_kv, tail_gate)  # not read without overlap
    if prev_gate.stride() != prev_kv.stride():  # read only here: a copy will do
        prev_kv, prev_gate = prev_kv.contiguous(), prev_gate.contiguous()
    ape = norm_weight if v4 is None else v4.ape.contiguous()  # not read for V4.1
    req, positions, start, row0, slots, emit_from = (t.contiguous() for t in (req, positions, start, row0, slots, emit_from))
    cos, sin, tables, norm_weight = cos.contiguous(), sin.contiguous(), block_tables.contiguous(), norm_weight.contiguous()
    cache = ckv.codes if ckv.quantized else ckv.values
    scales = ckv.scales if ckv.quantized else cache  # not written unquantised
    n_slots = 2 * ratio if overlap else ratio
    v4_args = (ape, prev_kv, prev_gate, prev_kv.stride(0), prev_kv.stride(1), ape.stride(0))
    apart = pooled and n_slots > FUSED_MAX_SLOTS
    pooled_rows = out  # not read unless apart
    if apart:
        pooled_rows = torch.empty(n_rows, width, dtype=torch.bfloat16, device=kv.device)
        pairs = max(1, min(pairs, APART_TILE // n_slots))
        _pool_kernel[(n_rows, width // 2 // pairs)](
            kv, gate, tail_kv, tail_gate, req, positions, start, row0, slots, pooled_rows, n_rows, kv.stride(0), tail_kv.stride(0), tail_kv.stride(1), *v4_args,
            RATIO=ratio, W=width, PAIRS=pairs, V4=v4 is not None, OVERLAP=overlap, num_warps=4, enable_fp_fusion=False, **pdl_launch(kv.device),
        )
    block_t, num_warps = (BLOCK_T, NUM_WARPS) if v4 is None else (V4_BLOCK_T, V4_NUM_WARPS)
    _compress_kernel[(triton.cdiv(n_rows, block_t),)](
        kv, gate, tail_kv, tail_gate, req, positions, start, row0, write.contiguous().view(torch.uint8), slots, emit_from,
        tables, norm_weight, cos, sin, cache, scales, out, where[0], where[1], emit.view(torch.int8),
        n_rows, float(eps), tables.shape[1], cache.shape[0], kv.stride(0), tail_kv.stride(0), tail_kv.stride(1), tables.stride(0), cos.stride(0),
        cache.stride(0), cache.stride(1), scales.stride(0), scales.stride(1),
        *v4_args,
        RATIO=ratio, W=width, ROPE_PAIRS=cos.shape[1], PER_BLOCK=block_size // ratio, BLOCK_T=block_t,
        V4=v4 is not None, OVERLAP=overlap, FP4=ckv.quantized,
        POOLED=apart, pooled_ptr=pooled_rows, num_warps=num_warps, enable_fp_fusion=False, **pdl_launch(kv.device),
    )
    return out, where, emit


@triton.jit
def _overlap_state_kernel(kv_ptr, gate_ptr, tail_kv_ptr, tail_gate_ptr, ape_ptr, start_ptr, count_ptr, row0_ptr, write_ptr, slot_ptr,
                          prev_kv_ptr, prev_gate_ptr, R, stride_kv, stride_tail_s, stride_tail_j, stride_prev_s, stride_prev_j, stride_ape,
                          RATIO: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """Program (request b, BLOCK_C channels of the first half): `update_overlap_state` for b."""
    begin(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    first = tl.load(start_ptr + b).to(tl.int64)
    end = first + tl.load(count_ptr + b).to(tl.int64)
    last = end - end % RATIO - 1  # the last position of the last window complete at the step's end
    row0 = tl.load(row0_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    last_row = tl.minimum(tl.maximum(row0 + last - first, 0), R - 1)
    completed = (last >= first) & (tl.load(write_ptr + last_row) != 0)  # by a written row of this step
    if completed:
        for j in tl.static_range(RATIO):
            pos = last - (RATIO - 1) + j
            if pos >= first:  # this step's row
                src = row0 + pos - first
                kv = tl.load(kv_ptr + src * stride_kv + c).to(tl.float32)
                gate = tl.load(gate_ptr + src * stride_kv + c).to(tl.float32)
            else:  # the tail, read in the projections' dtype (as the pooling reads it)
                tail = slot * stride_tail_s + (pos % RATIO) * stride_tail_j + c
                kv = tl.load(tail_kv_ptr + tail).to(kv_ptr.dtype.element_ty).to(tl.float32)
                gate = tl.load(tail_gate_ptr + tail).to(gate_ptr.dtype.element_ty).to(tl.float32)
            dst = slot * stride_prev_s + j * stride_prev_j + c
            tl.store(prev_kv_ptr + dst, kv)
            tl.store(prev_gate_ptr + dst, gate + tl.load(ape_ptr + j * stride_ape + c))


def overlap_state(v4, kv, gate, tail_kv, tail_gate, start, row0, write, slots, ratio: int) -> None:
    """`dsv4.ops.compressor.update_overlap_state` in one launch (arguments checked by
    `compress_entries`; ape fp32 as loaded)."""
    half = v4.prev_kv.shape[-1]
    if v4.ape.dtype != torch.float32:
        raise ValueError(f"update_overlap_state: the kernel takes V4's ape in fp32 (as loaded), got {v4.ape.dtype}")
    if half & (half - 1):
        raise ValueError(f"update_overlap_state: the kernel takes a power-of-two half width, got {half}")
    if gate.stride(0) != kv.stride(0) or tail_gate.stride() != tail_kv.stride() or v4.prev_gate.stride() != v4.prev_kv.stride():
        raise ValueError("update_overlap_state: kv / gate, the tails and the state pairs must share their strides")
    if kv.stride(1) != 1 or tail_kv.stride(2) != 1 or v4.prev_kv.stride(2) != 1 or v4.ape.stride(1) != 1:
        raise ValueError("update_overlap_state: every tensor needs unit channel stride")
    n_req = slots.shape[0]
    block_c = min(half, 256)
    _overlap_state_kernel[(n_req, half // block_c)](
        kv, gate, tail_kv, tail_gate, v4.ape, start, v4.count, row0, write.view(torch.uint8), slots, v4.prev_kv, v4.prev_gate,
        kv.shape[0], kv.stride(0), tail_kv.stride(0), tail_kv.stride(1), v4.prev_kv.stride(0), v4.prev_kv.stride(1), v4.ape.stride(0),
        RATIO=ratio, BLOCK_C=block_c, num_warps=4, **pdl_launch(kv.device),
    )
