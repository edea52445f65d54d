"""Manifold-constrained hyper-connections: mixes (with Sinkhorn), collapse and expand.

Streams are [T, hc, D]; every mix is computed in fp32."""

from __future__ import annotations

import torch

from dsv4.ops import elementwise
from dsv4.ops.linear import linear


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """-> pre [T, hc], post [T, hc], comb [T, hc, hc] (comb[j, k]: weight of input stream j in
    output stream k, doubly stochastic after Sinkhorn)."""
    flat = x.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    m = linear(flat, fn.float())
    pre = elementwise.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * elementwise.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(-1, hc, hc)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fp32: bool) -> torch.Tensor:
    """out_k = post_k * y + sum_j comb[j, k] * residual_j. V4.1 computes in fp32 and rounds
    once (`fp32=True`); V4 computes in the activation dtype."""
    if fp32:
        mixed = torch.einsum("tjk,tjd->tkd", comb, residual.float())
        return (post.unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(residual.dtype)
    dtype = residual.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), residual)
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(1) + mixed


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """V4's final collapse: sigmoid weights from the normalised streams, no Sinkhorn."""
    flat = x.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = elementwise.sigmoid(linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
