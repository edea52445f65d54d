"""Cache reads and writes in the stored formats (window ring and paged compressed entries).

Writes quantise (V4.1) or cast (V4) into the cache; reads dequantise to the compute dtype.
The quantise-then-dequantise round trip is exactly the reference's fake quantisation."""

from __future__ import annotations

import torch

from dsv4.cache.storage import CKV_BLOCK, FP8_BLOCK, IDX_BLOCK, QTensor
from dsv4.model import quant


def encode(q: QTensor, x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Values -> what the cache tensor stores (codes, scales) or (values, None)."""
    if not q.quantized:
        return x.to(q.values.dtype), None
    if kind == "window":
        return quant.quantize_fp8_ue8m0(x, FP8_BLOCK)
    if kind == "ckv":
        return quant.quantize_fp4(x, CKV_BLOCK, e4m3_scale=True)
    return quant.quantize_fp4(x, IDX_BLOCK, e4m3_scale=False)


def decode(q: QTensor, codes: torch.Tensor, scales: torch.Tensor | None, kind: str, dtype: torch.dtype) -> torch.Tensor:
    if not q.quantized:
        return codes.to(dtype)
    if kind == "window":
        return quant.dequantize_fp8_ue8m0(codes, scales, dtype, FP8_BLOCK)
    if kind == "ckv":
        return quant.dequantize_fp4(codes, scales, dtype, CKV_BLOCK)
    return quant.dequantize_fp4(codes, scales, dtype, IDX_BLOCK)


def round_trip(q: QTensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    """What reading `x` back from this cache would give (the fake quantisation)."""
    if not q.quantized:
        return x
    return decode(q, *encode(q, x, kind), kind, x.dtype)


def store(q: QTensor, index: tuple, x: torch.Tensor, kind: str) -> None:
    codes, scales = encode(q, x, kind)
    if q.quantized:
        q.codes[index] = codes
        q.scales[index] = scales
    else:
        q.values[index] = codes


def load(q: QTensor, index: tuple, kind: str, dtype: torch.dtype) -> torch.Tensor:
    if q.quantized:
        return decode(q, q.codes[index], q.scales[index], kind, dtype)
    return q.values[index].to(dtype)


def entry_locations(block_table: torch.Tensor, entries: torch.Tensor, ratio: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed entry j of a request (standing for tokens j*r .. j*r+r-1) lives in logical
    block j*r // block_size, at offset j % (block_size / r)."""
    per_block = block_size // ratio
    return block_table[entries // per_block], entries % per_block
