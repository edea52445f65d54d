"""Engram on Triton (H200 fast path): n-gram hashes, table lookup, gate and stream update.

Same semantics as the torch references in `dsv4.model.layers.engram` (which dispatch here for
CUDA tensors; MODEL.md section 2.2). Three kernels, each one launch, sized from shapes only (no
host sync: CUDA graphs capture them):

* `hash_ids`: the hash ids [T, L, (N-1)*heads] of every engram layer, exactly the reference's
  int64 results. One program per tile of rows builds the N shifted compressed tokens of each
  row (the look-back inside the step from input_ids, before the step's first row from
  prev_tokens; blocked at position < s and at unknown tokens, and then for every longer
  shift, blocked slots taking the pad id), then per layer the rolling XOR of token x
  multiplier, reduced modulo each column's prime (floor modulo, as torch's `%`) plus the
  column's offset.
* `lookup`: gather + dequantise of the table rows named by one layer's hash ids -> [T,
  cols * dim] in the activation dtype, exactly `quant.dequant_fp8_rows(...).to(dtype)`: the
  e4m3 code times 2**(byte - 127) (built from the bits, byte 0 giving the subnormal 2**-127 as
  torch's exp2 does) in fp32, then one rounding. Row ids are int64 (the released tables have
  384M rows, 98 GB); an id outside the table reads nothing and gives zeros (the torch path
  raises IndexError; a graph cannot).
* `gate`: after the wkv projection (the w8a16 GEMM, unchanged), per row and stream the fp32
  gate `sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot))` from the RMS statistics of the
  stream and its key and their weighted dot product, then `h + g * value` rounded once to
  the stream dtype. One program per (row, stream) holds the stream's D values in registers;
  compiled without fp contraction, each elementwise step rounds as torch's does and correctly
  rounded division / sqrt stand in for torch's, so only the three sums' order differs from
  the reference (fp32 rounding level). A row's result never depends on its batch.

The interpreter (tests on CPU) reads e4m3 NaN codes as +-480; the GPU reads them as NaN, as
torch does (released tables hold none).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.model import quant
from dsv4.ops.triton.kv import _load_fp32
from dsv4.ops.triton.mhc import _sigmoid
from dsv4.ops.triton.pdl import begin, pdl_launch

HASH_TILE = 1024  # int64 hash values per program (rows x layers x columns, padded): 141 registers at 16 rows x 2 x 32 (2048: 254)
LOOKUP_COLS = 8  # table rows per program of `lookup` (3 programs per token at 24 columns)


@triton.jit
def _hash_kernel(
    ids_ptr, req_ptr, local_ptr, pos_ptr, prev_ptr, map_ptr, mult_ptr, primes_ptr, offsets_ptr, out_ptr,
    T, P, V, L, C, pad, stride_prev,
    N: tl.constexpr, HEADS: tl.constexpr, L_P: tl.constexpr, C_P: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
):
    """out[t, l, c] for a tile of rows, all layers and columns (c = (n-2) * HEADS + head)."""
    begin(PDL)
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = rows < T
    req = tl.load(req_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    local = tl.load(local_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    lay = tl.arange(0, L_P)
    lay_ok = lay < L
    col = tl.arange(0, C_P)
    col_ok = col < C
    gram = col // HEADS  # the column's n-gram uses shifts 0 .. gram + 1
    blocked = rows < 0
    rolling = tl.zeros((BLOCK_T, L_P), dtype=tl.int64)
    hashed = tl.zeros((BLOCK_T, L_P, C_P), dtype=tl.int64)
    for s in tl.static_range(N):
        if s == 0:
            tok = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        else:  # inside the step from input_ids, before its first row from prev_tokens (nearest first)
            tok = tl.load(ids_ptr + tl.maximum(rows - s, 0), mask=row_ok & (local >= s), other=0).to(tl.int64)
            back = tl.minimum(tl.maximum(s - 1 - local, 0), P - 1)
            before = tl.load(prev_ptr + req * stride_prev + back, mask=row_ok & (local < s), other=0).to(tl.int64)
            tok = tl.where(local >= s, tok, before)
        known = (tok >= 0) & (tok < V)  # an id past the map counts as unknown (torch: IndexError)
        comp = tl.load(map_ptr + tl.where(known, tok, 0), mask=row_ok & known, other=-1).to(tl.int64)
        comp = tl.where(known, comp, -1)
        blocked = blocked | (pos < s) | (comp < 0)  # once blocked, longer n-grams are too
        tok_s = tl.where(blocked, pad, comp)
        mult = tl.load(mult_ptr + lay * N + s, mask=lay_ok, other=0)
        rolling = rolling ^ (tok_s[:, None] * mult[None, :])
        if s > 0:
            hashed = tl.where((gram == s - 1)[None, None, :], rolling[:, :, None], hashed)
    ok = lay_ok[:, None] & col_ok[None, :]
    primes = tl.load(primes_ptr + lay[:, None] * C + col[None, :], mask=ok, other=1)[None, :, :]
    offsets = tl.load(offsets_ptr + lay[:, None] * C + col[None, :], mask=ok, other=0)[None, :, :]
    rem = hashed % primes
    rem = tl.where(rem < 0, rem + primes, rem)  # floor modulo, as torch's `%`
    out = out_ptr + rows[:, None, None] * (L * C) + (lay[:, None] * C + col[None, :])[None, :, :]
    tl.store(out, rem + offsets, mask=row_ok[:, None, None] & ok[None, :, :])


@triton.jit
def _e8m0_value(byte):
    """2**(byte - 127) in fp32 for every byte, exactly as torch's exp2: 0 -> 2**-127 (subnormal),
    255 -> inf."""
    b = byte.to(tl.int32)
    return tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _lookup_kernel(
    hash_ptr, table_ptr, scale_ptr, out_ptr,
    C, R, stride_ht, stride_hc, stride_table, stride_scale, stride_o,
    NB: tl.constexpr, SB: tl.constexpr, NB_P: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    """out[t, c * NB * SB + j] = table[id, j] * 2**(scale[id, j // SB] - 127), id = hash[t, c],
    for one row t and BLOCK_C columns."""
    begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    ids = tl.load(hash_ptr + t * stride_ht + c * stride_hc, mask=c_ok, other=0).to(tl.int64)
    ok = c_ok & (ids >= 0) & (ids < R)
    nb = tl.arange(0, NB_P)
    nb_ok = nb < NB
    within = nb[None, :, None] * SB + tl.arange(0, SB)[None, None, :]  # [1, NB_P, SB]
    read = ok[:, None, None] & nb_ok[None, :, None]
    codes = tl.load(table_ptr + ids[:, None, None] * stride_table + within, mask=read, other=0.0).to(tl.float32)
    exps = tl.load(scale_ptr + ids[:, None] * stride_scale + nb[None, :], mask=ok[:, None] & nb_ok[None, :], other=127)
    values = codes * _e8m0_value(exps)[:, :, None]
    dst = out_ptr + t * stride_o + c[:, None, None].to(tl.int64) * (NB * SB) + within
    tl.store(dst, values.to(out_ptr.dtype.element_ty), mask=c_ok[:, None, None] & nb_ok[None, :, None])


@triton.jit
def _rsqrt(x):
    """1 / sqrt(x), both correctly rounded (torch's CPU rsqrt)."""
    return tl.math.div_rn(1.0, tl.sqrt_rn(x))


@triton.jit
def _gate_kernel(
    s_ptr, kv_ptr, w_ptr, out_ptr,
    D, stride_st, stride_sh, stride_kv, stride_ot, stride_oh, d_float, inv_sqrt_d, eps,
    HC: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """out[t, k] = h + g * value for stream k of row t: key = kv[t, k*D : (k+1)*D], value =
    kv[t, HC*D : (HC+1)*D], w = gate_weight[k]."""
    begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    h = _load_fp32(s_ptr + t * stride_st + k * stride_sh + cols, ok)
    key = _load_fp32(kv_ptr + t * stride_kv + k * D + cols, ok)
    w = tl.load(w_ptr + k * D + cols, mask=ok, other=0.0)
    rstd = _rsqrt(tl.math.div_rn(tl.sum(h * h, axis=0), d_float) + eps) * _rsqrt(tl.math.div_rn(tl.sum(key * key, axis=0), d_float) + eps)
    dot = tl.sum(h * w * key, axis=0) * rstd * inv_sqrt_d
    root = tl.sqrt_rn(tl.maximum(tl.abs(dot), 1e-6))
    signed = (root.to(tl.int32, bitcast=True) | (dot.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
    g = _sigmoid(signed)
    value = _load_fp32(kv_ptr + t * stride_kv + HC * D + cols, ok)
    tl.store(out_ptr + t * stride_ot + k * stride_oh + cols, (h + g * value).to(out_ptr.dtype.element_ty), mask=ok)


def hash_ids(input_ids: torch.Tensor, req: torch.Tensor, local: torch.Tensor, positions: torch.Tensor, prev_tokens: torch.Tensor,
             token_map: torch.Tensor, mult: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor, pad: int) -> torch.Tensor:
    """`EngramHasher.__call__` in one launch: ids, req, local, positions [T]; prev_tokens [B, P];
    token_map [V] int64; mult [L, N], primes [L, N-1, heads], offsets [L, (N-1)*heads] int64
    -> hash ids [T, L, (N-1)*heads] int64."""
    t = input_ids.shape[0]
    n_layers, n = mult.shape
    heads = primes.shape[2]
    c = (n - 1) * heads
    out = torch.empty(t, n_layers, c, dtype=torch.long, device=input_ids.device)
    if t == 0 or n_layers == 0:
        return out
    ids, req, local, positions, prev, token_map, mult, primes, offsets = (
        a.contiguous() for a in (input_ids, req, local, positions, prev_tokens, token_map, mult, primes.reshape(n_layers, c), offsets)
    )
    l_p, c_p = triton.next_power_of_2(n_layers), triton.next_power_of_2(c)
    rows = max(1, HASH_TILE // (l_p * c_p))
    _hash_kernel[(triton.cdiv(t, rows),)](
        ids, req, local, positions, prev, token_map, mult, primes, offsets, out,
        t, prev.shape[1], token_map.shape[0], n_layers, c, pad, prev.stride(0),
        N=n, HEADS=heads, L_P=l_p, C_P=c_p, BLOCK_T=rows, num_warps=4, **pdl_launch(ids.device),
    )
    return out


def lookup(table: torch.Tensor, table_scale: torch.Tensor, hash_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """table float8_e4m3fn [R, dim], table_scale E8M0 (float8_e8m0fnu or uint8) [R, dim/32],
    hash_ids int [T, cols] (any strides) -> [T, cols * dim] in `dtype`."""
    rows, dim = table.shape
    nb = dim // 32
    if table.dtype != torch.float8_e4m3fn or dim % 32 or tuple(table_scale.shape) != (rows, nb) or table.stride(1) != 1 or table_scale.stride(1) != 1:
        raise ValueError(f"engram lookup: table must be float8_e4m3fn [R, dim] (dim a multiple of 32) with E8M0 scales [R, dim/32], got {table.dtype} {list(table.shape)}, {list(table_scale.shape)}")
    t, cols = hash_ids.shape
    out = torch.empty(t, cols * dim, dtype=dtype, device=table.device)
    if t == 0 or cols == 0:
        return out
    scale = quant.e8m0_bytes(table_scale)
    block_c = min(LOOKUP_COLS, triton.next_power_of_2(cols))
    _lookup_kernel[(t, triton.cdiv(cols, block_c))](
        hash_ids, table, scale, out,
        cols, rows, hash_ids.stride(0), hash_ids.stride(1), table.stride(0), scale.stride(0), out.stride(0),
        NB=nb, SB=32, NB_P=triton.next_power_of_2(nb), BLOCK_C=block_c, num_warps=4, **pdl_launch(hash_ids.device),
    )
    return out


def gate(streams: torch.Tensor, kv: torch.Tensor, gate_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [T, hc, D] (last stride 1), kv [T, (hc+1)*D] (the wkv output: hc keys, then
    the value), gate_weight fp32 [hc, D] (q_weight * k_weight) -> [T, hc, D] in streams' dtype."""
    t, hc, d = streams.shape
    if tuple(kv.shape) != (t, (hc + 1) * d) or tuple(gate_weight.shape) != (hc, d) or gate_weight.dtype != torch.float32:
        raise ValueError(f"engram gate: kv must be [{t}, {(hc + 1) * d}] and gate_weight fp32 [{hc}, {d}], got {list(kv.shape)}, {gate_weight.dtype} {list(gate_weight.shape)}")
    if streams.stride(2) != 1:
        streams = streams.contiguous()
    kv, gate_weight = kv.contiguous(), gate_weight.contiguous()
    out = torch.empty(t, hc, d, dtype=streams.dtype, device=streams.device)
    if t == 0:
        return out
    block_d = triton.next_power_of_2(d)
    _gate_kernel[(t, hc)](
        streams, kv, gate_weight, out,
        d, streams.stride(0), streams.stride(1), kv.stride(0), out.stride(0), out.stride(1), float(d), d**-0.5, eps,
        HC=hc, BLOCK_D=block_d, num_warps=8 if block_d >= 4096 else 4, enable_fp_fusion=False, **pdl_launch(streams.device),
    )
    return out
