"""Interleaved-pair RoPE on the trailing `rope_dim` channels (DeepSeek-V4 layout).

Two frequency sets: "main" (rope_theta, plain) for window-only layers and "compress"
(compress_rope_theta with YaRN, no attention-scale factor) for every layer with a compressed
branch, its compressor and its indexer.
"""

from __future__ import annotations

import torch

from dsv4.config import ModelConfig, yarn_ramp_bounds
from dsv4.ops import on_triton


def inv_freq(cfg: ModelConfig, kind: str) -> torch.Tensor:
    dim = cfg.rope_dim
    base = cfg.rope_theta if kind == "main" else cfg.compress_rope_theta
    extrapolation = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if kind == "main" or cfg.yarn is None:
        return extrapolation
    yarn = cfg.yarn
    interpolation = 1.0 / (yarn.factor * base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low, high = yarn_ramp_bounds(dim, base, yarn)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


class RopeTables:
    """cos/sin per position for both rope kinds, computed in fp32 and rounded to the
    activation dtype (the reference's rounding point)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        self.inv = {k: inv_freq(cfg, k).to(device) for k in ("main", "compress")}
        self.dtype = dtype

    def cos_sin(self, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rope_dim / 2]."""
        if on_triton(positions):  # one launch instead of six
            from dsv4.ops.triton.rowwise import rope_tables

            return rope_tables(positions, self.inv[kind], self.dtype)
        return cos_sin(positions, self.inv[kind], self.dtype)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE tables' torch code: angles position x inv_freq in fp32, their cos / sin rounded
    to `dtype` (`dsv4.ops.triton.rowwise.rope_tables` is its kernel)."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate adjacent channel pairs of the last 2*cos.shape[-1] channels of x in place and
    return x. x: [T, ..., d]; cos/sin: [T, rd/2] (broadcast over the middle axes). `inverse`
    undoes the rotation. In place because every caller rotates a fresh projection or attention
    output: the leading channels are then neither read nor written (at prefill the copy was
    most of the cost)."""
    if on_triton(x) and x.dtype == torch.bfloat16 and x.dim() in (2, 3):  # one Triton kernel instead of ~10 launches
        from dsv4.ops.triton.rowwise import apply_rope_ as kernel

        return kernel(x, cos, sin, inverse)
    rd = cos.shape[-1] * 2
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    rope = x[..., -rd:]
    even, odd = rope[..., 0::2].float(), rope[..., 1::2].float()
    rope.copy_(torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2))
    return x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`apply_rope_` on a copy of x (x is left as it is)."""
    return apply_rope_(x.clone(), cos, sin, inverse)
