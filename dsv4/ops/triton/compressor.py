"""`dsv4.ops.compressor.compress_entries` in one Triton kernel (H200 fast path).

One program per BLOCK_T rows, each row whole (W channels as W/2 even and W/2 odd channels, the
pairs that RoPE rotates and FP4 packs into one byte): gather the r positions of the row's group
from this step's projections or the request's tail slot, softmax over them per channel, the
weighted sum (fp32, rounded to bf16), RMSNorm, the pre-RoPE entry out, RoPE of the trailing
pairs, FP4 quantisation (`kv._fp4_quantise`, E4M3 scale per 16 channels) and the store of the
rows that complete a group. The roundings are the reference's, step by step: exp as CUDA's
expf (libdevice; Triton's own exp is an approximation), correctly rounded divisions, every
product rounded on its own (the launch disables fp contraction), sums over the r positions in
position order (torch adds two terms the same way; for r > 2 its reduction order may differ
at fp32 rounding level). The norm's sum of squares runs in another order than the row-wise
kernel's (fp32 rounding level, as that kernel is to torch's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsv4.cache.storage import CKV_BLOCK, QTensor
from dsv4.ops.triton.kv import _e2m1_code, _fp4_quantise, _load_fp32

_CKV_BLOCK = tl.constexpr(CKV_BLOCK)  # the kernel's view of it (jit code reads constexpr globals only)
BLOCK_T = 2  # rows per program: 2 x 512 channels, 4 warps (decode rows get a program each)


@triton.jit
def _member(step_ptr, tail_ptr, j, g0, first, row0, slot, R, stride_row, stride_tail_s, stride_tail_j, p, ok):
    """(even, odd) channels of position g0 + j of each row's group: this step's row of it
    (row0 + position - first, clamped in range for the rows that do not read it) or, before
    the request's first position, the tail slot's entry j."""
    in_step = (g0 + j >= first)[:, None]
    src = tl.minimum(tl.maximum(row0 + g0 + j - first, 0), R - 1)[:, None]
    step = step_ptr + src * stride_row + 2 * p
    tail = tail_ptr + (slot * stride_tail_s + j * stride_tail_j)[:, None] + 2 * p
    even = tl.where(in_step, tl.load(step, mask=ok & in_step, other=0.0), tl.load(tail, mask=ok & ~in_step, other=0.0))
    odd = tl.where(in_step, tl.load(step + 1, mask=ok & in_step, other=0.0), tl.load(tail + 1, mask=ok & ~in_step, other=0.0))
    return even, odd


@triton.jit
def _compress_kernel(
    kv_ptr, gate_ptr, tail_kv_ptr, tail_gate_ptr, req_ptr, pos_ptr, start_ptr, row0_ptr, write_ptr, slot_ptr, emit_from_ptr,
    block_table_ptr, norm_ptr, cos_ptr, sin_ptr, codes_ptr, scales_ptr, out_ptr, block_out_ptr, offset_out_ptr, emit_out_ptr,
    R, eps, n_cols, S, stride_kv, stride_tail_s, stride_tail_j, stride_bt, stride_cos, stride_c0, stride_c1, stride_s0, stride_s1,
    RATIO: tl.constexpr, W: tl.constexpr, ROPE_PAIRS: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
):
    HALF: tl.constexpr = W // 2
    NB: tl.constexpr = W // _CKV_BLOCK
    PAIRS: tl.constexpr = _CKV_BLOCK // 2  # byte pairs per scale block
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < R
    req = tl.load(req_ptr + rows, mask=ok, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + rows, mask=ok, other=0).to(tl.int64)
    p = tl.arange(0, HALF)[None, :]
    ok2 = ok[:, None]
    if RATIO == 1:
        le = _load_fp32(kv_ptr + rows[:, None] * stride_kv + 2 * p, ok2)
        lo = _load_fp32(kv_ptr + rows[:, None] * stride_kv + 2 * p + 1, ok2)
    else:
        first = tl.load(start_ptr + req, mask=ok, other=0).to(tl.int64)
        row0 = tl.load(row0_ptr + req, mask=ok, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + req, mask=ok, other=0).to(tl.int64)
        g0 = pos - pos % RATIO
        # pass 1: the gate's max over the group, per channel
        m_e = tl.full((BLOCK_T, HALF), float("-inf"), dtype=tl.float32)
        m_o = tl.full((BLOCK_T, HALF), float("-inf"), dtype=tl.float32)
        for j in tl.static_range(RATIO):
            ge, go = _member(gate_ptr, tail_gate_ptr, j, g0, first, row0, slot, R, stride_kv, stride_tail_s, stride_tail_j, p, ok2)
            m_e = tl.maximum(m_e, ge)
            m_o = tl.maximum(m_o, go)
        # pass 2: exp and their sum; pass 3: the weighted sum (softmax = exp / sum, then * kv)
        s_e = tl.zeros((BLOCK_T, HALF), dtype=tl.float32)
        s_o = tl.zeros((BLOCK_T, HALF), dtype=tl.float32)
        for j in tl.static_range(RATIO):
            ge, go = _member(gate_ptr, tail_gate_ptr, j, g0, first, row0, slot, R, stride_kv, stride_tail_s, stride_tail_j, p, ok2)
            s_e += libdevice.exp(ge - m_e)
            s_o += libdevice.exp(go - m_o)
        le = tl.zeros((BLOCK_T, HALF), dtype=tl.float32)
        lo = tl.zeros((BLOCK_T, HALF), dtype=tl.float32)
        for j in tl.static_range(RATIO):
            ge, go = _member(gate_ptr, tail_gate_ptr, j, g0, first, row0, slot, R, stride_kv, stride_tail_s, stride_tail_j, p, ok2)
            ke, ko = _member(kv_ptr, tail_kv_ptr, j, g0, first, row0, slot, R, stride_kv, stride_tail_s, stride_tail_j, p, ok2)
            le += ke * tl.math.div_rn(libdevice.exp(ge - m_e), s_e)
            lo += ko * tl.math.div_rn(libdevice.exp(go - m_o), s_o)
        le = le.to(tl.bfloat16).to(tl.float32)
        lo = lo.to(tl.bfloat16).to(tl.float32)
    # RMSNorm (V4.1: the normalised value rounded to bf16, then times the bf16 weight)
    rstd = tl.math.rsqrt((tl.sum(le * le, axis=1) + tl.sum(lo * lo, axis=1)) / W + eps)[:, None]
    ye = (tl.load(norm_ptr + 2 * p).to(tl.float32) * (le * rstd).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
    yo = (tl.load(norm_ptr + 2 * p + 1).to(tl.float32) * (lo * rstd).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
    out_row = out_ptr + rows[:, None] * W + 2 * p
    tl.store(out_row, ye, mask=ok2)
    tl.store(out_row + 1, yo, mask=ok2)
    # RoPE of the trailing ROPE_PAIRS pairs at the entry's position
    rp = p - (HALF - ROPE_PAIRS)
    rot = ok2 & (rp >= 0)
    c = tl.load(cos_ptr + rows[:, None] * stride_cos + rp, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + rows[:, None] * stride_cos + rp, mask=rot, other=0.0).to(tl.float32)
    fe, fo = ye.to(tl.float32), yo.to(tl.float32)
    ec, os_, es, oc = fe * c, fo * s, fe * s, fo * c
    xe = tl.where(rot, (ec - os_).to(tl.bfloat16).to(tl.float32), fe)
    xo = tl.where(rot, (es + oc).to(tl.bfloat16).to(tl.float32), fo)
    # FP4 (E4M3 scale per 16 channels) of the rows that complete a group
    xe3 = tl.reshape(xe, (BLOCK_T, NB, PAIRS))
    xo3 = tl.reshape(xo, (BLOCK_T, NB, PAIRS))
    amax = tl.maximum(tl.max(tl.abs(xe3), axis=2), tl.max(tl.abs(xo3), axis=2))
    qe, stored, _ = _fp4_quantise(xe3, amax, True)
    qo, _, _ = _fp4_quantise(xo3, amax, True)
    packed = _e2m1_code(qe) | (_e2m1_code(qo) << 4)
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
    nb = tl.arange(0, NB)
    byte = nb[None, :, None] * PAIRS + tl.arange(0, PAIRS)[None, None, :]
    tl.store(codes_ptr + (i0 * stride_c0 + i1 * stride_c1)[:, None, None] + byte, packed.to(tl.uint8), mask=emit[:, None, None])
    tl.store(scales_ptr + (i0 * stride_s0 + i1 * stride_s1)[:, None] + nb[None, :], stored, mask=emit[:, None])


def compress_entries(kv, gate, tail_kv, tail_gate, req, positions, start, row0, write, slots, emit_from, block_tables,
                     norm_weight, eps, cos, sin, ckv: QTensor, ratio: int, block_size: int, dtype: torch.dtype):
    """See `dsv4.ops.compressor.compress_entries` (arguments checked there; bf16 activations)."""
    if dtype != torch.bfloat16:
        raise ValueError(f"compress_entries: the kernel computes bf16 entries, got dtype {dtype}")
    n_rows, width = kv.shape
    pairs = width // 2
    if width % CKV_BLOCK or pairs & (pairs - 1) or (width // CKV_BLOCK) & (width // CKV_BLOCK - 1) or cos.shape[1] > pairs:
        raise ValueError(f"compress_entries: the kernel needs a power-of-two entry width of whole {CKV_BLOCK}-channel blocks "
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
    req, positions, start, row0, slots, emit_from = (t.contiguous() for t in (req, positions, start, row0, slots, emit_from))
    cos, sin, tables, norm_weight = cos.contiguous(), sin.contiguous(), block_tables.contiguous(), norm_weight.contiguous()
    codes, scales = ckv.codes, ckv.scales
    _compress_kernel[(triton.cdiv(n_rows, BLOCK_T),)](
        kv, gate, tail_kv, tail_gate, req, positions, start, row0, write.contiguous().view(torch.uint8), slots, emit_from,
        tables, norm_weight, cos, sin, codes, scales, out, where[0], where[1], emit.view(torch.int8),
        n_rows, float(eps), tables.shape[1], codes.shape[0], kv.stride(0), tail_kv.stride(0), tail_kv.stride(1), tables.stride(0), cos.stride(0),
        codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1),
        RATIO=ratio, W=width, ROPE_PAIRS=cos.shape[1], PER_BLOCK=block_size // ratio, BLOCK_T=BLOCK_T,
        num_warps=4, enable_fp_fusion=False,
    )
    return out, where, emit
