"""Masked cache stores and the KV fake quantisation on Triton (H200 fast path).

`store_rows(q, kind, x, index, mask)` writes, for every row t with mask[t], the stored format of
`x[t]` at `q[index[0][t], index[1][t]]` — exactly the bytes of `dsv4.ops.kv.store` (the torch
reference, `quant.quantize_fp8_ue8m0` / `quant.quantize_fp4`); `store_plain` does the same for
a plain tensor (compressor tails, V4's unquantised caches). Rows whose mask is False touch no
memory at all, whatever their index holds, so a CUDA graph can be captured over a padded batch
(static shapes, the valid rows named by a device mask, no host sync). Arguments are checked by
the wrappers in `dsv4.ops.kv`.

One program quantises and stores a tile of rows; a row is laid out as [blocks, block] (FP4:
two [blocks, block / 2] halves, the even and the odd channels, which become the low and high
nibbles of a byte), so the per-block amax is a reduction over the last axis. The rounding
follows the reference step by step (quant.py):

* window, FP8 e4m3 + ue8m0 per 32: amax >= 1e-4, exponent = ceil(log2(amax * fp32(1/448)))
  from the product's bits, codes = e4m3(x * 2**-exponent) — the power-of-two division is
  exact, so multiplying by the reciprocal gives the same value, and the reference's clamp to
  +-448 never binds (2**exponent >= amax / 448 even after the product's rounding);
* compressed KV, FP4 + E4M3 per 16: scale = e4m3(max(amax, 6 * 2**-9) / 6) (IEEE division and
  a saturating cast: above 448 gives 448, as torch's cast does since 2.12; torch 2.11 and older
  give NaN above 464, a garbage block, but the model's scales, of RMS-normed latents, stay far
  below 448), q = x / scale, IEEE division (`div_rn`: Triton's plain `/` is not correctly
  rounded on the GPU). CUDA torch evaluates the reference's `amax / 6` (a tensor over a Python
  scalar) as amax * fp32(1/6), which can be an fp32 ulp off the quotient: for bf16 rows (the
  model's) the e4m3 scale is the same for every amax, for fp32 rows it differs in about one
  block in a million;
* indexer keys, FP4 + ue8m0 per 32: exponent = ceil(log2(max(amax, 6 * 2**-126) * fp32(1/6))),
  q = x * 2**-exponent;
* e2m1 codes: round to nearest, ties to the even code, on {0, .5, 1, 1.5, 2, 3, 4, 6}; the
  sign bit of q is kept, so -0 and negatives that round to zero give code 8 (-0), as the
  reference's `signbit` does. Magnitudes above 5 give code 7, so no clamp to +-6 is needed.

`round_trip(kind, x)` is the fake quantisation `decode(encode(x))` of the same formats
(`dsv4.ops.kv.round_trip`, the model's QAT of the window KV and the indexer queries): the same
quantisers, then code value times scale in registers, one launch instead of ~15 torch ops.

Inputs must be finite (the reference's handling of NaN/inf is not reproduced). Indices of valid
rows count from the end when negative, as torch indexing does; a valid row whose index is still
out of range is dropped rather than written out of bounds (the torch path raises IndexError).
Two valid rows naming the same location leave one of them, unspecified which (as torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.cache.storage import CKV_BLOCK, FP8_BLOCK, IDX_BLOCK, QTensor
from dsv4.ops.triton.fp8_gemm import FP8_MAX, fp8_quantise, pow2, pow2_ceil_exponent, round_to_e4m3
from dsv4.ops.triton.pdl import begin, pdl_launch

FP4_MAX = tl.constexpr(6.0)  # largest e2m1 magnitude
# Elements of x per program (rows x padded width): 4 rows of 512 (16 per thread with 4 warps),
# 2048 programs at T = 8192; decode rows get a program each.
TILE_ELEMS = 2048


@triton.jit
def _target_rows(pid, T, S, R, mask_ptr, i0_ptr, i1_ptr, BLOCK_T: tl.constexpr):
    """Rows of this program's tile, whether each is written, and its (i0, i1) target.

    The index of a masked row is never read, so it may hold anything."""
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = rows < T
    valid = valid & (tl.load(mask_ptr + rows, mask=valid, other=0) != 0)
    i0 = tl.load(i0_ptr + rows, mask=valid, other=0).to(tl.int64)
    i1 = tl.load(i1_ptr + rows, mask=valid, other=0).to(tl.int64)
    i0 = tl.where(i0 < 0, i0 + S, i0)
    i1 = tl.where(i1 < 0, i1 + R, i1)
    valid = valid & (i0 >= 0) & (i0 < S) & (i1 >= 0) & (i1 < R)
    return rows.to(tl.int64), valid, i0, i1


@triton.jit
def _load_fp32(ptrs, mask):
    """x as fp32; bf16 is widened from its bits, exact for subnormals too (as the GPU's cast
    is; Triton's interpreter casts bf16 subnormals wrongly)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _e2m1_code(q):
    """e2m1 code of fp32 q: the magnitude code is the number of rounding thresholds reached
    (`>` where a tie goes down to the even code, `>=` where it goes up), bit 3 the sign bit."""
    a = tl.abs(q)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
    code += (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    sign = (q.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << 3)


@triton.jit
def _e2m1_value(code):
    """fp32 value of e2m1 codes: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign bit
    (code 8 is -0, as the reference's table)."""
    m = code & 7
    mag = tl.where(m <= 4, m.to(tl.float32) * 0.5, tl.where(m == 7, 6.0, (m - 2).to(tl.float32)))
    return (mag.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_quantise(x, amax, E4M3_SCALE: tl.constexpr):
    """FP4 blocks x [rows, blocks, n] with their amax [rows, blocks] -> (x / scale as the
    reference rounds it, the stored scale, the scale in fp32)."""
    if E4M3_SCALE:
        scale = round_to_e4m3(tl.minimum(tl.math.div_rn(tl.maximum(amax, FP4_MAX * 2.0**-9), FP4_MAX), FP8_MAX))
        return tl.math.div_rn(x, scale[:, :, None]), scale.to(tl.float8e4nv), scale
    else:
        exp = pow2_ceil_exponent(tl.maximum(amax, FP4_MAX * 2.0**-126) * (1.0 / FP4_MAX))
        return x * pow2(-exp)[:, :, None], (exp + 127).to(tl.uint8), pow2(exp)


@triton.jit
def _store_fp8_kernel(
    x_ptr, mask_ptr, i0_ptr, i1_ptr, codes_ptr, scales_ptr,
    T, S, R, NB, stride_x, stride_c0, stride_c1, stride_s0, stride_s1,
    BLOCK: tl.constexpr, NB_P: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
):
    """Window KV: FP8 e4m3 codes and one ue8m0 exponent byte per BLOCK channels."""
    begin(PDL)
    rows, valid, i0, i1 = _target_rows(tl.program_id(0), T, S, R, mask_ptr, i0_ptr, i1_ptr, BLOCK_T)
    nb = tl.arange(0, NB_P)
    nb_ok = valid[:, None] & (nb < NB)[None, :]
    col = nb[None, :, None] * BLOCK + tl.arange(0, BLOCK)[None, None, :]
    ok = nb_ok[:, :, None]
    x = _load_fp32(x_ptr + rows[:, None, None] * stride_x + col, ok)
    v, exp = fp8_quantise(x)
    codes = codes_ptr + (i0 * stride_c0 + i1 * stride_c1)[:, None, None] + col
    tl.store(codes, v.to(tl.float8e4nv), mask=ok)
    scales = scales_ptr + (i0 * stride_s0 + i1 * stride_s1)[:, None] + nb[None, :]
    tl.store(scales, (exp + 127).to(tl.uint8), mask=nb_ok)


@triton.jit
def _store_fp4_kernel(
    x_ptr, mask_ptr, i0_ptr, i1_ptr, codes_ptr, scales_ptr,
    T, S, R, NB, stride_x, stride_c0, stride_c1, stride_s0, stride_s1,
    E4M3_SCALE: tl.constexpr, BLOCK: tl.constexpr, NB_P: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
):
    """FP4 e2m1 packed two per byte (low nibble = even channel) with one scale per BLOCK
    channels: E4M3 (compressed KV) or a ue8m0 exponent byte (indexer keys)."""
    begin(PDL)
    HALF: tl.constexpr = BLOCK // 2
    rows, valid, i0, i1 = _target_rows(tl.program_id(0), T, S, R, mask_ptr, i0_ptr, i1_ptr, BLOCK_T)
    nb = tl.arange(0, NB_P)
    nb_ok = valid[:, None] & (nb < NB)[None, :]
    pair = nb[None, :, None] * HALF + tl.arange(0, HALF)[None, None, :]  # byte index in the row
    ok = nb_ok[:, :, None]
    x_row = x_ptr + rows[:, None, None] * stride_x + 2 * pair
    xe = _load_fp32(x_row, ok)
    xo = _load_fp32(x_row + 1, ok)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=2), tl.max(tl.abs(xo), axis=2))
    qe, stored, _ = _fp4_quantise(xe, amax, E4M3_SCALE)
    qo, _, _ = _fp4_quantise(xo, amax, E4M3_SCALE)
    packed = _e2m1_code(qe) | (_e2m1_code(qo) << 4)
    codes = codes_ptr + (i0 * stride_c0 + i1 * stride_c1)[:, None, None] + pair
    tl.store(codes, packed.to(tl.uint8), mask=ok)
    scales = scales_ptr + (i0 * stride_s0 + i1 * stride_s1)[:, None] + nb[None, :]
    tl.store(scales, stored, mask=nb_ok)


@triton.jit
def fake_quantise(x, FP8: tl.constexpr, E4M3_SCALE: tl.constexpr):
    """decode(encode(x)) of fp32 blocks x [rows, blocks, block] (FP8: the window's e4m3 +
    ue8m0; else FP4 with E4M3 or ue8m0 scales), in fp32. A decoded value is a code value times
    a scale, at most 6 significant bits and 0 or above 2**-128 in magnitude, so exact in fp32
    and bf16: only the quantisation has to follow the reference's roundings."""
    if FP8:
        v, exp = fp8_quantise(x)
        return v * pow2(exp)[:, :, None]
    q, _, scale = _fp4_quantise(x, tl.max(tl.abs(x), axis=2), E4M3_SCALE)
    return _e2m1_value(_e2m1_code(q)) * scale[:, :, None]


@triton.jit
def _round_trip_kernel(
    x_ptr, out_ptr, M, NB, stride_x, stride_o,
    FP8: tl.constexpr, E4M3_SCALE: tl.constexpr, BLOCK: tl.constexpr, NB_P: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
):
    """out = decode(encode(x)) for a tile of rows: quantised and dequantised in registers
    (`fake_quantise`)."""
    begin(PDL)
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    nb = tl.arange(0, NB_P)
    ok = ((rows < M)[:, None] & (nb < NB)[None, :])[:, :, None]
    col = nb[None, :, None] * BLOCK + tl.arange(0, BLOCK)[None, None, :]
    x = _load_fp32(x_ptr + rows[:, None, None] * stride_x + col, ok)
    y = fake_quantise(x, FP8, E4M3_SCALE)
    tl.store(out_ptr + rows[:, None, None] * stride_o + col, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_plain_kernel(
    x_ptr, mask_ptr, i0_ptr, i1_ptr, dst_ptr,
    T, S, R, D, stride_x, stride_d0, stride_d1,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """dst[i0, i1, cols] = x[row, cols] cast to dst's dtype (round to nearest even)."""
    begin(PDL)
    rows, valid, i0, i1 = _target_rows(tl.program_id(0), T, S, R, mask_ptr, i0_ptr, i1_ptr, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = valid[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    dst = dst_ptr + (i0 * stride_d0 + i1 * stride_d1)[:, None] + cols[None, :]
    tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=ok)


def _rows_per_program(width: int) -> int:
    return max(1, TILE_ELEMS // triton.next_power_of_2(width))


def store_plain(dst: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, mask: torch.Tensor) -> None:
    """dst [S, R, D] (last stride 1), x [T, D], index two int [T], mask bool [T]:
    dst[index[0][t], index[1][t]] = x[t].to(dst.dtype) where mask[t]."""
    t, d = x.shape
    if t == 0:
        return
    x = x if x.stride(-1) == 1 else x.contiguous()  # rows at any stride (a column slice of a wider output)
    i0, i1, mask = (a.contiguous() for a in (index[0], index[1], mask))
    block_d = min(triton.next_power_of_2(d), 1024)
    rows = _rows_per_program(block_d)
    _store_plain_kernel[(triton.cdiv(t, rows), triton.cdiv(d, block_d))](
        x, mask.view(torch.uint8), i0, i1, dst,
        t, dst.shape[0], dst.shape[1], d, x.stride(0), dst.stride(0), dst.stride(1),
        BLOCK_T=rows, BLOCK_D=block_d, num_warps=4, **pdl_launch(x.device),
    )


def store_rows(q: QTensor, kind: str, x: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> None:
    """`dsv4.ops.kv.store(q, index masked, x masked, kind)` in one launch: quantise the valid
    rows of x [T, D] to `kind`'s format ("window" | "ckv" | "idx") and write codes and scales."""
    if not q.quantized:
        store_plain(q.values, index, x, mask)
        return
    t, d = x.shape
    if t == 0:
        return
    x, i0, i1, mask = (a.contiguous() for a in (x, index[0], index[1], mask))
    block = {"window": FP8_BLOCK, "ckv": CKV_BLOCK, "idx": IDX_BLOCK}[kind]
    nb = d // block
    rows = _rows_per_program(d)
    codes, scales = q.codes, q.scales
    args = (
        x, mask.view(torch.uint8), i0, i1, codes, scales,
        t, codes.shape[0], codes.shape[1], nb, x.stride(0), codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1),
    )
    grid = (triton.cdiv(t, rows),)
    consts = {"BLOCK": block, "NB_P": triton.next_power_of_2(nb), "BLOCK_T": rows}
    if kind == "window":
        _store_fp8_kernel[grid](*args, **consts, num_warps=4, **pdl_launch(x.device))
    else:
        _store_fp4_kernel[grid](*args, E4M3_SCALE=kind == "ckv", **consts, num_warps=4, **pdl_launch(x.device))


def round_trip(kind: str, x: torch.Tensor) -> torch.Tensor:
    """`dsv4.ops.kv.round_trip` of a quantised cache in one launch: x [..., D] (bf16 / fp32, D
    a multiple of `kind`'s block; "idx" queries [T, heads, 128] are rows of 128) -> what reading
    `encode(x)` back gives, in x's dtype."""
    block = {"window": FP8_BLOCK, "ckv": CKV_BLOCK, "idx": IDX_BLOCK}[kind]
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"round_trip: a {kind!r} row must be whole blocks of {block}, got width {d}")
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    m, nb = rows.shape[0], d // block
    if m:
        per = _rows_per_program(d)
        _round_trip_kernel[(triton.cdiv(m, per),)](
            rows, out, m, nb, rows.stride(0), out.stride(0),
            FP8=kind == "window", E4M3_SCALE=kind == "ckv", BLOCK=block, NB_P=triton.next_power_of_2(nb), BLOCK_T=per, num_warps=4, **pdl_launch(rows.device),
        )
    return out.view(x.shape)
