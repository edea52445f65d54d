"""Sparse MQA attention of the fast path: one softmax per query over its window keys (the ring
below the step's first position, the step's own keys from there on) and its selected
compressed entries (paged), with the per-head sink in the denominator; K = V. The caches come
in V4.1's formats (FP8 ring, FP4 compressed KV) or V4's (both bf16 values, no scales).

`sparse_attention` runs the Triton kernel (dsv4.ops.triton.attention, whose docstring gives
the layouts) on CUDA bf16 tensors and the torch reference elsewhere (CPU runs of the fast
path, and the kernel's test oracle). Same signature, same numerics: logits rounded to the
activation dtype, fp32 softmax, probabilities rounded before multiplying V.

`latent_inputs` and `rope_queries_` prepare its inputs: the fast path's norms, rotations and
fake quantisations of q, kv and the indexer's queries, two launches a layer on Triton
(`dsv4.ops.triton.rowwise`) where the separate ops took five to seven; elsewhere those ops.
"""

from __future__ import annotations

import torch

from dsv4.cache.storage import CKV_BLOCK, FP8_BLOCK, QTensor
from dsv4.model import quant
from dsv4.ops import on_triton
from dsv4.ops import kv as kvops
from dsv4.ops.norm import rms_norm
from dsv4.ops.rope import apply_rope_


def latent_inputs(qkv: torch.Tensor, q_width: int, q_norm: torch.Tensor, kv_norm: torch.Tensor, eps: float, weight_in_fp32: bool,
                  cos: torch.Tensor, sin: torch.Tensor, ring: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked wq_a + wkv output qkv [T, q_width + D] -> (q_res, kv): each part RMS-normed,
    kv then RoPE'd (cos / sin [T, rd/2]) and rounded as `ring` stores it (the window's QAT)."""
    if on_triton(qkv) and qkv.dtype == torch.bfloat16 and qkv.dim() == 2:
        from dsv4.ops.triton.rowwise import latent_inputs as kernel

        return kernel(qkv, q_width, q_norm, kv_norm, eps, weight_in_fp32, cos, sin, ring.quantized)
    q_a, kv = qkv.split([q_width, qkv.shape[-1] - q_width], dim=-1)
    kv = apply_rope_(rms_norm(kv, kv_norm, eps, weight_in_fp32), cos, sin)
    return rms_norm(q_a, q_norm, eps, weight_in_fp32), kvops.round_trip(ring, kv, "window")


def rope_queries_(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, idx_q: torch.Tensor | None = None,
                  idx_cos: torch.Tensor | None = None, idx_sin: torch.Tensor | None = None, idx_keys: QTensor | None = None) -> None:
    """In place: q [T, H, D] RoPE'd by cos / sin; the indexer's queries idx_q [T, IH, ID] (if
    given) by their own angles, then rounded as its keys `idx_keys` (if given) are stored (the
    FP4 QAT)."""
    if on_triton(q) and q.dtype == torch.bfloat16 and q.dim() == 3 and (idx_q is None or idx_q.dtype == q.dtype):
        from dsv4.ops.triton.rowwise import rope_queries_ as kernel

        kernel(q, cos, sin, idx_q, idx_cos, idx_sin, idx_keys is not None and idx_keys.quantized)
        return
    apply_rope_(q, cos, sin)
    if idx_q is not None:
        apply_rope_(idx_q, idx_cos, idx_sin)
        if idx_keys is not None:
            idx_q.copy_(kvops.round_trip(idx_keys, idx_q, "idx"))


def sparse_attention(q, kv_new, ring_codes, ring_scales, ckv_codes, ckv_scales, topk, token_req, positions, start_pos, row_start, slots, floors, block_tables, sink, softmax_scale: float,
                     inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None, fp8_output: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] (after RoPE); kv_new [T, D] this step's window keys (rounded as the ring stores them); ring
    FP8 codes [S, W, D] + ue8m0 bytes [S, W, D/32]; compressed KV packed FP4 [NB, P, D/2] +
    E4M3 scales [NB, P, D/16] — or, for V4's caches in the compute dtype, the values [S, W, D]
    / [NB, P, D] with scales None (each cache independently);
    topk [T, k] selected entries (-1 = none; k may be 0; V4's HCA layers: every visible entry);
    token_req [T]; positions [T]; per request: start_pos, row_start (first row), slots,
    floors (window keys below are invisible); block_tables [B, max_blocks]; sink fp32 [H];
    inverse_rope: None, or the (cos, sin) [T, rd/2] the queries were rotated by, to rotate the
    output's trailing rd channels back (`apply_rope_(out, cos, sin, inverse=True)`; the kernel
    does it in its epilogue). fp8_output: the output as an FP8 projection's input instead —
    (float8_e4m3fn codes [T, H, D], exponent bytes [T, H * D / ACT_BLOCK]), the output quantised
    per ACT_BLOCK channels (`quant.quantize_fp8_ue8m0`; the kernel in its epilogue).
    -> [T, H, D] in q's dtype (or the pair above)."""
    if on_triton(q) and q.dtype == torch.bfloat16:
        from dsv4.ops.triton.attention import sparse_attention as kernel

        return kernel(q, kv_new, ring_codes, ring_scales, ckv_codes, ckv_scales, topk, token_req, positions, start_pos, row_start, slots, floors, block_tables, sink, softmax_scale,
                      inverse_rope, fp8_output)
    return sparse_attention_reference(q, kv_new, ring_codes, ring_scales, ckv_codes, ckv_scales, topk, token_req, positions, start_pos, row_start, slots, floors, block_tables, sink, softmax_scale,
                                      inverse_rope, fp8_output)


def sparse_attention_reference(
    q: torch.Tensor,
    kv_new: torch.Tensor,
    ring_codes: torch.Tensor,
    ring_scales: torch.Tensor,
    ckv_codes: torch.Tensor,
    ckv_scales: torch.Tensor,
    topk: torch.Tensor,
    token_req: torch.Tensor,
    positions: torch.Tensor,
    start_pos: torch.Tensor,
    row_start: torch.Tensor,
    slots: torch.Tensor,
    floors: torch.Tensor,
    block_tables: torch.Tensor,
    sink: torch.Tensor,
    softmax_scale: float,
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8_output: bool = False,
    chunk: int = 256,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `sparse_attention` (same signature; `chunk` bounds the gathered keys'
    memory): gathers and dequantises every key a query may see, then computes the softmax of
    `Attention._attend` — bf16 logits, fp32 softmax with the sink column, bf16 probabilities."""
    t, h, dim = q.shape
    window, per_block = ring_codes.shape[1], ckv_codes.shape[1]
    out = torch.empty(t, h, dim, dtype=q.dtype, device=q.device)
    offs = torch.arange(window, device=q.device)
    for c0 in range(0, t, chunk):
        rows = slice(c0, min(c0 + chunk, t))
        req = token_req[rows].long()
        pos = positions[rows].long()
        start, row0 = start_pos.long()[req], row_start.long()[req]
        kpos = pos[:, None] - (window - 1) + offs  # [n, W]
        valid = kpos >= floors.long()[req].clamp_min(0)[:, None]
        in_ring = valid & (kpos < start[:, None])
        ring_idx = (slots.long()[req][:, None], kpos.clamp_min(0) % window)
        if ring_scales is None:
            ring = ring_codes[ring_idx].to(q.dtype)
        else:
            ring = quant.dequantize_fp8_ue8m0(ring_codes[ring_idx], ring_scales.view(torch.uint8)[ring_idx], q.dtype, FP8_BLOCK)
        new_row = (row0[:, None] + kpos - start[:, None]).clamp(0, t - 1)
        keys = torch.where(in_ring[..., None], ring, kv_new[new_row])
        entries = topk[rows].long()
        if entries.shape[1]:
            safe = entries.clamp_min(0)
            blocks = block_tables.long()[req[:, None], safe // per_block]
            loc = (blocks, safe % per_block)
            if ckv_scales is None:
                comp = ckv_codes[loc].to(q.dtype)
            else:
                comp = quant.dequantize_fp4(ckv_codes[loc], ckv_scales[loc], q.dtype, CKV_BLOCK)
            keys = torch.cat([keys, comp], dim=1)
            valid = torch.cat([valid, entries >= 0], dim=1)
        keys = keys.masked_fill(~valid[..., None], 0)  # unwritten cache bytes may decode to NaN
        logits = (torch.einsum("nhd,nkd->nhk", q[rows], keys) * softmax_scale).float()
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        sinks = sink.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1].to(q.dtype)
        out[rows] = torch.einsum("nhk,nkd->nhd", probs, keys)
    if inverse_rope is not None:
        apply_rope_(out, *inverse_rope, inverse=True)
    if fp8_output:
        codes, exps = quant.quantize_fp8_ue8m0(out.reshape(t, h * dim), quant.ACT_BLOCK)
        return codes.view(t, h, dim), exps
    return out
