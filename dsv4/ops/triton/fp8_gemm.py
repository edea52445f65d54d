"""FP8 block-scaled projection `y = x @ (w * 2**(s - 127))^T` on Triton (H200 fast path).

Same signature as the torch reference `F.linear(x, quant.dequant_fp8_block(w, s, block))`
(`dsv4.ops.linear.Linear`): x bf16 [..., K], w float8_e4m3fn [N, K], s uint8 exponent bytes
[ceil(N/block), ceil(K/block)] (E8M0), bf16 [..., N] out. Two kernels, because the two regimes
have different limits:

* `fp8_linear_w8a16` (decode, few rows, memory bound): the weight tile is loaded as FP8 (one
  byte per weight crosses HBM), converted to bf16 in registers and multiplied on bf16 tensor
  cores; the block scale, a power of two, is applied to each block's partial product in the
  fp32 accumulator, so the result equals the reference up to fp32 summation order. K is cut
  into chunks fixed by the weight's shape (never by M) and the chunk sums are added in a fixed
  order — in one program when there are many row tiles, or one program per chunk (split-K,
  filling the SMs at decode) plus a sum kernel: the same bits either way, so a row's result
  does not depend on the batch it came in (batch invariance) and no atomics are used.
* `fp8_linear_w8a8` (prefill, many rows, compute bound): the activations are first quantised
  to FP8 per (row, `block` columns) with a power-of-two scale (`fp8_act_quant`, the DeepSeek
  reference's activation quantiser, bit-identical to `quant.quantize_fp8_ue8m0`), then both
  operands run on FP8 tensor cores; each block's partial product is multiplied by
  (row scale x column scale) into the fp32 accumulator. This follows the DeepSeek reference's
  numerics, not HF's (which does not quantise activations): the error against the w8a16
  reference is that of one e4m3 rounding of x (about 2**-5 relative per element).

`fp8_linear` picks one by the number of rows (`W8A8_MIN_ROWS`). The two paths differ
numerically (and the FP8 path's autotuned tiles depend on the row count), so through the
dispatcher a token's result depends on which path its batch took; callers that need
batch-invariant greedy decoding call `fp8_linear_w8a16` (the row tile, 16 up to 64 rows and
64 above, is the one M-dependent choice left; scripts/check_kernels.py checks that it does not
change the bits).

Scale bytes are turned into 2**(byte - 127) by building the fp32 bits, which is exact for the
bytes a checkpoint holds (1..254); byte 0 (2**-127, a subnormal) reads as 0 and 0xFF (NaN) as
inf — the loader rejects 0xFF (`quant.FormatError`), the kernels do not check.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsv4.model import quant

# Rows from which `fp8_linear` switches from the weight-only kernel to the FP8 x FP8 kernel.
W8A8_MIN_ROWS = 1024
FP8_MAX = tl.constexpr(448.0)  # largest float8_e4m3fn (constexpr: kernels read it)


@triton.jit
def e8m0_to_fp32(byte):
    """2**(byte - 127) from the exponent byte, exactly (byte 0 flushes to 0)."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3(v):
    """Round fp32 values with |v| <= 448 to the nearest e4m3 value (ties to even), in fp32.

    After this the cast to float8e4nv is exact, whatever rounding the backend's cast uses (the
    Triton interpreter's cast drops the carry when rounding crosses a power of two). Integer
    arithmetic on the 24-bit significand, so no compiler can fold it away: e4m3 keeps 3 bits
    after the leading one for exponents >= -6, one fewer per step below (subnormals, step
    2**-9); values below 2**-10 round to zero. The sign bit is put back (a value that rounds
    to zero keeps it, as a cast would)."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    sig = (bits & 0x7FFFFF) | 0x800000
    drop = tl.minimum(20 + tl.maximum(-6 - e, 0), 25)
    q = sig >> drop
    rem = sig - (q << drop)
    half = 1 << (drop - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    unit = (tl.maximum(e + 104, 1) << 23).to(tl.float32, bitcast=True)  # 2**(e - 23)
    mag = (q << drop).to(tl.float32) * unit
    return (mag.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


# ------------------------------------------------------------------------------ w8a16 kernel


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om, stride_chunk,
    K_STEPS, CHUNK_STEPS, CHUNKS_PER_PROGRAM,
    QBLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile over CHUNKS_PER_PROGRAM consecutive K chunks.

    BLOCK_K divides QBLOCK (both powers of two), so one K step lies in one scale block: its partial product is
    scaled per output column. Each chunk of CHUNK_STEPS steps is summed on its own and the
    chunk sums are added in order to a zero total, so the bits are the same whether one
    program runs all chunks or each chunk has a program and `_chunk_sum_kernel` adds them."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None] * stride_xm
    w_rows = w_ptr + rn[:, None] * stride_wn
    s_rows = s_ptr + (rn // QBLOCK) * stride_sn
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first_chunk = pid_k * CHUNKS_PER_PROGRAM
    for chunk in range(first_chunk, first_chunk + CHUNKS_PER_PROGRAM):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(chunk * CHUNK_STEPS, tl.minimum(chunk * CHUNK_STEPS + CHUNK_STEPS, K_STEPS)):
            k = step * BLOCK_K + rk
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            s = e8m0_to_fp32(tl.load(s_rows + (step * BLOCK_K) // QBLOCK, mask=n_ok, other=0))
            acc += tl.dot(x, tl.trans(w.to(tl.bfloat16))) * s[None, :]
        total += acc
    out = out_ptr + pid_k * stride_chunk + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _chunk_sum_kernel(part_ptr, out_ptr, numel, CHUNKS, BLOCK: tl.constexpr):
    """out = bf16(((0 + part[0]) + part[1]) + ...), the order `_w8a16_kernel` adds chunks in."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(CHUNKS):
        total += tl.load(part_ptr + c * numel + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, total.to(tl.bfloat16), mask=ok)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (4 stands in for the CPU interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# Tiles of the weight-only kernel: 64 output columns, 32 inputs per K step (one V4.1 scale
# block; larger steps spill registers on sm_90 for V4's 128 blocks).
W8A16_BLOCK_N = 64
W8A16_BLOCK_K = 32


def w8a16_chunks(n: int, k: int, block: int, device: torch.device) -> tuple[int, int]:
    """(K steps per chunk, chunks) of a weight: from N, K and the SM count only, never from M,
    so a row's result does not depend on how many rows the call has. Chunks are sized so that
    a one-row-tile call fills two waves of SMs, each chunk keeping >= 8 K steps to pipeline."""
    steps = triton.cdiv(k, min(block, W8A16_BLOCK_K))
    tiles_n = triton.cdiv(n, W8A16_BLOCK_N)
    chunks = max(1, min(2 * num_sms(device) // tiles_n, steps // 8, 16))
    per = triton.cdiv(steps, chunks)
    return per, triton.cdiv(steps, per)


def fp8_linear_w8a16(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: int) -> torch.Tensor:
    """Weight-only dequantisation in the kernel; bf16 x bf16 tensor-core products (any M).

    Few row tiles (decode): one program per K chunk, then a fixed-order chunk sum; many row
    tiles: each program runs all chunks. Both give the same bits (see `_w8a16_kernel`)."""
    x2, lead, w_scale = _check(x, w, w_scale, block)
    m, k = x2.shape
    n = w.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    bm = 16 if m <= 64 else 64
    bn, bk = W8A16_BLOCK_N, min(block, W8A16_BLOCK_K)
    per, chunks = w8a16_chunks(n, k, block, x.device)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = chunks if chunks > 1 and tiles < num_sms(x.device) else 1
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    _w8a16_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm), split)](
        x2, w, w_scale, part, m, n, k,
        x2.stride(0), w.stride(0), w_scale.stride(0), n, m * n,
        triton.cdiv(k, bk), per, chunks // split, QBLOCK=block, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=4 if bm == 16 else 8, num_stages=6 if bm == 16 else 4,
    )
    if split > 1:
        _chunk_sum_kernel[(triton.cdiv(m * n, 1024),)](part, out, m * n, split, BLOCK=1024, num_warps=4)
    return out.view(*lead, n)


# ------------------------------------------------------------------------------ w8a8 kernels


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
    QBLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Rows x one QBLOCK column block: amax (>= 1e-4), exponent ceil(log2(amax / 448)) from the
    fp32 bits of amax * (1/448), codes = e4m3(x * 2**-exponent). A partial last block is
    quantised over the columns it has."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * QBLOCK + tl.arange(0, QBLOCK)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    bits = (amax * (1.0 / FP8_MAX)).to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    inv = ((127 - exp) << 23).to(tl.float32, bitcast=True)
    v = tl.minimum(tl.maximum(x * inv[:, None], -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], round_to_e4m3(v).to(tl.float8e4nv), mask=ok)
    tl.store(s_ptr + rows * stride_sm + tl.program_id(1), (exp + 127).to(tl.uint8), mask=rows < M)


def fp8_act_quant(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [M, K] -> (float8_e4m3fn [M, K], exponent bytes uint8 [M, ceil(K/block)]); equal
    to `quant.quantize_fp8_ue8m0(x, block)` when K is a multiple of `block`."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, triton.cdiv(k, block), dtype=torch.uint8, device=x.device)
    rows = max(1, min(64, 4096 // block))
    _act_quant_kernel[(triton.cdiv(m, rows), triton.cdiv(k, block))](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), QBLOCK=block, BLOCK_R=rows, num_warps=4
    )
    return q, s


def on_gpu() -> bool:
    """Whether kernels compile for a GPU (autotuning makes sense) or run in the interpreter."""
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


def w8a8_configs(gpu: bool) -> list:
    """Tile shapes for the FP8 GEMM, autotuned once per (N, K, row class) on the device (one
    small tile in the interpreter). All 8 warps with 32-wide K steps: with 4 warps or 64/128
    wide steps ptxas spills on sm_90 (128 x 128 still spills a little; kept: it may win)."""
    if not gpu:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 4}, num_warps=4, num_stages=2)]
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
    ]


@triton.autotune(configs=w8a8_configs(on_gpu()), key=["N", "K", "ROW_CLASS"])
@triton.jit
def _w8a8_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr,
    M, N, K, ROW_CLASS,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
    QBLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """FP8 x FP8 tile GEMM with per-(row, K block) and per-(N block, K block) power-of-two
    scales applied to each K step's partial product. Tiles are visited in groups of GROUP_M
    row tiles so that neighbouring programs share weight tiles in L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_rows = a_ptr + rm[:, None] * stride_am
    w_rows = w_ptr + rn[:, None] * stride_wn
    as_rows = as_ptr + rm * stride_asm
    ws_rows = ws_ptr + (rn // QBLOCK) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(tl.cdiv(K, BLOCK_K)):
        k = step * BLOCK_K + rk
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        kb = (step * BLOCK_K) // QBLOCK
        sa = e8m0_to_fp32(tl.load(as_rows + kb, mask=m_ok, other=0))
        sw = e8m0_to_fp32(tl.load(ws_rows + kb, mask=n_ok, other=0))
        acc += tl.dot(a, tl.trans(w)) * sa[:, None] * sw[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(tl.bfloat16), mask=m_ok[:, None] & n_ok[None, :])


def fp8_linear_w8a8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: int) -> torch.Tensor:
    """Activations quantised to FP8 (per row and `block` columns, power-of-two scales), FP8
    tensor-core products. `block` >= 32 (the FP8 MMA reduces over 32)."""
    x2, lead, w_scale = _check(x, w, w_scale, block)
    if block < 32:
        raise ValueError(f"fp8_linear_w8a8: block must be >= 32 for FP8 MMA, got {block}")
    m, k = x2.shape
    n = w.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    xq, xs = fp8_act_quant(x2, block)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _w8a8_kernel[grid](
        xq, xs, w, w_scale, out, m, n, k, min(m.bit_length(), 14),
        xq.stride(0), xs.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
        QBLOCK=block, BLOCK_K=32,
    )
    return out.view(*lead, n)


# ------------------------------------------------------------------------------ dispatch


def _check(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: int) -> tuple[torch.Tensor, tuple, torch.Tensor]:
    """Validate shapes/dtypes; -> (x as a contiguous [M, K] view, leading shape of x, scale
    bytes as uint8)."""
    n, k = w.shape
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_linear: weight must be float8_e4m3fn, got {w.dtype}")
    if w_scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"fp8_linear: scale must be E8M0 exponent bytes (uint8), got {w_scale.dtype}")
    w_scale = quant.e8m0_bytes(w_scale)
    if block < 16 or block & (block - 1):
        raise ValueError(f"fp8_linear: block must be a power of two >= 16, got {block}")
    grid = (triton.cdiv(n, block), triton.cdiv(k, block))
    if tuple(w_scale.shape) != grid:
        raise ValueError(f"fp8_linear: scale shape {list(w_scale.shape)} != {list(grid)} for weight {[n, k]} and block {block}")
    if x.shape[-1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"fp8_linear: x must be bf16 [..., {k}], got {x.dtype} {list(x.shape)}")
    if w.stride(1) != 1 or w_scale.stride(1) != 1:
        raise ValueError("fp8_linear: weight and scale must be row-major (last stride 1)")
    return x.reshape(-1, k).contiguous(), tuple(x.shape[:-1]), w_scale


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: int) -> torch.Tensor:
    """x bf16 [..., K] @ dequant(w, w_scale)^T -> bf16 [..., N]; weight-only kernel below
    `W8A8_MIN_ROWS` rows, FP8 x FP8 kernel from there on (see the module docstring)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows >= W8A8_MIN_ROWS and block >= 32:
        return fp8_linear_w8a8(x, w, w_scale, block)
    return fp8_linear_w8a16(x, w, w_scale, block)
