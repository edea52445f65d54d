"""V4.1's router in two kernels (H200 fast path): the fp32 gate GEMM (`mhc.fp32_gemm_parts`),
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

from dsv4.ops.triton.mhc import fp32_gemm_parts


@triton.jit
def _route_kernel(part_ptr, bias_ptr, weights_ptr, ids_ptr, E, stride_part, stride_l, temp, scale, extra_id,
                  CHUNKS: tl.constexpr, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, EXTRA: tl.constexpr, E_BLOCK: tl.constexpr,
                  K_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, E_BLOCK)
    ok = cols < E
    logits = tl.zeros((E_BLOCK,), dtype=tl.float32)
    for c in tl.static_range(CHUNKS):  # the GEMM's chunk sums, in chunk order (unrolled: loads issue together)
        logits += tl.load(part_ptr + c * stride_part + row * stride_l + cols, mask=ok, other=0.0)
    x = tl.math.div_rn(logits, temp)
    e = tl.exp(x)
    log1p = tl.where(e < 1e-3, e - e * e * 0.5 + e * e * e * (1.0 / 3.0), tl.log(1.0 + e))
    score = tl.sqrt_rn(tl.where(x > 20.0, x, log1p))
    biased = tl.where(ok, score + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    slots = tl.arange(0, K_BLOCK)
    picked = tl.zeros((K_BLOCK,), dtype=tl.int32)
    chosen = tl.zeros((K_BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(biased, axis=0)
        idx = tl.min(tl.where(biased == best, cols, E_BLOCK), axis=0)
        picked = tl.where(slots == j, idx, picked)
        chosen = tl.where(slots == j, tl.sum(tl.where(cols == idx, score, 0.0), axis=0), chosen)
        biased = tl.where(cols == idx, float("-inf"), biased)
    if NORMALIZE:
        chosen = tl.math.div_rn(chosen, tl.sum(tl.where(slots < TOP_K, chosen, 0.0), axis=0) + 1e-20)
    chosen = chosen * scale
    width = TOP_K + EXTRA
    if EXTRA:
        picked = tl.where(slots == TOP_K, extra_id, picked)
        chosen = tl.where(slots == TOP_K, 1.0, chosen)
    tl.store(ids_ptr + row * width + slots, picked.to(tl.int64), mask=slots < width)
    tl.store(weights_ptr + row * width + slots, chosen, mask=slots < width)


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
        part = fp32_gemm_parts(x if x.stride(-1) == 1 else x.contiguous(), gate.contiguous(), sumsq=False)
        _route_kernel[(t,)](
            part, bias.float().contiguous(), weights, ids, e, part.stride(0), part.stride(1), float(temp), float(routed_scale),
            -1 if extra_expert is None else int(extra_expert),
            CHUNKS=part.shape[0], TOP_K=top_k, NORMALIZE=normalize and top_k > 1, EXTRA=extra_expert is not None,
            E_BLOCK=triton.next_power_of_2(e), K_BLOCK=max(2, triton.next_power_of_2(width)), num_warps=4 if e > 256 else 1,
        )
    return weights, ids
