"""Manifold-constrained hyper-connections: mixes (with Sinkhorn), collapse and expand.

Streams are [T, hc, D]; every mix is computed in fp32. These are the torch references; CUDA bf16
streams with a power-of-two hc go to the fused Triton kernels (`dsv4.ops.triton.mhc`: fp32
rounding-level agreement, batch invariant, no host syncs), everything else stays here."""

from __future__ import annotations

import torch

from dsv4.ops import elementwise, on_triton
from dsv4.ops.linear import linear
from dsv4.ops.norm import rms_norm


def _fused(x: torch.Tensor) -> bool:
    """Whether streams x [T, hc, D] take the Triton kernels."""
    hc = x.shape[1]
    return on_triton(x) and x.dtype == torch.bfloat16 and hc & (hc - 1) == 0


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """-> pre [T, hc], post [T, hc], comb [T, hc, hc] (comb[j, k]: weight of input stream j in
    output stream k, doubly stochastic after Sinkhorn)."""
    _check_streams("hc_mixes", x, hc=hc)
    if fn.shape != (((2 + hc) * hc), hc * x.shape[2]) or base.shape != (fn.shape[0],) or scale.numel() != 3:
        raise ValueError(f"hc_mixes: fn must be [{(2 + hc) * hc}, {hc * x.shape[2]}], base [{(2 + hc) * hc}], scale [3]; got {list(fn.shape)}, {list(base.shape)}, {list(scale.shape)}")
    if iters < 1:
        raise ValueError(f"hc_mixes: iters (Sinkhorn iterations) must be >= 1, got {iters}")
    if _fused(x):
        from dsv4.ops.triton import mhc as triton_mhc

        return triton_mhc.hc_mixes(x, fn.float(), base.float(), scale.float(), hc, iters, hc_eps, norm_eps)
    return hc_mixes_reference(x, fn, base, scale, hc, iters, hc_eps, norm_eps)


def hc_mixes_reference(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """The torch computation of `hc_mixes` on any device (the kernels' oracle)."""
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


def hc_mixes_fp64(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """`hc_mixes`' math in fp64 with plain torch ops: the accuracy yardstick for both fp32
    implementations (the reference above and the Triton kernels), in the tests and on the
    device (scripts/check_kernels.py)."""
    flat = x.flatten(1).double()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    m = flat @ fn.double().T
    base, scale = base.double(), scale.double()
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = torch.softmax((m[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(-1, hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def _check_streams(name: str, x: torch.Tensor, hc: int | None = None, **mixes: torch.Tensor) -> None:
    """x must be [T, hc, D]; each named mix [T, hc] (post, pre) or [T, hc, hc] (comb)."""
    if x.dim() != 3 or (hc is not None and x.shape[1] != hc):
        raise ValueError(f"{name}: streams must be [T, hc{'=' + str(hc) if hc is not None else ''}, D], got {list(x.shape)}")
    t, h = x.shape[:2]
    for what, m in mixes.items():
        want = (t, h, h) if what == "comb" else (t, h)
        if tuple(m.shape) != want:
            raise ValueError(f"{name}: {what} must be {list(want)} for streams {list(x.shape)}, got {list(m.shape)}")


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    _check_streams("hc_collapse", x, pre=pre)
    if _fused(x):
        from dsv4.ops.triton import mhc as triton_mhc

        return triton_mhc.hc_collapse(x, pre.float())
    return hc_collapse_reference(x, pre)


def hc_collapse_reference(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """The torch computation of `hc_collapse` on any device (the kernels' oracle)."""
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


def hc_collapse_norm(x: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool) -> torch.Tensor:
    """`rms_norm(hc_collapse(x, pre), weight, eps, weight_in_fp32)`; one kernel on CUDA."""
    _check_streams("hc_collapse_norm", x, pre=pre)
    if tuple(weight.shape) != (x.shape[2],):
        raise ValueError(f"hc_collapse_norm: weight must be [{x.shape[2]}] (the stream width), got {list(weight.shape)}")
    if _fused(x):
        from dsv4.ops.triton import mhc as triton_mhc

        return triton_mhc.hc_collapse_norm(x, pre.float(), weight, eps, weight_in_fp32)
    return rms_norm(hc_collapse_reference(x, pre), weight, eps, weight_in_fp32)


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fp32: bool) -> torch.Tensor:
    """out_k = post_k * y + sum_j comb[j, k] * residual_j. V4.1 computes in fp32 and rounds
    once (`fp32=True`); V4 computes in the activation dtype."""
    _check_streams("hc_expand", residual, post=post, comb=comb)
    if tuple(y.shape) != (residual.shape[0], residual.shape[2]):
        raise ValueError(f"hc_expand: y must be [{residual.shape[0]}, {residual.shape[2]}] for streams {list(residual.shape)}, got {list(y.shape)}")
    if _fused(residual):
        from dsv4.ops.triton import mhc as triton_mhc

        return triton_mhc.hc_expand(y, residual, post.float(), comb.float(), fp32)
    return hc_expand_reference(y, residual, post, comb, fp32)


def hc_expand_collapse_norm(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
                            weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """V4.1 after a sublayer: streams = `hc_expand(y, residual, post, comb, fp32=True)` and the
    next site's input `hc_collapse_norm(streams, pre, weight, eps, weight_in_fp32=False)` ->
    (streams, h); one kernel on CUDA."""
    _check_streams("hc_expand_collapse_norm", residual, post=post, comb=comb, pre=pre)
    if tuple(y.shape) != (residual.shape[0], residual.shape[2]) or tuple(weight.shape) != (residual.shape[2],):
        raise ValueError(f"hc_expand_collapse_norm: y must be [{residual.shape[0]}, {residual.shape[2]}] and weight [{residual.shape[2]}] for "
                         f"streams {list(residual.shape)}, got {list(y.shape)} / {list(weight.shape)}")
    if _fused(residual):
        from dsv4.ops.triton import mhc as triton_mhc

        return triton_mhc.hc_expand_collapse_norm(y, residual, post.float(), comb.float(), pre.float(), weight, eps)
    streams = hc_expand_reference(y, residual, post, comb, True)
    return streams, rms_norm(hc_collapse_reference(streams, pre), weight, eps, False)


def hc_expand_reference(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fp32: bool) -> torch.Tensor:
    """The torch computation of `hc_expand` on any device (the kernels' oracle)."""
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
