"""RMSNorm in the two roundings the references use."""

import torch

from dsv4.ops import on_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool) -> torch.Tensor:
    """Statistics in fp32. V4.1 (`weight_in_fp32=False`) rounds the normalised value to the
    activation dtype first and multiplies by the weight there; V4 multiplies in fp32 and rounds
    once (its reference keeps norm weights in fp32)."""
    if on_triton(x) and x.dtype == torch.bfloat16:  # one Triton kernel instead of ~7 launches
        from dsv4.ops.triton.rowwise import rms_norm as kernel

        return kernel(x, weight, eps, weight_in_fp32)
    h = x.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        return (weight.float() * normed).to(x.dtype)
    return weight.to(x.dtype) * normed.to(x.dtype)


def head_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """V4's unweighted RMS norm of each query head (the last axis): x times rsqrt(mean(x^2) +
    eps), the scale rounded to x's dtype before the multiply (its reference's order, unlike
    `rms_norm`). One Triton kernel on CUDA for bf16 instead of six launches."""
    if on_triton(x) and x.dtype == torch.bfloat16:
        from dsv4.ops.triton.rowwise import rms_norm as kernel

        return kernel(x, None, eps, False)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
