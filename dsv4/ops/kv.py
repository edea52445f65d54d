"""Cache reads and writes in the stored formats (window ring and paged compressed entries).

Writes quantise (V4.1) or cast (V4) into the cache; reads dequantise to the compute dtype.
The quantise-then-dequantise round trip is exactly the reference's fake quantisation."""

from __future__ import annotations

import torch

from dsv4.cache.storage import CKV_BLOCK, FP8_BLOCK, IDX_BLOCK, QTensor
from dsv4.model import quant
from dsv4.ops import on_triton


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
    """What reading `x` back from this cache would give (the fake quantisation). CUDA bf16 /
    fp32 x: one Triton launch (`dsv4.ops.triton.kv.round_trip`, the same bits, graph-safe)."""
    if not q.quantized:
        return x
    if on_triton(x) and x.dtype in (torch.bfloat16, torch.float32):
        from dsv4.ops.triton import kv as triton_kv

        return triton_kv.round_trip(kind, x)
    return decode(q, *encode(q, x, kind), kind, x.dtype)


def store(q: QTensor, index: tuple, x: torch.Tensor, kind: str) -> None:
    codes, scales = encode(q, x, kind)
    if q.quantized:
        q.codes[index] = codes
        q.scales[index] = scales
    else:
        q.values[index] = codes


_FORMATS = {  # kind -> (codes dtype, channels per code, scales dtype, channels per scale)
    "window": (torch.float8_e4m3fn, 1, torch.uint8, FP8_BLOCK),
    "ckv": (torch.uint8, 2, torch.float8_e4m3fn, CKV_BLOCK),
    "idx": (torch.uint8, 2, torch.uint8, IDX_BLOCK),
}


def _check_rows(name: str, targets: list[tuple[str, torch.Tensor]], index, x: torch.Tensor, mask: torch.Tensor) -> None:
    """Shapes, dtypes and devices of a masked store (ValueError naming the argument)."""
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [T, D], got shape {list(x.shape)}")
    t = x.shape[0]
    if mask.dtype != torch.bool or tuple(mask.shape) != (t,):
        raise ValueError(f"{name}: mask must be bool [{t}] (one per row of x), got {mask.dtype} {list(mask.shape)}")
    if not isinstance(index, (tuple, list)) or len(index) != 2:
        raise ValueError(f"{name}: index must be a pair (i0, i1) of [T] integer tensors, got {type(index).__name__}")
    for i, ix in enumerate(index):
        if not isinstance(ix, torch.Tensor) or ix.dtype not in (torch.int32, torch.int64) or tuple(ix.shape) != (t,):
            got = f"{ix.dtype} {list(ix.shape)}" if isinstance(ix, torch.Tensor) else type(ix).__name__
            raise ValueError(f"{name}: index[{i}] must be int32/int64 [{t}], got {got}")
    lead = targets[0][1].shape[:2]
    for what, dst in targets:
        if dst.dim() != 3 or dst.shape[:2] != lead or dst.stride(-1) != 1:
            raise ValueError(f"{name}: {what} must be [S, R, width] with last stride 1 (leading dims {list(lead)}), got {list(dst.shape)} strides {dst.stride()}")
    for what, ten in [("x", x), ("mask", mask), ("index[0]", index[0]), ("index[1]", index[1])] + targets[1:]:
        if ten.device != targets[0][1].device:
            raise ValueError(f"{name}: {what} is on {ten.device}, the cache on {targets[0][1].device}")


def store_rows(q: QTensor, kind: str, x: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> None:
    """Masked `store`: for every row t with mask[t], `encode(x[t])` goes to q[index[0][t],
    index[1][t]] (the same bytes `store` writes); rows with mask False write nothing, whatever
    their index holds. Graph-safe on CUDA (one Triton launch, no host sync, `dsv4.ops.triton.kv`);
    on CPU the torch reference. Valid rows must name distinct locations; their negative indices
    count from the end (as torch's); an out-of-range one raises IndexError on CPU and is
    dropped on CUDA (a graph cannot raise)."""
    if kind not in _FORMATS:
        raise ValueError(f"store_rows: kind must be one of {list(_FORMATS)}, got {kind!r}")
    if q.quantized:
        codes_dtype, per_code, scales_dtype, block = _FORMATS[kind]
        width = q.codes.shape[-1] * per_code
        if q.codes.dtype != codes_dtype or q.scales.dtype != scales_dtype:
            raise ValueError(f"store_rows: a {kind!r} cache holds {codes_dtype} codes and {scales_dtype} scales, got {q.codes.dtype} and {q.scales.dtype}")
        if q.scales.shape[-1] * block != width:
            raise ValueError(f"store_rows: {kind!r} scales must have {width // block} per entry (one per {block} channels), got {q.scales.shape[-1]}")
        targets = [("q.codes", q.codes), ("q.scales", q.scales)]
    else:
        width = q.values.shape[-1]
        targets = [("q.values", q.values)]
    _check_rows("store_rows", targets, index, x, mask)
    if x.shape[1] != width:
        raise ValueError(f"store_rows: x must have the cache's width {width}, got [{x.shape[0]}, {x.shape[1]}]")
    if on_triton(x):
        from dsv4.ops.triton import kv as triton_kv

        triton_kv.store_rows(q, kind, x, index, mask)
        return
    store(q, (index[0][mask], index[1][mask]), x[mask], kind)


def store_plain(dst: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, mask: torch.Tensor) -> None:
    """dst [S, R, D] (e.g. fp32 compressor tails): dst[index[0][t], index[1][t]] = x[t] (cast
    to dst's dtype) for every row t with mask[t]; other rows write nothing. Graph-safe on CUDA."""
    _check_rows("store_plain", [("dst", dst)], index, x, mask)
    if x.shape[1] != dst.shape[-1]:
        raise ValueError(f"store_plain: x must be [T, {dst.shape[-1]}] (dst's width), got {list(x.shape)}")
    if on_triton(x):
        from dsv4.ops.triton import kv as triton_kv

        triton_kv.store_plain(dst, index, x, mask)
        return
    dst[index[0][mask], index[1][mask]] = x[mask].to(dst.dtype)


def load(q: QTensor, index: tuple, kind: str, dtype: torch.dtype) -> torch.Tensor:
    if q.quantized:
        return decode(q, q.codes[index], q.scales[index], kind, dtype)
    return q.values[index].to(dtype)


def entry_locations(block_table: torch.Tensor, entries: torch.Tensor, ratio: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed entry j of a request (standing for tokens j*r .. j*r+r-1) lives in logical
    block j*r // block_size, at offset j % (block_size / r)."""
    per_block = block_size // ratio
    return block_table[entries // per_block], entries % per_block
