"""Transcendental elementwise functions whose result for an element does not depend on where
the element sits in the tensor.

PyTorch's CPU kernels run whole SIMD vectors through a vectorised approximation and the
remainder through a scalar one, which rounds differently; so silu(x)[i] can change with the
tensor's length. Padding to a multiple of every vector width keeps every element on the
vectorised path: a request's results stay bitwise the same alone or batched."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_WIDTH = 64


def _uniform(fn, x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    pad = -flat.numel() % _WIDTH
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return fn(flat)[: x.numel()].view(x.shape)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _uniform(F.silu, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _uniform(torch.sigmoid, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return _uniform(F.softplus, x)
