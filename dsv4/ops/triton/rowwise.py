"""Row-wise ops of the fast path in one kernel each (H200): RMSNorm, interleaved-pair RoPE and
its cos / sin tables.

In torch each is 6-10 small kernels (casts, square, mean, rsqrt, products; slices, stack,
cat), which in a decode step costs far more in launches than in bytes. Same numerics as the
torch references (dsv4.ops.norm.rms_norm, dsv4.ops.rope.apply_rope): fp32 statistics and
rotations, the reference's rounding points; summation order of the mean may differ (fp32
rounding level). One program per row (or per rotated vector), every row's result independent
of the others (batch invariant), no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from dsv4.ops.triton.pdl import begin, pdl_launch


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps, WEIGHT_IN_FP32: tl.constexpr, BLOCK: tl.constexpr,
                     WEIGHTED: tl.constexpr, PDL: tl.constexpr):
    """out = weight * (x * rsqrt(mean(x^2) + eps)): V4.1 rounds the normalised value to the
    activation dtype before the weight multiply (WEIGHT_IN_FP32 False), V4 multiplies in fp32.
    Not WEIGHTED (V4's q heads, `norm.head_norm`): x * rsqrt(...) with the scale rounded to the
    activation dtype first."""
    begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    h = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    if not WEIGHTED:
        y = h * rstd.to(out_ptr.dtype.element_ty).to(tl.float32)
    else:
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        if WEIGHT_IN_FP32:
            y = w.to(tl.float32) * (h * rstd)
        else:
            y = w.to(out_ptr.dtype.element_ty).to(tl.float32) * (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_in_fp32: bool) -> torch.Tensor:
    """`ops.norm.rms_norm`, or with weight None `ops.norm.head_norm`, over x's last axis."""
    n = x.shape[-1]
    if weight is not None and weight.shape != (n,):
        raise ValueError(f"rms_norm: weight must be [{n}], got {list(weight.shape)}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](x2, x2 if weight is None else weight, out, x2.stride(0), out.stride(0), n, float(eps),
                                          WEIGHT_IN_FP32=weight_in_fp32, BLOCK=block, WEIGHTED=weight is not None,
                                          num_warps=4 if block <= 2048 else 8, **pdl_launch(x2.device))
    return out.view(x.shape)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, V, M, lead, stride_xt, stride_xm, stride_c,
                 HALF: tl.constexpr, INVERSE: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    """In place: rotate the trailing pairs (even, odd) of BLOCK_V vectors (vector v = token
    v // M, vector v % M of it) by their token's angle: (e*c - o*s, e*s + o*c), fp32 math;
    INVERSE negates the sine. cos/sin [T, HALF] hold the activation dtype's rounding of the
    angles. The `lead` channels before them are not touched (not read, not written). The
    2*HALF rotated channels of a vector are one contiguous load and store (16-byte accesses),
    split into even and odd channels in registers."""
    begin(PDL)
    v = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = (v < V)[:, None]
    t = v // M
    ch = x_ptr + (t * stride_xt + (v % M) * stride_xm + lead)[:, None] + tl.arange(0, 2 * HALF)[None, :]
    pairs = tl.reshape(tl.load(ch, mask=ok, other=0.0).to(tl.float32), (BLOCK_V, HALF, 2))
    even, odd = tl.split(pairs)
    p = tl.arange(0, HALF)[None, :]
    c = tl.load(cos_ptr + t[:, None] * stride_c + p, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t[:, None] * stride_c + p, mask=ok, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    # each product rounded on its own, as the reference (the launch disables fp fusion)
    ec, os_, es, oc = even * c, odd * s, even * s, odd * c
    out = tl.reshape(tl.join(ec - os_, es + oc), (BLOCK_V, 2 * HALF))
    tl.store(ch, out.to(x_ptr.dtype.element_ty), mask=ok)


# Rotated vectors per program: 16 x 64 channels, one 16-byte load per thread at 4 warps; a
# decode step's 64 q heads spread over 4 programs (a 64-vector program was 5.7 us per call at
# batch 1, and strided 2-byte accesses made an 8K prefill's rotations 4.6 ms; device, fifth
# session)
ROPE_BLOCK_V = 16


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, D] or [T, M, D] (last stride 1); cos/sin [T, HALF] (HALF a power of two): x's
    trailing 2*HALF channels rotated in place; returns x."""
    t, d, half = x.shape[0], x.shape[-1], cos.shape[-1]
    if cos.shape != (t, half) or sin.shape != cos.shape or 2 * half > d or half & (half - 1):
        raise ValueError(f"apply_rope_: cos/sin must be [{t}, half] with half a power of two <= {d // 2}, got {list(cos.shape)} / {list(sin.shape)}")
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"apply_rope_: x must be [T, D] or [T, M, D] with unit channel stride (rotated in place), got shape {list(x.shape)} strides {list(x.stride())}")
    m = x.shape[1] if x.dim() == 3 else 1
    cos, sin = cos.contiguous(), sin.contiguous()
    if t * m:
        _rope_kernel[(triton.cdiv(t * m, ROPE_BLOCK_V),)](
            x, cos, sin, t * m, m, d - 2 * half, x.stride(0), x.stride(1) if x.dim() == 3 else 0, cos.stride(0),
            HALF=half, INVERSE=inverse, BLOCK_V=ROPE_BLOCK_V, num_warps=4,
            enable_fp_fusion=False, **pdl_launch(x.device))  # no multiply-add contraction: the reference rounds each product
    return x


@triton.jit
def _rope_tables_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, T, HALF: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """cos / sin [T, HALF] of angle position x inv_freq, in fp32, rounded to the tables'
    dtype: the reference's operations (an fp32 product, then libdevice's cosf / sinf, which
    torch's CUDA cos / sin call too, not the approximate hardware ones), so the same bits."""
    begin(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = (t < T)[:, None]
    angle = tl.load(pos_ptr + t, mask=t < T, other=0).to(tl.float32)[:, None] * tl.load(inv_ptr + tl.arange(0, HALF))[None, :]
    out = t.to(tl.int64)[:, None] * HALF + tl.arange(0, HALF)[None, :]
    tl.store(cos_ptr + out, libdevice.cos(angle).to(cos_ptr.dtype.element_ty), mask=ok)
    tl.store(sin_ptr + out, libdevice.sin(angle).to(sin_ptr.dtype.element_ty), mask=ok)


ROPE_TABLE_BLOCK_T = 32


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int [T], inv_freq fp32 [HALF] (a power of two) -> cos, sin [T, HALF] in
    `dtype`: one launch (the torch code is six: cast, product, cos, sin and two roundings)."""
    half = inv_freq.shape[0]
    if positions.dim() != 1 or inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or half & (half - 1):
        raise ValueError(f"rope_tables: positions [T] and float32 inv_freq [HALF] (HALF a power of two), got {list(positions.shape)} / "
                         f"{inv_freq.dtype} {list(inv_freq.shape)}")
    t = positions.shape[0]
    cos = torch.empty(t, half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if t:
        _rope_tables_kernel[(triton.cdiv(t, ROPE_TABLE_BLOCK_T),)](positions.contiguous(), inv_freq.contiguous(), cos, sin, t,
                                                                    HALF=half, BLOCK_T=ROPE_TABLE_BLOCK_T, num_warps=4,
                                                                    enable_fp_fusion=False, **pdl_launch(positions.device))
    return cos, sin
