"""Manifold-constrained hyper-connections on Triton (H200 fast path).

Same semantics as the torch references in `dsv4.ops.mhc` (which dispatch here for CUDA bf16
streams): x is [T, hc, D] bf16 (hc a power of two), every mix is fp32.

* `hc_mixes`: per row, the RMS statistic over all hc*D values, m = flat @ fn^T (fn fp32
  [(2+hc)*hc, hc*D]), the pre/post sigmoids and comb's softmax + Sinkhorn. Two launches:
  a GEMM kernel (`fp32_gemm_parts`: bf16 tensor cores at fp32 accuracy, the sum of squares
  riding along in a spare output column; V4.1's router and compressor GEMMs use it too,
  `fp32_gemm`) and an epilogue kernel. The rsqrt is applied to the product (m * rsqrt)
  rather than to x, as DeepSeek's reference does: same math, x stays exact in bf16.

  fp32 accuracy without tf32: x is exact in bf16 and fn is split in registers into three bf16
  parts, fn = hi + mid + lo, exactly (each part takes the next 8 significant bits of the
  remainder, and the remainders are exact in fp32), so the three bf16 products accumulated in
  fp32 are an fp32 GEMM up to the accumulation order. The tensor cores add each MMA's products
  to the accumulator with truncation at the accumulator's exponent (round toward zero, not
  IEEE), so each BLOCK_K step's product is formed from zero (lo, mid, then hi) and added to
  the running sum with an fp32 add: the truncation then acts at the scale of one step's
  product, with its sign random across steps, instead of at the scale of the chunk's running
  sum, always toward zero (measured on the H200 with the chained accumulator: 2-5x the fp32
  reference's error at T <= 256).

  Batch invariance: K is cut into chunks of CONFIG["CHUNK"] inputs, fixed by K alone. Each
  chunk is summed on its own and the chunk sums are added in order to a zero total — either in
  the GEMM program that runs all chunks of a row tile (many row tiles: prefill), or one program
  per chunk writes its sum and the epilogue adds them in the same order (few row tiles: decode,
  filling the SMs). Same bits either way, so a row's mixes do not depend on the batch; both
  modes end in the same epilogue code, whose per-row math never mixes rows and whose launch is
  the same for every T (the layout of its tile sets the order of its sums).
* `hc_collapse` (and `hc_collapse_norm` = collapse then `rms_norm`): sum_k pre_k * x_k in fp32,
  rounded to bf16 (then the RMSNorm of `ops.norm.rms_norm` with either weight rounding);
  programs over (row, column slice of COLLAPSE_BLOCK_D), the norm a second launch over the same
  slices from their partial sums of squares, added in slice order.
* `hc_expand` (V4.1's fp32 variant): out_k = post_k * y + sum_j comb[j, k] * residual_j in
  fp32, rounded once; programs over (row, column tile).
* `hc_expand_collapse_norm` (V4.1): the expand after a layer's attention and the collapse +
  norm of the FFN site's input (which V4.1 collapses with the attention site's `pre`) in one
  launch over (row, column slice), then the same norm launch: the same operations as the two
  kernels.

Collapse, expand and the mixes epilogue are compiled without fp contraction: each product is
rounded before it is added, in the reference's order, as torch computes them (in the epilogue,
whose sums are shuffles between lanes, a product fused into one lane's add would also leave the
lanes of a row with different sums). The epilogue uses IEEE divisions, a
correctly rounded rsqrt and an exp whose error does not grow with the argument (`_exp`), so
pre/post/comb agree with the reference at fp32 rounding level (the device check's rule: against
fp64, within 2x the fp32 torch reference's own error). Everything is sized from shapes only (no
host sync): the calls can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.triton.fp8_gemm import num_sms, sum_chunks
from dsv4.ops.triton.pdl import begin, pdl_launch
from dsv4.ops.triton.rowwise import scale_row

# GEMM tiling: rows per program (BLOCK_T, or MANY_BLOCK_T below; the rows are the MMA's M, so
# a row's products and sums do not depend on how many rows share its program), K step, chunk (the unit of the split and of the fixed-order chunk sum; 80 chunks at
# hc*D = 20480: a decode call's programs run 4 serial K steps instead of 8 with 512-input
# chunks, mHC 0.46 -> 0.41 ms and the router 1.11 -> 1.07 ms of a batch-1 step, S5-4; the 8K
# prefill's unsplit mixes +0.25 ms, within that run's noise; in split mode the partial sums
# write 1/4 of x's bytes and read them back). 8 warps: with 4, ptxas needs 255 registers and spills on
# sm_90 (x is both a tensor-core operand and squared in registers). check_kernels.py times
# alternatives. EPI_BLOCK_T: the epilogue's rows per program, on one warp: at hc = 4 its
# 2 x 4 x 4 comb tile is one entry per lane (why: `_mixes_epilogue_kernel`); fixed for every T,
# since the tile's layout sets the order of the epilogue's sums.
CONFIG = {"BLOCK_T": 64, "MANY_BLOCK_T": 128, "BLOCK_K": 64, "CHUNK": 256, "num_warps": 8, "num_stages": 3, "EPI_BLOCK_T": 2}
# MANY_BLOCK_T: the rows per program of split calls that have many row tiles anyway (prefill's
# mixes and router); same bits as 64-row programs, so batch invariance holds. The mixes
# at 8192 rows 0.414 -> 0.255 ms, same bits (check_kernels mhc, H100, twentieth session; level
# at 1 and 256 rows). Few-tile (decode) calls keep 64: the router's split kernel takes 127
# registers at 64 rows (two programs an SM), 216 at 128 (sm_90 compile).
# Output columns per GEMM program (mHC's 24 + 1 in one block): 32 when the K chunks are split
# over programs (few rows: a router at batch 1 was 0.05 ms slower with 64, half the programs),
# 64 otherwise (251 registers at 8 warps, no spills; x is read once per column block: the
# prefill compressor's 1024 columns 2.87 -> 2.37 ms at 8K, S4-7). A column's bits do not depend
# on the block width (check_kernels `invariance_fp32_gemm`, H200, fifth session).
SPLIT_BLOCK_N = 32
WIDE_BLOCK_N = 64
# Calls whose chunk partials (fp32 [chunks, T, cols]) take at most this many bytes split too,
# whatever their row tiles: unsplit, a prefill's mixes run 128 programs at 8K rows, one per
# row tile, each through all 320 K steps of 20480 inputs; split, 80 programs per row tile run
# 4 steps each and the partials (84 MB at 8K rows of mHC's 32 columns) cross HBM twice.
# check_kernels mhc S10-2: mixes at 8192 rows 0.542 -> 0.353 ms (same bits), at 4096 level
# (0.183); prefill 8K 87.4 -> 86.6 ms. The compressor's 1024 columns (80 KB of partials a
# row) stay unsplit.
SPLIT_MAX_BYTES = 384 << 20
# Columns per program of `hc_expand`.
EXPAND_BLOCK_D = 1024
# Columns per program of the collapse kernels (`_collapse_kernel`, `_expand_collapse_kernel`,
# `_norm_slices_kernel`): a row of D = 5120 in 5 programs. They ran one 8-warp program a row
# (8192 lanes for 5120 values): at one row issue bound on one SM, the fused expand + collapse
# ~3260 instructions a thread (sm_90 compile), 6.2 us at batch 1 on the H100 (S26-1 timeline).
# Split, the norm needs the row's sum of squares from every slice: each slice writes its
# partial, a second launch adds them in slice order (batch invariant) and normalises. S27-3
# (H100, batch 1): 2.6 us + 1.45 us for the norm; steps level at decode, p8k -2% (docs/PERF.md).
COLLAPSE_BLOCK_D = 1024

LOG2E = tl.constexpr(1.4426950216293335)  # fp32(log2(e)), exactly
LOG2E_LO = tl.constexpr(1.92596298909109e-08)  # log2(e) - fp32(log2(e))
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _exp(x):
    """e**x within a few ulps for any x: exp2 of x * log2(e) with that product's rounding error
    (recovered by an fma) folded back in; `tl.exp` drops it, an error of |x| * 2**-24."""
    y = x * LOG2E
    y_lo = tl.fma(x, LOG2E, -y) + x * LOG2E_LO
    return tl.exp2(y) * (1.0 + y_lo * LN2)


@triton.jit
def _sigmoid(z):
    return tl.math.div_rn(1.0, 1.0 + _exp(-z))


@triton.jit
def _fp32_gemm_kernel(
    x_ptr, w_ptr, part_ptr,
    T, N, K, stride_x, stride_w, stride_part, stride_row,
    K_STEPS, CHUNK_STEPS, CHUNKS_PER_PROGRAM,
    SUMSQ: tl.constexpr, STEP_PARTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """part[pid_c, rows, cols] = sum over this program's chunks of x @ w^T for the column block
    pid_n; SUMSQ: column N holds sum x^2 instead.

    Each chunk's sum starts from zero and is added to the running total, in chunk order.
    STEP_PARTS: program pid_c runs K step pid_c alone and stores its product, which the
    consumer adds up as a chunk would (`add_step_parts`): the same fp32 additions in the same
    order, so the same bits, with one step's latency a program instead of a chunk's."""
    begin(PDL)
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = rt < T
    x_rows = x_ptr + rt.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + rn[:, None] * stride_w
    if STEP_PARTS:
        total, sq = _fp32_step(x_rows, w_rows, pid_c, t_ok, rn < N, K, SUMSQ, BLOCK_K)
        if SUMSQ:
            total = tl.where(rn[None, :] == N, sq[:, None], total)
    else:
        total = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        first = pid_c * CHUNKS_PER_PROGRAM
        for chunk in range(first, first + CHUNKS_PER_PROGRAM):
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
            for step in range(chunk * CHUNK_STEPS, tl.minimum(chunk * CHUNK_STEPS + CHUNK_STEPS, K_STEPS)):
                prod, step_sq = _fp32_step(x_rows, w_rows, step, t_ok, rn < N, K, SUMSQ, BLOCK_K)
                acc += prod
                if SUMSQ:
                    sq += step_sq
            if SUMSQ:
                acc = tl.where(rn[None, :] == N, sq[:, None], acc)
            total += acc
    out = part_ptr + pid_c * stride_part + rt.to(tl.int64)[:, None] * stride_row + rn[None, :]
    tl.store(out, total, mask=t_ok[:, None])


@triton.jit
def _fp32_step(x_rows, w_rows, step, t_ok, n_ok, K, SUMSQ: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of `_fp32_gemm_kernel`: (x @ w^T over inputs step * BLOCK_K .., the rows'
    sum of x^2 there (SUMSQ; else 0))."""
    k = step * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < K
    x = tl.load(x_rows + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    hi = w.to(tl.bfloat16)
    rest = w - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    # The step's product starts from zero, smallest part first, and joins the chunk's sum by
    # an fp32 add (the caller's): the tensor cores truncate each MMA's sum at the
    # accumulator's magnitude, so chaining the sum through them would bias every chunk toward
    # zero.
    prod = tl.dot(x, tl.trans(lo))
    prod = tl.dot(x, tl.trans(mid), prod)
    prod = tl.dot(x, tl.trans(hi), prod)
    sq = tl.zeros((x.shape[0],), dtype=tl.float32)
    if SUMSQ:
        xf = x.to(tl.float32)
        sq = tl.sum(xf * xf, axis=1)
    return prod, sq


def fp32_chunks(k: int) -> tuple[int, int]:
    """(K steps per chunk, chunks) of `fp32_gemm_parts` for k inputs: from K and the config only."""
    steps = triton.cdiv(k, CONFIG["BLOCK_K"])
    per = max(1, CONFIG["CHUNK"] // CONFIG["BLOCK_K"])
    return per, triton.cdiv(steps, per)


def fp32_gemm_parts(x2: torch.Tensor, w: torch.Tensor, sumsq: bool) -> torch.Tensor:
    """bf16 x2 [T, K] @ fp32 w [N, K]^T at fp32 accuracy (module docstring), as the chunk sums
    to be added in order: fp32 [S, T, cols], S = 1 (every chunk added in the GEMM) or the chunk
    count (few row tiles: one program per chunk fills the SMs; the same bits once added).
    cols = N rounded up to a power of two (N + 1 with `sumsq`: column N holds sum x^2), at
    least 32. Also V4.1's router GEMM (`router.route_scores`) and, through `fp32_gemm`, the
    compressor's."""
    t, k = x2.shape
    n = w.shape[0]
    cols = max(32, triton.next_power_of_2(n + 1 if sumsq else n))
    bt = CONFIG["BLOCK_T"]
    per, chunks = fp32_chunks(k)
    tiles = triton.cdiv(t, bt)
    few_tiles = 2 * tiles * (cols // min(cols, SPLIT_BLOCK_N)) <= num_sms(x2.device)
    split = chunks if few_tiles or chunks * t * cols * 4 <= SPLIT_MAX_BYTES else 1
    block_n = min(cols, SPLIT_BLOCK_N if split > 1 else WIDE_BLOCK_N)
    if split > 1 and not few_tiles:
        bt = CONFIG["MANY_BLOCK_T"]
        tiles = triton.cdiv(t, bt)
    part = torch.empty(split, t, cols, dtype=torch.float32, device=x2.device)
    if t:
        _fp32_gemm_kernel[(tiles, split, cols // block_n)](
            x2, w, part, t, n, k, x2.stride(0), w.stride(0), t * cols, cols,
            triton.cdiv(k, CONFIG["BLOCK_K"]), per, chunks // split,
            SUMSQ=sumsq, STEP_PARTS=False, BLOCK_T=bt, BLOCK_N=block_n, BLOCK_K=CONFIG["BLOCK_K"], num_warps=CONFIG["num_warps"],
            num_stages=CONFIG["num_stages"], **pdl_launch(x2.device),
        )
    return part


def fp32_gemm_step_parts(x2: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`fp32_gemm_parts` one program per K step (few rows: V4.1's router at decode), for K in
    whole chunks: -> (fp32 [K steps, T, cols], the steps of a chunk); the consumer adds each
    chunk's step products in order from zero and the chunk sums in order (`add_step_parts`),
    the additions of `_fp32_gemm_kernel`, so the same bits as `fp32_gemm_parts`. A chunk's
    steps ran one after another in one program: the latency of CHUNK / BLOCK_K dependent
    loads and MMA chains, where here every program runs one."""
    t, k = x2.shape
    n = w.shape[0]
    per, chunks = fp32_chunks(k)
    steps = triton.cdiv(k, CONFIG["BLOCK_K"])
    if steps != per * chunks:
        raise ValueError(f"fp32_gemm_step_parts: {k} inputs are not whole chunks of {CONFIG['CHUNK']}")
    cols = max(32, triton.next_power_of_2(n))
    bt = CONFIG["BLOCK_T"]
    part = torch.empty(steps, t, cols, dtype=torch.float32, device=x2.device)
    if t:
        _fp32_gemm_kernel[(triton.cdiv(t, bt), steps, cols // SPLIT_BLOCK_N)](
            x2, w, part, t, n, k, x2.stride(0), w.stride(0), t * cols, cols, steps, per, 1,
            SUMSQ=False, STEP_PARTS=True, BLOCK_T=bt, BLOCK_N=SPLIT_BLOCK_N, BLOCK_K=CONFIG["BLOCK_K"], num_warps=CONFIG["num_warps"],
            num_stages=CONFIG["num_stages"], **pdl_launch(x2.device),
        )
    return part, per


@triton.jit
def add_step_parts(ptrs, stride_part, mask, CHUNKS: tl.constexpr, STEPS: tl.constexpr):
    """The sum of partials ptrs + i * stride_part (i < CHUNKS * STEPS; masked loads read 0) as
    `_fp32_gemm_kernel` adds them: STEPS step products a chunk, from zero and in order, then
    the chunk sums in order (STEPS 1: chunk sums, or one total)."""
    total = tl.zeros(ptrs.shape, dtype=tl.float32)
    for c in tl.static_range(CHUNKS):  # unrolled: every partial's load issues at once
        acc = tl.zeros(ptrs.shape, dtype=tl.float32)
        for s in tl.static_range(STEPS):
            acc += tl.load(ptrs + (c * STEPS + s) * stride_part, mask=mask, other=0.0)
        total += acc
    return total


def fp32_gemm(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 x2 [T, K] @ fp32 w [N, K]^T -> fp32 [T, N] at fp32 accuracy, a row's bits
    independent of T (`fp32_gemm_parts`, its chunk sums added in order here when the GEMM
    split them)."""
    t, n = x2.shape[0], w.shape[0]
    part = fp32_gemm_parts(x2, w, sumsq=False)
    if part.shape[0] == 1 and part.shape[2] == n:
        return part[0]
    return sum_chunks(part, torch.empty(t, n, dtype=torch.float32, device=x2.device))


@triton.jit
def _mixes_epilogue_kernel(
    part_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
    T, K, stride_part, iters, norm_eps, hc_eps,
    CHUNKS: tl.constexpr, HC: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
):
    """Chunk sums added in order, then pre = sigmoid(m * rsqrt * s0 + b) + eps, post = 2 *
    sigmoid(...), comb = Sinkhorn(softmax(...)) exactly as `ops.mhc.hc_mixes` orders them.

    The time is the chain of dependent operations a thread runs (a few rows, 2 * iters
    normalisations). ptxas gives every div_rn its own branch region (the slow path is a call),
    so one thread's divisions run one after another. The launch (CONFIG) puts one comb entry in
    each lane at HC = 4 (2 rows x 16 entries, one warp): a normalisation is then one division
    per lane after its sum's log2(HC) butterfly shuffles. With more entries per lane Triton
    vectorises the loads and keeps a comb row in one thread, which then runs HC divisions per
    normalisation (and the sums' order changes with the layout: the launch is fixed for every
    T)."""
    begin(PDL)
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = rt < T
    h = tl.arange(0, HC)
    rows = part_ptr + rt.to(tl.int64) * NP
    vec = rows[:, None] + h[None, :]  # [BLOCK_T, HC] offsets of a row's first HC mixes
    mat = rows[:, None, None] + h[None, :, None] * HC + h[None, None, :]  # [BLOCK_T, HC, HC]
    ok2 = t_ok[:, None]
    ok3 = t_ok[:, None, None]
    m_pre = tl.zeros((BLOCK_T, HC), dtype=tl.float32)
    m_post = tl.zeros((BLOCK_T, HC), dtype=tl.float32)
    m_comb = tl.zeros((BLOCK_T, HC, HC), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for c in tl.static_range(CHUNKS):  # unrolled: every chunk's loads issue at once
        off = c * stride_part
        m_pre += tl.load(vec + off, mask=ok2, other=0.0)
        m_post += tl.load(vec + off + HC, mask=ok2, other=0.0)
        m_comb += tl.load(mat + off + 2 * HC, mask=ok3, other=0.0)
        sq += tl.load(rows + off + (2 + HC) * HC, mask=t_ok, other=0.0)
    r = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(sq, K.to(tl.float32)) + norm_eps))  # Triton's `/` and rsqrt are approximate
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = _sigmoid(m_pre * r[:, None] * s0 + tl.load(base_ptr + h)[None, :]) + hc_eps
    post = 2.0 * _sigmoid(m_post * r[:, None] * s1 + tl.load(base_ptr + HC + h)[None, :])
    logits = m_comb * r[:, None, None] * s2 + tl.load(base_ptr + 2 * HC + h[:, None] * HC + h[None, :])[None, :, :]
    e = _exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = tl.math.div_rn(e, tl.sum(e, axis=2)[:, :, None]) + hc_eps
    comb = tl.math.div_rn(comb, tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in range(iters - 1):
        comb = tl.math.div_rn(comb, tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = tl.math.div_rn(comb, tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    out_vec = rt.to(tl.int64)[:, None] * HC + h[None, :]
    tl.store(pre_ptr + out_vec, pre, mask=ok2)
    tl.store(post_ptr + out_vec, post, mask=ok2)
    out_mat = rt.to(tl.int64)[:, None, None] * (HC * HC) + h[None, :, None] * HC + h[None, None, :]
    tl.store(comb_ptr + out_mat, comb, mask=ok3)


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """`ops.mhc.hc_mixes` for bf16 x [T, hc, D]: -> pre [T, hc], post [T, hc], comb [T, hc, hc].

    The split (one program per chunk) is used when the row tiles alone would leave at least
    half of the SMs idle or its partials are small (`SPLIT_MAX_BYTES`); both modes give the
    same bits."""
    t = x.shape[0]
    k = x.shape[1] * x.shape[2]
    pre = torch.empty(t, hc, dtype=torch.float32, device=x.device)
    post = torch.empty(t, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=x.device)
    if t == 0:
        return pre, post, comb
    part = fp32_gemm_parts(x.reshape(t, k), fn.contiguous(), sumsq=True)
    ebt = CONFIG["EPI_BLOCK_T"]
    _mixes_epilogue_kernel[(triton.cdiv(t, ebt),)](
        part, base.contiguous(), scale.contiguous(), pre, post, comb,
        t, k, t * part.shape[2], iters, norm_eps, hc_eps,
        CHUNKS=part.shape[0], HC=hc, NP=part.shape[2], BLOCK_T=ebt, num_warps=1, enable_fp_fusion=False, **pdl_launch(part.device),
    )
    return pre, post, comb


# ------------------------------------------------------------------------------ collapse / expand


@triton.jit
def _collapse_kernel(
    x_ptr, pre_ptr, out_ptr, part_ptr,
    D, stride_xt, stride_xh, stride_ot,
    HC: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, column slice): h = bf16(sum_k pre_k * x_k) (fp32 sum in stream order);
    with NORM also the slice's sum of h^2 (of the rounded values) in part[row, slice], which
    `_norm_slices_kernel` turns into the row's RMSNorm."""
    begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(HC):
        xk = tl.load(x_ptr + t * stride_xt + k * stride_xh + d, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(pre_ptr + t * HC + k) * xk
    h = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_ot + d, h, mask=ok)
    if NORM:
        hf = h.to(tl.float32)
        tl.store(part_ptr + t * tl.num_programs(1) + tl.program_id(1), tl.sum(hf * hf, axis=0))


@triton.jit
def _norm_slices_kernel(
    h_ptr, part_ptr, w_ptr, D, stride_ht, eps,
    SLICES: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, column slice): the row's sum of squares from its slices' partials, added
    in slice order (the same at every batch size), then the RMSNorm of the slice in place
    (`rowwise.scale_row`: V4.1 rounds the normalised value before the bf16 weight multiply,
    V4 multiplies by the fp32 weight and rounds once)."""
    begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    total = tl.load(part_ptr + t * SLICES)
    for i in tl.static_range(1, SLICES):
        total += tl.load(part_ptr + t * SLICES + i)
    rstd = tl.math.rsqrt(total / D + eps)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = d < D
    h = tl.load(h_ptr + t * stride_ht + d, mask=ok, other=0.0).to(tl.float32)
    out = scale_row(h, tl.load(w_ptr + d, mask=ok, other=0.0), rstd, WEIGHT_IN_FP32, h_ptr.dtype.element_ty)
    tl.store(h_ptr + t * stride_ht + d, out, mask=ok)


def _slices(d: int) -> tuple[int, int]:
    """(columns per program, programs per row) of the collapse kernels for rows of d values."""
    block_d = min(COLLAPSE_BLOCK_D, triton.next_power_of_2(d))
    return block_d, triton.cdiv(d, block_d)


def _norm_slices(h: torch.Tensor, part: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool) -> None:
    """RMSNorm of h [T, D] in place from its slices' sums of squares part [T, slices]."""
    block_d, slices = _slices(h.shape[1])
    _norm_slices_kernel[(h.shape[0], slices)](
        h, part, weight.contiguous(), h.shape[1], h.stride(0), eps, SLICES=slices, WEIGHT_IN_FP32=weight_in_fp32, BLOCK_D=block_d,
        num_warps=4, enable_fp_fusion=False, **pdl_launch(h.device),
    )


def _collapse(x: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_in_fp32: bool) -> torch.Tensor:
    t, hc, d = x.shape
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    x = x.contiguous()
    pre = pre.contiguous()
    block_d, slices = _slices(d)
    part = torch.empty(t, slices, dtype=torch.float32, device=x.device) if weight is not None else pre  # (unread without a norm)
    _collapse_kernel[(t, slices)](
        x, pre, out, part, d, x.stride(0), x.stride(1), out.stride(0),
        HC=hc, NORM=weight is not None, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False, **pdl_launch(x.device),
    )
    if weight is not None:
        _norm_slices(out, part, weight, eps, weight_in_fp32)
    return out


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """`ops.mhc.hc_collapse`: x [T, hc, D] bf16, pre fp32 [T, hc] -> bf16 [T, D]."""
    return _collapse(x, pre, None, 0.0, False)


def hc_collapse_norm(x: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool) -> torch.Tensor:
    """`rms_norm(hc_collapse(x, pre), weight, eps, weight_in_fp32)` in one launch."""
    return _collapse(x, pre, weight.contiguous(), eps, weight_in_fp32)


@triton.jit
def _expand_kernel(
    y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr,
    D, stride_yt, stride_rt, stride_rh,
    HC: tl.constexpr, BLOCK_D: tl.constexpr, FP32: tl.constexpr, PDL: tl.constexpr,
):
    """out[t, k, cols] = post_k * y + sum_j comb[j, k] * residual_j: FP32 (V4.1) all in fp32,
    rounded once; else (V4) as the reference's activation-dtype ops round it: the mix as one
    matmul of bf16 comb (exact products, an fp32 sum, rounded), post (as bf16) times y
    rounded, the two added and rounded."""
    begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = d < D
    h = tl.arange(0, HC)
    dtype = out_ptr.dtype.element_ty
    mixed = tl.zeros((HC, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(HC):
        rj = tl.load(res_ptr + t * stride_rt + j * stride_rh + d, mask=ok, other=0.0).to(tl.float32)
        c = tl.load(comb_ptr + t * HC * HC + j * HC + h)
        if not FP32:
            c = c.to(dtype).to(tl.float32)
        mixed += c[:, None] * rj[None, :]
    y = tl.load(y_ptr + t * stride_yt + d, mask=ok, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * HC + h)
    if FP32:
        out = post[:, None] * y[None, :] + mixed
    else:
        scaled = (post.to(dtype).to(tl.float32)[:, None] * y[None, :]).to(dtype).to(tl.float32)
        out = scaled + mixed.to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_rt + h[:, None] * stride_rh + d[None, :], out.to(dtype), mask=ok[None, :])


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fp32: bool) -> torch.Tensor:
    """`ops.mhc.hc_expand`: y [T, D], residual [T, hc, D] bf16, post fp32 [T, hc], comb fp32
    [T, hc, hc] -> [T, hc, D] in residual's dtype (`fp32`: V4.1's rounding, else V4's)."""
    t, hc, d = residual.shape
    residual = residual.contiguous()
    out = torch.empty_like(residual)
    if t == 0:
        return out
    y = y.contiguous()
    _expand_kernel[(t, triton.cdiv(d, EXPAND_BLOCK_D))](
        y, residual, post.contiguous(), comb.contiguous(), out, d, y.stride(0), residual.stride(0), residual.stride(1),
        HC=hc, BLOCK_D=EXPAND_BLOCK_D, FP32=fp32, num_warps=4, enable_fp_fusion=False, **pdl_launch(y.device),
    )
    return out


@triton.jit
def _expand_collapse_kernel(
    y_ptr, res_ptr, post_ptr, comb_ptr, pre_ptr, out_ptr, h_ptr, part_ptr,
    D, stride_yt, stride_rt, stride_rh, stride_ht,
    HC: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, column slice): V4.1's expand (`_expand_kernel` FP32: out_k = post_k * y +
    sum_j comb[j, k] * residual_j in fp32, rounded once), then the next site's input from
    those rounded streams (`_collapse_kernel` NORM: h = bf16(sum_k pre_k * out_k) and the
    slice's sum of h^2 for `_norm_slices_kernel`) — the same operations in the same order as
    the two kernels, without the streams' round trip through memory between them."""
    begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = d < D
    dtype = out_ptr.dtype.element_ty
    y = tl.load(y_ptr + t * stride_yt + d, mask=ok, other=0.0).to(tl.float32)
    residual = ()  # each stream's slice, loaded and widened once
    for j in tl.static_range(HC):
        residual = residual + (tl.load(res_ptr + t * stride_rt + j * stride_rh + d, mask=ok, other=0.0).to(tl.float32),)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(HC):
        mixed = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in tl.static_range(HC):
            mixed += tl.load(comb_ptr + t * HC * HC + j * HC + k) * residual[j]
        out = (tl.load(post_ptr + t * HC + k) * y + mixed).to(dtype)
        tl.store(out_ptr + t * stride_rt + k * stride_rh + d, out, mask=ok)
        acc += tl.load(pre_ptr + t * HC + k) * out.to(tl.float32)
    h = acc.to(dtype)
    tl.store(h_ptr + t * stride_ht + d, h, mask=ok)
    hf = h.to(tl.float32)
    tl.store(part_ptr + t * tl.num_programs(1) + tl.program_id(1), tl.sum(hf * hf, axis=0))


def hc_expand_collapse_norm(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
                            weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`hc_expand(..., fp32=True)`, then `hc_collapse_norm` of its streams with `pre` (V4.1's
    rounding), in two launches (the norm's over the row's slices) -> (streams [T, hc, D], h [T, D])."""
    t, hc, d = residual.shape
    residual = residual.contiguous()
    out = torch.empty_like(residual)
    h = torch.empty(t, d, dtype=residual.dtype, device=residual.device)
    if t == 0:
        return out, h
    y = y.contiguous()
    block_d, slices = _slices(d)
    part = torch.empty(t, slices, dtype=torch.float32, device=y.device)
    _expand_collapse_kernel[(t, slices)](
        y, residual, post.contiguous(), comb.contiguous(), pre.contiguous(), out, h, part,
        d, y.stride(0), residual.stride(0), residual.stride(1), h.stride(0),
        HC=hc, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False, **pdl_launch(y.device),
    )
    _norm_slices(h, part, weight, eps, False)
    return out, h
