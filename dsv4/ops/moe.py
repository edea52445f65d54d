"""Mixture of experts: router and the routed + shared SwiGLU experts.

Reference implementation: loop over the experts that received tokens, in ascending expert id
(the order the references accumulate in)."""

from __future__ import annotations

import torch

from dsv4.ops import elementwise, on_triton
from dsv4.ops.linear import linear_fp32


def sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    return elementwise.softplus(x).sqrt()


def route(scores: torch.Tensor, bias: torch.Tensor | None, top_k: int, fixed: torch.Tensor | None, routed_scale: float, normalize: bool):
    """scores [T, E] (sqrtsoftplus of the router logits). Selection is the top-k of
    scores + bias (the bias only selects), or the fixed `tid2eid` rows of hash layers; weights
    are the unbiased scores of the selection, normalised (+1e-20) and scaled."""
    if fixed is not None:
        indices = fixed
    else:
        indices = (scores + bias).topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if normalize and indices.shape[1] > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scale, indices


def route_scores(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, top_k: int, temp: float, routed_scale: float, normalize: bool,
                 extra_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """V4.1's learned routing of hidden states x [T, D] by the fp32 gate [E, D] -> (weights
    fp32, ids int64), [T, k] or with `extra_expert` appended to every token at weight 1,
    [T, k + 1]: logits x @ gate^T in fp32, scores sqrtsoftplus(logits / temp), selection by
    `route`. Two Triton kernels on the GPU for bf16 x (`dsv4.ops.triton.router`)."""
    if on_triton(x) and x.dtype == torch.bfloat16:
        from dsv4.ops.triton import router

        return router.route_scores(x, gate, bias, top_k, temp, routed_scale, normalize, extra_expert)
    return _with_extra(*route(sqrtsoftplus(linear_fp32(x, gate) / temp), bias, top_k, None, routed_scale, normalize), extra_expert)


def _with_extra(weights: torch.Tensor, indices: torch.Tensor, extra_expert: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`route`'s result as fp32 weights, `extra_expert` (if any) appended to every token at weight 1."""
    weights = weights.float()
    if extra_expert is not None:
        indices = torch.cat([indices, torch.full_like(indices[:, :1], extra_expert)], dim=1)
        weights = torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1)
    return weights, indices


def route_logits(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scale: float, normalize: bool,
                 fixed: torch.Tensor | None = None, extra_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """V4's routing from its router logits [T, E] in the activation dtype -> (weights fp32,
    ids int64), [T, k] or with `extra_expert` appended at weight 1, [T, k + 1]: scores
    sqrtsoftplus(logits) and the rest of `route` in the logits' dtype (the hash layers' fixed
    ids [T, k] in place of the selection). One Triton kernel on the GPU for bf16 logits."""
    if on_triton(logits) and logits.dtype == torch.bfloat16:
        from dsv4.ops.triton import router

        return router.route_logits(logits, bias, top_k, routed_scale, normalize, fixed, extra_expert)
    return _with_extra(*route(sqrtsoftplus(logits), bias, top_k, fixed, routed_scale, normalize), extra_expert)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU in fp32: up clamped to [-limit, limit], gate to <= limit."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return elementwise.silu(gate) * up


def experts_forward(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, w1: list, w2: list, w3: list, limit: float, weight_before_down: bool) -> torch.Tensor:
    """Routed experts. V4.1 (`weight_before_down`) scales the activation by the routing weight
    before w2 and accumulates in fp32; V4 scales w2's output and accumulates in the
    activation dtype. Returns fp32 (V4.1) or x.dtype (V4)."""
    dtype = x.dtype
    out = torch.zeros(x.shape, dtype=torch.float32 if weight_before_down else dtype, device=x.device)
    # (token, slot) pairs grouped by expert with one stable sort (tokens ascending inside an
    # expert) and one host read of the counts, rather than a scan and a read per expert
    flat = indices.flatten()
    pairs = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(w1)).tolist()
    first = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pair = pairs[first : first + count]
        first += count
        token, slot = pair // indices.shape[1], pair % indices.shape[1]
        xe = x[token]
        act = swiglu(w1[e](xe), w3[e](xe), limit)
        w = weights[token, slot, None]
        if weight_before_down:
            out.index_add_(0, token, w2[e]((w * act).to(dtype)).float())
        else:
            out.index_add_(0, token, (w2[e](act.to(dtype)) * w).to(dtype))
    return out
