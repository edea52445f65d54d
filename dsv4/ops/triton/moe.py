"""Routed experts on Triton: two grouped GEMMs over FP8 expert weights with the clamped SwiGLU
fused into the first (H200 fast path).

Same semantics as `dsv4.ops.moe.experts_forward` with the weights stacked per layer:

    moe_experts(x bf16 [T, D], topk_ids int [T, k], topk_weights fp32 [T, k],
                w13 float8_e4m3fn [E, 2I, D], w13_scale uint8 [E, 2I, D/32],
                w2 float8_e4m3fn [E, D, I], w2_scale uint8 [E, D, I/32],
                limit: float, weight_before_down: bool) -> fp32 [T, D]

w13 holds w1 (gate) in rows 0..I-1 and w3 (up) in rows I..2I-1; the scales are E8M0 exponent
bytes, one per 32 inputs of a row — the exact FP4 -> FP8 conversion of the released experts
(`quant.fp4_expert_to_fp8`). A routing weight of a token is applied before the down projection
(V4.1, `weight_before_down`) or to its output (V4); the result is the fp32 sum over the k
experts in ascending expert id, as the reference accumulates. (V4's reference accumulates in
bf16; here the sum is fp32 and the caller casts.)

How: (token, slot) pairs are sorted by expert with torch ops and laid out in per-expert
segments padded to the row tile, so every row tile of the grouped GEMMs belongs to one expert;
the padded layout's size is bounded from the shapes alone (no host sync, CUDA-graph safe), and
tiles past the end exit at once. Kernel 1 gathers the token rows, multiplies by the gate and up
rows of its expert (bf16 tensor cores, FP8 weights converted in registers, scale per 32 inputs
applied to each 32-wide partial product), rounds both to bf16 as the reference's linears do,
clamps, applies silu(gate) * up (and the routing weight) and stores bf16 activations. Kernel 2
multiplies them by the expert's down weight and writes one bf16 row per (token, slot); kernel 3
sums the k rows of a token in fp32. No atomics, and a token's rows never mix with other
tokens' in any sum, so results change neither from run to run nor with the batch (batch
invariance; the row tile, chosen from the mean rows per expert, is checked on the device not to
change the bits).

Activations stay bf16 (HF's numerics; no FP8 activation quantisation). Expert ids must be in
[0, E) (no expert-parallel "not local" marker yet).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.triton.fp8_gemm import e8m0_to_fp32

SCALE_BLOCK = 32  # one E8M0 scale per 32 inputs of an expert row


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, rows_ptr, tile_expert_ptr, rw_ptr, act_ptr,
    n_pairs, n_experts, D, I,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_act,
    limit,
    TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr, WEIGHT_BEFORE_DOWN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """act[row tile, n tile] = swiglu(x_tok @ w1^T, x_tok @ w3^T) (* routing weight)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    if e >= n_experts:
        return
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + offs)
    valid = pair < n_pairs
    token = pair // TOPK
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + token[:, None] * stride_x
    gate_rows = w_ptr + e * stride_we + rn[:, None] * stride_wn
    up_rows = gate_rows + I * stride_wn
    gate_scales = s_ptr + e * stride_se + rn * stride_sn
    up_scales = gate_scales + I * stride_sn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(tl.cdiv(D, BLOCK_K)):
        k = step * BLOCK_K + rk
        k_ok = k < D
        x = tl.load(x_rows + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_ok = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(gate_rows + k[None, :], mask=w_ok, other=0.0).to(tl.bfloat16)
        wu = tl.load(up_rows + k[None, :], mask=w_ok, other=0.0).to(tl.bfloat16)
        sg = e8m0_to_fp32(tl.load(gate_scales + step, mask=n_ok, other=0))
        su = e8m0_to_fp32(tl.load(up_scales + step, mask=n_ok, other=0))
        acc_gate += tl.dot(x, tl.trans(wg)) * sg[None, :]
        acc_up += tl.dot(x, tl.trans(wu)) * su[None, :]
    gate = acc_gate.to(tl.bfloat16).to(tl.float32)
    up = acc_up.to(tl.bfloat16).to(tl.float32)
    if HAS_LIMIT:
        up = tl.minimum(tl.maximum(up, -limit), limit)
        gate = tl.minimum(gate, limit)
    act = gate * tl.sigmoid(gate) * up
    if WEIGHT_BEFORE_DOWN:
        act = act * tl.load(rw_ptr + pair, mask=valid, other=0.0)[:, None]
    tl.store(act_ptr + offs[:, None] * stride_act + rn[None, :], act.to(tl.bfloat16), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, s_ptr, rows_ptr, tile_expert_ptr, rw_ptr, y_ptr,
    n_pairs, n_experts, D, I,
    stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_y,
    WEIGHT_BEFORE_DOWN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[(token, slot)] = bf16(act @ w2^T) (V4: times the routing weight, rounded to bf16)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    if e >= n_experts:
        return
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + offs)
    valid = pair < n_pairs
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < D
    rk = tl.arange(0, BLOCK_K)
    a_rows = act_ptr + offs[:, None] * stride_act
    w_rows = w_ptr + e * stride_we + rn[:, None] * stride_wn
    scales = s_ptr + e * stride_se + rn * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(tl.cdiv(I, BLOCK_K)):
        k = step * BLOCK_K + rk
        k_ok = k < I
        a = tl.load(a_rows + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.bfloat16)
        s = e8m0_to_fp32(tl.load(scales + step, mask=n_ok, other=0))
        acc += tl.dot(a, tl.trans(w)) * s[None, :]
    y = acc.to(tl.bfloat16)
    if not WEIGHT_BEFORE_DOWN:
        rw = tl.load(rw_ptr + pair, mask=valid, other=0.0)
        y = (y.to(tl.float32) * rw[:, None]).to(tl.bfloat16)
    tl.store(y_ptr + pair[:, None] * stride_y + rn[None, :], y, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, D, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = ((0 + y[t, 0]) + y[t, 1]) + ... in fp32: the slots are in ascending expert id,
    the order the reference adds experts in."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(TOPK):
        total += tl.load(y_ptr + (t * TOPK + j) * D + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + cols, total, mask=ok)


def _row_tile(pairs: int, experts: int) -> int:
    """Row tile of the grouped GEMMs from the mean rows per expert: 16 in decode (about one row
    per expert; a 64-row MMA per weight tile would outlast the weight's load), 64 in prefill
    (each weight tile serves more rows). A row's bits do not depend on the tile's other rows."""
    return 16 if pairs <= 8 * experts else 64


def align_by_expert(flat_ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, slot) pairs grouped by expert in segments padded to `block_m` rows.

    -> rows [n_tiles * block_m] (pair index, or n_pairs for padding), tile_expert [n_tiles]
    (expert of each row tile; n_experts for tiles past the end). n_tiles is an upper bound
    from the shapes (every used expert wastes < block_m rows), so nothing syncs with the host."""
    n = flat_ids.numel()
    dev = flat_ids.device
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    start = counts.cumsum(0) - counts
    sorted_ids, order = flat_ids.sort(stable=True)
    dest = pad_start[sorted_ids] + torch.arange(n, device=dev) - start[sorted_ids]
    n_tiles = triton.cdiv(n, block_m) + min(n_experts, n)
    rows = torch.full((n_tiles * block_m,), n, dtype=torch.int64, device=dev)
    rows[dest] = order
    tile_start = torch.arange(n_tiles, device=dev) * block_m
    tile_expert = torch.searchsorted(pad_end, tile_start, right=True)
    return rows, tile_expert


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    limit: float,
    weight_before_down: bool,
) -> torch.Tensor:
    """Routed experts of a flat batch -> fp32 [T, D] (see the module docstring)."""
    t, topk = topk_ids.shape
    n_experts, two_i, d = w13.shape
    inter = two_i // 2
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise TypeError("moe_experts: expert weights must be float8_e4m3fn")
    if tuple(w2.shape) != (n_experts, d, inter) or x.shape != (t, d) or x.dtype != torch.bfloat16:
        raise ValueError(f"moe_experts: shapes x {list(x.shape)} {x.dtype}, w13 {list(w13.shape)}, w2 {list(w2.shape)} do not match")
    if d % SCALE_BLOCK or inter % SCALE_BLOCK:
        raise ValueError(f"moe_experts: hidden and intermediate sizes must be multiples of {SCALE_BLOCK}")
    if tuple(w13_scale.shape) != (n_experts, two_i, d // SCALE_BLOCK) or tuple(w2_scale.shape) != (n_experts, d, inter // SCALE_BLOCK):
        raise ValueError("moe_experts: scale shapes must be [E, rows, inputs/32]")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("moe_experts: expert weights must be row-major (last stride 1)")
    w13_scale = w13_scale.view(torch.uint8).contiguous()
    w2_scale = w2_scale.view(torch.uint8).contiguous()
    x = x.contiguous()
    # Slots in ascending expert id per token: the final sum then adds experts in that order.
    ids, perm = topk_ids.sort(dim=1)
    weights = topk_weights.float().gather(1, perm).contiguous()
    flat = ids.flatten().long()
    n_pairs = flat.numel()
    if n_pairs == 0:  # no tokens, or k = 0
        return torch.zeros(t, d, dtype=torch.float32, device=x.device)
    bm = _row_tile(n_pairs, n_experts)
    rows, tile_expert = align_by_expert(flat, n_experts, bm)
    n_tiles = tile_expert.numel()
    act = torch.empty(n_tiles * bm, inter, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(n_pairs, d, dtype=torch.bfloat16, device=x.device)
    bn = 64
    warps = 4 if bm == 16 else 8  # 64-row tiles spill registers with 4 warps (ptxas, sm_90)
    _gate_up_kernel[(n_tiles, triton.cdiv(inter, bn))](
        x, w13, w13_scale, rows, tile_expert, weights, act,
        n_pairs, n_experts, d, inter,
        x.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), act.stride(0),
        float(limit),
        TOPK=topk, HAS_LIMIT=limit > 0, WEIGHT_BEFORE_DOWN=weight_before_down,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=SCALE_BLOCK, num_warps=warps, num_stages=4,
    )
    _down_kernel[(n_tiles, triton.cdiv(d, bn))](
        act, w2, w2_scale, rows, tile_expert, weights, y,
        n_pairs, n_experts, d, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), y.stride(0),
        WEIGHT_BEFORE_DOWN=weight_before_down,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=SCALE_BLOCK, num_warps=warps, num_stages=4,
    )
    out = torch.empty(t, d, dtype=torch.float32, device=x.device)
    _sum_slots_kernel[(t, triton.cdiv(d, 1024))](y, out, d, TOPK=topk, BLOCK=1024, num_warps=4)
    return out
