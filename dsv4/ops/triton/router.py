"""The routers on the H200 fast path. V4.1's in two kernels: the fp32 gate GEMM (`mhc.fp32_gemm_parts`;
up to STEP_PARTS_MAX_ROWS tokens `mhc.fp32_gemm_step_parts`, one program per K step),
then one kernel for the rest — the GEMM's chunk sums added in order, sqrtsoftplus of the
temperature-scaled logits, the bias-shifted top-k, the selected unbiased scores normalised and
scaled, and the shared expert appended as one more slot of weight 1 (`layers.moe`: it runs as
the last expert of the grouped kernels) — in torch about fifteen small kernels per layer,
whose launch gaps cost a decode step more than their bytes.

Same semantics as `dsv4.ops.moe.route_scores`'s torch code: fp32 throughout, correctly rounded
division and square root, softplus as torch computes it (x above 20, else log1p(exp(x))).
The top-k picks the largest biased score first and the lowest expert id among equal ones
(torch.topk leaves ties unordered); the weights' sum may round differently (its order). One
program per token, so a token's routing does not depend on its batch; neither do its logits
(the GEMM's K chunks are fixed by the shapes). The gate GEMM was a cuBLAS fp32 GEMM on the
rows padded to 16 (its kernel, and so its rounding, chosen by the row count), with the cast,
the padding and the split-K reduction about 10 us and five launches per layer at decode
(profile S4-1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsv4.ops.triton.mhc import CONFIG, add_step_parts, fp32_gemm_parts, fp32_gemm_step_parts
from dsv4.ops.triton.pdl import begin, pdl_launch

# Calls of up to this many tokens run the gate GEMM one program per K step
# (`mhc.fp32_gemm_step_parts`), the routing kernel adding the step products as the GEMM's
# chunks would (same bits): a chunk's four dependent steps were most of a batch-1 router GEMM
# (~7 us a call, H200 timeline S28-6). Wider calls keep the chunk partials (4x fewer to write
# and read). 0: never.
STEP_PARTS_MAX_ROWS = 16


@triton.jit
def _select(score, biased, cols, slots, TOP_K: tl.constexpr, E_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr):
    """The TOP_K largest of `biased` (-inf where no expert), the lowest id first among equal
    ones -> (their ids, their unbiased `score`s) in slots 0 .. TOP_K - 1 of K_BLOCK."""
    picked = tl.zeros((K_BLOCK,), dtype=tl.int32)
    chosen = tl.zeros((K_BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(biased, axis=0)
        idx = tl.min(tl.where(biased == best, cols, E_BLOCK), axis=0)
        picked = tl.where(slots == j, idx, picked)
        chosen = tl.where(slots == j, tl.sum(tl.where(cols == idx, score, 0.0), axis=0), chosen)
        biased = tl.where(cols == idx, float("-inf"), biased)
    return picked, chosen


@triton.jit
def _store_route(ids_ptr, weights_ptr, row, picked, chosen, slots, extra_id, TOP_K: tl.constexpr, EXTRA: tl.constexpr):
    """A token's ids and weights, the extra expert (EXTRA) appended at weight 1."""
    width = TOP_K + EXTRA
    if EXTRA:
        picked = tl.where(slots == TOP_K, extra_id, picked)
        chosen = tl.where(slots == TOP_K, 1.0, chosen)
    tl.store(ids_ptr + row * width + slots, picked.to(tl.int64), mask=slots < width)
    tl.store(weights_ptr + row * width + slots, chosen, mask=slots < width)


@triton.jit
def _route_kernel(part_ptr, bias_ptr, weights_ptr, ids_ptr, E, stride_part, stride_l, temp, scale, extra_id,
                  CHUNKS: tl.constexpr, STEPS: tl.constexpr, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, EXTRA: tl.constexpr,
                  E_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, PDL: tl.constexpr):
    begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, E_BLOCK)
    ok = cols < E
    # the GEMM's partials (chunk sums, or STEPS step products a chunk) added as the GEMM would
    logits = add_step_parts(part_ptr + row * stride_l + cols, stride_part, ok, CHUNKS, STEPS)
    x = tl.math.div_rn(logits, temp)
    e = tl.exp(x)
    log1p = tl.where(e < 1e-3, e - e * e * 0.5 + e * e * e * (1.0 / 3.0), tl.log(1.0 + e))
    score = tl.sqrt_rn(tl.where(x > 20.0, x, log1p))
    biased = tl.where(ok, score + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    slots = tl.arange(0, K_BLOCK)
    picked, chosen = _select(score, biased, cols, slots, TOP_K, E_BLOCK, K_BLOCK)
    if NORMALIZE:
        chosen = tl.math.div_rn(chosen, tl.sum(tl.where(slots < TOP_K, chosen, 0.0), axis=0) + 1e-20)
    _store_route(ids_ptr, weights_ptr, row, picked, chosen * scale, slots, extra_id, TOP_K, EXTRA)


def route_scores(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, temp: float, routed_scale: float, normalize: bool,
                 extra_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [T, D], gate fp32 [E, D], bias [E] -> (weights fp32 [T, k (+1)], ids int64
    [T, k (+1)]); `extra_expert`: appended to every token with weight 1. The logits x @ gate^T
    come from `mhc.fp32_gemm_parts` (fp32 accuracy on bf16 tensor cores, K in fixed chunks:
    a row's logits do not depend on its batch), whose chunk sums this kernel adds in order."""
    t, d = x.shape
    e = gate.shape[0]
    if x.dtype != torch.bfloat16 or gate.dtype != torch.float32 or gate.shape[1] != d or bias.shape != (e,) or not 0 < top_k <= e:
        raise ValueError(f"route_scores: x must be bf16 [T, D], gate fp32 [E, D], bias [E] and 0 < top_k <= E; got x {x.dtype} {list(x.shape)}, "
                         f"gate {gate.dtype} {list(gate.shape)}, bias {list(bias.shape)}, top_k {top_k}")
    width = top_k + (extra_expert is not None)
    weights = torch.empty(t, width, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, width, dtype=torch.int64, device=x.device)
    if t:
        x2 = x if x.stride(-1) == 1 else x.contiguous()
        steps = 1
        if t <= STEP_PARTS_MAX_ROWS and d % CONFIG["CHUNK"] == 0:
            part, steps = fp32_gemm_step_parts(x2, gate.contiguous())
        else:
            part = fp32_gemm_parts(x2, gate.contiguous(), sumsq=False)
        _route_kernel[(t,)](
            part, bias.float().contiguous(), weights, ids, e, part.stride(0), part.stride(1), float(temp), float(routed_scale),
            -1 if extra_expert is None else int(extra_expert),
            CHUNKS=part.shape[0] // steps, STEPS=steps, TOP_K=top_k, NORMALIZE=normalize and top_k > 1, EXTRA=extra_expert is not None,
            E_BLOCK=triton.next_power_of_2(e), K_BLOCK=max(2, triton.next_power_of_2(width)), num_warps=4 if e > 256 else 1, **pdl_launch(part.device),
        )
    return weights, ids


@triton.jit
def _route_v4_kernel(logit_ptr, bias_ptr, fixed_ptr, weights_ptr, ids_ptr, E, stride_l, stride_fixed, scale, extra_id,
                     TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, FIXED: tl.constexpr, EXTRA: tl.constexpr, E_BLOCK: tl.constexpr,
                     K_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One token: V4's routing from its bf16 logits, every step rounded to bf16 where the
    reference's bf16 torch ops round (softplus, sqrt, the gathered weights' sum, + 1e-20, the
    division, the scale); softplus and exp as CUDA's libm (libdevice), so the same bits as
    torch on the GPU. FIXED: the hash layers' ids (no bias, no selection)."""
    begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, E_BLOCK)
    ok = cols < E
    x = tl.load(logit_ptr + row * stride_l + cols, mask=ok, other=0.0).to(tl.float32)
    softplus = tl.where(x > 20.0, x, libdevice.log1p(libdevice.exp(x))).to(tl.bfloat16).to(tl.float32)
    score = tl.sqrt_rn(softplus).to(tl.bfloat16).to(tl.float32)
    slots = tl.arange(0, K_BLOCK)
    if FIXED:
        picked = tl.load(fixed_ptr + row * stride_fixed + slots, mask=slots < TOP_K, other=0).to(tl.int32)
        chosen = tl.sum(tl.where(cols[None, :] == picked[:, None], score[None, :], 0.0), axis=1)
    else:
        biased = tl.where(ok, score + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32), float("-inf"))
        picked, chosen = _select(score, biased, cols, slots, TOP_K, E_BLOCK, K_BLOCK)
    if NORMALIZE:
        total = tl.sum(tl.where(slots < TOP_K, chosen, 0.0), axis=0).to(tl.bfloat16).to(tl.float32)
        denom = (total + 1e-20).to(tl.bfloat16).to(tl.float32)
        chosen = tl.math.div_rn(chosen, denom).to(tl.bfloat16).to(tl.float32)
    _store_route(ids_ptr, weights_ptr, row, picked, (chosen * scale).to(tl.bfloat16).to(tl.float32), slots, extra_id, TOP_K, EXTRA)


def route_logits(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scale: float, normalize: bool,
                 fixed: torch.Tensor | None = None, extra_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`dsv4.ops.moe.route_logits` in one launch: bf16 logits [T, E] -> (weights fp32, ids
    int64), [T, k (+1)]."""
    t, e = logits.shape
    if logits.dtype != torch.bfloat16 or (fixed is None and (bias is None or bias.shape != (e,))) or not 0 < top_k <= e:
        raise ValueError(f"route_logits: logits must be bf16 [T, E], bias [E] (learned routing) and 0 < top_k <= E; got logits {logits.dtype} "
                         f"{list(logits.shape)}, bias {None if bias is None else list(bias.shape)}, top_k {top_k}")
    if fixed is not None and fixed.shape != (t, top_k):
        raise ValueError(f"route_logits: fixed ids must be [T, top_k] = [{t}, {top_k}], got {list(fixed.shape)}")
    width = top_k + (extra_expert is not None)
    weights = torch.empty(t, width, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, width, dtype=torch.int64, device=logits.device)
    if t:
        fixed_ids = fixed.contiguous() if fixed is not None else ids  # (not read without FIXED)
        _route_v4_kernel[(t,)](
            logits, logits if bias is None else bias.float().contiguous(), fixed_ids, weights, ids, e, logits.stride(0), fixed_ids.stride(0),
            float(routed_scale), -1 if extra_expert is None else int(extra_expert),
            TOP_K=top_k, NORMALIZE=normalize and top_k > 1, FIXED=fixed is not None, EXTRA=extra_expert is not None,
            E_BLOCK=triton.next_power_of_2(e), K_BLOCK=max(2, triton.next_power_of_2(width)), num_warps=4 if e > 256 else 1, **pdl_launch(logits.device),
        )
    return weights, ids
