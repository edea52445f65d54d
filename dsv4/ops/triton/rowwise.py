"""Row-wise ops of the fast path in one kernel each (H200): RMSNorm, interleaved-pair RoPE and
its cos / sin tables, and the attention's inputs (`latent_inputs`: both norms of the stacked
wq_a + wkv output, kv's RoPE and window rounding; `rope_queries_`: the RoPE of q and of the
indexer's queries with their FP4 rounding — `dsv4.ops.attention`'s two ops).

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

from dsv4.cache import storage
from dsv4.ops.triton.kv import fake_quantise
from dsv4.ops.triton.pdl import begin, pdl_launch

FP8_BLOCK = tl.constexpr(storage.FP8_BLOCK)  # the window ring's channels per scale
IDX_BLOCK = tl.constexpr(storage.IDX_BLOCK)  # the indexer keys' channels per scale


@triton.jit
def norm_row(h, w, n, eps, WEIGHT_IN_FP32: tl.constexpr, dtype: tl.constexpr):
    """RMSNorm of one row h (fp32, zero past its n values) in `dtype`: weight * (h *
    rsqrt(mean(h^2) + eps)), V4.1 rounding the normalised value to `dtype` before the weight
    multiply (WEIGHT_IN_FP32 False), V4 multiplying in fp32."""
    return scale_row(h, w, tl.math.rsqrt(tl.sum(h * h, axis=0) / n + eps), WEIGHT_IN_FP32, dtype)


@triton.jit
def scale_row(h, w, rstd, WEIGHT_IN_FP32: tl.constexpr, dtype: tl.constexpr):
    """The last step of `norm_row` on values h (fp32) of a row whose rsqrt(mean(h^2) + eps) is
    `rstd`: the weight and the rounding (one home for both, whoever found rstd)."""
    if WEIGHT_IN_FP32:
        return (w.to(tl.float32) * (h * rstd)).to(dtype)
    return (w.to(dtype).to(tl.float32) * (h * rstd).to(dtype).to(tl.float32)).to(dtype)


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
    if not WEIGHTED:
        rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / N + eps)
        y = (h * rstd.to(out_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty)
    else:
        y = norm_row(h, tl.load(w_ptr + cols, mask=ok, other=0.0), N, eps, WEIGHT_IN_FP32, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=ok)


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
    _rope_vectors(x_ptr, cos_ptr, sin_ptr, tl.program_id(0), V, M, lead, stride_xt, stride_xm, stride_c, HALF, INVERSE, BLOCK_V)


@triton.jit
def mul_rn(a, b, PTX: tl.constexpr):
    """a * b in fp32 rounded on its own, in a kernel launched with fp fusion on: PTX's mul.rn
    (compiled CUDA), which is never contracted with a following add into a fused
    multiply-add; plain otherwise (the interpreter's numpy never fuses; launches with
    enable_fp_fusion=False contract nothing)."""
    if PTX:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def rotate_pairs(even, odd, c, s, PTX: tl.constexpr):
    """The pairs (even, odd) rotated by the angles' cos c and sin s: (e*c - o*s, e*s + o*c),
    each product rounded on its own, as the reference: this module's launches disable fp
    fusion (PTX False); the attention's PV epilogue, whose launch cannot, takes PTX products
    (`mul_rn`)."""
    ec, os_, es, oc = mul_rn(even, c, PTX), mul_rn(odd, s, PTX), mul_rn(even, s, PTX), mul_rn(odd, c, PTX)
    return ec - os_, es + oc


@triton.jit
def _rope_vectors(x_ptr, cos_ptr, sin_ptr, pid, V, M, lead, stride_xt, stride_xm, stride_c,
                  HALF: tl.constexpr, INVERSE: tl.constexpr, BLOCK_V: tl.constexpr):
    """`_rope_kernel`'s work for program `pid`: its BLOCK_V vectors rotated in place."""
    v = pid.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
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
    e2, o2 = rotate_pairs(even, odd, c, s, False)
    tl.store(ch, tl.reshape(tl.join(e2, o2), (BLOCK_V, 2 * HALF)).to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_tail(y, c_ptrs, s_ptrs, ok, WIDTH: tl.constexpr, HALF: tl.constexpr, dtype: tl.constexpr):
    """Rows y [R, WIDTH] (fp32) with their trailing HALF channel pairs rotated, rounded to
    `dtype` and back to fp32; c_ptrs / s_ptrs [R, WIDTH / 2] address the rows' cos / sin of
    pair p - (WIDTH / 2 - HALF) (read only at the rotated pairs, where ok)."""
    even, odd = tl.split(tl.reshape(y, (y.shape[0], WIDTH // 2, 2)))
    rot = (tl.arange(0, WIDTH // 2) >= WIDTH // 2 - HALF)[None, :]
    c = tl.load(c_ptrs, mask=ok & rot, other=0.0).to(tl.float32)
    s = tl.load(s_ptrs, mask=ok & rot, other=0.0).to(tl.float32)
    e2, o2 = rotate_pairs(even, odd, c, s, False)
    out = tl.join(tl.where(rot, e2, even), tl.where(rot, o2, odd))
    return tl.reshape(out, (y.shape[0], WIDTH)).to(dtype).to(tl.float32)


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


# ------------------------------------------------------------------------------ attention inputs
# A decode step ran the attention's inputs as five to seven launches a layer, each a DRAM round
# trip of a few KB a row (the two norms, the RoPE of q, of kv and of the indexer's queries, the
# window's and the indexer's fake quantisation); here they are two, with the same arithmetic and
# roundings in the same order.


@triton.jit
def _latent_inputs_kernel(
    x_ptr, qw_ptr, kvw_ptr, q_ptr, kv_ptr, cos_ptr, sin_ptr,
    stride_x, stride_q, stride_kv, stride_c, QN, eps,
    WEIGHT_IN_FP32: tl.constexpr, Q_BLOCK: tl.constexpr, KVN: tl.constexpr, HALF: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row program_id(0) of x = [q_a (QN) | kv (KVN)]: program_id(1) 0 stores rms_norm(q_a);
    1 stores kv normed, its trailing HALF pairs rotated (each step rounded to the activation
    dtype, as the separate kernels stored it) and, FP8, fake-quantised as the window ring
    stores it (e4m3 + ue8m0 per FP8_BLOCK channels)."""
    begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    if tl.program_id(1) == 0:  # (the branches' names differ: Triton types a name across both)
        q_cols = tl.arange(0, Q_BLOCK)
        q_ok = q_cols < QN
        q_a = tl.load(x_ptr + row * stride_x + q_cols, mask=q_ok, other=0.0).to(tl.float32)
        q = norm_row(q_a, tl.load(qw_ptr + q_cols, mask=q_ok, other=0.0), QN, eps, WEIGHT_IN_FP32, dtype)
        tl.store(q_ptr + row * stride_q + q_cols, q, mask=q_ok)
    else:
        kv_cols = tl.arange(0, KVN)
        kv_in = tl.load(x_ptr + row * stride_x + QN + kv_cols).to(tl.float32)
        kv = norm_row(kv_in, tl.load(kvw_ptr + kv_cols), KVN, eps, WEIGHT_IN_FP32, dtype).to(tl.float32)
        p = (tl.arange(0, KVN // 2) - (KVN // 2 - HALF))[None, :]
        c_ptrs, s_ptrs = cos_ptr + row * stride_c + p, sin_ptr + row * stride_c + p
        kv = _rope_tail(tl.reshape(kv, (1, KVN)), c_ptrs, s_ptrs, tl.full((1, 1), True, tl.int1), KVN, HALF, dtype)
        if FP8:
            kv = tl.reshape(fake_quantise(tl.reshape(kv, (1, KVN // FP8_BLOCK, FP8_BLOCK)), True, False), (1, KVN))
        tl.store(kv_ptr + row * stride_kv + kv_cols[None, :], kv.to(dtype))


def latent_inputs(qkv: torch.Tensor, q_width: int, q_norm: torch.Tensor, kv_norm: torch.Tensor, eps: float, weight_in_fp32: bool,
                  cos: torch.Tensor, sin: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`dsv4.ops.attention.latent_inputs` in one launch: qkv [T, q_width + KVN] (KVN a power of
    two) -> (q_res [T, q_width], kv [T, KVN])."""
    t, width = qkv.shape
    kvn, half = width - q_width, cos.shape[-1]
    if kvn <= 0 or kvn & (kvn - 1) or 2 * half > kvn or half & (half - 1) or cos.shape != (t, half) or sin.shape != cos.shape:
        raise ValueError(f"latent_inputs: kv width {kvn} must be a power of two holding 2 x cos's last axis, cos / sin [{t}, half]; got "
                         f"{list(cos.shape)} / {list(sin.shape)}")
    if fp8 and kvn % storage.FP8_BLOCK:
        raise ValueError(f"latent_inputs: the FP8 window rounds whole blocks of {storage.FP8_BLOCK} channels, got kv width {kvn}")
    if q_norm.shape != (q_width,) or kv_norm.shape != (kvn,):
        raise ValueError(f"latent_inputs: norm weights must be [{q_width}] and [{kvn}], got {list(q_norm.shape)} / {list(kv_norm.shape)}")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty(t, q_width, dtype=qkv.dtype, device=qkv.device)
    kv = torch.empty(t, kvn, dtype=qkv.dtype, device=qkv.device)
    if t:
        q_block = triton.next_power_of_2(q_width)
        cos, sin = cos.contiguous(), sin.contiguous()
        _latent_inputs_kernel[(t, 2)](
            qkv, q_norm.contiguous(), kv_norm.contiguous(), q, kv, cos, sin, qkv.stride(0), q.stride(0), kv.stride(0), cos.stride(0),
            q_width, float(eps), WEIGHT_IN_FP32=weight_in_fp32, Q_BLOCK=q_block, KVN=kvn, HALF=half, FP8=fp8,
            num_warps=4 if max(q_block, kvn) <= 2048 else 8, enable_fp_fusion=False, **pdl_launch(qkv.device))
    return q, kv


@triton.jit
def _query_rope_kernel(
    q_ptr, cos_ptr, sin_ptr, i_ptr, icos_ptr, isin_ptr,
    VQ, H, VI, IH, stride_qt, stride_qh, stride_it, stride_ih, stride_c, stride_ic, q_lead,
    HALF: tl.constexpr, ID: tl.constexpr, IHALF: tl.constexpr, FP4: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
):
    """In place: the first cdiv(VQ, BLOCK_V) programs rotate the query heads' trailing HALF
    pairs (`_rope_vectors`); the rest the indexer's query heads' (ID channels each, their
    own angles), then, FP4, fake-quantise them as the indexer keys are stored (e2m1 + ue8m0 per
    IDX_BLOCK channels)."""
    begin(PDL)
    pid = tl.program_id(0)
    q_programs = tl.cdiv(VQ, BLOCK_V)
    if pid < q_programs:
        _rope_vectors(q_ptr, cos_ptr, sin_ptr, pid, VQ, H, q_lead, stride_qt, stride_qh, stride_c, HALF, False, BLOCK_V)
    else:
        v = (pid - q_programs).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        ok = (v < VI)[:, None]
        t = v // IH
        ptrs = i_ptr + (t * stride_it + (v % IH) * stride_ih)[:, None] + tl.arange(0, ID)[None, :]
        dtype = i_ptr.dtype.element_ty
        y = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        p = t[:, None] * stride_ic + (tl.arange(0, ID // 2) - (ID // 2 - IHALF))[None, :]
        y = _rope_tail(y, icos_ptr + p, isin_ptr + p, ok, ID, IHALF, dtype)
        if FP4:
            y = tl.reshape(fake_quantise(tl.reshape(y, (BLOCK_V, ID // IDX_BLOCK, IDX_BLOCK)), False, False), (BLOCK_V, ID))
        tl.store(ptrs, y.to(dtype), mask=ok)


def rope_queries_(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, idx_q: torch.Tensor | None = None,
                  idx_cos: torch.Tensor | None = None, idx_sin: torch.Tensor | None = None, fp4: bool = False) -> None:
    """`dsv4.ops.attention.rope_queries_` in one launch: q [T, H, D] and idx_q [T, IH, ID]
    (ID a power of two; unit channel strides) rotated (and idx_q, fp4, fake-quantised) in
    place."""
    t, h, d = q.shape
    half = cos.shape[-1]
    if cos.shape != (t, half) or sin.shape != cos.shape or 2 * half > d or half & (half - 1) or q.stride(-1) != 1:
        raise ValueError(f"rope_queries_: q [T, H, D] (unit channel stride) and cos / sin [{t}, half], half a power of two <= {d // 2}; got q "
                         f"{list(q.shape)} strides {list(q.stride())}, cos {list(cos.shape)}, sin {list(sin.shape)}")
    ih, idim, ihalf = (0, 2, 1) if idx_q is None else (idx_q.shape[1], idx_q.shape[2], idx_cos.shape[-1])
    if idx_q is not None:
        if (idx_q.dim() != 3 or idx_q.shape[0] != t or idx_q.stride(-1) != 1 or idim & (idim - 1) or 2 * ihalf > idim or ihalf & (ihalf - 1)
                or idx_cos.shape != (t, ihalf) or idx_sin.shape != idx_cos.shape):
            raise ValueError(f"rope_queries_: idx_q [{t}, IH, ID] (ID a power of two, unit channel stride) and idx cos / sin [{t}, half], got idx_q "
                             f"{list(idx_q.shape)} strides {list(idx_q.stride())}, cos {list(idx_cos.shape)}, sin {list(idx_sin.shape)}")
        if fp4 and idim % storage.IDX_BLOCK:
            raise ValueError(f"rope_queries_: FP4 indexer queries round whole blocks of {storage.IDX_BLOCK} channels, got {idim}")
    if t == 0:
        return
    cos, sin = cos.contiguous(), sin.contiguous()
    if idx_q is None:  # no indexer heads: its pointers are q's, never read
        idx_q, idx_cos, idx_sin = q, cos, sin
    else:
        idx_cos, idx_sin = idx_cos.contiguous(), idx_sin.contiguous()
    vq, vi = t * h, t * ih
    _query_rope_kernel[(triton.cdiv(vq, ROPE_BLOCK_V) + triton.cdiv(vi, ROPE_BLOCK_V),)](
        q, cos, sin, idx_q, idx_cos, idx_sin, vq, h, vi, max(ih, 1), q.stride(0), q.stride(1), idx_q.stride(0), idx_q.stride(1),
        cos.stride(0), idx_cos.stride(0), d - 2 * half,
        HALF=half, ID=idim, IHALF=ihalf, FP4=fp4 and vi > 0, BLOCK_V=ROPE_BLOCK_V, num_warps=4,
        enable_fp_fusion=False, **pdl_launch(q.device))
